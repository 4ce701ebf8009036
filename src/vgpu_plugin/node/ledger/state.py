"""Allocation records, persisted in the state dir so a restarted plugin knows what it handed out.

The records live in an append-only journal, ``allocations.journal``: a header line, then one
entry per change (a record stored or replaced, or one dropped), each framed as a mark, its
length and a CRC-32 of both, then the msgpack payload. A change costs one append and one
``fdatasync`` whatever the number of records (``add_many`` writes a whole Allocate's records in
one), and a write is acknowledged only once it is synced, except ``add_many(sync=False)``.

Durability (docs/contracts.md#durability): an appended entry survives the death of the
process as soon as ``write`` returned (the page cache keeps it, whole or, if the process died
inside the call, as an unfinished tail that is cut off), so only a power loss or kernel crash
needs the sync. Allocate therefore appends with ``sync=False`` and answers; ``flush``, run by
serve's ``DeferredSync`` thread moments later, syncs it without holding the lock while the disk
works, and what a power loss takes in between is rebuilt at start from the kubelet's
checkpoint (``kubelet/rebuild.py``). Every other change is synced before it returns, and a
synced append also covers the unsynced ones before it.

Concurrent synced ``add_many`` calls share syncs (group commit): each queues its entries,
and whichever caller holds the lock next writes every queued entry in one append and one
``fdatasync``; a caller returns once the sync that covers its own entries has returned, and
fails if that sync failed (the whole group is cut back from the journal, as a single write
is). When the journal holds more dead entries than live records (and at least
``compact_min``), it is rewritten with the live records only (tmp file, fsync, rename, fsync
of the dir); Allocate's writes never compact.

Crashes: a writer killed mid-append leaves an incomplete entry at the end, never acknowledged;
the next writer (under the lock) truncates it and logs it. Bytes that do not frame an entry
*followed* by entries that do are damage, not an unfinished write: the whole journal is copied
aside to ``allocations.journal.corrupt-<unix time>``, the error is logged, and the journal is
rewritten from the entries that are intact. A journal that is not ours (no header) is moved
aside the same way and the store starts empty. Nothing is silently dropped.

Every change happens under an exclusive file lock (``allocations.lock``), after catching up
with what other processes appended, so two plugin processes (a rolling DaemonSet update) never
lose each other's records. Readers without the lock (``read_records``: status, metrics) read
only what was appended since their last look, and nothing when the journal did not change.

The store before the journal kept every record in ``allocations.msgpack``, rewritten whole on
every change. When that file is found (at start, or written by an older plugin during a
rolling update) its records are imported into the journal and it is renamed
``allocations.msgpack.migrated``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import struct
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from vgpu_plugin.core import defaults
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.host.atomicfile import fsync_dir, tmp_pattern, write_atomically

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(defaults.STATE_DIR)
JOURNAL_FILE_NAME = "allocations.journal"
LOCK_FILE_NAME = "allocations.lock"
# The store before the journal: imported at start, then renamed with MIGRATED_SUFFIX.
LEGACY_FILE_NAME = "allocations.msgpack"
MIGRATED_SUFFIX = ".migrated"
# Marks the legacy file as ours; a file without it is foreign and is refused.
FORMAT_NAME = "vgpu-plugin/allocations"
FORMAT_VERSION = 1

HEADER_PREFIX = b"vgpu-plugin/allocations journal v"
JOURNAL_VERSION = 1
HEADER = HEADER_PREFIX + f"{JOURNAL_VERSION}\n".encode()
ENTRY_MARK = b"\xd8\x1fVR"
# mark, payload length, CRC-32 of the length's four bytes and the payload.
_FRAME = struct.Struct("<4sII")
MAX_ENTRY = 1 << 20
# Changes remembered by id for ``changed_since``: a reader further behind reads the ledger whole.
CHANGES_KEPT = 4096
PUT, DELETE = "put", "del"

# Which front end made an allocation: the device plugin's Allocate, or a DRA claim's prepare.
DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
FRONT_ENDS = (DEVICE_PLUGIN, DRA)
# An allocation's lifecycle (docs/contracts.md#the-ledger): recorded ``preparing`` before its
# files are written, ``prepared`` once they are, ``releasing`` before they are removed; the
# record is dropped once they are gone. Device-plugin allocations are recorded ``prepared``.
PREPARING, PREPARED, RELEASING = "preparing", "prepared", "releasing"
STATES = (PREPARING, PREPARED, RELEASING)


class NotRegularFile(OSError):
    """A state file (the journal, its lock) exists but is no regular file: opening it could
    block (a FIFO) or fail with a bare errno that names nothing ("Illegal seek")."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is not a regular file ({kind})")
        self.path = path
        self.kind = kind

    def __str__(self) -> str:
        return str(self.strerror)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_regular(path: Path) -> None:
    """Raises NotRegularFile when ``path`` exists (symlinks followed) and is no regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, next((n for test, n in _KINDS if test(mode)), "not a file"))


class StateFileError(Exception):
    """A state file is corrupt, foreign or of an unknown version."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"state file {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)  # slots, and shared strings: thousands stay in memory
