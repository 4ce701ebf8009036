"""DRA on a real cluster: the driver's ResourceSlice, claims placed by the stock scheduler, and
prepared claims that outlive the plugin's cleanup grace (issue 20)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import native_build

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
)
from .kube import RESOURCE_GROUP, RESOURCE_VERSION, Kube, claim, pod, wait_for

# The processes in a container whose arguments include "serve" (this one's own do not).
COUNT_SERVE = """
import os
n = 0
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        n += "serve" in open(f"/proc/{pid}/cmdline", "rb").read().decode().split(chr(0))
    except OSError:
        pass
print(n)
"""
PAST_GRACE = 5 * GRACE  # several sweeps (every grace/4) after the grace ran out


def test_slice_published_and_claims_packed_exactly(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    slices = kube.resource_slices()
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    assert len(devices) == 1, slices  # GPU 0 only: GPU 1 is the device plugin's
    assert devices[0]["capacity"]["memory"]["value"] == "16Gi", devices[0]
    # The API server took the ownerReference: the slice goes with its node.
    node = kube.node().metadata
    assert [s["metadata"].get("ownerReferences") for s in slices] == [
        [{"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}]
    ], slices
    shapes = {"a": ("6Gi", "30"), "b": ("6Gi", "30"), "c": ("4Gi", "40"), "d": ("1Gi", "1")}
    try:
        for name, (memory, compute) in shapes.items():
            kube.create_claim(claim(f"pack-{name}", memory, compute))
            kube.create_pod(
                pod(
                    f"pack-{name}",
                    "sleep 3600",
                    claims=[{"name": "gpu", "resourceClaimName": f"pack-{name}"}],
                )
            )
            if name == "d":
                break
            wait_for(f"pod pack-{name} running", lambda n=name: kube.running(f"pack-{n}"), 120)
        reason = wait_for("pack-d unschedulable", lambda: kube.unschedulable("pack-d"), 60)
        assert "cannot allocate all claims" in reason or "claim" in reason, reason
        assert not kube.pod("pack-d").spec.node_name
    finally:
        kube.delete_pods(*(f"pack-{n}" for n in shapes))
        kube.delete_claims(*(f"pack-{n}" for n in shapes))


def test_claim_limits_hold_in_the_container(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """A CUDA start right after prepare sees its claim's memory as the GPU's and is refused
    past it."""
    kube.create_claim(claim("fresh", "6Gi", "30"))
    kube.create_pod(
        pod(
            "fresh",
            'exec python3 -c "$PROBE"',
            claims=[{"name": "gpu", "resourceClaimName": "fresh"}],
        )
    )
    try:
        result = wait_for("the pod's CUDA start", lambda: kube.finished("fresh"), 120)
        assert result["total_mib"] == 6 * 1024, result
        assert result["over_limit_rc"] == 2, result  # CUDA_ERROR_OUT_OF_MEMORY
    finally:
        kube.delete_pods("fresh")
        kube.delete_claims("fresh")


def test_cuda_start_after_the_cleanup_grace(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """An idle pod whose claim was prepared more than the grace ago still starts CUDA, inside
    its claim's limit."""
    kube.create_claim(claim("idle", "6Gi", "30"))
    kube.create_pod(
        pod(
            "idle",
            f'sleep {PAST_GRACE}; exec python3 -c "$PROBE"',
            claims=[{"name": "gpu", "resourceClaimName": "idle"}],
        )
    )
    try:
        result = wait_for("the idle pod's CUDA start", lambda: kube.finished("idle"), 180)
        assert result["total_mib"] == 6 * 1024, result
        assert result["over_limit_rc"] == 2, result  # CUDA_ERROR_OUT_OF_MEMORY
    finally:
        kube.delete_pods("idle")
        kube.delete_claims("idle")


