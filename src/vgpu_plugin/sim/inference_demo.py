"""``vgpu-plugin demo --inference``: inference servers packed onto one simulated GPU.

One 16 GiB GPU split four ways, the real plugin and shim. Three pods run the inference server
of sim/inference.py (PyTorch): each loads its model, sizes its KV cache from what
``torch.cuda.mem_get_info()`` shows it (vLLM's ``gpu_memory_utilization``) and serves
requests. A fourth asks for a cache larger than its slice and gets a clean out-of-memory error
while its neighbours keep serving. The table shows each pod's cache, memory and GPU time.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu_plugin.sim.demo import first_json
from vgpu_plugin.sim.node import MIB, Admitted, EmulatedNode
from vgpu_plugin.sim.simgpu import GpuSpec

GPU_MEMORY_MIB = 16384
CONTEXT_MIB = 256
SPLIT = 4
CONFIG = f"version: v1\nsharing:\n  splitCount: {SPLIT}\n  compute: proportional\n"
UTILIZATION = 0.9
GREEDY_CACHE_MIB = 6144  # more than a 4096 MiB slice holds
TOLERANCE = 0.02  # each cache within 2 % of what its slice allows
SERVER = [sys.executable, "-m", "vgpu_plugin.sim.inference"]


@dataclass
class Server:
    name: str
    args: list[str]
    admitted: Admitted | None = None
    proc: subprocess.Popen[str] | None = None
    first: dict[str, Any] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return "--cache-mib" in self.args

    def cuda_own(self) -> int:
        """What CUDA itself holds for the pod: its context and the code of the kernels it has
        run (what the pod saw in use beyond PyTorch's reserved memory)."""
        return int(self.first["in_use"] - self.first["reserved"])

    def expected_cache(self) -> int:
        """What its slice allows the cache, from the slice the plugin gave it: utilization x
        the slice, less CUDA's own memory, the weights, cuBLAS's workspaces and the
        activations' peak (each as the server measured it)."""
        r = self.first
        return int(
            UTILIZATION * slice_bytes(self)
            - self.cuda_own()
            - r["weights"]
            - r["workspaces"]
            - r["profile_peak"]
        )

    def cache_ratio(self) -> float:
        return float(self.first["cache"]) / self.expected_cache()


def servers(seconds: float) -> list[Server]:
    hold = ["--hold", str(seconds)]
    serve = [*SERVER, "--utilization", str(UTILIZATION), "--requests", "4", *hold]
    return [
        Server("llm-a", serve),
        Server("llm-b", serve),
        Server("llm-c", serve),
        Server("greedy", [*SERVER, "--cache-mib", str(GREEDY_CACHE_MIB), "--requests", "4"]),
    ]


def mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


COLUMNS = [("pod", 7), ("slice", 6), ("CUDA", 5), ("weights", 8), ("KV cache", 9),
           ("of allowed", 10), ("memory", 7), ("GPU ms", 8), ("served", 6)]  # fmt: skip


def row(cells: list[str], result: str) -> str:
    widths = [w for _, w in COLUMNS]
    text = " ".join(
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return f"      {text}  {result}"


def table(pods: list[Server]) -> list[str]:
    head = row([name for name, _ in COLUMNS], "result")
    rows = [head, "      " + "-" * (len(head) - 6)]
    for p in pods:
        assert p.admitted is not None
        r, last = p.first, p.last or p.first
        if "error" in r:
            rows.append(f"      {p.name:<7} failed: {r['error']}")
            continue
        cells = [p.name, str(p.admitted.memory_limit_mib())]
        if r.get("out_of_memory"):
            cells += ["-", mib(r["weights"]), "-", "-", "-", "-", "0"]
            rows.append(row(cells, f"asked {GREEDY_CACHE_MIB} MiB: out of memory"))
            continue
        cells += [mib(p.cuda_own()), mib(r["weights"]), mib(r["cache"])]
        cells += [f"{100 * p.cache_ratio():.1f}%", mib(r["cuda_used"])]
        cells += [f"{last['gpu_ms']:.1f}", str(last["served"])]
        rows.append(row(cells, "serving"))
    rows.append("      (MiB; CUDA: its context and kernel code; allowed: 90% of the slice less")
    rows.append("      CUDA, weights, cuBLAS workspaces and activations; memory: what CUDA shows")
    rows.append("      the pod using; GPU ms: its requests' time on the GPU, by CUDA events)")
    return rows


def slice_bytes(p: Server) -> int:
    assert p.admitted is not None
    return p.admitted.memory_limit_mib() * MIB


def judge(pods: list[Server]) -> tuple[bool, str]:
    """Whether the scenario proved what it claims, and the one line that says what."""
    sized = [p for p in pods if not p.greedy]
    greedy = [p for p in pods if p.greedy]
    problems = [f"{p.name}: {p.first.get('error') or p.last.get('error')}"
                for p in pods if "error" in p.first or "error" in p.last]  # fmt: skip
    if problems:
        return False, "FAILED: " + "; ".join(problems)
    oom = [p.name for p in sized if p.first.get("out_of_memory")]
    off = [p.name for p in sized if not (1 - TOLERANCE <= p.cache_ratio() <= 1.0)]
    stopped = [p.name for p in sized if p.last.get("served", 0) <= p.first["served"]]
    over = [p.name for p in sized if p.first["cuda_used"] > slice_bytes(p)]
    refused = all(p.first.get("out_of_memory") for p in greedy)
    if oom or off or stopped or over or not refused:
        return False, (
            f"FAILED: out of memory within their slice: {oom or 'none'}; more than their "
            f"slice: {over or 'none'}; cache off its slice "
            f"by more than {TOLERANCE:.0%}: {off or 'none'}; stopped serving: "
            f"{stopped or 'none'}; greedy refused: {refused}"
        )
    # Requests the neighbours finished after the greedy pod's out-of-memory error (one clock:
    # every container runs on this host).
    refused_at = max(p.first["at"] for p in greedy)
    more = sum(t > refused_at for p in sized for t in p.last["finished_at"])
    if more == 0:
        return False, "FAILED: no pod served a request after the greedy pod was refused"
    return True, (
        f"proved: {len(pods)} inference pods share one {GPU_MEMORY_MIB // 1024} GiB GPU; each "
        f"server sized its KV cache to its slice (within {TOLERANCE:.0%} of what the slice "
        f"allows after weights and context), the pod asking for more got a clean "
        f"out-of-memory error, and its neighbours kept serving ({more} requests after it)"
    )


def run_inference_demo(
    work: Path, seconds: float, say: Callable[[str], None], runtime: str = "runc"
) -> bool:
    gpu = GpuSpec(memory=GPU_MEMORY_MIB * MIB, context_overhead=CONTEXT_MIB * MIB, numa_node=0)
    pods = servers(seconds)
    node = EmulatedNode(work, [gpu], CONFIG, runtime=runtime)
    say(f"[1/4] simulated node in {work}: one {GPU_MEMORY_MIB} MiB GPU, {SPLIT} slices")
    try:
        node.start()
        say("[2/4] admitting pods, one slice each")
        for p in pods:
            a = p.admitted = node.admit(p.name, 1)
            say(f"      {p.name:<7} {a.memory_limit_mib()} MiB, {a.compute_limit()}% compute")
        say(f"[3/4] each loads its model, sizes its KV cache to "
            f"{UTILIZATION:.0%} of what CUDA shows it, serves until the greedy pod is refused "
            f"and {seconds:g}s more")  # fmt: skip
        for p in pods:
            assert p.admitted is not None
            p.proc = node.start_container(p.admitted, p.args, stdin=not p.greedy)
        for p in pods:
            assert p.proc is not None
            p.first = first_json(p.proc, seconds + 300)
        used = node.node.gpu(0).used_memory
        # The servers serve until told, then `seconds` more: told once the greedy pod was
        # refused (a pod that starts slowly on a loaded host is still refused while they serve).
        for p in pods:
            if p.proc is not None and p.proc.stdin is not None:
                p.proc.stdin.close()
        say(f"      GPU memory in use while they serve: {mib(used)} of {GPU_MEMORY_MIB} MiB")
        for p in pods:
            assert p.proc is not None
            if not p.greedy and "error" not in p.first:
                p.last = first_json(p.proc, seconds + 120)
            p.proc.wait(timeout=seconds + 60)
        say("[4/4] what each pod got")
        for row in table(pods):
            say(row)
        ok, line = judge(pods)
        say(line)
        return ok
    finally:
        node.stop()