class AllocationRecord:
    """One allocation of this node, from either front end: for the device plugin, the devices
    the kubelet gave one container; for DRA, one prepared claim (``claim_*``, no device ids).
    Limits in bytes."""

    allocation_id: str
    device_ids: tuple[str, ...]
    resource_name: str
    created: float
    limits: tuple[GpuLimit, ...] = ()
    # Learnt after the fact from the pod-resources API (Allocate has no pod name).
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None
    # When the cleaner first saw it held by nobody (None: held, or not known yet); an ended
    # allocation waits out the cleanup grace and is not counted as live meanwhile.
    released: float | None = None
    front_end: str = DEVICE_PLUGIN
    state: str = PREPARED
    # A DRA allocation's claim (None for the device plugin's).
    claim_uid: str | None = None
    claim_namespace: str | None = None
    claim_name: str | None = None
    # Kept so a newer writer's extra fields survive a round trip through this version.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            allocation_id=self.allocation_id,
            device_ids=list(self.device_ids),
            resource_name=self.resource_name,
            created=self.created,
            # Bytes are the unit (the 4th item); the whole MiB before it is for readers of
            # plugins before the one ledger, which read [uuid, MiB, compute].
            limits=[
                [g.uuid, g.memory_mib, g.compute_percent, g.memory_bytes]
                + ([g.compute_request] if g.compute_request else [])
                for g in self.limits
            ],
            pod=self.pod,
            namespace=self.namespace,
            container=self.container,
            front_end=self.front_end,
            state=self.state,
        )
        if self.released is not None:
            out["released"] = self.released
        if self.claim_uid is not None:
            out.update(
                claim_uid=self.claim_uid,
                claim_namespace=self.claim_namespace,
                claim_name=self.claim_name,
            )
        return out

    @classmethod
    def from_wire(cls, raw: Any) -> AllocationRecord:
        """Decodes one record; raises ValueError naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"record is a {type(raw).__name__}, not a map")
        known = {
            "allocation_id",
            "device_ids",
            "resource_name",
            "created",
            "limits",
            "pod",
            "namespace",
            "container",
            "released",
            "front_end",
            "state",
            "claim_uid",
            "claim_namespace",
            "claim_name",
        }
        try:
            allocation_id = _typed(raw["allocation_id"], str, "allocation_id")
            device_ids = tuple(
                sys.intern(_typed(d, str, "device_ids[]")) for d in raw["device_ids"]
            )
            resource_name = sys.intern(_typed(raw["resource_name"], str, "resource_name"))
            created = float(_typed(raw["created"], (int, float), "created"))
            limits = tuple(
                GpuLimit(
                    sys.intern(_typed(lim[0], str, "limits[].uuid")),
                    _typed(lim[3], int, "limits[].memory_bytes")
                    if len(lim) > 3
                    else _typed(lim[1], int, "limits[].memory_mib") * MIB,
                    _typed(lim[2], int, "limits[].compute_percent"),
                    _typed(lim[4], int, "limits[].compute_request") if len(lim) > 4 else 0,
                )
                for lim in raw.get("limits", [])
            )
            # Any string: a newer writer's front end or state is kept, and owned by no one
            # here but the ledger (the cleanup leaves what it does not know alone).
            front_end = _typed(raw.get("front_end", DEVICE_PLUGIN), str, "front_end")
            state = _typed(raw.get("state", PREPARED), str, "state")
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"malformed record: {err!r}") from err
        return cls(
            allocation_id=allocation_id,
            device_ids=device_ids,
            resource_name=resource_name,
            created=created,
            limits=limits,
            pod=_optional_str(raw.get("pod"), "pod"),
            namespace=_optional_str(raw.get("namespace"), "namespace"),
            container=_optional_str(raw.get("container"), "container"),
            released=_optional_float(raw.get("released"), "released"),
            front_end=sys.intern(front_end),
            state=sys.intern(state),
            claim_uid=_optional_str(raw.get("claim_uid"), "claim_uid"),
            claim_namespace=_optional_str(raw.get("claim_namespace"), "claim_namespace"),
            claim_name=_optional_str(raw.get("claim_name"), "claim_name"),
            extra={
                sys.intern(k): sys.intern(v) if isinstance(v, str) and len(v) < 64 else v
                for k, v in raw.items()
                if k not in known
            },
        )


def _typed(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name} has type {type(value).__name__}")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    return None if value is None else str(_typed(value, str, name))


def _optional_float(value: Any, name: str) -> float | None:
    return None if value is None else float(_typed(value, (int, float), name))


def _sorted(records: Iterable[AllocationRecord]) -> list[AllocationRecord]:
    return sorted(records, key=lambda r: (r.created, r.allocation_id))


# --- the journal's bytes ------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """One journal entry holding ``payload``."""
    size = struct.pack("<I", len(payload))
    return _FRAME.pack(ENTRY_MARK, len(payload), zlib.crc32(size + payload)) + payload


def put_entry(record: AllocationRecord) -> bytes:
    return frame(msgpack.packb([PUT, record.to_wire()], use_bin_type=True))


def delete_entry(allocation_id: str) -> bytes:
    return frame(msgpack.packb([DELETE, allocation_id], use_bin_type=True))


Change = tuple[str, AllocationRecord | str]


@dataclass
class Scan:
    """What ``scan`` found in a stretch of journal."""

    changes: list[Change] = field(default_factory=list)
    entries: int = 0
    # Where reading stopped: the end of the last whole entry, before any unfinished one.
    end: int = 0
    # Bytes after ``end`` that do not (yet) frame an entry: an append in progress or torn.
    tail: int = 0
    # Damage: (offset, why) of each stretch that is not an entry although entries follow it,
    # or of an entry whose content is not a record.
    damage: list[tuple[int, str]] = field(default_factory=list)


def _entry_at(buf: bytes | memoryview, pos: int) -> int:
    """The length of the whole entry framed at ``pos`` (0: none there, or not whole yet)."""
    if len(buf) - pos < _FRAME.size:
        return 0
    mark, length, crc = _FRAME.unpack_from(buf, pos)
    length = int(length)
    start, stop = pos + _FRAME.size, pos + _FRAME.size + length
    if mark != ENTRY_MARK or not 0 < length <= MAX_ENTRY or stop > len(buf):
        return 0
    if zlib.crc32(buf[start:stop], zlib.crc32(buf[pos + 4 : pos + 8])) != crc:
        return 0
    return _FRAME.size + length


def _next_entry(buf: bytes, pos: int) -> int | None:
    """The offset of the next whole entry after ``pos``, if any."""
    at = buf.find(ENTRY_MARK, pos + 1)
    while at >= 0:
        if _entry_at(buf, at):
            return at
        at = buf.find(ENTRY_MARK, at + 1)
    return None


def _decode_change(payload: bytes | memoryview) -> Change:
    """One entry's payload as (PUT, record) or (DELETE, id); ValueError when it is neither."""
    try:
        op, arg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"not a journal change ({err})") from err
    if op == PUT:
        return PUT, AllocationRecord.from_wire(arg)
    if op == DELETE and isinstance(arg, str):
        return DELETE, arg
    raise ValueError(f"unknown change {op!r}")


