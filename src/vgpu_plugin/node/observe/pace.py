"""The host's reading of a container's pacing file (``<id>.pace`` beside its region): per GPU,
the guarantee its shim published and how long its launches were held back.

The file is the tenant's to write (docs/security.md#compute-guarantees), so it is read as a
region is: opened without following links and without blocking, never mapped, one bounded
``pread`` of exactly the size the layout has, refused whole for a wrong magic, version, size
or count, and every value taken as a claim: a GPU the allocation lacks is ignored, a figure
is clamped (``held_back_bound``). A bad file costs its own container's figures, nothing else.

The layout is the shim's (native/libvgpu/src/pace.c; docs/contracts.md, Compute): a header
of 64 bytes (magic ``VGPUPAC``, version 1, count, size), then 16 device records of 192 bytes:
UUID (80 bytes, NUL-terminated), share at 80, guarantee at 84 (``uint32``), busy-until at 88
and nanoseconds waited at 96 (``uint64``), little-endian as the node's CPU writes them.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"VGPUPAC\0"
VERSION = 1
HEADER = 64
RECORD = 192
MAX_DEVICES = 16
SIZE = HEADER + RECORD * MAX_DEVICES
UUID_SIZE = 80
# What one container's processes can have waited in all, per second of its life: each waits
# at most the whole of it, and a region has 256 process slots (region.h's VGPU_MAX_SLOTS).
MAX_WAITERS = 256

_HEADER = struct.Struct("<8sIIQ")
_RECORD = struct.Struct(f"<{UUID_SIZE}sIIQQ")


@dataclass(frozen=True)
class PaceDevice:
    uuid: str
    request: int  # the guarantee its shim published, percent (claimed, not trusted)
    held_ns: int  # nanoseconds the container's launches waited in all (claimed)


@dataclass(frozen=True)
class PaceProblem:
    """A pacing file that gave no figures: 'invalid: <why>'."""

    state: str


PaceRead = tuple[PaceDevice, ...] | PaceProblem


def pace_path(region: Path) -> Path:
    """The pacing file of the region at ``region`` (the shim's rule: ``.cache`` -> ``.pace``)."""
    return region.with_suffix(".pace")


def parse_pace(data: bytes) -> PaceRead:
    """The device records of a pacing file's bytes, or why they are refused."""
    if len(data) != SIZE:
        return PaceProblem(f"invalid: {len(data)} bytes, not {SIZE}")
    magic, version, count, size = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return PaceProblem("invalid: not a pacing file (bad magic)")
    if version != VERSION:
        return PaceProblem(f"invalid: layout version {version}, not {VERSION}")
    if size != SIZE or count > MAX_DEVICES:
        return PaceProblem(f"invalid: header says {count} GPUs, {size} bytes")
    devices = []
    for i in range(count):
        raw, _percent, request, _active, held = _RECORD.unpack_from(data, HEADER + i * RECORD)
        uuid = raw.split(b"\0", 1)[0].decode("ascii", "replace")
        devices.append(PaceDevice(uuid, request if request <= 100 else 0, held))
    return tuple(devices)


def read_pace(path: Path) -> PaceRead | None:
    """The pacing file at ``path``; None when there is none (no paced launch yet, or a
    container whose compute is not paced)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return PaceProblem("invalid: a symbolic link")
        return PaceProblem(f"invalid: cannot open: {exc.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return PaceProblem("invalid: not a regular file")
        if st.st_size != SIZE:
            return PaceProblem(f"invalid: {st.st_size} bytes, not {SIZE}")
        return parse_pace(os.pread(fd, SIZE + 1, 0))  # one more: a file grown meanwhile
    except OSError as exc:
        return PaceProblem(f"invalid: cannot read: {exc.strerror}")
    finally:
        os.close(fd)


def held_back_bound(age_seconds: float) -> int:
    """The most nanoseconds a container ``age_seconds`` old can have been held back."""
    return int(max(age_seconds, 0.0) * 1e9) * MAX_WAITERS
