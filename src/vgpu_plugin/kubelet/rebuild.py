"""The power-loss rebuild (docs/contracts.md#durability): at the first start after a boot,
what Allocate wrote and a power loss took before the syncer made it durable is written again
from the kubelet's device checkpoint, which keeps each container's Allocate response: the
limits file, the region dir, the CDI spec and the ledger's record. Only paths Allocate could
have written (``<hostRoot>/limits/<id>``, ``<hostRoot>/containers/<id>``) are written."""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.core import cdi, defaults
from vgpu_plugin.core.allocation import (
    MEMORY_LIMIT_ENV,
    container_spec,
    host_allocation_dir,
    host_limits_path,
)
from vgpu_plugin.core.config import Config
from vgpu_plugin.core.devices import MIB, GpuLimit, parse_device_id
from vgpu_plugin.core.grant import GpuGrant, Grant, check_allocation_id
from vgpu_plugin.core.limits import Limits, format_limits
from vgpu_plugin.core.pods import CheckpointEntry
from vgpu_plugin.kubelet.plugin import OVERSUBSCRIBED_KEY, VgpuBackend, record_extra
from vgpu_plugin.node.host import cdi as cdi_files
from vgpu_plugin.node.host.hostfiles import restore_limits_and_dir
from vgpu_plugin.node.ledger.state import AllocationRecord

log = logging.getLogger(__name__)


class NotRebuildable(ValueError):
    """A checkpoint entry from which an allocation's host files cannot be rebuilt."""


@dataclass(frozen=True)
class _Wanted:
    """What Allocate wrote for one container, as a checkpoint entry (and its record) tell."""

    allocation_id: str
    limits: Limits
    limits_path: str
    allocation_dir: str


def _mounted(response: pb.ContainerAllocateResponse, container_path: str) -> str | None:
    for m in response.mounts:
        if m.container_path == container_path:
            return str(m.host_path)
    return None


def _from_response(aid: str, response: pb.ContainerAllocateResponse) -> _Wanted | None:
    """The limits and host paths the response names (envvar and volume-mounts strategies);
    None when it names none (the CDI strategies put them in the CDI spec)."""
    envs = response.envs
    if "CUDA_DEVICE_MEMORY_LIMIT_0" not in envs:
        return None
    listed = envs.get(cdi.VISIBLE_DEVICES_ENV, "")
    if listed and not listed.startswith("/"):
        uuids = listed.split(",")
    else:  # volume-mounts: one mount per GPU, in the same order
        prefix = cdi.VOLUME_MOUNTS_ROOT + "/"
        uuids = [
            m.container_path[len(prefix) :]
            for m in response.mounts
            if m.container_path.startswith(prefix)
        ]
    gpus: list[GpuLimit] = []
    try:
        for i, uuid in enumerate(uuids):
            memory = envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"]
            if not memory.endswith("m"):
                raise NotRebuildable(f"CUDA_DEVICE_MEMORY_LIMIT_{i}={memory!r} is not in MiB")
            compute = int(envs[f"CUDA_DEVICE_SM_LIMIT_{i}"])
            gpus.append(GpuLimit(uuid, int(memory[:-1]) * MIB, compute))
    except (KeyError, ValueError) as exc:
        if isinstance(exc, NotRebuildable):
            raise
        raise NotRebuildable(f"its response's limit envs are incomplete ({exc})") from exc
    if f"CUDA_DEVICE_MEMORY_LIMIT_{len(uuids)}" in envs or not gpus:
        raise NotRebuildable("its response's GPUs and limit envs do not match")
    limits_path = _mounted(response, defaults.LIMITS_PATH)
    allocation_dir = _mounted(response, defaults.CACHE_DIR)
    if limits_path is None or allocation_dir is None:
        raise NotRebuildable("its response mounts no limits file or region dir")
    _check_ours(limits_path, "limits", aid)
    _check_ours(allocation_dir, "containers", aid)
    oversubscribe = envs.get("CUDA_OVERSUBSCRIBE") == "true"
    return _Wanted(aid, Limits(aid, oversubscribe, tuple(gpus)), limits_path, allocation_dir)


def _check_ours(path: str, kind: str, aid: str) -> None:
    """Only a path Allocate could have written is written again: ``<root>/<kind>/<aid>``."""
    if posixpath.normpath(path) != path or not path.startswith("/"):
        raise NotRebuildable(f"its response mounts {path!r}, not a normalized absolute path")
    if not path.endswith(f"/{kind}/{aid}"):
        raise NotRebuildable(f"its response mounts {path!r}, not a {kind} path of ours")


def _slice_order(limits: Limits) -> Callable[[str], tuple[int, int, str]]:
    """Device IDs in the grant's order: by their GPU's place in the limits, then slice."""
    place = {g.uuid: i for i, g in enumerate(limits.gpus)}

    def key(device_id: str) -> tuple[int, int, str]:
        parsed = parse_device_id(device_id)
        if parsed is None:
            return (len(place), 0, device_id)
        return (place.get(parsed[0], len(place)), parsed[1], device_id)

    return key


