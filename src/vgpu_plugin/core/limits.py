"""The limits file (docs/limits-file.md): written by the plugin, read by the shim and the agent.

vgpu-limits 1
allocation <allocation-id>
oversubscribe <0|1>
gpu <GPU-UUID> <memory-limit-bytes> <sm-percent> [<sm-request>]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.core.grant import ALLOCATION_ID, Grant

HEADER = "vgpu-limits 1"

_UUID = re.compile(r"^[!-~]+$")  # printable ASCII, no spaces
_BYTES = re.compile(r"^[1-9][0-9]{0,19}$")
_PERCENT = re.compile(r"^(0|[1-9][0-9]{0,2})$")


@dataclass(frozen=True)
class Limits:
    """A limits file's content; ``gpus`` in the order of NVIDIA_VISIBLE_DEVICES."""

    allocation_id: str
    oversubscribe: bool
    gpus: tuple[GpuLimit, ...]


class LimitsError(ValueError):
    """The text is not a valid limits file; ``line`` is the 1-based line at fault (0: the whole
    file)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"limits line {line}: {message}" if line else f"limits: {message}")
        self.line = line


def limits_of(grant: Grant) -> Limits:
    return Limits(
        allocation_id=grant.allocation_id,
        oversubscribe=grant.oversubscribed,
        gpus=tuple(g.limit for g in grant.gpus),
    )


def format_limits(limits: Limits) -> str:
    lines = [
        HEADER,
        f"allocation {limits.allocation_id}",
        f"oversubscribe {int(limits.oversubscribe)}",
    ]
    lines += [
        f"gpu {g.uuid} {g.memory_bytes} {g.compute_percent}"
        + (f" {g.compute_request}" if g.compute_request else "")
        for g in limits.gpus
    ]
    return "\n".join(lines) + "\n"


def render_limits(grant: Grant) -> str:
    """The limits file for ``grant``, GPUs in physical index order (= NVIDIA_VISIBLE_DEVICES)."""
    return format_limits(limits_of(grant))


def parse_limits(text: str) -> Limits:
    """The strict inverse of :func:`format_limits`; :class:`LimitsError` names the bad line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    if not lines or lines[0] != HEADER:
        got = lines[0] if lines else ""
        raise LimitsError(1, f"first line must be exactly {HEADER!r}, got {got!r}")
    allocation: str | None = None
    oversubscribe: bool | None = None
    gpus: list[GpuLimit] = []
    for number, line in enumerate(lines[1:], start=2):
        if line.startswith("#"):
            continue
        fields = line.split(" ")
        key, values = fields[0], fields[1:]
        if key == "allocation":
            _arity(number, line, values, 1)
            if allocation is not None:
                raise LimitsError(number, "second allocation line")
            if not ALLOCATION_ID.match(values[0]):
                raise LimitsError(number, f"bad allocation id {values[0]!r}")
            allocation = values[0]
        elif key == "oversubscribe":
            _arity(number, line, values, 1)
            if oversubscribe is not None:
                raise LimitsError(number, "second oversubscribe line")
            if values[0] not in ("0", "1"):
                raise LimitsError(number, f"oversubscribe must be 0 or 1, got {values[0]!r}")
            oversubscribe = values[0] == "1"
        elif key == "gpu":
            gpus.append(_gpu(number, line, values, {g.uuid for g in gpus}))
        else:
            raise LimitsError(number, f"unknown record {line!r}")
    if allocation is None:
        raise LimitsError(0, "no allocation line")
    if oversubscribe is None:
        raise LimitsError(0, "no oversubscribe line")
    if not gpus:
        raise LimitsError(0, "no gpu line")
    return Limits(allocation, oversubscribe, tuple(gpus))


def _arity(number: int, line: str, values: list[str], count: int) -> None:
    if len(values) != count or "" in values:
        raise LimitsError(
            number, f"expected {count} value(s) separated by single spaces, got {line!r}"
        )


def _gpu(number: int, line: str, values: list[str], seen: set[str]) -> GpuLimit:
    _arity(number, line, values, 4 if len(values) == 4 else 3)
    uuid, memory, percent = values[:3]
    request = values[3] if len(values) == 4 else "0"
    if not _UUID.match(uuid):
        raise LimitsError(number, f"bad GPU UUID {uuid!r}")
    if uuid in seen:
        raise LimitsError(number, f"second gpu line for {uuid}")
    if not _BYTES.match(memory):
        raise LimitsError(number, f"memory limit must be decimal bytes > 0, got {memory!r}")
    if not _PERCENT.match(percent) or int(percent) > 100:
        raise LimitsError(number, f"sm percent must be 0..100, got {percent!r}")
    # The guarantee is written only when there is one, and never above a cap below 100.
    cap = int(percent) or 100
    if len(values) == 4 and (not _PERCENT.match(request) or not 1 <= int(request) <= cap):
        raise LimitsError(number, f"sm request must be 1..{cap}, got {request!r}")
    return GpuLimit(uuid, int(memory), int(percent), int(request))