def scan(buf: bytes, base: int = 0) -> Scan:
    """Every change in ``buf`` (journal bytes starting at file offset ``base``)."""
    out = Scan()
    view = memoryview(buf)
    pos = 0
    while pos < len(buf):
        size = _entry_at(view, pos)
        if not size:
            nxt = _next_entry(buf, pos)
            if nxt is None:  # the end: an append in progress, or one a crash cut short
                out.tail = len(buf) - pos
                break
            out.damage.append((base + pos, f"{nxt - pos} bytes that are no journal entry"))
            pos = nxt
            continue
        out.entries += 1
        try:
            out.changes.append(_decode_change(view[pos + _FRAME.size : pos + size]))
        except ValueError as err:
            out.damage.append((base + pos, str(err)))
        pos += size
    out.end = base + pos
    return out


def check_header(path: Path, head: bytes) -> None:
    """Raises StateFileError unless ``head`` (the file's first bytes) is our header."""
    if head.startswith(HEADER_PREFIX) and b"\n" in head:
        version = head[len(HEADER_PREFIX) : head.index(b"\n")].decode(errors="replace")
        if version != str(JOURNAL_VERSION):
            raise StateFileError(path, f"journal version {version}, this plugin reads 1")
    if not head.startswith(HEADER):
        raise StateFileError(path, "not a vgpu-plugin allocations journal (no header)")


