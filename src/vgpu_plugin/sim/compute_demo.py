"""``vgpu-plugin demo --compute``: a guaranteed pod keeps its share next to a noisy one, and
its idle time is lent (sharing.compute: guaranteed, docs/compute.md).

One simulated 16 GiB GPU split four ways under ``compute: guaranteed``, the real plugin, two
pods of two slices each (a guarantee of 50 %, no cap): ``steady`` runs kernels with one
process, ``noisy`` with three. Time-slicing would give each of the four processes a quarter
of the GPU, so steady 25 %; the guarantee holds it at 50 %. Then steady stops and noisy,
alone, gets the GPU (a cap of 50 % would waste the other half).

Every share is measured in simgpu's own clock, from the simulated GPU's record of whose work
ran when (``Node.busy``), never by the workloads' wall-clock windows: a loaded host delays
when work runs, not how the GPU's time was split. Which pid is whose needs no pid mapping
(the containers' pids are the node's, seen through their namespaces): steady's process is
the one whose work ends first, noisy's keep running after it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.sim.demo import CONTEXT_MIB, GPU_MEMORY_MIB, first_json
from vgpu_plugin.sim.node import MIB, WORKLOAD, Admitted, EmulatedNode
from vgpu_plugin.sim.simgpu import GpuSpec, Node

SPLIT = 4
CONFIG = f"version: v1\nsharing:\n  splitCount: {SPLIT}\n  compute: guaranteed\n"
NOISY_PROCESSES = 3
LEND_SECONDS = 1.5  # noisy alone, after steady stopped (at least: a sleep is never shorter)
STEP_NS = 20_000_000  # the timeline's resolution in simgpu's clock
SETTLE_NS = 500_000_000  # from when all run: the first kernels' estimates are settled
MARGIN_NS = 100_000_000  # around steady's end: the others see it idle one window (40 ms) later
TOLERANCE = 5.0  # points: the demo's "on target" band, as for caps (quickstart.md)
LENT_AT_LEAST = 75.0  # percent of the GPU noisy must get alone: well above its 50 % share
PROVES = (
    "proved: a pod's guarantee holds while a noisier pod (more processes) is busy, and the"
    " time it leaves idle goes to the busy pod instead of being wasted"
)


@dataclass(frozen=True)
class ComputeShares:
    """What the GPU's record says, in percent."""

    guarantee: int  # steady's (and noisy's), percent
    steady: float  # steady's share of the GPU's busy time while both ran
    noisy: float  # noisy's (the rest)
    lent: float  # noisy's share of the GPU's time while steady was idle
    contention_s: float  # how long each window was, in simgpu's clock
    lending_s: float

    @property
    def held(self) -> bool:
        return abs(self.steady - self.guarantee) <= TOLERANCE and self.lent >= LENT_AT_LEAST


def timeline(node: Node, t0: int, t1: int, gpu: int = 0) -> list[dict[int, int]]:
    """Per STEP_NS step of [t0, t1] (simgpu's clock), each pid's GPU time."""
    return [node.busy(gpu, a, min(a + STEP_NS, t1)) for a in range(t0, t1, STEP_NS)]


