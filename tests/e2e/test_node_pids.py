"""A container of a real runtime has its own pid namespace, and a real driver's NVML lists its
processes by their pids on the node, never by the pid the process sees. The emulated node
models that (``SIMGPU_HOST_PROC``: simgpu's NVML.md), so every container here meets what it
would on a cluster: the shim must find itself in NVML's list by a probe (libvgpu/src/ctx.c).
"""

from __future__ import annotations

import re

from e2e.helpers import NodeFactory, needs_containers, one

from vgpu_plugin.sim.node import WORKLOAD

pytestmark = needs_containers

SLICE_MIB, CONTEXT_MIB = 4096, 256  # a quarter of a 16 GiB GPU; the node's context overhead


def test_a_container_finds_itself_in_nvml_by_its_node_pid_and_its_context_is_charged(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node()
    pod = node.admit("pids", 1)
    greedy = [*WORKLOAD, "alloc", "--target-mib", str(2 * SLICE_MIB), "--chunk-mib", "64"]
    config = node.container_config(pod, "pids-0", greedy, {"LIBVGPU_LOG_LEVEL": "debug"})
    proc = node.runtime.run(config, timeout=120)
    got = one(proc)
    learned = re.search(r"NVML lists this process \(pid (\d+) here\) as pid (\d+)", proc.stderr)
    assert learned, proc.stderr
    here, on_node = map(int, learned.groups())
    assert here != on_node  # its own pid namespace, as on a cluster
    # The context was charged from the driver's count: the rest of the slice, to the chunk.
    assert got["out_of_memory"] is True
    assert got["allocated_mib"] == (SLICE_MIB - CONTEXT_MIB) // 64 * 64
