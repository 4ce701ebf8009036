"""GPU health as a pure state machine: events and probes in, Healthy/Unhealthy changes out.

A critical XID (one not in the ignored list) or a lost GPU makes every slice of that GPU
unhealthy. A GPU comes back once it has been quiet (no bad event, and its probes answer) for
the recovery period; competing plugins never recover devices, which strands capacity forever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


class Reason(str, Enum):
    XID = "xid"
    LOST = "lost"
    RECOVERED = "recovered"


@dataclass(frozen=True)
class HealthChange:
    uuid: str
    healthy: bool
    reason: Reason
    detail: str


@dataclass
class _GpuHealth:
    healthy: bool = True
    last_bad: float = 0.0
    detail: str = ""


@dataclass
class HealthTracker:
    """Health of each GPU by UUID. Time is passed in, so tests drive it without sleeping."""

    uuids: Iterable[str]
    ignored_xids: frozenset[int] = frozenset(DEFAULT_IGNORED_XIDS)
    recovery_seconds: float = 60.0
    _gpus: dict[str, _GpuHealth] = field(init=False)

    def __post_init__(self) -> None:
        self._gpus = {u: _GpuHealth() for u in self.uuids}

    def healthy(self, uuid: str) -> bool:
        gpu = self._gpus.get(uuid)
        return gpu is None or gpu.healthy

    def unhealthy(self) -> dict[str, str]:
        """UUID → why, for every GPU now unhealthy."""
        return {u: g.detail for u, g in self._gpus.items() if not g.healthy}

    def xid(self, uuid: str, xid: int, now: float) -> HealthChange | None:
        if xid in self.ignored_xids or uuid not in self._gpus:
            return None
        return self._bad(uuid, now, Reason.XID, f"XID {xid}")

    def lost(self, uuid: str, now: float) -> HealthChange | None:
        if uuid not in self._gpus:
            return None
        return self._bad(uuid, now, Reason.LOST, "GPU is lost")

    def probe_ok(self, uuid: str, now: float) -> HealthChange | None:
        """The GPU answered NVML; back to healthy once quiet for the recovery period."""
        gpu = self._gpus.get(uuid)
        if gpu is None or gpu.healthy or now - gpu.last_bad < self.recovery_seconds:
            return None
        gpu.healthy = True
        detail, gpu.detail = gpu.detail, ""
        return HealthChange(
            uuid, True, Reason.RECOVERED, f"quiet for {self.recovery_seconds:g}s after {detail}"
        )

    def _bad(self, uuid: str, now: float, reason: Reason, detail: str) -> HealthChange | None:
        gpu = self._gpus[uuid]
        gpu.last_bad = now  # every bad event restarts the quiet period
        if not gpu.healthy:
            return None
        gpu.healthy = False
        gpu.detail = detail
        return HealthChange(uuid, False, reason, detail)
