"""Idle GPU time lent, per GPU (sharing.compute: guaranteed, docs/compute.md).

**Definition.** Between two observations ``dt`` seconds apart, a container with a guarantee
of ``g`` % on a GPU that used ``u`` seconds of it there (its region's GPU time) was lent
``max(0, u - g/100 * dt)``: the GPU time it had beyond its guarantee, which only time that
others' guarantees left unclaimed (idle guarantees, unallocated slices) can have paid for.
A GPU's lent seconds are the sum over its guaranteed containers and over the intervals
between the plugin's observations (each metrics build: at most one a second, at least one
a scrape). A container that alternates idle and busy within one interval is credited its
average only, so the figure is a lower bound of what was lent, exact for containers busy
throughout. Time taken by containers without a guarantee (``none``, caps) is not counted.

The GPU time comes from regions, which their tenants can write: ``u`` is taken as at most
``dt`` (one GPU's time) and a counter that went back (a region made again) starts over, so
a forged region can add at most its own wall time to its GPU's figure (reported, not trusted).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LendingSample:
    allocation_id: str
    gpu_uuid: str
    guarantee: int  # percent
    gpu_ns: int  # the container's GPU time on that GPU, cumulative (its region)


class LendingMeter:
    """Accumulates each GPU's lent seconds from successive observations (a scrape's build
    and a filtered scrape, served by prometheus_client's own app, may observe at once)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lent: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, now: float, samples: Iterable[LendingSample]) -> dict[str, float]:
        """Takes the samples seen at ``now`` (seconds, a monotonic clock) and returns each
        GPU's lent seconds so far (GPUs with guarantees seen at least once)."""
        samples = list(samples)  # read the regions before taking the lock
        with self._lock:
            return self._observe(now, samples)

    def _observe(self, now: float, samples: list[LendingSample]) -> dict[str, float]:
        seen: dict[tuple[str, str], tuple[float, int]] = {}
        for s in samples:
            key = (s.allocation_id, s.gpu_uuid)
            if key in seen or not 0 < s.guarantee <= 100:
                continue
            self._lent.setdefault(s.gpu_uuid, 0.0)
            prev = self._last.get(key)
            if prev is not None and now <= prev[0]:  # an older observation, late: counted
                seen[key] = prev
                continue
            seen[key] = (now, max(s.gpu_ns, 0))
            if prev is None or s.gpu_ns < prev[1]:
                continue
            dt = now - prev[0]
            used = min((s.gpu_ns - prev[1]) / 1e9, dt)
            self._lent[s.gpu_uuid] += max(0.0, used - s.guarantee / 100 * dt)
        self._last = seen
        return dict(self._lent)
