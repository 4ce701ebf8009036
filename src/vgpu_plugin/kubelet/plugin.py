"""The device plugin's Backend: the node plan advertised, allocated and kept current.

Joins the pure core (plan, placement, grant, response) to the edges it needs on the Allocate
path: the allocation store and the per-allocation files. Nothing here talks to the network,
so Allocate stays fast and never blocks on anything but local disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.api.constants import HEALTHY, UNHEALTHY
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import cdi, defaults
from vgpu_plugin.core.allocation import ContainerSpec, container_spec
from vgpu_plugin.core.config import Config
from vgpu_plugin.core.devices import NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.grant import Grant, InvalidRequest, grant, new_allocation_id
from vgpu_plugin.core.placement import Held, held_by_gpu, preferred_allocation
from vgpu_plugin.kubelet.backend import BackendError, check_list_size, default_options
from vgpu_plugin.node import cdi as cdi_files
from vgpu_plugin.node.atomicfile import fsync_dir
from vgpu_plugin.node.health import HealthChange
from vgpu_plugin.node.hostfiles import remove_allocation, write_allocation
from vgpu_plugin.node.nodeview import DRIVER_LIMIT_KEY
from vgpu_plugin.node.state import AllocationRecord, AllocationStore

log = logging.getLogger(__name__)


def advertised_devices(plan: NodePlan, unhealthy: Mapping[str, str]) -> list[pb.Device]:
    """Every slice of the plan as the kubelet sees it, with its GPU's health and NUMA node."""
    out: list[pb.Device] = []
    for g in plan.gpus:
        health = UNHEALTHY if g.gpu.uuid in unhealthy else HEALTHY
        topology = (
            pb.TopologyInfo(nodes=[pb.NUMANode(ID=g.gpu.numa_node)])
            if g.gpu.numa_node is not None
            else None
        )
        out.extend(pb.Device(ID=s.id, health=health, topology=topology) for s in g.slices)
    return out


@dataclass(frozen=True)
class Snapshot:
    """A config and the plan made from it, published together and only once checked: every
    call reads one snapshot, once, so a reload can never pair one config's plan with another's
    host root or resource name, nor show a plan that was refused."""

    config: Config
    plan: NodePlan


