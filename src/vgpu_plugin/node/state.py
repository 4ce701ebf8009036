"""Allocation records, persisted in the state dir so a restarted plugin knows what it handed out.

One msgpack file (``allocations.msgpack``) holds every record. Every change is a
read-modify-write under an exclusive file lock (``allocations.lock``), so two plugin processes
(a rolling DaemonSet update) cannot lose each other's records, and every write is atomic (tmp
file + fsync + rename + fsync of the dir), so a crash leaves either the old or the new file.
A file that is not ours or cannot be decoded is never silently dropped: it is moved aside to
``<file>.corrupt-<unix time>`` and logged, and the store starts empty.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock
import msgpack

from vgpu_plugin.core import defaults
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.atomicfile import tmp_pattern, write_atomically

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path(defaults.STATE_DIR)
STATE_FILE_NAME = "allocations.msgpack"
LOCK_FILE_NAME = "allocations.lock"
# Marks the file as ours; a file without it is foreign and is refused.
FORMAT_NAME = "vgpu-plugin/allocations"
FORMAT_VERSION = 1


class StateFileError(Exception):
    """The state file is corrupt, foreign or of an unknown version."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"state file {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class AllocationRecord:
    """One Allocate answer: the devices the kubelet gave one container and their limits."""

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
    # Kept so a newer writer's extra fields survive a round trip through this version.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        out.update(
            allocation_id=self.allocation_id,
            device_ids=list(self.device_ids),
            resource_name=self.resource_name,
            created=self.created,
            limits=[[g.uuid, g.memory_mib, g.compute_percent] for g in self.limits],
            pod=self.pod,
            namespace=self.namespace,
            container=self.container,
        )
        if self.released is not None:
            out["released"] = self.released
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
        }
        try:
            allocation_id = _typed(raw["allocation_id"], str, "allocation_id")
            device_ids = tuple(_typed(d, str, "device_ids[]") for d in raw["device_ids"])
            resource_name = _typed(raw["resource_name"], str, "resource_name")
            created = float(_typed(raw["created"], (int, float), "created"))
            limits = tuple(
                GpuLimit(
                    _typed(lim[0], str, "limits[].uuid"),
                    _typed(lim[1], int, "limits[].memory_mib") * MIB,
                    _typed(lim[2], int, "limits[].compute_percent"),
                )
                for lim in raw.get("limits", [])
            )
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
            extra={k: v for k, v in raw.items() if k not in known},
        )


def _typed(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name} has type {type(value).__name__}")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    return None if value is None else str(_typed(value, str, name))


def _optional_float(value: Any, name: str) -> float | None:
    return None if value is None else float(_typed(value, (int, float), name))


def pack_record(record: AllocationRecord) -> bytes:
    data: bytes = msgpack.packb(record.to_wire(), use_bin_type=True)
    return data


def encode(records: dict[str, AllocationRecord], packed: dict[str, bytes] | None = None) -> bytes:
    """The file's bytes. ``packed`` holds records already encoded (by allocation id), so a
    change re-encodes only what changed: Allocate must not cost O(records) of Python work."""
    packer = msgpack.Packer(use_bin_type=True)
    head = [
        packer.pack_map_header(3),
        packer.pack("format"),
        packer.pack(FORMAT_NAME),
        packer.pack("version"),
        packer.pack(FORMAT_VERSION),
        packer.pack("records"),
        packer.pack_array_header(len(records)),
    ]
    cache = packed if packed is not None else {}
    body = [cache.get(k) or pack_record(r) for k, r in records.items()]
    return b"".join(head + body)


def decode(path: Path, data: bytes) -> dict[str, AllocationRecord]:
    """Decodes the file's bytes; raises StateFileError (naming ``path``) on anything odd."""
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


class AllocationStore:
    """The allocation records of this node, shared safely by every plugin process."""

    def __init__(self, state_dir: Path | str = DEFAULT_STATE_DIR, lock_timeout: float = 10.0):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / STATE_FILE_NAME
        self._flock = filelock.FileLock(self.state_dir / LOCK_FILE_NAME, timeout=lock_timeout)
        # flock is per open file; this keeps our own threads from racing on one FileLock.
        self._mutex = threading.RLock()
        # Where a refused file was moved, if one was; for status output and tests.
        self.quarantined: list[Path] = []
        # The last bytes read or written and what they decode to: a read that finds the same
        # bytes skips decoding. Compared by content, so another process's write is never missed.
        self._seen_bytes: bytes | None = None
        self._seen_records: dict[str, AllocationRecord] = {}
        self._packed: dict[str, bytes] = {}
        with self._locked():
            self._remove_stale_tmp()
            self._load()

    def add(self, record: AllocationRecord) -> None:
        """Stores ``record``, replacing any record with the same allocation id."""
        with self._locked():
            records = self._load()
            records[record.allocation_id] = record
            self._packed[record.allocation_id] = pack_record(record)
            self._write(records)

    def remove(self, allocation_id: str) -> bool:
        """Drops a record; returns whether it existed."""
        with self._locked():
            records = self._load()
            if records.pop(allocation_id, None) is None:
                return False
            self._write(records)
            return True

    def get(self, allocation_id: str) -> AllocationRecord | None:
        with self._locked():
            return self._load().get(allocation_id)

    def all(self) -> list[AllocationRecord]:
        """Every record, oldest first."""
        with self._locked():
            return sorted(self._load().values(), key=lambda r: (r.created, r.allocation_id))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex, self._flock:
            yield

    def _write(self, records: dict[str, AllocationRecord]) -> None:
        self._packed = {k: v for k, v in self._packed.items() if k in records}
        data = encode(records, self._packed)
        write_atomically(self.path, data)
        self._seen_bytes, self._seen_records = data, dict(records)

    def _load(self) -> dict[str, AllocationRecord]:
        """Reads the file (caller holds the lock); a bad file is quarantined, not fatal."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        if data == self._seen_bytes:
            return dict(self._seen_records)
        try:
            records = decode(self.path, data)
        except StateFileError as err:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            n = 0
            while aside.exists():  # two refusals in one second must not overwrite each other
                n += 1
                aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{n}")
            os.replace(self.path, aside)
            self.quarantined.append(aside)
            log.error(
                "refused %s (%s); moved it to %s and starting with no allocation records",
                self.path,
                err.reason,
                aside,
                extra={"state_file": str(self.path), "moved_to": str(aside)},
            )
            return {}
        self._seen_bytes, self._seen_records = data, dict(records)
        self._packed = {k: pack_record(r) for k, r in records.items()}
        return records

    def _remove_stale_tmp(self) -> None:
        # Writers hold the lock while their tmp file exists, so under the lock any tmp file
        # is left over from a crash and safe to delete.
        for tmp in self.state_dir.glob(tmp_pattern(self.path)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                log.info("removed %s, left by a writer that died mid-write", tmp)


def read_records(state_dir: Path) -> tuple[list[AllocationRecord], str | None]:
    """The plugin's records, read without its lock (its writes are atomic renames) and without
    its repairs (a refused file is reported, not moved aside: that is the plugin's call)."""
    path = Path(state_dir) / STATE_FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        return [], f"cannot read allocation records: {exc}"
    try:
        records = decode(path, data)
    except StateFileError as exc:
        return [], str(exc)
    return sorted(records.values(), key=lambda r: (r.created, r.allocation_id)), None