def apply(records: dict[str, AllocationRecord], changes: Iterable[Change]) -> None:
    for op, arg in changes:
        if op == PUT:
            assert isinstance(arg, AllocationRecord)
            records[arg.allocation_id] = arg
        else:
            assert isinstance(arg, str)
            records.pop(arg, None)


# --- the file before the journal ----------------------------------------------------------


def decode(path: Path, data: bytes) -> dict[str, AllocationRecord]:
    """Decodes an ``allocations.msgpack``; raises StateFileError (naming ``path``) on anything
    odd."""
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise StateFileError(path, f"not valid msgpack ({err})") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
        raise StateFileError(path, f"not a vgpu-plugin allocations file (no {FORMAT_NAME!r} mark)")
    if payload.get("version") != FORMAT_VERSION:
        raise StateFileError(
            path, f"format version {payload.get('version')!r}, this plugin reads {FORMAT_VERSION}"
        )
    raw_records = payload.get("records")
    if not isinstance(raw_records, list):
        raise StateFileError(path, "'records' is not a list")
    records: dict[str, AllocationRecord] = {}
    for i, raw in enumerate(raw_records):
        try:
            record = AllocationRecord.from_wire(raw)
        except ValueError as err:
            raise StateFileError(path, f"record {i}: {err}") from err
        records[record.allocation_id] = record
    return records


def _aside(path: Path, suffix: str) -> Path:
    """A free name beside ``path`` for keeping it: ``<name><suffix>``, numbered if taken."""
    aside = path.with_name(f"{path.name}{suffix}")
    n = 0
    while os.path.lexists(aside):  # two in one second must not overwrite each other
        n += 1
        aside = path.with_name(f"{path.name}{suffix}-{n}")
    return aside


# --- the store ----------------------------------------------------------------------------


class _FileLock:
    """An exclusive ``flock`` on the lock file, which stays open: taking the lock is one
    syscall when it is free (the filelock package opened, resolved and closed the file at
    every change: ~0.3 ms of an Allocate's ~1 ms). It keeps other processes out; the store's
    mutex keeps our own threads apart. A forked child shares the open file (and the lock
    while we hold it) but never unlocks it. ``TimeoutError`` (an OSError) after ``timeout``
    seconds held by another process."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._fd: int | None = None

    def __enter__(self) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.path}: another process has held the lock for {self.timeout} s"
                    ) from None
                time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(eq=False)
class _Batch:
    """One ``add_many`` call's records, queued for the next group commit."""

    records: list[AllocationRecord]
    entries: list[bytes] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None


def _copy_error(err: BaseException) -> BaseException:
    """The group's failure for one more caller: a fresh exception of the same kind and
    message (one exception object must not be raised in several threads at once)."""
    if isinstance(err, OSError):
        return OSError(err.errno, err.strerror or str(err))
    return RuntimeError(f"the group commit that held these records failed: {err!r}")


