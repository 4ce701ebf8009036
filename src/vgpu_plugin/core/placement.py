"""GetPreferredAllocation: which of the available slices a container asking for ``size`` should get.

It is advice (the kubelet may pick others), so it never raises on an impossible request: it
returns the best it can. Policies:

- ``binpack``: as few GPUs as possible; among those, the fullest (fewest available slices), so
  emptier GPUs stay free for larger requests. GPUs the must-include slices already use are
  filled first, as they cost no extra GPU.
- ``spread``: one slice per GPU across as many GPUs as possible, least used (most available)
  first, then round and round.

Ties go to the lower GPU index, then the lower k, so the answer is deterministic.

**What is promised, not slice IDs.** A GPU's free slice IDs are what the kubelet sees, but the
memory and compute that live allocations hold there (``held``, from the allocation records)
are what the GPU has promised. Both agree until the split changes: after ``splitCount`` 4 -> 8 a
GPU whose four old slices promised all its memory shows four new IDs free. Each GPU's *room* is
how many of the current plan's slices still fit beside what is held; slices beyond the room
are offered only when the request cannot be met within room anywhere, and a GPU's fullness
(binpack) and use (spread) are judged by its room.

**Which policy.** The ``placement`` of the GPUs the request can use (their override's, else
the base's); where those GPUs disagree, the node plan's policy (the base ``sharing``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vgpu_plugin.core.devices import MIB, GpuLimit, GpuPlan, NodePlan, Slice

POLICIES = ("binpack", "spread")


@dataclass(frozen=True)
class Held:
    """What live allocations hold of one GPU: memory in MiB and compute in percent (allocations
    that are not compute-limited hold none)."""

    memory_mib: int = 0
    compute_percent: int = 0


def held_by_gpu(limits: Iterable[GpuLimit]) -> dict[str, Held]:
    """The sum of the given limits (every GPU of every live allocation), per GPU UUID."""
    memory: dict[str, int] = {}
    compute: dict[str, int] = {}
    for limit in limits:
        memory[limit.uuid] = memory.get(limit.uuid, 0) + limit.memory_bytes // MIB
        compute[limit.uuid] = compute.get(limit.uuid, 0) + limit.promised_percent
    return {u: Held(memory[u], compute[u]) for u in memory}


def room(gpu: GpuPlan, held: Held) -> int:
    """How many of ``gpu``'s current slices fit beside what is held: the plan promises
    ``splitCount`` x the slice's memory (and compute, where limited) in all."""
    count = len(gpu.slices)
    rooms = [(count * gpu.slice_memory_mib - held.memory_mib) // gpu.slice_memory_mib]
    if gpu.slice_compute_percent:
        promised = count * gpu.slice_compute_percent
        rooms.append((promised - held.compute_percent) // gpu.slice_compute_percent)
    return max(0, min(rooms))


def policy_for(plan: NodePlan, uuids: Iterable[str]) -> str:
    """The placement of the GPUs ``uuids``: theirs where they agree, else the plan's."""
    policies = set()
    for uuid in uuids:
        gpu = plan.gpu(uuid)
        if gpu is not None:
            policies.add(gpu.sharing.placement)
    return policies.pop() if len(policies) == 1 else plan.placement


def preferred_allocation(
    plan: NodePlan,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: str | None = None,
    held: Mapping[str, Held] | None = None,
) -> list[str]:
    """``size`` distinct IDs from ``available`` and ``must_include``, every must-include among
    them (even if that makes more than ``size``: the kubelet already committed to those).
    Unknown IDs are ignored; fewer than ``size`` come back when no more are available.
    ``policy`` None: :func:`policy_for` the GPUs offered. ``held``: what live allocations hold
    per GPU UUID (none when not given)."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"placement policy must be binpack or spread, got {policy!r}")
    held = held or {}
    index = {g.gpu.uuid: g.gpu.index for g in plan.gpus}
    chosen: dict[str, Slice] = {}
    for device_id in must_include:
        found = plan.slice(device_id)
        if found is not None:
            chosen[device_id] = found
    need = size - len(chosen)
    if need > 0:
        free: dict[str, list[Slice]] = {}
        for device_id in available:
            found = plan.slice(device_id)
            if found is not None and device_id not in chosen:
                free.setdefault(found.gpu_uuid, []).append(found)
        for slices in free.values():
            # Dedupe (the kubelet should not repeat IDs, but advice must not return one twice).
            slices[:] = sorted({s.k: s for s in slices}.values(), key=lambda s: s.k)
        used: dict[str, int] = {}
        for s in chosen.values():
            used[s.gpu_uuid] = used.get(s.gpu_uuid, 0) + 1
        if policy is None:
            policy = policy_for(plan, [*free, *used])
        pick = _binpack if policy == "binpack" else _spread
        # First what fits beside what is held; beyond the room only what must be.
        fits: dict[str, list[Slice]] = {}
        beyond: dict[str, list[Slice]] = {}
        for uuid, slices in free.items():
            gpu = plan.gpu(uuid)
            assert gpu is not None
            n = max(0, room(gpu, held.get(uuid, Held())) - used.get(uuid, 0))
            fits[uuid], beyond[uuid] = slices[:n], slices[n:]
        for stage in (fits, beyond):
            offered = {u: s for u, s in stage.items() if s}
            for s in pick(offered, used, index, need):
                chosen[s.id] = s
                used[s.gpu_uuid] = used.get(s.gpu_uuid, 0) + 1
                need -= 1
            if need <= 0:
                break
    ordered = sorted(chosen.values(), key=lambda s: (index[s.gpu_uuid], s.k))
    return [s.id for s in ordered]


def _binpack(
    free: dict[str, list[Slice]], used: dict[str, int], index: dict[str, int], need: int
) -> list[Slice]:
    picked: list[Slice] = []

    def take(uuid: str, n: int) -> int:
        got = free[uuid][:n]
        picked.extend(got)
        return len(got)

    # GPUs this container already has cost nothing more: fill them, fullest first.
    for uuid in sorted((u for u in free if u in used), key=lambda u: (len(free[u]), index[u])):
        if need == 0:
            return picked
        need -= take(uuid, need)
    fresh = sorted((u for u in free if u not in used), key=lambda u: (len(free[u]), index[u]))
    for uuid in _fewest_then_fullest(fresh, {u: len(free[u]) for u in fresh}, need):
        need -= take(uuid, need)
    return picked


def _fewest_then_fullest(fresh: list[str], count: dict[str, int], need: int) -> list[str]:
    """The GPUs to take ``need`` slices from: as few as possible, and among such sets the
    fullest. ``fresh`` is sorted fullest first; with too few slices in all, all of them."""
    largest = sorted((count[u] for u in fresh), reverse=True)
    total, gpus = 0, 0
    for n in largest:
        if total >= need:
            break
        total, gpus = total + n, gpus + 1
    if total < need:
        return fresh
    chosen: list[str] = []
    remaining = list(fresh)
    for left in range(gpus - 1, -1, -1):
        if need <= 0:
            break
        # The fullest GPU that still lets the `left` largest others cover the rest.
        for uuid in remaining:
            rest = sorted((count[u] for u in remaining if u != uuid), reverse=True)[:left]
            if count[uuid] + sum(rest) >= need:
                chosen.append(uuid)
                remaining.remove(uuid)
                need -= min(count[uuid], need)
                break
    return chosen


def _spread(
    free: dict[str, list[Slice]], used: dict[str, int], index: dict[str, int], need: int
) -> list[Slice]:
    # (slices this container has there, -slices available, index): fewest taken, least used.
    heap = [(used.get(u, 0), -len(s), index[u], u) for u, s in free.items() if s]
    heapq.heapify(heap)
    taken = {u: 0 for u in free}
    picked: list[Slice] = []
    while heap and len(picked) < need:
        mine, negative_left, at, uuid = heapq.heappop(heap)
        picked.append(free[uuid][taken[uuid]])
        taken[uuid] += 1
        if negative_left + 1 < 0:
            heapq.heappush(heap, (mine + 1, negative_left + 1, at, uuid))
    return picked
