"""An allocation's host files (node/host/hostfiles.py): one implementation for the device plugin's
Allocate and the DRA driver's claims, and what each front end leaves when a write fails."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core.allocation import ContainerSpec
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.kubelet import plugin as plugin_module
from vgpu_plugin.kubelet.backend import BackendError
from vgpu_plugin.kubelet.plugin import VgpuBackend
from vgpu_plugin.node.host import hostfiles
from vgpu_plugin.node.ledger.state import AllocationStore

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
MIB = 1 << 20


def backend(tmp_path: Path) -> VgpuBackend:
    config = parse_config(
        f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {tmp_path / 'host'}\n"
        "deviceListStrategy: [cdi-cri]\n"
    )
    gpus = [PhysicalGpu(0, A, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "0:17:00.0", 0)]
    return VgpuBackend(
        gpus, config, "n", {}, AllocationStore(tmp_path / "state"), "0.1.0-abc",
        cdi_spec_dir=str(tmp_path / "cdi"),
    )  # fmt: skip


def request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )


def files(tmp_path: Path) -> list[str]:
    return sorted(
        str(p.relative_to(tmp_path))
        for d in ("host/limits", "host/containers", "cdi")
        for p in (tmp_path / d).glob("*")
    )


def test_allocate_writes_its_files_through_hostfiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[str] = []

    def spy(
        spec: ContainerSpec,
        allocation_id: str,
        cdi_spec_dir: str | Path,
        sync_dir: bool = True,
        durable: bool = True,
    ) -> None:
        written.append(allocation_id)
        hostfiles.write_allocation(spec, allocation_id, cdi_spec_dir, sync_dir, durable)

    monkeypatch.setattr(plugin_module, "write_allocation", spy)
    backend(tmp_path).allocate(request([f"{A}-0"]))
    (record,) = AllocationStore(tmp_path / "state").all()
    aid = record.allocation_id
    assert written == [aid]
    alloc_dir = tmp_path / "host" / "containers" / aid
    assert stat.S_IMODE(alloc_dir.stat().st_mode) == 0o777
    assert stat.S_IMODE((tmp_path / "host" / "limits" / aid).stat().st_mode) == 0o644
    assert (tmp_path / "cdi" / f"vgpu-plugin-allocation_{aid}.json").is_file()


def test_a_failed_write_removes_every_container_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def second_fails(
        spec: ContainerSpec,
        allocation_id: str,
        cdi_spec_dir: str | Path,
        sync_dir: bool = True,
        durable: bool = True,
    ) -> None:
        nonlocal calls
        calls += 1
        # The second container's CDI spec cannot be written: its dir and limits file were.
        spec_dir = Path(cdi_spec_dir) / "full" if calls == 2 else cdi_spec_dir
        hostfiles.write_allocation(spec, allocation_id, spec_dir)

    b = backend(tmp_path)
    (tmp_path / "cdi").mkdir()
    (tmp_path / "cdi" / "full").write_text("")  # a file where a dir must be
    monkeypatch.setattr(plugin_module, "write_allocation", second_fails)
    with pytest.raises(BackendError, match="cannot prepare the allocation"):
        b.allocate(request([f"{A}-0"], [f"{A}-1"]))
    assert calls == 2
    # The first container's files and record, and what the second wrote, are all gone.
    assert files(tmp_path) == ["cdi/full"]
    assert AllocationStore(tmp_path / "state").all() == []


def test_remove_allocation_is_idempotent(tmp_path: Path) -> None:
    backend(tmp_path).allocate(request([f"{A}-0"]))
    (record,) = AllocationStore(tmp_path / "state").all()
    aid = record.allocation_id
    assert len(files(tmp_path)) == 3
    args = (tmp_path / "host/containers" / aid, tmp_path / "host/limits" / aid, aid)
    hostfiles.remove_allocation(*args, tmp_path / "cdi")
    assert files(tmp_path) == []
    hostfiles.remove_allocation(*args, tmp_path / "cdi")
