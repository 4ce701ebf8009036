"""The host's view of a container's shared region (the shim's accountant), through cffi.

The layout and the reading protocol live in C (``native/libvgpu/include/vgpu/region.h``,
``libvgpu.so``); this module binds that same header, so there is no second definition. Reading
never takes the region's lock (the tenants never wait on the host) and never maps the file (it
is copied with pread): a tenant that shrinks or replaces its region file gets a RegionError for
it, and cannot make the host fault, block or follow a symlink.

    snap = read_region("/usr/local/vgpu/containers/<id>/<id>.cache")
    for dev in snap.devices:
        print(dev.uuid, dev.used, dev.memory_limit)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.host import native


class RegionError(RuntimeError):
    """A region file could not be read: missing, refused (corrupt, truncated, foreign,
    another layout version, not a regular file), changed while being read (shrunk or rewritten
    by its tenant) or unusable. The message names the file and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(reason)
        self.path = Path(path)
        self.reason = reason


class RegionBusy(RegionError):
    """Two reads of the region's slots never agreed in time: no view now."""


@dataclass(frozen=True)
class DeviceUsage:
    uuid: str
    memory_limit: int  # bytes, as the region's creator wrote it
    used: int  # bytes charged by the container's live processes (their sum)
    sm_percent: int
    refused: int = 0  # allocations refused at the limit, ever
    fallbacks: int = 0  # allocations that fell back to managed memory (oversubscription)
    peak: int = 0  # the highest usage charged, bytes
    gpu_ns: int = 0  # GPU time of the container's measured (paced) launches
    # What a process of the container found the driver holds it to (enum
    # vgpu_driver_limit_state in region.h; 0: nobody looked yet) and, when found, the hard
    # limit in bytes. Written by the tenant: reported, not trusted.
    driver_limit: int = 0
    driver_limit_state: int = 0


@dataclass(frozen=True)
class ProcessUsage:
    slot: int
    pid: int  # in the container's pid namespace
    start_time: int  # clock ticks since boot (field 22 of /proc/<pid>/stat)
    alive: bool  # False: dead, its charge not reclaimed yet (and not in DeviceUsage.used)
    used: tuple[int, ...]  # bytes per device, in the order of RegionSnapshot.devices
    pending: tuple[int, ...]  # of which reserved but not yet committed


@dataclass(frozen=True)
class RegionSnapshot:
    path: Path
    devices: tuple[DeviceUsage, ...]
    processes: tuple[ProcessUsage, ...]


@cache
def _lib() -> tuple[Any, Any]:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(native.cdef_source(native.include_dir() / "vgpu" / "region.h"))
    return ffi, ffi.dlopen(str(native.shim_library()))


def bind() -> None:
    """Binds the header and loads the library now, so a process forked later inherits them
    (each forked metrics build would parse the header again otherwise)."""
    _lib()


def _text(ffi: Any, buf: Any) -> str:
    return str(ffi.string(buf).decode("utf-8", "replace"))


def read_region(path: str | os.PathLike[str]) -> RegionSnapshot:
    """A view of the region at ``path`` (each process's figures as it really had them, at
    most microseconds old; no device over its limit but for memory forced past it, see
    region.h); RegionError if it cannot be had."""
    ffi, lib = _lib()
    snap = ffi.new("struct vgpu_region_snapshot *")
    err = ffi.new("char[]", lib.VGPU_REGION_ERRLEN)
    rc = lib.vgpu_region_snapshot(os.fsencode(path), snap, err, len(err))
    if rc == lib.VGPU_REGION_EBUSY:
        raise RegionBusy(path, _text(ffi, err))
    if rc != lib.VGPU_REGION_OK:
        raise RegionError(path, _text(ffi, err))
    ndev = snap.device_count
    devices = tuple(
        DeviceUsage(
            uuid=_text(ffi, d.uuid),
            memory_limit=d.memory_limit,
            used=d.used,
            sm_percent=d.sm_percent,
            refused=d.refused,
            fallbacks=d.fallbacks,
            peak=d.peak,
            gpu_ns=d.gpu_ns,
            driver_limit=d.driver_limit,
            driver_limit_state=d.driver_limit_state,
        )
        for d in snap.devices[0:ndev]
    )
    processes = tuple(
        ProcessUsage(
            slot=p.slot,
            pid=p.pid,
            start_time=p.start_time,
            alive=bool(p.alive),
            used=tuple(p.used[0:ndev]),
            pending=tuple(p.pending[0:ndev]),
        )
        for p in snap.processes[0 : snap.process_count]
    )
    return RegionSnapshot(
        path=Path(path),
        devices=devices,
        processes=processes,
    )


def create_region(path: str | os.PathLike[str], devices: Sequence[GpuLimit]) -> bool:
    """Create the region at ``path`` with these limits (mode 0666, complete before it appears)
    unless one is there already. True if this call created it. The limits are written once:
    an existing region keeps its own."""
    ffi, lib = _lib()
    limits = ffi.new("struct vgpu_limits *")
    if not 1 <= len(devices) <= lib.VGPU_MAX_DEVICES:
        raise RegionError(path, f"a region holds 1..{lib.VGPU_MAX_DEVICES} devices")
    limits.count = len(devices)
    for i, dev in enumerate(devices):
        uuid = dev.uuid.encode()
        if len(uuid) >= lib.VGPU_UUID_SIZE:
            raise RegionError(path, f"GPU uuid too long: {dev.uuid!r}")
        if not 0 <= dev.memory_bytes < 1 << 64:
            raise RegionError(path, f"GPU {dev.uuid}: memory limit out of range")
        limits.devices[i].uuid = uuid
        limits.devices[i].memory_limit = dev.memory_bytes
        limits.devices[i].sm_percent = dev.compute_percent
    err = ffi.new("char[]", lib.VGPU_REGION_ERRLEN)
    rc = lib.vgpu_region_create(os.fsencode(path), limits, err, len(err))
    if rc < 0:
        raise RegionError(path, _text(ffi, err))
    return bool(rc == 1)
