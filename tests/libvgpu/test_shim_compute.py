"""The compute limit: each container's GPU time share tracks CUDA_DEVICE_SM_LIMIT.

Program: tests/native/shim_launch.c, which launches kernels of a known duration as fast as the
shim lets it and reports the GPU time its kernels took in each one-second window (window 0 is
the warm-up). A container is a set of processes with one region (and pacing file); two
containers on one GPU are two regions. On the simulated GPU, work of all processes runs one
piece at a time, as kernels of different processes do on a time-sliced GPU.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from test_shim_helpers import Result, Shim, finish

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
    how many streams of the context the launches go round-robin over."""
    durations = str(us) if isinstance(us, int) else ",".join(map(str, us))
    args = ("shim_launch", "handle", ordinal, api, durations, seconds, 4, streams)
    return shim.start(*args, env=env)


def windows(r: Result, seconds: int) -> list[float]:
    assert r.rc == 0, r.stderr
    return [r.float(f"window_{w}") for w in range(1, seconds)]


def assert_share(r: Result, seconds: int, target: float) -> None:
    got = windows(r, seconds)
    assert all(abs(w - target) <= TOLERANCE for w in got), (target, got)


def test_limits_of_25_50_75_percent_hold_in_every_second(native_tree: Path, tmp_path: Path) -> None:
    shim = shim_on(native_tree, tmp_path, 3)
    seconds, targets = 5, (25, 50, 75)
    procs = [
        launch(shim, container(shim, f"c{i}", CUDA_DEVICE_SM_LIMIT=str(t)), i, "kernel", seconds)
        for i, t in enumerate(targets)
    ]
    time.sleep(3.0)
    # The simulator's own measure (NVML utilization, last second) agrees.
    util = [shim.node.gpu(i).utilization for i in range(3)]
    results = [finish(p, timeout=60) for p in procs]
    for r, t, u in zip(results, targets, util, strict=True):
        assert_share(r, seconds, t)
        assert abs(u - t) <= TOLERANCE, (t, u)


def test_two_containers_on_one_gpu_each_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    a = launch(shim, container(shim, "a", CUDA_DEVICE_SM_LIMIT="25"), 0, "kernel", seconds)
    b = launch(shim, container(shim, "b", CUDA_DEVICE_SM_LIMIT="50"), 0, "kernel", seconds)
    assert_share(finish(a, timeout=60), seconds, 25)
    assert_share(finish(b, timeout=60), seconds, 50)


def test_short_kernels_beside_long_ones_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    """200 µs kernels at 25 % beside 2 ms kernels at 50 %: the short kernels queue behind the
    long ones, and that wait is not GPU time of theirs."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    a = launch(shim, container(shim, "a", CUDA_DEVICE_SM_LIMIT="25"), 0, "kernel", seconds, 200)
    b = launch(shim, container(shim, "b", CUDA_DEVICE_SM_LIMIT="50"), 0, "kernel", seconds, 2000)
    ra, rb = finish(a, timeout=60), finish(b, timeout=60)
    assert_share(ra, seconds, 25)
    assert_share(rb, seconds, 50)


def test_kernels_of_varying_duration_get_their_share(native_tree: Path, tmp_path: Path) -> None:
    """One function and grid whose launches alternate between 100 µs and 5 ms: no per-kernel
    estimate fits it, each launch must be charged what it took."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 5
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="30")
    assert_share(
        finish(launch(shim, env, 0, "kernel", seconds, (100, 5000)), timeout=60), seconds, 30
    )


def test_streams_of_one_context_are_not_charged_twice(native_tree: Path, tmp_path: Path) -> None:
    """Kernels of two streams of a context: a bracket on one stream can cover the other's
    kernel (a GPU runs them concurrently; simgpu queues one behind the other), and that time
    is charged once."""
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 4
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="80")
    assert_share(
        finish(launch(shim, env, 0, "kernel", seconds, streams=2), timeout=60), seconds, 80
    )


APIS = ["kernel", "ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "graph", "graph_ptsz"]


def test_every_launch_api_is_paced(native_tree: Path, tmp_path: Path) -> None:
    """Per-thread default streams, Ex, cooperative and graph launches all count."""
    shim = shim_on(native_tree, tmp_path, len(APIS))
    seconds = 3
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="40")
    procs = [launch(shim, env, i, api, seconds) for i, api in enumerate(APIS)]
    for api, p in zip(APIS, procs, strict=True):
        r = finish(p, timeout=60)
        assert abs(r.float("mean") - 40) <= TOLERANCE, (api, r.stdout)


def test_the_processes_of_a_container_share_one_budget(native_tree: Path, tmp_path: Path) -> None:
    shim = shim_on(native_tree, tmp_path, 1)
    seconds = 4
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT="50")
    procs = [launch(shim, env, 0, "kernel", seconds) for _ in range(2)]
    results = [finish(p, timeout=60) for p in procs]
    per_window = [sum(w) for w in zip(*(windows(r, seconds) for r in results), strict=True)]
    assert all(abs(w - 50) <= TOLERANCE for w in per_window), per_window


MS = 1_000_000


def timeline(node: Node, pids: list[int], t0: int, t1: int, step: int) -> list[dict[int, int]]:
    """Per `step` ns of simgpu's clock in [t0, t1), each pid's GPU time there."""
    out = []
    for t in range(t0, t1, step):
        got = node.busy(0, t, t + step)
        out.append({p: got.get(p, 0) for p in pids})
    return out


def all_running(node: Node, pids: list[int], t0: int, t1: int) -> tuple[int, int]:
    """The span of simgpu time, in 50 ms steps, from the first step in which every pid's work
    ran to the last: the part of the run in which all of them were launching."""
    step = 50 * MS
    steps = timeline(node, pids, t0, t1, step)
    both = [i for i, s in enumerate(steps) if all(s[p] > 0 for p in pids)]
    assert both, steps
    return t0 + both[0] * step, t0 + (both[-1] + 1) * step


def shares(node: Node, pids: list[int], a: int, b: int) -> list[float]:
    """Each pid's GPU time in [a, b] of simgpu's clock, in percent of that span."""
    got = node.busy(0, a, b)
    return [100.0 * got.get(p, 0) / (b - a) for p in pids]


@pytest.mark.parametrize("value", ["0", "100"])
def test_0_and_100_percent_do_not_pace(native_tree: Path, tmp_path: Path, value: str) -> None:
    """Measured in simgpu's clock, with 160 ms of work queued: a loaded host that delays the
    launcher (a 60 ms stall, or load 15 on 2 cores) does not empty the GPU's queue, where
    pacing at any share below 100 % would hold it to that share."""
    shim = shim_on(native_tree, tmp_path, 1)
    env = container(shim, "c", CUDA_DEVICE_SM_LIMIT=value, CUDA_DEVICE_MEMORY_LIMIT="4g")
    t0 = time.monotonic_ns()
    p = shim.start("shim_launch", "handle", 0, "kernel", 5000, 4, 32, env=env)
    assert finish(p, timeout=120).rc == 0
    a, b = all_running(shim.node, [p.pid], t0, time.monotonic_ns())
    a, b = a + 500 * MS, b - 300 * MS
    assert b - a >= 2000 * MS, (a, b)
    assert shares(shim.node, [p.pid], a, b)[0] >= 95.0
