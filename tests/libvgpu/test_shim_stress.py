"""One container's processes hammering its limit through the shim (tests/native/shim_stress.c):
16 processes x 4 threads allocate and free at random near the limit, by three paths at once,
while this test reads the shared region. The limit is never exceeded, some processes are
SIGKILLed mid-run and their memory comes back, and when the survivors have freed everything
(and are still alive) the container's usage is exactly its contexts' again.

The same run on the ThreadSanitizer build finds no data race in the shim's threads (a report
makes the program exit non-zero)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_shim_helpers import CONTEXT, GIB, MIB, Shim, finish, read_until, start_together

from vgpu_plugin.node.observe.region import RegionError, read_region
from vgpu_plugin.sim.simgpu import Node

pytestmark = pytest.mark.slow


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def _used(shim: Shim) -> tuple[int, int]:
    """(used, limit) of the container's GPU as its region says."""
    dev = read_region(shim.region).devices[0]
    return dev.used, dev.memory_limit


def _stress(
    shim: Shim, procs: int, threads: int, seconds: float, kills: int, limit: int
) -> dict[str, int]:
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    args = ("default", 0, seconds, threads, 8 * MIB, 192 * MIB)
    ps = [shim.start("shim_stress", *args, env=env) for _ in range(procs)]
    try:
        return _drive(shim, ps, seconds, kills, limit)
    finally:
        for p in ps:  # a failed check must not leave 64 threads spinning behind it
            if p.poll() is None:
                p.kill()
            p.communicate()  # and no pipe open behind it


def _drive(
    shim: Shim, ps: list[subprocess.Popen[str]], seconds: float, kills: int, limit: int
) -> dict[str, int]:
    start_together(ps)
    rng = random.Random(1)
    victims = rng.sample(ps, kills)
    due = sorted(
        ((time.monotonic() + rng.uniform(0.2, seconds * 0.7), v) for v in victims),
        key=lambda tv: tv[0],
    )
    snapshots, peak, peak_physical = 0, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if due and time.monotonic() >= due[0][0]:
            victim = due.pop(0)[1]
            victim.send_signal(signal.SIGKILL)
            victim.wait()  # its pipes are closed with the others' below
            shim.node.reap()  # the GPU frees a dead process's memory (simgpu: when asked)
        try:
            used, region_limit = _used(shim)
        except RegionError:  # not created yet by the first process
            continue
        assert region_limit == limit
        assert used <= limit, f"{used} bytes charged past the limit of {limit}"
        # What the GPU really holds for the container's processes (the only ones on it).
        physical = shim.node.gpu(0).used_memory
        assert physical <= limit, f"the GPU holds {physical} bytes, past the limit of {limit}"
        peak_physical = max(peak_physical, physical)
        peak = max(peak, used)
        snapshots += 1
        time.sleep(0.005)
    survivors = [p for p in ps if p not in victims]
    granted = refused = 0
    for p in survivors:
        done = read_until(p, "freed")
        granted += int(done["granted"])
        refused += int(done["refused"])
    # Every survivor has freed all it allocated and is still alive: what the region holds now
    # is their contexts, and the victims' memory has been reclaimed.
    # (A bound, not a window: the wait ends when it holds; a loaded host may take a while.)
    reclaim_by = time.monotonic() + 30.0
    while _used(shim)[0] != len(survivors) * CONTEXT and time.monotonic() < reclaim_by:
        time.sleep(0.02)
    final = _used(shim)[0]
    for p in survivors:
        r = finish(p)
        assert r.rc == 0, r.stderr[-2000:]
    for p in victims:
        p.communicate(timeout=10)  # closes its pipes too
        assert p.returncode == -signal.SIGKILL
    return {
        "snapshots": snapshots,
        "peak": peak,
        "peak_physical": peak_physical,
        "final": final,
        "contexts": len(survivors) * CONTEXT,
        "granted": granted,
        "refused": refused,
    }


def test_16_processes_x_4_threads_never_exceed_the_limit_and_free_back(
    shim: Shim,
) -> None:
    limit = 8 * GIB  # 16 contexts take 4.7 GiB of it: the rest is fought over
    stats = _stress(shim, procs=16, threads=4, seconds=10, kills=4, limit=limit)
    assert stats["snapshots"] > 100
    assert stats["refused"] > 0 and stats["granted"] > stats["refused"] // 100
    assert stats["peak"] > limit - 192 * MIB  # the limit was really contended
    assert stats["final"] == stats["contexts"]


def test_threads_in_the_shim_race_nothing_under_tsan(
    tsan_tree: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    shim = Shim(tsan_tree, simgpu_node, tmp_path)
    # TSan reports end the program with a non-zero status, which _stress asserts against.
    stats = _stress(shim, procs=2, threads=4, seconds=3, kills=0, limit=2 * GIB)
    assert stats["refused"] > 0
    assert stats["final"] == stats["contexts"]


def test_the_tsan_shim_loads_into_a_program_that_never_uses_the_gpu(
    tsan_tree: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    shim = Shim(tsan_tree, simgpu_node, tmp_path)
    r = subprocess.run(["/bin/true"], env=shim.env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
