"""Device plugin figures, 8 simulated GPUs x 32 slices (docs/contracts.md#performance-targets).

Runs the real `vgpu-plugin serve` process on simgpu, drives it with the kubelet emulator over
its real unix socket, and prints: time from start to registered, the ListAndWatch message size,
Allocate and GetPreferredAllocation p50/p99 over N calls each, and the plugin's RSS.

    VGPU_NATIVE_DIR=build/native-release python bench/bench_plugin.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vgpu_plugin.kubelet.backend import list_and_watch_size
from vgpu_plugin.node.install import install_shim
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import GpuSpec, Node

RES = "nvidia.com/gpu"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-plugin-"))
    node = Node.create(work / "simgpu", [GpuSpec(numa_node=i // 4) for i in range(8)])
    install_shim(work / "host")
    (work / "config.yaml").write_text("version: v1\nsharing: {splitCount: 32}\n")
    plugin_dir = short_tmp_dir()
    kubelet = KubeletEmulator(plugin_dir)
    kubelet.start()
    cmd = [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(work / "config.yaml"),
           "--device-plugin-dir", str(plugin_dir), "--host-root", str(work / "host"),
           "--state-dir", str(work / "state"), "--lock-dir", str(work / "locks"),
           "--metrics-address", "127.0.0.1:0", "--log-level", "warning"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=node.env())
    try:
        kubelet.wait_registrations(1, timeout=60)
        t_registered = time.perf_counter() - t0
        devices = kubelet.wait_devices(RES, lambda d: len(d) == 256, timeout=30)
        ids = [d.ID for d in devices]
        rng = random.Random(7)
        pref: list[float] = []
        for _ in range(args.calls):
            available = rng.sample(ids, 128)
            t = time.perf_counter()
            kubelet.get_preferred_allocation(RES, available, size=rng.choice([1, 2, 4]))
            pref.append((time.perf_counter() - t) * 1e3)
        alloc: list[float] = []
        for _ in range(args.calls):
            chosen = rng.sample(ids, rng.choice([1, 2, 3]))
            t = time.perf_counter()
            kubelet.allocate(RES, chosen)
            alloc.append((time.perf_counter() - t) * 1e3)
        print(f"node: 8 simulated GPUs x 32 slices = {len(ids)} devices")
        print(f"start to registered: {t_registered * 1e3:.0f} ms")
        print(f"ListAndWatch message: {list_and_watch_size(devices)} bytes (limit 4194304)")
        for name, xs in (("GetPreferredAllocation", pref), ("Allocate", alloc)):
            print(f"{name}: p50 {statistics.median(xs):.2f} ms, p99 {pct(xs, 99):.2f} ms "
                  f"over {len(xs)} calls (target p99 <= 5 ms)")  # fmt: skip
        print(f"plugin RSS after {2 * args.calls} calls: {rss_mib(proc.pid):.1f} MiB "
              "(target <= 80 MB)")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(10)
        kubelet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
