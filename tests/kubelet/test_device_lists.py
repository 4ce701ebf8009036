"""deviceListStrategy through the backend: the response's fields, the CDI spec file written
before Allocate answers and removed with the allocation (docs/contracts.md#device-lists)."""

from __future__ import annotations

import json
from pathlib import Path

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import cdi
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.kubelet.plugin import VgpuBackend
from vgpu_plugin.node.host.cleanup import Cleaner
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.node.observe.nodeview import driver_limit_of

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
MIB = 1 << 20


def backend(tmp_path: Path, extra: str = "") -> VgpuBackend:
    config = parse_config(
        f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {tmp_path / 'host'}\n{extra}"
    )
    gpus = [PhysicalGpu(0, A, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "0:17:00.0", 0)]
    store = AllocationStore(tmp_path / "state")
    return VgpuBackend(
        gpus, config, "n", {}, store, "0.1.0-abc", cdi_spec_dir=str(tmp_path / "cdi")
    )


def allocate(b: VgpuBackend) -> pb.ContainerAllocateResponse:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{A}-0"])]
    )
    (c,) = b.allocate(request).container_responses
    return c


def test_the_default_names_the_gpu_by_a_mount_and_sets_the_driver_limit(tmp_path: Path) -> None:
    c = allocate(backend(tmp_path))
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert [(m.container_path, m.host_path) for m in c.mounts][-1] == (
        f"/var/run/nvidia-container-devices/{A}",
        "/dev/null",
    )
    assert c.envs["NVIDIA_GPU_MEMORY_LIMIT"] == c.envs["NVIDIA_GPU_MEMORY_REQUEST"] == "20389"
    assert not list(c.cdi_devices) and not dict(c.annotations)
    assert not (tmp_path / "cdi").exists()


def test_the_record_keeps_what_was_asked_of_the_driver(tmp_path: Path) -> None:
    """status and the metrics show it per container (docs/contracts.md#driver-memory-limit)."""
    on = backend(tmp_path / "on")
    allocate(on)
    off = backend(tmp_path / "off", "driverMemoryLimit: false\n")
    allocate(off)
    assert [driver_limit_of(r) for b in (on, off) for r in b._store.all()] == ["requested", "off"]
    for r in AllocationStore(tmp_path / "on" / "state").all():  # read back from the file
        assert driver_limit_of(r) == "requested"


def test_cdi_writes_one_spec_per_allocation_and_cleanup_removes_it(tmp_path: Path) -> None:
    b = backend(tmp_path, "deviceListStrategy: [cdi-cri, cdi-annotations]\n")
    c = allocate(b)
    (record,) = b._store.all()
    aid = record.allocation_id
    names = [f"nvidia.com/gpu={A}", f"{cdi.KIND}={aid}"]
    assert [d.name for d in c.cdi_devices] == names
    assert dict(c.annotations) == {f"cdi.k8s.io/vgpu-plugin_{aid}": ",".join(names)}
    assert not dict(c.envs) and not list(c.mounts)
    path = tmp_path / "cdi" / f"vgpu-plugin-allocation_{aid}.json"
    spec = json.loads(path.read_text())
    assert spec["devices"][0]["name"] == aid
    assert f"VGPU_ALLOCATION_ID={aid}" in spec["devices"][0]["containerEdits"]["env"]
    assert path.stat().st_mode & 0o777 == 0o644
    cleaner = Cleaner(
        tmp_path / "host",
        b._store.all,
        b._store.remove,
        dict,  # the kubelet says no container holds anything
        grace=0,
        cdi_spec_dir=tmp_path / "cdi",
    )
    cleaner.run_once()
    assert not path.exists()
    assert b._store.all() == []