def measure(steps: Sequence[dict[int, int]], t0: int, guarantee: int) -> ComputeShares:
    """The shares from a timeline: steady's pid is the one whose work ends first."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        for pid, ns in step.items():
            if ns > 0:
                first.setdefault(pid, i)
                last[pid] = i
    if len(last) < 2:
        raise RuntimeError(f"the GPU ran the work of {len(last)} process(es), not both pods'")
    steady = min(last, key=lambda p: last[p])
    noisy = [p for p in last if p != steady]
    at = [t0 + i * STEP_NS for i in range(len(steps) + 1)]
    a, b = at[max(first.values())] + SETTLE_NS, at[last[steady] + 1] - MARGIN_NS
    c, d = at[last[steady] + 1] + MARGIN_NS, at[min(last[p] for p in noisy)] - MARGIN_NS
    if b - a < 500_000_000 or d - c < 500_000_000:
        raise RuntimeError(
            f"too short to measure: both ran {(b - a) / 1e9:.2f} s, noisy alone"
            f" {(d - c) / 1e9:.2f} s of the GPU's clock (a very loaded host?)"
        )

    def busy(pids: Sequence[int], lo: int, hi: int) -> int:
        total = 0
        for i, step in enumerate(steps):
            s, e = at[i], at[i + 1]
            if s >= lo and e <= hi:
                total += sum(step.get(p, 0) for p in pids)
        return total

    def span(lo: int, hi: int) -> int:  # the whole steps inside [lo, hi]
        return sum(at[i + 1] - at[i] for i in range(len(steps)) if at[i] >= lo and at[i + 1] <= hi)

    s_busy, n_busy = busy([steady], a, b), busy(noisy, a, b)
    both = max(s_busy + n_busy, 1)
    return ComputeShares(
        guarantee=guarantee,
        steady=100.0 * s_busy / both,
        noisy=100.0 * n_busy / both,
        lent=100.0 * busy(noisy, c, d) / max(span(c, d), 1),
        contention_s=span(a, b) / 1e9,
        lending_s=span(c, d) / 1e9,
    )


def report(r: ComputeShares) -> list[str]:
    judged = "on target" if abs(r.steady - r.guarantee) <= TOLERANCE else "OFF its guarantee"
    lent = "lent" if r.lent >= LENT_AT_LEAST else "NOT lent"
    return [
        f"  both busy ({r.contention_s:.1f} s of the GPU's clock): steady got {r.steady:.1f}% of"
        f" the GPU's busy time, its guarantee {r.guarantee}%: {judged}; noisy"
        f" ({NOISY_PROCESSES} processes) {r.noisy:.1f}% (time-slicing would give steady"
        f" {100 / (NOISY_PROCESSES + 1):.0f}%)",
        f"  steady idle ({r.lending_s:.1f} s): noisy ran {r.lent:.1f}% of the GPU, above its"
        f" own {100 - r.guarantee}%: steady's idle time {lent} (a cap would hold it at"
        f" {100 - r.guarantee}%)",
        PROVES if r.held else "NOT " + PROVES,
    ]


def _stderr(proc: subprocess.Popen[str]) -> str:
    err = proc.stderr.read() if proc.stderr else ""
    return f"exit {proc.returncode}: {err.strip()[-500:]}"


def wait_running(
    node: Node, t0: int, procs: Sequence[subprocess.Popen[str]], count: int, timeout: float = 120
) -> None:
    """Until ``count`` processes have run work on GPU 0 since ``t0`` (simgpu's record)."""
    deadline = time.monotonic() + timeout
    while sum(1 for ns in node.busy(0, t0, time.monotonic_ns()).values() if ns > 0) < count:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a container stopped before it ran: {_stderr(p)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} processes did not all start in {timeout:.0f} s")
        time.sleep(0.05)


def _guarantee(a: Admitted) -> int:
    return int(a.envs.get("CUDA_DEVICE_SM_REQUEST_0", "0"))


def run_compute_demo(
    work: Path, seconds: float, say: Callable[[str], None], runtime: str = "runc"
) -> ComputeShares:
    gpus = [GpuSpec(memory=GPU_MEMORY_MIB * MIB, context_overhead=CONTEXT_MIB * MIB)]
    node = EmulatedNode(work, gpus, CONFIG, runtime=runtime)
    say(f"[1/4] simulated node in {work}, sharing.compute: guaranteed")
    g = node.node.gpus()[0]
    say(f"      GPU {g.index}: {g.name}, {g.uuid}, split {SPLIT} ways")
    procs: list[subprocess.Popen[str]] = []
    try:
        node.start()
        say("[2/4] admitting two pods of 2 slices each")
        steady, noisy = node.admit("steady", 2), node.admit("noisy", 2)
        for a in (steady, noisy):
            say(f"      {a.pod:<6} guaranteed {_guarantee(a)}% of the GPU while others are"
                f" busy, capped at {a.compute_limit()}%")  # fmt: skip
        kernels = [*WORKLOAD, "compute", "--kernel-ms", "10", "--seconds"]
        say(f"[3/4] noisy runs kernels with {NOISY_PROCESSES} processes; steady with one for"
            f" {seconds:g}s, then stops")  # fmt: skip
        t0 = time.monotonic_ns()
        # noisy runs until it is stopped; steady for `seconds` of its own.
        for _ in range(NOISY_PROCESSES):
            procs.append(node.start_container(noisy, [*kernels, str(seconds + 120)]))
        # Containers start one after another (runc: a second each on a loaded host): steady
        # starts once all of noisy's processes run work, as simgpu's record shows.
        wait_running(node.node, t0, procs, NOISY_PROCESSES)
        mine = node.start_container(steady, [*kernels, str(seconds)])
        result = first_json(mine, seconds + 120)
        if "error" in result:
            raise RuntimeError(f"steady: {result['error']}")
        mine.wait(timeout=60)
        time.sleep(LEND_SECONDS)  # noisy alone: steady's guarantee is lent
        stopped = [p for p in procs if p.poll() is not None]
        if stopped:
            raise RuntimeError(f"noisy stopped early: {_stderr(stopped[0])}")
        for name in noisy.containers:
            node.runtime.kill(name)
        for p in procs:
            p.wait(timeout=60)
        t1 = time.monotonic_ns()
        say("[4/4] the GPU's time, from simgpu's record of whose work ran when")
        shares = measure(timeline(node.node, t0, t1), t0, _guarantee(steady))
        for line in report(shares):
            say(line)
        return shares
    finally:
        node.stop()
