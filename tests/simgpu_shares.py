"""Shares of a simulated GPU's time, read from simgpu's record of whose work ran when
(`Node.busy`) in its own clock: what every tier's compute tests measure by, so a loaded host
shifts when work runs, not how the GPU's time was split."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from vgpu_plugin.sim.simgpu import Node

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
    groups = _groups(parties)
    steps = timeline(node, _pids(parties), a, b, BUSY_STEP, gpu)
    per = [[sum(s[p] for p in g) for g in groups] for s in steps]
    idle = [any(t == 0 for t in s) for s in per]
    return [s for i, s in enumerate(per) if not any(idle[max(0, i - 1) : i + 2])]


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
