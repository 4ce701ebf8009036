"""Splitting GPUs into slices (docs/contracts.md#resource-and-device-ids)."""

from __future__ import annotations

import random

import pytest

from vgpu_plugin.core.config import Config, Match, Override, Sharing, parse_config
from vgpu_plugin.core.devices import (
    MIB,
    NodePlan,
    PhysicalGpu,
    parse_device_id,
    plan_gpu,
    plan_node,
    slice_memory_mib,
)

UUID_A = "GPU-709fac35-5f40-624b-90f7-b0a3db7a97a0"
UUID_B = "GPU-fcda056f-77c6-7fdf-f7c7-6453511eaaa1"


def gpu(
    index: int, uuid: str, memory_mib: int = 81559, name: str = "NVIDIA H100 80GB HBM3"
) -> PhysicalGpu:
    return PhysicalGpu(index, uuid, name, memory_mib * MIB, index, f"0000:0{index}:00.0", index)


def test_design_example_slice_size_and_compute() -> None:
    config = Config(sharing=Sharing(split_count=4, compute="proportional"))
    plan = plan_node(config, [gpu(0, UUID_A)], "node", {})
    (only,) = plan.gpus
    assert only.slice_memory_mib == 20389
    assert only.slice_compute_percent == 25
    assert [s.memory_mib for s in only.slices] == [20389] * 4


def test_ids_are_uuid_dash_k_in_order() -> None:
    plan = plan_node(Config(sharing=Sharing(split_count=3)), [gpu(0, UUID_A)], "n", {})
    assert [s.id for s in plan.all_slices()] == [f"{UUID_A}-0", f"{UUID_A}-1", f"{UUID_A}-2"]
    assert [s.k for s in plan.all_slices()] == [0, 1, 2]
    assert {s.gpu_uuid for s in plan.all_slices()} == {UUID_A}


def test_same_config_gives_the_same_plan_whatever_the_discovery_order() -> None:
    gpus = [gpu(1, UUID_B), gpu(0, UUID_A)]
    first = plan_node(Config(), gpus, "n", {})
    again = plan_node(Config(), list(reversed(gpus)), "n", {})
    assert first == again
    assert [g.gpu.index for g in first.gpus] == [0, 1]


@pytest.mark.parametrize(
    ("compute", "split", "percent"),
    [("none", 4, 0), ("proportional", 4, 25), ("proportional", 3, 33), ("proportional", 256, 1)],
)
def test_compute_share_per_slice(compute: str, split: int, percent: int) -> None:
    plan = plan_node(Config(sharing=Sharing(split, compute=compute)), [gpu(0, UUID_A)], "n", {})
    assert {s.compute_percent for s in plan.all_slices()} == {percent}


def test_fixed_percent_compute() -> None:
    plan = plan_node(Config(sharing=Sharing(4, compute=30)), [gpu(0, UUID_A)], "n", {})
    assert plan.gpus[0].slice_compute_percent == 30


def test_memory_scaling_uses_the_decimal_as_written() -> None:
    # 100 MiB x 0.29 is 28.999... in floats; the admin wrote 0.29, meaning 29 MiB.
    assert slice_memory_mib(100 * MIB, Sharing(split_count=1, memory_scaling=0.29)) == 29
    assert slice_memory_mib(81559 * MIB, Sharing(split_count=4, memory_scaling=1.5)) == 30584


def test_memory_counts_whole_mib_only() -> None:
    assert slice_memory_mib(4 * MIB + MIB - 1, Sharing(split_count=2)) == 2


def test_a_slice_never_has_zero_memory() -> None:
    assert slice_memory_mib(100 * MIB, Sharing(split_count=256)) == 1


