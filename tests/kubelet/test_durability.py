"""Allocate's durability: nothing synced on its path, a deferred sync after it, and what a power
loss inside that window took rebuilt from the kubelet's checkpoint (docs/contracts.md#durability).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.kubelet.checkpoint import CHECKPOINT_NAME, allocation_ids_of, read_checkpoint
from vgpu_plugin.kubelet.plugin import VgpuBackend
from vgpu_plugin.kubelet.rebuild import rebuild
from vgpu_plugin.node.host import cdi as cdi_files
from vgpu_plugin.node.host.atomicfile import DeferredSync
from vgpu_plugin.node.ledger.state import JOURNAL_FILE_NAME, AllocationRecord, AllocationStore

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
RES = "nvidia.com/gpu"
MIB = 1 << 20
LOGGER = "vgpu_plugin.kubelet.rebuild"


def gpus() -> list[PhysicalGpu]:
    return [
        PhysicalGpu(0, A, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "00000000:17:00.0", 0),
        PhysicalGpu(1, B, "NVIDIA H100 80GB HBM3", 81559 * MIB, 1, "00000000:27:00.0", 1),
    ]


def make_backend(
    tmp_path: Path, strategy: str, syncer: DeferredSync | None, scaling: str = "1"
) -> VgpuBackend:
    config = parse_config(
        f"version: v1\nsharing: {{splitCount: 4, memoryScaling: {scaling}}}\n"
        f"hostRoot: {tmp_path / 'host'}\ndeviceListStrategy: {strategy}\n"
        "driverMemoryLimit: true\n"
    )
    store = AllocationStore(tmp_path / "state")
    if syncer is not None:
        syncer.register(store.flush)
    return VgpuBackend(
        gpus(), config, "node-1", {}, store, "0.1.0-abc", str(tmp_path / "locks"),
        cdi_spec_dir=str(tmp_path / "cdi"), syncer=syncer,
    )  # fmt: skip


def allocate(backend: VgpuBackend, *containers: Sequence[str]) -> pb.AllocateResponse:
    return backend.allocate(
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers]
        )
    )


CONTAINERS = ([f"{A}-0"], [f"{B}-1", f"{A}-1"], [f"{B}-3", f"{B}-2"])


def write_checkpoint(
    plugin_dir: Path, response: pb.AllocateResponse, containers: Sequence[Sequence[str]]
) -> None:
    """The kubelet's checkpoint after admitting one pod with these containers (v2 format)."""
    entries = [
        {
            "PodUID": "uid-1",
            "ContainerName": f"c{i}",
            "ResourceName": RES,
            "DeviceIDs": {"0": list(ids)},
            "AllocResp": base64.b64encode(resp.SerializeToString()).decode(),
        }
        for i, (resp, ids) in enumerate(zip(response.container_responses, containers, strict=True))
    ]
    doc = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / CHECKPOINT_NAME).write_text(json.dumps(doc))


