"""How the shim gets into a process and in front of the driver.

Nothing happens in a process that never uses the GPU; dlsym(RTLD_NEXT, ...) answers relative to
its caller, not to the shim; cuGetProcAddress hands out hooks of the ABI the driver chose and
leaves everything else alone. Programs: tests/native/shim_next.c with the preloaded library
tests/native/shim_nextlib/next.c, and tests/native/shim_getproc.c.
"""

from __future__ import annotations

import ctypes
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_shim_helpers import GIB, MIB, OOM, Shim

from vgpu_plugin.sim.simgpu import Node


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def limited(shim: Shim) -> dict[str, str]:
    return shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT": "50"})


def test_a_process_that_never_uses_the_gpu_gets_no_driver_no_thread_no_file(shim: Shim) -> None:
    env = limited(shim)
    maps = subprocess.run(["cat", "/proc/self/maps"], env=env, capture_output=True, text=True)
    assert "libvgpu.so" in maps.stdout  # it is loaded ...
    assert "libcuda" not in maps.stdout and "libnvidia-ml" not in maps.stdout  # ... and idle
    status = subprocess.run(["cat", "/proc/self/status"], env=env, capture_output=True, text=True)
    assert "\nThreads:\t1\n" in status.stdout
    script = (
        "import threading, json; print(json.dumps([open('/proc/self/maps').read(), "
        "threading.active_count(), open('/proc/self/status').read()]))"
    )
    py = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert py.returncode == 0, py.stderr
    pymaps, _, pystatus = __import__("json").loads(py.stdout)
    assert "libvgpu.so" in pymaps and "libcuda" not in pymaps and "libnvidia-ml" not in pymaps
    assert "\nThreads:\t1\n" in pystatus
    assert py.stderr == "" and maps.stderr == ""
    # No region, no pacing file, no lock dir: nothing was opened on the shim's behalf.
    assert not shim.region.parent.exists() and not (shim.tmp / "lock").exists()


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


def test_the_shim_is_laid_out_to_load_cheaply(shim: Shim) -> None:
    """What keeps /bin/true at an empty library's cost (bench/RESULTS.md): two mappings of the
    file, the writable one starting on a page of its own and its file-backed part ending on one
    (no zero fill), no RELRO, no start files, no load-time symbol lookups, one version need at
    most (native/libvgpu/CMakeLists.txt)."""
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    segs = _readelf("-lW", str(shim.lib))
    loads = [ln.split() for ln in segs.splitlines() if ln.strip().startswith("LOAD")]
    assert len(loads) == 2, segs
    writable = [f for f in loads if "RW" in f[6:]]
    assert len(writable) == 1 and int(writable[0][1], 16) % 4096 == 0, segs
    assert (int(writable[0][1], 16) + int(writable[0][4], 16)) % 4096 == 0, segs
    assert "GNU_RELRO" not in segs
    dynamic = _readelf("-dW", str(shim.lib))
    needs = re.findall(r"Name: (GLIBC_[0-9.]+)", _readelf("-VW", str(shim.lib)))
    if platform.machine() == "x86_64":  # tables built at first use, not relocated at load
        assert "(INIT)" not in dynamic and "(FINI)" not in dynamic, dynamic  # no start files
        relocs = _readelf("-rW", str(shim.lib))
        assert relocs.count("R_X86_64_RELATIVE") < 100
        assert "R_X86_64_GLOB_DAT" not in relocs and "R_X86_64_64 " not in relocs, relocs
        assert "R_X86_64_NONE" not in relocs, relocs  # the loader refuses the library
        assert set(needs) <= {"GLIBC_2.2.5"}, needs
        if "NEEDED" not in dynamic:  # linked without libc: nothing to map, no version to check
            assert needs == [], needs
    else:
        assert len(needs) <= 8, needs


