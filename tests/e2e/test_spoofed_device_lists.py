"""Isolation that holds without the tenant's cooperation (docs/security.md#threat-model).

A pod that asks for no GPU but sets ``NVIDIA_VISIBLE_DEVICES`` in its own spec: under the
default strategy (volume-mounts) and the toolkit settings it needs
(``accept-nvidia-visible-devices-envvar-when-unprivileged = false``,
``accept-nvidia-visible-devices-as-volume-mounts = true``), it sees no GPU, while an allocated
container still sees exactly its own. The NVIDIA runtime's decision is emulated by
``sim/toolkit.py`` (simgpu stands for the device nodes through ``NVIDIA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

from e2e.helpers import NodeFactory, needs_containers, one

from vgpu_plugin.sim.node import MIB, WORKLOAD
from vgpu_plugin.sim.toolkit import UNSAFE_DEFAULTS

pytestmark = needs_containers

VISIBLE = [
    "python3", "-c",
    "import ctypes, json; c = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(-1);"
    " r = c.cuInit(0); c.cuDeviceGetCount(ctypes.byref(n)) if r == 0 else None;"
    " print(json.dumps({'init': r, 'count': n.value}))",
]  # fmt: skip
SPOOF = {"NVIDIA_VISIBLE_DEVICES": "all"}


def test_a_pod_without_an_allocation_cannot_spoof_its_way_to_a_gpu(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(gpus=2)
    spoofed = one(node.run_unallocated("spoof", VISIBLE, SPOOF))
    assert spoofed["count"] <= 0, f"a pod with no allocation sees GPUs: {spoofed}"
    # An allocated container beside it still gets its GPU, its limit and the shim.
    pod = node.admit("tenant", 1)
    assert pod.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    seen = one(node.run_container(pod, [*WORKLOAD, "devices"]))["devices"]
    assert [(d["uuid"], d["total"] // MIB) for d in seen] == [(pod.gpus[0], 4096)]
    # ... and spoofing the env inside an allocation gains nothing either.
    config = node.container_config(pod, "tenant-spoof", VISIBLE, SPOOF)
    assert config.envs["NVIDIA_VISIBLE_DEVICES"] == pod.gpus[0]


def test_with_the_toolkits_defaults_the_same_spoof_gets_every_gpu(
    make_emulated_node: NodeFactory,
) -> None:
    """The test above would catch the hole: on a node left with the toolkit's defaults the
    spoofing pod gets both GPUs, with no shim and no limit."""
    node = make_emulated_node(
        gpus=2, config="version: v1\ndeviceListStrategy: envvar\n", toolkit=UNSAFE_DEFAULTS
    )
    spoofed = one(node.run_unallocated("spoof", VISIBLE, SPOOF))
    assert spoofed == {"init": 0, "count": 2}


def test_cdi_strategies_give_the_gpu_and_the_shim_from_the_spec(
    make_emulated_node: NodeFactory,
) -> None:
    node = make_emulated_node(
        config="version: v1\nsharing: {splitCount: 4}\ndeviceListStrategy: [cdi-cri]\n"
    )
    pod = node.admit("cdi", 1)
    assert not pod.envs and not list(pod.response.mounts)
    assert (node.cdi_dir / f"vgpu-plugin-allocation_{pod.allocation_id}.json").is_file()
    seen = one(node.run_container(pod, [*WORKLOAD, "view"]))
    assert seen["cuda_total"] == 4096 * MIB  # the shim from the CDI spec holds the limit
    assert one(node.run_unallocated("spoof", VISIBLE, SPOOF))["count"] <= 0
