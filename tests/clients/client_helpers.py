"""The real-client tier's helpers: where its wheels are. The tier runs NVIDIA's CUDA runtime
(libcudart 12 and 13), CuPy and PyTorch, from PyPI, on a simulated node, each scenario without
and with the shim; a test skips, saying so, only where its wheel is not installed
(`pip install -e '.[test]'` installs all but PyTorch, which is several GB and comes with
`pip install -e '.[test,torch]'`). Holds no tests."""

from __future__ import annotations

import importlib.metadata
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


def require_cublas() -> None:
    """CuPy and the cuBLAS 12 it loads for matrix products (nvidia-cublas-cu12), or skip."""
    require_cupy()
    try:
        importlib.metadata.version("nvidia-cublas-cu12")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-cublas-cu12 is not installed (pip install -e '.[test]')")


def require_torch() -> None:
    """PyTorch's CUDA build (PyPI's default Linux wheel), or skip."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed (pip install -e '.[test,torch]')")
    if version.endswith("+cpu"):
        pytest.skip(f"torch {version} is the CPU-only build; the tier needs PyPI's CUDA build")