class AllocationStore:
    """The allocation records of this node, shared safely by every plugin process."""

    def __init__(
        self,
        state_dir: Path | str = DEFAULT_STATE_DIR,
        lock_timeout: float = 10.0,
        compact_min: int = 1024,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / JOURNAL_FILE_NAME
        self.legacy_path = self.state_dir / LEGACY_FILE_NAME
        self.compact_min = compact_min
        self._flock = _FileLock(self.state_dir / LOCK_FILE_NAME, lock_timeout)
        # flock is per open file; this keeps our own threads from racing on one FileLock.
        self._mutex = threading.RLock()
        # Where refused or damaged files were kept, if any; for status output and tests.
        self.quarantined: list[Path] = []
        # The journal as far as read: its fd (kept open, so its inode is never reused while
        # we compare by it), inode, the offset read up to and the entries in it.
        self._fd: int | None = None
        self._ino = 0
        self._offset = 0
        self._entries = 0
        self._records: dict[str, AllocationRecord] = {}
        self._sorted: list[AllocationRecord] | None = None
        # The records of each front end but the device plugin's, kept with ``_records`` (None:
        # built again when next asked for): a DRA prepare reads its few claims, not the ledger.
        self._others: dict[str, AllocationRecord] | None = None
        # Every change of ``_records`` (ours, or another process's once read) gets the next
        # version, and the last CHANGES_KEPT of them are kept by id: a periodic reader asks
        # what changed since its version (``changed_since``) instead of reading the ledger
        # whole. ``_reset``: the version at which the records were last read whole (at
        # start, or after another process rewrote the journal): earlier versions are unknown.
        self._version = 0
        self._reset = 0
        self._changes: collections.deque[tuple[int, str]] = collections.deque(maxlen=CHANGES_KEPT)
        # Group commit: add_many's batches waiting for the next writer to hold the lock.
        self._queue_lock = threading.Lock()
        self._pending: list[_Batch] = []
        self.syncs = 0  # group commits tried (for tests and figures)
        # Appends not synced yet (add_many(sync=False)) and the flushes that synced some.
        self._unsynced = False
        self.flushes = 0
        for path in (self._flock.path, self.path):
            check_regular(path)
        with self._mutex, self._flock:
            self._remove_stale_tmp()
            self._sync()

    # --- the API ----------------------------------------------------------------------------

    def add(self, record: AllocationRecord) -> None:
        """Stores ``record``, replacing any record with the same allocation id."""
        with self._locked():
            replaced = record.allocation_id in self._records
            self._add_many([record])
            if replaced:
                self._maybe_compact()

    def add_many(self, records: Iterable[AllocationRecord], sync: bool = True) -> None:
        """Stores ``records`` (replacing those with the same ids) in one durable write: when this
        returns all of them are on disk; when it raises, none was acknowledged.

        Group commit: the entries are encoded before the lock and queued; whoever takes the lock
        first writes every queued batch in one append and syncs once, so callers that arrive
        while a sync runs share the next one instead of each waiting for its own.

        ``sync`` False: one append, not synced: when this returns the records survive the
        process's death (they are in the page cache, whole), and a power loss only once
        ``flush`` (a ``DeferredSync`` pass) has run after it."""
        if not sync:
            unsynced = list(records)
            if unsynced:
                with self._locked():
                    self._add_many(unsynced, sync=False)
            return
        batch = _Batch(list(records))
        if not batch.records:
            return
        batch.entries = [put_entry(r) for r in batch.records]
        with self._queue_lock:
            self._pending.append(batch)
        try:
            with self._locked():
                if not batch.done:
                    self._commit_pending()
        except BaseException:
            # We wrote our batch and that failed, or we could not get the lock or catch up.
            # In the second case another caller may have taken our batch meanwhile: if it is
            # still queued it is taken back (never written); if not, its writer's outcome is
            # ours, known once that writer lets go of the lock.
            with self._queue_lock:
                queued = any(b is batch for b in self._pending)
                if queued:
                    self._pending.remove(batch)
            if queued:
                raise
            with self._mutex:
                pass
            if batch.error is not None or not batch.done:
                raise
            return  # written and synced by another caller, our own failure notwithstanding
        if batch.error is not None:  # another caller wrote our batch, and its sync failed
            raise _copy_error(batch.error) from batch.error

    def remove(self, allocation_id: str) -> bool:
        """Drops a record; returns whether it existed."""
        with self._locked():
            if allocation_id not in self._records:
                return False
            self._append([delete_entry(allocation_id)])
            del self._records[allocation_id]
            self._changed(allocation_id)
            if self._others is not None:
                self._others.pop(allocation_id, None)
            self._drop_sorted(allocation_id)
            self._maybe_compact()
            return True

    def get(self, allocation_id: str) -> AllocationRecord | None:
        with self._locked():
            return self._records.get(allocation_id)

    def all(self) -> list[AllocationRecord]:
        """Every record, oldest first."""
        with self._locked():
            return self._ordered()

    def snapshot(self) -> tuple[int, list[AllocationRecord]]:
        """Every record, oldest first, and the version they are at (for ``changed_since``)."""
        with self._locked():
            return self._version, self._ordered()

    def changed_since(self, version: int) -> tuple[int, dict[str, AllocationRecord | None]] | None:
        """The version now and each record changed after ``version`` (None: removed); costs
        what changed, not the ledger. None when that is no longer known (too many changes
        since, or the journal was read whole again): ``snapshot`` then."""
        with self._locked():
            if version == self._version:
                return version, {}
            kept = self._changes
            if not self._reset <= version < self._version or not kept or kept[0][0] > version + 1:
                return None
            changed: dict[str, AllocationRecord | None] = {}
            for v, aid in reversed(kept):  # the newest first: stop at the caller's version
                if v <= version:
                    break
                changed.setdefault(aid, self._records.get(aid))
            return self._version, changed

    def of_front_end(self, front_end: str) -> list[AllocationRecord]:
        """The records of ``front_end`` (not the device plugin's), oldest first: costs what
        that front end holds, however many records the device plugin has."""
        if front_end == DEVICE_PLUGIN:
            raise ValueError("of_front_end is for the front ends beside the device plugin")
        with self._locked():
            if self._others is None:
                others = (r for r in self._records.values() if r.front_end != DEVICE_PLUGIN)
                self._others = {r.allocation_id: r for r in others}
            return _sorted(r for r in self._others.values() if r.front_end == front_end)

    def flush(self) -> None:
        """Make every append so far durable (``add_many(sync=False)``'s), holding the lock only
        to take a duplicate of the journal's fd: Allocate's appends never wait for this sync.
        A compaction meanwhile is harmless: the new journal was synced whole."""
        with self._mutex:
            if not self._unsynced or self._fd is None:
                return
            fd = os.dup(self._fd)
            self._unsynced = False
        try:
            os.fdatasync(fd)
        except BaseException:
            with self._mutex:
                self._unsynced = True  # the next flush tries again
            raise
        finally:
            os.close(fd)
        self.flushes += 1

    def responsive(self, timeout: float) -> bool:
        """Whether this process's writers can take the store within ``timeout`` seconds (a
        liveness check: a wedged writer holds the mutex forever)."""
        if not self._mutex.acquire(timeout=timeout):
            return False
        self._mutex.release()
        return True

    def close(self) -> None:
        with self._mutex:
            self._close_fd()
            self._flock.close()

    # --- under the lock -----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the lock, caught up with every change any process has made."""
        with self._mutex, self._flock:
            self._sync()
            yield

    def _commit_pending(self) -> None:
        """Write and sync every queued batch at once (caller holds the lock)."""
        with self._queue_lock:
            group, self._pending = self._pending, []
        try:
            self._append([e for b in group for e in b.entries])
        except BaseException as exc:
            for b in group:
                b.error, b.done = exc, True
            raise
        finally:
            self.syncs += 1
        for b in group:
            for r in b.records:
                self._put_record(r)
            b.done = True

    def _add_many(self, records: list[AllocationRecord], sync: bool = True) -> None:
        if not records:
            return
        self._append([put_entry(r) for r in records], sync)
        for r in records:
            self._put_record(r)

    def _put_record(self, r: AllocationRecord) -> None:
        """Stores ``r`` and keeps the oldest-first list where it stays cheap to: a new record
        is most often the newest (appended), a state change keeps its place (replaced, looked
        for from the newest end); otherwise the list is sorted again when next asked for."""
        old = self._records.get(r.allocation_id)
        self._records[r.allocation_id] = r
        self._changed(r.allocation_id)
        if self._others is not None:
            if r.front_end != DEVICE_PLUGIN:
                self._others[r.allocation_id] = r
            else:
                self._others.pop(r.allocation_id, None)
        ordered = self._sorted
        if ordered is None:
            return
        key = (r.created, r.allocation_id)
        if old is None:
            if not ordered or (ordered[-1].created, ordered[-1].allocation_id) <= key:
                ordered.append(r)
                return
        elif (old.created, old.allocation_id) == key:
            for i in range(len(ordered) - 1, -1, -1):
                if ordered[i].allocation_id == r.allocation_id:
                    ordered[i] = r
                    return
        self._sorted = None

    def _ordered(self) -> list[AllocationRecord]:
        """Every record, oldest first, a copy (caller holds the lock)."""
        if self._sorted is None:
            self._sorted = _sorted(self._records.values())
        return list(self._sorted)

    def _changed(self, allocation_id: str) -> None:
        self._version += 1
        self._changes.append((self._version, allocation_id))

    def _drop_sorted(self, allocation_id: str) -> None:
        ordered = self._sorted
        if ordered is None:
            return
        for i in range(len(ordered) - 1, -1, -1):
            if ordered[i].allocation_id == allocation_id:
                del ordered[i]
                return
        self._sorted = None

    def _append(self, entries: list[bytes], sync: bool = True) -> None:
        """Appends and syncs ``entries``; on failure the journal is cut back to where it was.
        ``sync`` False: not synced; ``flush`` syncs it later."""
        assert self._fd is not None
        data = b"".join(entries)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if sync:
                os.fdatasync(self._fd)  # covers earlier unsynced appends too
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._offset)
            raise
        self._offset += len(data)
        self._entries += len(entries)
        self._unsynced = not sync

    def _sync(self) -> None:
        """Catch up with the journal and import a legacy file (caller holds the lock)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None or self._fd is None or st.st_ino != self._ino or st.st_size < self._offset:
            self._reload()
        elif st.st_size > self._offset:
            self._read_on(reload=False)
        if os.path.lexists(self.legacy_path):
            self._import_legacy()

    def _reload(self) -> None:
        """Read the journal from the start (another process rewrote it, or at start)."""
        self._close_fd()
        self._records, self._sorted, self._others = {}, None, None
        self._version += 1
        self._reset = self._version
        self._changes.clear()
        self._offset = self._entries = 0
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        except FileNotFoundError:
            self._create([])
            return
        self._fd, self._ino = fd, os.fstat(fd).st_ino
        head = os.pread(fd, len(HEADER) + 16, 0)
        try:
            check_header(self.path, head)
        except StateFileError as err:
            self._close_fd()
            aside = _aside(self.path, f".corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            self._refused(err.reason, aside, "starting with no allocation records")
            self._create([])
            return
        self._offset = len(HEADER)
        self._read_on(reload=True)

    def _read_on(self, reload: bool) -> None:
        """Apply what was appended since ``_offset``; repair what a crash or damage left."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        found = scan(os.pread(self._fd, size - self._offset, self._offset), self._offset)
        apply(self._records, found.changes)
        self._sorted = self._others = None
        for _op, arg in found.changes:
            self._changed(arg.allocation_id if isinstance(arg, AllocationRecord) else arg)
        self._entries += found.entries
        self._offset = found.end
        if found.damage:
            aside = _aside(self.path, f".corrupt-{int(time.time())}")
            shutil.copyfile(self.path, aside)
            where = "; ".join(f"at byte {at}: {why}" for at, why in found.damage)
            self._refused(where, aside, "keeping every intact entry")
            self._compact()
        elif found.tail:
            # We hold the lock, so no append is in progress: a writer died mid-append, before
            # its write was acknowledged.
            os.ftruncate(self._fd, self._offset)
            os.fsync(self._fd)
            log.warning(
                "dropped the last %d bytes of %s: an unacknowledged append a crash cut short",
                found.tail,
                self.path,
                extra={"state_file": str(self.path)},
            )
        if reload:
            self._maybe_compact()

    def _refused(self, reason: str, aside: Path, outcome: str) -> None:
        self.quarantined.append(aside)
        log.error(
            "refused %s (%s); kept it as %s and %s",
            self.path,
            reason,
            aside,
            outcome,
            extra={"state_file": str(self.path), "moved_to": str(aside)},
        )

    def _create(self, records: Iterable[AllocationRecord]) -> None:
        """Replace the journal with one holding ``records`` only, atomically, and open it."""
        records = list(records)
        data = b"".join([HEADER, *(put_entry(r) for r in records)])
        write_atomically(self.path, data)
        self._close_fd()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        self._ino = os.fstat(self._fd).st_ino
        self._offset, self._entries = len(data), len(records)
        self._unsynced = False  # written and synced whole
        self._records = {r.allocation_id: r for r in records}  # the same records (compaction)
        self._sorted = self._others = None

    def _maybe_compact(self) -> None:
        if self._entries - len(self._records) > max(self.compact_min, len(self._records)):
            self._compact()

    def _compact(self) -> None:
        before = self._entries
        self._create(_sorted(self._records.values()))
        log.info(
            "compacted %s: %d entries -> %d records",
            self.path,
            before,
            len(self._records),
            extra={"state_file": str(self.path)},
        )

    def _import_legacy(self) -> None:
        """Move the records of an ``allocations.msgpack`` into the journal (migration)."""
        path = self.legacy_path
        try:
            records = decode(path, path.read_bytes())
        except FileNotFoundError:
            return
        except StateFileError as err:
            aside = _aside(path, f".corrupt-{int(time.time())}")
            os.replace(path, aside)
            self.quarantined.append(aside)
            log.error(
                "refused %s (%s); moved it to %s: its allocation records are not imported",
                path,
                err.reason,
                aside,
                extra={"state_file": str(path), "moved_to": str(aside)},
            )
            return
        self._add_many(list(records.values()))
        aside = _aside(path, MIGRATED_SUFFIX)
        os.replace(path, aside)
        fsync_dir(self.state_dir)
        log.info(
            "imported %d allocation records from %s into %s; the old file is kept as %s",
            len(records),
            path,
            self.path,
            aside,
            extra={"state_file": str(self.path), "moved_to": str(aside)},
        )

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove_stale_tmp(self) -> None:
        # Writers hold the lock while their tmp file exists, so under the lock any tmp file
        # is left over from a crash and safe to delete.
        for name in (self.path, self.legacy_path):
            for tmp in self.state_dir.glob(tmp_pattern(name)):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    log.info("removed %s, left by a writer that died mid-write", tmp)


