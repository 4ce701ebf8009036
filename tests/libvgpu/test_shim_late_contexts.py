"""A process that starts in a full container gets no context past the limit.

Process A fills its container's limit (its context and 64 MiB allocations); late processes of
the same container then start through NVIDIA's runtime (libcudart 12 and 13) or CuPy, which
make their primary context through the driver's private runtime table (cuGetExportTable), not
through any exported entry point. What the GPU holds is read from simgpu's physical
accounting, while the late processes stay alive. Program: late_client.py; A: shim_mem.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_shim_helpers import CONTEXT, GIB, MIB, OOM, Result, Shim, finish, parse, read_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients"))
from client_helpers import cudart_path, require_cupy

from vgpu_plugin.sim.simgpu import Node

LATE = Path(__file__).resolve().parent / "late_client.py"
LIMIT = 2 * GIB
CHUNK = 64 * MIB
# What NVIDIA's runtime makes of its context refused with CUDA_ERROR_OUT_OF_MEMORY: the same
# as on a GPU that is physically full without the shim (cudaErrorInitializationError).
RUNTIME_REFUSED = 3


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


@contextlib.contextmanager
def full_container(shim: Shim) -> Iterator[subprocess.Popen[str]]:
    """Process A, holding its context and 64 MiB chunks until refused: the container is full
    (less than a context left)."""
    p = shim.start("shim_mem", "handle", 0, "alloc", CHUNK, 1000, "hold", env=env(shim))
    try:
        out = read_until(p, "holding")
        assert int(out["refusal"]) == OOM
        assert LIMIT - CONTEXT < used(shim) <= LIMIT
        yield p
    finally:
        assert finish(p).rc == 0


@pytest.fixture
def full(shim: Shim) -> Iterator[subprocess.Popen[str]]:
    with full_container(shim) as p:
        yield p


def env(shim: Shim) -> dict[str, str]:
    return shim.env({"CUDA_DEVICE_MEMORY_LIMIT": str(LIMIT)})


def used(shim: Shim) -> int:
    return shim.node.gpu(0).used_memory


def late_args(client: str) -> list[str]:
    if client == "cupy":
        require_cupy()
        return ["cupy"]
    return ["cudart", str(cudart_path(int(client.removeprefix("cudart"))))]


def start_late(shim: Shim, client: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(LATE), *late_args(client)],
        env=env(shim),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def release(p: subprocess.Popen[str]) -> Result:
    out, err = p.communicate("\n", timeout=60)
    return Result(p.returncode, parse(out), out, err)


CLIENTS = ["cudart12", "cudart13", "cupy"]


@pytest.mark.parametrize("client", CLIENTS)
def test_a_late_process_in_a_full_container_gets_no_context_past_the_limit(
    shim: Shim, full: subprocess.Popen[str], client: str
) -> None:
    p = start_late(shim, client)
    try:
        out = read_until(p, "ready")
        assert used(shim) <= LIMIT  # the late process's context was never made
    finally:
        r = release(p)
    assert r.rc == 0, r.stderr
    assert int(out["init"]) == RUNTIME_REFUSED
    if client == "cupy":
        assert out["error"] == "cupy_backends.cuda.api.runtime.CUDARuntimeError"
        assert out["message"] == "cudaErrorInitializationError: initialization error"
    # The shim's line names the container's limit.
    assert f"memory limit of {LIMIT} bytes" in r.stderr, r.stderr


@pytest.mark.parametrize("client", CLIENTS)
def test_three_late_processes_that_stay_alive_leave_the_gpu_within_the_limit(
    shim: Shim, full: subprocess.Popen[str], client: str
) -> None:
    late = [start_late(shim, client) for _ in range(3)]
    try:
        outs = [read_until(p, "ready") for p in late]
        assert used(shim) <= LIMIT
        assert [int(o["init"]) for o in outs] == [RUNTIME_REFUSED] * 3
    finally:
        results = [release(p) for p in late]
    assert all(r.rc == 0 for r in results), [r.stderr for r in results]


MODES = ["handle", "default", "getproc"]


@pytest.mark.parametrize("mode", MODES)
def test_every_route_to_a_context_is_refused_before_it_is_made(
    shim: Shim, full: subprocess.Popen[str], mode: str
) -> None:
    """cuCtxCreate, cuDevicePrimaryCtxRetain and the runtime table's slot, each reached by
    dlsym on libcuda, the exported symbol or cuGetProcAddress: CUDA_ERROR_OUT_OF_MEMORY, and
    nothing made."""
    p = shim.start("shim_ctx", mode, "late", env=env(shim))
    try:
        out = read_until(p, "ready")
        assert used(shim) <= LIMIT
    finally:
        r = finish(p)
    assert r.rc == 0, r.stderr
    assert (out["create"], out["retain"], out["table"]) == (str(OOM),) * 3
    assert r.stderr.count(f"memory limit of {LIMIT} bytes") == 3, r.stderr


@pytest.mark.parametrize("client", ["cudart12", "cudart13"])
def test_a_late_process_with_room_gets_its_context_charged_once(shim: Shim, client: str) -> None:
    """With room in the container, the runtime's context is made and charged once: the
    estimate taken before it is settled to what it really took."""
    a = shim.start("shim_mem", "handle", 0, "alloc", CHUNK, 4, "hold", env=env(shim))
    try:
        read_until(a, "holding")
        p = start_late(shim, client)
        try:
            out = read_until(p, "ready")
            assert int(out["init"]) == 0
            assert used(shim) == 2 * CONTEXT + 4 * CHUNK
        finally:
            r = release(p)
        assert r.rc == 0, r.stderr
    finally:
        assert finish(a).rc == 0