def test_every_libc_import_is_one_libc_has_had_since_its_first_version(shim: Shim) -> None:
    """Linked without libc (or bound with .symver), the shim's imports bind to libc's oldest
    version of each: libc_versions.h vouches for the meaning of each at GLIBC_2.2.5. This checks
    that every import is libc's at that version, as -Wl,--no-undefined checked the link, and
    that the oldest version is GLIBC_2.2.5 (index 2, what an unversioned import binds to)."""
    if platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        pytest.skip("the import versions are pinned for x86-64 glibc only")
    if shutil.which("nm") is None or shutil.which("readelf") is None:
        pytest.skip("nm/readelf (binutils) are not installed")
    libc = ctypes.CDLL("libc.so.6")
    dlvsym = libc.dlvsym
    dlvsym.restype = ctypes.c_void_p
    dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    nm = subprocess.run(
        ["nm", "-D", "--undefined-only", str(shim.lib)], capture_output=True, text=True, check=True
    ).stdout
    imports = {ln.split()[-1].split("@")[0] for ln in nm.splitlines() if ln.strip()}
    assert {"dlvsym", "pthread_once", "memcpy", "__xstat"} <= imports, imports
    missing = [n for n in sorted(imports) if not dlvsym(libc._handle, n.encode(), b"GLIBC_2.2.5")]
    assert missing == []
    # Where libc has several versions of a name, an unversioned import takes index 2.
    libc_path = next(
        ln.split()[-1]
        for ln in Path("/proc/self/maps").read_text().splitlines()
        if re.search(r"/libc\.so\.6$|/libc-[0-9.]+\.so$", ln)
    )
    assert re.search(r"Index: 2 .*Name: GLIBC_2\.2\.5\n", _readelf("-VW", libc_path))


def test_bin_true_with_the_shim_costs_no_more_than_an_empty_library(
    shim: Shim, tmp_path: Path
) -> None:
    """issue 22: instructions (callgrind, repeatable on a loaded machine) of /bin/true with the
    shim preloaded <= with an empty library built the default way, both at paths of the same
    length. Only for the shim linked without libc (x86-64, glibc >= 2.34); the one linked the
    ordinary way pays for mapping libc as a dependency and its version need (RESULTS.md)."""
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        pytest.skip("valgrind and a C compiler are needed to count instructions")
    if "NEEDED" in _readelf("-dW", str(shim.lib)):
        pytest.skip("the shim is linked against libc here (glibc < 2.34 or VGPU_SHIM_LINK_LIBC)")
    lib = tmp_path / "s" / "libvgpu.so"
    lib.parent.mkdir()
    shutil.copy(shim.lib, lib)
    empty = tmp_path / "e" / "libvgpu.so"
    empty.parent.mkdir()
    (tmp_path / "empty.c").write_text("int vgpu_test_empty(void) { return 0; }\n")
    cc = ["cc", "-O2", "-shared", "-fPIC", "-o", str(empty), str(tmp_path / "empty.c")]
    subprocess.run(cc, check=True)

    def instructions(preload: Path) -> int:
        out = tmp_path / f"cg.{preload.parent.name}"
        env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(preload)}
        vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "/bin/true"]
        subprocess.run(vg, env=env, capture_output=True, check=True)
        lines = out.read_text().splitlines()
        return next(int(ln.split()[1]) for ln in lines if ln.startswith(("summary:", "totals:")))

    assert instructions(lib) <= instructions(empty)


def next_answers(shim: Shim, preload: list[Path], *names: str) -> dict[str, str]:
    env = shim.env()
    env["LD_PRELOAD"] = shim.preload_list(preload)
    r = shim.run("shim_next", *names, env=env)
    assert r.rc == 0, r.stderr
    return r.out


NAMES = ("vgpu_shim_version", "cuMemAlloc_v2", "cuInit", "dlsym", "getpid")


def test_rtld_next_from_a_library_is_relative_to_that_library(shim: Shim) -> None:
    nextlib = shim.prog("libshim_nextlib.so")
    # The library comes before the shim: the next definitions after it are the shim's.
    before = next_answers(shim, [nextlib, shim.lib], *NAMES)
    assert before["lib_next.vgpu_shim_version"] == "libvgpu.so"
    assert before["lib_next.cuMemAlloc_v2"] == "libvgpu.so"
    assert before["lib_next.cuInit"] == "libcuda.so.1"
    assert before["lib_next.getpid"] == "libc.so.6"
    # The library comes after the shim: it sees exactly what it sees without the shim.
    after = next_answers(shim, [shim.lib, nextlib], *NAMES)
    alone = next_answers(shim, [nextlib], *NAMES)
    assert {k: v for k, v in after.items() if k.startswith("lib_next.")} == {
        k: v for k, v in alone.items() if k.startswith("lib_next.")
    }
    assert after["lib_next.vgpu_shim_version"] == "NULL"
    assert after["lib_next.cuMemAlloc_v2"] == "libcuda.so.1"
    assert after["lib_next.dlsym"] == "libc.so.6"


