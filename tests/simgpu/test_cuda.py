"""The simulated CUDA driver (native/simgpu: libcuda.so.1) under C driver-API programs.

Each test runs programs of tests/native/cuda_*.c (built against NVIDIA's cuda.h where the CUDA
toolkit is installed, else against our compat header) on a fresh simulated node, and checks what
they print and what the node reports against what a real driver does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from conftest import make_node, say_to_each
from simgpu_shares import MS, all_running, shares, waiting_ns

from vgpu_plugin.node.host import native
from vgpu_plugin.sim.simgpu import GpuSpec, Node

MIB = 1 << 20
GIB = 1 << 30
CAPACITY = 16 * GIB  # the simgpu_node fixture's GPUs
OVERHEAD = 300 * MIB  # ... and what each context costs on them

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
NO_DEVICE, INVALID_DEVICE, INVALID_CONTEXT = 100, 101, 201
INVALID_HANDLE, NOT_FOUND, NOT_READY, COOP_TOO_LARGE = 400, 500, 600, 720
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, UNKNOWN = 900, 901, 999


def parse(text: str) -> dict[str, str]:
    """The program's "key=value" lines."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def run(
    native_bin: Path,
    env: Mapping[str, str],
    program: str,
    *args: str,
    stdin: str | None = None,
) -> dict[str, str]:
    proc = subprocess.run(
        [str(native_bin / program), *args],
        env=dict(env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"{program} {args}: rc {proc.returncode}\n{proc.stderr}"
    return parse(proc.stdout)


def start(
    native_bin: Path, env: Mapping[str, str], program: str, *args: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(native_bin / program), *args],
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen[str], wanted: str) -> list[str]:
    """Lines the program printed up to `wanted` (it must print it)."""
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == wanted:
            return lines
    raise AssertionError(
        f"exited before {wanted!r}: {lines} {proc.stderr.read() if proc.stderr else ''}"
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return parse(out)


# --- memory -----------------------------------------------------------------------------------


def test_allocation_fails_exactly_at_capacity(simgpu_node: Node, native_bin: Path) -> None:
    out = run(native_bin, simgpu_node.env(), "cuda_mem_fill", "0")
    # The primary context took its overhead first; what is left is usable to the byte.
    assert int(out["start_free"]) == CAPACITY - OVERHEAD
    assert int(out["allocated"]) == CAPACITY - OVERHEAD
    assert int(out["last_rc"]) == OUT_OF_MEMORY
    assert int(out["end_free"]) == 0
    assert int(out["freed_free"]) == CAPACITY - OVERHEAD
    assert simgpu_node.gpu(0).used_memory == 0  # the process is gone, and so is its memory


def test_other_processes_see_usage_and_a_killed_holder_frees_it(
    simgpu_node: Node, native_bin: Path
) -> None:
    env = simgpu_node.env()
    holder = start(native_bin, env, "cuda_mem_fill", "0", "--hold", "--limit", str(4 * GIB))
    try:
        wait_for_line(holder, "holding")
        gpu = simgpu_node.gpu(0)
        assert (gpu.used_memory, gpu.live_processes) == (4 * GIB + OVERHEAD, 1)
        assert simgpu_node.gpu(1).used_memory == 0
        # Another process sees the holder's memory and its own context's.
        other = run(native_bin, env, "cuda_query", "--ctx")
        assert int(other["dev0.free"]) == CAPACITY - 4 * GIB - 2 * OVERHEAD
        assert int(other["dev1.free"]) == CAPACITY - OVERHEAD
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        gpu = simgpu_node.gpu(0)
        assert (gpu.used_memory, gpu.live_processes) == (0, 0)
    finally:
        holder.kill()
        holder.communicate()


def test_usage_is_visible_through_nvml(simgpu_node: Node, native_bin: Path) -> None:
    if not (native.simgpu_dir() / "libnvidia-ml.so.1").exists():
        pytest.skip("the simulated libnvidia-ml.so.1 is not built yet (another part of simgpu)")
    holder = start(
        native_bin, simgpu_node.env(), "cuda_mem_fill", "0", "--hold", "--limit", str(GIB)
    )
    try:
        wait_for_line(holder, "holding")
        script = (
            "import pynvml as N; N.nvmlInit(); "
            "print(N.nvmlDeviceGetMemoryInfo(N.nvmlDeviceGetHandleByIndex(0)).used)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script],
            env=simgpu_node.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert int(proc.stdout) == GIB + OVERHEAD
    finally:
        holder.kill()
        holder.communicate()


def test_every_allocation_path_charges_what_it_frees(simgpu_node: Node, native_bin: Path) -> None:
    out = {k: int(v) for k, v in run(native_bin, simgpu_node.env(), "cuda_alloc_paths").items()}
    assert (out["ctx_create"], out["ctx_destroy"]) == (OVERHEAD, -OVERHEAD)
    assert out["ctx_current_is_primary"] == 1
    assert (out["alloc"], out["alloc_free"]) == (64 * MIB, -64 * MIB)
    # Rows of 1000 bytes are padded to 1024: pitch x height is what the GPU gives.
    assert out["pitch"] == 1024
    assert (out["pitch_alloc"], out["pitch_free"]) == (1024 * 3000, -1024 * 3000)
    assert (out["managed"], out["managed_free"]) == (48 * MIB, -48 * MIB)
    assert out["host"] == 0  # page-locked host memory is not GPU memory
    assert (out["array"], out["array_free"]) == (16 * MIB, -16 * MIB)  # 1024^2 float4
    assert (out["array3d"], out["array3d_free"]) == (MIB, -MIB)  # 64^3 x 2 x uint16
    # Stream-ordered memory goes back to the node at the next synchronisation.
    assert (out["async"], out["async_free_before_sync"]) == (40 * MIB, 0)
    assert out["async_free_after_sync"] == -40 * MIB
    # A pool that keeps its memory: cached after the free, reused, released by a trim.
    assert (out["pool"], out["pool_after_free_sync"]) == (24 * MIB, 24 * MIB)
    assert (out["pool_used"], out["pool_reserved"]) == (0, 24 * MIB)
    assert (out["pool_reuse"], out["pool_trim"]) == (0, -24 * MIB)
    # VMM: charged when created; released memory lives on until its last mapping goes.
    assert out["granularity"] == 2 * MIB
    assert out["vmm_create"] == 8 * MIB
    assert (out["vmm_release_mapped"], out["vmm_unmap_one"]) == (0, 0)
    assert out["vmm_unmap_all"] == -8 * MIB
    assert simgpu_node.gpu(0).used_memory == 0


def level_bytes(w: int, h: int, d: int, elem: int, levels: int, keep_depth: bool = False) -> int:
    """Levels [0, levels) of an array: max(1, extent >> l) elements per spatial dimension
    (NVIDIA's mip level sizes); a layered array's layers and a cubemap's faces do not shrink."""
    total = 0
    for lvl in range(levels):
        depth = (d if keep_depth else max(1, d >> lvl)) if d else 1
        total += max(1, w >> lvl) * (max(1, h >> lvl) if h else 1) * depth * elem
    return total


def test_layered_cubemap_and_mipmapped_arrays_are_charged_their_full_size(
    simgpu_node: Node, native_bin: Path
) -> None:
    out = {k: int(v) for k, v in run(native_bin, simgpu_node.env(), "cuda_alloc_paths").items()}
    # Depth is the layer count of a layered array and the faces of a cubemap.
    expected = {
        "layered1d": 1024 * 64 * 16,
        "layered2d": 256 * 256 * 16 * 4,
        "cubemap": 512 * 512 * 6 * 4,
        "cubemap_layered": 256 * 256 * 12 * 4,
    }
    for name, size in expected.items():
        assert (out[name], out[f"{name}_free"]) == (size, -size), name
    # Shapes the driver documents as invalid: a cubemap's faces must be square and 6 (6n if
    # layered), a layered array needs layers, a 1D array has no depth.
    refused = ["cubemap_square", "cubemap_faces", "cubemap_layers", "layered_no_layers", "1d_depth"]
    assert {r: out[f"bad_{r}_refused"] for r in refused} == dict.fromkeys(refused, INVALID_VALUE)
    # A mipmapped array: the sum of its levels. 0 levels is 1; 1024 x 256 has 11 at most.
    for n in range(13):
        size = level_bytes(1024, 256, 0, 4, min(max(n, 1), 11))
        assert (out[f"mip2d_{n}"], out[f"mip2d_{n}_free"]) == (size, -size), n
    assert out["mip2d_2"] == 1024 * 256 * 4 + 512 * 128 * 4
    assert out["mip3d"] == level_bytes(64, 32, 16, 1, 7)  # 3D: depth shrinks too
    assert out["mip1d"] == (1000 + 500 + 250 + 125) * 2
    assert out["mip_cubemap"] == level_bytes(256, 256, 6, 4, 3, keep_depth=True)
    assert out["mip_layered"] == level_bytes(128, 128, 10, 4, 4, keep_depth=True)
    # Its levels are its own: one handle per level, not destroyable apart, gone with it.
    assert out["mip_levels"] == level_bytes(64, 64, 0, 4, 3)
    assert (out["mip_level_same"], out["mip_level_distinct"]) == (1, 1)
    assert out["mip_level_past_last"] == INVALID_VALUE
    assert (out["mip_level_destroy"], out["mip_level_destroy_freed"]) == (INVALID_HANDLE, 0)
    assert out["mip_levels_free"] == -out["mip_levels"]
    assert out["mip_destroy_twice"] == INVALID_HANDLE
    # Destroying its context frees it.
    assert out["mip_ctx"] == OVERHEAD + level_bytes(512, 512, 0, 16, 10)
    assert out["mip_ctx_destroyed"] == 0
    assert simgpu_node.gpu(0).used_memory == 0


def test_sparse_arrays_hold_only_the_memory_bound_into_them(
    simgpu_node: Node, native_bin: Path
) -> None:
    out = {k: int(v) for k, v in run(native_bin, simgpu_node.env(), "cuda_alloc_paths").items()}
    # 16 GiB, 16 GiB and 1.3 GiB of nominal size on a 16 GiB GPU: nothing of their own.
    assert (out["sparse"], out["deferred"], out["sparse_mipmapped"]) == (0, 0, 0)
    assert out["tile_pools"] == 12 * MIB  # the cuMemCreate memory is what is charged ...
    assert out["map"] == 0  # ... once: binding it into arrays takes nothing more
    # Bound memory lives on after its handle's release, until unbound or its array goes.
    assert out["bound_release"] == 0
    assert (out["unmap"], out["bound_array_destroy"]) == (-4 * MIB, -8 * MIB)
    assert out["sparse_rest_free"] == -(2 * MIB + 64 * 64 * 4)
    refused = ["map_dense", "map_not_tile_pool", "map_other_device", "map_past_last_level"]
    assert {r: out[r] for r in refused} == dict.fromkeys(refused, INVALID_VALUE)
    assert simgpu_node.gpu(0).used_memory == 0


def test_copies_move_data_and_misuse_is_refused(simgpu_node: Node, native_bin: Path) -> None:
    out = {k: int(v) for k, v in run(native_bin, simgpu_node.env(), "cuda_alloc_paths").items()}
    assert out["roundtrip_ok"] == out["memset8_ok"] == out["memset32_ok"] == 1
    assert out["vmm_alias_ok"] == 1  # two mappings of one handle see the same bytes
    assert out["vmm_copy_before_access"] == INVALID_VALUE  # mapped, not yet accessible
    refused = [
        "free_twice",
        "free_unknown",
        "free_interior",
        "free_host_with_cuMemFree",
        "free_host_twice",
        "memset32_misaligned",
        "copy_past_end",
        "copy_to_host_pointer",
        "vmm_unaligned",
        "vmm_release_twice",
    ]
    assert {name: out[name] for name in refused} == dict.fromkeys(refused, INVALID_VALUE)
    assert out["free_null"] == out["free_host_null"] == SUCCESS  # free(NULL) semantics


# --- the execution timeline -------------------------------------------------------------------


def test_a_busy_process_reads_as_full_utilization(simgpu_node: Node, native_bin: Path) -> None:
    # 64 kernels (640 ms) queued ahead: the GPU stays busy through a late wake-up of the
    # process, and the count is taken on simgpu's clock. The utilization is read once 1.1 s
    # of the 3 s have passed, leaving this test 2 s to get to the read.
    args = ("0", "10000", "3", "1.1", "64")
    proc = start(native_bin, simgpu_node.env(), "cuda_workload", *args)
    wait_for_line(proc, "warm")
    busy, idle = simgpu_node.gpu(0).utilization, simgpu_node.gpu(1).utilization
    out = finish(proc)
    assert busy >= 95
    assert idle == 0
    assert 290 <= int(out["completed"]) <= 300  # 3 s of 10 ms kernels


@pytest.mark.parametrize("timeslice", ["", "2ms"], ids=["one-at-a-time", "time-sliced"])
def test_gpu_time_is_shared_by_the_processes_of_a_gpu(
    simgpu_node: Node, native_bin: Path, timeslice: str
) -> None:
    env = {**simgpu_node.env(), "SIMGPU_TIMESLICE": timeslice}
    procs = [start(native_bin, env, "cuda_workload", str(gpu), "10000", "1.5") for gpu in (0, 0, 1)]
    done = [int(finish(p)["completed"]) for p in procs]
    alone = 150  # what one process completes on a GPU of its own in 1.5 s
    # Two processes on GPU 0 split its time; the one on GPU 1 has all of its GPU.
    assert all(0.35 * alone <= n <= 0.65 * alone for n in done[:2]), done
    assert 0.85 * alone <= done[0] + done[1] <= alone + 2, done
    assert done[2] >= 0.9 * alone, done


def test_events_time_kernels_and_queries_see_them_pending(
    simgpu_node: Node, native_bin: Path
) -> None:
    out = run(native_bin, simgpu_node.env(), "cuda_streams", "events")
    ms = {k: float(v) for k, v in out.items() if k.endswith("_ms")}
    codes = {k: int(v) for k, v in out.items() if not k.endswith("_ms")}
    assert ms["kernel_ms"] == pytest.approx(10.0, abs=0.05)
    assert ms["sleep_ms"] == pytest.approx(20.0, abs=0.05)  # simgpu_sleep's parameter, in ns
    assert ms["ex_and_coop_ms"] == pytest.approx(20.0, abs=0.5)
    assert 9.5 <= ms["event_sync_wall_ms"] <= 60  # a synchronize really waits
    assert 29 <= ms["ctx_sync_wall_ms"] <= 90
    assert codes["event_query_pending"] == codes["stream_query_pending"] == NOT_READY
    assert codes["elapsed_pending"] == NOT_READY
    assert codes["event_query_done"] == codes["stream_query_done"] == SUCCESS
    assert codes["query_unrecorded"] == SUCCESS
    assert codes["elapsed_unrecorded"] == codes["elapsed_untimed"] == INVALID_HANDLE
    assert (codes["coop_too_large"], codes["bad_block"]) == (COOP_TOO_LARGE, INVALID_VALUE)
    # A stream waiting on an event is pending until the event's point is reached.
    assert (codes["wait_event_query"], codes["wait_event_query_after"]) == (NOT_READY, SUCCESS)


def test_an_event_waits_for_the_gpu_to_turn_to_its_context(
    simgpu_node: Node, native_bin: Path
) -> None:
    """Contexts time-share a GPU: an event recorded while another context's 50 ms kernel runs
    is written when that kernel ends, so a bracket around 10 ms of work measures 10 ms."""
    out = run(native_bin, simgpu_node.env(), "cuda_streams", "contexts")
    assert int(out["start_query"]) == NOT_READY
    assert 45 <= float(out["start_wall_ms"]) <= 150
    assert float(out["bracket_ms"]) == pytest.approx(10.0, abs=0.05)
    assert int(out["own_stream_query"]) == SUCCESS


@pytest.mark.parametrize("timeslice", ["", "2ms"], ids=["one-at-a-time", "time-sliced"])
def test_the_record_of_work_says_how_long_each_process_waited_on_the_gpu(
    simgpu_node: Node, native_bin: Path, timeslice: str
) -> None:
    """Node.spans: two processes that keep a GPU busy with 10 ms kernels each run about half the
    time and wait on the GPU (work queued, from launch to its end) nearly all of it, so a test
    can tell a launcher the GPU kept waiting from one the host did not run (waiting_ns)."""
    env = {**simgpu_node.env(), "SIMGPU_TIMESLICE": timeslice}
    t0 = time.monotonic_ns()
    # 8 kernels in flight each: a loaded host that wakes one late does not let its queue run dry
    args = ("0", "10000", "1.5", "-1", "8")
    procs = [start(native_bin, env, "cuda_workload", *args) for _ in range(2)]
    for p in procs:
        finish(p)
    t1 = time.monotonic_ns()
    pids = [p.pid for p in procs]
    a, b = all_running(simgpu_node, pids, t0, t1)
    a, b = a + 200 * MS, b - 200 * MS
    assert b - a >= 500 * MS, (a, b)
    spans = simgpu_node.spans(0, a, b)
    assert all(s.queued_ns <= s.start_ns < s.end_ns for s in spans), spans
    assert all(s.end_ns > a and s.queued_ns < b for s in spans), spans
    busy = simgpu_node.busy(0, a, b)
    for pid in pids:
        # a launcher the host delays between kernels waits less; none waits longer than all
        assert waiting_ns(spans, pid, a, b) >= 0.85 * (b - a), (pid, busy)
        assert 0.3 * (b - a) <= busy[pid] <= 0.7 * (b - a), (pid, busy)
    assert simgpu_node.spans(0, t1, t1 + 1) == []


def test_time_sliced_contexts_stretch_each_others_kernels(
    simgpu_node: Node, native_bin: Path
) -> None:
    """SIMGPU_TIMESLICE: the GPU turns between contexts with work every slice, so the event is
    written at once and the 10 ms kernel beside the other context's 50 ms one takes its own
    five 2 ms slices and the other's four in between."""
    env = {**simgpu_node.env(), "SIMGPU_TIMESLICE": "2ms"}
    out = run(native_bin, env, "cuda_streams", "contexts")
    assert int(out["start_query"]) == SUCCESS
    assert float(out["start_wall_ms"]) < 45
    assert float(out["bracket_ms"]) == pytest.approx(18.0, abs=0.05)


@pytest.mark.parametrize("contexts", [3, 4])
def test_time_sliced_contexts_together_do_one_gpus_work(
    simgpu_node: Node, native_bin: Path, contexts: int
) -> None:
    """SIMGPU_TIMESLICE with three or four processes keeping the GPU busy (32 kernels of 1
    and 15 ms in flight each): their GPU time adds up to the GPU's time, about a share each.
    A slice delays every other busy context's work by all of it; split among them, three
    contexts did 118 % of a GPU's work and four 134 % (2026-11-28). Measured in simgpu's
    clock from a second after all ran (the model's records of work handed out before the
    others queued overlap at first) to 200 ms before the end. A loaded host that starves a
    launcher leaves the GPU idle, so the sum's bound does not depend on the host."""
    env = {**simgpu_node.env(), "SIMGPU_TIMESLICE": "2ms", "SHIM_LAUNCH_GATE": "1"}
    args = ("handle", "0", "kernel", "1000,15000", "4", "32")
    procs = [start(native_bin, env, "shim_launch", *args) for _ in range(contexts)]
    try:
        for p in procs:
            wait_for_line(p, "ready")
        t0 = time.monotonic_ns()
        say_to_each(procs, "go")
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pids = [p.pid for p in procs]
    a, b = all_running(simgpu_node, pids, t0, time.monotonic_ns())
    a, b = a + 1000 * MS, b - 200 * MS
    assert b - a >= 1500 * MS, (a, b)
    got = shares(simgpu_node, pids, a, b)
    assert sum(got) <= 104.0, got
    # Each one about its share while all are busy (starved launchers only ever take less).
    assert max(got) <= 100.0 / contexts + 8.0, got


def test_a_bad_timeslice_is_named_and_not_time_sliced(simgpu_node: Node, native_bin: Path) -> None:
    env = {**simgpu_node.env(), "SIMGPU_TIMESLICE": "2 parsecs"}
    env.pop("SIMGPU_QUIET", None)
    proc = subprocess.run(
        [str(native_bin / "cuda_streams"), "contexts"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "SIMGPU_TIMESLICE=2 parsecs is not a duration" in proc.stderr
    assert float(parse(proc.stdout)["bracket_ms"]) == pytest.approx(10.0, abs=0.05)


def test_per_thread_streams_are_independent_and_the_legacy_stream_serialises(
    simgpu_node: Node, native_bin: Path
) -> None:
    out = run(native_bin, simgpu_node.env(), "cuda_streams", "ptds")
    for r in ("a_ptds", "a_legacy"):  # B's queries came while A's kernel ran
        assert out[f"{r}_late"] == "0", f"{r}: thread B was starved past A's 500 ms kernel"
    # Thread A queued 500 ms on its per-thread default stream: thread B's own per-thread
    # stream, and its streams that do not wait for the legacy stream, are free; the legacy
    # stream waits for every blocking stream.
    ready = {"ptds", "ptds_handle", "nonblocking", "blocking"}
    for name in [*ready, "legacy"]:
        assert int(out[f"a_ptds_{name}"]) == (SUCCESS if name in ready else NOT_READY), name
    assert float(out["a_ptds_ptds_done_ms"]) < 500  # did not wait for A's kernel
    # Synchronising the legacy stream covers what it would wait for, even with nothing on it.
    assert int(out["a_ptds_legacy_stream_query"]) == NOT_READY
    assert float(out["a_ptds_legacy_done_ms"]) >= 490
    # Thread A queued 500 ms on the legacy stream: everything blocking waits for it.
    for name in ["ptds", "ptds_handle", "blocking", "legacy"]:
        assert int(out[f"a_legacy_{name}"]) == NOT_READY, name
    assert int(out["a_legacy_nonblocking"]) == SUCCESS
    assert float(out["a_legacy_ptds_done_ms"]) >= 490


def test_graphs_run_their_kernels_in_order(simgpu_node: Node, native_bin: Path) -> None:
    out = run(native_bin, simgpu_node.env(), "cuda_streams", "graph")
    assert int(out["capturing"]) == 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert int(out["captured_ran"]) == SUCCESS  # capturing queued nothing
    assert int(out["captured_nodes"]) == 3
    assert float(out["captured_graph_x2_ms"]) == pytest.approx(60.0, abs=0.1)
    assert float(out["built_graph_ms"]) == pytest.approx(15.0, abs=0.1)
    assert int(out["sync_while_capturing"]) == CAPTURE_UNSUPPORTED
    assert int(out["end_invalidated"]) == CAPTURE_INVALIDATED
    assert int(out["capture_legacy"]) == CAPTURE_UNSUPPORTED


@pytest.mark.parametrize("how", ["upload", "params"])
def test_an_upload_gives_a_graph_its_memory_and_a_later_launch_takes_none(
    simgpu_node: Node, native_bin: Path, how: str
) -> None:
    """cuGraphUpload, or cuGraphInstantiateWithParams with the upload flag, without the shim
    (shim_graph: two executables of a graph with a 1 GiB allocation node, each uploaded)."""
    args = ("handle", "0", str(GIB), str(GIB), how)
    out = run(native_bin, simgpu_node.env(), "shim_graph", *args, stdin="\n")
    assert int(out["give1"]) == SUCCESS
    assert int(out["gmem1"]) == GIB  # resident before any launch
    assert int(out["view_free1"]) == CAPACITY - OVERHEAD - GIB  # on the GPU
    assert int(out["launch1"]) == SUCCESS
    assert int(out["gmem1l"]) == GIB  # the launch found it there
    assert int(out["view_free1l"]) == CAPACITY - OVERHEAD - GIB
    assert int(out["give2"]) == SUCCESS and int(out["gmem2"]) == 2 * GIB
    if how == "params":
        assert int(out["result1"]) == int(out["result2"]) == 0  # CUDA_GRAPH_INSTANTIATE_SUCCESS
    assert int(out["end_gmem"]) == 0  # given back with the executables
    assert int(out["end_free"]) == CAPACITY - OVERHEAD


@pytest.mark.parametrize("how", ["upload", "params"])
def test_an_upload_the_gpu_cannot_hold_is_refused_as_a_launch_is(
    simgpu_node: Node, native_bin: Path, how: str
) -> None:
    args = ("handle", "0", str(CAPACITY), str(GIB), how)
    out = run(native_bin, simgpu_node.env(), "shim_graph", *args, stdin="\n")
    assert int(out["give1"]) == OUT_OF_MEMORY
    assert int(out["gmem1"]) == 0 and int(out["view_free1"]) == CAPACITY - OVERHEAD  # nothing held
    if how == "params":
        assert int(out["result1"]) == 1  # CUDA_GRAPH_INSTANTIATE_ERROR: see the return value
    else:
        assert int(out["launch1"]) == OUT_OF_MEMORY  # the launch cannot either


def test_launch_queue_is_bounded(simgpu_node: Node, native_bin: Path) -> None:
    out = {
        k: float(v) for k, v in run(native_bin, simgpu_node.env(), "cuda_streams", "bound").items()
    }
    # 1100 launches of 0.5 ms: the 76 beyond 1024 pending each wait for one to finish.
    assert out["count_bound_launch_ms"] >= 30
    # 13 launches of 100 ms: the launching thread is held to ~1 s ahead of the GPU.
    assert out["time_bound_launch_ms"] >= 150
    assert out["time_bound_sync_ms"] <= 1200


# --- cuGetProcAddress -------------------------------------------------------------------------

DEFAULT, LEGACY, PER_THREAD = 0, 1, 2


def get_proc(
    native_bin: Path, node: Node, queries: Sequence[tuple[str, str, int, int]]
) -> list[tuple[int, int, str]]:
    """(rc, status, exported name) per (api, symbol, cudaVersion, flags); each pointer returned
    is checked to be the one dlsym gives for that name."""
    text = "".join(f"{api} {sym} {ver} {flags}\n" for api, sym, ver, flags in queries)
    proc = subprocess.run(
        [str(native_bin / "cuda_getproc")],
        env=node.env(),
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    results = []
    for query, line in zip(queries, proc.stdout.splitlines(), strict=True):
        rc, status, name, match = line.split()
        assert name == "-" or match == "1", f"{query}: pointer differs from dlsym({name})"
        results.append((int(rc), int(status), name))
    return results


def test_get_proc_address_versions_and_per_thread_variants(
    simgpu_node: Node, native_bin: Path
) -> None:
    cases: list[tuple[tuple[str, str, int, int], tuple[int, int, str]]] = [
        (("v2", "cuMemAlloc", 3010, DEFAULT), (SUCCESS, 0, "cuMemAlloc")),
        (("v2", "cuMemAlloc", 3020, DEFAULT), (SUCCESS, 0, "cuMemAlloc_v2")),
        (("v2", "cuMemAlloc", 13000, PER_THREAD), (SUCCESS, 0, "cuMemAlloc_v2")),
        (("v2", "cuCtxCreate", 2000, DEFAULT), (SUCCESS, 0, "cuCtxCreate")),
        (("v2", "cuCtxCreate", 3020, DEFAULT), (SUCCESS, 0, "cuCtxCreate_v2")),
        (("v2", "cuCtxCreate", 11040, DEFAULT), (SUCCESS, 0, "cuCtxCreate_v3")),
        (("v2", "cuCtxCreate", 12050, DEFAULT), (SUCCESS, 0, "cuCtxCreate_v4")),
        (("v2", "cuGetProcAddress", 11030, DEFAULT), (SUCCESS, 0, "cuGetProcAddress")),
        (("v2", "cuGetProcAddress", 12000, DEFAULT), (SUCCESS, 0, "cuGetProcAddress_v2")),
        (("v1", "cuGetProcAddress", 12000, DEFAULT), (SUCCESS, -1, "cuGetProcAddress_v2")),
        (("v2", "cuLaunchKernel", 12000, PER_THREAD), (SUCCESS, 0, "cuLaunchKernel_ptsz")),
        (("v2", "cuLaunchKernel", 12000, DEFAULT), (SUCCESS, 0, "cuLaunchKernel")),
        (("v2", "cuLaunchKernel", 12000, LEGACY), (SUCCESS, 0, "cuLaunchKernel")),
        (("v2", "cuLaunchKernel", 6050, PER_THREAD), (SUCCESS, 0, "cuLaunchKernel")),
        (("v2", "cuMemcpyHtoD", 12000, PER_THREAD), (SUCCESS, 0, "cuMemcpyHtoD_v2_ptds")),
        (("v2", "cuMemcpyAsync", 12000, PER_THREAD), (SUCCESS, 0, "cuMemcpyAsync_ptsz")),
        (("v2", "cuMemsetD32Async", 12000, PER_THREAD), (SUCCESS, 0, "cuMemsetD32Async_ptsz")),
        (("v2", "cuEventRecord", 12000, PER_THREAD), (SUCCESS, 0, "cuEventRecord_ptsz")),
        (
            ("v2", "cuStreamSynchronize", 12000, PER_THREAD),
            (SUCCESS, 0, "cuStreamSynchronize_ptsz"),
        ),
        (("v2", "cuGraphLaunch", 12000, PER_THREAD), (SUCCESS, 0, "cuGraphLaunch_ptsz")),
        (("v2", "cuGraphUpload", 12000, PER_THREAD), (SUCCESS, 0, "cuGraphUpload_ptsz")),
        (("v2", "cuGraphUpload", 11010, DEFAULT), (SUCCESS, 0, "cuGraphUpload")),
        (
            ("v2", "cuGraphInstantiateWithParams", 12000, PER_THREAD),
            (SUCCESS, 0, "cuGraphInstantiateWithParams_ptsz"),
        ),
        (("v2", "cuGraphInstantiateWithParams", 11080, DEFAULT), (NOT_FOUND, 2, "-")),
        (("v2", "cuEventElapsedTime", 12080, DEFAULT), (SUCCESS, 0, "cuEventElapsedTime_v2")),
        (("v2", "cuGraphInstantiate", 12000, DEFAULT), (SUCCESS, 0, "cuGraphInstantiateWithFlags")),
        (
            ("v2", "cuStreamBeginCapture", 12000, PER_THREAD),
            (SUCCESS, 0, "cuStreamBeginCapture_v2_ptsz"),
        ),
        (("v2", "cuMemAllocAsync", 11010, DEFAULT), (NOT_FOUND, 2, "-")),  # newer than asked
        (("v2", "cuNoSuchFunction", 12000, DEFAULT), (NOT_FOUND, 1, "-")),
        (("v2", "cuMemAlloc_v2", 12000, DEFAULT), (NOT_FOUND, 1, "-")),  # base names only
        (("v2", "cuMemAlloc", 12000, 4), (INVALID_VALUE, -1, "-")),  # unknown flag
    ]
    got = get_proc(native_bin, simgpu_node, [q for q, _ in cases])
    assert dict(zip([q for q, _ in cases], got, strict=True)) == dict(cases)


def cuda_typedefs() -> Path | None:
    """NVIDIA's cudaTypedefs.h, whose PFN_<name>_v<version> typedefs list every variant."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cudaTypedefs.h").exists():
            return Path(root) / "include" / "cudaTypedefs.h"
    return None


def test_get_proc_address_matches_nvidia_versions(simgpu_node: Node, native_bin: Path) -> None:
    header = cuda_typedefs()
    if header is None:
        pytest.skip("the CUDA toolkit's cudaTypedefs.h is not installed")
    variants: dict[str, set[int]] = {}
    per_thread: dict[str, set[int]] = {}
    for name, version, ptds in re.findall(
        r"PFN_(cu\w+?)_v(\d+)(_pt[sd]z|_ptds)?\b", header.read_text()
    ):
        (per_thread if ptds else variants).setdefault(name, set()).add(int(version))
    names = sorted(variants)
    probe = get_proc(native_bin, simgpu_node, [("v2", n, 99999, DEFAULT) for n in names])
    ours = [n for n, (rc, _, _) in zip(names, probe, strict=True) if rc == SUCCESS]
    assert len(ours) > 100  # everything the simulator implements has a PFN typedef
    queries: list[tuple[str, str, int, int]] = []
    expected: list[str] = []
    for name in ours:
        versions = sorted(variants[name])
        # The i-th variant of a name is exported as name, name_v2, name_v3, ...
        for i, version in enumerate(versions):
            queries.append(("v2", name, version, DEFAULT))
            expected.append(name + (f"_v{i + 1}" if i else ""))
        queries.append(("v2", name, versions[0] - 1, DEFAULT))
        expected.append("-")
        for version in sorted(per_thread.get(name, ())):
            queries.append(("v2", name, version, PER_THREAD))
            expected.append("ptds")
    got = get_proc(native_bin, simgpu_node, queries)
    for query, want, (rc, status, symbol) in zip(queries, expected, got, strict=True):
        if want == "-":
            assert (rc, status) == (NOT_FOUND, 2), query  # VERSION_NOT_SUFFICIENT
        elif want == "ptds":
            assert symbol.endswith(("_ptsz", "_ptds")), query
        else:
            assert symbol == want, query


# --- devices and visibility -------------------------------------------------------------------


def hex_uuid(uuid: str) -> str:
    return uuid.removeprefix("GPU-").replace("-", "")


def test_devices_and_errors_before_init_and_without_context(
    simgpu_node: Node, native_bin: Path
) -> None:
    out = run(native_bin, simgpu_node.env(), "cuda_query")
    gpus = simgpu_node.gpus()
    assert int(out["before_init"]) == NOT_INITIALIZED
    assert int(out["driver_version"]) == 13000
    assert (int(out["init"]), int(out["count"])) == (SUCCESS, 2)
    assert int(out["alloc_without_ctx"]) == INVALID_CONTEXT
    assert int(out["get_bad_ordinal"]) == INVALID_DEVICE
    for i, gpu in enumerate(gpus):
        assert out[f"dev{i}.name"] == gpu.name
        assert out[f"dev{i}.uuid"] == hex_uuid(gpu.uuid)
        assert int(out[f"dev{i}.total"]) == gpu.total_memory
        assert int(out[f"dev{i}.sms"]) == gpu.sm_count
        assert out[f"dev{i}.cc"] == "9.0"
        # "00000000:17:00.0" on the node is "0000:17:00.0" to CUDA, and finds the device.
        assert out[f"dev{i}.bus_id"] == gpu.pci_bus_id[4:].lower()
        assert out[f"dev{i}.pci"] == "0:{:x}:0".format(int(gpu.pci_bus_id.split(":")[1], 16))
        assert int(out[f"dev{i}.by_bus_id"]) == i


def visible(native_bin: Path, node: Node, **env: str) -> list[str]:
    """UUIDs (hex) of the devices a process sees, in CUDA order; [] when cuInit finds none."""
    base = {k: v for k, v in node.env().items() if k not in env}
    out = run(native_bin, {**base, **env}, "cuda_query")
    if int(out["init"]) == NO_DEVICE:
        return []
    return [out[f"dev{i}.uuid"] for i in range(int(out["count"]))]


def test_visible_devices_are_honoured(native_tree: Path, native_bin: Path, tmp_path: Path) -> None:
    node = make_node(tmp_path, [GpuSpec(memory=4 * GIB) for _ in range(3)])
    u = [hex_uuid(g.uuid) for g in node.gpus()]
    full = [g.uuid for g in node.gpus()]
    assert visible(native_bin, node) == u
    # The container runtime exposes one GPU: it is device 0.
    assert visible(native_bin, node, NVIDIA_VISIBLE_DEVICES=full[2]) == [u[2]]
    assert visible(native_bin, node, NVIDIA_VISIBLE_DEVICES="2,0") == [u[0], u[2]]
    assert visible(native_bin, node, NVIDIA_VISIBLE_DEVICES="none") == []
    # CUDA_VISIBLE_DEVICES reorders and hides, by index or UUID (prefix), and ends at the
    # first entry that names no device.
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES="2,0") == [u[2], u[0]]
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES=full[1][:12]) == [u[1]]
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES=f"1,{full[0]}") == [u[1], u[0]]
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES="0,7,1") == [u[0]]
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES="1,1") == [u[1]]
    assert visible(native_bin, node, CUDA_VISIBLE_DEVICES="") == []
    # Indices count the GPUs the container has, not the node's.
    both = {"NVIDIA_VISIBLE_DEVICES": f"{full[1]},{full[2]}", "CUDA_VISIBLE_DEVICES": "1"}
    assert visible(native_bin, node, **both) == [u[2]]


def test_without_a_node_there_is_no_device(simgpu_node: Node, native_bin: Path) -> None:
    env = {k: v for k, v in simgpu_node.env().items() if k != "SIMGPU_STATE"}
    env["SIMGPU_QUIET"] = "1"
    assert int(run(native_bin, env, "cuda_query")["init"]) == NO_DEVICE


def test_a_lost_gpu_fails_its_calls(simgpu_node: Node, native_bin: Path) -> None:
    simgpu_node.set_lost(1)
    out = run(native_bin, simgpu_node.env(), "cuda_query", "--ctx")
    assert int(out["count"]) == 2  # still enumerated, as after an XID 79
    assert int(out["dev0.retain"]) == SUCCESS and int(out["dev0.alloc"]) == SUCCESS
    assert int(out["dev1.retain"]) == UNKNOWN
    simgpu_node.set_lost(1, False)
    out = run(native_bin, simgpu_node.env(), "cuda_query", "--ctx")
    assert [int(out[f"dev1.{k}"]) for k in ("retain", "meminfo", "alloc", "sync")] == [0, 0, 0, 0]


# --- the compat header ------------------------------------------------------------------------


@pytest.mark.slow
def test_compat_header_builds_and_has_nvidia_abi(
    simgpu_node: Node, native_tree: Path, compat_tree: Path
) -> None:
    compat = compat_tree  # every cuda_* program compiles against our header too
    ours = run(compat / "tests", simgpu_node.env(), "cuda_abi")
    nvidia = run(native_tree / "tests", simgpu_node.env(), "cuda_abi")
    assert ours.pop("header") == "compat"
    if nvidia.pop("header") != "nvidia":
        pytest.skip("the CUDA toolkit's cuda.h is not installed: nothing to compare with")
    assert ours == nvidia
    # The driver built on our header works like the one built on NVIDIA's.
    env = dict(simgpu_node.env(), LD_LIBRARY_PATH=str(compat / "simgpu"))
    out = run(compat / "tests", env, "cuda_streams", "graph")
    assert float(out["built_graph_ms"]) == pytest.approx(15.0, abs=0.1)


_TOOLS_CTX_TABLE = r"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
table = ctypes.c_void_p()
uuid = (ctypes.c_ubyte * 16)(*bytes.fromhex(sys.argv[1]))
print("rc=%d" % cuda.cuGetExportTable(ctypes.byref(table), uuid))
if table.value:
    slots = (ctypes.c_uint64 * 95).from_address(table.value)
    print("size=%d" % slots[0])
    print("filled=%d" % all(slots[1:]))
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    slot3 = fn(slots[3])
    print("slot3=%d" % slot3(None, None, None))
"""


def test_the_tools_context_table_the_13_5_runtime_needs_exists(simgpu_node: Node) -> None:
    # NVIDIA's runtime 13.5 refuses a driver without table 21318c60-...; it reads no slot of
    # it in anything the client tier runs, so each slot only answers "not supported".
    def ask(uuid: str) -> dict[str, str]:
        proc = subprocess.run(
            [sys.executable, "-c", _TOOLS_CTX_TABLE, uuid],
            env={**simgpu_node.env(), "SIMGPU_TRACE": "1"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return {**parse(proc.stdout), "stderr": proc.stderr}

    found = ask("21318c60971432488ca641ff7324c8f2")
    assert (found["rc"], found["size"], found["filled"]) == (str(SUCCESS), str(95 * 8), "1")
    assert found["slot3"] == "801"  # CUDA_ERROR_NOT_SUPPORTED, and the trace names the slot
    assert "export table 21318c60 slot 3 called" in found["stderr"]
    assert ask("00" * 16)["rc"] == str(NOT_FOUND)


_LT_TABLE = r"""
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
table = ctypes.c_void_p()
uuid = (ctypes.c_ubyte * 16)(*bytes.fromhex("1734dc26800d47458726c0f1e7dd8bca"))
print("rc=%d" % cuda.cuGetExportTable(ctypes.byref(table), uuid))
size = ctypes.c_uint64.from_address(table.value).value
slots = (ctypes.c_uint64 * (size // 8)).from_address(table.value)
print("size=%d" % size)
print("filled=%d" % all(slots[1:]))
out = (ctypes.c_uint64 * 2)(7, 7)
fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
print("slot4=%d" % fn(slots[4])(ctypes.addressof(out), ctypes.addressof(out) + 8))
print("untouched=%d" % (list(out) == [7, 7]))
"""


def test_the_table_cublaslt_13_calls_without_checking_exists(simgpu_node: Node) -> None:
    # cuBLASLt 13's half-precision heuristics call slot 4 of table 1734dc26-... whether or not
    # the driver gave it (a NULL jump without it); on "not supported" they go their own way.
    proc = subprocess.run(
        [sys.executable, "-c", _LT_TABLE],
        env={**simgpu_node.env(), "SIMGPU_TRACE": "1"},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    found = parse(proc.stdout)
    assert (found["rc"], found["filled"], found["untouched"]) == (str(SUCCESS), "1", "1")
    assert int(found["size"]) >= 5 * 8  # slot 4 is in the table
    assert found["slot4"] == "801"  # CUDA_ERROR_NOT_SUPPORTED, named by the trace
    assert "export table lt slot 4 called" in proc.stderr
