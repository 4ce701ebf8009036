"""A capped pod's share of its GPU, from simgpu's record of whose work ran when.

The plain demo's verdict on a compute cap (sim/demo.py). A cap promises that the pod never
gets more than its limit, and the pacing that enforces it should give the pod its limit while
it has work to run. Both are read in simgpu's clock (``Node.busy``), never from the workload's
wall-clock count: a loaded host that does not run the pod's launcher for a while leaves the GPU
without its work, which no limiter holds back (the workload's count read 20.8 % for a 50 % cap
at load 13 on 2 cores).

The pacing is a token bucket (native/libvgpu/README.md, Compute pacing) that holds at most
40 ms x share: a launcher that pauses gets back, once it runs again, the share of the first
40 ms of its pause, and no more. So in the pod's record, in RESOLUTION_NS steps, every gap
between its work longer than the pacing's own wait (its period, kernel / share, less the
kernel) is a pause of its launcher, and the part of the pause beyond 40 ms is left out of the
time it was *launching*: over the rest, a cap that holds gives it its limit, catch-ups
included. The share over the whole run is kept too: a burst above the cap shows there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vgpu_plugin.sim.simgpu import Node

MS = 1_000_000
RESOLUTION_NS = 5 * MS  # the record's steps: a gap is known to within one
BUCKET_NS = 40 * MS  # the pacing's catch-up, in time at its share (libvgpu README)
TOLERANCE = 5.0  # points: the demo's "on target" band (docs/quickstart.md)
LEAST_LAUNCHING_NS = 500 * MS  # less than this while launching: too little to judge


def timeline(
    node: Node, gpu: int, pid: int, t0: int, t1: int, step: int = RESOLUTION_NS
) -> list[int]:
    """Per ``step`` of [t0, t1) in simgpu's clock, the GPU time ``pid``'s work ran on ``gpu``."""
    return [node.busy(gpu, a, a + step).get(pid, 0) for a in range(t0, t1, step)]


def pause_allowance(limit: int, kernel_ns: int) -> int:
    """How long a gap in the pod's work may be with all of it made up: the pacing's own wait
    between two kernels plus the 40 ms its bucket lets a paused launcher catch up."""
    return max(0, kernel_ns * 100 // max(limit, 1) - kernel_ns) + BUCKET_NS


@dataclass(frozen=True)
class CapShare:
    """What simgpu's record says of one capped pod, in percent of the GPU and seconds."""

    limit: int
    launching: float  # share of the time it was launching (see the module doc)
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


def measure(steps: Sequence[int], step: int, limit: int, kernel_ns: int) -> CapShare:
    """The pod's shares from its timeline (``timeline``) and its kernels' length. Its first and
    last steps with work are partly before and after its run, and are left out."""
    worked = [i for i, ns in enumerate(steps) if ns > 0]
    run = list(steps[worked[0] + 1 : worked[-1]]) if worked else []
    allowance = pause_allowance(limit, kernel_ns)
    paused = 0
    gap = 0
    for ns in [*run, 1]:  # a last step with work closes a gap at the end
        if ns == 0:
            gap += 1
            continue
        if gap:  # n empty steps: the gap was between n and n + 2 steps long
            paused += max(0, (gap + 1) * step - allowance)
        gap = 0
    run_ns = len(run) * step
    launching_ns = max(run_ns - paused, 0)
    return CapShare(
        limit=limit,
        launching=100.0 * sum(run) / launching_ns if launching_ns else 0.0,
        whole=100.0 * sum(run) / run_ns if run_ns else 0.0,
        launching_s=launching_ns / 1e9,
        run_s=run_ns / 1e9,
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
