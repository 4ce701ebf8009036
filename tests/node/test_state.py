"""Allocation records: round trip, crash safety, refusing bad files, two writer processes,
migration from the single-file store, readers without the lock."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.ledger import state
from vgpu_plugin.node.ledger.state import (
    HEADER,
    JOURNAL_FILE_NAME,
    LEGACY_FILE_NAME,
    AllocationRecord,
    AllocationStore,
    StateFileError,
    check_header,
    decode,
    frame,
    put_entry,
    read_records,
    scan,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def record(n: int, **kw: object) -> AllocationRecord:
    fields: dict[str, object] = {
        "allocation_id": f"alloc-{n:04d}",
        "device_ids": (f"GPU-aaaa-{n}", f"GPU-bbbb-{n}"),
        "resource_name": "nvidia.com/gpu",
        "created": 1_700_000_000.25 + n,
        "limits": (GpuLimit("GPU-aaaa", 20389 * MIB, 25), GpuLimit("GPU-bbbb", 40778 * MIB, 50)),
    }
    fields.update(kw)
    return AllocationRecord(**fields)  # type: ignore[arg-type]


def run_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env)


def test_round_trip_and_restart(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    first = record(1)
    second = record(2, pod="infer-0", namespace="ml", container="server")
    store.add(first)
    store.add(second)
    assert store.get("alloc-0001") == first
    assert store.get("missing") is None

    reopened = AllocationStore(tmp_path)  # a restarted plugin
    assert reopened.all() == [first, second]
    again = reopened.get("alloc-0002")
    assert again is not None and again.pod == "infer-0" and again.limits[1].memory_mib == 40778
    assert isinstance(again.device_ids, tuple) and isinstance(again.limits[0], GpuLimit)

    assert reopened.remove("alloc-0001") is True
    assert reopened.remove("alloc-0001") is False
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0002"]


def test_changed_since_names_what_changed_by_anyone_and_reads_whole_when_too_far_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What lets the GPU-time publisher read what changed, not the ledger: this store's
    changes, another process's and a compaction's (none) are named; a reader further behind
    than the changes kept is told to read the ledger whole."""
    monkeypatch.setattr(state, "CHANGES_KEPT", 8)
    store = AllocationStore(tmp_path, compact_min=2)
    store.add(record(1))
    version, records = store.snapshot()
    assert records == [record(1)]
    assert store.changed_since(version) == (version, {})
    store.all()
    store.get("alloc-0001")
    assert store.changed_since(version) == (version, {})  # reading changes nothing

    store.add(record(2))
    store.add_many([record(3)], sync=False)
    AllocationStore(tmp_path).add(record(4, pod="other"))  # another plugin process
    got = store.changed_since(version)
    assert got is not None
    v2, changed = got
    assert changed == {"alloc-0002": record(2), "alloc-0003": record(3),
                       "alloc-0004": record(4, pod="other")}  # fmt: skip
    for _ in range(3):  # replacements until the journal is compacted into a new file
        store.add(record(1, pod="again"))
    assert store.changed_since(v2) == (store.snapshot()[0], {"alloc-0001": record(1, pod="again")})
    v3 = store.snapshot()[0]
    AllocationStore(tmp_path).remove("alloc-0003")
    assert store.remove("alloc-0002")
    assert not store.remove("alloc-0002")
    assert store.changed_since(v3) == (v3 + 2, {"alloc-0002": None, "alloc-0003": None})

    for n in range(10, 20):  # more changes than are kept
        store.add(record(n))
    assert store.changed_since(v3) is None
    assert store.changed_since(store.snapshot()[0] - 8) is not None
    assert AllocationStore(tmp_path).changed_since(0) is None  # another store's versions: read


def test_add_replaces_the_same_allocation_id(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(1))
    store.add(record(1, pod="p"))
    assert [r.pod for r in store.all()] == ["p"]


def journal_changes(path: Path) -> list[tuple[str, object]]:
    data = path.read_bytes()
    check_header(path, data)
    found = scan(data[len(HEADER) :])
    assert not found.damage and not found.tail
    return found.changes


