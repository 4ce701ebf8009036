"""The memory a container really holds never exceeds its limit: read from simgpu's physical
usage (what the simulated GPU says its processes hold), not from the shim's own accounts.

Programs: tests/native/shim_pool.c (a pool that keeps everything it frees, then another path),
shim_ctx.c (contexts made every way), shim_nvml_procs.c (NVML's process lists), shim_mem.c.
The node has 2 x 16 GiB GPUs whose contexts take 300 MiB each (conftest).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_shim_helpers import (
    CONTEXT,
    GIB,
    MIB,
    OOM,
    Result,
    Shim,
    finish,
    parse,
    read_until,
    start_together,
)

from vgpu_plugin.node.host import native
from vgpu_plugin.node.observe.region import read_region
from vgpu_plugin.sim.simgpu import Node


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def physical(shim: Shim, gpu: int = 0) -> int:
    """Bytes the GPU's processes hold, as the simulated GPU counts them."""
    return shim.node.gpu(gpu).used_memory


def _release(proc: subprocess.Popen[str]) -> None:
    """Let a program waiting at a hold go on."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def test_a_pool_that_keeps_its_cache_then_another_path_stays_within_the_limit(shim: Shim) -> None:
    limit = 4 * GIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    p = shim.start("shim_pool", "handle", 0, 256 * MIB, env=env)
    try:
        first = read_until(p, "hold")
        # The pool filled the limit; freed and synchronised, it keeps all of it cached.
        assert int(first["async_count"]) == (limit - CONTEXT) // (256 * MIB)
        assert physical(shim) <= limit
        assert int(first["view_free"]) < 256 * MIB  # what the pool keeps counts
        _release(p)
        second = read_until(p, "hold")
        # The other path got the whole limit again: the shim trimmed the pool before refusing.
        assert int(second["alloc_count"]) == (limit - CONTEXT) // (256 * MIB)
        assert physical(shim) <= limit
    finally:
        r = finish(p)
    assert r.rc == 0, r.stderr
    assert "done" in r.stdout


def test_contexts_are_charged_exactly_while_neighbours_allocate_and_free(shim: Shim) -> None:
    # Another container's processes (no shim, no limit) churning on the same GPU: at most
    # 2 x 4 threads x 16 x 64 MiB, so the GPU always has more free than our limit (the view
    # then shows exactly the limit less the charge).
    neighbours = [
        shim.start("shim_stress", "default", 0, 4, 4, 8 * MIB, 64 * MIB, env=shim.env(shim=False))
        for _ in range(2)
    ]
    try:
        start_together(neighbours)
        limit = 4 * GIB
        r = shim.run(
            "shim_ctx",
            "handle",
            "create",
            6,
            env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)}),
        )
        assert r.rc == 0, r.stderr
        for i in range(1, 7):
            assert r.int(f"free_{i}") <= limit - i * CONTEXT
            assert r.int(f"free_{i}") == limit - i * CONTEXT, f"context {i} charged wrongly"
        assert r.int("end_free") == limit - CONTEXT  # the 6 given back; the primary charged
    finally:
        for p in neighbours:
            p.kill()
            p.communicate()  # and its pipes closed


@pytest.mark.parametrize("how", ["runtime", "runtime_alloc"])
def test_a_context_made_past_the_shim_is_charged_when_first_met(shim: Shim, how: str) -> None:
    limit = 2 * GIB
    r = shim.run("shim_ctx", "handle", how, env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)}))
    assert r.rc == 0, r.stderr
    if how == "runtime":
        assert r.int("free") == limit - CONTEXT
        assert r.int("free2") == limit - CONTEXT - 64 * MIB
    else:
        assert r.int("free") == limit - CONTEXT - 64 * MIB


def test_filling_the_limit_the_gpu_holds_no_more_than_it(shim: Shim) -> None:
    """A context, then allocations until refused: the GPU holds the limit at most, the
    context included."""
    limit = 2 * GIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    p = shim.start("shim_mem", "handle", 0, "alloc", 64 * MIB, 1000, "hold", env=env)
    try:
        out = read_until(p, "holding")
        assert int(out["refusal"]) == OOM
        assert physical(shim) <= limit
        assert int(out["allocated"]) == (limit - CONTEXT) // (64 * MIB) * 64 * MIB
    finally:
        assert finish(p).rc == 0


def test_nvml_process_lists_show_only_the_containers_processes(shim: Shim) -> None:
    # A neighbour (another container: no shim) holding memory on the same GPU.
    other = shim.start(
        "shim_mem", "handle", 0, "alloc", 512 * MIB, 1, "hold", env=shim.env(shim=False)
    )
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "4g"})
    mine = shim.start("shim_mem", "handle", 0, "alloc", 128 * MIB, 1, "hold", env=env)
    try:
        read_until(other, "holding")
        read_until(mine, "holding")
        r = shim.run("shim_nvml_procs", "handle", env=env)
        assert r.rc == 0, r.stderr
        me = int(r.out["self"])
        for key in ("v1", "v2", "v3"):
            listed = dict(
                (int(pid), int(used))
                for pid, _, used in (e.partition(":") for e in r.out[key].split(","))
            )
            assert set(listed) == {me, mine.pid}, (key, listed, other.pid)
            assert listed[me] == CONTEXT + 256 * MIB
            assert listed[mine.pid] == CONTEXT + 128 * MIB
        # Without the shim, the whole GPU's processes.
        plain = shim.run("shim_nvml_procs", "handle", env=shim.env(shim=False))
        assert str(other.pid) in plain.out["v3"]
    finally:
        finish(other)
        finish(mine)


# The 32-bit cuMemAlloc falls back too, where the managed pointer fits 32 bits (on simgpu it
# never does: its v1 allocations run out of 32-bit addresses first, and are refused).
@pytest.mark.parametrize("path", ["alloc", "pitch", "async", "async_ptsz", "pool", "pool_ptsz"])
def test_oversubscription_falls_back_on_every_path_that_can(shim: Shim, path: str) -> None:
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "24g", "CUDA_OVERSUBSCRIBE": "true"})
    r = shim.run("shim_mem", "handle", 0, path, GIB, 100, env=env)
    assert r.rc == 0, r.stderr
    assert r.int("allocated") > 16 * GIB  # past the GPU's memory: part of it host-backed
    assert r.int("allocated") <= 24 * GIB - CONTEXT
    assert r.int("refusal") == OOM
    assert r.int("after_view_free") == 16 * GIB - CONTEXT


@pytest.mark.parametrize("path", ["vmm", "array", "mipmapped"])
def test_oversubscription_refuses_paths_that_cannot_be_managed(shim: Shim, path: str) -> None:
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "24g", "CUDA_OVERSUBSCRIBE": "true"})
    r = shim.run("shim_mem", "handle", 0, path, GIB, 100, env=env)
    assert r.rc == 0, r.stderr
    assert r.int("allocated") <= 16 * GIB - CONTEXT  # the GPU's memory, no more
    assert r.int("refusal") == OOM


def test_root_made_lock_files_do_not_lock_out_non_root_processes(
    shim: Shim, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    lock_dir = tmp_path / "lock"
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g"})
    # A root container with a strict umask makes the lock dir and the GPU's lock file first.
    old = os.umask(0o077)
    try:
        r = shim.run("shim_views", "handle", 0, 0, env=env)
    finally:
        os.umask(old)
    assert r.rc == 0, r.stderr
    locks = list(lock_dir.glob("GPU-*.lock"))
    assert locks and all(p.stat().st_mode & 0o777 == 0o666 for p in locks)
    # Then a non-root pod's process (its own region: another container). It must reach the
    # node and the shim: open the test's own directories to it.
    for d in [tmp_path, *tmp_path.parents]:
        if d == Path("/tmp") or d == Path("/"):
            break
        d.chmod(d.stat().st_mode | 0o055)
    for f in (tmp_path / "simgpu").rglob("*"):
        f.chmod(0o777 if f.is_dir() else 0o666)
    (tmp_path / "simgpu").chmod(0o777)
    # The build tree may sit in a private checkout (mode 0700): the user gets its own copy.
    tree, libs = _readable_copy(shim.tree, tmp_path / "built")
    other = Shim(tree, shim.node, tmp_path / "other")
    other.tmp.mkdir()
    other.tmp.chmod(0o777)
    env2 = other.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "VGPU_LOCK_DIR": str(lock_dir)})
    env2["LD_LIBRARY_PATH"] = str(libs)
    r2 = _run_as(other, 65534, env2)
    assert r2.rc == 0, r2.stderr
    assert "cannot open the GPU lock" not in r2.stderr
    assert r2.int("start_free") == 2 * GIB - CONTEXT


def _readable_copy(tree: Path, dest: Path) -> tuple[Path, Path]:
    """The shim, ``shim_views`` and simgpu's libraries of ``tree``, copied under ``dest`` where
    any user can read them; the copy keeps the tree's name (the ASan tree is told by it).
    Returns (the copied tree, simgpu's library dir)."""
    copy = dest / tree.name
    (copy / "lib").mkdir(parents=True)
    (copy / "tests").mkdir()
    shutil.copy2(tree / "lib" / "libvgpu.so", copy / "lib")
    shutil.copy2(tree / "tests" / "shim_views", copy / "tests")
    libs = shutil.copytree(native.simgpu_dir(), dest / "simgpu-lib", symlinks=True)
    for p in [dest, *dest.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755)  # copied with the checkout's modes, which may be private
    return copy, libs


def _run_as(shim: Shim, uid: int, env: dict[str, str]) -> Result:
    """shim_views as user `uid` (no groups), as a non-root pod's process runs."""
    proc = subprocess.run(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            str(shim.prog("shim_views")),
            "handle",
            "0",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Result(proc.returncode, parse(proc.stdout), proc.stdout, proc.stderr)


def test_a_leased_lock_file_does_not_stall_context_creation(shim: Shim, tmp_path: Path) -> None:
    """A tenant replaces the lock file with its own and takes a write lease on it: an open for
    writing (or a blocking one) would wait fs.lease-break-time (45 s) for every process."""
    lease_break = int(Path("/proc/sys/fs/lease-break-time").read_text())
    if lease_break < 5:
        pytest.skip(f"fs.lease-break-time is {lease_break} s: a block would go unnoticed")
    lock_dir = tmp_path / "lock"
    lock_dir.mkdir()
    lock = lock_dir / f"{shim.node.gpu(0).uuid}.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, signal, sys, time\n"
            "signal.signal(signal.SIGIO, signal.SIG_IGN)\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)\n"
            "fcntl.fcntl(fd, getattr(fcntl, 'F_SETLEASE', 1024), fcntl.F_WRLCK)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g"})
        # Well under the lease break: a blocked open would raise TimeoutExpired here.
        r = shim.run("shim_views", "handle", 0, 0, env=env, timeout=lease_break / 2)
        assert r.rc == 0, r.stderr
        assert r.int("start_free") == 2 * GIB - CONTEXT  # still measured, and charged
    finally:
        holder.kill()
        holder.communicate()


