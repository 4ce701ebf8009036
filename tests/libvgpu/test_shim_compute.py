"""The compute limit: each container's GPU time share tracks CUDA_DEVICE_SM_LIMIT.

Program: tests/native/shim_launch.c, which launches kernels of a known duration as fast as the
shim lets it. Shares are measured in simgpu's own clock, from the simulated GPU's record of
whose work ran when (`Node.busy`), in one-second windows of that clock from one second after
the processes' work started: a loaded host (load 15 on 2 cores) delays when the program sees
its kernels complete, which the program's own windows would count in the wrong second, but
not when they ran. A container is a set of processes with one region (and pacing file); two
containers on one GPU are two regions. On the simulated GPU, work of all processes runs one
piece at a time, as kernels of different processes do on a time-sliced GPU.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from simgpu_shares import BUSY_STEP, MS, all_running, busy_split, shares, timeline
from test_shim_helpers import Shim, finish

from vgpu_plugin.sim.simgpu import GpuSpec, Node

TOLERANCE = 5.0  # points of share, in every window


def shim_on(native_tree: Path, tmp_path: Path, gpus: int) -> Shim:
    gpus_ = [GpuSpec(memory=16 << 30) for _ in range(gpus)]
    node = Node.create(tmp_path / "simgpu", gpus_, seed=tmp_path.name)
    return Shim(native_tree, node, tmp_path)


def container(shim: Shim, name: str, **limits: str) -> dict[str, str]:
    env = shim.env(limits)
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = str(shim.tmp / name / "r.cache")
    return env


def launch(
    shim: Shim,
    env: Mapping[str, str],
    ordinal: int,
    api: str,
    seconds: int,
    us: int | Sequence[int] = 1000,
    streams: int = 1,
) -> subprocess.Popen[str]:
    """`us`: the kernels' duration, or durations cycled through launch by launch; `streams`:
    how many streams of the context the launches go round-robin over.

    Up to 32 launches in flight: the pacing lets a launcher the host did not schedule for a
    while catch up its bucket (40 ms of credit), which it can spend in one wake-up only with
    that much queued. With 4 x 1 ms in flight, an 80 % launcher must wake every 1.25 ms, and
    at load 15 on 2 cores it got 64 to 74 % in some seconds: the host's doing, not the pacing's
    (issue 24)."""
    durations = str(us) if isinstance(us, int) else ",".join(map(str, us))
    args = ("shim_launch", "handle", ordinal, api, durations, seconds, 32, streams)
    return shim.start(*args, env=env)


SECOND = 1000 * MS


def gpu_windows(
    shim: Shim, procs: Sequence[subprocess.Popen[str]], t0: int, gpu: int = 0
) -> list[float]:
    """The processes' GPU time together, in percent of each whole second of simgpu's clock
    from one second after all of them started running (the warm-up) to the end of their
    work, less the last 200 ms (kernels in flight at the end); at least two windows.

    Each second counts only its 50 ms steps in which the processes were busy: their work
    ran there for at least half as long as in the median step, and so in the steps beside
    it. A launcher the loaded host does not schedule for longer than its bucket's 40 ms is
    not launching, and the time it does not ask for is not the pacing's to give (a second
    with less than a quarter of it busy, 250 ms, is left out). A 60 - 100 ms stop that
    straddled two steps, with some work in each, was counted with "any work" (68.5 % for
    75)."""
    for p in procs:
        if p.returncode is None:
            r = finish(p, timeout=120)
            assert r.rc == 0, r.stderr
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns(), gpu)
    a = max(a + SECOND, shim.node.recorded_since(gpu))
    n = (b - 200 * MS - a) // SECOND
    per_step = SECOND // BUSY_STEP
    used = [sum(s.values()) for s in timeline(shim.node, pids, a, a + n * SECOND, BUSY_STEP, gpu)]
    typical = sorted(used)[len(used) // 2]
    idle = [u * 2 < typical for u in used]
    got = []
    for k in range(n):
        busy = [
            used[i]
            for i in range(k * per_step, (k + 1) * per_step)
            if not any(idle[max(0, i - 1) : i + 2])
        ]
        if 4 * len(busy) >= per_step:
            got.append(100.0 * sum(busy) / (len(busy) * BUSY_STEP))
    assert len(got) >= 2, (a, b, n, got)
    return got


def assert_share(got: list[float], target: float) -> None:
    assert all(abs(w - target) <= TOLERANCE for w in got), (target, got)


def test_limits_of_25_50_75_percent_hold_in_every_second(native_tree: Path, tmp_path: Path) -> None:
    shim = shim_on(native_tree, tmp_path, 3)
    seconds, targets = 5, (25, 50, 75)
    t0 = time.monotonic_ns()
    procs = [
        launch(shim, container(shim, f"c{i}", CUDA_DEVICE_SM_LIMIT=str(t)), i, "kernel", seconds)
        for i, t in enumerate(targets)
    ]
    time.sleep(3.0)
    # The simulator's own measure (NVML utilization, the last second when asked) agrees with
    # its record of that second: within a point, and what the second moved by while asked.
    for i, p in enumerate(procs):
        before = time.monotonic_ns()
        u = shim.node.gpu(i).utilization
        after = time.monotonic_ns()
        seen = [shares(shim.node, [p.pid], t - SECOND, t, i)[0] for t in (before, after)]
        slack = 1.0 + 100.0 * (after - before) / SECOND
        assert min(seen) - slack <= u <= max(seen) + slack, (u, seen)
    for i, (p, t) in enumerate(zip(procs, targets, strict=True)):
        assert_share(gpu_windows(shim, [p], t0, i), t)


def test_two_containers_on_one_gpu_each_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    t0 = time.monotonic_ns()
    a = launch(shim, container(shim, "a", CUDA_DEVICE_SM_LIMIT="25"), 0, "kernel", seconds)
    b = launch(shim, container(shim, "b", CUDA_DEVICE_SM_LIMIT="50"), 0, "kernel", seconds)
    assert_share(gpu_windows(shim, [a], t0), 25)
    assert_share(gpu_windows(shim, [b], t0), 50)


def test_short_kernels_beside_long_ones_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    """200 µs kernels at 25 % beside 2 ms kernels at 50 %: the short kernels queue behind the
    long ones, and that wait is not GPU time of theirs."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    t0 = time.monotonic_ns()
    a = launch(shim, container(shim, "a", CUDA_DEVICE_SM_LIMIT="25"), 0, "kernel", seconds, 200)
    b = launch(shim, container(shim, "b", CUDA_DEVICE_SM_LIMIT="50"), 0, "kernel", seconds, 2000)
    assert_share(gpu_windows(shim, [a], t0), 25)
    assert_share(gpu_windows(shim, [b], t0), 50)