class VgpuBackend:
    """Implements ``backend.Backend`` for one resource over the node's GPUs."""

    def __init__(
        self,
        gpus: Sequence[PhysicalGpu],
        config: Config,
        node_name: str,
        node_labels: Mapping[str, str],
        store: AllocationStore,
        shim_version: str,
        lock_dir: str = defaults.LOCK_DIR,
        clock: Callable[[], float] = time.time,
        cdi_spec_dir: str = cdi.SPEC_DIR,
    ) -> None:
        self._cdi_spec_dir = cdi_spec_dir
        self._gpus = tuple(gpus)
        self._node_name = node_name
        self._store = store
        self._shim_version = shim_version
        self._lock_dir = lock_dir
        self._clock = clock
        self._cond = threading.Condition()
        self._generation = 0
        self._seen_generation = 0
        self._unhealthy: dict[str, str] = {}
        self._snapshot = self._checked(config, node_labels)

    # --- what is advertised ---------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def config(self) -> Config:
        return self._snapshot.config

    @property
    def plan(self) -> NodePlan:
        return self._snapshot.plan

    @property
    def unhealthy(self) -> dict[str, str]:
        """GPU UUID -> why, for the GPUs now advertised as unhealthy."""
        return dict(self._unhealthy)

    def options(self) -> pb.DevicePluginOptions:
        return default_options()

    def devices(self) -> list[pb.Device]:
        return advertised_devices(self._snapshot.plan, self._unhealthy)

    def wait_for_change(self, timeout: float) -> bool:
        with self._cond:
            if self._generation == self._seen_generation:
                self._cond.wait(timeout)
            changed = self._generation != self._seen_generation
            self._seen_generation = self._generation
            return changed

    def _changed(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def _checked(self, config: Config, node_labels: Mapping[str, str]) -> Snapshot:
        """The snapshot for ``config``; raises if its device list cannot be served."""
        plan = plan_node(config, self._gpus, self._node_name, node_labels)
        check_list_size(advertised_devices(plan, self._unhealthy))
        return Snapshot(config, plan)

    def apply_config(self, config: Config, node_labels: Mapping[str, str]) -> NodePlan:
        """Re-plan under a new config; raises (nothing published) if it cannot be served.
        Running containers keep their limits: those live in their own limits files."""
        snapshot = self._checked(config, node_labels)
        old = self._snapshot
        self._snapshot = snapshot  # one reference swap: readers see the old or the new pair
        if snapshot.plan != old.plan:
            self._changed()
        return snapshot.plan

    def apply_health(self, changes: Sequence[HealthChange]) -> None:
        unhealthy = dict(self._unhealthy)
        for c in changes:
            if c.healthy:
                unhealthy.pop(c.uuid, None)
            else:
                unhealthy[c.uuid] = c.detail
            log.info(
                "GPU %s is now %s: %s",
                c.uuid,
                HEALTHY if c.healthy else UNHEALTHY,
                c.detail,
                extra={"gpu_uuid": c.uuid, "healthy": c.healthy, "reason": c.reason.value},
            )
        self._unhealthy = unhealthy
        self._changed()

    # --- the kubelet's calls --------------------------------------------------------------

    def preferred_allocation(
        self, request: pb.PreferredAllocationRequest
    ) -> pb.PreferredAllocationResponse:
        plan = self._snapshot.plan
        held = self._held()
        responses = []
        for creq in request.container_requests:
            chosen = preferred_allocation(
                plan,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
                held=held,
            )
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def _held(self) -> dict[str, Held]:
        """Memory and compute per GPU that the recorded allocations hold (their limits were
        fixed at admission, whatever the split has become since). One the cleaner marked
        released is held by no container the kubelet knows: its slices are free again."""
        live = (r for r in self._store.all() if r.released is None)
        return held_by_gpu(lim for r in live for lim in r.limits)

    def allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        snapshot = self._snapshot
        plan, host_root = snapshot.plan, snapshot.config.host_root
        if not request.container_requests:
            raise BackendError.invalid("Allocate request has no container requests")
        # Decide everything first: a refused request writes nothing.
        prepared: list[tuple[Grant, ContainerSpec]] = []
        for i, creq in enumerate(request.container_requests):
            try:
                g = grant(plan, list(creq.devices_ids), new_allocation_id())
                spec = container_spec(
                    g,
                    host_root,
                    self._shim_version,
                    self._lock_dir,
                    snapshot.config.device_list_strategy,
                    snapshot.config.driver_memory_limit,
                )
            except (InvalidRequest, ValueError) as exc:
                raise BackendError.invalid(f"container request {i}: {exc}") from exc
            prepared.append((g, spec))
        # The files of every container, their dirs synced once, then every record in one
        # durable write: an Allocate of 1,000 containers costs one store write, not 1,000.
        written: list[tuple[Grant, ContainerSpec]] = []
        try:
            for g, spec in prepared:
                written.append((g, spec))
                self._materialise(g, spec)
            self._sync_dirs(prepared)
            now = self._clock()
            self._store.add_many(
                AllocationRecord(
                    allocation_id=g.allocation_id,
                    device_ids=g.device_ids,
                    resource_name=plan.resource_name,
                    created=now,
                    limits=tuple(x.limit for x in g.gpus),
                    extra={DRIVER_LIMIT_KEY: spec.driver_limit},
                )
                for g, spec in prepared
            )
        except OSError as exc:
            for g, spec in written:
                self._unmaterialise(g, spec)
            raise BackendError.internal(
                f"cannot prepare the allocation on the host: {exc}"
            ) from exc
        responses = []
        for g, spec in prepared:
            log.info(
                "allocated %s -> %s",
                ",".join(g.device_ids),
                "; ".join(
                    f"{x.gpu.uuid} {x.limit.memory_mib} MiB {x.limit.compute_percent}%"
                    for x in g.gpus
                ),
                extra={"allocation_id": g.allocation_id},
            )
            responses.append(
                pb.ContainerAllocateResponse(
                    envs=spec.envs,
                    mounts=[
                        pb.Mount(
                            container_path=m.container_path,
                            host_path=m.host_path,
                            read_only=m.read_only,
                        )
                        for m in spec.mounts
                    ],
                    annotations=spec.annotations,
                    cdi_devices=[pb.CDIDevice(name=n) for n in spec.cdi_devices],
                )
            )
        return pb.AllocateResponse(container_responses=responses)

    def pre_start_container(
        self, request: pb.PreStartContainerRequest
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    # --- host files -----------------------------------------------------------------------

    def _materialise(self, g: Grant, spec: ContainerSpec) -> None:
        """The rw dir, the read-only limits file and the CDI spec (the same host files as a DRA
        claim's: ``node/hostfiles.py``); their dirs are synced by ``_sync_dirs`` and the record
        written by the caller, before we answer."""
        write_allocation(spec, g.allocation_id, self._cdi_spec_dir, sync_dir=False)

    def _sync_dirs(self, prepared: Sequence[tuple[Grant, ContainerSpec]]) -> None:
        """One fsync per directory the allocations' files were created in."""
        dirs: set[Path] = set()
        for g, spec in prepared:
            dirs.add(Path(spec.limits_path).parent)
            dirs.add(Path(spec.allocation_dir).parent)
            if spec.cdi_spec is not None:
                dirs.add(cdi_files.spec_path(self._cdi_spec_dir, g.allocation_id).parent)
        for d in sorted(dirs):
            fsync_dir(d)

    def _unmaterialise(self, g: Grant, spec: ContainerSpec) -> None:
        aid = g.allocation_id
        remove_allocation(spec.allocation_dir, spec.limits_path, aid, self._cdi_spec_dir)
        self._store.remove(g.allocation_id)