@dataclass
class RebuildReport:
    """What ``rebuild`` did: allocation id -> what was rebuilt, and refusals."""

    rebuilt: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    intact: int = 0


def rebuild(backend: VgpuBackend, entries: Sequence[CheckpointEntry]) -> RebuildReport:
    """Rebuild, from the kubelet's checkpoint ``entries``, what Allocate wrote for each of
    ``backend``'s allocations and a power loss took before the syncer made it durable: the
    limits file (missing or not what the response says: torn), the region dir, the CDI spec,
    the record. Logs one line per allocation rebuilt, and one per allocation that cannot be
    (the rest goes on). Run at start, before registering with the kubelet."""
    snapshot = backend._snapshot
    config = snapshot.config
    report = RebuildReport()
    for e in entries:
        if e.resource_name != snapshot.plan.resource_name or not e.allocation_ids:
            continue
        aid = e.allocation_ids[0]
        who = f"pod {e.pod_uid} container {e.container!r}"
        try:
            done = _rebuild_one(backend, e, aid, config)
        except (NotRebuildable, OSError) as exc:
            report.refused[aid] = str(exc)
            log.error(
                "cannot rebuild allocation %s (%s) from the kubelet's checkpoint: %s%s",
                aid,
                who,
                exc,
                "; the container's limits are missing until its pod is recreated"
                if isinstance(exc, NotRebuildable)
                else "",
                extra={"allocation_id": aid, "pod_uid": e.pod_uid},
            )
            continue
        if not done:
            report.intact += 1
            continue
        report.rebuilt[aid] = done
        log.warning(
            "rebuilt allocation %s (%s) from the kubelet's checkpoint: %s (lost to a power "
            "loss before they were synced)",
            aid,
            who,
            ", ".join(done),
            extra={"allocation_id": aid, "pod_uid": e.pod_uid},
        )
    return report


def _rebuild_one(backend: VgpuBackend, e: CheckpointEntry, aid: str, config: Config) -> list[str]:
    """Rebuilds what is missing or torn of one allocation; returns what it rebuilt."""
    try:
        check_allocation_id(aid)  # it names files: nothing else is written from a checkpoint
    except ValueError as exc:
        raise NotRebuildable(str(exc)) from exc
    record = backend._store.get(aid)
    response = e.response
    # An entry with an allocation id has its response (kubelet/checkpoint.py decoded it).
    assert isinstance(response, pb.ContainerAllocateResponse)
    wanted = _from_response(aid, response)
    if wanted is None:
        if record is None or not record.limits:
            raise NotRebuildable(
                "its response carries no limits (the CDI strategies keep them in the CDI spec) "
                "and its record is not on file"
            )
        oversubscribe = record.extra.get(OVERSUBSCRIBED_KEY) is True
        wanted = _Wanted(
            aid,
            Limits(aid, oversubscribe, record.limits),
            host_limits_path(config.host_root, aid),
            host_allocation_dir(config.host_root, aid),
        )
    done = restore_limits_and_dir(
        wanted.limits_path, format_limits(wanted.limits), wanted.allocation_dir
    )
    if response.cdi_devices or response.annotations:
        spec_path = cdi_files.spec_path(backend._cdi_spec_dir, aid)
        if not spec_path.exists():
            cdi_files.write_spec(backend._cdi_spec_dir, aid, _cdi_spec(backend, e, wanted, config))
            done.append("CDI spec")
    if record is None:
        driver = "requested" if MEMORY_LIMIT_ENV in response.envs else None
        backend._store.add(
            AllocationRecord(
                allocation_id=aid,
                device_ids=tuple(sorted(e.device_ids, key=_slice_order(wanted.limits))),
                resource_name=e.resource_name,
                created=backend._clock(),
                limits=wanted.limits.gpus,
                extra=record_extra(driver, wanted.limits.oversubscribe),
            )
        )
        done.append("record")
    return done


def _cdi_spec(
    backend: VgpuBackend, e: CheckpointEntry, wanted: _Wanted, config: Config
) -> dict[str, Any]:
    """The CDI spec Allocate writes for this allocation under ``config``."""
    by_uuid = {g.uuid: g for g in backend._gpus}
    order = _slice_order(wanted.limits)
    gpus: list[GpuGrant] = []
    for lim in wanted.limits.gpus:
        gpu = by_uuid.get(lim.uuid)
        if gpu is None:
            raise NotRebuildable(f"its GPU {lim.uuid} is not on this node any more")
        ids = [d for d in e.device_ids if (parse_device_id(d) or ("",))[0] == lim.uuid]
        gpus.append(GpuGrant(gpu, tuple(sorted(ids, key=order)), lim))
    g = Grant(wanted.allocation_id, tuple(gpus), wanted.limits.oversubscribe)
    spec = container_spec(
        g,
        config.host_root,
        backend._shim_version,
        backend._lock_dir,
        config.device_list_strategy,
        config.driver_memory_limit,
    )
    if spec.cdi_spec is None:
        raise NotRebuildable("its response names CDI devices; the config's strategy has none")
    return spec.cdi_spec
