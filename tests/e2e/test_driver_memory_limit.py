"""The driver's own memory limit holds a process that bypasses the shim (docs/security.md,
the "static binary" and "musl image" rows of the threat model).

The container is the allocated one, but started without the ``/etc/ld.so.preload`` mount: its
loader never loads the shim, exactly as for a static binary or a musl image, so nothing but the
driver stands between it and the whole GPU. The NVIDIA toolkit's ``apply-cuda-memory-limits``
hook is played by ``sim/toolkit.py``, which calls simgpu's ``nvmlDeviceSetMemoryLimits_v1`` for
the container's cgroup when the plugin set ``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``.
"""

from __future__ import annotations

import dataclasses
import json

from e2e.helpers import NodeFactory, needs_containers, one

from vgpu_plugin.core.defaults import PRELOAD_PATH
from vgpu_plugin.sim.node import MIB, WORKLOAD, Admitted, EmulatedNode
from vgpu_plugin.sim.toolkit import CGROUP_ENV, ToolkitSettings, container_cgroup

pytestmark = needs_containers

SLICE_MIB, CONTEXT_MIB = 4096, 256  # a quarter of a 16 GiB GPU; the node's context overhead
GREEDY = [*WORKLOAD, "alloc", "--target-mib", str(2 * SLICE_MIB), "--chunk-mib", "64"]


def driver_limits(node: EmulatedNode) -> list[tuple[str, str, int]]:
    """Per allocation and GPU, from ``status --json``: (requested, state, confirmed bytes)."""
    shown = node.status("--json")
    assert shown.returncode == 0, shown.stderr
    return [
        (a["driver_memory_limit"], g["driver_limit"], g["driver_limit_confirmed"])
        for a in json.loads(shown.stdout)["allocations"]
        for g in a["gpus"]
    ]


def run_without_shim(node: EmulatedNode, pod: Admitted, name: str) -> dict[str, object]:
    config = node.container_config(pod, name, GREEDY)
    bypass = [m for m in config.mounts if m.container_path != PRELOAD_PATH]
    assert len(bypass) == len(config.mounts) - 1
    return one(node.runtime.run(dataclasses.replace(config, mounts=bypass)))


def test_the_driver_holds_a_process_that_bypasses_the_shim(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node()  # driverMemoryLimit: true is the default
    pod = node.admit("static", 1)
    assert pod.envs["NVIDIA_GPU_MEMORY_LIMIT"] == str(SLICE_MIB)
    config = node.container_config(pod, "static-bypass", GREEDY)
    assert config.envs[CGROUP_ENV] == container_cgroup("static-bypass")
    got = run_without_shim(node, pod, "static-bypass")
    assert got["cuda_total"] == 16384 * MIB, "the shim was loaded after all"
    assert got["out_of_memory"] is True
    assert got["allocated_mib"] + CONTEXT_MIB == SLICE_MIB  # the driver's limit, to the MiB
    # The plugin says what it asked for; no process of the container has confirmed it: the
    # bypassing one never loaded the shim.
    assert driver_limits(node) == [("requested", "requested", 0)]
    # A CUDA process with the shim finds the driver's limit for its own cgroup (by the path
    # its namespace shows, not the host's): confirmed, to the byte.
    small = [*WORKLOAD, "alloc", "--target-mib", "64", "--chunk-mib", "64"]
    assert one(node.run_container(pod, small))["allocated_mib"] == 64
    assert driver_limits(node) == [("requested", "confirmed", SLICE_MIB * MIB)]


def test_without_the_driver_limit_the_same_process_takes_what_it_wants(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(
        config="version: v1\nsharing: {splitCount: 4}\ndriverMemoryLimit: false\n"
    )
    pod = node.admit("static", 1)
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in pod.envs
    got = run_without_shim(node, pod, "static-free")
    assert got["out_of_memory"] is False
    assert got["allocated_mib"] == 2 * SLICE_MIB  # twice its slice: the hole the row describes


def test_a_toolkit_without_the_hook_leaves_only_the_shim(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(toolkit=ToolkitSettings(apply_cuda_memory_limits=False))
    pod = node.admit("old-toolkit", 1)
    assert pod.envs["NVIDIA_GPU_MEMORY_LIMIT"] == str(SLICE_MIB)  # asked, but nobody applies it
    assert CGROUP_ENV not in node.container_config(pod, "x", GREEDY).envs
    assert run_without_shim(node, pod, "old-bypass")["allocated_mib"] == 2 * SLICE_MIB
    # With the shim it is still held to its slice; and it found the driver holds it to nothing.
    got = one(node.run_container(pod, GREEDY))
    assert got["out_of_memory"] is True and got["allocated_mib"] + CONTEXT_MIB <= SLICE_MIB
    assert driver_limits(node) == [
        ("requested", "not applied: no limit on the container's cgroup", 0)
    ]
