"""Region snapshots and prepared DRA claims made up by tests: just what the node view reads
(nodeview's Protocols, node/dra_claims)."""

from __future__ import annotations

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
