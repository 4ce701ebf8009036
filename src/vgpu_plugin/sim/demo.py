"""The demo's scenario: a whole GPU node, simulated, showing each limit at work.

A simulated node (simgpu) with two GPUs, the real plugin process, a kubelet emulator that
admits a handful of pods through GetPreferredAllocation and Allocate, each pod's container run
exactly as the response says (envs, mounts, /etc/ld.so.preload loading the shim) by runc, or
as processes where runc cannot run (sim/process.py), and workloads that stay inside a limit,
hit one, and share a GPU's compute. Ends with the node's status table and a summary of what
every limit did. ``vgpu-plugin demo`` (commands/demo.py) runs it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu_plugin.sim import cap_share
from vgpu_plugin.sim.cap_share import CapShare
from vgpu_plugin.sim.node import MIB, WORKLOAD, Admitted, EmulatedNode
from vgpu_plugin.sim.simgpu import GpuSpec, Node

GPU_MEMORY_MIB = 16384
CONTEXT_MIB = 256
SPLIT = 4
CONFIG = f"version: v1\nsharing:\n  splitCount: {SPLIT}\n  compute: proportional\n"
KERNEL_MS = 10  # the compute pods' kernels: how long pacing alone leaves their GPU idle follows


@dataclass
class Pod:
    name: str
    slices: int
    workload: list[str]
    what: str
    admitted: Admitted | None = None
    result: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    verdict: str = ""
    share: CapShare | None = None  # a compute pod's, from simgpu's record

    @property
    def held(self) -> bool:
        """The limit did what it promises."""
        return bool(self.verdict) and not any(
            bad in self.verdict for bad in ("failed", "not enforced", "OFF", "not judged")
        )

    @property
    def computes(self) -> bool:
        return "compute" in self.workload

    @property
    def holds_memory(self) -> bool:
        return any(w.endswith("alloc") for w in self.workload)


def default_pods(seconds: float) -> list[Pod]:
    s = str(seconds)
    kernels = [*WORKLOAD, "compute", "--kernel-ms", str(KERNEL_MS), "--seconds", s]
    pods = [
        Pod("batch-50", 2, kernels, "runs kernels non-stop"),
        Pod("batch-25", 1, kernels, "runs kernels non-stop"),
        Pod("steady", 1, [*WORKLOAD, "alloc", "--target-mib", "2048", "--hold", s],
            "allocates 2048 MiB and holds it"),
        Pod("greedy", 1, [*WORKLOAD, "alloc", "--target-mib", "8192", "--chunk-mib", "256",
                          "--hold", s], "tries to allocate 8192 MiB"),
    ]  # fmt: skip
    if importlib.util.find_spec("cupy") is not None:
        # What users run: CuPy over NVIDIA's CUDA runtime, held to its slice like the rest.
        cupy = [*WORKLOAD, "cupy-alloc", "--target-mib", "8192", "--chunk-mib", "256"]
        pods.insert(0, Pod("cupy", 1, [*cupy, "--hold", s], "allocates 8192 MiB with CuPy"))
    return pods


def first_json(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The next JSON line the process prints (a result); its error output when it gave none."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("{"):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
        if time.monotonic() > deadline:
            break
    err = proc.stderr.read() if proc.stderr else ""
    return {"error": f"no result (exit {proc.poll()}): {err.strip()[-500:]}"}


def verdict(pod: Pod) -> str:
    """One line on what the pod's limit did, saying plainly when it did not hold."""
    r, a = pod.result, pod.admitted
    if "error" in r or a is None:
        return f"  {pod.name}: failed: {r.get('error', 'not admitted')}"
    if pod.computes:
        if pod.share is None:
            return f"  {pod.name}: failed: simgpu has no record of its kernels"
        return f"  {pod.name}: compute limit {a.compute_limit()}%: {cap_share.describe(pod.share)}"
    got, seen, limit = r["allocated_mib"], r["cuda_total"] // MIB, a.memory_limit_mib()
    if got > limit:
        judged = "MORE than its limit: not enforced"
    elif r["out_of_memory"]:
        judged = "then a clean CUDA_ERROR_OUT_OF_MEMORY at its limit"
    else:
        judged = "all it asked for, within its limit"
    client = f" through {r['client']}" if "client" in r else ""
    return (f"  {pod.name}: memory limit {limit} MiB: got {got} MiB{client} (+ its context), "
            f"{judged}; cuMemGetInfo shows a {seen} MiB GPU")  # fmt: skip


