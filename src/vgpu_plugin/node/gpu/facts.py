"""What is known of a physical GPU besides the allocations: NVML reads it, the node view
shows it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFacts:
    """What is known of a physical GPU besides the allocations; None: not known."""

    uuid: str
    index: int | None = None
    name: str | None = None
    memory_total: int | None = None
    slices_total: int | None = None
    memory_used_nvml: int | None = None
    healthy: bool | None = None
