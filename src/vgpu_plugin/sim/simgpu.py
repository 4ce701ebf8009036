"""Control of the GPU simulator (native/simgpu): create a node, read it, inject faults.

A node lives in a state dir; every process whose environment has ``SIMGPU_STATE=<dir>`` and
the simulator's libraries on its library path (``LD_LIBRARY_PATH=<simgpu dir>``) sees the
node's GPUs through the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1``.

    python -m vgpu_plugin.sim.simgpu create --state /tmp/node --gpus 2 --memory 16g
    python -m vgpu_plugin.sim.simgpu xid --state /tmp/node --gpu 1 --xid 79
    python -m vgpu_plugin.sim.simgpu status --state /tmp/node
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from vgpu_plugin.core.sizes import parse_size
from vgpu_plugin.node.host import native

DEFAULT_NAME = "NVIDIA H100 80GB HBM3"
DEFAULT_MEMORY = 81559 * (1 << 20)  # what NVML reports for an 80 GB H100
SPANS_KEPT = 16384  # spans of work a GPU's record keeps (state.h's SIMGPU_BUSY_RING)


def model_name(memory: int) -> str:
    """The name a GPU of ``memory`` bytes shows when none is given: the real model's for the
    default size, else one that says it is simulated and states its own size (a name is what
    operators and ``gpuModels`` overrides match on; it must not claim memory the GPU lacks)."""
    if memory == DEFAULT_MEMORY:
        return DEFAULT_NAME
    return f"NVIDIA simulated GPU {max(1, round(memory / (1 << 30)))}GB"


DEFAULT_CONTEXT_OVERHEAD = 300 * (1 << 20)
DEFAULT_SMS = 132


class SimGpuError(RuntimeError):
    """The simulator refused a control call; the message says why."""


@dataclass(frozen=True)
class GpuSpec:
    """One simulated GPU. Unset UUID/serial/bus id are derived from the index and a seed."""

    name: str = ""  # empty: model_name(memory)
    memory: int = DEFAULT_MEMORY
    sm_count: int = DEFAULT_SMS
    context_overhead: int = DEFAULT_CONTEXT_OVERHEAD
    numa_node: int = 0
    uuid: str = ""
    serial: str = ""
    pci_bus_id: str = ""
    cc: tuple[int, int] = (9, 0)
    pci_device_id: int = 0x233010DE


@dataclass(frozen=True)
class GpuStatus:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    numa_node: int
    total_memory: int
    used_memory: int
    utilization: int
    live_processes: int
    xid_count: int
    lost: bool
    sm_count: int
    context_overhead: int = field(default=0)


@cache
def _lib() -> tuple[Any, Any]:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(native.cdef_source(native.include_dir() / "simgpu" / "control.h"))
    lib = ffi.dlopen(str(native.simgpu_dir() / "libsimgpu.so"))
    return ffi, lib


def _check(rc: int) -> int:
    if rc < 0:
        ffi, lib = _lib()
        raise SimGpuError(ffi.string(lib.simgpu_last_error()).decode())
    return rc


def _derive(spec: GpuSpec, index: int, seed: str) -> GpuSpec:
    uid = spec.uuid or "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_OID, f"simgpu/{seed}/{index}"))
    return GpuSpec(
        name=spec.name or model_name(spec.memory),
        memory=spec.memory,
        sm_count=spec.sm_count,
        context_overhead=spec.context_overhead,
        numa_node=spec.numa_node,
        uuid=uid,
        serial=spec.serial or f"{1650000000000 + index:013d}",
        pci_bus_id=spec.pci_bus_id or f"00000000:{0x17 + 0x10 * index:02X}:00.0",
        cc=spec.cc,
        pci_device_id=spec.pci_device_id,
    )


def _encode(value: str, size: int, what: str) -> bytes:
    data = value.encode()
    if len(data) >= size:
        raise SimGpuError(f"{what} {value!r} is longer than {size - 1} bytes")
    return data


def _recorded(index: int, covered_ns: int, from_ns: int) -> None:
    """SimGpuError unless GPU ``index``'s record of work, complete from ``covered_ns`` on,
    holds ``from_ns``."""
    if covered_ns > from_ns:
        raise SimGpuError(f"GPU {index}: work before {covered_ns} ns is no longer recorded")


@dataclass(frozen=True)
class Span:
    """Work a process queued at ``queued_ns`` that ran in ``[start_ns, end_ns]`` (simgpu's
    clock): from ``queued_ns`` to ``end_ns`` the process was waiting on the GPU."""

    pid: int
    queued_ns: int
    start_ns: int
    end_ns: int


class Node:
    """A simulated GPU node in a state dir."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)

    @classmethod
    def create(
        cls, state_dir: str | os.PathLike[str], gpus: Sequence[GpuSpec], seed: str = "node"
    ) -> Node:
        ffi, lib = _lib()
        cfgs = ffi.new("struct simgpu_gpu_config[]", len(gpus))
        for i, raw in enumerate(gpus):
            spec = _derive(raw, i, seed)
            c = cfgs[i]
            c.name = _encode(spec.name, 96, "name")
            c.uuid = _encode(spec.uuid, 80, "uuid")
            c.serial = _encode(spec.serial, 32, "serial")
            c.pci_bus_id = _encode(spec.pci_bus_id, 32, "PCI bus id")
            c.total_memory = spec.memory
            c.context_overhead = spec.context_overhead
            c.sm_count = spec.sm_count
            c.numa_node = spec.numa_node
            c.minor_number = i
            c.cc_major, c.cc_minor = spec.cc
            c.pci_device_id = spec.pci_device_id
        _check(lib.simgpu_node_create(str(state_dir).encode(), cfgs, len(gpus)))
        return cls(state_dir)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment in which a process sees this node through the simulated libraries."""
        env = dict(os.environ if base is None else base)
        libdir = str(native.simgpu_dir())
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + old if old else "")
        env["SIMGPU_STATE"] = str(self.state_dir)
        return env

    @property
    def gpu_count(self) -> int:
        _, lib = _lib()
        return _check(lib.simgpu_node_gpu_count(str(self.state_dir).encode()))

    def gpu(self, index: int) -> GpuStatus:
        ffi, lib = _lib()
        cfg = ffi.new("struct simgpu_gpu_config *")
        st = ffi.new("struct simgpu_gpu_status *")
        _check(lib.simgpu_node_gpu(str(self.state_dir).encode(), index, cfg, st))
        return GpuStatus(
            index=index,
            name=ffi.string(cfg.name).decode(),
            uuid=ffi.string(cfg.uuid).decode(),
            pci_bus_id=ffi.string(cfg.pci_bus_id).decode(),
            numa_node=cfg.numa_node,
            total_memory=cfg.total_memory,
            used_memory=st.used_memory,
            utilization=st.utilization,
            live_processes=st.live_processes,
            xid_count=st.xid_count,
            lost=bool(st.lost),
            sm_count=cfg.sm_count,
            context_overhead=cfg.context_overhead,
        )

    def gpus(self) -> list[GpuStatus]:
        return [self.gpu(i) for i in range(self.gpu_count)]

    def inject_xid(self, index: int, xid: int) -> None:
        _, lib = _lib()
        _check(lib.simgpu_inject_xid(str(self.state_dir).encode(), index, xid))

    def set_lost(self, index: int, lost: bool = True) -> None:
        _, lib = _lib()
        _check(lib.simgpu_set_lost(str(self.state_dir).encode(), index, 1 if lost else 0))

    def recorded_since(self, index: int) -> int:
        """From when on (simgpu's clock, ns) GPU ``index``'s record of work is complete."""
        ffi, lib = _lib()
        covered = ffi.new("uint64_t *")
        _check(
            lib.simgpu_node_busy(str(self.state_dir).encode(), index, 0, 0, ffi.NULL, 0, covered)
        )
        return int(covered[0])

    def busy(self, index: int, from_ns: int, to_ns: int) -> dict[int, int]:
        """Per pid, the GPU time GPU ``index`` ran its work during ``[from_ns, to_ns]`` of
        simgpu's clock (``time.monotonic_ns()``). Refuses a span part of which has left the
        simulator's record of work."""
        ffi, lib = _lib()
        out = ffi.new("struct simgpu_pid_busy[]", 256)
        covered = ffi.new("uint64_t *")
        n = _check(
            lib.simgpu_node_busy(
                str(self.state_dir).encode(), index, from_ns, to_ns, out, 256, covered
            )
        )
        _recorded(index, int(covered[0]), from_ns)
        return {int(out[i].pid): int(out[i].busy_ns) for i in range(n)}

    def spans(self, index: int, from_ns: int, to_ns: int) -> list[Span]:
        """The spans of work GPU ``index`` ran whose time from being queued to their end meets
        ``[from_ns, to_ns]`` of simgpu's clock, oldest recorded first. Refuses a span of time
        part of which has left the simulator's record of work."""
        ffi, lib = _lib()
        out = ffi.new("struct simgpu_span[]", SPANS_KEPT)
        covered = ffi.new("uint64_t *")
        n = _check(
            lib.simgpu_node_spans(
                str(self.state_dir).encode(), index, from_ns, to_ns, out, SPANS_KEPT, covered
            )
        )
        _recorded(index, int(covered[0]), from_ns)
        return [
            Span(int(s.pid), int(s.queued_ns), int(s.start_ns), int(s.end_ns))
            for s in (out[i] for i in range(n))
        ]

    def reap(self) -> int:
        """Reclaim dead processes' memory now; returns how many were reclaimed."""
        _, lib = _lib()
        return _check(lib.simgpu_reap(str(self.state_dir).encode()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vgpu_plugin.sim.simgpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a simulated node")
    c.add_argument("--state", required=True, help="state dir of the node")
    c.add_argument("--gpus", type=int, default=2, help="number of GPUs (default 2)")
    c.add_argument(
        "--memory",
        default=f"{DEFAULT_MEMORY // (1 << 20)}m",
        help="memory per GPU, e.g. 16g (default: an 80 GB H100's 81559m)",
    )
    c.add_argument("--sms", type=int, default=DEFAULT_SMS, help="SMs per GPU")
    c.add_argument(
        "--name",
        default="",
        help="GPU model name (default: from the memory, e.g. 80 GB: an H100's)",
    )
    c.add_argument("--context-overhead", default="300m", help="memory each new context takes")
    c.add_argument(
        "--numa-nodes", type=int, default=1, help="spread GPUs over this many NUMA nodes"
    )
    c.add_argument("--seed", default="node", help="seed of the derived UUIDs")
    for name, text in (
        ("xid", "inject an XID event"),
        ("lost", "make a GPU fall off the bus"),
        ("restore", "bring a lost GPU back"),
    ):
        f = sub.add_parser(name, help=text)
        f.add_argument("--state", required=True)
        f.add_argument("--gpu", type=int, required=True)
        if name == "xid":
            f.add_argument("--xid", type=int, required=True)
    s = sub.add_parser("status", help="print the node's GPUs as JSON")
    s.add_argument("--state", required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        node = Node(args.state)
        if args.cmd == "create":
            if not 1 <= args.gpus <= 16:
                raise SimGpuError(f"--gpus must be 1..16, got {args.gpus}")
            per_numa = max(1, -(-args.gpus // max(1, args.numa_nodes)))
            spec = [
                GpuSpec(
                    name=args.name,
                    memory=parse_size(args.memory, "--memory"),
                    sm_count=args.sms,
                    context_overhead=parse_size(args.context_overhead, "--context-overhead"),
                    numa_node=i // per_numa,
                )
                for i in range(args.gpus)
            ]
            node = Node.create(args.state, spec, seed=args.seed)
            for g in node.gpus():
                print(f"GPU {g.index}: {g.name} {g.uuid} {g.total_memory >> 20} MiB")
        elif args.cmd == "xid":
            node.inject_xid(args.gpu, args.xid)
        elif args.cmd in ("lost", "restore"):
            node.set_lost(args.gpu, args.cmd == "lost")
        else:
            print(json.dumps([asdict(g) for g in node.gpus()], indent=2))
    except (SimGpuError, ValueError, native.NativeArtifactMissing) as exc:
        print(f"simgpu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
