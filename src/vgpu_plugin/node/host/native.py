"""Where the native artifacts are: the shim, the simulator and the C headers.

The installed package carries them in ``vgpu_plugin/_native`` (laid out by CMake's install
rules); ``VGPU_NATIVE_DIR`` points at another tree of the same layout, e.g. a CMake build dir
(``build/native``) or a sanitizer build, which the tests use.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

NATIVE_DIR_ENV = "VGPU_NATIVE_DIR"


class NativeArtifactMissing(RuntimeError):
    """A native artifact the caller needs was not built or not installed."""


def native_dir() -> Path:
    """The root of the native tree: ``lib/``, ``simgpu/``, ``include/``."""
    override = os.environ.get(NATIVE_DIR_ENV)
    if override:
        # Absolute: the paths built from it go into containers and processes whose working
        # directory is another (a relative LD_LIBRARY_PATH found no driver there).
        return Path(override).absolute()
    # An editable install spreads the package over two dirs (sources, built files): look in each.
    import vgpu_plugin

    for entry in vgpu_plugin.__path__:
        candidate = Path(entry) / "_native"
        if candidate.is_dir():
            return candidate
    return Path(vgpu_plugin.__file__).resolve().parent / "_native"


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise NativeArtifactMissing(
            f"{what} not found at {path}: build the native code (`pip install .`) "
            f"or set {NATIVE_DIR_ENV} to a CMake build dir of native/"
        )
    return path


def shim_library() -> Path:
    """The enforcement shim, ``libvgpu.so``."""
    return _existing(native_dir() / "lib" / "libvgpu.so", "the shim libvgpu.so")


def simgpu_dir() -> Path:
    """The directory holding the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1``."""
    return _existing(native_dir() / "simgpu", "the GPU simulator (simgpu)")


def include_dir() -> Path:
    """The C headers that Python binds with cffi (one definition, shared with C)."""
    return _existing(native_dir() / "include", "the native headers")


_PREPROCESSOR = re.compile(r"^\s*#.*?(?:\\\n.*?)*$", re.MULTILINE)
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def cdef_source(header: Path) -> str:
    """A C header as cffi's ``cdef`` takes it: comments and preprocessor lines dropped.

    Headers bound this way keep their constants in enums and their array sizes literal.
    """
    text = _COMMENT.sub("", header.read_text())
    return _PREPROCESSOR.sub("", text)