# --- readers without the lock ---------------------------------------------------------------


class JournalReader:
    """The records of one state dir for a reader that takes no lock and repairs nothing
    (status, metrics): each ``read`` costs one ``stat`` when nothing changed, and decodes only
    what was appended since the last one."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / JOURNAL_FILE_NAME
        self.legacy_path = Path(state_dir) / LEGACY_FILE_NAME
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._ino = 0
        self._offset = 0
        self._records: dict[str, AllocationRecord] = {}
        self._problem: str | None = None
        self._legacy_key: tuple[int, int, int] | None = None
        self._legacy: dict[str, AllocationRecord] = {}
        self._legacy_problem: str | None = None
        self._sorted: list[AllocationRecord] | None = None

    def read(self) -> tuple[list[AllocationRecord], str | None]:
        with self._lock:
            try:
                self._read_journal()
                self._read_legacy()
            except OSError as exc:
                self._close()
                return [], f"cannot read allocation records: {exc}"
            if self._sorted is None:
                self._sorted = _sorted({**self._records, **self._legacy}.values())
            return list(self._sorted), self._problem or self._legacy_problem

    def _read_journal(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._fd is not None or self._records or self._problem:
                self._close()
                self._records, self._problem, self._sorted = {}, None, None
            return
        if self._fd is None or st.st_ino != self._ino or st.st_size < self._offset:
            self._close()
            self._records, self._problem, self._sorted = {}, None, None
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self._ino = os.fstat(self._fd).st_ino
            self._offset = 0
            try:
                check_header(self.path, os.pread(self._fd, len(HEADER) + 16, 0))
            except StateFileError as err:
                self._problem = str(err)
                self._offset = os.fstat(self._fd).st_size + 1  # nothing more to read here
                return
            self._offset = len(HEADER)
        size = os.fstat(self._fd).st_size
        if self._problem is not None or size <= self._offset:
            return
        found = scan(os.pread(self._fd, size - self._offset, self._offset), self._offset)
        apply(self._records, found.changes)
        self._offset = found.end
        self._sorted = None
        if found.damage:
            at, why = found.damage[0]
            self._problem = (
                f"state file {self.path}: damaged at byte {at} ({why}); the plugin keeps a copy "
                "and the intact entries"
            )

    def _read_legacy(self) -> None:
        """An ``allocations.msgpack`` the plugin has not imported yet (an older plugin runs)."""
        try:
            st = os.stat(self.legacy_path)
        except FileNotFoundError:
            if self._legacy_key is not None:
                self._legacy_key, self._legacy, self._legacy_problem = None, {}, None
                self._sorted = None
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._legacy_key:
            return
        self._legacy_key, self._sorted = key, None
        try:
            self._legacy = decode(self.legacy_path, self.legacy_path.read_bytes())
            self._legacy_problem = None
        except FileNotFoundError:
            self._legacy_key, self._legacy, self._legacy_problem = None, {}, None
        except StateFileError as exc:
            self._legacy, self._legacy_problem = {}, str(exc)

    def close(self) -> None:
        """Forget the journal's file (a later ``read`` opens it again)."""
        with self._lock:
            self._close()
            self._records, self._problem, self._sorted = {}, None, None

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ino = self._offset = 0


# A few state dirs at most are read in one process (the plugin's own; status reads one): the
# cache keeps the most recent, closing the file of one it drops, so no fd is held forever.
_MAX_READERS = 4
_readers: OrderedDict[Path, JournalReader] = OrderedDict()
_readers_lock = threading.Lock()


def read_records(state_dir: Path) -> tuple[list[AllocationRecord], str | None]:
    """The plugin's records, oldest first, and a problem to report (None: none), read without
    its lock (appends are framed and checksummed, rewrites are atomic renames) and without its
    repairs (a damaged file is reported, never moved: that is the plugin's call). Cached per
    state dir: a call when nothing changed costs a ``stat``."""
    key = Path(state_dir).absolute()
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = JournalReader(key)
        _readers.move_to_end(key)
        while len(_readers) > _MAX_READERS:
            _readers.popitem(last=False)[1].close()
    return reader.read()
