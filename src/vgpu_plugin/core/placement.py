"""GetPreferredAllocation: which of the available slices a container asking for ``size`` should get.

It is advice (the kubelet may pick others), so it never raises on an impossible request: it
returns the best it can. Policies:

- ``binpack``: as few GPUs as possible; among those, the fullest (fewest available slices), so
  emptier GPUs stay free for larger requests. GPUs the must-include slices already use are
  filled first, as they cost no extra GPU.
- ``spread``: one slice per GPU across as many GPUs as possible, least used (most available)
  first, then round and round.

Ties go to the lower GPU index, then the lower k, so the answer is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from vgpu_plugin.core.devices import NodePlan, Slice

POLICIES = ("binpack", "spread")


def preferred_allocation(
    plan: NodePlan,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: str,
) -> list[str]:
    """``size`` distinct IDs from ``available`` and ``must_include``, every must-include among
    them (even if that makes more than ``size``: the kubelet already committed to those).
    Unknown IDs are ignored; fewer than ``size`` come back when no more are available."""
    if policy not in POLICIES:
        raise ValueError(f"placement policy must be binpack or spread, got {policy!r}")
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
        pick = _binpack if policy == "binpack" else _spread
        for s in pick(free, used, index, need):
            chosen[s.id] = s
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
