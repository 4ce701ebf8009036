"""Compute guarantees (sharing.compute: guaranteed, docs/compute.md): each container keeps its
share of a GPU while the others are busy, and idle time goes to whoever is busy.

Every share here is measured in simgpu's own clock: from the simulated GPU's record of which
process's work ran when (`Node.busy`), not from the programs' wall-clock windows, so a loaded
host that delays the launchers shifts when work runs, not how the GPU's time was split.

A container is a region and pacing file in its own directory under tmp_path; tmp_path is
also the peers directory (VGPU_COMPUTE_PEERS), as the host's read-only mount of every
container's directory is in production. Without the guarantee scheme these fail: with
today's `none` (not paced) the all-busy split is a third each (33.2 / 33.4 / 33.3) and the
newcomer's neighbours keep a third each; with caps at the shares (`proportional`) two busy
containers of four use half the GPU (49 %) and the tenant that fills its own shared bucket
gets 32 % of a 25 % share.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pace_forge import forge_budget
from simgpu_shares import (
    BUSY_STEP,
    MS,
    all_running,
    busy_split,
    first_ran,
    median_share,
    shares,
    timeline,
)
from test_shim_compute import shim_on
from test_shim_helpers import Shim, finish, start_together

from vgpu_plugin.node.observe.pace import read_pace

KERNEL_US = 4000  # long kernels: the simulator's record of work covers the whole run
IN_FLIGHT = 8


# simgpu time-slicing contexts as a real GPU does (native/simgpu/README.md): a kernel's
# duration stretches by the neighbours' slices run meanwhile.
TIMESLICE = "2ms"


def container(
    shim: Shim, name: str, request: int, cap: int = 100, timeslice: str = ""
) -> dict[str, str]:
    env = shim.env({"CUDA_DEVICE_SM_LIMIT": str(cap), "CUDA_DEVICE_SM_REQUEST": str(request)})
    if timeslice:
        env["SIMGPU_TIMESLICE"] = timeslice
    (shim.tmp / name).mkdir(exist_ok=True)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(shim.tmp / name / "r.cache")
    env["VGPU_COMPUTE_PEERS"] = str(shim.tmp)
    return env


def a50_b25_c25(shim: Shim, timeslice: str = "") -> list[dict[str, str]]:
    """The three containers most tests here share a GPU between: A 50 %, B and C 25 %."""
    return [
        container(shim, n, r, timeslice=timeslice) for n, r in (("a", 50), ("b", 25), ("c", 25))
    ]


def run(
    shim: Shim, env: dict[str, str], seconds: int, kernel_us: int | str = KERNEL_US
) -> subprocess.Popen[str]:
    return shim.start("shim_launch", "handle", 0, "kernel", kernel_us, seconds, IN_FLIGHT, env=env)


def run_together(
    shim: Shim, envs: list[dict[str, str]], seconds: int, kernel_us: list[int | str] | None = None
) -> list[subprocess.Popen[str]]:
    """Launchers that start their clocks at once (shim_launch's SHIM_LAUNCH_GATE): started
    one after another, a loaded host can bring the last up seconds after the first and leave
    too short a span in which all ran."""
    us = kernel_us or [KERNEL_US] * len(envs)
    procs = [
        run(shim, {**e, "SHIM_LAUNCH_GATE": "1"}, seconds, k) for e, k in zip(envs, us, strict=True)
    ]
    start_together(procs)
    return procs


def finish_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        r = finish(p, timeout=120)
        assert r.rc == 0, r.stderr


@pytest.mark.parametrize("timeslice", ["", TIMESLICE], ids=["one-at-a-time", "time-sliced"])
def test_all_busy_each_gets_its_guarantee(
    native_tree: Path, tmp_path: Path, timeslice: str
) -> None:
    """A 4-way split: A holds 2 slices (50 %), B and C one each (25 %); all busy."""
    shim = shim_on(native_tree, tmp_path, 1)
    t0 = time.monotonic_ns()
    envs = a50_b25_c25(shim, timeslice)
    procs = run_together(shim, envs, 6)
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 500 * MS  # settled, and before the first one stops
    assert b - a >= 1500 * MS, (a, b)
    # Of their GPU time while all three were busy: a launcher the host starves is idle, and
    # its guarantee rightly lent, meanwhile (over the whole run its part fell to 22 % with
    # three 200 ms stops of B, and at load 10)
    split, got = busy_split(shim.node, pids, a, b)
    assert all(abs(s - t) <= 2.0 for s, t in zip(split, (50, 25, 25), strict=True)), (split, got)
    # and the GPU is not left idle (time-sliced and charged whole brackets: 80 %)
    assert median_share(shim.node, pids, a, b) >= 95.0, got


def test_a_launcher_the_host_stops_holds_its_guarantee_while_busy(
    native_tree: Path, tmp_path: Path
) -> None:
    """What a loaded host does to one launcher, on purpose: B's process is stopped for 150 ms
    six times (SIGSTOP). Meanwhile B is idle and its 25 % lent; while all three are busy the
    split is 50 / 25 / 25 still, so B is not held back for its stop afterwards, nor its
    neighbours left with what it was lent. Over the whole run B's part drops to ~21 %: the
    host's doing, which this test's measure (busy_split) leaves out."""
    shim = shim_on(native_tree, tmp_path, 1)
    t0 = time.monotonic_ns()
    envs = a50_b25_c25(shim, TIMESLICE)
    procs = run_together(shim, envs, 7)
    try:
        time.sleep(2.0)
        for _ in range(6):
            os.kill(procs[1].pid, signal.SIGSTOP)
            time.sleep(0.15)
            os.kill(procs[1].pid, signal.SIGCONT)
            time.sleep(0.35)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 500 * MS
    split, got = busy_split(shim.node, pids, a, b)
    assert all(abs(s - t) <= 2.0 for s, t in zip(split, (50, 25, 25), strict=True)), (split, got)


@pytest.mark.parametrize("timeslice", ["", TIMESLICE], ids=["one-at-a-time", "time-sliced"])
def test_idle_guarantees_are_lent_to_the_busy(
    native_tree: Path, tmp_path: Path, timeslice: str
) -> None:
    """Four containers of 25 %; C and D ran a moment and went idle: A and B, busy, use the
    whole GPU between them."""
    shim = shim_on(native_tree, tmp_path, 1)
    envs = [container(shim, n, 25, timeslice=timeslice) for n in "abcd"]
    finish_all([run(shim, e, 1) for e in envs[2:]])
    t0 = time.monotonic_ns()
    procs = run_together(shim, envs[:2], 5)
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 500 * MS, b - 300 * MS
    assert b - a >= 1500 * MS, (a, b)
    got = shares(shim.node, pids, a, b)
    assert median_share(shim.node, pids, a, b) >= 95.0, got


def newcomer(
    native_tree: Path, tmp_path: Path, timeslice: str, after: float, seconds: int
) -> tuple[Shim, list[int], int, Spans]:
    """A (50 %) and B (25 %) busy for 6 s, C (25 %) idle, then busy for ``seconds`` from
    ``after`` s on: the shim, the pids (A, B, C), when C's first kernel ran (simgpu's
    clock, to 5 ms) and when C's launches waited in its bucket (held_spans)."""
    shim = shim_on(native_tree, tmp_path, 1)
    envs = a50_b25_c25(shim, timeslice)
    t0 = time.monotonic_ns()
    busy = run_together(shim, envs[:2], 6)
    time.sleep(after)
    with held_spans(tmp_path / "c" / "r.pace") as waits:
        late = run(shim, envs[2], seconds)
        finish_all([late])
    finish_all(busy)
    pids = [p.pid for p in (*busy, late)]
    return shim, pids, first_ran(shim.node, late.pid, t0, time.monotonic_ns()), waits