def test_kernels_of_varying_duration_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    """One function and grid whose launches alternate between 100 µs and 5 ms: no per-kernel
    estimate fits it, each launch must be charged what it took."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="30")
    t0 = time.monotonic_ns()
    assert_share(gpu_windows(shim, [launch(shim, env, 0, "kernel", seconds, (100, 5000))], t0), 30)


def test_streams_of_one_context_are_not_charged_twice(native_tree: Path, tmp_path: Path) -> None:
    """Kernels of two streams of a context: a bracket on one stream can cover the other's
    kernel (a GPU runs them concurrently; simgpu queues one behind the other), and that time
    is charged once."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 6  # four whole seconds to measure: a loaded host may leave one under-busy
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="80")
    t0 = time.monotonic_ns()
    assert_share(gpu_windows(shim, [launch(shim, env, 0, "kernel", seconds, streams=2)], t0), 80)


APIS = ["kernel", "ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "graph", "graph_ptsz"]


def test_every_launch_api_is_paced(native_tree: Path, tmp_path: Path) -> None:
    """Per-thread default streams, Ex, cooperative and graph launches all count."""
    shim = shim_on(native_tree, tmp_path, len(APIS))
    seconds = 6
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="40")
    t0 = time.monotonic_ns()
    procs = [launch(shim, env, i, api, seconds) for i, api in enumerate(APIS)]
    for i, (api, p) in enumerate(zip(APIS, procs, strict=True)):
        got = gpu_windows(shim, [p], t0, i)
        assert abs(sum(got) / len(got) - 40) <= TOLERANCE, (api, got)


