"""Node scan and metrics scrape time on a full node: 64 allocations x 8 live processes; and
the look for processes without the shim that serve takes every 10 s (``escapes.py``).

    python bench/bench_nodeview.py [--allocations 64] [--processes 8] [--rounds 200]

Real region files, each mapped by 8 real processes holding their slots (as a container's
processes do), read through the shim's own snapshot code, when the native build is there
(``VGPU_NATIVE_DIR``, else ``build/native-release``, else the installed package); synthetic
snapshots otherwise. The output says which. Target: both <= 50 ms.

The escape check is timed as serve's watch runs it, less NVML's list (given here: each
live holder process listed on its own allocation's GPU): every listed pid's mountinfo read
and parsed against the limits files' keys (attributed as its allocation, since the holders
are in no container), its identity read from /proc, and each such allocation's region read
for its slots (each holder is found in its slot: nothing is reported).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
TARGET_MS = 50.0
GPUS = [f"GPU-{i:08x}-0000-0000-0000-{i:012x}" for i in range(8)]

# One process of every container: attaches to each region (one slot per region), charges
# memory, and holds its slots until stdin closes.
_HOLDER = r"""
import sys
from cffi import FFI
from vgpu_plugin.node.host import native
ffi = FFI()
ffi.cdef(native.cdef_source(native.include_dir() / "vgpu" / "region.h"))
lib = ffi.dlopen(str(native.shim_library()))
err = ffi.new("char[]", 320)
keep = []
for line in sys.argv[1:]:
    path, uuid, limit, charge = line.split(",")
    limits = ffi.new("struct vgpu_limits *")
    limits.count = 1
    limits.devices[0].uuid = uuid.encode()
    limits.devices[0].memory_limit = int(limit)
    r = ffi.new("struct vgpu_region **")
    if lib.vgpu_region_open(path.encode(), limits, r, err, 320) != 0:
        sys.exit(ffi.string(err).decode())
    if lib.vgpu_region_reserve(r[0], 0, int(charge)) == 0:
        lib.vgpu_region_commit(r[0], 0, int(charge))
    keep.append(r)
