"""The DRA driver's prepared claims, as records of the one allocation ledger (the journal of
``node/ledger/state.py``): a kubelet retry or a restarted plugin answers NodePrepareResources for a
claim exactly as the first time, NodeUnprepareResources knows what to remove, and the
cleanup's orphan sweep leaves a claim's files alone for as long as its record exists.

A claim's record: front end ``dra``, the claim's namespace, name and UID, its limits (bytes)
and its state (``preparing``, ``prepared``, ``releasing``); the devices answered to the
kubelet and the paths written are in the record's extra (``dra_devices``, ``allocation_dir``,
``limits_path``).

Before the ledger the driver kept its claims in ``dra-claims.json`` in the state dir. At
start (``migrate_claims_file``) its claims are imported into the journal and it is renamed
``dra-claims.json.migrated``; one that cannot be read is moved aside (``.corrupt-<time>``)
with an error and nothing is imported from it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.host.atomicfile import fsync_dir
from vgpu_plugin.node.ledger.state import (
    DRA,
    PREPARED,
    AllocationRecord,
    AllocationStore,
)

log = logging.getLogger(__name__)

FILE_NAME = "dra-claims.json"
FORMAT = "vgpu-plugin/dra-claims"
MIGRATED_SUFFIX = ".migrated"
DEVICES_KEY = "dra_devices"
DIR_KEY = "allocation_dir"
LIMITS_KEY = "limits_path"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of the answer to the kubelet (the fields of the DRA API's ``Device``)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str = ""


@dataclass(frozen=True)
class PreparedClaim:
    """A prepared claim as the driver answers from it (the content of its ledger record)."""

    uid: str
    namespace: str
    name: str
    allocation_id: str
    allocation_dir: str
    limits_path: str
    devices: tuple[PreparedDevice, ...]
    limits: tuple[GpuLimit, ...]
    created: float

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> PreparedClaim:
        """A claim of a ``dra-claims.json`` (the file before the ledger)."""
        return cls(
            uid=str(raw["uid"]),
            namespace=str(raw["namespace"]),
            name=str(raw["name"]),
            allocation_id=str(raw["allocation_id"]),
            allocation_dir=str(raw["allocation_dir"]),
            limits_path=str(raw["limits_path"]),
            devices=tuple(_device(d) for d in raw["devices"]),
            limits=tuple(GpuLimit(str(u), int(m), int(c)) for u, m, c in raw["limits"]),
            created=float(raw["created"]),
        )


def _device_wire(d: PreparedDevice) -> dict[str, Any]:
    return {
        "request_names": list(d.request_names),
        "pool_name": d.pool_name,
        "device_name": d.device_name,
        "cdi_device_ids": list(d.cdi_device_ids),
        "share_id": d.share_id,
    }


def _device(d: dict[str, Any]) -> PreparedDevice:
    return PreparedDevice(
        tuple(str(x) for x in d["request_names"]),
        str(d["pool_name"]),
        str(d["device_name"]),
        tuple(str(x) for x in d["cdi_device_ids"]),
        str(d.get("share_id", "")),
    )


def claim_record(claim: PreparedClaim, state: str = PREPARED) -> AllocationRecord:
    """The ledger's record of ``claim`` in ``state``."""
    return AllocationRecord(
        allocation_id=claim.allocation_id,
        device_ids=(),
        resource_name=DRA,
        created=claim.created,
        limits=claim.limits,
        front_end=DRA,
        state=state,
        claim_uid=claim.uid,
        claim_namespace=claim.namespace,
        claim_name=claim.name,
        extra={
            DEVICES_KEY: [_device_wire(d) for d in claim.devices],
            DIR_KEY: claim.allocation_dir,
            LIMITS_KEY: claim.limits_path,
        },
    )


def claim_of(record: AllocationRecord) -> PreparedClaim:
    """The claim a DRA record holds; ValueError when the record is not one (or is damaged)."""
    if record.front_end != DRA or record.claim_uid is None:
        raise ValueError(f"allocation {record.allocation_id} is not a DRA claim's")
    try:
        devices = tuple(_device(d) for d in record.extra.get(DEVICES_KEY, []))
        return PreparedClaim(
            uid=record.claim_uid,
            namespace=record.claim_namespace or "",
            name=record.claim_name or "",
            allocation_id=record.allocation_id,
            allocation_dir=str(record.extra[DIR_KEY]),
            limits_path=str(record.extra[LIMITS_KEY]),
            devices=devices,
            limits=record.limits,
            created=record.created,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"allocation {record.allocation_id}: malformed claim: {exc!r}") from exc


