"""GetPreferredAllocation advice: binpack and spread, and what always holds."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from vgpu_plugin.core.config import Config, Match, Override, Sharing
from vgpu_plugin.core.devices import MIB, GpuLimit, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.placement import held_by_gpu, policy_for, preferred_allocation


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-000000000000"


def node(gpus: int, split: int) -> NodePlan:
    physical = [PhysicalGpu(i, uuid(i), "G", 16384 * MIB, i, "b", 0) for i in range(gpus)]
    return plan_node(Config(sharing=Sharing(split_count=split)), physical, "n", {})


def ids(gpu: int, *ks: int) -> list[str]:
    return [f"{uuid(gpu)}-{k}" for k in ks]


def per_gpu(plan: NodePlan, chosen: list[str]) -> Counter[int]:
    index = {g.gpu.uuid: g.gpu.index for g in plan.gpus}
    counts: Counter[int] = Counter()
    for device_id in chosen:
        found = plan.slice(device_id)
        assert found is not None
        counts[index[found.gpu_uuid]] += 1
    return counts


# binpack ---------------------------------------------------------------------------------------


def test_binpack_fits_a_request_on_one_gpu_and_picks_the_fullest() -> None:
    plan = node(3, 4)
    available = ids(0, 0, 1, 2, 3) + ids(1, 2, 3) + ids(2, 1, 2, 3)
    assert preferred_allocation(plan, available, [], 2, "binpack") == ids(1, 2, 3)
    # Three do not fit on GPU 1 any more: GPU 2 is the fullest that holds them.
    assert preferred_allocation(plan, available, [], 3, "binpack") == ids(2, 1, 2, 3)


def test_binpack_ties_go_to_the_lower_index_then_lower_k() -> None:
    plan = node(2, 4)
    available = ids(1, 3, 0) + ids(0, 2, 1)
    assert preferred_allocation(plan, available, [], 1, "binpack") == ids(0, 1)


def test_binpack_uses_as_few_gpus_as_possible() -> None:
    plan = node(4, 8)
    # 8, 8, 3 and 2 free: ten slices need two GPUs; one of them must be an 8.
    available = ids(0, *range(8)) + ids(1, *range(8)) + ids(2, 5, 6, 7) + ids(3, 6, 7)
    chosen = preferred_allocation(plan, available, [], 10, "binpack")
    assert len(chosen) == 10
    counts = per_gpu(plan, chosen)
    assert len(counts) == 2
    assert counts == Counter({3: 2, 0: 8})  # the fullest pair that covers the request


def test_binpack_prefers_full_gpus_among_equally_few() -> None:
    plan = node(3, 8)
    # 8, 5 and 5 free: two GPUs are needed; both fives keep the empty GPU whole.
    available = ids(0, *range(8)) + ids(1, *range(3, 8)) + ids(2, *range(3, 8))
    counts = per_gpu(plan, preferred_allocation(plan, available, [], 10, "binpack"))
    assert counts == Counter({1: 5, 2: 5})


def test_binpack_fills_the_must_include_gpu_first() -> None:
    plan = node(2, 4)
    available = ids(0, 0, 1, 2, 3) + ids(1, 3)
    chosen = preferred_allocation(plan, available, ids(0, 2), 3, "binpack")
    assert chosen == ids(0, 0, 1, 2)


def test_binpack_among_must_include_gpus_fills_the_fullest() -> None:
    plan = node(3, 4)
    available = ids(0, 0, 1, 2, 3) + ids(1, 2, 3) + ids(2, 0, 1, 2, 3)
    chosen = preferred_allocation(plan, available, ids(0, 0) + ids(1, 2), 3, "binpack")
    assert chosen == ids(0, 0) + ids(1, 2, 3)


# spread ----------------------------------------------------------------------------------------


def test_spread_takes_one_slice_per_gpu_least_used_first() -> None:
    plan = node(4, 4)
    available = ids(0, 3) + ids(1, 0, 1, 2, 3) + ids(2, 1, 2, 3) + ids(3, 2, 3)
    chosen = preferred_allocation(plan, available, [], 3, "spread")
    assert chosen == ids(1, 0) + ids(2, 1) + ids(3, 2)


def test_spread_goes_round_again_when_there_are_more_slices_than_gpus() -> None:
    plan = node(2, 4)
    available = ids(0, 0, 1, 2, 3) + ids(1, 0, 1, 2, 3)
    counts = per_gpu(plan, preferred_allocation(plan, available, [], 5, "spread"))
    assert sorted(counts.values()) == [2, 3]


def test_spread_avoids_the_gpus_must_include_already_uses() -> None:
    plan = node(3, 4)
    available = ids(0, 0, 1, 2, 3) + ids(1, 0, 1) + ids(2, 0, 1, 2)
    chosen = preferred_allocation(plan, available, ids(0, 0), 3, "spread")
    assert per_gpu(plan, chosen) == Counter({0: 1, 1: 1, 2: 1})


# what always holds -----------------------------------------------------------------------------


def test_unknown_ids_are_ignored() -> None:
    plan = node(1, 2)
    available = ["bogus", f"{uuid(9)}-0", *ids(0, 0, 1, 7)]
    assert preferred_allocation(plan, available, ["nope"], 2, "binpack") == ids(0, 0, 1)


def test_more_than_available_returns_what_there_is() -> None:
    plan = node(2, 2)
    available = ids(0, 1) + ids(1, 0)
    for policy in ("binpack", "spread"):
        assert sorted(preferred_allocation(plan, available, [], 5, policy)) == sorted(available)


def test_must_include_wins_over_size() -> None:
    plan = node(1, 4)
    must = ids(0, 0, 1, 2)
    assert preferred_allocation(plan, ids(0, 0, 1, 2, 3), must, 2, "binpack") == must


def test_duplicates_in_the_request_do_not_come_back_twice() -> None:
    plan = node(1, 4)
    available = ids(0, 1, 1, 2, 2)
    assert preferred_allocation(plan, available, ids(0, 1, 1), 3, "binpack") == ids(0, 1, 2)


def test_zero_size_asks_for_nothing() -> None:
    assert preferred_allocation(node(1, 4), ids(0, 0, 1), [], 0, "spread") == []


def test_an_unknown_policy_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="binpack or spread"):
        preferred_allocation(node(1, 1), ids(0, 0), [], 1, "random")


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_properties_on_random_nodes(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    plan = node(rng.randint(1, 8), rng.randint(1, 32))
    every = [s.id for s in plan.all_slices()]
    for _ in range(25):
        available = rng.sample(every, rng.randint(0, len(every)))
        must = rng.sample(available, rng.randint(0, min(3, len(available))))
        size = rng.randint(len(must), len(every) + 2)
        noise = ["junk", f"{uuid(99)}-0"]
        chosen = preferred_allocation(plan, available + noise, must + noise[:1], size, policy)
        assert len(chosen) == len(set(chosen)), "distinct"
        assert set(must) <= set(chosen), "every must-include"
        assert set(chosen) <= set(available) | set(must), "only offered IDs"
        assert len(chosen) == min(size, len(set(available) | set(must))), "size when possible"
        again = preferred_allocation(plan, available + noise, must + noise[:1], size, policy)
        assert again == chosen, "deterministic"
        if policy == "spread":
            # No GPU gets a second slice while another offered GPU has none.
            counts = per_gpu(plan, chosen)
            offered = per_gpu(plan, available)
            if not must and len(chosen) < len(offered):
                assert max(counts.values(), default=0) <= 1


@pytest.mark.parametrize("seed", range(40))
def test_binpack_uses_the_fewest_gpus_possible(seed: int) -> None:
    rng = random.Random(1000 + seed)
    plan = node(rng.randint(1, 8), rng.randint(1, 16))
    every = [s.id for s in plan.all_slices()]
    for _ in range(25):
        available = rng.sample(every, rng.randint(1, len(every)))
        size = rng.randint(1, len(available))
        chosen = preferred_allocation(plan, available, [], size, "binpack")
        free = sorted(per_gpu(plan, available).values(), reverse=True)
        fewest = next(n for n in range(1, len(free) + 1) if sum(free[:n]) >= size)
        assert len(per_gpu(plan, chosen)) == fewest


def test_answers_every_request_on_8_gpus_of_32_slices() -> None:
    # Its speed is a figure of bench/bench_plugin.py (GetPreferredAllocation p50/p99), not a
    # timed assertion: here every answer on a large node is a valid one.
    plan = node(8, 32)
    rng = random.Random(3)
    every = [s.id for s in plan.all_slices()]
    for policy in ("binpack", "spread"):
        for _ in range(50):
            available = rng.sample(every, 200)
            size = rng.randint(1, 64)
            must = available[:1]
            got = preferred_allocation(plan, available, must, size, policy)
            assert len(got) == size, (policy, size)
            assert len(set(got)) == size and set(got) <= set(available)
            assert must[0] in got


# What live allocations hold ----------------------------------------------------------------------


def test_binpack_weighs_the_memory_held_not_the_free_ids() -> None:
    # Split 4 -> 8 on 16 GiB GPUs: GPU 0's old slices hold all its memory, four new IDs look free.
    plan = node(2, 8)
    held = held_by_gpu([GpuLimit(uuid(0), 8192 * MIB, 0), GpuLimit(uuid(0), 8192 * MIB, 0)])
    available = ids(0, 4, 5, 6, 7) + ids(1, *range(8))
    assert preferred_allocation(plan, available, [], 2, "binpack", held) == ids(1, 0, 1)
    # Half of GPU 0 held: it still has room for two slices, and is the fuller GPU.
    half = held_by_gpu([GpuLimit(uuid(0), 8192 * MIB, 0)])
    assert preferred_allocation(plan, available, [], 2, "binpack", half) == ids(0, 4, 5)
    # Past every GPU's room the advice still answers, with what is offered.
    full = held_by_gpu([GpuLimit(uuid(g), 16384 * MIB, 0) for g in (0, 1)])
    assert len(preferred_allocation(plan, available, [], 3, "binpack", full)) == 3


def test_spread_counts_held_compute_as_use() -> None:
    physical = [PhysicalGpu(i, uuid(i), "G", 16384 * MIB, i, "b", 0) for i in range(2)]
    config = Config(sharing=Sharing(split_count=4, compute="proportional"))
    plan = plan_node(config, physical, "n", {})
    # GPU 0 offers more IDs, but old allocations hold 75 % of its compute.
    held = held_by_gpu([GpuLimit(uuid(0), 0, 75)])
    available = ids(0, 0, 1, 2, 3) + ids(1, 2, 3)
    assert preferred_allocation(plan, available, [], 1, "spread", held) == ids(1, 2)


def test_the_policy_is_that_of_the_gpus_offered() -> None:
    physical = [PhysicalGpu(i, uuid(i), f"M{i}", 16384 * MIB, i, "b", 0) for i in range(3)]
    config = Config(
        sharing=Sharing(split_count=4),
        overrides=(Override(Match(gpu_models=("M1", "M2")), {"placement": "spread"}),),
    )
    plan = plan_node(config, physical, "n", {})
    assert policy_for(plan, [uuid(1), uuid(2)]) == "spread"
    assert policy_for(plan, [uuid(0), uuid(1)]) == "binpack"  # they disagree: the base
    available = ids(1, 0, 1, 2, 3) + ids(2, 0, 1, 2, 3)
    assert per_gpu(plan, preferred_allocation(plan, available, [], 2)) == {1: 1, 2: 1}