print("ready", flush=True)
sys.stdin.read()
"""


def _pick_native() -> None:
    if "VGPU_NATIVE_DIR" in os.environ:
        return
    build = ROOT / "build" / "native-release"
    if (build / "lib" / "libvgpu.so").exists():
        os.environ["VGPU_NATIVE_DIR"] = str(build)


@dataclass(frozen=True)
class Dev:
    uuid: str
    used: int
    refused: int = 0
    fallbacks: int = 0
    peak: int = 0
    gpu_ns: int = 0
    driver_limit: int = 0
    driver_limit_state: int = 0


@dataclass(frozen=True)
class Proc:
    alive: bool
    used: tuple[int, ...]
    pid: int = 0
    start_time: int = 0


@dataclass(frozen=True)
class Snap:
    devices: tuple[Dev, ...]
    processes: tuple[Proc, ...]


def _times(fn: Callable[[], object], rounds: int) -> list[float]:
    fn()  # warm: imports, first dlopen, page cache
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _line(what: str, ms: list[float]) -> str:
    ms = sorted(ms)
    p50 = statistics.median(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    verdict = "ok" if p99 <= TARGET_MS else "OVER TARGET"
    return (
        f"{what:<34} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  "
        f"(target <= {TARGET_MS:.0f} ms, p99/target {p99 / TARGET_MS:.2f}: {verdict})"
    )


def _escape_check(
    root: Path,
    specs: list[tuple[Path, str]],
    holders: list[subprocess.Popen[str]],
    read_region: object,
    rounds: int,
) -> list[float]:
    from vgpu_plugin.node.observe.escapes import EscapeWatch, mount_attribution
    from vgpu_plugin.node.observe.nodeview import ReadRegion, region_slots

    ids = [path.parent.name for path, _ in specs]
    allocations = {a: {uuid} for a, (_, uuid) in zip(ids, specs, strict=True)}
    of_pid = {h.pid: ids[k] for k, h in enumerate(holders)}
    listed = {uuid: [(h.pid, MIB) for k, h in enumerate(holders) if specs[k][1] == uuid]
              for uuid in GPUS}  # fmt: skip

    def owner_of(limits: Path, allocs: object) -> Callable[[int], str | None]:
        real = mount_attribution(limits, ids)

        def owner(pid: int) -> str | None:
            real(pid)  # the read and parse a container's pid costs; none of ours is in one
            return of_pid.get(pid)

        return owner

    reader: ReadRegion = read_region  # type: ignore[assignment]
    watch = EscapeWatch(root, lambda: listed, region_slots(root, reader), owner_of=owner_of)
    names = {a: a for a in ids}
    if watch(allocations, names):
        raise RuntimeError("a holder was taken for a process without the shim")
    return _times(lambda: watch(allocations, names), rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocations", type=int, default=64)
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    _pick_native()

    from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore, GpuLimit
    from vgpu_plugin.node.observe import metrics
    from vgpu_plugin.node.observe.nodeview import GpuFacts, ReadRegion, region_path, view_provider

    tmp = Path(tempfile.mkdtemp(prefix="bench-nodeview-"))
    root, store = tmp / "host", AllocationStore(tmp / "state")
    n, procs = args.allocations, args.processes
    specs = []
    for i in range(n):
        uuid = GPUS[i % len(GPUS)]
        alloc_id = f"alloc-{i:03d}"
        store.add(
            AllocationRecord(
                alloc_id,
                (f"{uuid}-{i // len(GPUS)}",),
                "nvidia.com/gpu",
                float(i),
                (GpuLimit(uuid, 8192 * MIB, 12),),
                namespace="bench",
                pod=f"pod-{i}",
                container="main",
            )
        )
        path = region_path(root, alloc_id)
        path.parent.mkdir(parents=True)
        specs.append((path, uuid))

    holders: list[subprocess.Popen[str]] = []
    read_region: ReadRegion
    try:
        from vgpu_plugin.node.observe import region

        region.read_region  # noqa: B018 - fails here when the module is not there
        for path, uuid in specs:
            region.create_region(path, [GpuLimit(uuid, 8192 * MIB, 12)])
        argv = [f"{p},{u},{8192 * MIB},{(k + 1) * MIB}" for k, (p, u) in enumerate(specs)]
        for _ in range(procs):
            h = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            holders.append(h)
        for h in holders:
            assert h.stdout is not None
            if h.stdout.readline().strip() != "ready":
                raise RuntimeError("a region holder failed to start")
        read_region = region.read_region
        where = os.environ.get("VGPU_NATIVE_DIR", "the installed package")
        mode = f"real regions ({procs} live processes hold a slot in each), native: {where}"
    except Exception as exc:  # no native build or no region module: measure the rest
        for h in holders:
            h.kill()
        holders = []
        snaps = {
            path: Snap(
                (Dev(uuid, procs * MIB),),
                tuple(Proc(True, (MIB,)) for _ in range(procs)),
            )
            for path, uuid in specs
        }
        for path in snaps:
            path.write_bytes(b"synthetic")
        read_region = snaps.__getitem__
        mode = f"SYNTHETIC region snapshots (real reader unavailable: {exc})"

    try:
        facts = [
            GpuFacts(u, i, "bench GPU", 80 << 30, 8, 1 << 30, True) for i, u in enumerate(GPUS)
        ]
        provider = view_provider(root, store.all, lambda: facts, read_region=read_region)
        view = provider()
        alive = sum(a.processes_alive for a in view.allocations)
        states = {a.region_state for a in view.allocations}
        pm = metrics.new_registry(provider)
        server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry)
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> bytes:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return bytes(resp.read())

        size = len(scrape())
        print(f"node: {n} allocations x {procs} processes on {len(GPUS)} GPUs; {mode}")
        print(f"view: {len(view.allocations)} allocations, {alive} live processes, ", end="")
        print(f"region states {sorted(states)}")
        print(_line("node scan (records+regions+view)", _times(provider, args.rounds)))
        print(_line(f"metrics scrape over HTTP ({size} B)", _times(scrape, args.rounds)))
        if holders:
            check = _escape_check(root, specs, holders, read_region, args.rounds)
            print(_line(f"escape check ({len(holders)} listed)", check))
        server.shutdown()
    finally:
        for h in holders:
            assert h.stdin is not None
            h.stdin.close()
        for h in holders:
            h.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
