"""What one container gets: the requested slices, merged per physical GPU.

Several slices of one GPU in one container add up: two 20389 MiB / 25 % slices are one GPU
limited to 40778 MiB / 50 % (the ancestor plugin gave such a container one slice's memory).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_plugin.core.devices import MIB, GpuLimit, NodePlan, PhysicalGpu, Slice, parse_device_id

# Safe as a file name: it names the limits file and the per-container dir on the host.
ALLOCATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class InvalidRequest(ValueError):
    """Allocate was asked for something this plugin cannot grant; names the ID and why."""

    def __init__(self, message: str, device_id: str | None = None) -> None:
        super().__init__(message)
        self.device_id = device_id


@dataclass(frozen=True)
class GpuGrant:
    """One physical GPU of a grant: its slices' memory summed, and their compute summed and
    capped at 100 (0: not limited)."""

    gpu: PhysicalGpu
    slice_ids: tuple[str, ...]
    limit: GpuLimit


@dataclass(frozen=True)
class Grant:
    """A container's allocation; ``gpus`` in physical index order. ``oversubscribed``: some
    granted GPU's memoryScaling is above 1."""

    allocation_id: str
    gpus: tuple[GpuGrant, ...]
    oversubscribed: bool

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(i for g in self.gpus for i in g.slice_ids)


def check_allocation_id(allocation_id: str) -> None:
    """Raise ValueError unless the id is safe as a file name (it names host dirs and files)."""
    if not ALLOCATION_ID.match(allocation_id):
        raise ValueError(
            f"allocation id {allocation_id!r}: must be 1..128 letters, digits, '.', '_' or '-',"
            " starting with a letter or digit"
        )


def new_allocation_id() -> str:
    """A short unique id, time-ordered: milliseconds since the epoch then 32 random bits, in hex.

    Sorting ids sorts allocations by time (to the millisecond), which keeps host dirs readable.
    """
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(4)}"


def grant(plan: NodePlan, device_ids: Sequence[str], allocation_id: str) -> Grant:
    """Merge the requested slices per GPU; :class:`InvalidRequest` when any ID is not ours."""
    check_allocation_id(allocation_id)
    if not device_ids:
        raise InvalidRequest(f"empty request: no {plan.resource_name} device IDs")
    if plan.fail_requests_greater_than_one and len(device_ids) > 1:
        raise InvalidRequest(
            f"request for {len(device_ids)} {plan.resource_name} slices refused: this node"
            " allows one per container (failRequestsGreaterThanOne)"
        )
    by_gpu: dict[str, list[Slice]] = {}
    seen: set[str] = set()
    for device_id in device_ids:
        if device_id in seen:
            raise InvalidRequest(f"device ID {device_id!r} requested twice", device_id)
        seen.add(device_id)
        found = _slice(plan, device_id)
        by_gpu.setdefault(found.gpu_uuid, []).append(found)
    gpus: list[GpuGrant] = []
    oversubscribed = False
    for gpu_plan in plan.gpus:  # physical index order
        slices = by_gpu.get(gpu_plan.gpu.uuid)
        if not slices:
            continue
        compute = sum(s.compute_percent for s in slices)
        gpus.append(
            GpuGrant(
                gpu=gpu_plan.gpu,
                slice_ids=tuple(s.id for s in sorted(slices, key=lambda s: s.k)),
                limit=GpuLimit(
                    gpu_plan.gpu.uuid, sum(s.memory_mib for s in slices) * MIB, min(100, compute)
                ),
            )
        )
        oversubscribed = oversubscribed or gpu_plan.sharing.oversubscribed
    return Grant(allocation_id, tuple(gpus), oversubscribed)


def _slice(plan: NodePlan, device_id: str) -> Slice:
    found = plan.slice(device_id)
    if found is not None:
        return found
    parsed = parse_device_id(device_id)
    if parsed is None:
        raise InvalidRequest(
            f"malformed device ID {device_id!r}: expected <GPU-UUID>-<k>", device_id
        )
    uuid, k = parsed
    gpu_plan = plan.gpu(uuid)
    if gpu_plan is None:
        raise InvalidRequest(
            f"device ID {device_id!r}: GPU {uuid} is not one of this node's"
            f" {plan.resource_name} GPUs",
            device_id,
        )
    count = len(gpu_plan.slices)
    raise InvalidRequest(
        f"device ID {device_id!r}: slice {k} out of range, GPU {uuid} has {count}"
        f" slices (0..{count - 1})",
        device_id,
    )