def test_the_region_counts_refusals_fallbacks_peak_and_gpu_time(shim: Shim) -> None:
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "24g", "CUDA_OVERSUBSCRIBE": "true"})
    r = shim.run("shim_mem", "handle", 0, "alloc", GIB, 100, env=env)
    assert r.rc == 0, r.stderr
    dev = read_region(shim.region).devices[0]
    assert r.int("allocated") == 23 * GIB
    assert dev.fallbacks == 8  # 15 GiB fit the GPU beside the context; 8 are host-backed
    assert dev.refused == 1  # the 24th
    assert dev.peak == 23 * GIB + CONTEXT
    assert dev.gpu_ns == 0  # nothing paced

    paced = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "24g", "CUDA_DEVICE_SM_LIMIT": "50"})
    r = shim.run("shim_launch", "handle", 0, "kernel", 1000, 1, env=paced)
    assert r.rc == 0, r.stderr
    # Each 1 ms kernel's GPU time is measured, but the last few in flight at exit.
    gpu_ns = read_region(shim.region).devices[0].gpu_ns
    assert gpu_ns >= (int(r.out["launched"]) - 8) * 900_000


def test_graph_memory_nodes_are_charged_when_launched_and_refused_past_the_limit(
    shim: Shim,
) -> None:
    limit = 2 * GIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    p = shim.start("shim_graph", "handle", 0, GIB, 64 * MIB, env=env)
    try:
        out = read_until(p, "hold")
        assert int(out["launch1"]) == 0
        assert int(out["view_free1"]) == limit - CONTEXT - GIB  # held by the launched graph
        assert int(out["launch2"]) == OOM  # a second copy does not fit: nothing ran
        assert int(out["view_free2"]) == limit - CONTEXT - GIB
        assert int(out["allocated"]) == (limit - CONTEXT - GIB) // (64 * MIB) * 64 * MIB
        assert physical(shim) <= limit
    finally:
        r = finish(p)
    assert r.rc == 0, r.stderr
    assert r.int("end_free") == limit - CONTEXT  # the graphs' memory went with them