def test_unknown_fields_from_a_newer_writer_survive(tmp_path: Path) -> None:
    AllocationStore(tmp_path).add(record(1))
    wire = record(2).to_wire()
    wire["future_field"] = [1, 2]
    with open(tmp_path / JOURNAL_FILE_NAME, "ab") as f:
        f.write(frame(msgpack.packb(["put", wire])))
    store = AllocationStore(tmp_path)
    old = store.get("alloc-0002")
    assert old is not None
    store.add(dataclasses.replace(old, pod="p"))  # relabelled by this version
    store._compact()  # and rewritten whole
    (_, kept) = journal_changes(tmp_path / JOURNAL_FILE_NAME)[-1]
    assert isinstance(kept, AllocationRecord) and kept.pod == "p"
    assert kept.to_wire()["future_field"] == [1, 2]


def test_released_survives_replacement_compaction_and_restart(tmp_path: Path) -> None:
    store = AllocationStore(tmp_path, compact_min=4)
    for n in range(12):
        store.add(record(n))
    store.add(dataclasses.replace(record(3), released=1234.5))
    for n in range(12):
        if n != 3:
            assert store.remove(f"alloc-{n:04d}")
    # 13 puts and 11 deletes for one record: compacted (once the dead outnumbered the live).
    changes = journal_changes(tmp_path / JOURNAL_FILE_NAME)
    assert len(changes) <= 4
    assert changes[0] == ("put", dataclasses.replace(record(3), released=1234.5))
    (only,) = AllocationStore(tmp_path).all()
    assert only.allocation_id == "alloc-0003" and only.released == 1234.5
    (read,), problem = read_records(tmp_path)
    assert read.released == 1234.5 and problem is None


def test_add_many_is_one_durable_write_and_all_or_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(0))
    size = (tmp_path / JOURNAL_FILE_NAME).stat().st_size
    syncs: list[int] = []
    real = os.fdatasync

    def failing(fd: int) -> None:
        syncs.append(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="No space"):
        store.add_many(record(n) for n in range(1, 500))
    assert len(syncs) == 1
    assert (tmp_path / JOURNAL_FILE_NAME).stat().st_size == size  # cut back: nothing half there
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0000"]

    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    store.add_many(record(n) for n in range(1, 500))
    assert len(syncs) == 2  # 499 records, one sync
    assert len(AllocationStore(tmp_path).all()) == 500


def test_an_unsynced_add_many_is_synced_by_the_next_flush_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AllocationStore(tmp_path)
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(
        os, "fdatasync", lambda fd: (syncs.append(os.fstat(fd).st_size), real(fd))[1]
    )
    store.add_many([record(1), record(2)], sync=False)
    assert syncs == []  # acknowledged from the page cache
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == [
        "alloc-0001",
        "alloc-0002",
    ]
    store.flush()
    assert syncs == [(tmp_path / JOURNAL_FILE_NAME).stat().st_size] and store.flushes == 1
    store.flush()  # nothing new: no sync
    store.add(record(3))  # a synced write covers what came before it
    store.flush()
    assert len(syncs) == 2 and store.flushes == 1


class _HeldSync:
    """A fake ``fdatasync`` that logs the journal's size at each call and holds the first call
    until released, so other callers queue up behind it."""

    def __init__(self, fail_second: bool = False) -> None:
        self.events: list[tuple[str, object]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail_second = fail_second
        self.lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        with self.lock:
            n = sum(1 for e in self.events if e[0] == "sync")
            self.events.append(("sync", os.fstat(fd).st_size))
        if n == 0:
            self.entered.set()
            assert self.release.wait(30)
        elif self.fail_second:
            raise OSError(5, "Input/output error")


def _wait_for(cond: Callable[[], bool]) -> None:
    """Polls ``cond`` until true (a liveness guard, not a timed assertion)."""
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.005)


