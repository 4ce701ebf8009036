"""The node-wide per-GPU lock cannot be used by one tenant to stall everyone's CUDA start."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

from test_shim_helpers import CONTEXT, GIB, Shim

from vgpu_plugin.sim.simgpu import Node


def test_a_lock_held_forever_delays_a_context_by_a_bounded_time(
    native_tree: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    shim = Shim(native_tree, simgpu_node, tmp_path)
    lock_dir = tmp_path / "lock"
    lock_dir.mkdir()
    uuid = simgpu_node.gpu(0).uuid
    with open(lock_dir / f"{uuid}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another container's process, stuck holding it
        t0 = time.monotonic()
        r = shim.run("shim_views", "handle", 0, 0, env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g"}))
        took = time.monotonic() - t0
    assert r.rc == 0, r.stderr
    assert took < 10, f"context creation waited {took:.1f}s on another tenant's lock"
    assert "measuring without it" in r.stderr
    # The context was still measured and charged.
    assert r.int("start_free") == 2 * GIB - CONTEXT
