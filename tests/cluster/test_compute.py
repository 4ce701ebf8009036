"""Guaranteed compute on a real kubelet and containerd: with the chart's ``hostPID`` the
plugin sees the node's pids, attributes a pod's kernels to its allocation by the pod's limits
mount, and publishes the pod's GPU-time record where the pod reads it only through the
read-only peers mount (node/observe/gputime.py, docs/security.md#compute-guarantees)."""

from __future__ import annotations

from typing import Any

from vgpu_plugin.node.observe.gputime import SUFFIX, GpuShare, decode_record

from .cluster import Cluster
from .conftest import (
    HOST_ROOT,
    PLUGIN_NS,
    Helm,
    plugin_pods,
    ready_plugin_pods,
    upgrade,
    wait_plugin_ready,
)
from .kube import Kube, pod, wait_for

# Kernels back to back on its slice (the workload of the demo's batch pods).
BUSY = "exec python3 -m vgpu_plugin.sim.workload compute --seconds 600 --kernel-ms 4"


def records(cluster: Cluster) -> dict[str, list[GpuShare]]:
    """The GPU-time records on the node, by allocation id."""
    found: dict[str, list[GpuShare]] = {}
    d = cluster.node_path(f"{HOST_ROOT}/containers")
    for p in sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []:
        try:
            found[p.name[: -len(SUFFIX)]] = decode_record(p.read_bytes())
        except (OSError, ValueError):
            continue  # replaced while read: the next look has it whole
    return found


def test_a_guaranteed_pods_gpu_time_is_measured_by_the_nodes_pids(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    (old,) = plugin_pods(kube)
    upgrade(plugin, "hostPID=true", "config.sharing.compute=guaranteed")
    try:

        def moved() -> list[Any]:
            return [
                p
                for p in ready_plugin_pods(kube)
                if p.spec.host_pid and p.metadata.uid != old.metadata.uid  # type: ignore[attr-defined]
            ]

        wait_for("the plugin pod in the node's pid namespace, ready", moved, 180)
        wait_plugin_ready(kube, cluster)
        kube.create_pod(pod("busy", BUSY, limits={"nvidia.com/gpu": "1"}))
        wait_for("the busy pod running", lambda: kube.running("busy"), 120)
        slices_gpu = cluster.gpus[1].lower()  # values.yaml: DRA on GPU 0, slices on GPU 1

        def measured() -> tuple[str, GpuShare] | None:
            for aid, shares in records(cluster).items():
                for s in shares:
                    if s.uuid.lower() == slices_gpu and s.share > 0:
                        return aid, s
            return None

        try:
            aid, share = wait_for("the busy pod's GPU time published", measured, 90)
        except AssertionError as exc:  # what the plugin said, and what it wrote
            (now,) = moved()
            log = kube.core.read_namespaced_pod_log(now.metadata.name, PLUGIN_NS)
            raise AssertionError(f"{exc}\n{records(cluster)}\n{log[-3000:]}") from exc
        assert share.start_ns < share.end_ns, share
        # The record names the pod's own allocation: its limits file is the one mounted.
        assert cluster.node_path(f"{HOST_ROOT}/limits/{aid}").exists(), aid
    finally:
        kube.delete_pods("busy")
        plugin.install()  # the tier's values: no hostPID, compute as before

        def back() -> list[Any]:  # the rollout done: the next test meets a plugin that stays
            return [p for p in ready_plugin_pods(kube) if not p.spec.host_pid]  # type: ignore[attr-defined]

        wait_for("the plugin pod out of the node's pid namespace, ready", back, 180)
        wait_for("one plugin pod", lambda: len(plugin_pods(kube)) == 1, 120)
        wait_plugin_ready(kube, cluster)