def read_share(node: Node, gpu: int, pod: Pod, t0: int, t1: int) -> CapShare:
    """A compute pod's shares of GPU ``gpu`` in [t0, t1) of simgpu's clock, by the pid its
    workload reported (the node's, as simgpu records its work)."""
    assert pod.admitted is not None
    # A long run's start may have left simgpu's record (a ring): judge what it still holds.
    t0 = max(t0, node.recorded_since(gpu))
    steps = cap_share.timeline(node, gpu, int(pod.result["pid"]), t0, t1)
    kernel_ns = KERNEL_MS * 1_000_000
    return cap_share.measure(
        steps, cap_share.RESOLUTION_NS, pod.admitted.compute_limit(), kernel_ns
    )


def run_demo(
    work: Path, seconds: float, say: Callable[[str], None], runtime: str = "runc"
) -> list[Pod]:
    gpus = [GpuSpec(memory=GPU_MEMORY_MIB * MIB, context_overhead=CONTEXT_MIB * MIB,
                    numa_node=i) for i in range(2)]  # fmt: skip
    pods = default_pods(seconds)
    node = EmulatedNode(work, gpus, CONFIG, runtime=runtime)
    say(f"[1/5] simulated node in {work}")
    for g in node.node.gpus():
        say(f"      GPU {g.index}: {g.name}, {g.total_memory // MIB} MiB, {g.uuid}")
    try:
        node.start()
        say(f"      plugin registered: {len(node.devices())} slices of "
            f"{GPU_MEMORY_MIB // SPLIT} MiB and {100 // SPLIT}% compute")  # fmt: skip
        say("[2/5] admitting pods (GetPreferredAllocation, then Allocate)")
        index = {g.uuid: g.index for g in node.node.gpus()}
        for pod in pods:
            a = pod.admitted = node.admit(pod.name, pod.slices)
            say(f"      {pod.name:<9} {pod.slices} slice{'s' if pod.slices > 1 else ' '} -> "
                f"GPU {index[a.gpus[0]]}: {a.memory_limit_mib()} MiB, "
                f"{a.compute_limit()}% compute")  # fmt: skip
        say(f"[3/5] running workloads in their containers ({runtime}) for {seconds:g}s")
        t0 = time.monotonic_ns()  # simgpu's clock: the compute pods' record starts after it
        for pod in pods:
            assert pod.admitted is not None
            pod.proc = node.start_container(pod.admitted, pod.workload)
            say(f"      {pod.name:<9} started: {pod.what}")
        # Memory pods report while still holding their memory: the status shows it.
        for pod in [p for p in pods if p.holds_memory]:
            assert pod.proc is not None
            pod.result = first_json(pod.proc, seconds + 60)
        say("[4/5] node status while they run")
        shown = node.status()
        say(shown.stdout if shown.returncode == 0 else shown.stdout + shown.stderr)
        for pod in [p for p in pods if not p.holds_memory]:
            assert pod.proc is not None
            pod.result = first_json(pod.proc, seconds + 60)
        for pod in pods:
            if pod.proc is not None:
                pod.proc.wait(timeout=seconds + 30)
        t1 = time.monotonic_ns()
        for pod in [p for p in pods if p.computes and "pid" in p.result]:
            assert pod.admitted is not None
            pod.share = read_share(node.node, index[pod.admitted.gpus[0]], pod, t0, t1)
        say("[5/5] what each limit did")
        for pod in pods:
            pod.verdict = verdict(pod)
            say(pod.verdict)
    finally:
        node.stop()
    return pods
