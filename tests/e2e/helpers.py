"""Helpers of the end-to-end tests."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from vgpu_plugin.sim import cap_share
from vgpu_plugin.sim.node import EmulatedNode
from vgpu_plugin.sim.runc import runc_unavailable_reason

REASON = runc_unavailable_reason()
needs_containers = pytest.mark.skipif(REASON is not None, reason=f"real containers: {REASON}")

NodeFactory = Callable[..., EmulatedNode]


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Every JSON line a container printed (one per workload process)."""
    assert proc.returncode == 0, f"container failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def one(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    found = results(proc)
    assert len(found) == 1, proc.stdout
    return found[0]


def gpu_share(
    node: EmulatedNode, result: dict[str, Any], t0: int, limit: int, gpu: int = 0
) -> cap_share.CapShare:
    """A ``compute`` workload's share of its GPU (10 ms kernels) since ``t0`` (simgpu's clock),
    from simgpu's record of the pid it reported, as the demo judges it (sim/cap_share.py):
    not its own wall-clock count, which a loaded host that does not run it lowers."""
    t0 = max(t0, node.node.recorded_since(gpu))
    steps = cap_share.timeline(node.node, gpu, int(result["pid"]), t0, time.monotonic_ns())
    return cap_share.measure(steps, cap_share.RESOLUTION_NS, limit, 10 * cap_share.MS)
