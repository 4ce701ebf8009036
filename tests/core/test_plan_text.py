"""The plan as check-config prints it, and the ListAndWatch size estimate."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import MIB, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.plan_text import listandwatch_size, render_plan

A100 = PhysicalGpu(0, "GPU-aaaa-0001", "NVIDIA A100-SXM4-80GB", 81920 * MIB, 0, "b0", 0)
H100 = PhysicalGpu(1, "GPU-bbbb-0002", "NVIDIA H100 80GB HBM3", 81559 * MIB, 1, "b1", 1)

CONFIG = """
sharing: {splitCount: 4, compute: proportional}
overrides:
  - match: {nodeNames: [other]}
    sharing: {splitCount: 2}
  - match: {gpuModels: ["*A100*"]}
    sharing: {splitCount: 8, memoryScaling: 1.5, compute: none}
"""


def plan() -> NodePlan:
    return plan_node(parse_config(CONFIG), [A100, H100], "gpu-1", {})


def cells(text: str, row: int) -> list[str]:
    """The table row's cells (split on the two-space column gap)."""
    line = text.splitlines()[row + 1]
    return [c.strip() for c in line.split("  ") if c.strip()]


def test_header_counts_gpus_and_slices() -> None:
    text = render_plan(plan())
    assert text.splitlines()[0] == (
        "resource nvidia.com/gpu: 2 GPU(s), 12 slice(s), placement binpack"
    )


def test_one_row_per_gpu_with_its_split_and_rule() -> None:
    text = render_plan(plan())
    assert cells(text, 0)[0] == "GPU"
    assert cells(text, 1) == [
        "0",
        "NVIDIA A100-SXM4-80GB",
        "GPU-aaaa-0001",
        "81920 MiB",
        "8",
        "15360 MiB",
        "not limited",
        "1.5 (oversubscribed)",
        "binpack",
        "overrides[1]",
    ]
    assert cells(text, 2) == [
        "1",
        "NVIDIA H100 80GB HBM3",
        "GPU-bbbb-0002",
        "81559 MiB",
        "4",
        "20389 MiB",
        "25 % (proportional)",
        "1.0",
        "binpack",
        "default",
    ]


def test_columns_line_up() -> None:
    lines = render_plan(plan()).splitlines()[1:]
    starts = {line.index("GPU-") for line in lines[1:]}
    assert starts == {lines[0].index("UUID")}


def test_an_empty_node_says_so() -> None:
    text = render_plan(plan_node(parse_config("version: v1"), [], "n", {}))
    assert "0 GPU(s)" in text and "(no GPUs)" in text


# ListAndWatch size, checked against protobuf's own encoder ----------------------------------


def _response_class() -> Any:
    """ListAndWatchResponse as the kubelet's v1beta1 api.proto defines it, with the three
    messages it holds (same field numbers and types)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="vgpu_test_listandwatch.proto", package="v1beta1test", syntax="proto3"
    )
    t = descriptor_pb2.FieldDescriptorProto

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            f = m.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                f.type_name = type_name

    message("NUMANode", ("ID", 1, t.TYPE_INT64, t.LABEL_OPTIONAL, ""))
    message(
        "TopologyInfo",
        ("nodes", 1, t.TYPE_MESSAGE, t.LABEL_REPEATED, ".v1beta1test.NUMANode"),
    )
    message(
        "Device",
        ("ID", 1, t.TYPE_STRING, t.LABEL_OPTIONAL, ""),
        ("health", 2, t.TYPE_STRING, t.LABEL_OPTIONAL, ""),
        ("topology", 3, t.TYPE_MESSAGE, t.LABEL_OPTIONAL, ".v1beta1test.TopologyInfo"),
    )
    message(
        "ListAndWatchResponse",
        ("devices", 1, t.TYPE_MESSAGE, t.LABEL_REPEATED, ".v1beta1test.Device"),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    found = pool.FindMessageTypeByName("v1beta1test.ListAndWatchResponse")
    return message_factory.GetMessageClass(found)


def _encoded_size(node: NodePlan, health: str) -> int:
    response = _response_class()()
    for s in node.all_slices():
        device = response.devices.add(ID=s.id, health=health)
        if s.numa_node is not None:
            device.topology.nodes.add(ID=s.numa_node)
    return len(response.SerializeToString())


@pytest.mark.parametrize("health", ["Healthy", "Unhealthy"])
@pytest.mark.parametrize("numa", [None, 0, 1, 200, -1])
@pytest.mark.parametrize("split", [1, 10, 256])
def test_listandwatch_size_is_exact(health: str, numa: int | None, split: int) -> None:
    gpus = [
        PhysicalGpu(i, f"GPU-{i:08x}-5f40-624b-90f7-b0a3db7a97a0", "G", 1 << 34, i, "b", numa)
        for i in range(8)
    ]
    node = plan_node(parse_config(f"sharing: {{splitCount: {split}}}"), gpus, "n", {})
    assert listandwatch_size(node, health) == _encoded_size(node, health)


def test_listandwatch_default_is_the_unhealthy_upper_bound() -> None:
    assert listandwatch_size(plan()) == _encoded_size(plan(), "Unhealthy")
    assert listandwatch_size(plan()) > listandwatch_size(plan(), "Healthy")
