"""One allocation ledger for both front ends (issue 21, item 1): a DRA claim is a record of
the journal, the previous version's ``dra-claims.json`` migrates into it, and the cleanup
owns exactly what the ledger owns."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from kubelet.test_dra_driver import AAAA, DEV_A, make_driver

from vgpu_plugin.commands.serve import _open_store, new_cleaner
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.kubelet.dra.driver import ClaimRef, DraDriver
from vgpu_plugin.node.ledger.dra_claims import (
    FILE_NAME,
    ClaimLedger,
    claim_of,
    claim_record,
    migrate_claims_file,
)
from vgpu_plugin.node.ledger.state import (
    DEVICE_PLUGIN,
    DRA,
    PREPARED,
    PREPARING,
    RELEASING,
    AllocationRecord,
    AllocationStore,
)
from vgpu_plugin.sim.dra_kubelet import FakeApiServer

GIB = 1 << 30
# Written by the plugin before the one ledger (PreparedClaims.add, commit b4693ed): a 6Gi 30%
# claim on GPU aaaa and a 1500M claim on GPU bbbb.
V1_CLAIMS = Path(__file__).parent.parent / "data" / "dra-claims-v1.json"


def prepare_claim(api: FakeApiServer, driver: DraDriver, name: str, memory: str) -> ClaimRef:
    api.add_claim("ml", name, {"gpu": {"memory": memory, "compute": "30"}})
    claim = api.allocate("ml", name, DEV_A)
    ref = ClaimRef("ml", claim["metadata"]["uid"], name)  # type: ignore[index]
    driver.prepare(ref)
    return ref


def claim_files(root: Path, uid: str) -> list[Path]:
    aid = f"dra-{uid}"
    return [
        root / "vgpu" / "containers" / aid,
        root / "vgpu" / "limits" / aid,
        root / "cdi" / f"vgpu-plugin-allocation_{aid}.json",
    ]


def test_a_prepared_claim_outlives_any_number_of_sweeps_with_no_process_alive(
    tmp_path: Path,
) -> None:
    """The driver and the cleaner over one store, as ``serve`` wires them; the claim's pod is
    idle (no process in its region) and pod-resources answers (nothing of the device plugin's
    held). Before the one ledger the sweep removed all three files once the grace passed."""
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    driver.publish("test")
    ref = prepare_claim(api, driver, "infer", "6Gi")
    store = driver._claims.store  # the one store serve gives both
    now = [time.time()]
    cleaner = new_cleaner(
        store,
        tmp_path / "vgpu",
        lambda: {},
        grace=60,
        cdi_spec_dir=tmp_path / "cdi",
        clock=lambda: now[0],
    )
    files = claim_files(tmp_path, ref.uid)
    for _ in range(24):  # a day of hourly sweeps
        now[0] += 3600
        cleaner.run_once()
    assert all(p.exists() for p in files), [p for p in files if not p.exists()]
    assert [c.uid for c in driver.prepared()] == [ref.uid]
    # Its unprepare still ends it, files and record.
    driver.unprepare(ref)
    assert not any(p.exists() for p in files) and store.all() == []


def test_a_claim_record_is_one_journal_record_with_its_limits_in_bytes(tmp_path: Path) -> None:
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    driver.publish("test")
    ref = prepare_claim(api, driver, "one", "6Gi")
    reopened = AllocationStore(tmp_path / "state")  # another process reading the journal
    (record,) = reopened.all()
    assert (record.front_end, record.state) == (DRA, PREPARED)
    assert (record.claim_namespace, record.claim_name, record.claim_uid) == ("ml", "one", ref.uid)
    assert record.limits == (GpuLimit(AAAA, 6 * GIB, 30),)
    assert claim_of(record) == driver.prepared()[0]
    # Bytes, not MiB: a limit that is no whole MiB comes back exact.
    odd = dataclasses.replace(record, limits=(GpuLimit(AAAA, 1_024_000_000, 30),))
    reopened.add(odd)
    assert AllocationStore(tmp_path / "state").all()[0].limits == odd.limits


def test_a_device_plugin_record_of_the_previous_version_reads_as_one() -> None:
    raw = {
        "allocation_id": "0190a1b2c3d400000001",
        "device_ids": ["GPU-a-0"],
        "resource_name": "nvidia.com/gpu",
        "created": 1.0,
        "limits": [["GPU-a", 1024, 25]],  # [uuid, MiB, compute]: before the ledger
        "pod": None,
        "namespace": None,
        "container": None,
    }
    r = AllocationRecord.from_wire(raw)
    assert (r.front_end, r.state, r.limits) == (
        DEVICE_PLUGIN,
        PREPARED,
        (GpuLimit("GPU-a", 1024 * MIB, 25),),
    )
    # Written now: older readers still find [uuid, MiB, compute] first.
    assert r.to_wire()["limits"] == [["GPU-a", 1024, 25, 1024 * MIB]]


def test_the_previous_versions_claims_file_migrates_into_the_ledger_on_first_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    shutil.copy(V1_CLAIMS, state / FILE_NAME)
    old = json.loads(V1_CLAIMS.read_text())["claims"]
    with caplog.at_level(logging.INFO):
        store = _open_store(state)  # serve's start
    assert not (state / FILE_NAME).exists()
    assert (state / f"{FILE_NAME}.migrated").read_bytes() == V1_CLAIMS.read_bytes()
    assert "imported 2 DRA claims" in caplog.text
    records = AllocationStore(state).all()  # what a restarted plugin reads
    assert [(r.front_end, r.state, r.claim_uid) for r in records] == [
        (DRA, PREPARED, c["uid"]) for c in old
    ]
    for r, c in zip(records, old, strict=True):
        assert [[g.uuid, g.memory_bytes, g.compute_percent] for g in r.limits] == c["limits"]
        claim = claim_of(r)
        assert (claim.namespace, claim.name) == (c["namespace"], c["name"])
        assert (claim.allocation_dir, claim.limits_path) == (
            c["allocation_dir"],
            c["limits_path"],
        )
        assert [list(d.cdi_device_ids) for d in claim.devices] == [
            d["cdi_device_ids"] for d in c["devices"]
        ]
        assert [d.share_id for d in claim.devices] == [d["share_id"] for d in c["devices"]]
    # The driver answers a kubelet retry from the migrated record, without the API server.
    api = FakeApiServer()
    api.fail_reads = True
    driver = make_driver(tmp_path, api)
    driver._claims = ClaimLedger(store)
    devices = driver.prepare(ClaimRef("ml", old[0]["uid"], "infer"))
    assert devices[0].share_id == old[0]["devices"][0]["share_id"]
    assert api.claim_reads == 0
    # A second start finds nothing to migrate and keeps the records.
    assert migrate_claims_file(store) == 0 and len(store.all()) == 2


def test_an_unreadable_claims_file_is_moved_aside_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / FILE_NAME).write_text('{"format": "something else"}')
    store = AllocationStore(state)
    assert migrate_claims_file(store) == 0
    (aside,) = state.glob(f"{FILE_NAME}.corrupt-*")
    assert aside.read_text() == '{"format": "something else"}'
    assert f"DRA claims file {state / FILE_NAME} is unreadable" in caplog.text


def test_a_claim_a_crash_left_half_way_is_finished_at_start(tmp_path: Path) -> None:
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    driver.publish("test")
    a = prepare_claim(api, driver, "a", "1Gi")
    b = prepare_claim(api, driver, "b", "1Gi")
    c = prepare_claim(api, driver, "c", "1Gi")
    store = driver._claims.store
    for ref, state in ((a, PREPARING), (b, RELEASING)):
        record = store.get(f"dra-{ref.uid}")
        assert record is not None
        store.add(claim_record(claim_of(record), state))
    restarted = make_driver(tmp_path, api)
    # Just now: maybe another plugin process's prepare in progress (a rolling update).
    assert restarted.recover() == 0 and len(restarted._claims.unfinished()) == 2
    assert restarted.recover(min_age=0) == 2
    for ref in (a, b):
        assert not any(p.exists() for p in claim_files(tmp_path, ref.uid))
    assert [r.claim_uid for r in AllocationStore(tmp_path / "state").all()] == [c.uid]
    assert all(p.exists() for p in claim_files(tmp_path, c.uid))


def test_the_cleanup_releases_as_every_path_does_mark_remove_drop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vgpu_plugin.node.host import cleanup

    store = AllocationStore(tmp_path / "state")
    aid = "0190a1b2c3d400000001"
    store.add(AllocationRecord(aid, ("GPU-a-0",), "nvidia.com/gpu", 0.0))
    (tmp_path / "vgpu" / "containers" / aid).mkdir(parents=True)
    now = [1000.0]
    cleaner = new_cleaner(
        store, tmp_path / "vgpu", lambda: {}, 60, tmp_path / "cdi", clock=lambda: now[0]
    )

    def refused(*_: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cleanup, "remove_allocation_files", refused)
    cleaner.run_once()
    assert store.get(aid) is not None and store.get(aid).state == PREPARED  # type: ignore[union-attr]
    now[0] += 61
    cleaner.run_once()
    assert store.get(aid).state == RELEASING  # type: ignore[union-attr]
    monkeypatch.undo()
    now[0] += 1
    cleaner.run_once()
    assert store.get(aid) is None
    assert not (tmp_path / "vgpu" / "containers" / aid).exists()


def test_claims_the_api_server_no_longer_has_are_released(tmp_path: Path) -> None:
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    driver.publish("test")
    kept = prepare_claim(api, driver, "kept", "1Gi")
    deleted = prepare_claim(api, driver, "deleted", "1Gi")
    remade = prepare_claim(api, driver, "remade", "1Gi")
    del api.claims[("ml", "deleted")]
    api.claims[("ml", "remade")]["metadata"]["uid"] = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    api.fail_reads = True  # the API server does not answer: nothing is stale
    assert driver.release_stale() == 0 and len(driver.prepared()) == 3
    api.fail_reads = False
    assert driver.release_stale() == 2
    assert [c.uid for c in driver.prepared()] == [kept.uid]
    for ref in (deleted, remade):
        assert not any(p.exists() for p in claim_files(tmp_path, ref.uid))
    assert all(p.exists() for p in claim_files(tmp_path, kept.uid))
    assert driver.release_stale() == 0


def test_a_front_ends_records_stay_those_of_the_whole_ledger_through_every_change(
    tmp_path: Path,
) -> None:
    """``of_front_end`` keeps DRA's records apart so a prepare does not scan the device
    plugin's thousands: it must stay exactly the DRA records of ``all()``, whichever way the
    ledger changes (this process, another process's appends, a compaction)."""
    store = AllocationStore(tmp_path, compact_min=4)

    def dra(i: int, state: str = PREPARED) -> AllocationRecord:
        return AllocationRecord(
            f"dra-{i:08d}-0000-0000-0000-000000000000", (), DRA, 1000.0 + i,
            (GpuLimit(AAAA, GIB, 30),), front_end=DRA, state=state,
            claim_uid=f"{i:08d}-0000-0000-0000-000000000000", claim_namespace="ml",
            claim_name=f"c{i}",
        )  # fmt: skip

    def plugin(i: int) -> AllocationRecord:
        return AllocationRecord(f"{i:020x}", (f"{AAAA}-{i}",), "nvidia.com/gpu", 500.0 + i)

    def check(s: AllocationStore) -> None:
        assert s.of_front_end(DRA) == [r for r in s.all() if r.front_end == DRA]

    with pytest.raises(ValueError):
        store.of_front_end(DEVICE_PLUGIN)
    store.add_many([plugin(i) for i in range(6)] + [dra(1), dra(2)])
    check(store)
    store.add_many([dra(3, PREPARING)], sync=False)
    check(store)
    store.add_many([dra(3)])  # a state change in place
    store.remove(dra(1).allocation_id)
    check(store)
    # A record that changes front end (never made by the plugin; the index must not keep it).
    store.add(dataclasses.replace(dra(2), front_end=DEVICE_PLUGIN))
    check(store)
    other = AllocationStore(tmp_path, compact_min=4)  # another plugin process
    other.add_many([dra(4), plugin(7)])
    other.remove(dra(3).allocation_id)
    check(store)
    assert [r.claim_name for r in store.of_front_end(DRA)] == ["c4"]
    for i in range(10):  # enough dead entries for a compaction
        store.add(dataclasses.replace(plugin(i % 3), created=900.0 + i))
    check(store)
    check(other)
    check(AllocationStore(tmp_path))
