"""The DRA driver's domain (docs/dra.md): prepare and unprepare claims, publish the slice.

NodePrepareResources names claims only; for each one the driver reads the claim from the API
server (``ClaimReader``, with its timeout), takes what its allocation consumed of each of
this driver's GPUs, and builds the container's grant, limits file, region dir and shim mounts
with the same core builder as the device plugin's Allocate (``grant_amounts`` then
``container_spec``). The shim reaches the containers as a CDI device: one spec per claim,
``vgpu-plugin/allocation=dra-<claim UID>``, beside the toolkit's ``nvidia.com/gpu=<UUID>``.
Every container that uses the claim gets the same device, so the containers of one pod that
share a claim share one limits file and one region: one limit for all of them.

A prepared claim is recorded (``node/dra_claims.py``) before the answer, so a kubelet retry
or a restarted plugin answers from the record without the API server, and
NodeUnprepareResources removes exactly what was made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vgpu_plugin.core import cdi, defaults, dra
from vgpu_plugin.core.allocation import container_spec
from vgpu_plugin.core.config import Config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.core.grant import Amount, InvalidRequest, grant_amounts
from vgpu_plugin.node.dra_claims import PreparedClaim, PreparedClaims, PreparedDevice
from vgpu_plugin.node.hostfiles import remove_allocation, write_allocation
from vgpu_plugin.node.kubeapi import ApiError, ClaimReader, SlicePublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


class DraDriver:
    """Prepares claims on this node's DRA GPUs and keeps the node's ResourceSlice current."""

    def __init__(
        self,
        gpus: Sequence[PhysicalGpu],
        config: Config,
        node_name: str,
        claims: PreparedClaims,
        reader: ClaimReader,
        publisher: SlicePublisher,
        shim_version: str,
        facts: Mapping[str, dra.DeviceFacts] | None = None,
        lock_dir: str = defaults.LOCK_DIR,
        cdi_spec_dir: str = cdi.SPEC_DIR,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._gpus = tuple(sorted(gpus, key=lambda g: g.index))
        self._config = config
        self._node = node_name
        self._claims = claims
        self._reader = reader
        self._publisher = publisher
        self._shim_version = shim_version
        self._facts = dict(facts or {})
        self._lock_dir = lock_dir
        self._cdi_spec_dir = cdi_spec_dir
        self._clock = clock
        self._unhealthy: set[str] = set()
        self._generation = 0
        self._lock = threading.Lock()  # one claim at a time: cheap, and no two writers
        self._by_name = {dra.device_name(g): g for g in self._gpus}

    @property
    def driver_name(self) -> str:
        return self._config.dra.driver_name

    @property
    def gpus(self) -> tuple[PhysicalGpu, ...]:
        return self._gpus

    # --- the ResourceSlice ----------------------------------------------------------------

    def resource_slice(self) -> dict[str, object]:
        d = self._config.dra
        return dra.resource_slice(
            self._node,
            d.driver_name,
            [
                (g, self._facts.get(g.uuid, dra.DeviceFacts()))
                for g in self._gpus
                if g.uuid not in self._unhealthy
            ],
            generation=max(1, self._generation),
            memory=dra.CapacityPolicy(*d.memory),
            compute=dra.CapacityPolicy(*d.compute),
        )

    def publish(self, why: str) -> bool:
        """Publish the slice (a new generation); False, logged, when the API server refuses
        (the next trigger or the caller's retry publishes again)."""
        with self._lock:
            self._generation += 1
            body = self.resource_slice()
        try:
            self._publisher.publish(body)
        except ApiError as exc:
            log.error("cannot publish the ResourceSlice (%s): %s", why, exc)
            return False
        log.info(
            "published ResourceSlice %s generation %d (%s): %d devices",
            body["metadata"]["name"],  # type: ignore[index]
            self._generation,
            why,
            len(body["spec"]["devices"]),  # type: ignore[index]
        )
        return True

    def apply_health(self, uuid: str, healthy: bool) -> None:
        if uuid not in {g.uuid for g in self._gpus}:
            return
        before = set(self._unhealthy)
        (self._unhealthy.discard if healthy else self._unhealthy.add)(uuid)
        if self._unhealthy != before:
            self.publish(f"GPU {uuid} {'healthy' if healthy else 'unhealthy'}")

    def apply_config(self, config: Config) -> None:
        """New request policies are republished; the GPUs and the driver name stay until a
        restart (claims already allocated name them)."""
        old = self._config
        self._config = config if config.dra.driver_name == old.dra.driver_name else old
        if config.dra != old.dra:
            self.publish("config reloaded")

    # --- the kubelet's calls --------------------------------------------------------------

    def prepare(self, claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        """The devices to answer for ``claim``; ValueError (one line) when it cannot be."""
        with self._lock:
            done = self._claims.get(claim.uid)
            if done is not None:
                return done.devices
        # The read takes what the API server takes: outside the lock, so that unprepares
        # and answers from the record never wait on it (the server's queue keeps a claim's
        # prepare and unprepare apart).
        try:
            body = self._reader.get_claim(claim.namespace, claim.name)
        except ApiError as exc:
            raise ValueError(f"cannot read claim {claim.namespace}/{claim.name}: {exc}") from exc
        with self._lock:
            done = self._claims.get(claim.uid)
            if done is not None:  # prepared meanwhile, by a retry
                return done.devices
            prepared = self._prepare(claim, body)
            self._claims.add(prepared)
            g = prepared.limits
            log.info(
                "prepared claim %s/%s -> %s",
                claim.namespace,
                claim.name,
                "; ".join(f"{x.uuid} {x.memory_mib} MiB {x.compute_percent}%" for x in g),
                extra={"allocation_id": prepared.allocation_id, "claim_uid": claim.uid},
            )
            return prepared.devices

    def _prepare(self, claim: ClaimRef, body: Mapping[str, object]) -> PreparedClaim:
        policies = self._config.dra
        results = dra.claim_devices(
            body,
            self.driver_name,
            claim.uid,
            dra.CapacityPolicy(*policies.memory),
            dra.CapacityPolicy(*policies.compute),
        )
        amounts: list[Amount] = []
        for r in results:
            gpu = self._by_name.get(r.device)
            if r.pool != self._node or gpu is None:
                raise dra.ClaimError(
                    f"claim {claim.namespace}/{claim.name}: device {r.pool}/{r.device} is not"
                    f" one of node {self._node}'s"
                )
            compute = 0 if r.compute_percent == 100 else r.compute_percent
            amounts.append(Amount(gpu.uuid, r.memory_bytes, compute))
        # Fail closed: never promise a GPU more than it has, whatever the scheduler summed.
        dra.check_fits(
            f"{claim.namespace}/{claim.name}",
            {g.uuid: g.memory_total for g in self._gpus},
            (x for c in self._claims.all() if c.uid != claim.uid for x in c.limits),
            amounts,
        )
        aid = dra.allocation_id(claim.uid)
        try:
            grant = grant_amounts(self._gpus, amounts, aid)
        except InvalidRequest as exc:
            raise dra.ClaimError(f"claim {claim.namespace}/{claim.name}: {exc}") from exc
        spec = container_spec(
            grant,
            self._config.host_root,
            self._shim_version,
            self._lock_dir,
            (cdi.CDI_CRI,),
            self._config.driver_memory_limit,
        )
        shim_device = spec.cdi_devices[-1]
        devices = []
        for i, r in enumerate(results):
            gpu = self._by_name[r.device]
            ids = [cdi.qualified_name(cdi.GPU_KIND, gpu.uuid)]
            if i == 0:  # once per claim: every container of the claim gets its devices
                ids.append(shim_device)
            devices.append(PreparedDevice((r.request,), r.pool, r.device, tuple(ids), r.share_id))
        try:
            write_allocation(spec, aid, self._cdi_spec_dir)  # all or nothing
        except OSError as exc:
            raise ValueError(f"cannot prepare the claim's files on the host: {exc}") from exc
        return PreparedClaim(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            allocation_id=aid,
            allocation_dir=spec.allocation_dir,
            limits_path=spec.limits_path,
            devices=tuple(devices),
            limits=tuple(x.limit for x in grant.gpus),
            created=self._clock(),
        )

    def unprepare(self, claim: ClaimRef) -> None:
        """Remove the claim's files and record; a claim never prepared here is fine."""
        with self._lock:
            done = self._claims.get(claim.uid)
            if done is None:
                return
            remove_allocation(
                done.allocation_dir, done.limits_path, done.allocation_id, self._cdi_spec_dir
            )
            self._claims.remove(claim.uid)
            log.info(
                "unprepared claim %s/%s",
                claim.namespace,
                claim.name,
                extra={"allocation_id": done.allocation_id, "claim_uid": claim.uid},
            )

    def prepared(self) -> list[PreparedClaim]:
        return self._claims.all()
