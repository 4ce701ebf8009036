"""The DRA driver's prepared claims, persisted so that a kubelet retry or a restarted plugin
answers NodePrepareResources for a claim exactly as the first time, and NodeUnprepareResources
knows what to remove.

One JSON file (``dra-claims.json`` in the state dir), rewritten atomically on every change
under a lock of this process; one plugin process serves the DRA socket at a time. A file that
cannot be read is moved aside (``.corrupt-<time>``) and logged, and the store starts empty.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.atomicfile import write_atomically

log = logging.getLogger(__name__)

FILE_NAME = "dra-claims.json"
FORMAT = "vgpu-plugin/dra-claims"


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
    uid: str
    namespace: str
    name: str
    allocation_id: str
    allocation_dir: str
    limits_path: str
    devices: tuple[PreparedDevice, ...]
    limits: tuple[GpuLimit, ...]
    created: float

    def to_wire(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "allocation_id": self.allocation_id,
            "allocation_dir": self.allocation_dir,
            "limits_path": self.limits_path,
            "devices": [
                {
                    "request_names": list(d.request_names),
                    "pool_name": d.pool_name,
                    "device_name": d.device_name,
                    "cdi_device_ids": list(d.cdi_device_ids),
                    "share_id": d.share_id,
                }
                for d in self.devices
            ],
            "limits": [[g.uuid, g.memory_bytes, g.compute_percent] for g in self.limits],
            "created": self.created,
        }

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> PreparedClaim:
        return cls(
            uid=str(raw["uid"]),
            namespace=str(raw["namespace"]),
            name=str(raw["name"]),
            allocation_id=str(raw["allocation_id"]),
            allocation_dir=str(raw["allocation_dir"]),
            limits_path=str(raw["limits_path"]),
            devices=tuple(
                PreparedDevice(
                    tuple(d["request_names"]),
                    str(d["pool_name"]),
                    str(d["device_name"]),
                    tuple(d["cdi_device_ids"]),
                    str(d.get("share_id", "")),
                )
                for d in raw["devices"]
            ),
            limits=tuple(GpuLimit(str(u), int(m), int(c)) for u, m, c in raw["limits"]),
            created=float(raw["created"]),
        )


def read_prepared_claims(state_dir: Path | str) -> tuple[list[PreparedClaim], str | None]:
    """The prepared claims on file, read-only (for ``status`` and the metrics): never moves an
    unreadable file aside, but says why it gave nothing. No file: no claims, no problem."""
    path = Path(state_dir) / FILE_NAME
    try:
        body = json.loads(path.read_bytes())
        if body.get("format") != FORMAT or body.get("version") != 1:
            raise ValueError("not a vgpu-plugin DRA claims file of version 1")
        claims = [PreparedClaim.from_wire(c) for c in body["claims"]]
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [], f"DRA claims file {path}: {exc}"
    return sorted(claims, key=lambda c: (c.created, c.uid)), None


class PreparedClaims:
    """The prepared claims by UID, kept in memory and on disk."""

    def __init__(self, state_dir: Path | str) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._lock = threading.Lock()
        self._claims = self._load()

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def all(self) -> list[PreparedClaim]:
        with self._lock:
            return sorted(self._claims.values(), key=lambda c: (c.created, c.uid))

    def add(self, claim: PreparedClaim) -> None:
        with self._lock:
            claims = dict(self._claims)
            claims[claim.uid] = claim
            self._write(claims)
            self._claims = claims

    def remove(self, uid: str) -> bool:
        with self._lock:
            if uid not in self._claims:
                return False
            claims = {k: v for k, v in self._claims.items() if k != uid}
            self._write(claims)
            self._claims = claims
            return True

    def _write(self, claims: dict[str, PreparedClaim]) -> None:
        body = {"format": FORMAT, "version": 1, "claims": [c.to_wire() for c in claims.values()]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, (json.dumps(body, indent=1) + "\n").encode(), 0o600)

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT or body.get("version") != 1:
                raise ValueError("not a vgpu-plugin DRA claims file of version 1")
            claims = [PreparedClaim.from_wire(c) for c in body["claims"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            self.path.rename(aside)
            log.error("DRA claims file %s is unreadable (%s): moved to %s", self.path, exc, aside)
            return {}
        return {c.uid: c for c in claims}
