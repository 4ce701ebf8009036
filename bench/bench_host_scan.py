"""Does the host's scan slow the tenants down? Their allocation-loop rate with and without the
host snapshotting every region every 100 ms (the node agent's period). Target: no measurable
slowdown.

    python bench/bench_host_scan.py [--regions 4] [--procs 2] [--seconds 2] [--period-ms 100]
                                    [--gap-ns 0] [--repeat 5]

Each region stands for a container: tests/native/region_bench runs --procs processes on it,
each doing reserve+commit+release pairs in a tight loop (--gap-ns 0, the host's worst case: the
region is never quiet, so snapshots often take the published copy, which a tenant makes inside
its critical section). Runs alternate without and with a scanner thread that reads every region
through vgpu_plugin.node.observe.region.read_region (as the node agent does) every --period-ms.
Prints the median wall-clock and CPU ns per pair of each, the ratio of the tenants' rates
(with / without: 1.00 is no slowdown) per CPU second and wall-clock, and the scanner's own figures.
Asserts nothing.

Uses ``VGPU_NATIVE_DIR`` if it has the test programs, else tests/native_build.py's release build.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import native_build

    return native_build.tree_with("region_bench")


@dataclass
class Scan:
    """The scanner's figures for one run."""

    snapshots: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per snapshot
    cpu_s: float = 0.0  # the scanner thread's CPU time
    wall_s: float = 0.0


def _scan(paths: list[Path], period_s: float, stop: threading.Event, scan: Scan) -> None:
    from vgpu_plugin.node.observe.region import RegionError, read_region

    cpu0, wall0 = time.thread_time(), time.monotonic()
    while not stop.wait(period_s):
        for path in paths:
            if not path.exists():
                continue  # its bench has not created it yet
            t0 = time.perf_counter()
            try:
                read_region(path)
                scan.snapshots += 1
            except RegionError as e:
                scan.failures.append(e.reason)
            scan.seconds.append(time.perf_counter() - t0)
    scan.cpu_s, scan.wall_s = time.thread_time() - cpu0, time.monotonic() - wall0


def _run(
    tree: Path, regions: int, procs: int, iters: int, gap: int, period_s: float | None
) -> tuple[dict[str, float], Scan]:
    """One run of `regions` region_bench instances at once; the mean figures per process."""
    scan = Scan()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"c{i}.cache" for i in range(regions)]
        env = dict(os.environ, VGPU_SHIM_LIB=str(tree / "lib" / "libvgpu.so"))
        args = ["--procs", str(procs), "--iters", str(iters), "--gap-ns", str(gap)]
        benches = [
            subprocess.Popen(
                [str(tree / "tests" / "region_bench"), str(p), *args],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for p in paths
        ]
        stop = threading.Event()
        scanner = None
        if period_s is not None:
            scanner = threading.Thread(target=_scan, args=(paths, period_s, stop, scan))
            scanner.start()
        outs = [b.communicate()[0] for b in benches]
        stop.set()
        if scanner is not None:
            scanner.join()
    if any(b.returncode != 0 for b in benches):
        raise RuntimeError(f"region_bench failed: {outs}")
    figures = [{k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out)} for out in outs]
    return {k: statistics.fmean(f[k] for f in figures) for k in figures[0]}, scan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--regions", type=int, default=4, help="containers, one region each")
    ap.add_argument("--procs", type=int, default=2, help="allocating processes per region")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of one run, about")
    ap.add_argument("--period-ms", type=float, default=100.0, help="the host's scan period")
    ap.add_argument("--gap-ns", type=int, default=0, help="driver stand-in between calls")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each kind, alternated")
    args = ap.parse_args(argv)
    tree = _tree()
    print(
        f"host scan vs tenants: {args.regions} regions x {args.procs} processes, "
        f"{os.cpu_count()} CPUs, scan every {args.period_ms:g} ms, libvgpu from {tree}"
    )
    probe, _ = _run(tree, args.regions, args.procs, 200_000, args.gap_ns, None)
    iters = max(10_000, int(args.seconds * 1e9 / max(probe["wall_ns_per_pair"], 1.0)))

    without: list[dict[str, float]] = []
    with_scan: list[dict[str, float]] = []
    scans: list[Scan] = []
    period_s = 1e-3 * args.period_ms
    for _ in range(args.repeat):
        without.append(_run(tree, args.regions, args.procs, iters, args.gap_ns, None)[0])
        figures, scan = _run(tree, args.regions, args.procs, iters, args.gap_ns, period_s)
        with_scan.append(figures)
        scans.append(scan)

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(f"medians (and ranges) of {args.repeat} runs of each, {iters} pairs per process:")
    for name, runs in (("without scan", without), ("with scan", with_scan)):
        cpu = [r["cpu_ns_per_pair"] for r in runs]
        wall = [r["wall_ns_per_pair"] for r in runs]
        print(
            f"{name:13s} {med(runs, 'cpu_ns_per_pair'):6.1f} CPU ns per pair "
            f"({min(cpu):.1f}..{max(cpu):.1f}), {med(runs, 'wall_ns_per_pair'):6.1f} wall ns "
            f"per pair per process ({min(wall):.0f}..{max(wall):.0f})"
        )
    # CPU time is the fair measure where the processes outnumber the CPUs: wall-clock time
    # then mostly measures time-slicing (bench_region.py says the same).
    cpu_ratio = med(without, "cpu_ns_per_pair") / med(with_scan, "cpu_ns_per_pair")
    wall_ratio = med(without, "wall_ns_per_pair") / med(with_scan, "wall_ns_per_pair")
    print(
        f"tenants' allocation rate, with scan / without: {cpu_ratio:.3f} per CPU second, "
        f"{wall_ratio:.3f} wall-clock (1.000: no slowdown)"
    )
    took = sorted(s for scan in scans for s in scan.seconds)
    failures = [f for scan in scans for f in scan.failures]
    if took:
        print(
            f"scanner: {len(took)} snapshots, {len(failures)} failed, "
            f"{1e6 * statistics.median(took):.0f} us median, {1e6 * took[-1]:.0f} us max each, "
            f"{100 * sum(s.cpu_s for s in scans) / sum(s.wall_s for s in scans):.2f}% of a CPU"
        )
    for reason in sorted(set(failures))[:3]:
        print(f"  failed: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
