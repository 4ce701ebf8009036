"""The kubelet's device checkpoint: the format the kubelet writes (seeds: the device manager's
``kubelet_internal_checkpoint``), read back to the allocation each container got."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core.pods import CheckpointEntry, CheckpointError
from vgpu_plugin.kubelet.checkpoint import parse_checkpoint, read_checkpoint


def alloc_resp(allocation_id: str | None) -> str:
    envs = {"NVIDIA_VISIBLE_DEVICES": "GPU-a"}
    if allocation_id is not None:
        envs["VGPU_ALLOCATION_ID"] = allocation_id
    resp = pb.ContainerAllocateResponse(
        envs=envs,
        mounts=[pb.Mount(container_path="/tmp/vgpu", host_path="/x", read_only=False)],
    )
    return base64.b64encode(resp.SerializeToString()).decode()


def entry(uid: str, container: str, devices: list[str], allocation_id: str | None) -> dict:
    return {
        "PodUID": uid,
        "ContainerName": container,
        "ResourceName": "nvidia.com/gpu",
        "DeviceIDs": {"0": devices},
        "AllocResp": alloc_resp(allocation_id),
    }


def checkpoint_bytes(*entries: dict) -> bytes:
    doc = {
        "Data": {"PodDeviceEntries": list(entries), "RegisteredDevices": {"nvidia.com/gpu": []}},
        "Checksum": 216033768,
    }
    return json.dumps(doc).encode()


def test_each_entry_names_its_allocation_from_the_allocate_response() -> None:
    data = checkpoint_bytes(
        entry("uid-1", "download", ["GPU-a-0"], "alloc-init"),
        entry("uid-1", "server", ["GPU-a-0"], "alloc-main"),
        entry("uid-2", "other-plugin", ["dev1"], None),
    )
    assert parse_checkpoint(data) == [
        CheckpointEntry("uid-1", "download", "nvidia.com/gpu", ("GPU-a-0",), ("alloc-init",)),
        CheckpointEntry("uid-1", "server", "nvidia.com/gpu", ("GPU-a-0",), ("alloc-main",)),
        CheckpointEntry("uid-2", "other-plugin", "nvidia.com/gpu", ("dev1",), ()),
    ]


def test_v1_device_lists_and_entries_without_a_response_are_read() -> None:
    raw = {"PodUID": "u", "ContainerName": "c", "ResourceName": "r", "DeviceIDs": ["d1", "d2"]}
    doc = {"Data": {"PodDeviceEntries": [raw]}, "Checksum": 1}
    assert parse_checkpoint(json.dumps(doc).encode()) == [
        CheckpointEntry("u", "c", "r", ("d1", "d2"), ())
    ]


@pytest.mark.parametrize("data", [b"\xff\xfe", b"{not json", b"[]", b'{"Data": 3}'])
def test_a_file_that_is_not_a_checkpoint_is_refused_by_name(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="kubelet_internal_checkpoint"):
        parse_checkpoint(data)


def test_read_from_the_device_plugin_dir(tmp_path: Path) -> None:
    assert read_checkpoint(tmp_path) is None
    (tmp_path / "kubelet_internal_checkpoint").write_bytes(
        checkpoint_bytes(entry("u", "c", ["GPU-a-1"], "a1"))
    )
    found = read_checkpoint(tmp_path)
    assert found is not None and found[0].allocation_ids == ("a1",)
