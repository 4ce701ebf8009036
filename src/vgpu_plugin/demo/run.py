"""``vgpu-plugin demo``: a whole GPU node, simulated, showing each limit at work.

A simulated node (simgpu) with two GPUs, the real plugin process, a kubelet emulator that
admits a handful of pods through GetPreferredAllocation and Allocate, each pod's container run
by runc exactly as the response says (envs, mounts, /etc/ld.so.preload loading the shim), and
workloads that stay inside a limit, hit one, and share a GPU's compute. Ends with the node's
status table and a summary of what every limit did.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu_plugin import native
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.install import install_shim
from vgpu_plugin.kubelet_emulator import KubeletEmulator, PodResourcesEmulator, short_tmp_dir
from vgpu_plugin.oci import BindMount, ContainerConfig, RuncRuntime, runc_unavailable_reason
from vgpu_plugin.simgpu import GpuSpec, Node

RES = "nvidia.com/gpu"
MIB = 1 << 20
GPU_MEMORY_MIB = 16384
CONTEXT_MIB = 256
SPLIT = 4
SLICE_MIB = GPU_MEMORY_MIB // SPLIT


@dataclass
class Pod:
    name: str
    slices: int
    workload: list[str]
    what: str
    response: pb.ContainerAllocateResponse | None = None
    device_ids: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None

    @property
    def memory_limit_mib(self) -> int:
        assert self.response is not None
        return int(self.response.envs["CUDA_DEVICE_MEMORY_LIMIT_0"].rstrip("m"))

    @property
    def compute_limit(self) -> int:
        assert self.response is not None
        return int(self.response.envs["CUDA_DEVICE_SM_LIMIT_0"])

    @property
    def gpu(self) -> str:
        assert self.response is not None
        return self.response.envs["NVIDIA_VISIBLE_DEVICES"]


def default_pods(seconds: float) -> list[Pod]:
    w = [sys.executable, "-m", "vgpu_plugin.demo.workload"]
    return [
        Pod("batch-50", 2, [*w, "compute", "--seconds", str(seconds)], "runs kernels non-stop"),
        Pod("batch-25", 1, [*w, "compute", "--seconds", str(seconds)], "runs kernels non-stop"),
        Pod("steady", 1, [*w, "alloc", "--target-mib", "2048", "--hold", str(seconds)],
            "allocates 2048 MiB and holds it"),
        Pod("greedy", 1, [*w, "alloc", "--target-mib", "8192", "--chunk-mib", "256",
                          "--hold", str(seconds)], "tries to allocate 8192 MiB"),
    ]  # fmt: skip


class Demo:
    def __init__(self, workdir: Path, say: Callable[[str], None], seconds: float) -> None:
        self.work = workdir
        self.say = say
        self.seconds = seconds
        self.host_root = workdir / "host"
        self.state_dir = workdir / "state"
        self.lock_dir = workdir / "locks"
        self.plugin_dir = short_tmp_dir("vgpu-demo-dp-")
        self.kubelet = KubeletEmulator(self.plugin_dir)
        self.podres = PodResourcesEmulator(
            workdir / "pod-resources" / "kubelet.sock",
            lambda: [(RES, [d.ID for d in self.kubelet.devices(RES) or []])],
        )
        self.runtime = RuncRuntime(workdir / "containers")
        self.plugin: subprocess.Popen[str] | None = None
        self.node: Node | None = None

    # -- steps -----------------------------------------------------------------------------

    def bring_up(self) -> None:
        gpus = [GpuSpec(memory=GPU_MEMORY_MIB * MIB, context_overhead=CONTEXT_MIB * MIB,
                        numa_node=i) for i in range(2)]  # fmt: skip
        self.node = Node.create(self.work / "simgpu", gpus, seed="demo")
        for g in self.node.gpus():
            self.say(f"      GPU {g.index}: {g.name}, {g.total_memory // MIB} MiB, {g.uuid}")
        install_shim(self.host_root)
        config = self.work / "config.yaml"
        config.write_text(
            f"version: v1\nsharing:\n  splitCount: {SPLIT}\n  compute: proportional\n"
            "  placement: binpack\n"
        )
        self.podres.start()
        self.kubelet.start()
        cmd = [
            sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(config),
            "--device-plugin-dir", str(self.plugin_dir), "--host-root", str(self.host_root),
            "--state-dir", str(self.state_dir), "--lock-dir", str(self.lock_dir),
            "--pod-resources-socket", str(self.podres.socket_path), "--node-name", "demo-node",
            "--metrics-address", "127.0.0.1:0",
        ]  # fmt: skip
        log = open(self.work / "plugin.log", "w")  # noqa: SIM115 - lives as long as the plugin
        self.plugin = subprocess.Popen(
            cmd, env=self.node.env(), stdout=log, stderr=subprocess.STDOUT, text=True
        )
        self.kubelet.wait_registrations(1, timeout=30)
        devices = self.kubelet.wait_devices(RES, lambda d: len(d) == 2 * SPLIT, timeout=30)
        self.say(f"      registered {RES}: {len(devices)} slices of {SLICE_MIB} MiB "
                 f"and {100 // SPLIT}% compute")  # fmt: skip

    def admit(self, pods: Sequence[Pod]) -> None:
        for pod in pods:
            devices = self.kubelet.devices(RES) or []
            taken = {i for p in pods for i in p.device_ids}
            free = [d.ID for d in devices if d.ID not in taken and d.health == "Healthy"]
            chosen = self.kubelet.get_preferred_allocation(RES, free, size=pod.slices)
            pod.response = self.kubelet.allocate(RES, chosen).container_responses[0]
            pod.device_ids = chosen
            self.podres.assign("demo", pod.name, "main", RES, chosen)
            gpu_index = self._gpu_index(pod.gpu)
            self.say(f"      {pod.name:<9} {pod.slices} slice{'s' if pod.slices > 1 else ' '} "
                     f"-> GPU {gpu_index}: {pod.memory_limit_mib} MiB, "
                     f"{pod.compute_limit}% compute")  # fmt: skip

    def run_workloads(self, pods: Sequence[Pod]) -> None:
        assert self.node is not None
        for pod in pods:
            assert pod.response is not None
            envs = dict(pod.response.envs)
            envs["LD_LIBRARY_PATH"] = str(native.simgpu_dir())
            envs["SIMGPU_STATE"] = str(self.node.state_dir)
            envs["PYTHONPATH"] = ":".join(p for p in sys.path if p)
            envs["PYTHONDONTWRITEBYTECODE"] = "1"
            mounts = [BindMount(m.container_path, m.host_path, m.read_only)
                      for m in pod.response.mounts]  # fmt: skip
            # The simulated GPUs' device state, as /dev/nvidia* would be for a real one.
            mounts.append(BindMount(str(self.node.state_dir), str(self.node.state_dir), False))
            config = ContainerConfig(name=f"demo-{pod.name}", args=pod.workload, envs=envs,
                                     mounts=mounts)  # fmt: skip
            pod.proc = self.runtime.start(config)
            self.say(f"      {pod.name:<9} started: {pod.what}")

    def collect(self, pods: Sequence[Pod]) -> None:
        """Each pod's result line (memory pods print theirs while still holding memory)."""
        for pod in pods:
            assert pod.proc is not None
            pod.result = self._first_json(pod.proc)

    def finish(self, pods: Sequence[Pod]) -> None:
        for pod in pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(timeout=self.seconds + 30)
                except subprocess.TimeoutExpired:
                    self.runtime.kill(f"demo-{pod.name}")
                self.runtime.remove(f"demo-{pod.name}")

    def status(self) -> str:
        assert self.node is not None
        proc = subprocess.run(
            [sys.executable, "-m", "vgpu_plugin", "status", "--host-root", str(self.host_root),
             "--state-dir", str(self.state_dir),
             "--pod-resources-socket", str(self.podres.socket_path)],
            env=self.node.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr

    def tear_down(self) -> None:
        if self.plugin is not None and self.plugin.poll() is None:
            self.plugin.terminate()
            try:
                self.plugin.wait(10)
            except subprocess.TimeoutExpired:
                self.plugin.kill()
        self.kubelet.stop()
        self.podres.stop()
        shutil.rmtree(self.plugin_dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------

    def _gpu_index(self, uuid: str) -> int:
        assert self.node is not None
        return next(g.index for g in self.node.gpus() if g.uuid == uuid)

    def _first_json(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        deadline = time.monotonic() + self.seconds + 60
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
            if time.monotonic() > deadline:
                break
        err = proc.stderr.read() if proc.stderr else ""
        return {"error": f"no result (exit {proc.poll()}): {err.strip()[-500:]}"}


def summary(pods: Sequence[Pod]) -> list[str]:
    lines = []
    for pod in pods:
        r = pod.result
        if "error" in r:
            lines.append(f"  {pod.name}: failed: {r['error']}")
        elif "share_percent" in r:
            share, limit = r["share_percent"], pod.compute_limit
            verdict = "on target" if abs(share - limit) <= 5 else "OFF its limit"
            lines.append(f"  {pod.name}: compute limit {limit}%: its kernels ran "
                         f"{share:.1f}% of the time, {verdict}")  # fmt: skip
        else:
            got, seen, limit = r["allocated_mib"], r["cuda_total"] // MIB, pod.memory_limit_mib
            if got > limit:
                verdict = "MORE than its limit: not enforced"
            elif r["out_of_memory"]:
                verdict = "then a clean CUDA_ERROR_OUT_OF_MEMORY at its limit"
            else:
                verdict = "all it asked for, within its limit"
            lines.append(
                f"  {pod.name}: memory limit {limit} MiB: got {got} MiB (+ its context), "
                f"{verdict}; cuMemGetInfo shows a {seen} MiB GPU"
            )
    return lines


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=4.0, help="how long workloads run")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, state)")


def run(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(text, flush=True)

    reason = runc_unavailable_reason()
    if reason:
        print(f"vgpu-plugin demo: cannot run containers here: {reason}.\n"
              "The demo runs real containers with runc; run it as root on Linux with runc "
              "installed (Debian/Ubuntu: apt-get install runc).", file=sys.stderr)  # fmt: skip
        return 2
    try:
        native.shim_library()
        native.simgpu_dir()
    except native.NativeArtifactMissing as exc:
        print(f"vgpu-plugin demo: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="vgpu-demo-"))
    demo = Demo(work, say, args.seconds)
    pods = default_pods(args.seconds)
    rc = 0
    try:
        say("vgpu-plugin demo: one simulated GPU node, the real plugin, containers under runc")
        say(f"[1/5] simulated node in {work}")
        demo.bring_up()
        say("[2/5] admitting pods (GetPreferredAllocation, then Allocate)")
        demo.admit(pods)
        say(f"[3/5] running workloads in their containers for {args.seconds:g}s")
        demo.run_workloads(pods)
        holders = [p for p in pods if "alloc" in p.workload]
        demo.collect(holders)
        say("[4/5] node status while they run")
        say(demo.status())
        demo.collect([p for p in pods if p not in holders])
        demo.finish(pods)
        say("[5/5] what each limit did")
        for line in summary(pods):
            say(line)
        if any("error" in p.result for p in pods):
            rc = 1
    except Exception as exc:
        print(f"vgpu-plugin demo failed: {exc} (logs in {work})", file=sys.stderr)
        args.keep = True
        rc = 1
    finally:
        demo.tear_down()
        if args.keep:
            say(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return rc
