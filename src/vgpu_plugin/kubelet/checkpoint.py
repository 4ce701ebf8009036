"""Reader of the kubelet's device-manager checkpoint (``kubelet_internal_checkpoint``).

The kubelet keeps, in the device-plugin dir, a JSON file with every container it allocated
devices to: pod UID, container name, resource, device IDs and the Allocate response it got,
init containers included (the pod-resources ``List`` omits non-restartable init containers).
The response carries our ``VGPU_ALLOCATION_ID`` env (or, with the CDI strategies, our CDI
device named by the allocation id), so each entry names its allocation exactly, without
guessing from device IDs. Node-local, read-only, never on the Allocate path.

The kubelet writes the file after our Allocate answered (tmp file, fsync, rename), keeping each
container's whole serialized ``ContainerAllocateResponse``; after a node reboot it starts the
containers again from these responses without calling Allocate. ``serve`` rebuilds at start
what an entry's response needs on the host and a power loss took (``kubelet/rebuild.py``).

The kubelet drops a deleted pod's entries only at its next write of the file (the next
admission of a pod with devices, a device-list update, its own restart): an entry says that
the pod *may* still live, not that it does. ``cleanup.holders`` combines it with ``List``.

Format (v2, kubelet ≥ 1.20; v1 had a flat ``DeviceIDs`` list and is read too)::

    {"Data": {"PodDeviceEntries": [{"PodUID": "...", "ContainerName": "...",
      "ResourceName": "...", "DeviceIDs": {"<numa>": ["id", ...]}, "AllocResp": "<base64>"}],
      "RegisteredDevices": {...}}, "Checksum": 123}

The checksum is the kubelet's hash of Go's in-memory dump and is not reproducible here; the
file is written by rename, so a reader never sees half of it.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import cdi
from vgpu_plugin.core.pods import CheckpointEntry, CheckpointError

CHECKPOINT_NAME = "kubelet_internal_checkpoint"
ALLOCATION_ENV = "VGPU_ALLOCATION_ID"
# A checkpoint is a few KiB per container; anything this big is not one.
_MAX_BYTES = 64 * 1024 * 1024


def _response(alloc_resp: Any) -> pb.ContainerAllocateResponse | None:
    if not isinstance(alloc_resp, str) or not alloc_resp:
        return None
    try:
        return pb.ContainerAllocateResponse.FromString(base64.b64decode(alloc_resp))
    except (binascii.Error, ValueError, DecodeError):
        return None


def allocation_ids_of(resp: pb.ContainerAllocateResponse | None) -> tuple[str, ...]:
    """Our env; with the CDI strategies (whose envs are in the spec) our CDI device's name,
    from the response's CDI devices or its CDI annotation."""
    if resp is None:
        return ()
    value = resp.envs.get(ALLOCATION_ENV)
    if value:
        return (value,)
    names = [d.name for d in resp.cdi_devices]
    for key, devices in resp.annotations.items():
        if key.startswith(cdi.ANNOTATION_PREFIX):
            names += devices.split(",")
    ours = f"{cdi.KIND}="
    for name in names:
        if name.startswith(ours) and len(name) > len(ours):
            return (name[len(ours) :],)
    return ()


def _device_ids(raw: Any) -> tuple[str, ...]:
    if isinstance(raw, list):  # v1
        return tuple(d for d in raw if isinstance(d, str))
    if isinstance(raw, dict):  # v2: NUMA node -> IDs
        return tuple(
            d for ids in raw.values() if isinstance(ids, list) for d in ids if isinstance(d, str)
        )
    return ()


def parse_checkpoint(data: bytes, source: str = CHECKPOINT_NAME) -> list[CheckpointEntry]:
    """The entries of a checkpoint's bytes; raises CheckpointError naming ``source``."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{source}: not JSON ({exc})") from exc
    body = doc.get("Data") if isinstance(doc, dict) else None
    entries = body.get("PodDeviceEntries", []) if isinstance(body, dict) else None
    if entries is None and isinstance(body, dict):
        entries = []  # Go writes a nil list as null: no container has devices
    if not isinstance(entries, list):
        raise CheckpointError(f"{source}: no Data.PodDeviceEntries list (not a kubelet checkpoint)")
    out: list[CheckpointEntry] = []
    for raw in entries:
        if not isinstance(raw, dict):
            continue
        uid, name, resource = raw.get("PodUID"), raw.get("ContainerName"), raw.get("ResourceName")
        if not (isinstance(uid, str) and isinstance(name, str) and isinstance(resource, str)):
            continue
        resp = _response(raw.get("AllocResp"))
        out.append(
            CheckpointEntry(
                uid,
                name,
                resource,
                _device_ids(raw.get("DeviceIDs")),
                allocation_ids_of(resp),
                resp,
            )
        )
    return out


def read_checkpoint(plugin_dir: Path | str) -> list[CheckpointEntry] | None:
    """The checkpoint in ``plugin_dir``; None when there is none (a kubelet that has not
    written one yet). Raises CheckpointError when it cannot be read or parsed."""
    path = Path(plugin_dir) / CHECKPOINT_NAME
    try:
        # O_NONBLOCK: a FIFO planted under the name must not hang the cleanup thread.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        raise CheckpointError(f"{path}: larger than {_MAX_BYTES} bytes")
    return parse_checkpoint(data, str(path))
