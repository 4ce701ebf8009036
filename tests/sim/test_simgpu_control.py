"""The simulator's control API: nodes are created, read back, refused when invalid."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_plugin.sim.simgpu import GpuSpec, Node, SimGpuError, main


def test_node_reads_back_its_configuration(simgpu_node: Node) -> None:
    gpus = simgpu_node.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert all(g.total_memory == 16 << 30 and g.used_memory == 0 for g in gpus)
    assert gpus[0].uuid != gpus[1].uuid
    assert all(g.uuid.startswith("GPU-") and len(g.uuid) == 40 for g in gpus)
    assert [g.numa_node for g in gpus] == [0, 1]


def test_faults_are_recorded(simgpu_node: Node) -> None:
    simgpu_node.inject_xid(1, 79)
    simgpu_node.inject_xid(1, 48)
    simgpu_node.set_lost(0)
    assert simgpu_node.gpu(1).xid_count == 2
    assert simgpu_node.gpu(0).lost
    simgpu_node.set_lost(0, False)
    assert not simgpu_node.gpu(0).lost


def test_unknown_gpu_is_refused_with_reason(simgpu_node: Node) -> None:
    with pytest.raises(SimGpuError, match="GPU 5 does not exist"):
        simgpu_node.inject_xid(5, 79)


def test_foreign_state_file_is_refused(native_tree: Path, tmp_path: Path) -> None:
    (tmp_path / "node.simgpu").write_bytes(bytes(1 << 20))
    with pytest.raises(SimGpuError, match="not a simgpu node"):
        Node(tmp_path).gpu(0)


def test_invalid_node_is_refused(native_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(SimGpuError, match="context overhead"):
        Node.create(tmp_path, [GpuSpec(memory=1 << 20, context_overhead=2 << 20)])


def test_cli_create_and_status(
    native_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["create", "--state", str(tmp_path), "--gpus", "3", "--memory", "8g"]) == 0
    out = capsys.readouterr().out
    assert out.count("8192 MiB") == 3
    assert main(["create", "--state", str(tmp_path), "--memory", "1.5g"]) == 1
    assert "--memory" in capsys.readouterr().err
