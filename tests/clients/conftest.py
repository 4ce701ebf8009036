"""The real-client tier: NVIDIA's CUDA runtime (libcudart 12 and 13) and CuPy, from PyPI, on a
simulated node, each scenario without and with the shim. A test skips, saying so, only where
its wheel is not installed (`pip install -e '.[test]'` installs them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from test_shim_helpers import Shim

from vgpu_plugin.simgpu import Node


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)
