"""A container with its own pid namespace, as on a real cluster: the driver's NVML lists its
processes by their pids in the node's namespace (simgpu: SIMGPU_HOST_PROC, NVML.md), never by
the pid the process sees. The memory the GPU holds for it must still stay within its limit,
contexts included, however the context was made (ctx.c: the shim learns its node pid by a
probe). Program: tests/native/shim_ctx_fill.c. The node's contexts take 300 MiB (conftest).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_of, require_root
from test_shim_helpers import (
    CONTEXT,
    GIB,
    MIB,
    OOM,
    Shim,
    finish,
    parse,
    read_until,
    start_together,
)

from vgpu_plugin.sim.simgpu import Node

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients"))
from client_helpers import cudart_path

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "client_prog.py"


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def start_in_pid_namespace(
    shim: Shim, tmp: Path, prog: str | Path, *args: str | int, limits: dict[str, str]
) -> subprocess.Popen[str]:
    """prog as pid 1 of a new pid namespace, the node's /proc bound where SIMGPU_HOST_PROC
    says, as a container runtime with the node's /proc mounted into the container leaves it."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a pid namespace")
    require_root()
    host_proc = tmp / "host-proc"
    host_proc.mkdir(parents=True, exist_ok=True)
    env = shim.env(limits)
    env["SIMGPU_HOST_PROC"] = str(host_proc)
    # The shim goes into the program only: unshare and sh are not the container's CUDA process
    # (and the sanitizer build's leak checker cannot run in unshare's parent).
    env["TEST_PRELOAD"] = env.pop("LD_PRELOAD")
    script = (
        'mount --bind /proc "$0" && mount -t proc proc /proc && '
        'LD_PRELOAD="$TEST_PRELOAD" exec "$@"'
    )
    argv = ["unshare", "--mount", "--pid", "--fork", "sh", "-c", script, str(host_proc)]
    return subprocess.Popen(
        [*argv, str(shim.prog(prog) if isinstance(prog, str) else prog), *map(str, args)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["runtime", "create", "retain"])
def test_a_container_in_its_own_pid_namespace_holds_no_more_than_its_limit(
    shim: Shim, tmp_path: Path, how: str
) -> None:
    limit = 2 * GIB
    chunk = 64 * MIB
    p = start_in_pid_namespace(
        shim,
        tmp_path,
        "shim_ctx_fill",
        "handle",
        how,
        chunk,
        limits={"CUDA_DEVICE_MEMORY_LIMIT": str(limit), "LIBVGPU_LOG_LEVEL": "debug"},
    )
    try:
        node_pid = child_of(p.pid)
        out = read_until(p, "holding")
        assert int(out["refusal"]) == OOM
        # What the simulated GPU holds for the process, its context included.
        assert shim.node.gpu(0).used_memory <= limit
        # And the context was charged what it takes, no more: the rest of the limit was usable.
        assert int(out["allocated"]) == (limit - CONTEXT) // chunk * chunk
        # Nothing else is charged: the probe that found the process in NVML's list was not.
        assert int(out["view_free"]) == limit - CONTEXT - int(out["allocated"])
    finally:
        r = finish(p)
    assert r.rc == 0, r.stderr
    # The shim found itself in NVML's list by its pid on the node, not the pid it sees (1).
    assert f"NVML lists this process (pid 1 here) as pid {node_pid}" in r.stderr


def test_two_containers_pid_1s_starting_together_are_each_charged_their_context(
    shim: Shim, tmp_path: Path
) -> None:
    """Two containers whose CUDA processes are both pid 1 and probe at about the same time:
    each finds its own entry (a neighbour's probe is another size, or is ambiguity and tried
    again), so each holds its limit, its context included."""
    limit = 2 * GIB
    chunk = 64 * MIB
    other = Shim(shim.tree, shim.node, tmp_path / "other")
    limits = {"CUDA_DEVICE_MEMORY_LIMIT": str(limit), "LIBVGPU_LOG_LEVEL": "debug"}
    procs = [
        start_in_pid_namespace(s, s.tmp, "shim_ctx_fill", "handle", "runtime", chunk, limits=limits)
        for s in (shim, other)
    ]
    try:
        node_pids = [child_of(p.pid) for p in procs]
        outs = [read_until(p, "holding") for p in procs]
        assert shim.node.gpu(0).used_memory <= 2 * limit
        for out in outs:
            assert int(out["allocated"]) == (limit - CONTEXT) // chunk * chunk
            assert int(out["view_free"]) == limit - CONTEXT - int(out["allocated"])
    finally:
        results = [finish(p) for p in procs]
    for r, node_pid in zip(results, node_pids, strict=True):
        assert r.rc == 0, r.stderr
        assert f"NVML lists this process (pid 1 here) as pid {node_pid}" in r.stderr


@pytest.mark.parametrize("major", [12, 13])
def test_nvidias_runtime_in_its_own_pid_namespace_fills_its_limit_context_included(
    shim: Shim, tmp_path: Path, major: int
) -> None:
    """NVIDIA's libcudart (tests/clients/client_prog.py), which makes its primary context
    through the driver's private table, out of the shim's sight."""
    limit = GIB
    chunk = 64 * MIB
    p = start_in_pid_namespace(
        shim, tmp_path, Path(sys.executable), CLIENT, "cudart", cudart_path(major), "fill", chunk,
        limits={"CUDA_DEVICE_MEMORY_LIMIT": str(limit)},
    )  # fmt: skip
    r = finish(p, timeout=120)
    assert r.rc == 0, r.stderr
    out = parse(r.stdout)
    assert int(out["total"]) == limit
    assert int(out["refusal"]) == 2  # cudaErrorMemoryAllocation
    # The context counted: what the GPU held at the refusal stayed within the limit.
    assert int(out["allocated"]) == (limit - CONTEXT) // chunk * chunk


def test_the_probe_finds_the_process_while_a_neighbour_allocates_and_frees(
    shim: Shim, tmp_path: Path
) -> None:
    """Another container's processes (no shim) churning allocations of 8 to 64 MiB on the GPU
    while the probe runs: its entry is still told apart, and the context charged exactly."""
    neighbours = [
        shim.start("shim_stress", "default", 0, 4, 4, 8 * MIB, 64 * MIB, env=shim.env(shim=False))
        for _ in range(2)
    ]
    try:
        start_together(neighbours)
        limit = 2 * GIB
        chunk = 64 * MIB
        limits = {"CUDA_DEVICE_MEMORY_LIMIT": str(limit), "LIBVGPU_LOG_LEVEL": "debug"}
        p = start_in_pid_namespace(
            shim, tmp_path, "shim_ctx_fill", "handle", "runtime", chunk, limits=limits
        )
        node_pid = child_of(p.pid)
        out = read_until(p, "holding")
        r = finish(p)
        assert r.rc == 0, r.stderr
        assert f"NVML lists this process (pid 1 here) as pid {node_pid}" in r.stderr
        assert int(out["allocated"]) == (limit - CONTEXT) // chunk * chunk
        assert int(out["view_free"]) == limit - CONTEXT - int(out["allocated"])
    finally:
        for n in neighbours:
            n.kill()
            n.communicate()  # and its pipes closed


def test_nvml_process_lists_in_the_container_show_its_processes_by_their_node_pids(
    shim: Shim, tmp_path: Path
) -> None:
    """nvidia-smi in a container: the driver lists processes by their node pids, which the
    region's slots (container pids) never name; the slot records the node pid the probe
    learned, so the container's own process is listed, and a neighbour is not."""
    # A neighbour (another container: no shim) holding memory on the same GPU.
    neighbour = shim.start(
        "shim_mem", "handle", 0, "alloc", 512 * MIB, 1, "hold", env=shim.env(shim=False)
    )
    try:
        read_until(neighbour, "holding")
        p = start_in_pid_namespace(
            shim,
            tmp_path,
            "shim_nvml_procs",
            "handle",
            limits={"CUDA_DEVICE_MEMORY_LIMIT": str(2 * GIB), "LIBVGPU_LOG_LEVEL": "debug"},
        )
        r = finish(p)
    finally:
        finish(neighbour)
    assert r.rc == 0, r.stderr
    assert r.out["self"] == "1"
    learned = re.search(r"NVML lists this process \(pid 1 here\) as pid (\d+)", r.stderr)
    assert learned, r.stderr
    node_pid = int(learned.group(1))
    assert node_pid not in (1, neighbour.pid)
    for key in ("v1", "v2", "v3"):
        listed = dict(e.split(":") for e in r.out[key].split(",") if e)
        assert listed == {str(node_pid): str(CONTEXT + 256 * MIB)}, (key, listed)
