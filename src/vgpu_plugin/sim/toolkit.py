"""What the NVIDIA container runtime decides for a container, emulated for runc tests.

The real runtime (nvidia-container-toolkit) picks the GPUs a container gets from its OCI spec
and makes their device nodes appear; simgpu stands for the device nodes by honouring
``NVIDIA_VISIBLE_DEVICES`` (native/simgpu/NVML.md). So this module takes the container as the
kubelet hands it to the runtime, decides the GPUs the way the toolkit does under its settings,
applies the CDI devices the container names (our allocation specs; a ``nvidia.com/gpu=<UUID>``
device stands for the toolkit's own spec and adds that GPU), and writes the decision into the
container's ``NVIDIA_VISIBLE_DEVICES`` (``void``: none), which is what simgpu reads.

The toolkit's decision, as its settings document it:

- ``accept-nvidia-visible-devices-as-volume-mounts = true``: mounts at
  ``/var/run/nvidia-container-devices/<id>`` name the devices; when there are such mounts the
  env is not consulted.
- otherwise ``NVIDIA_VISIBLE_DEVICES`` names them, but only for a privileged container or where
  ``accept-nvidia-visible-devices-envvar-when-unprivileged = true`` (the toolkit's default);
  with it false, an unprivileged container's own env gets it nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.core import cdi
from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.sim.runc import ContainerConfig


@dataclass(frozen=True)
class ToolkitSettings:
    """The node's toolkit settings; the defaults are the safe ones docs/security.md asks for."""

    accept_envvar_when_unprivileged: bool = False
    accept_volume_mounts: bool = True
    cdi_spec_dirs: tuple[Path, ...] = ()


UNSAFE_DEFAULTS = ToolkitSettings(accept_envvar_when_unprivileged=True, accept_volume_mounts=False)
"""The toolkit as installed, before a node is set up for vgpu-plugin."""


def _cdi_edits(settings: ToolkitSettings, name: str) -> tuple[list[str], list[Mount]]:
    kind, _, device = name.partition("=")
    for directory in settings.cdi_spec_dirs:
        for path in sorted(directory.glob("*.json")):
            spec = json.loads(path.read_text())
            if spec.get("kind") != kind:
                continue
            for d in spec.get("devices", []):
                if d.get("name") == device:
                    edits = d["containerEdits"]
                    mounts = [
                        Mount(m["containerPath"], m["hostPath"], "ro" in m.get("options", []))
                        for m in edits.get("mounts", [])
                    ]
                    return list(edits.get("env", [])), mounts
    raise LookupError(f"unresolvable CDI device {name!r}")  # the runtime fails the container


def _expand(ids: Sequence[str], physical: Sequence[str]) -> list[str]:
    if "all" in ids:
        return list(physical)
    return [i for i in ids if i and i not in ("none", "void")]


def apply(
    config: ContainerConfig,
    settings: ToolkitSettings,
    physical: Sequence[str],
    cdi_devices: Sequence[str] = (),
    privileged: bool = False,
) -> ContainerConfig:
    """The container as the runtime starts it: CDI edits applied, the GPUs decided."""
    envs = dict(config.envs)
    mounts = list(config.mounts)
    gpus: list[str] = []
    for name in cdi_devices:
        if name.startswith(cdi.GPU_KIND + "="):
            gpus.append(name.split("=", 1)[1])
            continue
        env, extra = _cdi_edits(settings, name)
        envs.update(e.split("=", 1) for e in env)  # type: ignore[misc]
        mounts.extend(extra)
    prefix = cdi.VOLUME_MOUNTS_ROOT + "/"
    from_mounts = [
        m.container_path[len(prefix) :] for m in mounts if m.container_path.startswith(prefix)
    ]
    if settings.accept_volume_mounts and from_mounts:
        gpus.extend(_expand(from_mounts, physical))
    elif privileged or settings.accept_envvar_when_unprivileged:
        gpus.extend(_expand(envs.get(cdi.VISIBLE_DEVICES_ENV, "").split(","), physical))
    decided = [g for g in dict.fromkeys(gpus) if g in physical]
    envs[cdi.VISIBLE_DEVICES_ENV] = ",".join(decided) or "void"
    return dataclasses.replace(config, envs=envs, mounts=mounts)
