"""Helpers of the end-to-end tests."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

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