def test_an_idle_container_that_turns_busy_gets_its_guarantee_at_once(
    native_tree: Path, tmp_path: Path
) -> None:
    """A (50 %) and B (25 %) busy, C (25 %) idle, so A and B use C's time; C starts and gets
    its guarantee, counted from its first kernel on."""
    shim, pids, c0, _ = newcomer(native_tree, tmp_path, "", 2.5, 2)

    def split(a: int, b: int) -> list[float]:
        got = shares(shim.node, pids, a, b)
        return [100 * g / sum(got) for g in got]

    # C's GPU time from its first kernel on is its guarantee's (its first kernels, charged
    # before any was measured, run ahead for ~50 ms and are paid back over the next ~100 ms:
    # over a second that evens out). On a time-sliced GPU: the test below.
    assert split(c0, c0 + 1000 * MS)[2] >= 23.0, split(c0, c0 + 1000 * MS)
    # (That A is back to its 50 % from then on is seen on an idle host, but not asserted: when
    # the host starves A's launcher, the time A does not ask for is rightly lent to B and C,
    # and simgpu's record cannot tell that from A being held back.)


Spans = list[tuple[int, int]]


@contextlib.contextmanager
def held_spans(pace: Path) -> Iterator[Spans]:
    """While in the block, when (CLOCK_MONOTONIC, simgpu's clock) the launches of the
    container of pacing file ``pace`` waited in its bucket: its ``held_ns`` (pace.c), read
    every 5 ms; the shim adds each wait as it ends, so a rise is a wait that ended then."""
    spans: Spans = []
    stop = threading.Event()

    def watch() -> None:
        last = -1
        while not stop.wait(0.005):
            got = read_pace(pace)
            if not isinstance(got, tuple) or not got:
                continue
            now, held = time.monotonic_ns(), got[0].held_ns
            if 0 <= last < held:
                spans.append((now - (held - last), now))
            last = held

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield spans
    finally:
        stop.set()
        watcher.join()