def test_slice_memory_property_against_exact_arithmetic() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        total = rng.randrange(1, 200_000) * MIB + rng.randrange(MIB)
        split = rng.randrange(1, 257)
        scaling_text = f"{rng.randrange(1, 400) / 100:.2f}"
        got = slice_memory_mib(
            total, Sharing(split_count=split, memory_scaling=float(scaling_text))
        )
        hundredths = round(float(scaling_text) * 100)
        assert got == max(1, (total // MIB) * hundredths // (100 * split))


def test_overrides_apply_per_gpu_and_are_recorded() -> None:
    config = parse_config(
        """
version: v1
sharing: {splitCount: 10}
overrides:
  - match: {gpuModels: ["*A100*"]}
    sharing: {splitCount: 4, memoryScaling: 2}
"""
    )
    gpus = [gpu(0, UUID_A, 81920, "NVIDIA A100-SXM4-80GB"), gpu(1, UUID_B)]
    plan = plan_node(config, gpus, "n", {})
    a100, h100 = plan.gpus
    assert (len(a100.slices), a100.override, a100.slice_memory_mib) == (4, 0, 40960)
    assert (len(h100.slices), h100.override) == (10, None)
    assert a100.sharing.oversubscribed and not h100.sharing.oversubscribed


def test_node_placement_is_the_gpus_when_they_agree_else_the_base() -> None:
    spread_all = Config(
        overrides=(Override(Match(node_names=("n",)), {"placement": "spread"}),),
    )
    assert plan_node(spread_all, [gpu(0, UUID_A), gpu(1, UUID_B)], "n", {}).placement == "spread"
    spread_one = Config(
        overrides=(Override(Match(gpu_uuids=(UUID_A,)), {"placement": "spread"}),),
    )
    mixed = plan_node(spread_one, [gpu(0, UUID_A), gpu(1, UUID_B)], "n", {})
    assert mixed.placement == "binpack"


def test_fail_requests_greater_than_one_reaches_the_plan() -> None:
    config = Config(fail_requests_greater_than_one=True)
    assert plan_node(config, [gpu(0, UUID_A)], "n", {}).fail_requests_greater_than_one


def test_numa_node_is_carried_to_every_slice() -> None:
    no_numa = PhysicalGpu(0, UUID_A, "x", 1024 * MIB, 0, "b", None)
    plan = plan_node(Config(), [no_numa, gpu(1, UUID_B)], "n", {})
    assert {s.numa_node for s in plan.gpus[0].slices} == {None}
    assert {s.numa_node for s in plan.gpus[1].slices} == {1}


def test_duplicate_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="uuid"):
        plan_node(Config(), [gpu(0, UUID_A), gpu(1, UUID_A)], "n", {})
    with pytest.raises(ValueError, match="index"):
        plan_node(Config(), [gpu(0, UUID_A), gpu(0, UUID_B)], "n", {})


def test_lookup_by_id_and_by_gpu() -> None:
    plan = plan_node(Config(sharing=Sharing(split_count=2)), [gpu(0, UUID_A)], "n", {})
    assert plan.slice(f"{UUID_A}-1") == plan.gpus[0].slices[1]
    assert plan.slice(f"{UUID_A}-2") is None
    assert plan.gpu(UUID_A) is plan.gpus[0]
    assert plan.gpu(UUID_B) is None


def test_empty_node() -> None:
    plan = plan_node(Config(), [], "n", {})
    assert plan == NodePlan("nvidia.com/gpu", ())
    assert plan.all_slices() == ()


def test_plan_gpu_rejects_an_unvalidated_compute() -> None:
    with pytest.raises(ValueError, match="compute"):
        plan_gpu(gpu(0, UUID_A), Sharing(compute="half"))


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (f"{UUID_A}-0", (UUID_A, 0)),
        (f"{UUID_A}-255", (UUID_A, 255)),
        ("GPU-1234-5678-12", ("GPU-1234-5678", 12)),
        (f"{UUID_A}-03", None),
        (f"{UUID_A}--1", None),
        (f"{UUID_A}::3", None),
        (UUID_A, None),
        ("3", None),
        ("", None),
        (f"{UUID_A}-1 ", None),
        (f"{UUID_A}-1\n", None),  # "$" would match before the newline
    ],
)
def test_parse_device_id(text: str, parsed: tuple[str, int] | None) -> None:
    assert parse_device_id(text) == parsed
