"""Region snapshots made up by tests: just what the node view reads (nodeview's Protocols)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dev:
    uuid: str
    used: int  # bytes the region's total says the container uses on this GPU
    refused: int = 0  # the region's counters (vgpu_region_device_stats)
    fallbacks: int = 0
    peak: int = 0
    gpu_ns: int = 0


@dataclass(frozen=True)
class Proc:
    alive: bool
    used: tuple[int, ...]  # bytes per device, in the order of Snap.devices


@dataclass(frozen=True)
class Snap:
    devices: tuple[Dev, ...]
    processes: tuple[Proc, ...]