def test_rtld_next_and_rtld_default_from_the_program(shim: Shim) -> None:
    out = next_answers(shim, [shim.lib], *NAMES)
    assert out["main_next.cuMemAlloc_v2"] == "libvgpu.so"  # the preloaded shim comes next
    assert out["main_next.cuInit"] == "libcuda.so.1"
    assert out["default.cuMemAlloc_v2"] == "libvgpu.so"
    assert out["default.getpid"] == "libc.so.6"
    # A second lookup is answered the same: nothing remembers the first.
    again = next_answers(shim, [shim.lib], "cuMemAlloc_v2", "cuMemAlloc_v2", "getpid")
    assert again["main_next.cuMemAlloc_v2"] == "libvgpu.so"


PTDS = 1
QUERIES = {
    # query: (object the pointer belongs to, its symbol)
    "cuMemAlloc:12000:0": ("libvgpu.so", "cuMemAlloc_v2"),
    "cuMemAlloc:3000:0": ("libvgpu.so", "cuMemAlloc"),  # the 32-bit ABI, hooked too
    "cuLaunchKernel:12000:0": ("libvgpu.so", "cuLaunchKernel"),
    "cuLaunchKernel:12000:1": ("libvgpu.so", "cuLaunchKernel_ptsz"),
    "cuLaunchKernelEx:12000:1": ("libvgpu.so", "cuLaunchKernelEx_ptsz"),
    "cuGraphLaunch:12000:1": ("libvgpu.so", "cuGraphLaunch_ptsz"),
    "cuGraphUpload:12000:0": ("libvgpu.so", "cuGraphUpload"),
    "cuGraphUpload:12000:1": ("libvgpu.so", "cuGraphUpload_ptsz"),
    "cuGraphInstantiateWithParams:12000:1": ("libvgpu.so", "cuGraphInstantiateWithParams_ptsz"),
    "cuMemAllocAsync:12000:1": ("libvgpu.so", "cuMemAllocAsync_ptsz"),
    "cuMemFreeAsync:12000:0": ("libvgpu.so", "cuMemFreeAsync"),
    "cuCtxCreate:12050:0": ("libvgpu.so", "cuCtxCreate_v4"),
    "cuCtxCreate:3020:0": ("libvgpu.so", "cuCtxCreate_v2"),
    "cuMemGetInfo:12000:0": ("libvgpu.so", "cuMemGetInfo_v2"),
    "cuGetProcAddress:12000:0": ("libvgpu.so", "cuGetProcAddress_v2"),
    "cuMipmappedArrayCreate:12000:0": ("libvgpu.so", "cuMipmappedArrayCreate"),
    "cuMipmappedArrayDestroy:5000:0": ("libvgpu.so", "cuMipmappedArrayDestroy"),
    "cuStreamSynchronize:12000:1": ("libvgpu.so", "cuStreamSynchronize_ptsz"),
    "cuCtxSetCurrent:12000:0": ("libvgpu.so", "cuCtxSetCurrent"),
    # not hooked: the driver's own, in the variant it chose
    "cuInit:12000:0": ("libcuda.so.1", "cuInit"),
    "cuMemcpyAsync:12000:1": ("libcuda.so.1", "cuMemcpyAsync_ptsz"),
    "cuEventRecord:12000:1": ("libcuda.so.1", "cuEventRecord_ptsz"),
    "cuStreamQuery:12000:0": ("libcuda.so.1", "cuStreamQuery"),
    "cuMipmappedArrayGetLevel:12000:0": ("libcuda.so.1", "cuMipmappedArrayGetLevel"),
    "cuMemMapArrayAsync:12000:1": ("libcuda.so.1", "cuMemMapArrayAsync_ptsz"),
}


