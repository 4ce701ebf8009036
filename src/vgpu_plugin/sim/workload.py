"""The demo's workloads, run inside the containers: ``python -m vgpu_plugin.sim.workload``.

Each prints one JSON line that the demo reads back:
- ``view``: what the container sees (CUDA memory info, device total, NVML memory).
- ``devices``: each visible device's UUID and the memory CUDA reports for it.
- ``alloc --target-mib N --chunk-mib C --hold S``: allocate up to N MiB in chunks, report how
  far it got and whether the driver said out of memory; hold it for S seconds. With
  ``--barrier DIR --parties P``: each of P processes says in DIR that it is done (fed or
  refused), and one that holds memory holds it until all P have, then S seconds: they race
  for the memory together however late a loaded host starts the last.
- ``compute --seconds S --kernel-ms K``: launch K ms kernels one after another for S seconds
  and report how many, the share of its wall time they ran, and its pid as simgpu records its
  work (the demo reads its GPU time from simgpu's record by that pid). With
  ``--stop-on-stdin``: also stop when a line or the end comes on stdin, so a test can run
  processes until they have run together long enough.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_plugin.node.gpu import nvml
from vgpu_plugin.sim.driver import Driver

MIB = 1 << 20


def view(drv: Driver) -> dict[str, Any]:
    free, total = drv.mem_info()
    out: dict[str, Any] = {"cuda_free": free, "cuda_total": total, "device_total": drv.total_mem()}
    try:
        total, used = nvml.memory_info(0)
        out.update(nvml_total=total, nvml_used=used)
    except Exception as exc:  # NVML is a nice-to-have in the view
        out["nvml_error"] = str(exc)
    return out


def devices(drv: Driver) -> dict[str, Any]:
    """Every device the container sees: its UUID and the memory CUDA says it has."""
    return {
        "devices": [
            {"uuid": drv.uuid(i), "total": drv.total_mem(i)} for i in range(drv.device_count())
        ]
    }


@dataclass(frozen=True)
class Barrier:
    """`parties` processes meet in `path`, a directory they can all write."""

    path: Path
    parties: int

    def arrive(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / str(os.getpid())).touch()

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(os.listdir(self.path)) < self.parties and time.monotonic() < deadline:
            time.sleep(0.02)


def alloc(
    drv: Driver, target_mib: int, chunk_mib: int, hold: float, barrier: Barrier | None = None
) -> dict[str, Any]:
    got, oom = 0, False
    while got + chunk_mib <= target_mib:
        if drv.alloc(chunk_mib * MIB) is None:
            oom = True
            break
        got += chunk_mib
    result = {"allocated_mib": got, "out_of_memory": oom, **view(drv)}
    print(json.dumps(result), flush=True)
    if barrier:
        barrier.arrive()
        barrier.wait()
    time.sleep(hold)
    return result


def cupy_alloc(target_mib: int, chunk_mib: int, hold: float) -> dict[str, Any]:
    """The alloc workload through a real client: CuPy, over NVIDIA's CUDA runtime."""
    import cupy as cp  # only offered where CuPy is installed

    held: list[Any] = []
    oom = False
    while (len(held) + 1) * chunk_mib <= target_mib:
        try:
            held.append(cp.empty(chunk_mib * MIB, dtype=cp.uint8))
        except cp.cuda.memory.OutOfMemoryError:
            oom = True
            break
    free, total = cp.cuda.runtime.memGetInfo()
    result = {
        "allocated_mib": len(held) * chunk_mib,
        "out_of_memory": oom,
        "cuda_free": int(free),
        "cuda_total": int(total),
        "client": f"CuPy {cp.__version__}",
    }
    print(json.dumps(result), flush=True)
    time.sleep(hold)
    return result


def node_pid() -> int:
    """This process's pid as simgpu records its work: the node's, read through the node's
    /proc where the container has it (SIMGPU_HOST_PROC, native/simgpu/NVML.md), else its own."""
    proc = os.environ.get("SIMGPU_HOST_PROC")
    if proc:
        try:
            return int(os.readlink(os.path.join(proc, "self")))
        except (OSError, ValueError):
            pass  # simgpu falls back the same way
    return os.getpid()


def stop_on_stdin() -> threading.Event:
    """An event set when a line or the end comes on stdin."""
    stop = threading.Event()

    def read() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=read, daemon=True).start()
    return stop


def compute(
    drv: Driver, seconds: float, kernel_ms: float, stop: threading.Event | None = None
) -> dict[str, Any]:
    func = drv.sleep_kernel()
    ns = int(kernel_ms * 1e6)
    start = time.monotonic()
    done = 0
    while time.monotonic() - start < seconds and not (stop and stop.is_set()):
        drv.launch_sleep(func, ns)
        drv.synchronize()
        done += 1
    wall = time.monotonic() - start
    result = {
        "kernels": done,
        "wall_s": wall,
        "share_percent": 100.0 * done * ns / 1e9 / wall,
        "pid": node_pid(),
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vgpu_plugin.sim.workload")
    sub = ap.add_subparsers(dest="mode", required=True)
    sub.add_parser("view")
    sub.add_parser("devices")
    a = sub.add_parser("alloc")
    a.add_argument("--target-mib", type=int, required=True)
    a.add_argument("--chunk-mib", type=int, default=256)
    a.add_argument("--hold", type=float, default=0.0)
    a.add_argument("--barrier", type=Path, help="a directory the racing processes share")
    a.add_argument("--parties", type=int, default=1, help="how many race (with --barrier)")
    k = sub.add_parser("cupy-alloc")
    k.add_argument("--target-mib", type=int, required=True)
    k.add_argument("--chunk-mib", type=int, default=256)
    k.add_argument("--hold", type=float, default=0.0)
    c = sub.add_parser("compute")
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--kernel-ms", type=float, default=10.0)
    c.add_argument("--stop-on-stdin", action="store_true")
    args = ap.parse_args(argv)
    barrier = Barrier(args.barrier, args.parties) if getattr(args, "barrier", None) else None
    try:
        if args.mode == "cupy-alloc":
            cupy_alloc(args.target_mib, args.chunk_mib, args.hold)
            return 0
        drv = Driver()
        if args.mode == "view":
            print(json.dumps(view(drv)), flush=True)
        elif args.mode == "devices":
            print(json.dumps(devices(drv)), flush=True)
        elif args.mode == "alloc":
            alloc(drv, args.target_mib, args.chunk_mib, args.hold, barrier)
        else:
            stop = stop_on_stdin() if args.stop_on_stdin else None
            compute(drv, args.seconds, args.kernel_ms, stop)
    except Exception as exc:  # any failure is the result line the demo reads
        print(json.dumps({"error": str(exc)}), flush=True)
        if barrier:  # refused: it has raced, and holds nothing
            barrier.arrive()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
