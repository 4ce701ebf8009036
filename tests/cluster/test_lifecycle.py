"""Lifecycle on a real cluster: what a deleted pod leaves, a kubelet restart, the plugin's pod
replaced, a rolling upgrade to a new shim build, and the chart uninstalled (last: it removes
the plugin; the `plugin` fixture installs it again for any test after it)."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

from vgpu_plugin.node.host.install import content_version

from .cluster import Cluster
from .conftest import (
    CDI_DIR,
    GRACE,
    HOST_ROOT,
    PLUGIN_NS,
    SPLIT,
    Helm,
    allocation_files,
    plugin_pods,
    ready_plugin_pods,
    upgrade,
    wait_plugin_ready,
)
from .images import NEXT_IMAGE, NEXT_TAG, PLUGIN_IMAGE, Images
from .kube import Kube, claim, pod, wait_for

SLICE_MIB = 16 * 1024 // SPLIT
PROBE_AND_HOLD = 'exec python3 -c "$PROBE" hold'  # a live CUDA process while the pod runs


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
    kube.create_claim(claim("before-restart", "2Gi", "10"))
    kube.create_pod(
        pod(
            "before-restart-dra",
            PROBE_AND_HOLD,
            claims=[{"name": "gpu", "resourceClaimName": "before-restart"}],
        )
    )
    try:
        wait_for("a pod before the restart", lambda: kube.probed("before-restart"), 120)
        wait_for("a claim pod before the restart", lambda: kube.probed("before-restart-dra"), 120)
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
        # The claim prepared before the restart still holds: a new CUDA process in its pod.
        assert kube.probe_in("before-restart-dra")["total_mib"] == 2 * 1024
        assert kube.probe_in("before-restart")["total_mib"] == SLICE_MIB
    finally:
        kube.delete_pods("before-restart", "before-restart-dra", "after-restart",
                         "after-restart-dra")  # fmt: skip
        kube.delete_claims("before-restart", "after-restart")


def test_plugin_pod_replaced(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """The DaemonSet's new pod serves again, and a running workload keeps its allocation."""
    before = allocation_files(cluster)
    kube.create_pod(pod("survivor", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    kube.create_claim(claim("survivor", "2Gi", "10"))
    kube.create_pod(
        pod("survivor-dra", PROBE_AND_HOLD,
            claims=[{"name": "gpu", "resourceClaimName": "survivor"}])
    )  # fmt: skip
    try:
        wait_for("the workload's probe", lambda: kube.probed("survivor"), 120)
        wait_for("the claim workload's probe", lambda: kube.probed("survivor-dra"), 120)
        held = {f for f in allocation_files(cluster) - before if "/limits/" in f or CDI_DIR in f}
        assert any("/limits/dra-" in f for f in held) and any(CDI_DIR in f for f in held), held
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
        time.sleep(3 * GRACE)  # the new plugin's cleanup passes, well past the grace
        assert kube.running("survivor") and kube.running("survivor-dra")
        assert held <= allocation_files(cluster), "a running pod's limits or CDI spec was removed"
        # New CUDA processes in the running pods still get their limits.
        assert kube.probe_in("survivor")["total_mib"] == SLICE_MIB
        assert kube.probe_in("survivor-dra")["total_mib"] == 2 * 1024
    finally:
        kube.delete_pods("survivor", "survivor-dra", "newcomer")
        kube.delete_claims("survivor")


def test_split_hot_reload(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """A changed split (helm upgrade: the ConfigMap only) reaches the node without a restart of
    the plugin: the new capacity and slice size; a running pod keeps its old slice's limit."""
    kube.create_pod(pod("reload-held", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    try:
        wait_for("the running pod's probe", lambda: kube.probed("reload-held"), 120)
        (old,) = plugin_pods(kube)
        upgrade(plugin, "config.sharing.splitCount=2")
        wait_for("2 nvidia.com/gpu allocatable", lambda: kube.allocatable("nvidia.com/gpu") == "2",
                 180)  # fmt: skip
        (now,) = plugin_pods(kube)
        assert now.metadata.uid == old.metadata.uid  # type: ignore[attr-defined]
        assert [s.restart_count for s in now.status.container_statuses] == [0]  # type: ignore[attr-defined]
        kube.create_pod(pod("reload-new", 'exec python3 -c "$PROBE"',
                            limits={"nvidia.com/gpu": "1"}))  # fmt: skip
        result = wait_for("a pod of the new split", lambda: kube.finished("reload-new"), 120)
        assert result["total_mib"] == 16 * 1024 // 2, result
        assert kube.probe_in("reload-held")["total_mib"] == SLICE_MIB
    finally:
        kube.delete_pods("reload-held", "reload-new")
        plugin.install()  # the tier's values: the split back to SPLIT
        wait_for(f"{SPLIT} nvidia.com/gpu allocatable again",
                 lambda: kube.allocatable("nvidia.com/gpu") == str(SPLIT), 180)  # fmt: skip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _plugin_shim_build_id(kube: Kube, name: str) -> str:
    """The shim build id a plugin pod hands out (``vgpu-plugin --version``, which
    vgpu_build_info's shim_build_id also reports)."""
    out = kube.exec(name, ["vgpu-plugin", "--version"], container="vgpu-plugin",
                    namespace=PLUGIN_NS)  # fmt: skip
    return out.strip().rpartition("(shim ")[2].rstrip(")")


def _alone_and_ready(kube: Kube, gone: set[str], image: str) -> object | None:
    """The plugin pod once it is the only one, runs ``image``, is ready and none of ``gone``."""
    pods = plugin_pods(kube)
    if len(pods) != 1 or pods[0].metadata.uid in gone:  # type: ignore[attr-defined]
        return None
    (p,) = pods
    images = {c.image for c in p.spec.containers}  # type: ignore[attr-defined]
    return p if images == {image} and ready_plugin_pods(kube) else None


def test_rolling_upgrade_keeps_running_pods_limits(
    cluster: Cluster, kube: Kube, plugin: Helm, images: Images
) -> None:
    """helm upgrade to an image with a new shim build, the new plugin pod before the old one
    stops (surge). Running workloads keep their limits and the old shim's very file (the inode
    their processes map, unchanged content: install-shim puts the new build beside it); pods
    started after get the new build; both front ends serve from the new pod after the old one
    stopped (its stop does not take the new pod's sockets). Then back to the tier's image."""
    t0 = time.monotonic()
    old_id, new_id = (content_version(s.read_bytes()) for s in (images.shim, images.next_shim))
    old_sha, new_sha = _sha256(images.shim), _sha256(images.next_shim)
    assert old_id != new_id, "the next image's shim is the same build"
    kube.create_pod(pod("roll-slice", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"}))
    kube.create_claim(claim("roll", "2Gi", "10"))
    kube.create_pod(pod("roll-dra", PROBE_AND_HOLD,
                        claims=[{"name": "gpu", "resourceClaimName": "roll"}]))  # fmt: skip
    try:
        held = {
            "roll-slice": wait_for(
                "the slice workload's probe", lambda: kube.probed("roll-slice"), 120
            ),
            "roll-dra": wait_for(
                "the claim workload's probe", lambda: kube.probed("roll-dra"), 120
            ),
        }
        for name, result in held.items():
            assert result["shim"]["sha256"] == old_sha, (name, result, old_id)
        (old,) = plugin_pods(kube)
        assert _plugin_shim_build_id(kube, old.metadata.name) == old_id  # type: ignore[attr-defined]
        upgrade(
            plugin,
            f"image.tag={NEXT_TAG}",
            "updateStrategy.rollingUpdate.maxSurge=1",
            "updateStrategy.rollingUpdate.maxUnavailable=0",
        )
        new = wait_for(
            "the new plugin pod alone and ready",
            lambda: _alone_and_ready(kube, {old.metadata.uid}, NEXT_IMAGE),  # type: ignore[attr-defined]
            180,
        )
        wait_for(f"{SPLIT} nvidia.com/gpu allocatable",
                 lambda: kube.allocatable("nvidia.com/gpu") == str(SPLIT), 120)  # fmt: skip
        wait_for("the driver's ResourceSlice", kube.resource_slices, 120)
        assert _plugin_shim_build_id(kube, new.metadata.name) == new_id  # type: ignore[attr-defined]
        # The new build landed beside the old one, which is the very file the running
        # processes map (same inode), its content unchanged.
        lib = cluster.node_path(f"{HOST_ROOT}/lib")
        old_file, new_file = lib / f"libvgpu.so.{old_id}", lib / f"libvgpu.so.{new_id}"
        assert _sha256(new_file) == new_sha
        assert _sha256(old_file) == old_sha
        for name, result in held.items():
            assert result["shim"]["inode"] == old_file.stat().st_ino, (name, result)
            # A new CUDA process in a running pod: its limits, and still the old shim.
            again = kube.probe_in(name)
            assert again["total_mib"] == result["total_mib"], (name, again)
            assert again["shim"] == result["shim"], (name, again)
        assert held["roll-slice"]["total_mib"] == SLICE_MIB
        assert held["roll-dra"]["total_mib"] == 2 * 1024
        kube.create_claim(claim("roll-after", "3Gi", "10"))
        after = [{"name": "gpu", "resourceClaimName": "roll-after"}]
        kube.create_pod(pod("roll-after-dra", 'exec python3 -c "$PROBE"', claims=after))
        kube.create_pod(pod("roll-after", 'exec python3 -c "$PROBE"',
                            limits={"nvidia.com/gpu": "1"}))  # fmt: skip
        dra = wait_for("a claim prepared by the new pod", lambda: kube.finished("roll-after-dra"))
        one = wait_for("a slice from the new pod", lambda: kube.finished("roll-after"))
        assert dra["total_mib"] == 3 * 1024, dra
        assert one["total_mib"] == SLICE_MIB, one
        for result in (dra, one):
            assert result["shim"]["sha256"] == new_sha, (result, new_id)
            assert result["shim"]["inode"] == new_file.stat().st_ino, result
    finally:
        kube.delete_pods("roll-slice", "roll-dra", "roll-after", "roll-after-dra")
        kube.delete_claims("roll", "roll-after")
        # Back to the tier's image and values for the tests after this one.
        other = {
            p.metadata.uid  # type: ignore[attr-defined]
            for p in plugin_pods(kube)
            if {c.image for c in p.spec.containers} != {PLUGIN_IMAGE}  # type: ignore[attr-defined]
        }
        plugin.install()
        if other:
            wait_for(
                "the tier's plugin image back, alone and ready",
                lambda: _alone_and_ready(kube, other, PLUGIN_IMAGE),
                180,
            )
        wait_plugin_ready(kube, cluster)
        sys.stderr.write(
            f"\n[cluster tier] rolling upgrade scenario {time.monotonic() - t0:.1f}s\n"
        )


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