def test_cu_get_proc_address_returns_hooks_of_the_drivers_variant(shim: Shim) -> None:
    r = shim.run("shim_getproc", *QUERIES, env=limited(shim))
    assert r.rc == 0, r.stderr
    for query, (obj, name) in QUERIES.items():
        rc, status, got_obj, got_name = r.out[query].split()
        assert (rc, status) == ("0", "0"), query
        assert (got_obj, got_name) == (obj, name), query


def test_cu_get_proc_address_passes_failures_and_status_through(shim: Shim) -> None:
    r = shim.run("shim_getproc", "cuNoSuchCall:12000:0", "cuCtxCreate:2000:0", env=limited(shim))
    assert r.out["cuNoSuchCall:12000:0"].split()[:2] == ["500", "1"]  # NOT_FOUND, symbol not found
    # An old CUDA version gets the old variant, and that variant's hook.
    assert r.out["cuCtxCreate:2000:0"].split()[2:] == ["libvgpu.so", "cuCtxCreate"]


def test_without_the_shim_the_same_queries_give_the_drivers_functions(shim: Shim) -> None:
    r = shim.run("shim_getproc", *QUERIES, env=shim.env(shim=False))
    for query, (_, name) in QUERIES.items():
        assert r.out[query].split()[2:] == ["libcuda.so.1", name], query


CTYPES_PROGRAM = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
ck = lambda rc: rc == 0 or sys.exit(f"rc {rc}")
ck(cu.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0))
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ck(cu.cuCtxSetCurrent(ctx))
ptr, n = ctypes.c_uint64(), 0
while (rc := cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))) == 0:
    n += 1
print(n, rc)
"""


def test_a_python_program_using_ctypes_is_held_to_the_limit(shim: Shim) -> None:
    py = subprocess.run(
        [sys.executable, "-c", CTYPES_PROGRAM], env=limited(shim), capture_output=True, text=True
    )
    assert py.returncode == 0, py.stderr
    n, rc = map(int, py.stdout.split())
    assert n * 64 * MIB == (GIB - 300 * MIB) // (64 * MIB) * (64 * MIB) and rc == OOM


NATIVE = Path(__file__).resolve().parents[2] / "native" / "libvgpu"


def _hooked() -> list[str]:
    """The hooked entry points, from the shim's one list of them (src/shim.h)."""

    header = (NATIVE / "src" / "shim.h").read_text()
    names: list[str] = []
    for macro in ("VGPU_CUDA_HOOKS", "VGPU_NVML_HOOKS"):
        body = re.search(rf"#define {macro}\(H\)(.*?)\n\n", header, re.S)
        assert body is not None
        names += re.findall(r"\bH\((\w+)\)", body.group(1))
    return names


def test_every_hook_is_exported_and_nothing_else_of_ours(shim: Shim) -> None:
    hooked = set(_hooked())
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(shim.lib)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in out.splitlines()}
    ours = {n for n in exported if n.startswith(("cu", "nvml"))}
    assert ours == hooked
    assert "dlsym" in exported
    # The rest of the shim's own names stay inside: only the region's API and the version.
    own = {n for n in exported if n.startswith("vgpu_")}
    assert all(n.startswith("vgpu_region_") or n == "vgpu_shim_version" for n in own), own


def test_get_proc_address_variants_match_nvidias_typedefs() -> None:
    """Each hooked variant is named by the (base, version, flag) NVIDIA's cudaTypedefs.h gives."""

    source = (NATIVE / "src" / "procaddr.c").read_text()
    rows = re.findall(r'\{"(\w+)", (\d+), ([01]), "(\w+)"\}', source)
    cuda_hooks = {n for n in _hooked() if n.startswith("cu")}
    assert {name for *_, name in rows} == cuda_hooks
    typedefs = Path("/usr/local/cuda/include/cudaTypedefs.h")
    if not typedefs.exists():
        pytest.skip("the CUDA toolkit's cudaTypedefs.h is not installed")
    text = typedefs.read_text()
    for base, version, ptds, _ in rows:
        pfn = f"PFN_{base}_v{version}{'_ptsz' if ptds == '1' else ''}"
        assert re.search(rf"\b{pfn}\b", text), pfn
