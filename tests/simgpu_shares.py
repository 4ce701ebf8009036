"""Shares of a simulated GPU's time, read from simgpu's record of whose work ran when
(`Node.busy`) in its own clock: what every tier's compute tests measure by, so a loaded host
shifts when work runs, not how the GPU's time was split."""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence

from vgpu_plugin.sim.simgpu import Node, Span

MS = 1_000_000


def timeline(
    node: Node, pids: list[int], t0: int, t1: int, step: int, gpu: int = 0
) -> list[dict[int, int]]:
    """Per `step` ns of simgpu's clock in [t0, t1), each pid's GPU time there."""
    out = []
    for t in range(t0, t1, step):
        got = node.busy(gpu, t, t + step)
        out.append({p: got.get(p, 0) for p in pids})
    return out


def first_ran(node: Node, pid: int, t0: int, t1: int, gpu: int = 0) -> int:
    """When (simgpu's clock, to 5 ms) `pid`'s work first ran in [t0, t1)."""
    step = 5 * MS
    fine = timeline(node, [pid], t0, t1, step, gpu)
    return t0 + next(i for i, s in enumerate(fine) if s[pid] > 0) * step


def settle_ns() -> int:
    """How long after all started a guaranteed container's pacing is taken to have settled:
    1.5 s; with a driver that samples (SIMGPU_UTIL_PERIOD_MS, as the test's processes get it)
    up to three periods more (the first period the processes started in is measured only
    partly, and the shim uses a window only if it began after its last change)."""
    return 1500 * MS + 3 * int(os.environ.get("SIMGPU_UTIL_PERIOD_MS") or 0) * MS


def all_running(node: Node, pids: list[int], t0: int, t1: int, gpu: int = 0) -> tuple[int, int]:
    """The span of simgpu time, in 50 ms steps, from the first step in which every pid's work
    ran to the last: the part of the run in which all of them were launching."""
    span = _all_ran(node, pids, t0, t1, gpu)
    assert span, (pids, t0, t1)
    return span


def _all_ran(node: Node, pids: list[int], t0: int, t1: int, gpu: int) -> tuple[int, int] | None:
    step = 50 * MS
    t0 = max(t0, node.recorded_since(gpu))
    steps = timeline(node, pids, t0, t1, step, gpu)
    both = [i for i, s in enumerate(steps) if all(s[p] > 0 for p in pids)]
    return (t0 + both[0] * step, t0 + (both[-1] + 1) * step) if both else None


def waiting_ns(spans: Sequence[Span], pid: int, a: int, b: int) -> int:
    """How long in [a, b) `pid` had work on the GPU, queued or running (Node.spans: from each
    span's queueing to its end): the time it was asking the GPU for time."""
    return sum(hi - lo for lo, hi in _waited(spans, {pid}, a, b))


def shares(node: Node, pids: list[int], a: int, b: int, gpu: int = 0) -> list[float]:
    """Each pid's GPU time in [a, b] of simgpu's clock, in percent of that span."""
    got = node.busy(gpu, a, b)
    return [100.0 * got.get(p, 0) / (b - a) for p in pids]


BUSY_STEP = 50 * MS

# Whose shares are asked for: each a pid, or a container's pids together (busy_steps).
Parties = Sequence[int | Sequence[int]]


def busy_steps(node: Node, parties: Parties, a: int, b: int, gpu: int = 0) -> list[list[int]]:
    """Each party's GPU time per 50 ms step of simgpu's clock in [a, b), in the steps in which
    every party's work ran, less the steps next to one in which some party's did not. A party
    is a pid, or a container's pids together (busy in a step where any of them ran: three
    processes paced to 25 % between them each run a 4 ms kernel only every ~50 ms).

    A launcher the loaded host does not schedule for longer than its claim (its queued work,
    plus one 40 ms window: docs/compute.md, Lending) is idle as the pacing sees it: its share
    is rightly lent, and it catches up only its bucket (40 ms of credit) once it runs again.
    Over the whole run that lowers its share by however long the host starved it, which is
    the host's doing, not the pacing's. A paced launcher has work on the GPU every few ms
    (4 ms kernels at 25 %: one every ~16 ms), so a step without its work is one it was not
    launching in; the steps beside it hold the way into and out of that (its last queued
    kernels, the others' lent time, its catch-up). What is left is the time in which all of
    them were busy: what a share is promised over."""
    return [per for _, per in _kept_steps(node, parties, a, b, gpu)]


def _kept_steps(
    node: Node, parties: Parties, a: int, b: int, gpu: int
) -> list[tuple[int, list[int]]]:
    """busy_steps, each with where it starts."""
    groups = _groups(parties)
    steps = timeline(node, _pids(parties), a, b, BUSY_STEP, gpu)
    per = [[sum(s[p] for p in g) for g in groups] for s in steps]
    idle = [any(t == 0 for t in s) for s in per]
    keep = [i for i in range(len(per)) if not any(idle[max(0, i - 1) : i + 2])]
    return [(a + i * BUSY_STEP, per[i]) for i in keep]


