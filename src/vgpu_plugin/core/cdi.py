"""How the Allocate response names a container's GPUs to the runtime (``deviceListStrategy``),
and the CDI spec that carries the shim for the CDI strategies (docs/contracts.md#device-lists).

Pure: names, the spec as a JSON-ready dict, the annotation. Writing and removing the spec
files is ``node/host/cdi.py``'s.

Facts this relies on, from NVIDIA's k8s-device-plugin, nvidia-container-toolkit and the CDI
project (cncf-tags/container-device-interface):

- ``volume-mounts``: one mount per GPU, host ``/dev/null``, container
  ``/var/run/nvidia-container-devices/<GPU UUID>``, and ``NVIDIA_VISIBLE_DEVICES`` set to the
  directory itself; the toolkit reads the mount destinations when its
  ``accept-nvidia-visible-devices-as-volume-mounts`` is true.
- A qualified CDI device name is ``<vendor>/<class>=<name>``: vendor and class start with a
  letter, end with a letter or digit, and hold letters, digits, ``_``, ``-`` and ``.``; a
  device name starts and ends with a letter or digit and may also hold ``:``.
- The annotation form is ``cdi.k8s.io/<plugin>_<id>`` (the part after the prefix at most 63
  characters of letters, digits, ``_``, ``-``, ``.``) with the qualified names, comma-separated.
- The toolkit's own CDI spec (``nvidia-ctk cdi generate``) names each GPU by its UUID under
  kind ``nvidia.com/gpu``; that device brings the GPU itself (device nodes, driver libraries,
  the toolkit's hooks). Ours brings only the shim.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

ENVVAR: Final = "envvar"
VOLUME_MOUNTS: Final = "volume-mounts"
CDI_ANNOTATIONS: Final = "cdi-annotations"
CDI_CRI: Final = "cdi-cri"
STRATEGIES: Final = (ENVVAR, VOLUME_MOUNTS, CDI_ANNOTATIONS, CDI_CRI)
CDI_STRATEGIES: Final = (CDI_ANNOTATIONS, CDI_CRI)
# Fails closed on a node whose toolkit is not set up for it (docs/security.md#threat-model).
DEFAULT_STRATEGIES: Final = (VOLUME_MOUNTS,)

VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNTS_ROOT: Final = "/var/run/nvidia-container-devices"
VOLUME_MOUNTS_SOURCE: Final = "/dev/null"

CDI_VERSION: Final = "0.5.0"
VENDOR: Final = "vgpu-plugin"
CLASS: Final = "allocation"
KIND: Final = f"{VENDOR}/{CLASS}"  # one device per allocation, named by the allocation id
GPU_KIND: Final = "nvidia.com/gpu"  # the toolkit's spec, one device per GPU UUID
SPEC_DIR: Final = "/var/run/cdi"
ANNOTATION_PREFIX: Final = "cdi.k8s.io/"
_ANNOTATION_NAME_MAX = 63

_QUALIFIER = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


def parse_strategies(value: str | Sequence[str]) -> tuple[str, ...]:
    """The strategies named by a comma-separated string or a list, deduplicated in order;
    ValueError in one line for an unknown name, none at all, or envvar with volume-mounts
    (both set ``NVIDIA_VISIBLE_DEVICES``, to different things)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    names: list[str] = []
    for item in items:
        name = item.strip() if isinstance(item, str) else item
        if name not in STRATEGIES or not isinstance(name, str):
            raise ValueError(f"unknown device list strategy {name!r}: use {', '.join(STRATEGIES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no device list strategy given: use {', '.join(STRATEGIES)}")
    if ENVVAR in names and VOLUME_MOUNTS in names:
        raise ValueError(
            "envvar and volume-mounts cannot be combined: both set NVIDIA_VISIBLE_DEVICES"
        )
    return tuple(names)


def uses_cdi(strategies: Iterable[str]) -> bool:
    return any(s in CDI_STRATEGIES for s in strategies)


def qualified_name(kind: str, name: str) -> str:
    """``<vendor>/<class>=<name>``; ValueError in one line if a part breaks CDI's rules."""
    vendor, slash, klass = kind.partition("/")
    if not slash or not _QUALIFIER.match(vendor) or not _QUALIFIER.match(klass):
        raise ValueError(f"CDI kind {kind!r} is not <vendor>/<class> by CDI's rules")
    if not _DEVICE.match(name):
        raise ValueError(f"CDI device name {name!r} breaks CDI's rules")
    return f"{kind}={name}"


def device_names(allocation_id: str, gpu_uuids: Sequence[str]) -> tuple[str, ...]:
    """The CDI devices a container gets: each GPU from the toolkit's spec, then the shim's."""
    gpus = [qualified_name(GPU_KIND, u) for u in gpu_uuids]
    return (*gpus, qualified_name(KIND, allocation_id))


def annotation(allocation_id: str, devices: Sequence[str]) -> tuple[str, str]:
    """The ``cdi-annotations`` form: (key, value) for the container's annotations."""
    name = f"{VENDOR}_{allocation_id}"
    if len(name) > _ANNOTATION_NAME_MAX or not _ANNOTATION_NAME.match(name):
        raise ValueError(f"CDI annotation name {name!r} breaks CDI's rules (63 characters)")
    return ANNOTATION_PREFIX + name, ",".join(devices)


def spec_file_name(allocation_id: str) -> str:
    """The allocation's spec file in the CDI spec dir (CDI reads ``*.json`` there)."""
    if not _DEVICE.match(allocation_id) or ":" in allocation_id:
        raise ValueError(f"allocation id {allocation_id!r} cannot name a CDI device")
    return f"{VENDOR}-{CLASS}_{allocation_id}.json"


def _mount(container_path: str, host_path: str, read_only: bool) -> dict[str, Any]:
    return {
        "hostPath": host_path,
        "containerPath": container_path,
        "type": "bind",
        "options": ["bind", "ro" if read_only else "rw", "nosuid", "nodev"],
    }


def cdi_spec(
    allocation_id: str,
    envs: Mapping[str, str],
    mounts: Iterable[tuple[str, str, bool]],
) -> dict[str, Any]:
    """One CDI spec, one device (the allocation) whose edits are ``envs`` and ``mounts``
    (container path, host path, read-only), in the order given."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {
                "name": qualified_name(KIND, allocation_id).split("=", 1)[1],
                "containerEdits": {
                    "env": [f"{k}={v}" for k, v in envs.items()],
                    "mounts": [_mount(c, h, ro) for c, h, ro in mounts],
                },
            }
        ],
    }
