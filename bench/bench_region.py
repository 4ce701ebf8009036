"""Region accounting cost (docs/contracts.md#performance-targets: <= 150 ns per alloc+free, 8 procs
allocating at once <= 2x one process).

    python bench/bench_region.py [--iters 1000000] [--gap-ns 2000] [--repeat 3]

Runs tests/native/region_bench (built with the tests: ``VGPU_NATIVE_DIR`` if it has it, else
tests/native_build.py's release build) and prints, as medians over --repeat runs:
- ns per reserve+commit+release pair, one process in a tight loop;
- 8 processes each doing the same number of pairs at once, in a tight loop (all contention,
  no driver call between): CPU ns per pair and the ratio to one process;
- the same with a busy wait of --gap-ns between reserve and commit standing in for the
  driver's allocation (cuMemAlloc takes ~100 us): CPU ns the region adds per pair (against
  the same loop without the region), 1 and 8 processes, and their ratio.
CPU time is the fair measure where the machine has fewer cores than processes (wall-clock
time then includes time-slicing); the wall-clock figures are printed beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import native_build

    return native_build.tree_with("region_bench")


def _run(tree: Path, procs: int, iters: int, gap: int, baseline: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        args = [str(tree / "tests" / "region_bench"), f"{tmp}/bench.cache"]
        args += ["--procs", str(procs), "--iters", str(iters), "--gap-ns", str(gap)]
        if baseline:
            args.append("--baseline")
        env = dict(os.environ, VGPU_SHIM_LIB=str(tree / "lib" / "libvgpu.so"))
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out)}


def _median(
    tree: Path, repeat: int, procs: int, iters: int, gap: int = 0, baseline: bool = False
) -> dict[str, float]:
    runs = [_run(tree, procs, iters, gap, baseline) for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1_000_000, help="pairs per process, tight")
    ap.add_argument("--gap-ns", type=int, default=2000, help="stand-in driver call, ns")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", type=int, default=8)
    args = ap.parse_args(argv)
    tree = _tree()
    n, rep = args.procs, args.repeat
    print(f"region accounting, {os.cpu_count()} CPUs, libvgpu from {tree}")

    one = _median(tree, rep, 1, args.iters)
    many = _median(tree, rep, n, args.iters // 4)
    print(f"1 process, tight loop:       {one['cpu_ns_per_pair']:7.1f} ns per pair (target 150)")
    print(
        f"{n} processes, tight loop:    {many['cpu_ns_per_pair']:7.1f} CPU ns per pair "
        f"= {many['cpu_ns_per_pair'] / one['cpu_ns_per_pair']:.2f}x one process "
        f"(wall {many['wall_ns_per_pair']:.0f} ns per pair per process)"
    )

    gap_iters = max(1000, args.iters // 20)
    added, total = {}, {}
    for procs in (1, n):
        with_region = _median(tree, rep, procs, gap_iters, args.gap_ns)
        without = _median(tree, rep, procs, gap_iters, args.gap_ns, baseline=True)
        added[procs] = with_region["cpu_ns_per_pair"] - without["cpu_ns_per_pair"]
        total[procs] = with_region["cpu_ns_per_pair"]
        print(
            f"{procs} process(es), {args.gap_ns} ns driver stand-in: region adds "
            f"{added[procs]:6.1f} CPU ns per pair (wall in calls "
            f"{with_region['in_calls_ns_per_pair'] - without['in_calls_ns_per_pair']:.0f} ns)"
        )
    print(
        f"{n} processes vs 1, driver stand-in: whole allocation {total[n] / total[1]:.2f}x "
        f"(target 2), the region's part alone {added[n] / max(added[1], 1e-9):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
