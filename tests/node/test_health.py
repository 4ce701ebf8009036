"""The health state machine: which events make a GPU unhealthy, and when it recovers."""

from __future__ import annotations

from vgpu_plugin.node.health import HealthTracker, Reason


def tracker() -> HealthTracker:
    return HealthTracker(["GPU-a", "GPU-b"], recovery_seconds=10.0)


def test_critical_xid_marks_only_that_gpu() -> None:
    t = tracker()
    change = t.xid("GPU-a", 79, now=100.0)
    assert change is not None and not change.healthy and change.reason is Reason.XID
    assert "79" in change.detail
    assert not t.healthy("GPU-a") and t.healthy("GPU-b")
    assert t.unhealthy() == {"GPU-a": "XID 79"}


def test_application_xids_are_ignored() -> None:
    t = tracker()
    for xid in (13, 31, 43, 45, 68, 109):
        assert t.xid("GPU-a", xid, now=1.0) is None
    assert t.healthy("GPU-a")


def test_ignored_list_is_configurable() -> None:
    t = HealthTracker(["GPU-a"], ignored_xids=frozenset({79}))
    assert t.xid("GPU-a", 79, now=1.0) is None
    assert t.xid("GPU-a", 13, now=1.0) is not None


def test_recovers_only_after_a_quiet_period() -> None:
    t = tracker()
    t.xid("GPU-a", 48, now=100.0)
    assert t.probe_ok("GPU-a", now=105.0) is None
    t.xid("GPU-a", 48, now=106.0)  # a repeat restarts the quiet period, with no new change
    assert t.probe_ok("GPU-a", now=112.0) is None
    change = t.probe_ok("GPU-a", now=116.0)
    assert change is not None and change.healthy and change.reason is Reason.RECOVERED
    assert t.healthy("GPU-a")


def test_lost_gpu_reported_once_until_it_recovers() -> None:
    t = tracker()
    first = t.lost("GPU-b", now=5.0)
    assert first is not None and first.reason is Reason.LOST
    assert t.lost("GPU-b", now=6.0) is None
    assert t.probe_ok("GPU-b", now=16.5) is not None


def test_unknown_gpu_is_ignored() -> None:
    t = tracker()
    assert t.xid("GPU-z", 79, now=1.0) is None
    assert t.healthy("GPU-z")
