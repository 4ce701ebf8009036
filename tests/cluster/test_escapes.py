"""A pod's process that runs on its GPU without the shim, on a real kubelet and containerd:
with the chart's ``hostPID`` the plugin finds it (NVML lists it, the pod's limits mount
attributes it, the pod's region has no slot for it), names it in its log and in ``status``,
and leaves a shimmed pod beside it alone (node/observe/escapes.py, docs/security.md).

The bare process is a real escape of the real injection: a privileged container masks the
``/etc/ld.so.preload`` the CDI spec mounted (as an image whose loader cannot read it would
ignore it) in a mount namespace of its own, which keeps the container's other mounts."""

from __future__ import annotations

from .cluster import SIMGPU_ENV, Cluster
from .conftest import PLUGIN_NS, Helm, in_node_pid_namespace
from .kube import Kube, pod, wait_for

HOLD = "python3 -m vgpu_plugin.sim.workload alloc --target-mib 256 --chunk-mib 64 --hold 600"
BARE = f"exec unshare -m sh -c 'mount --bind /dev/null /etc/ld.so.preload && exec {HOLD}'"
KEPT = f"exec {HOLD}"


def test_a_pods_process_without_the_shim_is_named_and_a_shimmed_one_is_not(
    cluster: Cluster, kube: Kube, plugin: Helm
) -> None:
    with in_node_pid_namespace(kube, cluster, plugin) as plugin_pod:
        try:
            bare = pod("bare", BARE, limits={"nvidia.com/gpu": "1"})
            bare["spec"]["containers"][0]["securityContext"] = {"privileged": True}
            kube.create_pod(bare)
            kube.create_pod(pod("kept", KEPT, limits={"nvidia.com/gpu": "1"}))

            def both() -> bool:
                return kube.running("bare") and kube.running("kept")

            wait_for("both pods running", both, 120)
            limits = ["sed", "-n", "s/^allocation //p", "/etc/vgpu/limits"]
            ids = {name: kube.exec(name, limits).strip() for name in ("bare", "kept")}

            def said() -> list[str] | None:
                log = kube.core.read_namespaced_pod_log(plugin_pod().metadata.name, PLUGIN_NS)
                lines = [ln for ln in log.splitlines() if "without the shim" in ln]
                return lines or None

            lines = wait_for("the plugin naming a process without the shim", said, 90)
            assert len(lines) == 1, lines
            assert f"(allocation {ids['bare']})" in lines[0], (ids, lines)
            # exec'd processes get the pod spec's env, not the runtime's CDI edits: NVML's
            # (simgpu's) settings as the plugin's own process has them
            nvml = " ".join(SIMGPU_ENV)
            status = kube.exec(
                plugin_pod().metadata.name, ["sh", "-c", f"{nvml} exec vgpu-plugin status"],
                container="vgpu-plugin", namespace=PLUGIN_NS,
            )  # fmt: skip
            warned = [ln for ln in status.splitlines() if "without the shim" in ln]
            assert len(warned) == 1 and ids["bare"] in warned[0], (ids, status)
        finally:
            kube.delete_pods("bare", "kept")
