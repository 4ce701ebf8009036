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

It also plays the toolkit's ``apply-cuda-memory-limits`` CDI hook
(docs/contracts.md#driver-memory-limit): when the container's envs carry both
``NVIDIA_GPU_MEMORY_REQUEST`` and ``NVIDIA_GPU_MEMORY_LIMIT`` (whole MiB) and it gets GPUs, the
hook calls
``nvmlDeviceSetMemoryLimits_v1`` on each of them for the container's cgroup (request: soft
limit, limit: hard limit, in bytes), so the driver holds the container to it. The hook is a
process of its own, as the real one is (``python -m vgpu_plugin.sim.toolkit``, through
simgpu's NVML). A simulated container's cgroup is ``/kubepods/vgpu-sim/<container name>``; it
reaches the container as ``SIMGPU_CGROUP``, which simgpu takes for the process's cgroup (under
a cgroup namespace the container's own ``/proc/self/cgroup`` says only ``/``).

Where the driver call knows the node's simulated cgroup fs (``DriverHook.cgroupfs``, next to
the node's state), the container's cgroup is also a directory there, as the runtime makes it,
and the container sees it as its own cgroup, as under a cgroup namespace: mounted read-only at
``OWN_CGROUP_MOUNT``, which ``SIMGPU_SYSFS_CGROUP`` tells simgpu stands for /sys/fs/cgroup (the
process runtimes cannot mount over /sys/fs/cgroup). The hook sets the limit by the host path,
the shim inside asks by ``/sys/fs/cgroup/``, and simgpu finds the one directory both name.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.core import cdi
from vgpu_plugin.core.allocation import MEMORY_LIMIT_ENV, MEMORY_REQUEST_ENV, Mount
from vgpu_plugin.sim.runc import ContainerConfig

MIB = 1 << 20
CGROUP_ENV = "SIMGPU_CGROUP"
SYSFS_CGROUP = "/sys/fs/cgroup"
SYSFS_ENV = "SIMGPU_SYSFS_CGROUP"  # simgpu: the directory that stands for /sys/fs/cgroup
OWN_CGROUP_MOUNT = "/run/vgpu-sim/cgroup"  # the container's own cgroup, as its /sys/fs/cgroup


@dataclass(frozen=True)
class ToolkitSettings:
    """The node's toolkit settings; the defaults are the safe ones docs/security.md asks for."""

    accept_envvar_when_unprivileged: bool = False
    accept_volume_mounts: bool = True
    cdi_spec_dirs: tuple[Path, ...] = ()
    # The apply-cuda-memory-limits hook: in the toolkit's generated CDI specs wherever the
    # toolkit has it (NVIDIA's PR #2075), with nothing to configure; False: an older toolkit.
    apply_cuda_memory_limits: bool = True


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


SetMemoryLimits = Callable[[str, Sequence[str], int, int], None]
"""Calls the driver for the hook: (cgroup nameSpace, GPU UUIDs, soft bytes, hard bytes)."""


def container_cgroup(name: str) -> str:
    """The simulated cgroup v2 path of the container ``name``."""
    return f"/kubepods/vgpu-sim/{name}"


def memory_limits(envs: Mapping[str, str]) -> tuple[int, int] | None:
    """The hook's (soft, hard) bytes from the container's envs, or None when it does nothing
    (not both set). A value that is not a whole number of MiB fails the container."""
    request, limit = envs.get(MEMORY_REQUEST_ENV), envs.get(MEMORY_LIMIT_ENV)
    if request is None or limit is None:
        return None
    try:
        return int(request) * MIB, int(limit) * MIB
    except ValueError as exc:
        raise RuntimeError(f"apply-cuda-memory-limits: bad value: {exc}") from exc


def apply(
    config: ContainerConfig,
    settings: ToolkitSettings,
    physical: Sequence[str],
    cdi_devices: Sequence[str] = (),
    privileged: bool = False,
    set_memory_limits: SetMemoryLimits | None = None,
) -> ContainerConfig:
    """The container as the runtime starts it: CDI edits applied, the GPUs decided, and the
    memory-limit hook run where it applies (``set_memory_limits`` reaches the node's driver;
    without one the hook has no driver to call and does nothing)."""
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
    limits = memory_limits(envs)
    cgroupfs: Path | None = getattr(set_memory_limits, "cgroupfs", None)
    if cgroupfs is not None and decided:
        # The runtime's part: the container's cgroup exists, and is the container's own view.
        own = cgroupfs / container_cgroup(config.name).lstrip("/")
        own.mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(OWN_CGROUP_MOUNT, str(own), True))
        envs[SYSFS_ENV] = OWN_CGROUP_MOUNT
    if settings.apply_cuda_memory_limits and limits and decided and set_memory_limits:
        cgroup = container_cgroup(config.name)
        set_memory_limits(SYSFS_CGROUP + cgroup, decided, *limits)
        envs[CGROUP_ENV] = cgroup
    return dataclasses.replace(config, envs=envs, mounts=mounts)


@dataclass(frozen=True)
class DriverHook:
    """The hook's driver call, as a process of its own on the node of ``env`` (simgpu's), on
    the host, whose /sys/fs/cgroup is ``cgroupfs`` (None: simulated cgroups are paths only)."""

    env: Mapping[str, str]
    cgroupfs: Path | None

    def __call__(self, name_space: str, uuids: Sequence[str], soft: int, hard: int) -> None:
        env = dict(self.env)
        if self.cgroupfs is not None:
            env[SYSFS_ENV] = str(self.cgroupfs)
        proc = subprocess.run(
            [sys.executable, "-m", "vgpu_plugin.sim.toolkit", name_space, str(soft), str(hard),
             *uuids],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if proc.returncode != 0:  # the runtime fails the container, as on a real node
            raise RuntimeError(f"apply-cuda-memory-limits failed: {proc.stderr.strip()}")


def set_memory_limits_with(env: Mapping[str, str]) -> DriverHook:
    """The hook's driver call on the node of ``env``; the node's simulated cgroup fs is the
    directory beside its state (``<state>.cgroupfs``)."""
    state = env.get("SIMGPU_STATE")
    return DriverHook(env, Path(state + ".cgroupfs") if state else None)


# --- the hook process: NVML through ctypes (any pynvml version; NVML 13.4's entry points) ----


class _SetLimits(ctypes.Structure):
    _fields_ = [  # nvmlSetMemoryLimits_v1_t
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


def _hook(argv: Sequence[str]) -> int:
    name_space, soft, hard, *uuids = argv
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    rc = nvml.nvmlInit_v2()
    if rc != 0:
        print(f"nvmlInit: NVML error {rc}", file=sys.stderr)
        return 1
    try:
        for uuid in uuids:
            handle = ctypes.c_void_p()
            rc = nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle))
            if rc == 0:
                limits = _SetLimits(name_space.encode(), int(soft), int(hard))
                rc = nvml.nvmlDeviceSetMemoryLimits_v1(handle, ctypes.byref(limits))
            if rc != 0:
                print(f"{uuid}: nvmlDeviceSetMemoryLimits_v1: NVML error {rc}", file=sys.stderr)
                return 1
    finally:
        nvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_hook(sys.argv[1:]))