@pytest.mark.parametrize("how", ["upload", "params", "upload_ptsz", "params_ptsz"])
def test_graph_memory_given_before_a_launch_is_charged_before_the_driver_gives_it(
    shim: Shim, how: str
) -> None:
    """cuGraphUpload, and cuGraphInstantiateWithParams with the upload flag, give an executable
    its memory before any launch: charged then, refused past the limit, never charged twice."""
    limit = 2 * GIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    p = shim.start("shim_graph", "handle", 0, GIB, 64 * MIB, how, env=env)
    try:
        out = read_until(p, "hold")
        assert int(out["give1"]) == 0 and int(out["gmem1"]) == GIB  # the driver gave it
        assert int(out["view_free1"]) == limit - CONTEXT - GIB  # ... and it was charged
        assert int(out["launch1"]) == 0
        assert int(out["gmem1l"]) == GIB  # the launch took nothing more
        assert int(out["view_free1l"]) == limit - CONTEXT - GIB  # ... and was charged nothing
        assert int(out["give2"]) == OOM  # a second copy does not fit: refused before the driver
        assert int(out["gmem2"]) == GIB
        assert int(out["view_free2"]) == limit - CONTEXT - GIB
        if how.startswith("params"):
            assert int(out["result1"]) == 0  # CUDA_GRAPH_INSTANTIATE_SUCCESS
            assert int(out["result2"]) == 1  # CUDA_GRAPH_INSTANTIATE_ERROR: see the return value
        allocated = int(out["allocated"])
        assert allocated == (limit - CONTEXT - GIB) // (64 * MIB) * 64 * MIB
        # The GPU holds the context, one copy and the chunks: the refused one left nothing.
        assert physical(shim) == CONTEXT + GIB + allocated <= limit
    finally:
        r = finish(p)
    assert r.rc == 0, r.stderr
    assert r.int("end_free") == limit - CONTEXT  # the graph's memory went with it
    assert r.int("end_gmem") == 0


def test_a_contexts_growth_is_charged_and_refused_past_the_limit(shim: Shim) -> None:
    limit = 2 * GIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(limit)})
    grow = shim.run("shim_ctx", "handle", "limit", 512 * MIB, env=env)
    assert grow.rc == 0, grow.stderr
    assert grow.int("set") == 0 and grow.int("heap") == 512 * MIB
    assert grow.int("free") == limit - CONTEXT - (512 - 8) * MIB  # beyond the 8 MiB default
    assert grow.int("end_free") == limit - CONTEXT  # given back with the context
    over = shim.run("shim_ctx", "handle", "limit", 2 * GIB, env=env)
    assert over.rc == 0, over.stderr
    assert over.int("set") == OOM and over.int("heap") == 8 * MIB  # refused, the old size kept
    assert over.int("free") == limit - CONTEXT
