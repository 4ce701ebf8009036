"""DRA on a real cluster: the driver's ResourceSlice, claims placed by the stock scheduler, and
prepared claims that outlive the plugin's cleanup grace (issue 20)."""

from __future__ import annotations

import time

from .cluster import Cluster
from .conftest import Helm
from .kube import Kube, claim, pod, wait_for

GRACE = 4.0  # values.yaml cleanupGraceSeconds
PAST_GRACE = 5 * GRACE  # several sweeps (every grace/4) after the grace ran out


def test_slice_published_and_claims_packed_exactly(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    slices = kube.resource_slices()
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    assert len(devices) == 1, slices  # GPU 0 only: GPU 1 is the device plugin's
    assert devices[0]["capacity"]["memory"]["value"] == "16Gi", devices[0]
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
