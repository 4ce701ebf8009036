"""Device plugin figures, 8 simulated GPUs x 32 slices (docs/contracts.md#performance-targets).

Runs the real `vgpu-plugin serve` process on simgpu, drives it with the kubelet emulator over
its real unix socket, and prints: time from start to registered, the ListAndWatch message size,
GetPreferredAllocation and Allocate p50/p99 over N calls each with ``--records`` allocation
records already on file (one caller, as the kubelet calls), Allocate again while two scrapers
read the metrics endpoint in a loop, then with 8 callers at once (and the scrapers), one
Allocate of 1,000 container requests, and the plugin's RSS at start and at the end.
``--gzip``: the scrapers ask for gzip, as Prometheus does. The scrapers are processes of their
own (``--scrapers-in-process``: threads of this one, as the figures before 2026-11-24, late,
were taken).

    VGPU_NATIVE_DIR=build/native-release python bench/bench_plugin.py [--calls 1000] \
        [--records 2000]
    python bench/bench_plugin.py --deferred-sync   # Allocate's sync lag, in process

The records on file are seeded as an ``allocations.msgpack`` (the format before the journal),
which every version reads: the current one imports it at start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgpack

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.kubelet.backend import list_and_watch_size
from vgpu_plugin.node.host.install import install_shim
from vgpu_plugin.node.ledger.state import AllocationRecord
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used (all its threads; not its forked children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def seed_records(state_dir: Path, n: int, device_ids: list[str]) -> None:
    """``n`` records as the plugin before the journal wrote them (``allocations.msgpack``)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(3)
    records = []
    for i in range(n):
        devices = tuple(rng.sample(device_ids, rng.choice([1, 2])))
        uuid = devices[0].rsplit("-", 1)[0]
        r = AllocationRecord(
            f"seed-{i:06d}", devices, RES, time.time() - n + i,
            (GpuLimit(uuid, 1024 * MIB, 0),), pod=f"pod-{i}", namespace="bench", container="main",
        )  # fmt: skip
        records.append(r.to_wire())
    payload = {"format": "vgpu-plugin/allocations", "version": 1, "records": records}
    (state_dir / "allocations.msgpack").write_bytes(msgpack.packb(payload, use_bin_type=True))


def report(name: str, xs: list[float], target: str = " (target p99 <= 5 ms)") -> None:
    print(f"{name}: p50 {statistics.median(xs):.2f} ms, p99 {pct(xs, 99):.2f} ms "
          f"over {len(xs)} calls{target}")  # fmt: skip


# One scraper: reads the endpoint back to back until its stdin closes, then prints the times.
_SCRAPER = """
import json, sys, threading, time, urllib.request
url, headers = sys.argv[1], json.loads(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
times = []
while not stop.is_set():
    t = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        r.read()
    times.append((time.perf_counter() - t) * 1e3)
print(json.dumps(times))
"""


class Scrapers:
    """Processes reading the metrics endpoint back to back, as Prometheus replicas would: each
    its own process (as Prometheus is), so their reading never holds the GIL of the process
    that times Allocate (``--scrapers-in-process``: threads here, as before 2026-11-24)."""

    def __init__(self, url: str, n: int, gzip: bool = False, in_process: bool = False) -> None:
        self.url = url
        # Prometheus asks for gzip; a plain client (curl, urllib) does not.
        self.headers = {"Accept-Encoding": "gzip"} if gzip else {}
        self.times: list[float] = []
        self._n = n
        self._in_process = in_process
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        self._procs: list[subprocess.Popen[bytes]] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            request = urllib.request.Request(self.url, headers=self.headers)
            with urllib.request.urlopen(request, timeout=30) as r:
                r.read()
            self.times.append((time.perf_counter() - t) * 1e3)

    def __enter__(self) -> Scrapers:
        if self._in_process:
            for t in self._threads:
                t.start()
            return self
        argv = [sys.executable, "-c", _SCRAPER, self.url, json.dumps(self.headers)]
        self._procs = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for _ in range(self._n)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(30)
        for p in self._procs:
            out, _ = p.communicate(timeout=60)  # closes its stdin: it stops and reports
            self.times += json.loads(out)