def _add_in_thread(
    store: AllocationStore, n: int, sync: _HeldSync, errors: list[BaseException]
) -> threading.Thread:
    def run() -> None:
        try:
            store.add_many([record(n)])
        except OSError as exc:
            errors.append(exc)
            with sync.lock:
                sync.events.append(("failed", n))
            return
        with sync.lock:
            sync.events.append(("ack", n))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_concurrent_add_many_share_one_sync_and_return_only_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AllocationStore(tmp_path)
    base = (tmp_path / JOURNAL_FILE_NAME).stat().st_size
    entry = len(put_entry(record(1)))
    sync = _HeldSync()
    monkeypatch.setattr(os, "fdatasync", sync)
    errors: list[BaseException] = []
    first = _add_in_thread(store, 1, sync, errors)
    assert sync.entered.wait(30)  # the first caller is inside its sync, holding the lock
    others = [_add_in_thread(store, n, sync, errors) for n in (2, 3, 4)]
    _wait_for(lambda: len(store._pending) == 3)  # all three queued behind it
    assert not any(e[0] == "ack" for e in sync.events)  # nobody acknowledged before a sync
    sync.release.set()
    for t in (first, *others):
        t.join(30)
    assert errors == []
    # Two syncs for four callers: the first covered record 1 only, the second the other three.
    syncs = [size for kind, size in sync.events if kind == "sync"]
    assert syncs == [base + entry, base + 4 * entry]
    second = sync.events.index(("sync", base + 4 * entry))
    assert sync.events.index(("ack", 1)) > 0
    assert all(sync.events.index(("ack", n)) > second for n in (2, 3, 4))
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == [
        record(n).allocation_id for n in (1, 2, 3, 4)
    ]


def test_a_failed_group_sync_fails_every_caller_in_it_and_keeps_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AllocationStore(tmp_path)
    sync = _HeldSync(fail_second=True)
    monkeypatch.setattr(os, "fdatasync", sync)
    errors: list[BaseException] = []
    first = _add_in_thread(store, 1, sync, errors)
    assert sync.entered.wait(30)
    others = [_add_in_thread(store, n, sync, errors) for n in (2, 3)]
    _wait_for(lambda: len(store._pending) == 2)
    sync.release.set()
    for t in (first, *others):
        t.join(30)
    assert sorted(e[1] for e in sync.events if e[0] == "failed") == [2, 3]
    assert all("Input/output error" in str(e) for e in errors) and len(errors) == 2
    assert ("ack", 1) in sync.events
    monkeypatch.undo()
    assert [r.allocation_id for r in store.all()] == [record(1).allocation_id]
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == [record(1).allocation_id]
    store.add_many([record(5)])  # the store still works after a failed group
    assert len(AllocationStore(tmp_path).all()) == 2


def test_a_caller_that_fails_to_catch_up_learns_what_became_of_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller whose own turn at the lock fails (catching up raises) gets the outcome of the
    group that took its batch, if one did; a batch still queued is taken back, never written."""
    store = AllocationStore(tmp_path)
    real_sync = store._sync
    hold = threading.Event()
    held = threading.Event()
    failing: set[int] = set()

    def sync() -> None:
        me = threading.get_ident()
        if me in failing:
            raise OSError(5, "Input/output error")
        if not held.is_set() and threading.current_thread().name == "leader":
            held.set()
            assert hold.wait(30)  # the leader waits inside the lock, before it takes the queue
        real_sync()

    monkeypatch.setattr(store, "_sync", sync)
    outcome: dict[str, str] = {}

    def add(name: str, n: int, fail: bool) -> threading.Thread:
        def run() -> None:
            if fail:
                failing.add(threading.get_ident())
            try:
                store.add_many([record(n)])
                outcome[name] = "ok"
            except OSError as exc:
                outcome[name] = str(exc)

        t = threading.Thread(target=run, name=name)
        t.start()
        return t

    # 1. Its batch was queued before the leader took the queue: the leader wrote it, so the
    #    caller's own failure does not matter.
    leader = add("leader", 1, fail=False)
    assert held.wait(30)
    follower = add("follower", 2, fail=True)
    _wait_for(lambda: len(store._pending) == 2)
    hold.set()
    leader.join(30)
    follower.join(30)
    assert outcome == {"leader": "ok", "follower": "ok"}
    ids = [r.allocation_id for r in AllocationStore(tmp_path).all()]
    assert ids == [record(1).allocation_id, record(2).allocation_id]
    # 2. Nobody took it: it is taken back and never written, not even by the next writer.
    late = add("late", 3, fail=True)
    late.join(30)
    assert "Input/output error" in outcome["late"] and store._pending == []
    store.add_many([record(4)])
    ids = [r.allocation_id for r in AllocationStore(tmp_path).all()]
    assert record(3).allocation_id not in ids and record(4).allocation_id in ids


# --- crashes ------------------------------------------------------------------------------------

# Applies random changes and reports each on stdout: "begin <change>" before, "done" once the
# store call returned (acknowledged). Small compact_min: SIGKILLs land in compactions too. Half
# the batches are not synced (Allocate's path under serve): a SIGKILL must not tell.
_WRITER = """
import dataclasses, json, random, sys
from vgpu_plugin.node.ledger import state
store = state.AllocationStore(sys.argv[1], compact_min=8)
rng = random.Random(int(sys.argv[2]))
n = int(sys.argv[2]) * 100_000
def say(*words):
    print(json.dumps(words), flush=True)
