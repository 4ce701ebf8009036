"""The shim on a real NVIDIA GPU and driver (skipped, with the reason, anywhere else).

What the simulator cannot show: the real driver's cuGetProcAddress pointers map to our hooks,
the CUDA runtime and PyTorch (which find the driver through cuGetProcAddress) are held to the
memory limit and see it in torch.cuda.mem_get_info, and a compute limit slows a real kernel
loop to its share. Run with ``pytest -m gpu tests/gpu`` on a machine with a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GIB = 1 << 30
_PROBE = (
    "import ctypes, sys\n"
    "cu = ctypes.CDLL('libcuda.so.1')\n"
    "n = ctypes.c_int()\n"
    "sys.exit(0 if cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0 "
    "and n.value > 0 else 1)\n"
)


def _clean_env() -> dict[str, str]:
    drop = ("CUDA_", "SIMGPU_", "VGPU_", "LIBVGPU_", "LD_PRELOAD", "LD_LIBRARY_PATH")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def gpu_env(native_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=_clean_env(), check=False)
    if probe.returncode != 0:
        pytest.skip("no NVIDIA GPU here (libcuda.so.1 with a device)")
    tmp = tmp_path_factory.mktemp("gpu")
    (tmp / "vgpu").mkdir()  # the shim makes the region file, not its directory
    env = _clean_env()
    env.update(
        LD_PRELOAD=str(native_tree / "lib" / "libvgpu.so"),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp / "vgpu" / "r.cache"),
        VGPU_LOCK_DIR=str(tmp / "lock"),
        VGPU_LIMITS_FILE=str(tmp / "no-limits-file"),
    )
    return env


def _torch(env: dict[str, str], code: str) -> str:
    pytest.importorskip("torch")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_real_get_proc_address_maps_to_hooks(gpu_env: dict[str, str], native_tree: Path) -> None:
    queries = {
        "cuMemAlloc:12000:0": "cuMemAlloc_v2",
        "cuLaunchKernel:12000:1": "cuLaunchKernel_ptsz",
        "cuGraphLaunch:12000:0": "cuGraphLaunch",
        "cuMemAllocAsync:12000:1": "cuMemAllocAsync_ptsz",
        "cuMipmappedArrayCreate:12000:0": "cuMipmappedArrayCreate",
    }
    r = subprocess.run(
        [str(native_tree / "tests" / "shim_getproc"), *queries, "cuInit:12000:0"],
        env=gpu_env,
        capture_output=True,
        text=True,
        check=True,
    )
    out = dict(line.split("=", 1) for line in r.stdout.splitlines())
    for q, name in queries.items():
        assert out[q].split()[2:] == ["libvgpu.so", name], (q, out[q])
    assert out["cuInit:12000:0"].split()[2] != "libvgpu.so"


MEMORY = """
import torch
free, total = torch.cuda.mem_get_info()
print("total", total)
blocks = []
try:
    while True:
        blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
print("held", len(blocks) * (256 << 20))
"""


def test_torch_sees_and_is_held_to_the_memory_limit(gpu_env: dict[str, str]) -> None:
    out = _torch(dict(gpu_env, CUDA_DEVICE_MEMORY_LIMIT="4g"), MEMORY)
    got = dict(line.split() for line in out.splitlines())
    assert int(got["total"]) == 4 * GIB
    assert 2 * GIB <= int(got["held"]) <= 4 * GIB  # the context takes its part


def test_mipmapped_arrays_are_held_to_the_limit_and_given_back_exactly(
    gpu_env: dict[str, str], native_tree: Path
) -> None:
    """shim_mem's mipmapped path (2D layered, 4 levels: within real texture limits)."""
    chunk = 64 << 20
    r = subprocess.run(
        [str(native_tree / "tests" / "shim_mem"), "handle", "0", "mipmapped", str(chunk), "100"],
        env=dict(gpu_env, CUDA_DEVICE_MEMORY_LIMIT="2g"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    allocated = int(out["allocated"])
    assert int(out["refusal"]) == 2  # CUDA_ERROR_OUT_OF_MEMORY: the limit, not the GPU
    assert 0 < allocated < 2 * GIB  # beside the context's own memory
    assert int(out["after_view_free"]) == int(out["view_free"]) + allocated


SPEED = """
import time, torch
a = torch.randn(4096, 4096, device="cuda")
for _ in range(10):
    a @ a
torch.cuda.synchronize()
t, n = time.monotonic(), 0
while time.monotonic() - t < 4:
    a @ a
    n += 1
    if n % 20 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print(n / (time.monotonic() - t))
"""


def test_a_compute_limit_slows_a_kernel_loop_to_its_share(gpu_env: dict[str, str]) -> None:
    full = float(_torch(gpu_env, SPEED))
    half = float(_torch(dict(gpu_env, CUDA_DEVICE_SM_LIMIT="50"), SPEED))
    assert 0.4 <= half / full <= 0.6, (half, full)


HOLD_FULL = """
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, p = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
while cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)) == 0:
    pass
print(os.getpid(), flush=True)
sys.stdin.read()
"""

LATE = """
import os, sys, torch
try:
    torch.zeros(1, device="cuda")
except Exception as e:
    print("refused:", e, file=sys.stderr)
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def _nvml_used(pids: set[int]) -> int:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in pids)
    finally:
        pynvml.nvmlShutdown()


def test_a_late_runtime_process_keeps_a_full_container_within_its_limit(
    gpu_env: dict[str, str],
) -> None:
    """The CUDA runtime makes its primary context through the driver's private table
    (cuGetExportTable): a process started in a full container must not take GPU memory past
    the container's limit with it, by the driver's own count (NVML)."""
    pytest.importorskip("torch")
    env = dict(gpu_env, CUDA_DEVICE_MEMORY_LIMIT="2g")
    procs = []
    try:
        for code in (HOLD_FULL, LATE):
            p = subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None
            assert p.stdout.readline().strip().isdigit(), "the process did not start"
        used = _nvml_used({p.pid for p in procs})
        assert 0 < used <= 2 * GIB, used
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=60)