def busy_split(
    node: Node,
    parties: Parties,
    a: int,
    b: int,
    gpu: int = 0,
    least: int = 1000 * MS,
) -> tuple[list[float], list[float]]:
    """Over busy_steps: each party's part of their GPU time together, and each party's share
    of the GPU, in percent; at least `least` ns of such steps (else the host starved them so
    much that nothing is measured)."""
    steps = busy_steps(node, parties, a, b, gpu)
    assert len(steps) * BUSY_STEP >= least, (len(steps), (b - a) // BUSY_STEP)
    got = [sum(s[i] for s in steps) for i in range(len(parties))]
    span = len(steps) * BUSY_STEP
    return [100.0 * g / sum(got) for g in got], [100.0 * g / span for g in got]


# A launcher that waits on each kernel queues the next this long after the last one ends at
# most when the host runs it (simgpu's clock): a gap no longer than this is part of asking.
TURNAROUND = 1 * MS


def waited_split(
    node: Node,
    parties: Parties,
    a: int,
    b: int,
    gpu: int = 0,
    least: int = 1000 * MS,
) -> list[float]:
    """Over busy_steps, within the time the first party waited on the GPU (work queued or
    running, gaps up to TURNAROUND bridged: waiting_ns), each party's GPU time there in
    percent of it: the share the first party got of the time it asked for, and what the
    others took of it meanwhile.

    A launcher the loaded host does not run between its kernels is not asking then, and what
    the others ran meanwhile was idle time rightly lent (docs/compute.md, Lending): busy_split
    counts that against it (at load 15 a 75 % neighbour fell to 63.4 % of its steps), this
    does not. Nor does it count the others' work that was queued before a stretch of asking
    began and ran into it (simgpu runs queued work in order: lent time that was already handed
    out); that time leaves the whole. At least `least` ns of such time."""
    groups = _groups(parties)
    spans = node.spans(gpu, a, b)
    first = set(groups[0])
    waits: list[tuple[int, int]] = []
    for start, _ in _kept_steps(node, parties, a, b, gpu):
        for lo, hi in _waited(spans, first, start, start + BUSY_STEP, TURNAROUND):
            if waits and waits[-1][1] == lo:  # one stretch across two steps
                lo = waits.pop()[0]
            waits.append((lo, hi))
    starts = [lo for lo, _ in waits]
    ends = [hi for _, hi in waits]
    total = sum(hi - lo for lo, hi in waits)
    got = [0] * len(groups)
    for s in spans:
        ahead = s.pid not in first and s.queued_ns < _stretch_start(starts, ends, s.start_ns)
        time_in = _overlap(waits, ends, s.start_ns, s.end_ns)
        if ahead:
            total -= time_in
            continue
        for i, g in enumerate(groups):
            if s.pid in g:
                got[i] += time_in
    assert total >= least, (total, (b - a) // MS)
    return [100.0 * g / total for g in got]


def _waited(
    spans: Sequence[Span], pids: set[int], a: int, b: int, bridge: int = 0
) -> list[tuple[int, int]]:
    """The stretches of [a, b) in which some of `pids` had work on the GPU, gaps of up to
    `bridge` ns between them bridged, in order."""
    out: list[tuple[int, int]] = []
    for s in sorted((s for s in spans if s.pid in pids), key=lambda s: s.queued_ns):
        lo, hi = max(s.queued_ns, a), min(s.end_ns, b)
        if hi <= lo:
            continue
        if out and lo <= out[-1][1] + bridge:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _stretch_start(starts: list[int], ends: list[int], t: int) -> int:
    """Where the stretch that holds `t` (or the next one after it) begins."""
    i = bisect.bisect_right(ends, t)
    return starts[i] if i < len(starts) else t


def _overlap(stretches: list[tuple[int, int]], ends: list[int], lo: int, hi: int) -> int:
    """How much of [lo, hi) the ordered, disjoint `stretches` cover (`ends`: their ends)."""
    out = 0
    for s_lo, s_hi in stretches[bisect.bisect_right(ends, lo) :]:
        if s_lo >= hi:
            break
        out += min(s_hi, hi) - max(s_lo, lo)
    return out


def busy_span(node: Node, parties: Parties, a: int, b: int, gpu: int = 0) -> int:
    """How much of [a, b) busy_steps keeps, in ns: a test runs its launchers until it has
    enough, however long a loaded host kept them from running."""
    return len(busy_steps(node, parties, a, b, gpu)) * BUSY_STEP


def median_share(node: Node, pids: list[int], a: int, b: int, gpu: int = 0) -> float:
    """The pids' GPU time together, in percent, per 250 ms of [a, b]: the median, so that a
    host that starves the launchers for a while (the GPU idles or is lent: nobody's doing)
    does not decide it."""
    step = 250 * MS
    got = sorted(sum(shares(node, pids, t, t + step, gpu)) for t in range(a, b - step + 1, step))
    assert got, (a, b)
    return got[len(got) // 2]


def settled(node: Node, parties: Parties, t0: int, t1: int, gpu: int = 0) -> tuple[int, int]:
    """Where a guarantee is judged: from the pacing's settling (settle_ns) after all the
    parties' pids first ran together to 500 ms before the first of them stopped."""
    window = _settled(node, parties, t0, t1, gpu)
    assert window, (parties, t0, t1)
    return window


def _settled(node: Node, parties: Parties, t0: int, t1: int, gpu: int) -> tuple[int, int] | None:
    ran = _all_ran(node, _pids(parties), t0, t1, gpu)
    return (ran[0] + settle_ns(), ran[1] - 500 * MS) if ran else None


def run_until_busy(
    node: Node,
    parties: Parties,
    t0: int,
    need: int,
    limit: float = 60,
    gpu: int = 0,
) -> None:
    """Wait until the parties have been busy together (busy_span) for `need` of simgpu's
    time in their settled window, however long a loaded host keeps their launchers from
    running (fixed runs once left the measure under a second, or a 75 % container idle for
    more than half of it), or until `limit` seconds have passed (the caller's busy_split then
    says how little there was)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        window = _settled(node, parties, t0, time.monotonic_ns(), gpu)
        if window and busy_span(node, parties, *window, gpu) >= need:
            return


def _groups(parties: Parties) -> list[list[int]]:
    return [[p] if isinstance(p, int) else list(p) for p in parties]


def _pids(parties: Parties) -> list[int]:
    return [p for g in _groups(parties) for p in g]
