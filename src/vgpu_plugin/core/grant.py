"""What one container gets: the requested slices, merged per physical GPU, or (DRA) the
amounts a claim consumed of each GPU. Either way the result is one ``Grant``, from which
``core/allocation.py`` builds the same envs, mounts, limits file and CDI spec.

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
        compute = min(100, sum(s.compute_percent for s in slices))
        memory = sum(s.memory_mib for s in slices) * MIB
        sharing = gpu_plan.sharing
        if sharing.compute == "guaranteed":  # the slices' shares are the guarantee
            cap = sharing.compute_limit
            limit = GpuLimit(gpu_plan.gpu.uuid, memory, cap, min(cap, compute))
        else:
            limit = GpuLimit(gpu_plan.gpu.uuid, memory, compute)
        gpus.append(
            GpuGrant(
                gpu=gpu_plan.gpu,
                slice_ids=tuple(s.id for s in sorted(slices, key=lambda s: s.k)),
                limit=limit,
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


@dataclass(frozen=True)
class Amount:
    """What a grant by amount asks of one GPU (a DRA claim's consumed capacity): memory in
    bytes, compute in percent (0: not limited)."""

    uuid: str
    memory_bytes: int
    compute_percent: int

    @property
    def promised_percent(self) -> int:
        return self.compute_percent


def grant_amounts(
    gpus: Sequence[PhysicalGpu],
    amounts: Sequence[Amount],
    allocation_id: str,
    compute_limit: int | None = None,
) -> Grant:
    """A grant from amounts instead of slices: amounts on one GPU add up (compute capped at
    100), GPUs in physical index order; :class:`InvalidRequest` for a GPU that is not one of
    ``gpus``, no amount at all, or more memory than the GPU has. ``compute_limit`` (DRA's
    ``dra.computeLimit``): the compute asked is a guarantee, this its cap (docs/compute.md)."""
    check_allocation_id(allocation_id)
    if not amounts:
        raise InvalidRequest("empty request: no GPU amounts")
    by_uuid = {g.uuid: g for g in gpus}
    memory: dict[str, int] = {}
    compute: dict[str, int] = {}
    for a in amounts:
        if a.uuid not in by_uuid:
            raise InvalidRequest(f"GPU {a.uuid} is not one of this node's GPUs", a.uuid)
        if a.memory_bytes < 1 or not 0 <= a.compute_percent <= 100:
            raise InvalidRequest(
                f"GPU {a.uuid}: memory {a.memory_bytes} bytes and compute"
                f" {a.compute_percent}% are not a valid amount (memory >= 1, compute 0..100)",
                a.uuid,
            )
        memory[a.uuid] = memory.get(a.uuid, 0) + a.memory_bytes
        compute[a.uuid] = compute.get(a.uuid, 0) + a.compute_percent
    out: list[GpuGrant] = []
    for gpu in sorted((by_uuid[u] for u in memory), key=lambda g: g.index):
        if memory[gpu.uuid] > gpu.memory_total:
            raise InvalidRequest(
                f"GPU {gpu.uuid}: {memory[gpu.uuid]} bytes asked, the GPU has {gpu.memory_total}",
                gpu.uuid,
            )
        asked = min(100, compute[gpu.uuid])
        if compute_limit is None:
            limit = GpuLimit(gpu.uuid, memory[gpu.uuid], asked)
        else:  # 0 asked is all of the GPU: guaranteed all of it, up to the cap
            guarantee = min(compute_limit, asked or 100)
            limit = GpuLimit(gpu.uuid, memory[gpu.uuid], compute_limit, guarantee)
        out.append(GpuGrant(gpu=gpu, slice_ids=(), limit=limit))
    return Grant(allocation_id, tuple(out), oversubscribed=False)
