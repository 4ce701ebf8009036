"""A whole emulated GPU node: simgpu, the real plugin process, a kubelet, containers.

The demo and the end-to-end tests both drive a node through this: pods are admitted the way
the kubelet admits them (GetPreferredAllocation, then Allocate, then pod-resources knows), and
their containers run under runc with exactly the response's envs and mounts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from vgpu_plugin.api.constants import HEALTHY
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import cdi, defaults
from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.node.host import native
from vgpu_plugin.node.host.install import install_shim
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, PodResourcesEmulator, short_tmp_dir
from vgpu_plugin.sim.process import ProcessRuntime
from vgpu_plugin.sim.runc import ContainerConfig, RuncRuntime, Runtime
from vgpu_plugin.sim.simgpu import GpuSpec, Node
from vgpu_plugin.sim.toolkit import ToolkitSettings, set_memory_limits_with
from vgpu_plugin.sim.toolkit import apply as apply_toolkit

RES = defaults.RESOURCE_NAME
MIB = 1 << 20
NAMESPACE = "demo"


NODE_PROC = "/run/simgpu/node-proc"  # where containers see the node's /proc (simulation only)


@dataclass
class Admitted:
    """A pod's container as the kubelet admitted it."""

    pod: str
    device_ids: list[str]
    response: pb.ContainerAllocateResponse
    containers: list[str] = field(default_factory=list)

    @property
    def envs(self) -> dict[str, str]:
        return dict(self.response.envs)

    @property
    def cdi_devices(self) -> list[str]:
        """The CDI devices named by the response, in either of its two forms."""
        names = [d.name for d in self.response.cdi_devices]
        for key, value in self.response.annotations.items():
            if key.startswith(cdi.ANNOTATION_PREFIX):
                names.extend(value.split(","))
        return list(dict.fromkeys(names))

    @property
    def allocation_id(self) -> str:
        if "VGPU_ALLOCATION_ID" in self.response.envs:
            return self.response.envs["VGPU_ALLOCATION_ID"]
        return next(n.split("=", 1)[1] for n in self.cdi_devices if n.startswith(cdi.KIND + "="))

    def memory_limit_mib(self, i: int = 0) -> int:
        return int(self.response.envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"].rstrip("m"))

    def compute_limit(self, i: int = 0) -> int:
        return int(self.response.envs[f"CUDA_DEVICE_SM_LIMIT_{i}"])

    @property
    def gpus(self) -> list[str]:
        """The GPUs the response names, whatever the deviceListStrategy."""
        prefix = cdi.VOLUME_MOUNTS_ROOT + "/"
        found = [m.container_path[len(prefix) :] for m in self.response.mounts
                 if m.container_path.startswith(prefix)]  # fmt: skip
        found += [n.split("=", 1)[1] for n in self.cdi_devices if n.startswith(cdi.GPU_KIND + "=")]
        if found:
            return list(dict.fromkeys(found))
        return self.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")


class EmulatedNode:
    """Bring up with ``start()``, always ``stop()`` (also as a context manager)."""

    def __init__(
        self,
        workdir: Path,
        gpus: Sequence[GpuSpec],
        config_text: str,
        cleanup_grace: float | None = None,
        runtime: str = "runc",
        toolkit: ToolkitSettings | None = None,
    ) -> None:
        self.work = workdir
        self.cdi_dir = workdir / "cdi"
        # The NVIDIA runtime's settings on this node (sim/toolkit.py); safe unless told.
        base = toolkit if toolkit is not None else ToolkitSettings()
        self.toolkit = dataclasses.replace(base, cdi_spec_dirs=(self.cdi_dir,))
        self.gpu_specs = list(gpus)
        self.config = workdir / "config.yaml"
        self.config_text = config_text
        self.cleanup_grace = cleanup_grace
        self.host_root = workdir / "host"
        self.state_dir = workdir / "state"
        self.lock_dir = workdir / "locks"
        self.plugin_dir = short_tmp_dir("vgpu-node-dp-")
        self.kubelet = KubeletEmulator(self.plugin_dir)
        self.podres = PodResourcesEmulator(
            workdir / "pod-resources" / "kubelet.sock",
            lambda: [(RES, [d.ID for d in self.kubelet.devices(RES) or []])],
        )
        containers = workdir / "containers"
        self.runtime: Runtime = (
            RuncRuntime(containers) if runtime == "runc" else ProcessRuntime(containers, runtime)
        )
        self.plugin: subprocess.Popen[bytes] | None = None
        self.node = Node.create(workdir / "simgpu", self.gpu_specs, seed=workdir.name)
        self.admitted: list[Admitted] = []
        self._log: IO[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> None:
        install_shim(self.host_root)
        self.config.write_text(self.config_text)
        self.podres.start()
        self.kubelet.start()
        self.start_plugin()
        self.kubelet.wait_registrations(1, timeout=timeout)
        self.wait_devices(lambda d: len(d) > 0, timeout=timeout)

    def start_plugin(self) -> None:
        cmd = [
            sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(self.config),
            "--device-plugin-dir", str(self.plugin_dir), "--host-root", str(self.host_root),
            "--state-dir", str(self.state_dir), "--lock-dir", str(self.lock_dir),
            "--pod-resources-socket", str(self.podres.socket_path), "--node-name", "node-1",
            "--metrics-address", "127.0.0.1:0", "--log-level", "debug",
            "--cdi-spec-dir", str(self.cdi_dir),
        ]  # fmt: skip
        env = self.node.env()
        if self.cleanup_grace is not None:
            env["VGPU_CLEANUP_GRACE"] = str(self.cleanup_grace)
        if self._log is None:
            self._log = open(self.work / "plugin.log", "ab")  # noqa: SIM115 - closed in stop()
        self.plugin = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def kill_plugin(self) -> None:
        if self.plugin is not None and self.plugin.poll() is None:
            self.plugin.kill()
            self.plugin.wait()

    def stop(self) -> None:
        for a in self.admitted:
            for name in a.containers:
                self.runtime.kill(name)
                self.runtime.remove(name)
        if self.plugin is not None and self.plugin.poll() is None:
            self.plugin.terminate()
            try:
                self.plugin.wait(10)
            except subprocess.TimeoutExpired:
                self.plugin.kill()
                self.plugin.wait()
        self.kubelet.stop()
        self.podres.stop()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.plugin_dir, ignore_errors=True)

    def __enter__(self) -> EmulatedNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def plugin_log(self) -> str:
        path = self.work / "plugin.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- kubelet ---------------------------------------------------------------------------

    def devices(self) -> list[pb.Device]:
        return self.kubelet.devices(RES) or []

    def wait_devices(self, predicate: object, timeout: float = 10) -> list[pb.Device]:
        return self.kubelet.wait_devices(RES, predicate, timeout)  # type: ignore[arg-type]

    def admit(self, pod: str, slices: int, device_ids: Sequence[str] | None = None) -> Admitted:
        """Admit one single-container pod asking for ``slices`` slices."""
        if device_ids is None:
            taken = {i for a in self.admitted for i in a.device_ids}
            free = [d.ID for d in self.devices() if d.ID not in taken and d.health == HEALTHY]
            device_ids = self.kubelet.get_preferred_allocation(RES, free, size=slices)
        chosen = list(device_ids)
        response = self.kubelet.allocate(RES, chosen).container_responses[0]
        self.podres.assign(NAMESPACE, pod, "main", RES, chosen)
        admitted = Admitted(pod, chosen, response)
        self.admitted.append(admitted)
        return admitted

    def remove_pod(self, admitted: Admitted) -> None:
        """The pod ended: its containers are gone and the kubelet forgets its devices."""
        for name in admitted.containers:
            self.runtime.kill(name)
            self.runtime.remove(name)
        self.podres.remove_pod(NAMESPACE, admitted.pod)
        self.admitted.remove(admitted)

    # -- containers ------------------------------------------------------------------------

    def container_config(
        self, admitted: Admitted | None, name: str, args: Sequence[str],
        envs: dict[str, str] | None = None,
    ) -> ContainerConfig:  # fmt: skip
        """The container as the runtime starts it: the response's envs and mounts (none for
        a container without an allocation) and the pod's own ``envs``, through the NVIDIA
        runtime's decision (sim/toolkit.py)."""
        all_envs = dict(envs or {})
        if admitted is not None:
            all_envs.update(admitted.envs)  # the kubelet's device envs win over the pod's
        # The simulated driver stands where the NVIDIA runtime would put the real one.
        all_envs["LD_LIBRARY_PATH"] = str(native.simgpu_dir())
        all_envs["SIMGPU_STATE"] = str(self.node.state_dir)
        # The driver's sample period is the node's (a real driver's, its product's): every
        # process of the node, serve and the containers' shims, reads NVML alike.
        if period := os.environ.get("SIMGPU_UTIL_PERIOD_MS"):
            all_envs["SIMGPU_UTIL_PERIOD_MS"] = period
        all_envs["PYTHONPATH"] = ":".join(p for p in sys.path if p)
        all_envs["PYTHONDONTWRITEBYTECODE"] = "1"
        mounts = [] if admitted is None else [
            Mount(m.container_path, m.host_path, m.read_only) for m in admitted.response.mounts
        ]  # fmt: skip
        # The simulated GPUs' device state, as /dev/nvidia* would be for a real GPU.
        mounts.append(Mount(str(self.node.state_dir), str(self.node.state_dir), False))
        # A real driver's NVML lists a container's processes by their pids on the node: simgpu
        # learns those through the node's /proc (SIMGPU_HOST_PROC, simgpu's NVML.md), so the
        # containers here see what they would on a cluster (the shim finds itself by a probe).
        mounts.append(Mount(NODE_PROC, "/proc", True))
        all_envs["SIMGPU_HOST_PROC"] = NODE_PROC
        config = ContainerConfig(name=name, args=list(args), envs=all_envs, mounts=mounts)
        return apply_toolkit(
            config,
            self.toolkit,
            [g.uuid for g in self.node.gpus()],
            admitted.cdi_devices if admitted is not None else (),
            set_memory_limits=set_memory_limits_with(self.node.env()),
        )

    def run_unallocated(
        self, name: str, args: Sequence[str], envs: dict[str, str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """A pod that asked for no GPU, with ``envs`` in its own spec."""
        return self.runtime.run(self.container_config(None, name, args, envs), timeout=timeout)

    def start_container(
        self, admitted: Admitted, args: Sequence[str], suffix: str = "", stdin: bool = False
    ) -> subprocess.Popen[str]:
        """``stdin``: the container reads a pipe (the Popen's stdin) rather than /dev/null."""
        name = f"{admitted.pod}{suffix}-{len(admitted.containers)}"
        admitted.containers.append(name)
        config = self.container_config(admitted, name, args)
        return self.runtime.start(dataclasses.replace(config, stdin=stdin))

    def run_container(
        self, admitted: Admitted, args: Sequence[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        name = f"{admitted.pod}-run-{len(admitted.containers)}"
        return self.runtime.run(self.container_config(admitted, name, args), timeout=timeout)

    # -- operator's view -------------------------------------------------------------------

    def status(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vgpu_plugin", "status", "--host-root", str(self.host_root),
             "--state-dir", str(self.state_dir),
             "--pod-resources-socket", str(self.podres.socket_path), *extra],
            env=self.node.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip


WORKLOAD = [sys.executable, "-m", "vgpu_plugin.sim.workload"]
