"""GPU health as a pure state machine: events and probes in, Healthy/Unhealthy changes out.

A critical XID (one not in the ignored list) or a lost GPU makes every slice of that GPU
unhealthy. A GPU comes back once it has been quiet (no bad event, and its probes answer) for
the recovery period; competing plugins never recover devices, which strands capacity forever.

Some XIDs leave the GPU needing a reset (``RESET_XIDS``: double-bit ECC, row remapping,
NVLink, fallen off the bus, uncontained errors, GSP errors). Quiet does not heal those: such
a GPU comes back only when NVML's recovery action, having asked for one, reads "none" again,
or when the GPU has left NVML (a reset or re-enumeration) and answers again; then the quiet
period applies as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)
# XIDs after which the GPU is not usable until it is reset (NVIDIA's XID catalogue: the
# action is a GPU reset or a node reboot).
RESET_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 136, 140, 143, 155})
# nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): NVML_GPU_RECOVERY_ACTION_NONE.
RECOVERY_ACTION_NONE = 0


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
    # A reset XID was seen and no reset since: quiet alone does not heal it.
    needs_reset: bool = False
    # NVML's recovery action asked for something since the fault.
    action_asked: bool = False


@dataclass
class HealthTracker:
    """Health of each GPU by UUID. Time is passed in, so tests drive it without sleeping."""

    uuids: Iterable[str]
    ignored_xids: frozenset[int] = frozenset(DEFAULT_IGNORED_XIDS)
    recovery_seconds: float = 60.0
    reset_xids: frozenset[int] = RESET_XIDS
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
        if xid in self.reset_xids:
            self._gpus[uuid].needs_reset = True
        return self._bad(uuid, now, Reason.XID, f"XID {xid}")

    def lost(self, uuid: str, now: float) -> HealthChange | None:
        """The GPU does not answer NVML. After a reset XID, its coming back later is the
        reset (or re-enumeration) that heals it."""
        gpu = self._gpus.get(uuid)
        if gpu is None:
            return None
        gpu.needs_reset = False
        return self._bad(uuid, now, Reason.LOST, "GPU is lost")

    def recovery_action(self, uuid: str, action: int) -> None:
        """NVML's recovery action for the GPU, where the driver reports one: once it has asked
        for an action since the fault, reading none again means the driver has recovered it."""
        gpu = self._gpus.get(uuid)
        if gpu is None or not gpu.needs_reset:
            return
        if action != RECOVERY_ACTION_NONE:
            gpu.action_asked = True
        elif gpu.action_asked:
            gpu.needs_reset = gpu.action_asked = False

    def probe_ok(self, uuid: str, now: float) -> HealthChange | None:
        """The GPU answered NVML; back to healthy once quiet for the recovery period."""
        gpu = self._gpus.get(uuid)
        if gpu is None or gpu.healthy or gpu.needs_reset:
            return None
        if now - gpu.last_bad < self.recovery_seconds:
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
