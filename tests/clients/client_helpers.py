"""The real-client tier's helpers: where its wheels are. The tier runs NVIDIA's CUDA runtime
(libcudart 12 and 13) and CuPy, from PyPI, on a simulated node, each scenario without and with
the shim; a test skips, saying so, only where its wheel is not installed
(`pip install -e '.[test]'` installs them). Holds no tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def cudart_path(major: int) -> Path:
    """libcudart.so.<major> from the nvidia-cuda-runtime(-cu12) wheel, or skip."""
    wheel = "nvidia-cuda-runtime-cu12" if major == 12 else "nvidia-cuda-runtime"
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip(f"{wheel} is not installed (pip install -e '.[test]')")
    for base in getattr(nvidia, "__path__", []):
        for lib in sorted(Path(base).glob(f"*/lib/libcudart.so.{major}")):
            return lib
    pytest.skip(f"{wheel} is not installed (pip install -e '.[test]')")


def require_cupy() -> None:
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy-cuda12x is not installed (pip install -e '.[test]')")
