"""What a tenant may do to the pacing file it can write (its region's path ending in .pace,
native/libvgpu/src/pace.c): keep its first device record's bucket full and its guarantee at
100 %. The compute-guarantee tests of every tier run it against the shim."""

from __future__ import annotations

import mmap
import struct
import threading
from pathlib import Path

from vgpu_plugin.node.observe.pace import HEADER

REQUEST_AT = HEADER + 84  # the first device record's guarantee, percent (uint32)
TOKENS_AT = HEADER + 128  # and its bucket, ns of GPU time (int64)


def forge_budget(pace: Path, stop: threading.Event) -> None:
    """Once the shim made ``pace``, write a 100 % guarantee and a full bucket into it every
    millisecond until ``stop``."""
    while not pace.exists() or pace.stat().st_size == 0:
        if stop.wait(0.01):
            return
    with pace.open("r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        while not stop.wait(0.001):
            struct.pack_into("<I", m, REQUEST_AT, 100)
            struct.pack_into("<q", m, TOKENS_AT, 10**12)
