"""Lifecycle on a real cluster: what a deleted pod leaves, a kubelet restart, the plugin's pod
replaced, and the chart uninstalled (last: it removes the plugin; the `plugin` fixture
installs it again for any test after it)."""

from __future__ import annotations

from pathlib import Path

from .cluster import Cluster
from .conftest import PLUGIN_NS, SPLIT, Helm, plugin_pods
from .kube import Kube, claim, pod, wait_for

HOST_ROOT = "/var/lib/vgpu"  # values.yaml hostRoot
CDI_DIR = "/var/run/cdi"  # values.yaml cdiSpecDir
SLICE_MIB = 16 * 1024 // SPLIT
PROBE_AND_HOLD = 'exec python3 -c "$PROBE" hold'  # a live CUDA process while the pod runs


def allocation_files(cluster: Cluster) -> set[str]:
    """The per-allocation files on the node: limits, container dirs, CDI specs."""
    found: set[str] = set()
    for d in (f"{HOST_ROOT}/limits", f"{HOST_ROOT}/containers", CDI_DIR):
        path: Path = cluster.node_path(d)
        if path.is_dir():
            found.update(f"{d}/{p.name}" for p in path.iterdir())
    return found


def test_deleted_pods_leave_no_allocation_files(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    before = allocation_files(cluster)
    kube.create_pod(pod("gone-slice", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    kube.create_claim(claim("gone-claim", "2Gi", "10"))
    kube.create_pod(
        pod(
            "gone-claim",
            PROBE_AND_HOLD,
            claims=[{"name": "gpu", "resourceClaimName": "gone-claim"}],
        )
    )
    try:
        wait_for("the slice pod's probe", lambda: kube.probed("gone-slice"), 120)
        wait_for("the claim pod's probe", lambda: kube.probed("gone-claim"), 120)
        made = allocation_files(cluster) - before
        assert any("/limits/0" in f for f in made), made  # the slice's
        assert any("/limits/dra-" in f for f in made), made  # the claim's
        assert any(f.startswith(CDI_DIR) for f in made), (
            f"the running claim's CDI spec is gone: {made}"
        )
    finally:
        kube.delete_pods("gone-slice", "gone-claim")
        kube.delete_claims("gone-claim")
    wait_for("the allocations' files removed", lambda: not (allocation_files(cluster) & made), 120)


def test_kubelet_restart(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """After a kubelet restart the plugin registers again: new pods of both front ends get
    their GPUs with their limits."""
    kube.create_pod(pod("before-restart", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    try:
        wait_for("a pod before the restart", lambda: kube.probed("before-restart"), 120)
        cluster.control("restart kubelet")
        kube.create_pod(
            pod("after-restart", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"})
        )
        kube.create_claim(claim("after-restart", "3Gi", "10"))
        kube.create_pod(
            pod(
                "after-restart-dra",
                'exec python3 -c "$PROBE"',
                claims=[{"name": "gpu", "resourceClaimName": "after-restart"}],
            )
        )
        one = wait_for("a slice pod after the restart", lambda: kube.finished("after-restart"), 180)
        dra = wait_for(
            "a claim pod after the restart", lambda: kube.finished("after-restart-dra"), 180
        )
        assert one["total_mib"] == SLICE_MIB, one
        assert dra["total_mib"] == 3 * 1024, dra
        assert kube.running("before-restart")
    finally:
        kube.delete_pods("before-restart", "after-restart", "after-restart-dra")
        kube.delete_claims("after-restart")


def test_plugin_pod_replaced(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """The DaemonSet's new pod serves again, and a running workload keeps its allocation."""
    before = allocation_files(cluster)
    kube.create_pod(pod("survivor", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    try:
        wait_for("the workload's probe", lambda: kube.probed("survivor"), 120)
        held = {f for f in allocation_files(cluster) - before if "/limits/" in f}
        assert held
        (old,) = plugin_pods(kube)
        kube.core.delete_namespaced_pod(old.metadata.name, PLUGIN_NS)  # type: ignore[attr-defined]
        wait_for(
            "a new plugin pod ready",
            lambda: [
                p
                for p in plugin_pods(kube)
                if p.metadata.name != old.metadata.name  # type: ignore[attr-defined]
                and any(s.ready for s in p.status.container_statuses or [])  # type: ignore[attr-defined]
            ],
            180,
        )
        kube.create_pod(pod("newcomer", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"}))
        result = wait_for("a pod served by the new plugin", lambda: kube.finished("newcomer"), 180)
        assert result["total_mib"] == SLICE_MIB, result
        assert kube.running("survivor")
        assert held <= allocation_files(cluster), "the running pod's limits file was removed"
    finally:
        kube.delete_pods("survivor", "newcomer")


def test_uninstall_leaves_no_gpus_behind(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    plugin.uninstall()
    wait_for("no plugin pods", lambda: not plugin_pods(kube), 120)
    wait_for("no ResourceSlice", lambda: not kube.resource_slices(), 120)
    wait_for(
        "no allocatable nvidia.com/gpu",
        lambda: kube.allocatable("nvidia.com/gpu") in (None, "0"),
        120,
    )
    capacity = kube.node().status.capacity.get("nvidia.com/gpu")
    assert capacity in (None, "0"), f"nvidia.com/gpu capacity {capacity} left on the node"
