"""The GPU-time publisher's view of who is guaranteed what (node/observe/nodeview.py's
GuaranteeIndex): kept from the ledger's changes, it must always equal the whole-ledger answer
(``guaranteed_gpus``), whoever changed the ledger and however far behind it fell, and read the
ledger whole only when it must."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from synthetic_regions import prepared_claim

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.ledger import state
from vgpu_plugin.node.ledger.dra_claims import claim_record
from vgpu_plugin.node.ledger.state import (
    PREPARED,
    PREPARING,
    RELEASING,
    AllocationRecord,
    AllocationStore,
)
from vgpu_plugin.node.observe.nodeview import GuaranteeIndex, guaranteed_gpus

GPUS = ("GPU-a", "GPU-b")


def limits(rng: random.Random) -> tuple[GpuLimit, ...]:
    return tuple(
        GpuLimit(u, 1024 * MIB, 0, rng.choice((0, 0, 25, 50)))
        for u in rng.sample(GPUS, rng.randint(1, 2))
    )


def device_plugin_record(rng: random.Random, n: int) -> AllocationRecord:
    return AllocationRecord(
        allocation_id=f"alloc-{n}",
        device_ids=(f"{GPUS[0]}-{n % 4}",),
        resource_name="nvidia.com/gpu",
        created=1_700_000_000.0 + n,
        limits=limits(rng),
        released=rng.choice((None, None, 1_700_000_500.0)),
    )


def dra_record(rng: random.Random, n: int) -> AllocationRecord:
    claim = prepared_claim(f"u-{n}", *limits(rng), created=1_700_000_000.0 + n)
    return claim_record(claim, rng.choice((PREPARING, PREPARED, PREPARED, RELEASING)))


class Counting:
    """The store, counting whole reads."""

    def __init__(self, store: AllocationStore) -> None:
        self.store = store
        self.snapshots = 0

    def snapshot(self) -> tuple[int, list[AllocationRecord]]:
        self.snapshots += 1
        return self.store.snapshot()

    def changed_since(self, version: int) -> tuple[int, dict[str, AllocationRecord | None]] | None:
        return self.store.changed_since(version)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_always_equals_the_whole_ledgers_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    monkeypatch.setattr(state, "CHANGES_KEPT", 32)
    rng = random.Random(seed)
    store = AllocationStore(tmp_path, compact_min=16)
    other = AllocationStore(tmp_path)  # another plugin process (a rolling update's overlap)
    ledger = Counting(store)
    index = GuaranteeIndex(ledger)
    legacy = [prepared_claim("old", GpuLimit("GPU-a", MIB, 0, 30), created=1.0)]
    made = 0
    for _ in range(60):
        for _ in range(rng.choice((0, 1, 3, 40))):  # 40: further behind than the changes kept
            writer = rng.choice((store, store, other))
            ids = [r.allocation_id for r in writer.all()]
            move = rng.random()
            if ids and move < 0.25:
                writer.remove(rng.choice(ids))
            elif ids and move < 0.5:  # replaced in place: released, another state
                n = int(rng.choice(ids).rsplit("-", 1)[1])
                make = device_plugin_record if rng.random() < 0.5 else dra_record
                writer.add(make(rng, n))
            else:
                made += 1
                make = device_plugin_record if rng.random() < 0.5 else dra_record
                writer.add_many([make(rng, made)], sync=rng.random() < 0.5)
        claims = legacy if rng.random() < 0.3 else []
        assert index.current(claims) == guaranteed_gpus(store.all(), claims)
    assert 1 < ledger.snapshots < 30  # whole reads only at first and when far behind


def test_a_round_with_nothing_changed_reads_nothing(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    rng = random.Random(1)
    store.add_many([device_plugin_record(rng, n) for n in range(2000)])
    ledger = Counting(store)
    index = GuaranteeIndex(ledger)
    first = index.current()
    assert first == guaranteed_gpus(store.all(), [])
    for _ in range(5):
        assert index.current() == first
    store.add(AllocationRecord("alloc-new", ("GPU-a-0",), "nvidia.com/gpu", 1.0,
                               (GpuLimit("GPU-b", MIB, 0, 25),)))  # fmt: skip
    assert index.current()["alloc-new"] == {"GPU-b"}
    assert ledger.snapshots == 1
