"""The health state machine: which events make a GPU unhealthy, and when it recovers."""

from __future__ import annotations

from vgpu_plugin.node.gpu.health import HealthTracker, Reason


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
    t.xid("GPU-a", 61, now=100.0)
    assert t.probe_ok("GPU-a", now=105.0) is None
    t.xid("GPU-a", 61, now=106.0)  # a repeat restarts the quiet period, with no new change
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


def test_xids_that_need_a_reset_are_not_healed_by_quiet() -> None:
    for xid in (48, 63, 64, 74, 79, 94, 95):
        t = tracker()
        assert t.xid("GPU-a", xid, now=100.0) is not None
        for now in (111.0, 500.0, 10_000.0):
            assert t.probe_ok("GPU-a", now=now) is None, xid
        assert not t.healthy("GPU-a")


def test_a_reset_gpu_comes_back_after_leaving_nvml_and_the_quiet_period() -> None:
    t = tracker()
    t.xid("GPU-a", 79, now=100.0)
    assert t.probe_ok("GPU-a", now=200.0) is None
    assert t.lost("GPU-a", now=201.0) is None  # already unhealthy: no second change
    assert t.probe_ok("GPU-a", now=205.0) is None  # answering again, not quiet long enough
    change = t.probe_ok("GPU-a", now=211.5)
    assert change is not None and change.healthy


def test_nvmls_recovery_action_heals_once_it_has_asked_for_one() -> None:
    t = tracker()
    t.xid("GPU-a", 48, now=100.0)
    t.recovery_action("GPU-a", 0)  # "none" before asking for anything means nothing
    assert t.probe_ok("GPU-a", now=200.0) is None
    t.recovery_action("GPU-a", 1)  # GPU reset asked
    assert t.probe_ok("GPU-a", now=300.0) is None
    t.recovery_action("GPU-a", 0)  # done
    change = t.probe_ok("GPU-a", now=301.0)
    assert change is not None and change.healthy


def test_a_reset_does_not_shortcut_the_next_fault() -> None:
    t = tracker()
    t.xid("GPU-a", 79, now=100.0)
    t.lost("GPU-a", now=101.0)
    assert t.probe_ok("GPU-a", now=120.0) is not None
    t.xid("GPU-a", 95, now=130.0)
    assert t.probe_ok("GPU-a", now=1000.0) is None