def prepared_claims(records: list[AllocationRecord]) -> list[PreparedClaim]:
    """The prepared claims among ``records`` (any order in, oldest first out)."""
    out = []
    for r in records:
        if r.front_end == DRA and r.state == PREPARED:
            try:
                out.append(claim_of(r))
            except ValueError as exc:
                log.error("%s", exc)
    return sorted(out, key=lambda c: (c.created, c.uid))


def _decode_file(data: bytes) -> list[PreparedClaim]:
    body = json.loads(data)
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != 1:
        raise ValueError("not a vgpu-plugin DRA claims file of version 1")
    return [PreparedClaim.from_wire(c) for c in body["claims"]]


def read_prepared_claims(state_dir: Path | str) -> tuple[list[PreparedClaim], str | None]:
    """The claims of a ``dra-claims.json`` not migrated into the ledger yet (an older plugin
    runs), read-only, for ``status``: the ledger's own DRA records come with the allocation
    records. Never moves an unreadable file aside, but says why it gave nothing."""
    path = Path(state_dir) / FILE_NAME
    try:
        claims = _decode_file(path.read_bytes())
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [], f"DRA claims file {path}: {exc}"
    return sorted(claims, key=lambda c: (c.created, c.uid)), None


def migrate_claims_file(store: AllocationStore) -> int:
    """Imports the claims of the state dir's ``dra-claims.json`` (written by a plugin before
    the one ledger) into ``store`` and renames the file ``.migrated``; returns how many were
    imported. A claim the ledger already has is left as the ledger has it. An unreadable file
    is moved aside (``.corrupt-<time>``) with an error; OSError when the store cannot be
    written (the file then stays, for the next start)."""
    path = store.state_dir / FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    try:
        claims = _decode_file(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        os.replace(path, aside)
        log.error(
            "DRA claims file %s is unreadable (%s): moved to %s; its claims are not imported",
            path,
            exc,
            aside,
            extra={"state_file": str(path), "moved_to": str(aside)},
        )
        return 0
    new = [claim_record(c) for c in claims if store.get(c.allocation_id) is None]
    store.add_many(new)
    aside = path.with_name(path.name + MIGRATED_SUFFIX)
    os.replace(path, aside)
    fsync_dir(store.state_dir)
    log.info(
        "imported %d DRA claims from %s into %s; the old file is kept as %s",
        len(new),
        path,
        store.path,
        aside,
        extra={"state_file": str(store.path), "moved_to": str(aside)},
    )
    return len(new)


class ClaimLedger:
    """The DRA driver's view of the ledger: its claims' records, by claim UID."""

    def __init__(self, store: AllocationStore) -> None:
        self.store = store

    def record(self, allocation_id: str) -> AllocationRecord | None:
        r = self.store.get(allocation_id)
        return r if r is not None and r.front_end == DRA else None

    def put(self, claim: PreparedClaim, state: str, sync: bool = True) -> None:
        """Records ``claim`` in ``state``; ``sync`` False: a step the next synced one covers
        (the process's death keeps it; a power loss leaves files the orphan sweep owns)."""
        self.store.add_many([claim_record(claim, state)], sync=sync)

    def mark(self, record: AllocationRecord, state: str, sync: bool = True) -> None:
        self.store.add_many([replace(record, state=state)], sync=sync)

    def drop(self, allocation_id: str) -> None:
        self.store.remove(allocation_id)

    def all(self) -> list[PreparedClaim]:
        return prepared_claims(self.store.of_front_end(DRA))

    def records(self) -> list[AllocationRecord]:
        """Every DRA record, whatever its state, oldest first."""
        return self.store.of_front_end(DRA)

    def unfinished(self) -> list[AllocationRecord]:
        """DRA records a crash left half-way (``preparing`` or ``releasing``)."""
        return [r for r in self.store.of_front_end(DRA) if r.state != PREPARED]