def newcomer_steps(
    shim: Shim, pids: list[int], c0: int, span: int, held: dict[int, Spans] | None = None
) -> list[dict[int, int] | None]:
    """Each pid's GPU time per 50 ms step of simgpu's clock from c0 on, None for a step in
    which, or beside one in which, some pid's work did not run (busy_steps: a launcher the
    host starved is idle, and the time it did not ask for rightly lent meanwhile). A pid of
    ``held`` whose launches waited in its bucket for half the step or more was not starved
    by the host but held by its pacing: the step stays, with its 0."""
    steps = timeline(shim.node, pids, c0, c0 + span, BUSY_STEP)

    def paced(pid: int, a: int) -> bool:
        waits = (held or {}).get(pid, [])
        return 2 * sum(max(0, min(e, a + BUSY_STEP) - max(s, a)) for s, e in waits) >= BUSY_STEP

    idle = [
        any(s[p] == 0 and not paced(p, c0 + i * BUSY_STEP) for p in pids)
        for i, s in enumerate(steps)
    ]
    return [None if any(idle[max(0, i - 1) : i + 2]) else s for i, s in enumerate(steps)]


def per_100ms(steps: list[dict[int, int] | None], pid: int) -> list[float]:
    """pid's share of the GPU, percent, per 100 ms: two 50 ms steps (newcomer_steps), both
    busy."""
    return [
        100.0 * (a[pid] + b[pid]) / (2 * BUSY_STEP)
        for a, b in zip(steps[0::2], steps[1::2], strict=False)
        if a is not None and b is not None
    ]


def worst_of_three(shares: list[float]) -> float:
    """The least of each share's median with the two beside it: a launcher the loaded host
    starved for a few tens of ms inside a step that stays busy sinks that step alone (16 %
    once, with twelve extra busy loops on 2 CPUs), where an overcharge sinks them all in a
    row."""
    return min(sorted(shares[i : i + 3])[1] for i in range(len(shares) - 2))


