"""Shared fixtures: the native build and a fresh simulated GPU node per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import native_build

from vgpu_plugin import native
from vgpu_plugin.simgpu import GpuSpec, Node


@pytest.fixture(scope="session")
def native_tree() -> Path:
    """The release build of native/ with the test programs; the package's code uses it too."""
    tree = native_build.build("release")
    os.environ[native.NATIVE_DIR_ENV] = str(tree)
    return tree


@pytest.fixture(scope="session")
def native_bin(native_tree: Path) -> Path:
    """Where the C test programs of tests/native are built."""
    return native_tree / "tests"


@pytest.fixture
def simgpu_node(native_tree: Path, tmp_path: Path) -> Iterator[Node]:
    """A fresh node of 2 simulated 16 GiB GPUs; ``node.env()`` runs a subprocess on it."""
    gpus = [GpuSpec(memory=16 << 30, numa_node=i) for i in range(2)]
    yield Node.create(tmp_path / "simgpu", gpus, seed=tmp_path.name)


def make_node(tmp_path: Path, gpus: list[GpuSpec]) -> Node:
    """A node of the given GPUs, for tests that need another shape."""
    return Node.create(tmp_path / "simgpu", gpus, seed=tmp_path.name)


def require_root() -> None:
    """Skip, with the reason, where the test needs root and namespaces and has neither."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount/pid namespaces); run the tests as root to include it")
