"""The plugin's backend behind the real gRPC server, driven by the kubelet emulator."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from vgpu_plugin.api.constants import HEALTHY, UNHEALTHY
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import NodePlan, PhysicalGpu
from vgpu_plugin.core.grant import Grant
from vgpu_plugin.core.limits import parse_limits
from vgpu_plugin.kubelet import plugin as plugin_module
from vgpu_plugin.kubelet.backend import ListTooLargeError
from vgpu_plugin.kubelet.plugin import VgpuBackend
from vgpu_plugin.kubelet.server import DevicePluginServer
from vgpu_plugin.node.gpu.health import HealthChange, Reason
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
RES = "nvidia.com/gpu"
MIB = 1 << 20


def gpus() -> list[PhysicalGpu]:
    return [
        PhysicalGpu(0, A, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "00000000:17:00.0", 0),
        PhysicalGpu(1, B, "NVIDIA H100 80GB HBM3", 81559 * MIB, 1, "00000000:27:00.0", 1),
    ]


@dataclass
class Node:
    kubelet: KubeletEmulator
    backend: VgpuBackend
    store: AllocationStore
    host_root: Path


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    host_root = tmp_path / "host"
    config = parse_config(
        f"version: v1\nsharing: {{splitCount: 4, compute: proportional}}\nhostRoot: {host_root}\n"
        # The response as it was before deviceListStrategy (tests/kubelet/test_device_lists.py
        # covers the others and the default).
        "deviceListStrategy: envvar\ndriverMemoryLimit: false\n"
    )
    store = AllocationStore(tmp_path / "state")
    backend = VgpuBackend(gpus(), config, "node-1", {}, store, shim_version="0.1.0-abc")
    plugin_dir = short_tmp_dir()
    kubelet = KubeletEmulator(plugin_dir)
    kubelet.start()
    server = DevicePluginServer(backend, RES, plugin_dir, poll_interval=0.05)
    server.start()
    try:
        kubelet.wait_registrations(1, timeout=5)
        kubelet.wait_devices(RES, lambda d: len(d) == 8, timeout=5)
        yield Node(kubelet, backend, store, host_root)
    finally:
        server.stop()
        kubelet.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)


def test_advertises_every_slice_with_numa_topology(node: Node) -> None:
    devices = node.kubelet.devices(RES)
    assert devices is not None
    assert sorted(d.ID for d in devices) == sorted(
        [f"{A}-{k}" for k in range(4)] + [f"{B}-{k}" for k in range(4)]
    )
    assert {d.ID: d.topology.nodes[0].ID for d in devices}[f"{B}-2"] == 1
    assert all(d.health == HEALTHY for d in devices)


def test_allocate_matches_the_design_example(node: Node) -> None:
    response = node.kubelet.allocate(RES, [f"{B}-1", f"{A}-0", f"{A}-3"])
    (c,) = response.container_responses
    aid = c.envs["VGPU_ALLOCATION_ID"]
    assert dict(c.envs) == {
        "NVIDIA_VISIBLE_DEVICES": f"{A},{B}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "40778m",
        "CUDA_DEVICE_SM_LIMIT_0": "50",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "20389m",
        "CUDA_DEVICE_SM_LIMIT_1": "25",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/tmp/vgpu/{aid}.cache",
        "CUDA_OVERSUBSCRIBE": "false",
        "VGPU_ALLOCATION_ID": aid,
    }
    root = node.host_root
    assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == [
        ("/etc/vgpu/libvgpu.so", f"{root}/lib/libvgpu.so.0.1.0-abc", True),
        ("/etc/ld.so.preload", f"{root}/ld.so.preload", True),
        ("/etc/vgpu/limits", f"{root}/limits/{aid}", True),
        ("/tmp/vgpu", f"{root}/containers/{aid}", False),
        ("/tmp/vgpulock", "/tmp/vgpulock", False),
    ]
    # What the response points at exists before the kubelet gets it.
    assert (root / "containers" / aid).is_dir()
    limits = parse_limits((root / "limits" / aid).read_text())
    assert [(g.uuid, g.memory_bytes, g.compute_percent) for g in limits.gpus] == [
        (A, 40778 * MIB, 50),
        (B, 20389 * MIB, 25),
    ]
    (record,) = node.store.all()
    assert record.allocation_id == aid
    assert sorted(record.device_ids) == sorted([f"{B}-1", f"{A}-0", f"{A}-3"])


def test_one_call_for_several_containers_gives_each_its_own_allocation(node: Node) -> None:
    response = node.kubelet.allocate(RES, [f"{A}-0"], [f"{A}-1", f"{A}-2"])
    first, second = response.container_responses
    assert first.envs["VGPU_ALLOCATION_ID"] != second.envs["VGPU_ALLOCATION_ID"]
    assert first.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20389m"
    assert second.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40778m"
    assert len(node.store.all()) == 2


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        ([f"{A}-9"], f"{A}-9"),
        (["GPU-ffffffff-0000-0000-0000-000000000000-0"], "GPU-ffffffff"),
        (["not-a-device"], "not-a-device"),
        ([f"{A}-0", "bogus"], "bogus"),
        ([], "empty request"),
    ],
)
def test_refused_requests_name_the_id_and_write_nothing(
    node: Node, ids: list[str], named: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        node.kubelet.allocate(RES, [f"{B}-0"], ids)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (info.value.details() or "")
    assert node.store.all() == []
    assert not (node.host_root / "limits").exists() or not any(
        (node.host_root / "limits").iterdir()
    )


def test_preferred_allocation_packs_then_spreads(node: Node) -> None:
    available = [f"{A}-0", f"{B}-0", f"{B}-1", f"{B}-2"]
    assert sorted(node.kubelet.get_preferred_allocation(RES, available, size=2)) == [
        f"{B}-0",
        f"{B}-1",
    ]
    spread = parse_config(
        f"version: v1\nsharing: {{splitCount: 4, placement: spread}}\nhostRoot: {node.host_root}\n"
    )
    node.backend.apply_config(spread, {})
    chosen = node.kubelet.get_preferred_allocation(RES, available, size=2)
    assert {c.rsplit("-", 1)[0] for c in chosen} == {A, B}


def test_health_changes_are_advertised(node: Node) -> None:
    node.backend.apply_health([HealthChange(B, False, Reason.XID, "XID 79")])
    devices = node.kubelet.wait_devices(
        RES, lambda d: sum(x.health == UNHEALTHY for x in d) == 4, timeout=5
    )
    assert {d.ID.rsplit("-", 1)[0] for d in devices if d.health == UNHEALTHY} == {B}
    node.backend.apply_health([HealthChange(B, True, Reason.RECOVERED, "quiet")])
    node.kubelet.wait_devices(RES, lambda d: all(x.health == HEALTHY for x in d), timeout=5)


def test_new_split_is_advertised_and_old_allocations_keep_their_limits(node: Node) -> None:
    response = node.kubelet.allocate(RES, [f"{A}-0"])
    aid = response.container_responses[0].envs["VGPU_ALLOCATION_ID"]
    before = (node.host_root / "limits" / aid).read_text()
    eight = parse_config(f"version: v1\nsharing: {{splitCount: 8}}\nhostRoot: {node.host_root}\n")
    node.backend.apply_config(eight, {})
    node.kubelet.wait_devices(RES, lambda d: len(d) == 16, timeout=5)
    assert (node.host_root / "limits" / aid).read_text() == before
    again = node.kubelet.allocate(RES, [f"{A}-7"]).container_responses[0]
    assert again.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{81559 // 8}m"


# Placement follows the overrides and what live allocations hold -------------------------------


@pytest.mark.parametrize(
    "match", ["{nodeNames: [node-1]}", "{gpuModels: ['*H100*']}", "{nodeLabels: {pool: a}}"]
)
def test_preferred_allocation_follows_a_per_node_or_per_gpu_placement_override(
    node: Node, match: str
) -> None:
    config = parse_config(
        f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {node.host_root}\n"
        f"overrides:\n  - match: {match}\n    sharing: {{placement: spread}}\n"
    )
    node.backend.apply_config(config, {"pool": "a"})
    available = [f"{A}-0", f"{B}-0", f"{B}-1", f"{B}-2"]
    chosen = node.kubelet.get_preferred_allocation(RES, available, size=2)
    assert {c.rsplit("-", 1)[0] for c in chosen} == {A, B}


def test_placement_weighs_what_live_allocations_hold_after_a_split_change(
    tmp_path: Path,
) -> None:
    # Two 16 GiB GPUs split in 4; two pods of two slices fill GPU A (16384 MiB promised).
    small = [
        PhysicalGpu(0, A, "NVIDIA T4", 16384 * MIB, 0, "00000000:17:00.0", 0),
        PhysicalGpu(1, B, "NVIDIA T4", 16384 * MIB, 1, "00000000:27:00.0", 0),
    ]
    root = tmp_path / "host"
    four = parse_config(f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {root}\n")
    store = AllocationStore(tmp_path / "state")
    backend = VgpuBackend(small, four, "node-1", {}, store, shim_version="0.1.0-abc")
    for ids in ([f"{A}-0", f"{A}-1"], [f"{A}-2", f"{A}-3"]):
        backend.allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        )
    eight = parse_config(f"version: v1\nsharing: {{splitCount: 8}}\nhostRoot: {root}\n")
    backend.apply_config(eight, {})
    # The kubelet still holds A-0..A-3 and offers the rest: A-4..A-7 look free, but A's
    # memory is all promised. Both new 2-slice pods belong on B.
    taken = {f"{A}-{k}" for k in range(4)}
    for _ in range(2):
        available = [s.id for s in backend.plan.all_slices() if s.id not in taken]
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, allocation_size=2
                )
            ]
        )
        chosen = list(backend.preferred_allocation(request).container_responses[0].deviceIDs)
        assert {c.rsplit("-", 1)[0] for c in chosen} == {B}
        backend.allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)])
        )
        taken |= set(chosen)
    # Once B is promised too, the advice still answers (it is advice): A's leftover IDs.
    available = [s.id for s in backend.plan.all_slices() if s.id not in taken]
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=2)
        ]
    )
    assert len(backend.preferred_allocation(request).container_responses[0].deviceIDs) == 2


# One snapshot of config and plan --------------------------------------------------------------


def test_a_refused_reload_is_never_visible(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def too_large(devices: list[pb.Device]) -> int:
        seen.append(len(node.backend.plan.all_slices()))  # what a concurrent call would read
        raise ListTooLargeError(len(devices), 5 << 20, 4 << 20)

    monkeypatch.setattr(plugin_module, "check_list_size", too_large)
    bigger = parse_config(f"version: v1\nsharing: {{splitCount: 16}}\nhostRoot: {node.host_root}\n")
    with pytest.raises(ListTooLargeError):
        node.backend.apply_config(bigger, {})
    assert seen == [8]
    assert len(node.backend.plan.all_slices()) == 8


def test_allocate_reads_one_snapshot_across_a_reload(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other_root = tmp_path / "other-root"
    renamed = parse_config(
        f"version: v1\nresourceName: example.com/gpu\nsharing: {{splitCount: 2}}\n"
        f"hostRoot: {other_root}\n"
    )
    real_grant = plugin_module.grant
    calls = 0

    def grant_during_a_reload(plan: NodePlan, ids: list[str], aid: str) -> Grant:
        nonlocal calls
        calls += 1
        if calls == 1:
            node.backend.apply_config(renamed, {})  # lands between the reads of one call
        return real_grant(plan, ids, aid)

    monkeypatch.setattr(plugin_module, "grant", grant_during_a_reload)
    response = node.backend.allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"{A}-3"])])
    )
    (c,) = response.container_responses
    assert c.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20389m"  # the old plan's slice
    assert all(not m.host_path.startswith(str(other_root)) for m in c.mounts)
    (record,) = node.store.all()
    assert record.resource_name == RES
    assert not other_root.exists()


# Scale --------------------------------------------------------------------------------------


def test_an_allocate_of_1000_containers_is_one_store_write_and_one_sync_per_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "host"
    config = parse_config(f"version: v1\nsharing: {{splitCount: 4}}\nhostRoot: {root}\n")
    store = AllocationStore(tmp_path / "state")
    backend = VgpuBackend(gpus(), config, "node-1", {}, store, shim_version="0.1.0-abc")
    synced: list[str] = []

    def spy(real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return sync

    monkeypatch.setattr(os, "fsync", spy(os.fsync))
    monkeypatch.setattr(os, "fdatasync", spy(os.fdatasync))
    ids = [s.id for s in backend.plan.all_slices()]
    request = pb.AllocateRequest(
        container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[ids[i % len(ids)]]) for i in range(1000)
        ]
    )
    response = backend.allocate(request)
    aids = [c.envs["VGPU_ALLOCATION_ID"] for c in response.container_responses]
    assert len(set(aids)) == 1000
    assert {r.allocation_id for r in AllocationStore(tmp_path / "state").all()} == set(aids)
    assert all((root / "limits" / aid).is_file() for aid in aids)
    state_dir = str(tmp_path / "state")
    assert [p for p in synced if p.startswith(state_dir)] == [f"{state_dir}/allocations.journal"]
    assert synced.count(str(root / "limits")) == 1
    assert synced.count(str(root / "containers")) == 1
    # Every limits file's own content is synced before the record names it.
    assert sum(p.startswith(f"{root}/limits/") for p in synced) == 1000


def test_a_failed_record_write_leaves_no_files_and_no_record(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(grpc.RpcError) as info:
        node.kubelet.allocate(RES, [f"{A}-0"], [f"{A}-1"])
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "No space left" in (info.value.details() or "")
    monkeypatch.undo()
    assert node.store.all() == []
    assert not any((node.host_root / "limits").iterdir())
    assert not any((node.host_root / "containers").iterdir())


@pytest.fixture
def read_only(node: Node) -> Iterator[Callable[[], None]]:
    """Makes the host root read-only (a bind mount of itself, remounted ro) when called."""
    mounted: list[Path] = []

    def make() -> None:
        root = str(node.host_root)
        for args in (["--bind", root, root], ["-o", "remount,bind,ro", root]):
            done = subprocess.run(["mount", *args], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a read-only host root here: {done.stderr.strip()}")
            if not mounted:
                mounted.append(node.host_root)

    yield make
    for m in mounted:
        subprocess.run(["umount", str(m)], check=True)


def test_a_read_only_host_root_fails_allocate_with_one_line_naming_the_file(
    node: Node, read_only: Callable[[], None], caplog: pytest.LogCaptureFixture
) -> None:
    node.kubelet.allocate(RES, [f"{A}-0"])  # the root's dirs exist, as on a node
    read_only()
    with pytest.raises(grpc.RpcError) as info:
        node.kubelet.allocate(RES, [f"{A}-1"], [f"{B}-0"])
    details = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "Read-only file system" in details and str(node.host_root) in details, details
    assert "\n" not in details
    # One error, never a chain of them: the roll-back's own failure is one logged line.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert len(node.store.all()) == 1
