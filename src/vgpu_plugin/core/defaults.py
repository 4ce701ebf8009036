"""Default names and paths: the one place each is written (docs/contracts.md)."""

from __future__ import annotations

from typing import Final

RESOURCE_NAME: Final = "nvidia.com/gpu"
CONFIG_PATH: Final = "/etc/vgpu-plugin/config.yaml"
# On the host.
HOST_ROOT: Final = "/usr/local/vgpu"  # shim versions, ld.so.preload, limits/, containers/
STATE_DIR: Final = "/var/lib/vgpu-plugin"  # allocation records
LOCK_DIR: Final = "/tmp/vgpulock"  # per-GPU lock files, shared by every container
METRICS_ADDRESS: Final = ":9400"

# Inside the container (the Allocate response's mounts).
SHIM_PATH: Final = "/etc/vgpu/libvgpu.so"
PRELOAD_PATH: Final = "/etc/ld.so.preload"
LIMITS_PATH: Final = "/etc/vgpu/limits"
CACHE_DIR: Final = "/tmp/vgpu"
PEERS_PATH: Final = "/etc/vgpu/peers"  # every container's dir, read-only (compute guarantees)
CONTAINER_LOCK_DIR: Final = LOCK_DIR  # mounted at the same path as on the host
