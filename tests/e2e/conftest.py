"""End-to-end fixtures: a whole emulated node with real containers (runc, root only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.helpers import NodeFactory

from vgpu_plugin.demo.node import MIB, EmulatedNode
from vgpu_plugin.simgpu import GpuSpec


@pytest.fixture
def make_emulated_node(native_tree: Path, tmp_path: Path) -> Iterator[NodeFactory]:
    nodes: list[EmulatedNode] = []

    def make(
        gpus: int = 1,
        memory_mib: int = 16384,
        context_mib: int = 256,
        config: str = "version: v1\nsharing: {splitCount: 4, compute: proportional}\n",
        cleanup_grace: float | None = None,
    ) -> EmulatedNode:
        specs = [GpuSpec(memory=memory_mib * MIB, context_overhead=context_mib * MIB,
                         numa_node=i) for i in range(gpus)]  # fmt: skip
        node = EmulatedNode(tmp_path / f"node{len(nodes)}", specs, config, cleanup_grace)
        nodes.append(node)
        node.start()
        return node

    yield make
    for node in nodes:
        node.stop()