# NVML's per-process samples: one exact sample per call (simgpu's default), and a real
# driver's periods (SIMGPU_UTIL_PERIOD_MS; 1/6 s, the H200's). The settle must hold with both.
SAMPLES = pytest.mark.parametrize("util_period_ms", ["0", "167"], ids=["exact", "periods-167ms"])


@SAMPLES
def test_a_container_that_turns_busy_beside_busy_ones_gets_its_guarantee_at_once_time_sliced(
    native_tree: Path, tmp_path: Path, util_period_ms: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A (50 %) and B (25 %) busy on a time-sliced GPU, C (25 %) idle; C turns busy. Its
    kernels run only stretched by A's and B's slices, and it holds its guarantee from its
    first 100 ms on all the same: over its next 500 ms of steps in which all three were busy,
    and in the 100 ms steps in which they were, after the first. Charged its kernels' least
    stretched duration (their floor before it had seen one run alone) it got 17.6 - 19.0 %
    over those 500 ms and 16 % for 100 - 500 ms in a row (issue 24: 15 - 18 % per 100 ms for
    0.5 s to over 2 s); settled against the driver's measure (pace.c, calibrate), 24.8 -
    25.6 %, and 22 - 24 % in its worst 100 ms step but where the host starved it. With the
    driver's samples 1/6 s apart, settled by the time since the last settle, C got 21 %, and
    the settle's credit, more than the bucket holds, was capped away: the stretched charges
    are now scaled by what the settles found, for the floors as they stood (a floor that fell
    under a learnt scale undercharged C until the next settles)."""
    monkeypatch.setenv("SIMGPU_UTIL_PERIOD_MS", util_period_ms)
    shim, pids, c0, waits = newcomer(native_tree, tmp_path, TIMESLICE, 2.0, 3)
    late = pids[2]
    # 50 ms steps from c0 + 100 ms on, while all three were busy (a loaded host may starve a
    # launcher for a while: those steps are left out), to 500 ms before C stops: the first
    # ten of them, [c0 + 100 ms, c0 + 600 ms] where the host starved nobody
    steps = newcomer_steps(shim, pids, c0 + 100 * MS, 2400 * MS, {late: waits})
    kept = [s for s in steps if s is not None][:10]
    assert len(kept) == 10, steps
    c_share = [100.0 * s[late] / BUSY_STEP for s in kept]
    assert sum(c_share) / len(c_share) >= 23.0, c_share
    pairs = per_100ms(steps, late)  # from c0 + 100 ms to its end
    assert len(pairs) >= 4, steps
    # With the driver's samples 1/6 s apart this failed in 1 of 45 idle runs and 2 of 29 at
    # load 15 while a newcomer's floors still fell after its charges were scaled (launch.c,
    # settle_charge): C's shares swung period by period. Since: 0 of 55 idle, 0 of 20 at load.
    # Then 3 of 120 (this or the mean above) while the first settle learnt its scale 3/4 of
    # the way from a period the neighbours' lent rates stretched (C ran ahead at 33 - 40 %,
    # then paid at 8 - 21 %: pace.c, calibrate); learnt half way, 0 of 60 idle, 0 of 40 at
    # load 15 (worst of three at least 21.2, the mean 23.6).
    assert worst_of_three(pairs) >= 20.0, pairs


@SAMPLES
def test_a_container_whose_peers_pause_keeps_its_guarantee_when_they_return_time_sliced(
    native_tree: Path, tmp_path: Path, util_period_ms: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C (25 %) turns busy beside busy A (50 %) and B (25 %) on a time-sliced GPU, and its
    settles learn what its stretched kernels stand for; A and B stop for a second, in which C
    runs alone (lent the whole GPU); then they come back (new processes). C holds its
    guarantee from their return on. With the driver's samples 1/6 s apart, the settle at
    their return covered C's second alone and its charges up to the read, past the driver's
    last period: credited 35 - 86 ms more than its bucket holds, C ran 77 - 122 ms of the
    next 167 ms and then paid it back at 0 - 16 % of the GPU for 300 - 500 ms. A settle after
    a pause of the reads (80 ms) now starts over, as a newcomer's does (pace.c, calibrate)."""
    monkeypatch.setenv("SIMGPU_UTIL_PERIOD_MS", util_period_ms)
    shim = shim_on(native_tree, tmp_path, 1)
    envs = a50_b25_c25(shim, TIMESLICE)
    first = run_together(shim, envs[:2], 3)
    time.sleep(1.0)
    late = run(shim, envs[2], 8)
    finish_all(first)
    time.sleep(1.0)
    t0 = time.monotonic_ns()
    with held_spans(tmp_path / "c" / "r.pace") as waits:
        back = run_together(shim, envs[:2], 3)
        finish_all(back)
    finish_all([late])
    pids = [p.pid for p in (*back, late)]
    a0 = first_ran(shim.node, back[0].pid, t0, time.monotonic_ns())
    # their first 100 ms are theirs to start in (their buckets start empty: C runs more);
    # a step in which C ran nothing counts where C's own bucket held it
    steps = newcomer_steps(shim, pids, a0 + 100 * MS, 2400 * MS, {late.pid: waits})
    pairs = per_100ms(steps, late.pid)
    assert len(pairs) >= 4, steps
    assert sum(pairs) / len(pairs) >= 23.0, pairs
    assert worst_of_three(pairs) >= 20.0, pairs


@pytest.mark.parametrize(
    "util_period_ms", ["0", "167", "1000"], ids=["exact", "periods-167ms", "periods-1s"]
)
def test_a_lender_keeps_its_guarantee_when_its_neighbour_turns_busy_time_sliced(
    native_tree: Path, tmp_path: Path, util_period_ms: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A (25 %, no cap) busy alone, lent the whole GPU; B (75 %) turns busy. A's settles
    against the driver start then, in the middle of a sample period in which A ran at 100 %:
    settled as if all of it came after, A was held at 0 % for 200 - 300 ms (1/6 s periods)
    or 700 ms (1 s) within its first second of sharing. Its settles now begin at that
    period's end: A keeps its 25 % from B's first kernel on (the mean of its 100 ms steps
    over the next 1.9 s; 0 % steps counted, so a hole shows)."""
    monkeypatch.setenv("SIMGPU_UTIL_PERIOD_MS", util_period_ms)
    shim = shim_on(native_tree, tmp_path, 1)
    lender = run(shim, container(shim, "a", 25, timeslice=TIMESLICE), 5)
    t0 = time.monotonic_ns()
    time.sleep(2.0)
    busy = run(shim, container(shim, "b", 75, timeslice=TIMESLICE), 2)
    finish_all([busy, lender])
    pids = [lender.pid, busy.pid]
    b0 = first_ran(shim.node, busy.pid, t0, time.monotonic_ns())
    steps = timeline(shim.node, pids, b0 + 100 * MS, b0 + 2000 * MS, 100 * MS)
    a_share = [100.0 * s[lender.pid] / (100 * MS) for s in steps]
    assert sum(a_share) / len(a_share) >= 22.0, a_share


def time_sliced_split(
    native_tree: Path, tmp_path: Path, kernel_us: list[int | str]
) -> tuple[list[float], list[float]]:
    """A (50 %), B and C (25 %) busy for 6 s on a time-sliced GPU, each with its kernels
    (``kernel_us``, shim_launch's durations): busy_split's split and shares while all ran."""
    shim = shim_on(native_tree, tmp_path, 1)
    envs = a50_b25_c25(shim, TIMESLICE)
    t0 = time.monotonic_ns()
    procs = run_together(shim, envs, 6, kernel_us)
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 500 * MS
    assert b - a >= 1500 * MS, (a, b)
    return busy_split(shim.node, pids, a, b)


def test_kernels_shorter_than_a_slice_are_not_charged_a_share_time_sliced(
    native_tree: Path, tmp_path: Path
) -> None:
    """B's kernels (1 ms) fit in one 2 ms slice: nothing stretches most of them, so they must
    be charged what they take, not their share of the GPU (1 / (1 + k) of it), beside A
    (50 %) and C (25 %) with 4 ms kernels, all busy: 50 / 25 / 25 still, B no more than its
    guarantee. Charged their share with no floor (and not settled against the driver's
    measure) B took 30.9 % of the three's GPU time and A 43.7 %; the floor and the driver's
    settle (pace.c) each hold it alone."""
    split, got = time_sliced_split(native_tree, tmp_path, [KERNEL_US, 1000, KERNEL_US])
    assert all(abs(s - t) <= 2.0 for s, t in zip(split, (50, 25, 25), strict=True)), (split, got)


@SAMPLES
def test_a_kernel_whose_duration_varies_gets_no_more_than_its_guarantee_time_sliced(
    native_tree: Path, tmp_path: Path, util_period_ms: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's kernel (one function, grid and block) takes 1.5 ms or 0.2 ms by its argument: both
    fit in a slice, so nothing stretches them, and charged their share of the GPU down to the
    fastest run's 0.2 ms its 1.5 ms runs cost a third. Beside A (50 %) and C (25 %), all
    busy, B still gets no more than its guarantee: its charges are settled against the
    driver's measure of its GPU time (pace.c, calibrate). Without that (3dbd998) B took
    45.3 % of the three's GPU time, 50 % of the GPU, and A 34 %; with the driver's samples
    1/6 s apart and each settled over the time since the last, 40 / 37 / 22."""
    monkeypatch.setenv("SIMGPU_UTIL_PERIOD_MS", util_period_ms)
    split, got = time_sliced_split(native_tree, tmp_path, [KERNEL_US, "1500,200", KERNEL_US])
    assert all(abs(s - t) <= 2.0 for s, t in zip(split, (50, 25, 25), strict=True)), (split, got)


def test_a_guarantee_holds_beside_a_busy_neighbour_on_a_time_sliced_gpu(
    native_tree: Path, tmp_path: Path
) -> None:
    """The GPU day's noisy neighbour (bench/RESULTS.md, an H200): A guaranteed and capped at
    25 %, B guaranteed 75 %, both busy, kernels of the two contexts time-sliced. Charged by
    its kernels' durations, which B's slices stretch, A got 15 % there (and 20 % here: B's
    are stretched by A's too, and both leave the GPU idle, 85 % used)."""
    shim = shim_on(native_tree, tmp_path, 1)
    envs = [
        container(shim, "a", 25, cap=25, timeslice=TIMESLICE),
        container(shim, "b", 75, timeslice=TIMESLICE),
    ]
    t0 = time.monotonic_ns()
    procs = run_together(shim, envs, 6)
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 500 * MS
    assert b - a >= 1500 * MS, (a, b)
    split, got = busy_split(shim.node, pids, a, b)  # while both were busy
    assert abs(split[0] - 25) <= 2.0, (split, got)
    assert got[0] >= 23.0, got  # of the GPU; charged whole brackets: ~20


def test_a_tenant_filling_its_own_budget_gets_no_more_than_its_guarantee(
    native_tree: Path, tmp_path: Path
) -> None:
    """Four containers of 25 %, all busy; a process of A keeps writing a full bucket (and
    the guarantee of 100 %) into A's pacing file, which is A's to write. A stays at 25 %."""
    shim = shim_on(native_tree, tmp_path, 1)
    envs = [container(shim, n, 25) for n in "abcd"]
    t0 = time.monotonic_ns()
    procs = run_together(shim, envs, 6)
    pace = tmp_path / "a" / "r.pace"
    stop = threading.Event()

    writer = threading.Thread(target=forge_budget, args=(pace, stop))
    writer.start()
    try:
        finish_all(procs)
    finally:
        stop.set()
        writer.join()
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 500 * MS
    assert b - a >= 1500 * MS, (a, b)
    split, got = busy_split(shim.node, pids, a, b)  # while all four were busy
    assert split[0] <= 27.0, (split, got)
