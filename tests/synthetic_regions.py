"""Region snapshots and prepared DRA claims made up by tests: just what the node view reads
(nodeview's Protocols, node/dra_claims)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.ledger.dra_claims import PreparedClaim, PreparedDevice


@dataclass(frozen=True)
class Dev:
    uuid: str
    used: int  # bytes the region's total says the container uses on this GPU
    refused: int = 0  # the region's counters (vgpu_region_device_stats)
    fallbacks: int = 0
    peak: int = 0
    gpu_ns: int = 0
    driver_limit: int = 0  # what a process found the driver holds it to (region.h)
    driver_limit_state: int = 0


@dataclass(frozen=True)
class Proc:
    alive: bool
    used: tuple[int, ...]  # bytes per device, in the order of Snap.devices
    pid: int = 0  # in the container's pid namespace
    start_time: int = 0  # clock ticks since boot


@dataclass(frozen=True)
class Snap:
    devices: tuple[Dev, ...]
    processes: tuple[Proc, ...]


def prepared_claim(uid: str, *limits: GpuLimit, created: float) -> PreparedClaim:
    aid = f"dra-{uid}"
    return PreparedClaim(
        uid=uid,
        namespace="ml",
        name="infer",
        allocation_id=aid,
        allocation_dir=f"/host/containers/{aid}",
        limits_path=f"/host/limits/{aid}",
        devices=(PreparedDevice(("gpu",), "node-1", "gpu-a", (f"vgpu-plugin/allocation={aid}",)),),
        limits=limits,
        created=created,
    )


# --- the scrape's path: the cached body -----------------------------------------------------


def pace_bytes(
    *devices: tuple[str, int, int], version: int = 1, magic: bytes = b"VGPUPAC\0"
) -> bytes:
    """A pacing file as the shim lays it out (native/libvgpu/src/pace.c; docs/contracts.md,
    Compute): per GPU (uuid, guarantee %, ns held back), written here by hand, not through
    the reader's own layout constants, so a reader that drifts from the shim's layout fails."""
    out = bytearray(64 + 16 * 192)
    struct.pack_into("<8sIIQ", out, 0, magic, version, len(devices), len(out))
    for i, (uuid, request, held_ns) in enumerate(devices):
        rec = 64 + i * 192
        out[rec : rec + len(uuid)] = uuid.encode()
        struct.pack_into("<I", out, rec + 80, request)  # percent: the creator's share
        struct.pack_into("<I", out, rec + 84, request)
        struct.pack_into("<Q", out, rec + 96, held_ns)
    return bytes(out)
