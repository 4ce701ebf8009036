"""The plan as check-config prints it, and the ListAndWatch size estimate."""

from __future__ import annotations

from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import MIB, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.plan_text import render_plan

A100 = PhysicalGpu(0, "GPU-aaaa-0001", "NVIDIA A100-SXM4-80GB", 81920 * MIB, 0, "b0", 0)
H100 = PhysicalGpu(1, "GPU-bbbb-0002", "NVIDIA H100 80GB HBM3", 81559 * MIB, 1, "b1", 1)

CONFIG = """
version: v1
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
