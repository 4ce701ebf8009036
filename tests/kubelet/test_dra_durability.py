"""A prepared claim survives a power loss (docs/contracts.md#durability): the kubelet checkpoints
a claim as prepared once answered and never asks again, so the driver syncs one write before
answering (the claim's ``prepared`` record, which holds its limits, devices and paths), leaves
its files to the syncer, and at the first start of a boot writes back what a power loss took of
them, before it registers. Within one boot nothing is rebuilt, and an unprepared claim never
comes back."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from commands.test_serve import serve_with_dra, wait_until
from core.test_cdi import validator
from kubelet.test_dra_driver import DEV_A, GPUS, make_driver

from vgpu_plugin.core import dra
from vgpu_plugin.core.config import Config, DraConfig
from vgpu_plugin.kubelet.dra.driver import ClaimRef, DraDriver
from vgpu_plugin.node.host.atomicfile import DeferredSync
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import RELEASING, AllocationStore
from vgpu_plugin.sim.dra_kubelet import FakeApiServer
from vgpu_plugin.sim.simgpu import Node

DRIVER = dra.DRIVER_NAME


def new_driver(root: Path, api: FakeApiServer, syncer: DeferredSync | None) -> DraDriver:
    driver = make_driver(root, api, syncer)
    assert driver.publish("started")  # the slice the fake API server allocates from
    return driver


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


def claim(api: FakeApiServer, name: str) -> ClaimRef:
    api.add_claim("ml", name, {"gpu": {"memory": "2Gi", "compute": "20"}})
    meta = api.allocate("ml", name, DEV_A)["metadata"]
    return ClaimRef("ml", str(meta["uid"]), name)  # type: ignore[index]


def files_of(root: Path, uid: str) -> dict[str, bytes | None]:
    aid = f"dra-{uid}"
    paths = [
        root / "vgpu" / "limits" / aid,
        root / "vgpu" / "containers" / aid,
        root / "cdi" / f"vgpu-plugin-allocation_{aid}.json",
    ]
    return {
        str(p): (p.read_bytes() if p.is_file() else b"<dir>" if p.is_dir() else None) for p in paths
    }


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every fsync and fdatasync of this process, by the path synced."""
    seen: list[str] = []

    def counted(real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return sync

    monkeypatch.setattr(os, "fsync", counted(os.fsync))
    monkeypatch.setattr(os, "fdatasync", counted(os.fdatasync))
    yield seen


def test_prepare_syncs_only_its_record_before_answering(
    tmp_path: Path, api: FakeApiServer, syncs: list[str]
) -> None:
    syncer = DeferredSync()  # not started: it syncs when waited on, as a pass after the answer
    driver = new_driver(tmp_path, api, syncer)
    ref = claim(api, "infer")
    syncs.clear()
    driver.prepare(ref)
    journal = str(tmp_path / "state" / "allocations.journal")
    assert syncs == [journal]  # one fdatasync: the ``prepared`` record
    files = files_of(tmp_path, ref.uid)
    assert all(v is not None for v in files.values())
    syncs.clear()
    syncer.wait()
    # The syncer then makes the files and the dirs that name them durable.
    limits, region, spec = files
    for path in (limits, spec, str(Path(limits).parent), str(Path(region).parent)):
        assert path in syncs, syncs
    # Without a syncer (a driver on its own) everything is synced before the answer.
    plain = new_driver(tmp_path / "plain", api, None)
    other = claim(api, "other")
    syncs.clear()
    plain.prepare(other)
    limits, _, spec = files_of(tmp_path / "plain", other.uid)
    # (synced under their temporary names, before the rename)
    for path in (limits, spec, str(Path(limits).parent), str(Path(spec).parent)):
        assert any(s.startswith(path) for s in syncs), (path, syncs)


def test_the_rebuild_writes_back_what_a_power_loss_took_from_the_record(
    tmp_path: Path, api: FakeApiServer
) -> None:
    driver = new_driver(tmp_path, api, DeferredSync())
    lost, kept, gone, stuck = (claim(api, n) for n in ("lost", "kept", "gone", "stuck"))
    for ref in (lost, kept, gone, stuck):
        driver.prepare(ref)
    before = files_of(tmp_path, lost.uid)
    kept_before = files_of(tmp_path, kept.uid)
    kept_inode = (tmp_path / "vgpu" / "limits" / f"dra-{kept.uid}").stat().st_ino
    driver.unprepare(gone)
    ledger = ClaimLedger(AllocationStore(tmp_path / "state"))
    record = ledger.record(f"dra-{stuck.uid}")
    assert record is not None
    ledger.mark(record, RELEASING)  # a crash in the middle of its unprepare
    # The power loss: renames whose data never reached the disk read empty, the rest is gone.
    limits, region, spec = before
    os.unlink(limits)
    Path(spec).write_bytes(b"")
    os.rmdir(region)
    for path in files_of(tmp_path, stuck.uid):
        if os.path.isfile(path):
            os.unlink(path)
    restarted = new_driver(tmp_path, api, DeferredSync())
    assert restarted.rebuild() == (1, 1, 0)  # kept intact, lost rebuilt
    assert files_of(tmp_path, lost.uid) == before
    validator().validate(json.loads(Path(spec).read_text()))
    assert files_of(tmp_path, kept.uid) == kept_before
    assert (tmp_path / "vgpu" / "limits" / f"dra-{kept.uid}").stat().st_ino == kept_inode
    # Unprepared on purpose: nothing comes back; half-way: left to recover().
    assert set(files_of(tmp_path, gone.uid).values()) == {None}
    assert not (tmp_path / "vgpu" / "limits" / f"dra-{stuck.uid}").exists()
    # Torn, not missing: a limits file that is not the record's is written again too.
    Path(limits).write_bytes(b"\0" * 64)
    assert restarted.rebuild() == (1, 1, 0)
    assert files_of(tmp_path, lost.uid) == before


def test_a_claim_whose_gpu_left_the_driver_is_one_error_and_the_rest_goes_on(
    tmp_path: Path, api: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    driver = new_driver(tmp_path, api, DeferredSync())
    a = claim(api, "a")
    driver.prepare(a)
    api.add_claim("ml", "b", {"gpu": {"memory": "1Gi"}})
    meta = api.allocate("ml", "b", DEV_A.replace("aaaaaaaa", "b" * 8))["metadata"]
    b = ClaimRef("ml", str(meta["uid"]), "b")  # type: ignore[index]
    driver.prepare(b)
    os.unlink(tmp_path / "vgpu" / "limits" / f"dra-{a.uid}")
    os.unlink(tmp_path / "vgpu" / "limits" / f"dra-{b.uid}")
    store = AllocationStore(tmp_path / "state")
    record = store.get(f"dra-{b.uid}")
    assert record is not None
    uid = "c" * 8 + b.uid[8:]  # a damaged record: no limits
    store.add(
        dataclasses.replace(
            record, allocation_id=f"dra-{uid}", claim_uid=uid, claim_name="c", limits=()
        )
    )
    config = Config(host_root=str(tmp_path / "vgpu"), dra=DraConfig(enabled=True))
    only_a = DraDriver(
        GPUS[:1], config, "node-a", ClaimLedger(store), api, api,
        "0.1.0-abc", lock_dir=str(tmp_path / "locks"), cdi_spec_dir=str(tmp_path / "cdi"),
    )  # fmt: skip
    assert only_a.rebuild() == (0, 1, 2)
    assert (tmp_path / "vgpu" / "limits" / f"dra-{a.uid}").exists()
    lines = sorted(r.getMessage() for r in caplog.records if "cannot rebuild" in r.getMessage())
    assert lines == [
        f"cannot rebuild the files of claim ml/b: its GPU {GPUS[1].uuid} is not one of this"
        " driver's any more",
        "cannot rebuild the files of claim ml/c: its record holds no limits",
    ]


def test_serve_rebuilds_a_prepared_claim_after_a_power_loss_before_it_registers(
    simgpu_node: Node, native_tree: Path, tmp_path: Path
) -> None:
    with serve_with_dra(simgpu_node, native_tree, tmp_path, "[all]") as s:
        wait_until(lambda: len(s.api.slices) == 1)
        (published,) = s.api.slices.values()
        device = published["spec"]["devices"][0]["name"]
        uids = {}
        for name in ("lost", "gone"):
            s.api.add_claim("ml", name, {"gpu": {"memory": "2Gi", "compute": "20"}})
            c = s.api.allocate("ml", name, device)
            uids[name] = c["metadata"]["uid"]
            assert s.dra.prepare(DRIVER, c).claims[uids[name]].error == "", s.log.read_text()
        gone = s.api.claims[("ml", "gone")]
        assert s.dra.unprepare(DRIVER, gone).claims[uids["gone"]].error == ""
        aid = f"dra-{uids['lost']}"
        limits = s.host_root / "limits" / aid
        region = s.host_root / "containers" / aid
        spec = s.cdi_dir / f"vgpu-plugin-allocation_{aid}.json"
        before = [limits.read_bytes(), spec.read_bytes()]
        s.kill()
        # The power loss: the limits file gone, the CDI spec torn (empty), the region dir gone.
        limits.unlink()
        spec.write_bytes(b"")
        shutil.rmtree(region)
        gone_aid = f"dra-{uids['gone']}"
        gone_files = [
            s.host_root / "limits" / gone_aid,
            s.host_root / "containers" / gone_aid,
            s.cdi_dir / f"vgpu-plugin-allocation_{gone_aid}.json",
        ]
        # Without a reboot nothing is rebuilt: no write can have been lost.
        s.start()
        assert not limits.exists() and spec.read_bytes() == b""
        assert not any(p.exists() for p in gone_files)  # unprepared on purpose
        s.kill()
        assert "rebuilt claim" not in s.log.read_text()
        # The node booted since: the boot the last start ran in is another one.
        (s.state_dir / "boot_id").write_text("00000000-0000-0000-0000-000000000000\n")
        log_before = len(s.log.read_text())
        s.start()
        assert [limits.read_bytes(), spec.read_bytes()] == before
        assert region.is_dir()
        assert not any(p.exists() for p in gone_files)
        wait_until(lambda: "registered with the kubelet" in s.log.read_text()[log_before:])
        lines = s.log.read_text()[log_before:].splitlines()
        rebuilt = [i for i, line in enumerate(lines) if "rebuilt claim ml/lost" in line]
        registered = next(
            i for i, line in enumerate(lines) if "registered with the kubelet" in line
        )
        assert len(rebuilt) == 1 and rebuilt[0] < registered
        assert "limits file, region dir, CDI spec" in lines[rebuilt[0]]
        # The kubelet's retry is answered from the record, the same devices.
        lost = s.api.claims[("ml", "lost")]
        entry = s.dra.prepare(DRIVER, lost).claims[uids["lost"]]
        assert entry.error == "" and len(entry.devices) == 1
