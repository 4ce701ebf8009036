"""Byte sizes as people write them: ``16g``, ``300m``, ``512k``, ``1048576``."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^([0-9]+)([kKmMgGtT]?)$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """An integer with an optional k/m/g/t suffix (powers of 1024); a bare number is bytes."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise ValueError(f"{what}: {text!r} is not a size (e.g. 16g, 300m, 4096)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_mib(n_bytes: int) -> str:
    """Bytes as whole MiB, e.g. ``20389 MiB``."""
    return f"{n_bytes // (1 << 20)} MiB"
