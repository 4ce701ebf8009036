"""The Allocate response for one container (docs/contracts.md#allocate-response): envs, mounts,
limits file's text. The gRPC layer copies them into a ContainerAllocateResponse.

Ordering: ``NVIDIA_VISIBLE_DEVICES`` lists the GPUs in **physical index order**, not in the
order of the kubelet's device IDs. Inside the container the runtime enumerates the visible GPUs
in physical order, so listing them that way makes ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` (and
``_SM_LIMIT_<i>``) index i the device that CUDA and NVML number i in the container. The limits
file lists the GPUs in the same order, and keys them by UUID besides.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from vgpu_plugin.core.defaults import (
    CACHE_DIR,
    CONTAINER_LOCK_DIR,
    LIMITS_PATH,
    PRELOAD_PATH,
    SHIM_PATH,
)
from vgpu_plugin.core.grant import Grant, check_allocation_id
from vgpu_plugin.core.limits import render_limits

_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class ContainerSpec:
    """What the runtime applies to the container, and the two host paths the plugin prepares
    (writes ``limits_text`` to ``limits_path``, creates ``allocation_dir``) before answering."""

    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    limits_text: str
    allocation_dir: str
    limits_path: str


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


def container_spec(
    grant: Grant, host_root: str, shim_version: str, lock_dir: str = CONTAINER_LOCK_DIR
) -> ContainerSpec:
    """Envs and mounts as docs/contracts.md#allocate-response lists them; order: module doc."""
    if not lock_dir.startswith("/"):
        raise ValueError(f"lock dir must be an absolute path, got {lock_dir!r}")
    envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(g.gpu.uuid for g in grant.gpus)}
    for i, g in enumerate(grant.gpus):
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{g.limit.memory_mib}m"
        envs[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(g.limit.compute_percent)
    shares = {g.limit.compute_percent for g in grant.gpus}
    if len(shares) == 1:  # the index-less form older shims read
        envs["CUDA_DEVICE_SM_LIMIT"] = str(shares.pop())
    envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{CACHE_DIR}/{grant.allocation_id}.cache"
    envs["CUDA_OVERSUBSCRIBE"] = "true" if grant.oversubscribed else "false"
    envs["VGPU_ALLOCATION_ID"] = grant.allocation_id
    limits_path = host_limits_path(host_root, grant.allocation_id)
    allocation_dir = host_allocation_dir(host_root, grant.allocation_id)
    mounts = (
        Mount(SHIM_PATH, host_shim_path(host_root, shim_version), True),
        Mount(PRELOAD_PATH, host_preload_path(host_root), True),
        Mount(LIMITS_PATH, limits_path, True),
        Mount(CACHE_DIR, allocation_dir, False),
        Mount(CONTAINER_LOCK_DIR, posixpath.normpath(lock_dir), False),
    )
    return ContainerSpec(envs, mounts, render_limits(grant), allocation_dir, limits_path)
