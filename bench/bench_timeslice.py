"""Compute guarantees on a GPU that time-slices contexts (issue 24, docs/compute.md).

    python bench/bench_timeslice.py [--timeslice 2ms] [--seconds 6]

Runs, on a simulated node with ``SIMGPU_TIMESLICE`` (native/simgpu/README.md), the cases of
tests/libvgpu/test_shim_guarantee.py and prints each container's share of the GPU in
simgpu's clock (``Node.busy``), over the span all of them ran less a second of warm-up and the
last 500 ms; the 25 % container's slowdown beside a busy 75 % one (its share alone over its
share beside, as kernel latency: GPU-Virt-Bench's noisy neighbour); and a container that turns
busy beside busy ones: its share in each 100 ms of
its first second; ``--timeslice 0`` runs them one kernel at a time (simgpu's default). The native
tree is the tests' (``VGPU_NATIVE_DIR`` to measure another build, e.g. an older shim). It
asserts nothing: it prints figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "libvgpu"))

import native_build  # noqa: E402
from test_shim_compute import MS, all_running, launch, shares, shim_on, timeline  # noqa: E402
from test_shim_compute import container as capped  # noqa: E402
from test_shim_guarantee import a50_b25_c25, container, finish_all, run  # noqa: E402
from test_shim_helpers import finish  # noqa: E402


def measure(
    tree: Path, tmp: Path, cases: list[tuple[str, int, int]], idle: int, seconds: int, ts: str
) -> list[float]:
    """Shares of the busy containers (name, guarantee, cap); `idle` more containers of 25 %
    ran a moment first and went idle."""
    shim = shim_on(tree, tmp, 1)
    envs = [container(shim, n, r, cap=c, timeslice=ts) for n, r, c in cases]
    idle_envs = [container(shim, f"idle{i}", 25, timeslice=ts) for i in range(idle)]
    finish_all([run(shim, e, 1) for e in idle_envs])
    t0 = time.monotonic_ns()
    procs = [run(shim, e, seconds) for e in envs]
    finish_all(procs)
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    return shares(shim.node, pids, a + 1000 * MS, b - 500 * MS)


def newcomer(tree: Path, tmp: Path, ts: str) -> list[float]:
    """A 50 % and B 25 % busy, C 25 % turns busy 2 s later: C's share of the GPU in each
    100 ms of simgpu's clock from its first kernel on, for a second."""
    shim = shim_on(tree, tmp, 1)
    envs = a50_b25_c25(shim, ts)
    t0 = time.monotonic_ns()
    busy = [run(shim, e, 5) for e in envs[:2]]
    time.sleep(2.0)
    late = run(shim, envs[2], 2)
    finish_all([late, *busy])
    fine = timeline(shim.node, [late.pid], t0, time.monotonic_ns(), 5 * MS)
    c0 = t0 + next(i for i, s in enumerate(fine) if s[late.pid] > 0) * 5 * MS
    return [
        shares(shim.node, [late.pid], c0 + i * 100 * MS, c0 + (i + 1) * 100 * MS)[0]
        for i in range(10)
    ]


def processes(
    tree: Path, tmp: Path, ts: str, n: int, seconds: int
) -> tuple[list[float], list[float]]:
    """`n` processes of one container capped at 90 %, kernels of 1 and 15 ms in turn (the
    multi-process cap shortfall, docs/compute.md): the container's share of the GPU in each
    second of simgpu's clock from a second after all ran, and the work its launchers saw
    complete in each whole second of theirs after the first (the kernels' durations)."""
    shim = shim_on(tree, tmp, 1)
    env = capped(shim, "c", CUDA_DEVICE_SM_LIMIT="90")
    if ts:
        env["SIMGPU_TIMESLICE"] = ts
    t0 = time.monotonic_ns()
    procs = [launch(shim, env, 0, "kernel", seconds, (1000, 15000)) for _ in range(n)]
    done = [finish(p, timeout=120) for p in procs]
    pids = [p.pid for p in procs]
    a, b = all_running(shim.node, pids, t0, time.monotonic_ns())
    per_second = [
        sum(shares(shim.node, pids, t, t + 1000 * MS))
        for t in range(a + 1000 * MS, b - 1200 * MS, 1000 * MS)
    ]
    work = [sum(r.float(f"window_{w}") for r in done) for w in range(1, seconds)]
    return per_second, work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeslice", default="2ms", help="SIMGPU_TIMESLICE (0: one at a time)")
    ap.add_argument("--seconds", type=int, default=6)
    args = ap.parse_args()
    ts = "" if args.timeslice in ("", "0") else args.timeslice
    tree = native_build.tree_with("shim_launch")
    rows = [
        ("A 25 % (cap 25) beside a busy B 75 %", [("a", 25, 25), ("b", 75, 100)], 0),
        ("all busy: A 50 %, B 25 %, C 25 %", [("a", 50, 100), ("b", 25, 100), ("c", 25, 100)], 0),
        ("two of four idle: A, B 25 % busy", [("a", 25, 100), ("b", 25, 100)], 2),
    ]
    print(f"SIMGPU_TIMESLICE={ts or '0'}; shares of the GPU in simgpu's clock, percent")
    with tempfile.TemporaryDirectory() as tmp:
        (alone,) = measure(tree, Path(tmp), [("a", 25, 25)], 0, args.seconds, ts)
    print(f"A 25 % (cap 25) alone: {alone:.1f}")
    firsts = []  # each row's first container's share: A's beside busy B, the first row
    for title, cases, idle in rows:
        with tempfile.TemporaryDirectory() as tmp:
            got = measure(tree, Path(tmp), cases, idle, args.seconds, ts)
        firsts.append(got[0])
        total = sum(got)
        split = " / ".join(f"{100 * g / total:.1f}" for g in got)
        print(
            f"{title}: "
            + " / ".join(f"{g:.1f}" for g in got)
            + f" (sum {total:.1f}; of it {split})"
        )
    # GPU-Virt-Bench's noisy neighbour as bench/gpu_day.py takes it: its 25 % container
    # launches and syncs each kernel, so its time per kernel is the inverse of its kernel
    # rate; here that rate is its share over the kernels' fixed duration.
    print(
        "noisy neighbour: A's time per kernel beside busy B over alone: "
        f"{100 * (alone / firsts[0] - 1):+.1f} %"
    )
    with tempfile.TemporaryDirectory() as tmp:
        steps = newcomer(tree, Path(tmp), ts)
    print(
        "C 25 % turns busy beside A 50 %, B 25 %: C per 100 ms from its first kernel: "
        + " ".join(f"{s:.1f}" for s in steps)
    )
    for n in (1, 4):
        with tempfile.TemporaryDirectory() as tmp:
            got, work = processes(tree, Path(tmp), ts, n, args.seconds)
        print(
            f"{n} busy process(es) of one 90 % container, 1 and 15 ms kernels: per second "
            + " ".join(f"{g:.1f}" for g in got)
            + "; kernel work completed per second "
            + " ".join(f"{w:.1f}" for w in work)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
