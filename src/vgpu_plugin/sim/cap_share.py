"""A capped pod's share of its GPU, from simgpu's record of whose work ran when.

The plain demo's verdict on a compute cap (sim/demo.py). A cap promises that the pod never
gets more than its limit, and the pacing that enforces it should give the pod its limit while
it has work to run. Both are read in simgpu's clock (``Node.busy``), never from the workload's
wall-clock count: a loaded host that does not run the pod's launcher for a while leaves the GPU
without its work, which no limiter holds back, and the workload's count read 20.8 % for a 50 %
cap at load 13 on 2 cores.

So the record is cut into steps, each long enough that the pacing always runs some of the
pod's work in it (the longest a paced kernel waits is its own period, kernel / share). A step
without any of its work is one in which its launcher launched nothing; it and the steps beside
it (the way into and out of the pause, and the bucket's catch-up after it: 40 ms x share) are
left out of the share *while launching*. The share over the whole run is kept too: a burst
above the cap, in whichever step, shows there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_plugin.sim.simgpu import Node

MS = 1_000_000
MIN_STEP_NS = 50 * MS
TOLERANCE = 5.0  # points: the demo's "on target" band (docs/quickstart.md)
LEAST_LAUNCHING_NS = 500 * MS  # less than this while launching: too little to judge


def step_ns(limit: int, kernel_ns: int) -> int:
    """A step in which a launcher paced to ``limit`` % with ``kernel_ns`` kernels always has
    work on the GPU: twice the pacing's period (kernel / share), at least 50 ms."""
    return max(MIN_STEP_NS, -(-2 * kernel_ns * 100 // max(limit, 1)))


def timeline(node: Node, gpu: int, pid: int, t0: int, t1: int, step: int) -> list[int]:
    """Per ``step`` of [t0, t1) in simgpu's clock, the GPU time ``pid``'s work ran on ``gpu``."""
    return [node.busy(gpu, a, a + step).get(pid, 0) for a in range(t0, t1, step)]


@dataclass(frozen=True)
class CapShare:
    """What simgpu's record says of one capped pod, in percent of the GPU and seconds."""

    limit: int
    launching: float  # share in the steps in which it was launching (see the module doc)
    whole: float  # share over its whole run, first to last step with its work
    launching_s: float
    run_s: float

    @property
    def enough(self) -> bool:
        return self.launching_s * 1e9 >= LEAST_LAUNCHING_NS

    @property
    def above(self) -> bool:
        """More than its cap over the run: the cap was not enforced."""
        return self.whole > self.limit + TOLERANCE

    @property
    def held(self) -> bool:
        return self.enough and not self.above and abs(self.launching - self.limit) <= TOLERANCE


def measure(steps: Sequence[int], step: int, limit: int) -> CapShare:
    """The pod's shares from its timeline (``timeline``). Its first and last steps with work
    are partly before and after its run, and are left out."""
    worked = [i for i, ns in enumerate(steps) if ns > 0]
    run = list(steps[worked[0] + 1 : worked[-1]]) if worked else []
    idle = [ns == 0 for ns in run]
    launching = [ns for i, ns in enumerate(run) if not any(idle[max(0, i - 1) : i + 2])]

    def share(part: Sequence[int]) -> float:
        return 100.0 * sum(part) / (len(part) * step) if part else 0.0

    return CapShare(
        limit=limit,
        launching=share(launching),
        whole=share(run),
        launching_s=len(launching) * step / 1e9,
        run_s=len(run) * step / 1e9,
    )


def describe(r: CapShare) -> str:
    """The verdict's words: what was measured, and whether the cap held."""
    measured = (
        f"its kernels ran {r.launching:.1f}% of the GPU's time in the {r.launching_s:.1f} s it"
        f" was launching them, {r.whole:.1f}% over its whole {r.run_s:.1f} s run (simgpu's"
        " record)"
    )
    if r.above:
        return f"{measured}: OFF its limit, above it: not enforced"
    if not r.enough:
        return (
            f"{measured}: not judged, it launched for less than"
            f" {LEAST_LAUNCHING_NS / 1e9:.1f} s (a very loaded host, or a run too short?)"
        )
    return f"{measured}: {'on target' if r.held else 'OFF its limit'}"