def test_the_processes_of_a_container_share_one_budget(native_tree: Path, tmp_path: Path) -> None:
    """Two processes under one 50 % cap get 50 % together, not 50 % each. On a time-sliced
    GPU, as real GPUs run contexts: on simgpu's one-at-a-time model a process the loaded host
    descheduled between its start event and its launch can have its sibling's kernels in its
    bracket (44.9 - 46.5 % once in CI at load 11 - 17; docs/compute.md, Several processes in a
    container), which time-slicing with kernels shorter than a slice does not do."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 6
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="50")
    env["SIMGPU_TIMESLICE"] = "2ms"
    t0 = time.monotonic_ns()
    procs = [launch(shim, env, 0, "kernel", seconds) for _ in range(2)]
    assert_share(gpu_windows(shim, procs, t0), 50)


@pytest.mark.xfail(
    strict=True,
    reason="known defect (docs/compute.md, Several processes in a container): each process's"
    " measure of a kernel holds its siblings' time-sliced time too, and is charged whole",
)
def test_processes_of_a_container_are_charged_once_for_kernels_that_ran_beside_each_other(
    native_tree: Path, tmp_path: Path
) -> None:
    """Four processes of one container capped at 90 % on a time-sliced GPU, each launching
    one function whose kernels take 1 or 15 ms in turn. The GPU runs one process's kernels
    beside the others', so each process's measure of a kernel also holds the others' slices
    run meanwhile, and the container pays again for time that ran once: 66 - 81 % in its
    seconds on simgpu's corrected time-slicing (59 - 83 % before it, 8 runs; 50 - 72 % on a
    simgpu that also stretched a kernel by work queued after it, efe90c1, reverted). The
    contract is the cap within 5 points in every second.

    Settling each process's charges against the driver's measure of it while the container
    has several processes launching (as a guaranteed container does beside busy peers) held
    it at 89 - 92 % with exact samples, but at 1/6 s sample periods the four settles ran the
    container over its cap (95 - 108 % in some seconds; 92 - 98 % on the stretching simgpu):
    not shipped, nor the division of each bracket by the siblings busy during it (over the
    cap at 50 %: docs/compute.md). Guaranteed containers
    keep their processes together with the node agent's measure of the container
    (test_shim_multiproc.py); caps do not have it yet."""
    shim = shim_on(native_tree, tmp_path, 1)
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="90")
    env["SIMGPU_TIMESLICE"] = "2ms"
    t0 = time.monotonic_ns()
    procs = [launch(shim, env, 0, "kernel", 7, (1000, 15000)) for _ in range(4)]
    got = gpu_windows(shim, procs, t0)
    assert_share(got, 90)
    assert abs(sum(got) / len(got) - 90) <= 2.0, got


@pytest.mark.parametrize("value", ["0", "100"])
def test_0_and_100_percent_do_not_pace(native_tree: Path, tmp_path: Path, value: str) -> None:
    """Measured in simgpu's clock, with 160 ms of work queued: a loaded host that delays the
    launcher (a 60 ms stall) does not empty the GPU's queue, where pacing at any share below
    100 % would hold it to that share. At load 15 on 2 cores the host once stopped it for
    longer than that (the GPU idled, nobody's doing), so the share is taken over the steps
    in which its work ran (busy_steps); a pacer's waits (20 ms at most) leave none out."""
    shim = shim_on(native_tree, tmp_path, 1)
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT=value, CUDA_DEVICE_MEMORY_LIMIT="4g")
    t0 = time.monotonic_ns()
    p = shim.start("shim_launch", "handle", 0, "kernel", 5000, 4, 32, env=env)
    assert finish(p, timeout=120).rc == 0
    a, b = all_running(shim.node, [p.pid], t0, time.monotonic_ns())
    a, b = a + 500 * MS, b - 300 * MS
    assert b - a >= 2000 * MS, (a, b)
    share = busy_split(shim.node, [p.pid], a, b)[1][0]
    assert share >= 95.0, (share, shares(shim.node, [p.pid], a, b))
