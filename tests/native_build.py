"""Builds native/ (shim, simgpu, tests/native programs) with CMake for the tests.

One build dir per variant under build/: ``release`` (what the package ships, plus the test
programs), ``asan`` (AddressSanitizer + UndefinedBehaviorSanitizer), ``tsan`` (ThreadSanitizer),
``compat`` (our own cuda.h/nvml.h instead of NVIDIA's, to prove the fallback builds). The build
uses NVIDIA's real headers where present: the CUDA toolkit's cuda.h (FindCUDAToolkit) and the
nvml.h of the PyPI package nvidia-nvml-dev, so every signature is checked against them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Helpers and parallel runs may build elsewhere; the default is the repo's build/.
BUILD_ROOT = Path(os.environ.get("VGPU_TEST_BUILD_ROOT", str(ROOT / "build")))

VARIANTS: dict[str, list[str]] = {
    "release": ["-DCMAKE_BUILD_TYPE=Release"],
    "asan": ["-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DVGPU_SANITIZE=address;undefined"],
    "tsan": ["-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DVGPU_SANITIZE=thread"],
    "compat": ["-DCMAKE_BUILD_TYPE=Release", "-DVGPU_CUDA_HEADERS=OFF", "-DVGPU_NVML_INCLUDE_DIR="],
}

# What one pytest process built already (or failed to build, with why): a build is asked for
# by the session's start hook (tests/conftest.py) and again by the fixture that uses it.
_built: dict[tuple[str, tuple[str, ...]], Path] = {}
_failed: dict[tuple[str, tuple[str, ...]], str] = {}


def compat_targets() -> list[str]:
    """The compat variant's subject: the simulated drivers and the programs that check their
    ABI against NVIDIA's headers; the rest of the tree builds in the other variants."""
    programs = sorted(p.stem for p in (ROOT / "tests" / "native").glob("cuda_*.c"))
    return ["simgpu_cuda", "simgpu_nvml", "nvml_api_check", "nvml_legacy_check", *programs]


def nvml_include_dir() -> Path | None:
    """nvml.h from the nvidia-nvml-dev wheel, if installed."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for header in sorted(Path(base).glob("*/include/nvml.h")):
            return header.parent
    return None


def build(variant: str = "release", targets: list[str] | None = None) -> Path:
    """Configure (once) and build a variant (all of it, or only ``targets``); returns its
    build dir (a native tree). Once per process: a second call answers from memory."""
    key = (variant, tuple(targets or ()))
    if key in _built:
        return _built[key]
    if key in _failed:
        raise RuntimeError(_failed[key])
    try:
        _built[key] = _build(variant, targets)
    except RuntimeError as exc:
        _failed[key] = str(exc)
        raise
    return _built[key]


def _build(variant: str, targets: list[str] | None) -> Path:
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed: `apt-get install cmake` (see .ci/run)")
    out = BUILD_ROOT / f"native-{variant}"
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    # pytest-xdist's workers each ask for the builds they use: one configures and builds while
    # the others wait, then find it made (CMake's own files are not safe to write twice at once).
    with open(BUILD_ROOT / f".native-{variant}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_locked(variant, targets, out)


def _build_locked(variant: str, targets: list[str] | None, out: Path) -> Path:
    args = list(VARIANTS[variant])
    if variant != "compat":
        nvml = nvml_include_dir()
        if nvml is not None:
            args.append(f"-DVGPU_NVML_INCLUDE_DIR={nvml}")
    if not (out / "CMakeCache.txt").exists():
        _run(["cmake", "-S", str(ROOT / "native"), "-B", str(out), "-DVGPU_BUILD_TESTS=ON", *args])
    only = ["--target", *targets] if targets else []
    _run(["cmake", "--build", str(out), f"-j{os.cpu_count() or 2}", *only])
    return out


def tree_with(program: str) -> Path:
    """A native tree holding the test program ``tests/<program>``: ``VGPU_NATIVE_DIR``'s when
    it has one, else the release build (built now). Exported as ``VGPU_NATIVE_DIR`` so the
    package's own code (e.g. the region reader) loads the same build. For the benchmarks."""
    given = os.environ.get("VGPU_NATIVE_DIR")
    if given and (Path(given) / "tests" / program).exists():
        return Path(given)
    tree = build("release")
    os.environ["VGPU_NATIVE_DIR"] = str(tree)
    return tree


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-20000:] + proc.stderr[-20000:])
        raise RuntimeError(f"native build failed (its output is above): {' '.join(cmd)}")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["release"]:
        print(build(name))
