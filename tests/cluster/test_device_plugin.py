"""The device plugin on a real cluster: registration, capacity, slices' limits inside the
containers, and the scheduler's refusal past the capacity."""

from __future__ import annotations

import json
import time

import pytest

from .cluster import Cluster
from .conftest import GRACE, HOST_ROOT, SPLIT, Helm, allocation_files, plugin_status
from .kube import Kube, pod, wait_for

SLICE_MIB = 16 * 1024 // SPLIT
PROBE_THEN_SLEEP = 'python3 -c "$PROBE"; exec sleep 3600'
PROBE_AND_HOLD = 'exec python3 -c "$PROBE" hold'  # a live CUDA process while the pod runs


def test_registered_with_its_capacity(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    node = kube.node()
    assert node.status.capacity["nvidia.com/gpu"] == str(SPLIT)
    assert node.status.allocatable["nvidia.com/gpu"] == str(SPLIT)
    sockets = [p.name for p in cluster.node_path("/var/lib/kubelet/device-plugins").iterdir()]
    assert any(s.startswith("vgpu-") for s in sockets), sockets


@pytest.mark.parametrize("slices", [1, 3])
def test_slices_hold_their_limit(cluster: Cluster, kube: Kube, plugin: Helm, slices: int) -> None:
    name = f"slice-{slices}"
    kube.create_pod(pod(name, 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": str(slices)}))
    try:
        result = wait_for(f"the {slices}-slice pod's CUDA start", lambda: kube.finished(name), 120)
        assert result["total_mib"] == slices * SLICE_MIB, result
        assert result["over_limit_rc"] == 2, result  # CUDA_ERROR_OUT_OF_MEMORY
    finally:
        kube.delete_pods(name)


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


def test_read_only_root_pod_holds_its_limit(cluster: Cluster, kube: Kube, plugin: Helm) -> None:
    """A read-only root (so a read-only /usr and /etc) still gets the shim: the limit holds."""
    body = pod("read-only", 'exec python3 -c "$PROBE"', limits={"nvidia.com/gpu": "1"})
    body["spec"]["containers"][0]["securityContext"] = {"readOnlyRootFilesystem": True}
    kube.create_pod(body)
    try:
        result = wait_for("the read-only pod's CUDA start", lambda: kube.finished("read-only"))
        assert result["total_mib"] == SLICE_MIB, result  # simgpu alone would say 16 GiB
        assert result["over_limit_rc"] == 2, result
    finally:
        kube.delete_pods("read-only")


def test_init_container_slice_kept_but_not_counted_after_it_ended(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    """The kubelet hands the init container's slice to the app container after it. The init
    container's allocation stays while the pod lives (it may run again), past the cleanup
    grace; ``status`` counts the slice once (issue 20: an ended init container's slice was
    counted beside the app container's, GPU LIMITED 18432/16384 MiB on 8/8 slices)."""
    limits_dir = f"{HOST_ROOT}/limits/"
    before = allocation_files(cluster)
    body = pod("init-slice", PROBE_AND_HOLD, limits={"nvidia.com/gpu": "1"})
    main = body["spec"]["containers"][0]
    init = {**main, "name": "init", "command": ["sh", "-c", 'exec python3 -c "$PROBE"']}
    body["spec"]["initContainers"] = [init]
    kube.create_pod(body)
    try:
        held = wait_for("the app container's probe", lambda: kube.probed("init-slice"), 120)
        assert held["total_mib"] == SLICE_MIB, held
        (ended,) = kube.pod("init-slice").status.init_container_statuses
        assert ended.state.terminated.exit_code == 0, ended.state
        assert json.loads(ended.state.terminated.message)["total_mib"] == SLICE_MIB
        made = {f for f in allocation_files(cluster) - before if f.startswith(limits_dir)}
        assert len(made) == 2, made  # the init container's and the app container's
        time.sleep(3 * GRACE)  # cleanup passes (every grace/4) well past the grace
        assert made <= allocation_files(cluster), "the init container's limits file was removed"
        status = plugin_status(kube)
        (gpu,) = [g for g in status["gpus"] if g["uuid"] == cluster.gpus[1]]
        assert (gpu["slices_allocated"], gpu["memory_limited"] >> 20) == (1, SLICE_MIB), gpu
        mine = {
            a["pod"]["container"]: a["ended"]
            for a in status["allocations"]
            if a["pod"] and a["pod"]["pod"] == "init-slice"
        }
        assert mine == {"init": True, "main": False}, status["allocations"]
    finally:
        kube.delete_pods("init-slice")
