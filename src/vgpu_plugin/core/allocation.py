"""The Allocate response for one container (docs/contracts.md#allocate-response): envs, mounts,
limits file's text. The gRPC layer copies them into a ContainerAllocateResponse.

Ordering: ``NVIDIA_VISIBLE_DEVICES`` lists the GPUs in **physical index order**, not in the
order of the kubelet's device IDs. Inside the container the runtime enumerates the visible GPUs
in physical order, so listing them that way makes ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` (and
``_SM_LIMIT_<i>``) index i the device that CUDA and NVML number i in the container. The limits
file lists the GPUs in the same order, and keys them by UUID besides.

How the GPUs themselves are named to the runtime is the ``deviceListStrategy``
(``core/cdi.py``): by env, by ``/dev/null`` mounts, or by CDI devices. With a CDI strategy the
shim's envs and mounts travel in the allocation's CDI spec instead of the response, so the
runtime applies them once.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu_plugin.core import cdi
from vgpu_plugin.core.defaults import (
    CACHE_DIR,
    CONTAINER_LOCK_DIR,
    LIMITS_PATH,
    PEERS_PATH,
    PRELOAD_PATH,
    SHIM_PATH,
)
from vgpu_plugin.core.grant import GpuGrant, Grant, check_allocation_id
from vgpu_plugin.core.limits import render_limits

_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


# Read by the NVIDIA container toolkit's CDI hook apply-cuda-memory-limits: whole MiB, both
# needed; the same value is applied on every GPU of the container (docs/contracts.md).
MEMORY_REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
MEMORY_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"


@dataclass(frozen=True)
class ContainerSpec:
    """What the runtime applies to the container, and the host paths the plugin prepares
    (writes ``limits_text`` to ``limits_path``, creates ``allocation_dir``, writes ``cdi_spec``
    when there is one) before answering.

    ``envs``, ``mounts``, ``annotations`` and ``cdi_devices`` are the response's fields;
    ``driver_limit`` says whether the response asks the driver to hold the memory limit too,
    or why not."""

    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    limits_text: str
    allocation_dir: str
    limits_path: str
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    cdi_spec: dict[str, Any] | None = None
    driver_limit: str = ""


def _root(host_root: str) -> str:
    if not host_root.startswith("/"):
        raise ValueError(f"host root must be an absolute path, got {host_root!r}")
    return posixpath.normpath(host_root)


def host_shim_path(host_root: str, shim_version: str) -> str:
    """Versioned, never overwritten in place: running containers keep the one they mapped."""
    if not _VERSION.match(shim_version):
        raise ValueError(f"shim version {shim_version!r} is not a safe file-name suffix")
    return f"{_root(host_root)}/lib/libvgpu.so.{shim_version}"


def host_preload_path(host_root: str) -> str:
    return f"{_root(host_root)}/ld.so.preload"


def host_limits_path(host_root: str, allocation_id: str) -> str:
    check_allocation_id(allocation_id)
    return f"{_root(host_root)}/limits/{allocation_id}"


def host_allocation_dir(host_root: str, allocation_id: str) -> str:
    check_allocation_id(allocation_id)
    return f"{_root(host_root)}/containers/{allocation_id}"


DRIVER_LIMIT_SET = "requested"


def driver_limit_problem(gpus: Sequence[GpuGrant], oversubscribed: bool) -> str | None:
    """Why the driver's limit cannot hold this container the way the shim does, or None.

    The toolkit's hook applies one request and one limit to every GPU of the container, in
    whole MiB; an oversubscribed limit is above what the GPU can hold and is backed by host
    memory, which a device-memory limit in the driver would refuse instead."""
    if not gpus:
        return "no GPU"
    if oversubscribed:
        return "oversubscribed (memoryScaling > 1)"
    if len({g.limit.memory_mib for g in gpus}) > 1:
        return "its GPUs have different limits (the hook applies one to all)"
    return None


def container_spec(
    grant: Grant,
    host_root: str,
    shim_version: str,
    lock_dir: str = CONTAINER_LOCK_DIR,
    strategies: Sequence[str] = (cdi.ENVVAR,),
    driver_limit: bool = False,
) -> ContainerSpec:
    """Envs and mounts as docs/contracts.md#allocate-response lists them; order: module doc.
    ``strategies``: the deviceListStrategy (``cdi.parse_strategies``); ``driver_limit``: set
    the envs of the toolkit's memory-limit hook where they cannot hurt."""
    if not lock_dir.startswith("/"):
        raise ValueError(f"lock dir must be an absolute path, got {lock_dir!r}")
    strategies = cdi.parse_strategies(strategies)
    uuids = [g.gpu.uuid for g in grant.gpus]
    envs: dict[str, str] = {}
    if cdi.ENVVAR in strategies:
        envs[cdi.VISIBLE_DEVICES_ENV] = ",".join(uuids)
    elif cdi.VOLUME_MOUNTS in strategies:
        envs[cdi.VISIBLE_DEVICES_ENV] = cdi.VOLUME_MOUNTS_ROOT
    list_envs = dict(envs)
    for i, g in enumerate(grant.gpus):
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{g.limit.memory_mib}m"
        envs[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(g.limit.compute_percent)
        if g.limit.compute_request:
            envs[f"CUDA_DEVICE_SM_REQUEST_{i}"] = str(g.limit.compute_request)
    shares = {g.limit.compute_percent for g in grant.gpus}
    if len(shares) == 1:  # the index-less form older shims read
        envs["CUDA_DEVICE_SM_LIMIT"] = str(shares.pop())
    envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{CACHE_DIR}/{grant.allocation_id}.cache"
    envs["CUDA_OVERSUBSCRIBE"] = "true" if grant.oversubscribed else "false"
    envs["VGPU_ALLOCATION_ID"] = grant.allocation_id
    problem = driver_limit_problem(grant.gpus, grant.oversubscribed)
    if not driver_limit:
        driver_state = "off"
    elif problem is not None:
        driver_state = f"not requested: {problem}"
    else:
        driver_state = DRIVER_LIMIT_SET
        mib = str(grant.gpus[0].limit.memory_mib)
        envs[MEMORY_REQUEST_ENV] = mib
        envs[MEMORY_LIMIT_ENV] = mib
    limits_path = host_limits_path(host_root, grant.allocation_id)
    allocation_dir = host_allocation_dir(host_root, grant.allocation_id)
    mounts: tuple[Mount, ...] = (
        Mount(SHIM_PATH, host_shim_path(host_root, shim_version), True),
        Mount(PRELOAD_PATH, host_preload_path(host_root), True),
        Mount(LIMITS_PATH, limits_path, True),
        Mount(CACHE_DIR, allocation_dir, False),
        Mount(CONTAINER_LOCK_DIR, posixpath.normpath(lock_dir), False),
    )
    if any(g.limit.compute_request for g in grant.gpus):
        # Guarantees: every container's pacing file, read-only (docs/compute.md).
        mounts += (Mount(PEERS_PATH, f"{_root(host_root)}/containers", True),)
    list_mounts: tuple[Mount, ...] = ()
    if cdi.VOLUME_MOUNTS in strategies:
        list_mounts = tuple(
            Mount(f"{cdi.VOLUME_MOUNTS_ROOT}/{u}", cdi.VOLUME_MOUNTS_SOURCE, True) for u in uuids
        )
    text = render_limits(grant)
    if not cdi.uses_cdi(strategies):
        return ContainerSpec(
            envs, mounts + list_mounts, text, allocation_dir, limits_path,
            driver_limit=driver_state,
        )  # fmt: skip
    # CDI: the shim's envs and mounts go in the allocation's spec, the GPUs are the toolkit's
    # CDI devices; the response keeps only what another chosen strategy adds.
    shim_envs = {k: v for k, v in envs.items() if k != cdi.VISIBLE_DEVICES_ENV}
    spec = cdi.cdi_spec(
        grant.allocation_id,
        shim_envs,
        ((m.container_path, m.host_path, m.read_only) for m in mounts),
    )
    names = cdi.device_names(grant.allocation_id, uuids)
    annotations = (
        dict([cdi.annotation(grant.allocation_id, names)])
        if cdi.CDI_ANNOTATIONS in strategies
        else {}
    )
    return ContainerSpec(
        list_envs,
        list_mounts,
        text,
        allocation_dir,
        limits_path,
        annotations=annotations,
        cdi_devices=names if cdi.CDI_CRI in strategies else (),
        cdi_spec=spec,
        driver_limit=driver_state,
    )
