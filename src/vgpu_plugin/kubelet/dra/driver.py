"""The DRA driver's domain (docs/dra.md): prepare and unprepare claims, publish the slice.

NodePrepareResources names claims only; for each one the driver reads the claim from the API
server (``ClaimReader``, with its timeout), takes what its allocation consumed of each of
this driver's GPUs, and builds the container's grant, limits file, region dir and shim mounts
with the same core builder as the device plugin's Allocate (``grant_amounts`` then
``container_spec``). The shim reaches the containers as a CDI device: one spec per claim,
``vgpu-plugin/allocation=dra-<claim UID>``, beside the toolkit's ``nvidia.com/gpu=<UUID>``.
Every container that uses the claim gets the same device, so the containers of one pod that
share a claim share one limits file and one region: one limit for all of them.

A claim is one record of the node's allocation ledger (``node/ledger/state.py``, through
``node/ledger/dra_claims.py``), in the lifecycle every allocation follows: recorded ``preparing``
before its files are written, ``prepared`` (synced) before the answer, so a kubelet retry or a
restarted plugin answers from the record without the API server. With a ``DeferredSync`` (as
``serve`` runs it) that record's ``fdatasync`` is the one sync before the answer: the limits
file, the CDI spec and their dirs are synced after it, and what a power loss took of them is
written again from the record (which holds the limits and paths) at the first start of a boot,
before the driver registers (``rebuild``; docs/contracts.md#durability). Unprepare marks it
``releasing``, removes exactly what was made with the one remover (``hostfiles``) and drops
it. A record a crash left ``preparing`` or ``releasing`` is finished at start (``recover``)
or by the next call for its claim. While the record exists the cleanup's orphan sweep leaves
the claim's files alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vgpu_plugin.core import cdi, defaults, dra
from vgpu_plugin.core.allocation import ContainerSpec, container_spec
from vgpu_plugin.core.config import Config
from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.core.grant import Amount, GpuGrant, Grant, InvalidRequest, grant_amounts
from vgpu_plugin.kubelet.dra.health import DeviceHealth
from vgpu_plugin.node.host.atomicfile import DeferredSync
from vgpu_plugin.node.host.hostfiles import (
    allocation_paths,
    remove_allocation,
    restore_allocation,
    write_allocation,
)
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger, PreparedClaim, PreparedDevice, claim_of
from vgpu_plugin.node.ledger.state import PREPARED, PREPARING, RELEASING, AllocationRecord
from vgpu_plugin.node.serving.kubeapi import ApiError, ClaimReader, SlicePublisher

log = logging.getLogger(__name__)

# A half-way record younger than this is left to its own process (``DraDriver.recover``).
RECOVER_MIN_AGE = 60.0


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
        claims: ClaimLedger,
        reader: ClaimReader,
        publisher: SlicePublisher,
        shim_version: str,
        facts: Mapping[str, dra.DeviceFacts] | None = None,
        lock_dir: str = defaults.LOCK_DIR,
        cdi_spec_dir: str = cdi.SPEC_DIR,
        clock: Callable[[], float] = time.time,
        syncer: DeferredSync | None = None,
    ) -> None:
        self._gpus = tuple(sorted(gpus, key=lambda g: g.index))
        # None: a claim's files are synced before its answer; else the syncer syncs them after
        # (the ``prepared`` record is synced first either way).
        self._syncer = syncer
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
        # Replaced, never changed in place: readers (the health streams) take it unlocked.
        self._unhealthy: set[str] = set()
        self._health_listeners: list[Callable[[], object]] = []
        self._generation = 0
        # Whether the API server keeps device taints: unknown until a tainted slice is stored.
        self._taints: bool | None = None
        self._node_uid = ""  # read once, on the first publish that can reach the API server
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
        """The slice now: an unhealthy GPU tainted where the API server keeps device taints
        (or before that is known), left out where it dropped them."""
        d = self._config.dra
        drop = self._taints is False
        return dra.resource_slice(
            self._node,
            d.driver_name,
            [
                (g, self._facts.get(g.uuid, dra.DeviceFacts()))
                for g in self._gpus
                if not (drop and g.uuid in self._unhealthy)
            ],
            generation=max(1, self._generation),
            memory=dra.CapacityPolicy(*d.memory),
            compute=dra.CapacityPolicy(*d.compute),
            node_uid=self._node_uid,
            unhealthy=set() if drop else set(self._unhealthy),
        )

    def publish(self, why: str) -> bool:
        """Publish the slice (a new generation); False, logged, when the API server refuses
        (the next trigger or the caller's retry publishes again). The first reads the node's
        UID: a slice always names its owner, so it goes with a deleted node. A slice with a
        tainted GPU that the API server stored without the taint (device taints off: the
        DRADeviceTaints gate) would offer that GPU as healthy: it is republished at once
        without the GPU, and unhealthy GPUs are left out from then on."""
        if not self._node_uid:
            try:
                uid = self._publisher.node_uid(self._node)
            except ApiError as exc:
                log.error(
                    "cannot read node %s for the ResourceSlice (%s): %s", self._node, why, exc
                )
                return False
            with self._lock:
                self._node_uid = uid
        with self._lock:
            self._generation += 1
            body = self.resource_slice()
        try:
            stored = self._publisher.publish(body)
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
        asked = dra.tainted_devices(body)
        if asked and self._taints is None:
            with self._lock:
                self._taints = asked <= dra.tainted_devices(stored)
            if not self._taints:
                log.warning(
                    "the API server dropped the ResourceSlice's device taints (is the"
                    " DRADeviceTaints feature off?): unhealthy GPUs leave the ResourceSlice instead"
                )
                return self.publish(f"{why}; unhealthy GPUs left out")
        return True

    def keep_published(self) -> bool:
        """Publish the slice again if the API server no longer has it: a restarted kubelet
        deletes its node's ResourceSlices, possibly after this driver registered again and
        published, and nothing else would bring it back (no new claim could be placed on the
        node). True when it was gone and is published again. ApiError when the check fails."""
        with self._lock:
            if not self._node_uid:
                return False  # never published: the start's own publish is still to come
            name = str(self.resource_slice()["metadata"]["name"])  # type: ignore[index]
        if self._publisher.exists(name):
            return False
        log.warning("the ResourceSlice %s is gone from the API server: publishing it again", name)
        return self.publish("it was gone from the API server")

    def apply_health(self, uuid: str, healthy: bool) -> None:
        if uuid not in {g.uuid for g in self._gpus}:
            return
        before = self._unhealthy
        after = before - {uuid} if healthy else before | {uuid}
        if after == before:
            return
        self._unhealthy = after
        # The kubelet's health streams first: they do not wait on the API server.
        for listener in self._health_listeners:
            listener()
        self.publish(f"GPU {uuid} {'healthy' if healthy else 'unhealthy'}")

    def on_health_change(self, listener: Callable[[], object]) -> None:
        """``listener()`` after every change of a GPU's health (it must not block)."""
        self._health_listeners.append(listener)

    def device_health(self) -> list[DeviceHealth]:
        """Every GPU of this driver as the ResourceSlice names it (pool = node), with its
        health: the kubelet's health streams send this."""
        unhealthy = self._unhealthy
        return [
            DeviceHealth(
                self._node,
                dra.device_name(g),
                g.uuid not in unhealthy,
                f"GPU {g.uuid} reported unhealthy" if g.uuid in unhealthy else "",
            )
            for g in self._gpus
        ]

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
            done = self._record(claim.uid)
            if done is not None and done.state == PREPARED:
                return claim_of(done).devices
        # The read takes what the API server takes: outside the lock, so that unprepares
        # and answers from the record never wait on it (the server's queue keeps a claim's
        # prepare and unprepare apart).
        try:
            body = self._reader.get_claim(claim.namespace, claim.name)
        except ApiError as exc:
            raise ValueError(f"cannot read claim {claim.namespace}/{claim.name}: {exc}") from exc
        with self._lock:
            done = self._record(claim.uid)
            if done is not None and done.state == PREPARED:  # prepared meanwhile, by a retry
                return claim_of(done).devices
            if done is not None:  # a crash left it half-way: start again from nothing
                self._release(done)
            prepared = self._prepare(claim, body)
            try:
                self._claims.put(prepared, PREPARED)
            except OSError as exc:
                raise ValueError(
                    f"cannot record claim {claim.namespace}/{claim.name}: {exc}"
                ) from exc
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
            grant = grant_amounts(self._gpus, amounts, aid, self._config.dra.compute_limit)
        except InvalidRequest as exc:
            raise dra.ClaimError(f"claim {claim.namespace}/{claim.name}: {exc}") from exc
        spec = self._container_spec(grant)
        shim_device = spec.cdi_devices[-1]
        devices = []
        for i, r in enumerate(results):
            gpu = self._by_name[r.device]
            ids = [cdi.qualified_name(cdi.GPU_KIND, gpu.uuid)]
            if i == 0:  # once per claim: every container of the claim gets its devices
                ids.append(shim_device)
            devices.append(PreparedDevice((r.request,), r.pool, r.device, tuple(ids), r.share_id))
        prepared = PreparedClaim(
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
        try:
            # Not synced: the process's death keeps it; after a power loss the files are
            # orphans the sweep removes. The ``prepared`` record's sync covers it.
            self._claims.put(prepared, PREPARING, sync=False)
            # All or nothing. With the syncer, synced after the answer: the ``prepared``
            # record, synced before it, is what ``rebuild`` writes them again from.
            write_allocation(spec, aid, self._cdi_spec_dir, durable=self._syncer is None)
        except OSError as exc:
            self._forget(aid)
            raise ValueError(f"cannot prepare the claim's files on the host: {exc}") from exc
        if self._syncer is not None:
            files, dirs = allocation_paths(spec, aid, self._cdi_spec_dir)
            self._syncer.note(files, dirs)
        return prepared

    def _container_spec(self, grant: Grant) -> ContainerSpec:
        """A claim's files and CDI device: the device plugin's builder, the CDI strategy."""
        return container_spec(
            grant,
            self._config.host_root,
            self._shim_version,
            self._lock_dir,
            (cdi.CDI_CRI,),
            self._config.driver_memory_limit,
        )

    def rebuild(self) -> tuple[int, int, int]:
        """At the first start after the node booted, before registering with the kubelet:
        what a power loss took of a prepared claim's files before the syncer made them
        durable (a limits file missing or torn, the region dir, a CDI spec missing or torn)
        is written again from the claim's record, which was synced before the kubelet got
        its answer (and the kubelet never prepares that claim again). Only ``prepared``
        records: one ``preparing`` or ``releasing`` is ``recover``'s. One warning line per
        claim rebuilt, one error line per claim that cannot be (the rest goes on). Returns
        (intact, rebuilt, not rebuildable)."""
        intact = rebuilt = refused = 0
        with self._lock:
            for r in self._claims.records():
                if r.state != PREPARED:
                    continue
                try:
                    claim = claim_of(r)
                    done = restore_allocation(
                        self._spec_of(claim), claim.allocation_id, self._cdi_spec_dir
                    )
                except (OSError, ValueError) as exc:
                    refused += 1
                    log.error(
                        "cannot rebuild the files of claim %s/%s: %s",
                        r.claim_namespace,
                        r.claim_name,
                        exc,
                        extra={"allocation_id": r.allocation_id, "claim_uid": r.claim_uid},
                    )
                    continue
                if not done:
                    intact += 1
                    continue
                rebuilt += 1
                log.warning(
                    "rebuilt claim %s/%s from its record: %s (lost to a power loss before"
                    " they were synced)",
                    claim.namespace,
                    claim.name,
                    ", ".join(done),
                    extra={"allocation_id": claim.allocation_id, "claim_uid": claim.uid},
                )
        return intact, rebuilt, refused

    def _spec_of(self, claim: PreparedClaim) -> ContainerSpec:
        """The files ``_prepare`` wrote for ``claim``, from its record and the config now in
        force; ValueError when they cannot be the same (a GPU gone, another host root)."""
        if not claim.limits:
            raise ValueError("its record holds no limits")
        gpus = []
        for limit in claim.limits:
            gpu = next((g for g in self._gpus if g.uuid == limit.uuid), None)
            if gpu is None:
                raise ValueError(f"its GPU {limit.uuid} is not one of this driver's any more")
            gpus.append(GpuGrant(gpu=gpu, slice_ids=(), limit=limit))
        spec = self._container_spec(Grant(claim.allocation_id, tuple(gpus), oversubscribed=False))
        if (spec.limits_path, spec.allocation_dir) != (claim.limits_path, claim.allocation_dir):
            raise ValueError(
                f"its files ({claim.limits_path}, {claim.allocation_dir}) are not where the"
                f" config's host root {self._config.host_root} puts them"
            )
        return spec

    def unprepare(self, claim: ClaimRef) -> None:
        """Remove the claim's files and record; a claim never prepared here is fine. OSError
        (the record stays ``releasing``, the kubelet retries) when its files cannot be
        removed nor moved aside."""
        with self._lock:
            done = self._record(claim.uid)
            if done is None:
                return
            self._release(done)
            log.info(
                "unprepared claim %s/%s",
                claim.namespace,
                claim.name,
                extra={"allocation_id": done.allocation_id, "claim_uid": claim.uid},
            )

    def recover(self, min_age: float = RECOVER_MIN_AGE) -> int:
        """At start: finish what a crash left half-way (a ``preparing`` claim's files were
        never answered to the kubelet, which prepares it again; a ``releasing`` one was being
        removed). Only records older than ``min_age`` seconds: a younger one may be another
        plugin process's prepare in progress (a rolling update's overlap); the kubelet's
        retry of it finishes it. Returns how many were finished; one that cannot be is logged
        and kept."""
        n = 0
        with self._lock:
            for r in self._claims.unfinished():
                if r.created > self._clock() - min_age:
                    continue
                try:
                    self._release(r)
                except (OSError, ValueError) as exc:
                    log.error("cannot finish claim allocation %s: %s", r.allocation_id, exc)
                    continue
                n += 1
                log.info(
                    "removed the files of claim %s/%s, left %s by a crash",
                    r.claim_namespace,
                    r.claim_name,
                    r.state,
                    extra={"allocation_id": r.allocation_id, "claim_uid": r.claim_uid},
                )
        return n

    def release_stale(self) -> int:
        """Release every claim the API server no longer has: its claim is gone (404), or a
        claim of that name has another UID (deleted and made again). A kubelet that never
        called unprepare (it restarted, the node was cordoned and drained) must not leave a
        claim's files forever. Reads with the reader's bounded timeout, without holding the
        driver's lock; any other API error ends the pass (nothing is stale while the API
        server cannot tell). Returns how many were released."""
        released = 0
        for r in self._claims.records():
            if r.claim_namespace is None or r.claim_name is None:
                continue
            try:
                body = self._reader.get_claim(r.claim_namespace, r.claim_name)
                meta = body.get("metadata")
                uid = meta.get("uid") if isinstance(meta, Mapping) else None
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("stale claims not checked: %s", exc)
                    return released
                uid = None
            if uid == r.claim_uid:
                continue
            with self._lock:
                now = self._claims.record(r.allocation_id)
                if now is None or now.created != r.created:
                    continue  # unprepared, or prepared again, meanwhile
                try:
                    self._release(now)
                except (OSError, ValueError) as exc:
                    log.error("cannot release stale claim %s: %s", r.allocation_id, exc)
                    continue
            released += 1
            log.info(
                "released claim %s/%s: the API server %s",
                r.claim_namespace,
                r.claim_name,
                "no longer has it" if uid is None else f"has a claim {uid} of that name now",
                extra={"allocation_id": r.allocation_id, "claim_uid": r.claim_uid},
            )
        return released

    def _record(self, claim_uid: str) -> AllocationRecord | None:
        try:
            aid = dra.allocation_id(claim_uid)
        except dra.ClaimError:
            return None  # never prepared: _prepare says why
        return self._claims.record(aid)

    def _release(self, record: AllocationRecord) -> None:
        """Mark, remove with the one remover, drop (the lifecycle's release)."""
        done = claim_of(record)
        if record.state != RELEASING:
            self._claims.mark(record, RELEASING, sync=False)
        remove_allocation(
            done.allocation_dir, done.limits_path, done.allocation_id, self._cdi_spec_dir
        )
        self._claims.drop(done.allocation_id)

    def _forget(self, allocation_id: str) -> None:
        try:
            self._claims.drop(allocation_id)
        except OSError as exc:  # its files are gone: at worst a record recover() finishes
            log.error("cannot drop the record of %s: %s", allocation_id, exc)

    def prepared(self) -> list[PreparedClaim]:
        return self._claims.all()