def timed_calls(n: int, call: Callable[[], object]) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def deferred_sync_lag(calls: int, batch: int) -> None:
    """In process (no gRPC): ``calls`` Allocates back to back through the backend with serve's
    deferred sync, then one of ``batch`` containers; prints how long a write stayed
    acknowledged but not yet durable (the longest seen)."""
    from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
    from vgpu_plugin.core.config import parse_config
    from vgpu_plugin.core.devices import PhysicalGpu
    from vgpu_plugin.kubelet.plugin import VgpuBackend
    from vgpu_plugin.node.host.atomicfile import DeferredSync
    from vgpu_plugin.node.ledger.state import AllocationStore

    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    gpus = [
        PhysicalGpu(i, f"GPU-{i:08x}-0000-0000-0000-000000000000", "H100", 81559 * MIB, i,
                    f"0000:{i:02x}:00.0", i // 4)
        for i in range(8)
    ]  # fmt: skip
    config = parse_config(f"version: v1\nsharing: {{splitCount: 32}}\nhostRoot: {work}/host\n")
    store = AllocationStore(work / "state")
    syncer = DeferredSync()
    syncer.register(store.flush)
    syncer.start()
    backend = VgpuBackend(
        gpus, config, "node-1", {}, store, "0.1.0", str(work / "locks"),
        cdi_spec_dir=str(work / "cdi"), syncer=syncer,
    )  # fmt: skip
    ids = [s.id for s in backend.plan.all_slices()]
    rng = random.Random(1)

    def request(n: int, size: int) -> pb.AllocateRequest:
        return pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=rng.sample(ids, size)) for _ in range(n)
            ]
        )

    times = timed_calls(calls, lambda: backend.allocate(request(1, 2)))
    syncer.wait(60)
    report("Allocate in process (no gRPC)", times)
    print(f"deferred sync: {syncer.passes} passes for {calls} Allocates, longest acknowledged "
          f"to durable {syncer.max_lag * 1e3:.1f} ms, {syncer.errors} errors")  # fmt: skip
    syncer.max_lag = 0.0
    t = time.perf_counter()
    backend.allocate(request(batch, 1))
    answered = time.perf_counter() - t
    syncer.wait(600)
    print(f"one Allocate of {batch} containers: answered in {answered:.2f} s, durable "
          f"{syncer.max_lag:.2f} s after")  # fmt: skip
    syncer.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--records", type=int, default=2000, help="records on file at start")
    ap.add_argument("--scrapers", type=int, default=2)
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--gzip", action="store_true", help="scrape with Accept-Encoding: gzip")
    ap.add_argument("--batch", type=int, default=1000, help="container requests in one Allocate")
    ap.add_argument(
        "--scrapers-in-process",
        action="store_true",
        help="scrape from threads of this process (shares its GIL with the timed calls)",
    )
    ap.add_argument(
        "--deferred-sync",
        action="store_true",
        help="only measure, in process, how long Allocate's writes wait for their sync",
    )
    args = ap.parse_args()
    if args.deferred_sync:
        deferred_sync_lag(args.calls, args.batch)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-plugin-"))
    gpus = [GpuSpec(numa_node=i // 4) for i in range(8)]
    node = Node.create(work / "simgpu", gpus)
    install_shim(work / "host")
    (work / "config.yaml").write_text("version: v1\nsharing: {splitCount: 32}\n")
    plugin_dir = short_tmp_dir()
    kubelet = KubeletEmulator(plugin_dir, call_timeout=600)
    kubelet.start()
    port = free_port()
    cmd = [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(work / "config.yaml"),
           "--device-plugin-dir", str(plugin_dir), "--host-root", str(work / "host"),
           "--state-dir", str(work / "state"), "--lock-dir", str(work / "locks"),
           "--metrics-address", f"127.0.0.1:{port}", "--log-level", "warning"]  # fmt: skip
    proc: subprocess.Popen[bytes] | None = None
    try:
        if args.records:
            # The device IDs are known only once the plugin advertises them: start it once.
            proc = subprocess.Popen(cmd, env=node.env())
            ids = [d.ID for d in kubelet.wait_devices(RES, lambda d: len(d) == 256, timeout=60)]
            proc.terminate()
            proc.wait(10)
            kubelet.stop()
            kubelet = KubeletEmulator(plugin_dir, call_timeout=600)
            kubelet.start()
            seed_records(work / "state", args.records, ids)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=node.env())
        kubelet.wait_registrations(1, timeout=120)
        t_registered = time.perf_counter() - t0
        devices = kubelet.wait_devices(RES, lambda d: len(d) == 256, timeout=30)
        ids = [d.ID for d in devices]
        rss_start = rss_mib(proc.pid)
        rng = random.Random(7)
        url = f"http://127.0.0.1:{port}/metrics"
        pref = timed_calls(
            args.calls,
            lambda: kubelet.get_preferred_allocation(
                RES, rng.sample(ids, 128), size=rng.choice([1, 2, 4])
            ),
        )

        def one() -> object:
            return kubelet.allocate(RES, rng.sample(ids, rng.choice([1, 2, 3])))

        alloc = timed_calls(args.calls, one)
        phases = [("start", rss_start), ("after one caller", rss_mib(proc.pid))]
        cpu0 = cpu_seconds(proc.pid)
        with Scrapers(url, args.scrapers, args.gzip, args.scrapers_in_process) as scrapers:
            scraped = timed_calls(args.calls, one)
            # The floor under the same scrapers: an RPC that does nothing (no disk, no lock).
            floor = timed_calls(args.calls, lambda: kubelet.get_device_plugin_options(RES))
        scrape_cpu = cpu_seconds(proc.pid) - cpu0
        scrape_times = list(scrapers.times)
        phases.append(("after the scraped run", rss_mib(proc.pid)))
        per_caller = max(1, args.calls // args.callers)
        concurrent: list[float] = []
        with Scrapers(url, args.scrapers, args.gzip, args.scrapers_in_process):
            threads = [
                threading.Thread(target=lambda: concurrent.extend(timed_calls(per_caller, one)))
                for _ in range(args.callers)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        phases.append(("after 8 callers", rss_mib(proc.pid)))
        t_start = time.perf_counter()
        kubelet.allocate(RES, *[[rng.choice(ids)] for _ in range(args.batch)])
        t_batch = time.perf_counter() - t_start
        rss_end = rss_mib(proc.pid)
        phases.append(("after the batch", rss_end))
        total = args.records + 3 * args.calls + per_caller * args.callers + args.batch
        print(f"node: 8 simulated GPUs x 32 slices = {len(ids)} devices; "
              f"{args.records} records on file at start")  # fmt: skip
        print(f"start to registered: {t_registered * 1e3:.0f} ms")
        print(f"ListAndWatch message: {list_and_watch_size(devices)} bytes (limit 4194304)")
        report("GetPreferredAllocation", pref)
        report("Allocate, one caller", alloc)
        report(f"Allocate, one caller, {args.scrapers} scrapers", scraped)
        report(f"GetDevicePluginOptions, one caller, {args.scrapers} scrapers", floor, "")
        report(f"Allocate, {args.callers} callers, {args.scrapers} scrapers", concurrent)
        if scrape_times:
            report("metrics scrape (during the one-caller runs)", scrape_times, "")
            print(f"plugin CPU during the scraped one-caller runs: {scrape_cpu:.2f} s for "
                  f"{len(scrape_times)} scrapes and {2 * args.calls} calls")  # fmt: skip
        print(f"one Allocate of {args.batch} container requests: {t_batch:.2f} s (target < 5 s)")
        print(f"plugin RSS: {rss_start:.1f} MiB at start, {rss_end:.1f} MiB with {total} "
              "records (target <= 80 MB, flat)")  # fmt: skip
        print("plugin RSS by phase: " + ", ".join(f"{n} {v:.1f}" for n, v in phases) + " MiB")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        kubelet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
