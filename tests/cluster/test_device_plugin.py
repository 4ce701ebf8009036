"""The device plugin on a real cluster: registration, capacity, slices' limits inside the
containers, and the scheduler's refusal past the capacity."""

from __future__ import annotations

from .cluster import Cluster
from .conftest import SPLIT, Helm
from .kube import Kube, pod, wait_for

SLICE_MIB = 16 * 1024 // SPLIT
PROBE_THEN_SLEEP = 'python3 -c "$PROBE"; exec sleep 3600'


def test_registered_with_its_capacity(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    node = kube.node()
    assert node.status.capacity["nvidia.com/gpu"] == str(SPLIT)
    assert node.status.allocatable["nvidia.com/gpu"] == str(SPLIT)
    sockets = [p.name for p in cluster.node_path("/var/lib/kubelet/device-plugins").iterdir()]
    assert any(s.startswith("vgpu-") for s in sockets), sockets


def test_one_slice_holds_its_limit(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    kube.create_pod(pod("slice-1", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"}))
    try:
        result = wait_for("the 1-slice pod's CUDA start", lambda: kube.finished("slice-1"), 120)
        assert result["total_mib"] == SLICE_MIB, result
        assert result["over_limit_rc"] == 2, result  # CUDA_ERROR_OUT_OF_MEMORY
    finally:
        kube.delete_pods("slice-1")


def test_slices_add_up_and_the_next_one_is_pending(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    try:
        kube.create_pod(pod("slices-2", PROBE_THEN_SLEEP, limits={"nvidia.com/gpu": "2"}))
        kube.create_pod(pod("slices-1", PROBE_THEN_SLEEP, limits={"nvidia.com/gpu": "1"}))
        two = wait_for("the 2-slice pod's probe", lambda: kube.probed("slices-2"), 120)
        one = wait_for("the 1-slice pod's probe", lambda: kube.probed("slices-1"), 120)
        assert two["total_mib"] == 2 * SLICE_MIB, two
        assert one["total_mib"] == SLICE_MIB, one
        kube.create_pod(pod("slices-last", PROBE_THEN_SLEEP, limits={"nvidia.com/gpu": "1"}))
        wait_for("the last slice's pod running", lambda: kube.probed("slices-last"), 120)
        kube.create_pod(pod("slices-over", "exec sleep 3600", limits={"nvidia.com/gpu": "1"}))
        reason = wait_for(
            "the pod past the capacity unschedulable", lambda: kube.unschedulable("slices-over"), 60
        )
        assert "Insufficient nvidia.com/gpu" in reason, reason
    finally:
        kube.delete_pods("slices-2", "slices-1", "slices-last", "slices-over")


def test_non_root_pod_holds_its_limit(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    body = pod("non-root", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"})
    body["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000}
    kube.create_pod(body)
    try:
        result = wait_for("the non-root pod's CUDA start", lambda: kube.finished("non-root"), 120)
        assert result["total_mib"] == SLICE_MIB, result
        assert result["over_limit_rc"] == 2, result
    finally:
        kube.delete_pods("non-root")