say("ready", [r.allocation_id for r in store.all()])
while True:
    live = [r.allocation_id for r in store.all()]
    kind = rng.choice(["batch", "batch", "release", "remove"] if live else ["batch"])
    if kind == "batch":
        ids = [f"a{n + i}" for i in range(rng.choice([1, 3, 40]))]
        n += len(ids)
        say("begin", "put", ids)
        store.add_many(
            (
                state.AllocationRecord(i, ("GPU-x-0",), "nvidia.com/gpu", 1.0, pod="p" * 300)
                for i in ids
            ),
            sync=rng.random() < 0.5,
        )
        if rng.random() < 0.3:
            store.flush()  # what the deferred sync does, from another thread under serve
    elif kind == "release":
        aid = rng.choice(live)
        say("begin", "release", [aid])
        store.add(dataclasses.replace(store.get(aid), released=2.0))
    else:
        aid = rng.choice(live)
        say("begin", "remove", [aid])
        assert store.remove(aid)
    say("done")
"""


def test_sigkill_at_random_points_loses_no_acknowledged_record_and_tears_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(14)
    want: dict[str, bool] = {}  # acknowledged: allocation id -> released
    in_flight = 0  # rounds killed inside a store call
    # Kills land inside a write by chance (a loaded host lands fewer): go on until ten did, with
    # at least 20 rounds and at most 150.
    round_ = 0
    while round_ < 20 or (in_flight < 10 and round_ < 150):
        round_ += 1
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(round_)],
            env=dict(os.environ, PYTHONPATH=str(SRC)),
            stdout=subprocess.PIPE,
        )
        assert writer.stdout is not None
        kind, at_start = json.loads(writer.stdout.readline())
        assert kind == "ready" and set(at_start) >= set(want)
        time.sleep(rng.uniform(0.0, 0.3))
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        pending: list[object] | None = None
        for line in writer.stdout.read().decode().splitlines():
            words = json.loads(line)
            if words[0] == "begin":
                pending = words[1:]
                continue
            assert words == ["done"] and pending is not None
            op, ids = pending
            for aid in ids:  # type: ignore[union-attr]
                if op == "put":
                    want[aid] = False
                elif op == "release":
                    want[aid] = True
                else:
                    del want[aid]
            pending = None
        writer.stdout.close()

        # A reader without the lock first (it repairs nothing), then the next plugin.
        read, problem = read_records(tmp_path)
        assert problem is None
        with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.ledger.state"):
            store = AllocationStore(tmp_path)
        assert store.quarantined == [], "a crash must never look like damage"
        got = {r.allocation_id: r.released is not None for r in store.all()}
        # The change in flight when the kill came may or may not have landed, whole.
        if pending is not None:
            in_flight += 1
            op, ids = pending
            for aid in ids:  # type: ignore[union-attr]
                if op == "put" and aid in got:
                    want[aid] = got[aid]
                elif op == "release" and got.get(aid):
                    want[aid] = True
                elif op == "remove" and aid not in got:
                    del want[aid]
        assert got == want, f"round {round_}"
        assert {r.allocation_id for r in read} <= set(got) | set(ids if pending else ())
        assert all(r.pod == "p" * 300 for r in store.all())
        store.close()
    assert len(want) > 20 and in_flight >= 10  # the kills did land inside writes
    assert not list(tmp_path.glob(f"{JOURNAL_FILE_NAME}.tmp-*"))


def test_a_torn_last_entry_is_cut_off_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    AllocationStore(tmp_path).add_many([record(1), record(2)])
    path = tmp_path / JOURNAL_FILE_NAME
    whole = put_entry(record(3))
    with open(path, "ab") as f:
        f.write(whole[: len(whole) // 2])  # a writer killed mid-append
    records, problem = read_records(tmp_path)  # as an append in progress: not there yet
    assert [r.allocation_id for r in records] == ["alloc-0001", "alloc-0002"] and problem is None
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.ledger.state"):
        store = AllocationStore(tmp_path)
    assert [r.allocation_id for r in store.all()] == ["alloc-0001", "alloc-0002"]
    assert store.quarantined == []
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vgpu_plugin.node.ledger.state"]
    assert f"dropped the last {len(whole) // 2} bytes of {path}" in line
    store.add(record(4))  # appended after the cut, readable by everyone
    assert [r.allocation_id for r in read_records(tmp_path)[0]] == ["alloc-0001", "alloc-0002",
                                                                     "alloc-0004"]  # fmt: skip


# --- damage and foreign files -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xc1\xc1 not a journal at all", "not a vgpu-plugin allocations journal"),
        (b"", "not a vgpu-plugin allocations journal"),
        (b"vgpu-plugin/allocations journal v9\n", "journal version 9"),
    ],
)
def test_a_foreign_journal_is_refused_and_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / JOURNAL_FILE_NAME
    path.write_bytes(content)
    assert reason in (read_records(tmp_path)[1] or "")  # readers report, and move nothing
    assert path.read_bytes() == content
    with caplog.at_level(logging.ERROR, logger="vgpu_plugin.node.ledger.state"):
        store = AllocationStore(tmp_path)
    assert store.all() == []
    (aside,) = store.quarantined
    assert aside.name.startswith(f"{JOURNAL_FILE_NAME}.corrupt-")
    assert aside.read_bytes() == content  # kept for a human, never silently dropped
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vgpu_plugin.node.ledger.state"]
    assert str(path) in line and str(aside) in line and reason in line
    store.add(record(1))  # and the plugin carries on with a fresh journal
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0001"]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (b"\x00" * 37, "37 bytes that are no journal entry"),
        (frame(msgpack.packb(["put", {"x": 1}])), "malformed record"),
        (frame(msgpack.packb(["rename", "a", "b"])), "not a journal change"),
        (frame(msgpack.packb(["compact", 1])), "unknown change 'compact'"),
    ],
)
def test_damage_between_entries_is_kept_aside_and_the_intact_entries_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: bytes, reason: str
) -> None:
    AllocationStore(tmp_path).add(record(1))
    path = tmp_path / JOURNAL_FILE_NAME
    with open(path, "ab") as f:
        f.write(bad + put_entry(record(2)))
    content = path.read_bytes()
    records, problem = read_records(tmp_path)
    assert [r.allocation_id for r in records] == ["alloc-0001", "alloc-0002"]
    assert problem is not None and reason in problem and str(path) in problem
    assert path.read_bytes() == content  # a reader repairs nothing
    with caplog.at_level(logging.ERROR, logger="vgpu_plugin.node.ledger.state"):
        store = AllocationStore(tmp_path)
    assert [r.allocation_id for r in store.all()] == ["alloc-0001", "alloc-0002"]
    (aside,) = store.quarantined
    assert aside.read_bytes() == content
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vgpu_plugin.node.ledger.state"]
    assert (
        reason in line
        and str(aside) in line
        and f"at byte {len(HEADER) + len(put_entry(record(1)))}" in line
    )
    assert len(journal_changes(path)) == 2  # rewritten without the damage
    assert read_records(tmp_path) == (store.all(), None)


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    AllocationStore(tmp_path)
    code = """
        import sys
        from vgpu_plugin.node.ledger import state
        store = state.AllocationStore(sys.argv[1], compact_min=4)
        tag = sys.argv[2]
        for i in range(40):
            store.add(state.AllocationRecord(f"{tag}-{i}", (f"d{i}",), "nvidia.com/gpu", i))
        for i in range(0, 40, 4):
            assert store.remove(f"{tag}-{i}")
        """
    writers = [run_python(code, str(tmp_path), tag) for tag in ("a", "b", "c")]
    for writer in writers:
        assert writer.wait(60) == 0
    got = {r.allocation_id for r in AllocationStore(tmp_path).all()}
    want = {f"{t}-{i}" for t in ("a", "b", "c") for i in range(40) if i % 4}
    assert got == want


# --- migration from allocations.msgpack ---------------------------------------------------------


def legacy_file(records: list[AllocationRecord], **extra: object) -> bytes:
    wires = [r.to_wire() for r in records]
    for w in wires:
        w.update(extra)
    payload = {"format": "vgpu-plugin/allocations", "version": 1, "records": wires}
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


def test_the_single_file_store_is_imported_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = [
        record(1, pod="infer-0", namespace="ml", container="server"),
        record(2, released=1_700_000_500.0),
    ]
    legacy = tmp_path / LEGACY_FILE_NAME
    legacy.write_bytes(legacy_file(old, future_field=7))
    # status or metrics from this version before the plugin restarts: the old file is read
    assert read_records(tmp_path) == (old, None)
    with caplog.at_level(logging.INFO, logger="vgpu_plugin.node.ledger.state"):
        store = AllocationStore(tmp_path)
    assert store.all() == old
    assert store.all()[1].released == 1_700_000_500.0
    assert store.all()[0].extra == {"future_field": 7}
    assert not legacy.exists()
    assert (tmp_path / f"{LEGACY_FILE_NAME}.migrated").read_bytes() == legacy_file(
        old, future_field=7
    )
    assert any("imported 2 allocation records" in r.getMessage() for r in caplog.records)
    store.remove("alloc-0001")
    # Imported once: a restart does not bring the removed record back.
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0002"]
    assert [r.allocation_id for r in read_records(tmp_path)[0]] == ["alloc-0002"]


def test_records_an_older_plugin_writes_during_a_rolling_update_are_imported(
    tmp_path: Path,
) -> None:
    store = AllocationStore(tmp_path)
    store.add(record(1))
    # The old plugin, still running, writes its (new) file again beside the journal.
    (tmp_path / LEGACY_FILE_NAME).write_bytes(legacy_file([record(2)]))
    assert [r.allocation_id for r in read_records(tmp_path)[0]] == ["alloc-0001", "alloc-0002"]
    assert [r.allocation_id for r in store.all()] == ["alloc-0001", "alloc-0002"]
    assert (tmp_path / f"{LEGACY_FILE_NAME}.migrated").exists()
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == [
        "alloc-0001",
        "alloc-0002",
    ]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xc1\xc1 not msgpack at all", "not valid msgpack"),
        (msgpack.packb({"hello": "world"}), "not a vgpu-plugin allocations file"),
        (msgpack.packb([1, 2, 3]), "not a vgpu-plugin allocations file"),
        (
            msgpack.packb({"format": "vgpu-plugin/allocations", "version": 99, "records": []}),
            "format version 99",
        ),
        (
            msgpack.packb(
                {"format": "vgpu-plugin/allocations", "version": 1, "records": [{"x": 1}]}
            ),
            "record 0",
        ),
    ],
)
def test_a_corrupt_or_foreign_old_file_is_refused_and_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, reason: str
) -> None:
    path = tmp_path / LEGACY_FILE_NAME
    path.write_bytes(content)
    with pytest.raises(StateFileError, match=reason) as err:
        decode(path, content)
    assert str(path) in str(err.value)

    with caplog.at_level(logging.ERROR, logger="vgpu_plugin.node.ledger.state"):
        store = AllocationStore(tmp_path)
    assert store.all() == []
    (aside,) = store.quarantined
    assert aside.name.startswith(f"{LEGACY_FILE_NAME}.corrupt-")
    assert aside.read_bytes() == content  # kept for a human, never silently dropped
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vgpu_plugin.node.ledger.state"]
    assert str(path) in line and str(aside) in line and reason in line
    store.add(record(1))
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0001"]


# --- readers without the lock -------------------------------------------------------------------


def test_a_reader_decodes_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AllocationStore(tmp_path, compact_min=4)
    store.add_many(record(n) for n in range(200))
    scanned: list[int] = []
    real_scan = state.scan

    def counting(buf: bytes, base: int = 0) -> state.Scan:
        scanned.append(len(buf))
        return real_scan(buf, base)

    monkeypatch.setattr(state, "scan", counting)
    first, _ = read_records(tmp_path)
    assert len(first) == 200 and len(scanned) == 1
    for _ in range(5):  # scrapes while nothing changes: no decoding at all
        assert read_records(tmp_path) == (first, None)
    assert len(scanned) == 1
    store.add(record(200))
    again, _ = read_records(tmp_path)
    assert len(again) == 201 and scanned[-1] == len(put_entry(record(200)))
    for n in range(195):  # enough dead entries to compact: a new file, read whole
        store.remove(f"alloc-{n:04d}")
    after, problem = read_records(tmp_path)
    assert after == store.all() and len(after) == 6 and problem is None


def test_reading_many_state_dirs_holds_no_file_open_forever(tmp_path: Path) -> None:
    """read_records caches a reader per state dir; a process that reads many (the test suite,
    a status loop over nodes) must not run out of file descriptors."""

    def write_then_read(i: int) -> None:
        store = AllocationStore(tmp_path / f"s{i}")
        store.add(record(i))
        store.close()
        records, problem = read_records(tmp_path / f"s{i}")
        assert [r.allocation_id for r in records] == [f"alloc-{i:04d}"] and problem is None

    for i in range(4):  # the reader cache full first: then each new dir displaces one
        write_then_read(i)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(4, 54):
        write_then_read(i)
    assert len(os.listdir("/proc/self/fd")) - before <= 2  # 50 without the bound


def test_a_lock_another_process_holds_too_long_is_a_clear_timeout(tmp_path: Path) -> None:
    import fcntl

    store = AllocationStore(tmp_path, lock_timeout=0.05)
    # Another open file of the lock: flock tells it from the store's as it would a process.
    other = os.open(tmp_path / state.LOCK_FILE_NAME, os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="another process has held the lock"):
            store.add_many([record(1)], sync=False)
        fcntl.flock(other, fcntl.LOCK_UN)
        store.add_many([record(1)], sync=False)
    finally:
        os.close(other)
    assert [r.allocation_id for r in AllocationStore(tmp_path).all()] == ["alloc-0001"]


def test_all_stays_oldest_first_through_any_mix_of_puts_changes_and_removes(
    tmp_path: Path,
) -> None:
    """all() keeps its oldest-first list up to date in place (appends, state changes,
    removes) instead of sorting every record after each change: whatever the mix, it is what
    a full sort gives, and a reopened store agrees."""
    store = AllocationStore(tmp_path)
    rng = random.Random(5)
    live: dict[str, AllocationRecord] = {}
    for step in range(600):
        store.all()  # the kept list exists, so each change below updates it
        op = rng.random()
        if op < 0.5 or not live:
            n = rng.randrange(2000)
            # mostly newest, sometimes older than what is there (out of order)
            created = 1_700_000_000.0 + (step if rng.random() < 0.8 else rng.randrange(600))
            r = record(n, created=created)
            store.add_many([r], sync=rng.random() < 0.5)
        elif op < 0.8:
            old = live[rng.choice(sorted(live))]
            r = dataclasses.replace(old, pod=f"pod-{step}")  # same place, new content
            store.add(r)
        else:
            gone = rng.choice(sorted(live))
            assert store.remove(gone)
            del live[gone]
            continue
        live[r.allocation_id] = r
        expected = sorted(live.values(), key=lambda x: (x.created, x.allocation_id))
        assert store.all() == expected, step
    store.close()
    again = AllocationStore(tmp_path)
    assert again.all() == sorted(live.values(), key=lambda x: (x.created, x.allocation_id))