def test_container_restarting_after_the_grace_starts_again(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    """A container that exits past the grace is restarted by the kubelet: its CDI devices must
    still resolve and its limits still hold."""
    kube.create_claim(claim("restart", "4Gi", "20"))
    first_run = f"touch /scratch/ran; sleep {PAST_GRACE}; exit 1"
    command = f'if [ -e /scratch/ran ]; then exec python3 -c "$PROBE"; else {first_run}; fi'
    kube.create_pod(
        pod(
            "restart",
            command,
            restart="OnFailure",
            volumes=True,
            claims=[{"name": "gpu", "resourceClaimName": "restart"}],
        )
    )
    t0 = time.monotonic()
    try:
        result = wait_for(
            "the restarted container's CUDA start", lambda: kube.finished("restart"), 240
        )
        assert time.monotonic() - t0 > PAST_GRACE
        assert kube.pod("restart").status.container_statuses[0].restart_count >= 1
        assert result["total_mib"] == 4 * 1024, result
    finally:
        kube.delete_pods("restart")
        kube.delete_claims("restart")


def test_two_containers_share_one_claim(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    body = pod("pair", 'exec python3 -c "$PROBE" hold',
               claims=[{"name": "gpu", "resourceClaimName": "pair"}])  # fmt: skip
    main = body["spec"]["containers"][0]
    body["spec"]["containers"].append({**main, "name": "sidecar"})
    kube.create_claim(claim("pair", "6Gi", "30"))
    kube.create_pod(body)
    try:
        for container in ("main", "sidecar"):
            result = wait_for(f"{container}'s probe", lambda c=container: kube.probed("pair", c))
            assert result["total_mib"] == 6 * 1024, (container, result)
    finally:
        kube.delete_pods("pair")
        kube.delete_claims("pair")


def test_plugin_token_refused_for_another_nodes_slice(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    """The plugin's own credentials (a token bound to its pod, so naming its node) may read its
    node's ResourceSlice but not write one for another node (the chart's admission policy)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    (plugin_pod,) = plugin_pods(kube)
    token = kube.core.create_namespaced_service_account_token(
        plugin_pod.spec.service_account_name,
        PLUGIN_NS,
        {"spec": {"expirationSeconds": 600, "boundObjectRef": {
            "kind": "Pod", "apiVersion": "v1", "name": plugin_pod.metadata.name,
            "uid": plugin_pod.metadata.uid}}},
    ).status.token  # fmt: skip
    cfg = client.Configuration()
    cfg.host = f"https://127.0.0.1:{cluster.port}"
    cfg.ssl_ca_cert = str(cluster.work / "pki" / "ca.crt")
    cfg.api_key = {"authorization": f"Bearer {token}"}
    as_plugin = client.CustomObjectsApi(client.ApiClient(cfg))
    own = kube.resource_slices()[0]
    got = as_plugin.get_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", own["metadata"]["name"]
    )
    assert got["spec"]["nodeName"] == "vgpu-node"
    other = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "other-node-gpu.vgpu-plugin.io"},
        "spec": {"driver": own["spec"]["driver"], "nodeName": "other-node",
                 "pool": {"name": "other-node", "generation": 1, "resourceSliceCount": 1},
                 "devices": own["spec"]["devices"]},
    }  # fmt: skip
    try:
        as_plugin.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", other)
    except ApiException as exc:
        assert exc.status in (403, 422), exc
        assert "own-node" in str(exc.body), exc.body
    else:
        kube.custom.delete_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", other["metadata"]["name"]
        )
        raise AssertionError("the plugin's token wrote another node's ResourceSlice")


def test_extended_resource_form(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """A pod asking for the DeviceClass's extended resource gets a claim with the defaults
    (values: dra.memory.default 1Gi) from the scheduler, and its limit inside."""
    kube.create_pod(pod("extended", 'exec python3 -c "$PROBE"', limits={"vgpu-plugin.io/gpu": "1"}))
    try:
        result = wait_for(
            "the extended-resource pod's CUDA start", lambda: kube.finished("extended")
        )
        assert result["total_mib"] == 1024, result
    finally:
        kube.delete_pods("extended")


def test_pod_deletion_unprepares_the_claim(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """Deleting the pod (the claim stays) unprepares: the claim's limits, container dir and CDI
    spec leave the node, and the claim is reserved for nobody."""
    before = allocation_files(cluster)
    kube.create_claim(claim("unprepare", "2Gi", "10"))
    kube.create_pod(
        pod(
            "unprepare",
            'exec python3 -c "$PROBE" hold',
            claims=[{"name": "gpu", "resourceClaimName": "unprepare"}],
        )
    )
    try:
        held = wait_for("the claim pod's probe", lambda: kube.probed("unprepare"), 120)
        assert held["total_mib"] == 2 * 1024, held
        made = allocation_files(cluster) - before
        assert any(f.startswith(f"{HOST_ROOT}/limits/dra-") for f in made), made
        assert any(f.startswith(CDI_DIR) for f in made), made
        kube.delete_pods("unprepare")
        wait_for("the claim's files removed", lambda: not (allocation_files(cluster) & made), 120)
        status = kube.get_claim("unprepare")["status"]
        assert not status.get("reservedFor"), status
    finally:
        kube.delete_pods("unprepare")
        kube.delete_claims("unprepare")


def test_both_front_ends_in_one_process(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """dra.gpus splits the node: one plugin process serves GPU 1's slices (nvidia.com/gpu) and
    GPU 0 as the driver's device, both at once."""
    (p,) = plugin_pods(kube)
    assert [c.name for c in p.spec.containers] == ["vgpu-plugin"], p.spec.containers
    log = kube.core.read_namespaced_pod_log(p.metadata.name, PLUGIN_NS, container="vgpu-plugin")
    assert "front ends: device-plugin, dra" in log, log[-2000:]
    serving = kube.exec(
        p.metadata.name,
        ["python3", "-c", COUNT_SERVE],
        container="vgpu-plugin",
        namespace=PLUGIN_NS,
    )
    assert serving.strip() == "1", serving  # one serve process in the plugin's container
    assert kube.allocatable("nvidia.com/gpu") == str(SPLIT)
    (device,) = [d for s in kube.resource_slices() for d in s["spec"].get("devices", [])]
    assert device["attributes"]["uuid"]["string"] == cluster.gpus[0], device
    kube.create_claim(claim("both", "3Gi", "10"))
    kube.create_pod(pod("both-dra", 'exec python3 -c "$PROBE"',
                        claims=[{"name": "gpu", "resourceClaimName": "both"}]))  # fmt: skip
    kube.create_pod(pod("both-slice", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"}))
    try:
        dra = wait_for("the claim pod's CUDA start", lambda: kube.finished("both-dra"), 120)
        one = wait_for("the slice pod's CUDA start", lambda: kube.finished("both-slice"), 120)
        assert dra["total_mib"] == 3 * 1024, dra
        assert one["total_mib"] == 16 * 1024 // SPLIT, one
    finally:
        kube.delete_pods("both-dra", "both-slice")
        kube.delete_claims("both")


def test_a_deleted_slice_comes_back(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """A restarted kubelet deletes its node's ResourceSlices, at times after the driver has
    registered and published again (seen with kubelet 1.36): the driver checks every 30 s
    (SLICE_CHECK_INTERVAL_S) and publishes it again, so new claims can still be placed."""
    (before,) = kube.resource_slices()
    kube.custom.delete_cluster_custom_object(
        RESOURCE_GROUP, RESOURCE_VERSION, "resourceslices", before["metadata"]["name"]
    )
    after = wait_for("the ResourceSlice published again", kube.resource_slices, 90)
    assert [s["metadata"]["name"] for s in after] == [before["metadata"]["name"]]
    assert after[0]["metadata"]["uid"] != before["metadata"]["uid"]  # a new object


def test_the_kubelet_reads_device_health_into_the_pod_status(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    """Kubelet 1.36 (ResourceHealthStatus on by default) opens the driver's
    v1alpha1.DRAResourceHealth stream: it must not fail (before the driver served it, the
    kubelet logged an error and retried every 5 s), and a running claim pod's container status
    shows its device Healthy."""
    (uuid,) = [
        d["attributes"]["uuid"]["string"]
        for s in kube.resource_slices()
        for d in s["spec"].get("devices", [])
    ]
    kube.create_claim(claim("health", "2Gi", "10"))
    kube.create_pod(
        pod("health", "sleep 3600", claims=[{"name": "gpu", "resourceClaimName": "health"}])
    )

    def statuses() -> list[tuple[str, str, str]]:
        found = []
        for c in kube.pod("health").status.container_statuses or []:
            for r in c.allocated_resources_status or []:
                found += [(r.name, h.resource_id, h.health) for h in r.resources or []]
        return found

    try:
        wait_for("pod health running", lambda: kube.running("health"), 120)
        seen = wait_for(
            "the device's health in the pod's status",
            lambda: statuses() if any(h == "Healthy" for *_, h in statuses()) else None,
            120,
        )
        # Per claim reference of the pod ("claim:gpu"), the device by its CDI ID.
        assert ("claim:gpu", f"nvidia.com/gpu={uuid}", "Healthy") in seen, seen
        assert {h for *_, h in seen} == {"Healthy"}, seen
        log = cluster.log("kubelet")
        assert "Successfully started WatchResources health stream" in log  # it is opened
        mark = len(log)
        # A stream the kubelet cannot keep is retried every 5 s: three retries' time, none.
        time.sleep(16)
        failed = [
            line
            for line in cluster.log("kubelet")[mark:].splitlines()
            if "WatchResources stream" in line and ("Error" in line or "Failed" in line)
        ]
        assert not failed, failed[:3]
        # A critical XID on the claim's GPU: the pod's status says so, and again when the GPU
        # has been quiet for the recovery period (60 s) and is healthy again.
        inject_xid(cluster, gpu=0, xid=62)
        seen = wait_for(
            "Unhealthy in the pod's status",
            lambda: statuses() if ("Unhealthy" in {h for *_, h in statuses()}) else None,
            120,
        )
        assert ("claim:gpu", f"nvidia.com/gpu={uuid}", "Unhealthy") in seen, seen
        wait_for(
            "Healthy again in the pod's status",
            lambda: statuses() if {h for *_, h in statuses()} == {"Healthy"} else None,
            240,
        )
    finally:
        kube.delete_pods("health")
        kube.delete_claims("health")


def inject_xid(cluster: Cluster, gpu: int, xid: int) -> None:
    """An XID event on the cluster's simulated GPU (simgpu's state, as the node sees it)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vgpu_plugin.sim.simgpu",
            "xid",
            "--state",
            str(cluster.work / "simgpu"),
            "--gpu",
            str(gpu),
            "--xid",
            str(xid),
        ],
        env=dict(os.environ, VGPU_NATIVE_DIR=str(native_build.build("release"))),
        check=True,
        capture_output=True,
    )