class Syncs:
    """Counts fsync and fdatasync calls by path."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._spy(getattr(os, name)))

    def _spy(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return sync


# --- the deferred sync --------------------------------------------------------------------


def test_allocate_syncs_nothing_and_the_deferred_sync_syncs_all_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncer = DeferredSync()  # not started: ``wait`` runs its pass in this thread
    backend = make_backend(tmp_path, "volume-mounts", syncer)
    syncs = Syncs(monkeypatch)
    response = allocate(backend, *CONTAINERS)
    assert syncs.paths == []  # Allocate answered without one sync
    aids = [allocation_ids_of(c)[0] for c in response.container_responses]
    journal = str(tmp_path / "state" / JOURNAL_FILE_NAME)
    host = tmp_path / "host"

    assert syncer.wait()
    # Every limits file's content, then the two dirs naming them, then the journal, once each.
    assert sorted(syncs.paths[:3]) == sorted(str(host / "limits" / a) for a in aids)
    assert sorted(syncs.paths[3:5]) == [str(host / "containers"), str(host / "limits")]
    assert syncs.paths[5:] == [journal]
    assert backend._store.flushes == 1
    # Nothing new: a second wait syncs nothing.
    assert syncer.wait() and len(syncs.paths) == 6


def test_the_syncer_thread_syncs_after_allocate_and_at_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncer = DeferredSync()
    backend = make_backend(tmp_path, "volume-mounts", syncer)
    syncer.start()
    try:
        syncs = Syncs(monkeypatch)
        response = allocate(backend, [f"{A}-0"])
        assert syncer.wait(timeout=60)  # a liveness guard, not a timing
        (aid,) = [c.envs["VGPU_ALLOCATION_ID"] for c in response.container_responses]
        assert str(tmp_path / "host" / "limits" / aid) in syncs.paths
        assert str(tmp_path / "state" / JOURNAL_FILE_NAME) in syncs.paths
        assert syncer.passes >= 1 and syncer.errors == 0
    finally:
        syncer.stop()
    # Noted after the thread stopped (a late Allocate during shutdown): stop's own pass.
    allocate(backend, [f"{A}-1"])
    before = len(syncs.paths)
    syncer.stop()
    assert len(syncs.paths) > before


def test_a_failed_deferred_sync_is_logged_and_the_pass_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    syncer = DeferredSync(fsync=eio)
    target = tmp_path / "f"
    target.write_text("x")
    syncer.note([target, tmp_path / "gone"], [tmp_path])
    with caplog.at_level(logging.ERROR, logger="vgpu_plugin.node.host.atomicfile"):
        assert syncer.wait()
    assert syncer.errors == 2  # the file and the dir; the removed file is skipped, silently
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"deferred sync of {target} failed",
        f"deferred sync of {tmp_path} failed",
    ]


def test_with_a_cdi_strategy_the_record_is_synced_before_allocate_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncer = DeferredSync()
    backend = make_backend(tmp_path, "cdi-cri", syncer)
    syncs = Syncs(monkeypatch)
    allocate(backend, *CONTAINERS)
    # The response carries no limits: the record is what a rebuild reads, so it is durable.
    assert syncs.paths == [str(tmp_path / "state" / JOURNAL_FILE_NAME)]


# --- a power loss -------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file under ``root`` (bytes) and dir (None), by relative path."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def power_loss(tmp_path: Path, journal_size: int, aids: Sequence[str]) -> None:
    """What the deferred sync had not covered is gone: the journal's tail, the first
    allocation's limits file and region dir, the second's limits file torn (empty, as ext4
    leaves a renamed file whose data never reached the disk), the CDI specs."""
    os.truncate(tmp_path / "state" / JOURNAL_FILE_NAME, journal_size)
    host = tmp_path / "host"
    (host / "limits" / aids[0]).unlink()
    (host / "containers" / aids[0]).rmdir()
    (host / "containers" / aids[2]).chmod(0o755)  # its mode lost with the journal's commit
    (host / "limits" / aids[1]).write_bytes(b"")
    for spec in (tmp_path / "cdi").glob("*"):
        spec.unlink()


def same_records(got: Sequence[AllocationRecord], want: Sequence[AllocationRecord]) -> None:
    """Equal but for ``created``, which the checkpoint does not keep."""
    key = {r.allocation_id: r for r in got}
    assert sorted(key) == sorted(r.allocation_id for r in want)
    for r in want:
        g = key[r.allocation_id]
        assert (g.device_ids, g.resource_name, g.limits) == (
            r.device_ids,
            r.resource_name,
            r.limits,
        )
        assert g.extra.get("oversubscribed") == r.extra.get("oversubscribed")


@pytest.mark.parametrize(
    ("strategy", "scaling"), [("volume-mounts", "1"), ("envvar", "1.5"), ("cdi-cri", "1")]
)
def test_after_a_power_loss_start_rebuilds_exactly_what_allocate_wrote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, strategy: str, scaling: str
) -> None:
    backend = make_backend(tmp_path, strategy, DeferredSync(), scaling)
    journal_size = (tmp_path / "state" / JOURNAL_FILE_NAME).stat().st_size
    if strategy == "cdi-cri":  # the record was synced before the answer: it survives
        journal_size = -1
    response = allocate(backend, *CONTAINERS)
    aids = [allocation_ids_of(c)[0] for c in response.container_responses]
    write_checkpoint(tmp_path / "plugins", response, CONTAINERS)
    files = snapshot(tmp_path / "host")
    specs = snapshot(tmp_path / "cdi")
    records = backend._store.all()
    backend._store.close()

    if journal_size < 0:
        journal_size = (tmp_path / "state" / JOURNAL_FILE_NAME).stat().st_size
    power_loss(tmp_path, journal_size, aids)
    restarted = make_backend(tmp_path, strategy, DeferredSync(), scaling)
    entries = read_checkpoint(tmp_path / "plugins")
    assert entries is not None
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = rebuild(restarted, entries)

    assert snapshot(tmp_path / "host") == files  # byte for byte
    assert snapshot(tmp_path / "cdi") == specs
    assert stat.S_IMODE((tmp_path / "host" / "containers" / aids[0]).stat().st_mode) == 0o777
    same_records(restarted._store.all(), records)
    same_records(AllocationStore(tmp_path / "state").all(), records)  # and on file
    assert report.refused == {}
    lost_records = strategy != "cdi-cri"
    assert report.rebuilt[aids[0]][:2] == ["limits file", "region dir"]
    assert report.rebuilt[aids[1]][0] == "limits file"
    assert report.rebuilt[aids[2]][0] == "region dir"
    assert ("record" in report.rebuilt[aids[2]]) == lost_records
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(report.rebuilt)
    assert all(
        f"rebuilt allocation {aid} (pod uid-1" in line
        for aid, line in zip(aids, lines, strict=True)
    )
    # A second start finds everything in place.
    caplog.clear()
    again = rebuild(restarted, entries)
    assert again.rebuilt == {} and again.intact == 3 and caplog.records == []


def test_an_entry_that_cannot_be_rebuilt_is_refused_in_one_line_and_the_rest_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = make_backend(tmp_path, "cdi-cri", DeferredSync())
    response = allocate(backend, *CONTAINERS)
    aids = [allocation_ids_of(c)[0] for c in response.container_responses]
    write_checkpoint(tmp_path / "plugins", response, CONTAINERS)
    files = snapshot(tmp_path / "host")
    backend._store.close()
    # Worse than the window allows (the record was synced): the first record is lost too.
    # Its CDI response names no limits, so it cannot be rebuilt; the others can.
    store = AllocationStore(tmp_path / "state")
    store.remove(aids[0])
    store.close()
    power_loss(tmp_path, (tmp_path / "state" / JOURNAL_FILE_NAME).stat().st_size, aids)
    restarted = make_backend(tmp_path, "cdi-cri", DeferredSync())
    entries = read_checkpoint(tmp_path / "plugins")
    assert entries is not None
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = rebuild(restarted, entries)
    assert list(report.refused) == [aids[0]]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"cannot rebuild allocation {aids[0]} (pod uid-1 container 'c0') from the kubelet's "
        "checkpoint: its response carries no limits (the CDI strategies keep them in the CDI "
        "spec) and its record is not on file; the container's limits are missing until its pod "
        "is recreated"
    ]
    got = snapshot(tmp_path / "host")
    assert {k: v for k, v in files.items() if aids[0] not in k} == got
    assert sorted(report.rebuilt) == sorted(aids[1:])
    assert report.rebuilt[aids[2]] == ["region dir", "CDI spec"]
    assert {r.allocation_id for r in restarted._store.all()} == set(aids[1:])
    assert cdi_files.spec_path(tmp_path / "cdi", aids[1]).is_file()


def test_a_checkpoint_naming_paths_allocate_never_writes_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = make_backend(tmp_path, "volume-mounts", DeferredSync())
    response = allocate(backend, [f"{A}-0"], [f"{A}-1"])
    first, second = response.container_responses
    victim = tmp_path / "etc" / "passwd"
    # One entry mounts someone else's file as its limits file; the other an unnormalized path.
    for m in first.mounts:
        if m.container_path == "/etc/vgpu/limits":
            m.host_path = str(victim)
    for m in second.mounts:
        if m.container_path == "/etc/vgpu/limits":
            m.host_path = m.host_path.replace("/limits/", "/limits/../limits/")
    write_checkpoint(tmp_path / "plugins", response, [[f"{A}-0"], [f"{A}-1"]])
    entries = read_checkpoint(tmp_path / "plugins")
    assert entries is not None
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        report = rebuild(backend, entries)
    assert sorted(report.refused) == sorted(allocation_ids_of(c)[0] for c in (first, second))
    assert not victim.exists() and len(caplog.records) == 2
    assert "not a limits path of ours" in caplog.records[0].getMessage()
    assert "not a normalized absolute path" in caplog.records[1].getMessage()
