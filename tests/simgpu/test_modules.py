"""Real GPU images on simgpu: cubins, PTX and fat binaries (NVRTC compiles them here) load as
modules and libraries whose kernels are found by name and whose variables (__device__,
__constant__) have device memory with the image's initial contents; loading takes the image's
device memory on the GPU, per context, and gives it back; a driver limit holds module memory
like any other; managed memory is bounded (SIMGPU_MANAGED_LIMIT).

Program: tests/native/cuda_modules.c (see its header for the ops and what it prints).
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from gpu_images import ENTRY_ELF, ENTRY_PTX, compile_cuda, device_bytes, fatbin, kernel_code
from test_memory_limits import env_for, ns, nvml

from vgpu_plugin.sim.simgpu import Node

MIB = 1 << 20
SUCCESS, OUT_OF_MEMORY, NOT_FOUND, NO_BINARY_FOR_GPU = 0, 2, 500, 209

SOURCE = r"""
__device__ float table[37];
__device__ int counter = 42;
__constant__ double coeffs[5] = {1.0, 2.0, 3.0, 4.0, 5.0};
__device__ unsigned short shorts[3] = {0x1234, 0xbeef, 7};
extern "C" __global__ void scale(float *x, int n) {
    int i = threadIdx.x;
    if (i < n) x[i] *= table[i] + coeffs[i % 5] + shorts[i % 3];
    counter++;
}
extern "C" __global__ void other() {}
extern "C" __device__ int helper(int a) { return a + 1; }
"""

# For another GPU, with other names: a fat binary must pick the cubin for the device's sm_90.
SOURCE_80 = r"""
__device__ int only_on_80[4];
extern "C" __global__ void ampere_kernel(int *p) { p[0] = only_on_80[0]; }
"""

BIG = r"""
__device__ char weights[64 << 20];
extern "C" __global__ void touch(int i) { weights[i] = 1; }
"""


def le_hex(fmt: str, *values: float | int) -> str:
    return struct.pack("<" + fmt, *values).hex()


def run(
    native_bin: Path, env: Mapping[str, str], image: Path, kind: str, *ops: str
) -> dict[str, str]:
    proc = subprocess.run(
        [str(native_bin / "cuda_modules"), str(image), kind, *ops],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


OPS = (
    "global:table",
    "global:counter",
    "global:coeffs",
    "global:shorts",
    "global:nope",
    "write:table",
    "func:scale",
    "func:other",
    "func:helper",
    "func:nope",
    "launch:scale",
)


def assert_image_read(out: dict[str, str]) -> None:
    """What SOURCE defines, as the driver answers for it."""
    assert out["global.table"] == f"0 148 {'00' * 16}"  # __device__: zero-filled
    assert out["global.counter"] == f"0 4 {le_hex('i', 42)}"
    assert out["global.coeffs"] == f"0 40 {le_hex('dd', 1.0, 2.0)}"  # __constant__
    assert out["global.shorts"] == f"0 6 {le_hex('HHH', 0x1234, 0xBEEF, 7)}"
    assert out["global.nope"].split()[0] == str(NOT_FOUND)
    assert out["write.table"] == "0 1"  # real memory behind it
    assert (out["func.scale"], out["func.other"]) == ("0", "0")
    # A device function is not a kernel; an unknown name is not found.
    assert (out["func.helper"], out["func.nope"]) == (str(NOT_FOUND), str(NOT_FOUND))
    assert out["launch.scale"] == "0"


@pytest.fixture(scope="module")
def cubin() -> bytes:
    return compile_cuda(SOURCE, "sm_90")


def test_a_cubin_module_has_its_kernels_and_variables_and_takes_its_size(
    native_bin: Path, simgpu_node: Node, tmp_path: Path, cubin: bytes
) -> None:
    """Lazy loading (the default): the image but its kernels' code at load, a kernel's code at
    its first launch; everything back at unload."""
    out = run(native_bin, simgpu_node.env(), write(tmp_path, "t.cubin", cubin), "module", *OPS)
    assert out["load"] == "0"
    assert_image_read(out)
    free0 = int(out["free0"])
    scale, other = kernel_code(cubin, "scale"), kernel_code(cubin, "other")
    assert scale > 0 and other > 0
    at_load = device_bytes(cubin) - scale - other  # variables, constant banks
    assert free0 - int(out["free_loaded"]) == at_load > 148 + 4 + 40 + 6
    assert free0 - int(out["free_ops"]) == at_load + scale  # launched once: its code is in
    assert int(out["free_unloaded"]) == free0  # unloading gives it all back


def test_eager_loading_takes_the_whole_image_at_load(
    native_bin: Path, simgpu_node: Node, tmp_path: Path, cubin: bytes
) -> None:
    env = {**simgpu_node.env(), "CUDA_MODULE_LOADING": "EAGER"}
    out = run(native_bin, env, write(tmp_path, "t.cubin", cubin), "module", "launch:scale")
    assert int(out["free0"]) - int(out["free_loaded"]) == device_bytes(cubin)
    assert out["free_ops"] == out["free_loaded"]
    assert int(out["free_unloaded"]) == int(out["free0"])


def test_a_fat_binary_gives_the_cubin_for_the_device_even_lz4_compressed(
    native_bin: Path, simgpu_node: Node, tmp_path: Path, cubin: bytes
) -> None:
    ampere = compile_cuda(SOURCE_80, "sm_80")
    ptx = compile_cuda(SOURCE, "compute_90", ptx=True)
    for compress in (False, True):
        image = fatbin(
            (ENTRY_ELF, 80, ampere, compress),
            (ENTRY_PTX, 90, ptx, compress),
            (ENTRY_ELF, 90, cubin, compress),
        )
        path = write(tmp_path, f"t{int(compress)}.fatbin", image)
        out = run(native_bin, simgpu_node.env(), path, "module", *OPS, "global:only_on_80")
        assert out["load"] == "0"
        assert_image_read(out)
        assert out["global.only_on_80"].split()[0] == str(NOT_FOUND)  # sm_80's is not loaded
        code = kernel_code(cubin, "scale") + kernel_code(cubin, "other")
        assert int(out["free0"]) - int(out["free_loaded"]) == device_bytes(cubin) - code


def test_ptx_has_its_kernels_and_variables(
    native_bin: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    ptx = compile_cuda(SOURCE, "compute_90", ptx=True)
    out = run(native_bin, simgpu_node.env(), write(tmp_path, "t.ptx", ptx), "module", *OPS)
    assert out["load"] == "0"
    assert_image_read(out)


def test_an_image_for_other_gpus_is_refused_by_a_module_and_fails_at_use_in_a_library(
    native_bin: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    image = write(
        tmp_path, "ampere.fatbin", fatbin((ENTRY_ELF, 80, compile_cuda(SOURCE_80, "sm_80"), True))
    )
    assert run(native_bin, simgpu_node.env(), image, "module")["load"] == str(NO_BINARY_FOR_GPU)
    # A library loads lazily (cuBLAS carries kernels for every architecture and loads them
    # all): its names are known, and using it here says there is no code for this GPU.
    out = run(
        native_bin,
        simgpu_node.env(),
        image,
        "library",
        "func:ampere_kernel",
        "launch:ampere_kernel",
    )
    assert out["load"] == "0"
    assert out["launch.ampere_kernel"] == str(NO_BINARY_FOR_GPU)


def test_a_library_takes_its_memory_in_a_context_on_first_use_until_the_context_goes(
    native_bin: Path, simgpu_node: Node, tmp_path: Path, cubin: bytes
) -> None:
    ops = ("global:counter", "global:coeffs", "write:table", "func:scale", "func:nope")
    out = run(native_bin, simgpu_node.env(), write(tmp_path, "t.cubin", cubin), "library", *ops)
    assert out["load"] == "0"
    assert out["free_loaded"] == out["free0"]  # nothing until a context uses it
    assert out["global.counter"] == f"0 4 {le_hex('i', 42)}"
    assert out["global.coeffs"] == f"0 40 {le_hex('dd', 1.0, 2.0)}"
    assert out["write.table"] == "0 1"
    assert (out["func.scale"], out["func.nope"]) == ("0", str(NOT_FOUND))
    code = kernel_code(cubin, "scale") + kernel_code(cubin, "other")  # not launched: not loaded
    assert int(out["free0"]) - int(out["free_ops"]) == device_bytes(cubin) - code
    assert out["free_destroyed"] == out["free0"]  # gone with the context, the library kept


def test_a_library_loads_with_the_binary_is_preserved_flag_and_no_values(
    native_bin: Path, simgpu_node: Node, tmp_path: Path, cubin: bytes
) -> None:
    """CU_LIBRARY_BINARY_IS_PRESERVED is a flag: cuBLAS 13 passes it with no values array (its
    cubins failed to load, and every gemm needing one with CUBLAS_STATUS_INTERNAL_ERROR). The
    host table option takes a value: without one it is refused."""
    image = write(tmp_path, "t.cubin", cubin)
    out = run(native_bin, simgpu_node.env(), image, "library:preserved", "func:scale")
    assert (out["load"], out["func.scale"]) == ("0", "0")
    assert run(native_bin, simgpu_node.env(), image, "library:table")["load"] == "1"


def test_module_memory_counts_against_the_containers_driver_limit(
    native_bin: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    """A container (cgroup) held by the driver's limit cannot go past it by loading modules:
    64 MiB of module variables are refused where only 32 MiB are left, and load where 96 are."""
    big = compile_cuda(BIG, "sm_90")
    assert device_bytes(big) > 64 * MIB
    image = write(tmp_path, "big.cubin", big)
    cgroup = "/kubepods/pod-m/ctr"
    limit = 2048 * MIB
    assert nvml(simgpu_node, f"set:0:{ns(cgroup)}:{limit}:{limit}") == ["ok"]
    env = env_for(simgpu_node, cgroup)
    probe = run(native_bin, env, image, "module")
    assert probe["load"] == "0"  # alone, it fits
    used_by_context = 16 * 1024 * MIB - int(probe["free0"])  # alone on the node: its context
    room = limit - used_by_context
    for left_mib, expect in ((32, str(OUT_OF_MEMORY)), (96, "0")):
        hold = room // MIB - left_mib
        out = run(native_bin, {**env, "CUDA_MODULES_HOLD_MIB": str(hold)}, image, "module")
        assert out["load"] == expect, (left_mib, out)


# --- managed memory -----------------------------------------------------------------------------


def managed(native_bin: Path, env: Mapping[str, str], *mib: int) -> dict[str, str]:
    proc = subprocess.run(
        [str(native_bin / "cuda_managed"), *map(str, mib)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_managed_memory_is_bounded_by_simgpu_managed_limit(
    native_bin: Path, simgpu_node: Node
) -> None:
    """Managed memory lives in host memory: the process's live managed bytes stay within
    SIMGPU_MANAGED_LIMIT (beyond the GPU's 16 GiB here, as oversubscription allows), freed
    bytes count no more."""
    env = {**simgpu_node.env(), "SIMGPU_MANAGED_LIMIT": "20g"}
    out = managed(native_bin, env, 12 * 1024, 8 * 1024, 7 * 1024, 1024)
    # 12 GiB, then 8 GiB more (20 GiB: the limit, past the GPU's 16); then neither 7 GiB nor
    # 1 GiB fits; once everything is freed the first fits again.
    assert [out[f"alloc.{i}"] for i in range(4)] == [
        "0",
        "0",
        str(OUT_OF_MEMORY),
        str(OUT_OF_MEMORY),
    ]
    assert out["again"] == "0"


def test_managed_memory_is_bounded_by_the_hosts_memory_by_default(
    native_bin: Path, simgpu_node: Node
) -> None:
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    over = host // MIB + 1
    out = managed(native_bin, simgpu_node.env(), over, 64)
    assert (out["alloc.0"], out["alloc.1"]) == (str(OUT_OF_MEMORY), "0")


def test_a_bad_managed_limit_is_named_and_the_hosts_memory_bounds(
    native_bin: Path, simgpu_node: Node
) -> None:
    env = {**simgpu_node.env(), "SIMGPU_MANAGED_LIMIT": "lots"}
    proc = subprocess.run(
        [str(native_bin / "cuda_managed"), "64"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "alloc.0=0" in proc.stdout
    assert "SIMGPU_MANAGED_LIMIT=lots is not a size" in proc.stderr


# --- module memory under the shim ---------------------------------------------------------------


def test_module_memory_counts_against_the_shims_limit(
    native_tree: Path, native_bin: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libvgpu"))
    from test_shim_helpers import Shim

    shim = Shim(native_tree, simgpu_node, tmp_path)
    image = write(tmp_path, "big.cubin", compile_cuda(BIG, "sm_90"))
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m"})
    probe = run(native_bin, env, image, "module")
    assert probe["load"] == "0"  # alone, its 64 MiB fit beside the context
    room = int(probe["free0"])  # the container's view, the context charged
    # Held to 32 MiB short of the limit, 64 MiB of module variables must not fit.
    out = run(native_bin, {**env, "CUDA_MODULES_HOLD_MIB": str(room // MIB - 32)}, image, "module")
    assert out["load"] == str(OUT_OF_MEMORY)


@pytest.mark.parametrize("loading", ["EAGER", "LAZY"])
def test_a_librarys_memory_counts_against_the_shims_limit(
    native_tree: Path, native_bin: Path, simgpu_node: Node, tmp_path: Path, loading: str
) -> None:
    """A library takes its memory in a context at its first use there (here cuLibraryGetGlobal;
    all of its image when loading is eager): past the shim's limit that call is refused."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libvgpu"))
    from test_shim_helpers import Shim

    shim = Shim(native_tree, simgpu_node, tmp_path)
    image = write(tmp_path, "big.cubin", compile_cuda(BIG, "sm_90"))
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m", "CUDA_MODULE_LOADING": loading})
    probe = run(native_bin, env, image, "library", "global:weights")
    assert (probe["load"], probe["global.weights"].split()[0]) == ("0", "0")
    room = int(probe["free0"])
    held = {**env, "CUDA_MODULES_HOLD_MIB": str(room // MIB - 32)}
    out = run(native_bin, held, image, "library", "global:weights")
    assert (out["load"], out["global.weights"].split()[0]) == ("0", str(OUT_OF_MEMORY))


# --- what launches load, under the shim ---------------------------------------------------------

LONG = r"""
extern "C" __global__ void long_kernel(float *x, float k) {
    float a = x[threadIdx.x];
#pragma unroll
    for (int i = 0; i < 8192; i++) a = a * k + (float)i;
    x[threadIdx.x] = a;
}
"""


@pytest.fixture(scope="module")
def long_cubin() -> bytes:
    return compile_cuda(LONG, "sm_90")  # ~190 KiB of code, loaded at its first launch


LAUNCH_THEN_ALLOC = ("launch:long_kernel", "alloc:4096", "free:now")


def shim_for(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Any:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libvgpu"))
    from test_shim_helpers import Shim

    return Shim(native_tree, simgpu_node, tmp_path)


@pytest.mark.parametrize("loading", ["LAZY", "EAGER"])
def test_code_loaded_at_a_first_launch_is_charged_and_unloading_gives_it_back(
    native_tree: Path,
    native_bin: Path,
    simgpu_node: Node,
    tmp_path: Path,
    long_cubin: bytes,
    loading: str,
) -> None:
    """Lazy loading puts a kernel's code on the GPU at its first launch: the container's next
    view (here cuMemGetInfo) has it charged, as the driver holds it. Unloading the module gives
    back everything the module took, its code included."""
    shim = shim_for(native_tree, simgpu_node, tmp_path)
    image = write(tmp_path, "long.cubin", long_cubin)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m", "CUDA_MODULE_LOADING": loading})
    out = run(native_bin, env, image, "module", "launch:long_kernel")
    assert (out["load"], out["launch.long_kernel"]) == ("0", "0")
    code = kernel_code(long_cubin, "long_kernel")
    free0, loaded, ops = int(out["free0"]), int(out["free_loaded"]), int(out["free_ops"])
    if loading == "LAZY":
        assert free0 - loaded == device_bytes(long_cubin) - code
        assert loaded - ops == code  # the launch's code, charged by the view after it
    else:
        assert free0 - loaded == device_bytes(long_cubin)
        assert ops == loaded
    assert int(out["free_unloaded"]) == free0


def test_code_a_launch_loads_past_the_limit_is_charged_and_refuses_what_follows(
    native_tree: Path, native_bin: Path, simgpu_node: Node, tmp_path: Path, long_cubin: bytes
) -> None:
    """A container left 64 KiB launches a kernel whose ~190 KiB of code the driver loads then:
    the code is on the GPU before anything can refuse it, so it is charged past the limit (one
    warning naming the limit) and the container's next allocation is refused; its view shows
    nothing free. Without the settle the allocation was granted and the view showed 64 KiB."""
    shim = shim_for(native_tree, simgpu_node, tmp_path)
    image = write(tmp_path, "long.cubin", long_cubin)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m", "CUDA_MODULES_LEAVE": str(64 << 10)})
    assert kernel_code(long_cubin, "long_kernel") > 64 << 10
    proc = subprocess.run(
        [str(native_bin / "cuda_modules"), str(image), "module", *LAUNCH_THEN_ALLOC],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert int(out["free_left"]) == 64 << 10
    assert out["launch.long_kernel"] == "0"
    assert out["alloc.4096"] == str(OUT_OF_MEMORY)
    assert out["free.now"] == "0"
    warned = [line for line in proc.stderr.splitlines() if "over its limit" in line]
    assert len(warned) == 1 and "1073741824 bytes" in warned[0], proc.stderr


@pytest.mark.parametrize("call", ["alloc", "free"])
def test_a_neighbours_allocation_in_flight_during_a_settle_takes_no_code_back(
    native_tree: Path,
    native_bin: Path,
    simgpu_node: Node,
    tmp_path: Path,
    long_cubin: bytes,
    call: str,
) -> None:
    """A settle that runs while another thread's allocation is reserved but not yet made by
    the driver (or freed by the driver, not yet given back) reads the driver holding less
    than the charge: that is not code the driver let go of. simgpu holds the other thread's
    call half-way (SIMGPU_STALL) while a second launch makes a settle due and a view runs it.
    The code stays charged: the container's free memory moves by exactly the allocation.
    Before, the settle gave the code back (the view showed it free again)."""
    shim = shim_for(native_tree, simgpu_node, tmp_path)
    image = write(tmp_path, "long.cubin", long_cubin)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m", "SIMGPU_STALL": str(tmp_path / "gate")})
    out = run(
        native_bin,
        env,
        image,
        "module",
        "launch:long_kernel",
        "free:settled",  # the first settle: the launch's code charged
        f"stall:{call}:{MIB}",
        "launch:long_kernel",  # a settle is due again
        "sleep:150",  # past VGPU_CODE_SETTLE_NS since the first
        "free:racing",  # the settle, with the other thread's call half-way
        "unstall:",
        "free:after",
    )
    assert out["unstall"] == "0"
    code = kernel_code(long_cubin, "long_kernel")
    settled = int(out["free.settled"])
    assert int(out["free_loaded"]) - settled == code
    made = MIB if call == "alloc" else 0  # a freed allocation is gone after the race
    assert int(out["free.after"]) == settled - made
    if call == "free":  # still charged until the shim gives it back
        assert int(out["free.racing"]) == settled - MIB


def test_code_is_charged_at_a_synchronisation_without_any_allocation(
    native_tree: Path, simgpu_node: Node, tmp_path: Path, long_cubin: bytes
) -> None:
    """A program that launches and waits for its results, allocating nothing more (an
    inference loop over memory it holds already), has the code its launches loaded charged at
    its next synchronisation: the container's usage, as the node reads it from the region
    while the program lives on, holds the code. Before, it was charged only at an allocation
    or a memory view, which such a program may never make again."""
    from vgpu_plugin.node.observe.region import read_region

    shim = shim_for(native_tree, simgpu_node, tmp_path)  # puts test_shim_helpers on the path
    from test_shim_helpers import read_until

    image = write(tmp_path, "long.cubin", long_cubin)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1024m"})
    ops = ("launch:long_kernel", "sleep:150", "sync:", "hold:")
    proc = shim.start("cuda_modules", image, "module", *ops, env=env)
    try:
        out = read_until(proc, "held")
        (used,) = [d.used for d in read_region(shim.region).devices if d.used]  # GPU 0's
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0
    assert out["launch.long_kernel"] == out["sync."] == "0"
    before_launch = (1024 << 20) - int(out["free_loaded"])
    assert used == before_launch + kernel_code(long_cubin, "long_kernel")
