"""Run a container the way a CRI runtime would from an AllocateResponse, with runc.

Used by ``vgpu-plugin demo`` and the end-to-end tests: the response's envs and mounts (with
their read-only flags) go into an OCI bundle whose rootfs is an overlay over the host's root
(so the host's programs and Python are there, and what the container writes lands in the
overlay's upper dir, never on the host), and runc runs it in fresh namespaces.
``/etc/ld.so.preload`` in the container is then the plugin's file, and every process really
loads the shim.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_plugin.core.allocation import Mount

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ContainerConfig:
    """What the kubelet hands the runtime for one container, plus the command to run."""

    name: str
    args: Sequence[str]
    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: Sequence[Mount] = ()
    cwd: str = "/"
    # Whether the container's stdin is a pipe the caller writes to and closes (the Popen's
    # stdin); otherwise /dev/null.
    stdin: bool = False


def runc_unavailable_reason() -> str | None:
    """Why containers cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "running containers needs root (runc with mount and pid namespaces)"
    if shutil.which("runc") is None:
        return "runc is not installed (Debian: apt-get install runc)"
    return None


def _mount_entry(m: Mount) -> dict[str, object]:
    return {
        "destination": m.container_path,
        "type": "bind",
        "source": m.host_path,
        "options": ["rbind", "ro" if m.read_only else "rw", "nosuid"],
    }


def oci_spec(config: ContainerConfig, rootfs: Path) -> dict[str, object]:
    """An OCI runtime spec like the one containerd writes for a plain pod container."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/root"}
    env.update(config.envs)
    mounts: list[dict[str, object]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
    ]
    mounts.extend(_mount_entry(m) for m in config.mounts)
    caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FOWNER",
        "CAP_KILL",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_NET_BIND_SERVICE",
    ]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(config.args),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": config.cwd,
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": config.name[:63],
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"],
        },
    }


class Runtime(ABC):
    """Runs containers by name: runc here, plain processes in sim/process.py."""

    @abstractmethod
    def start(self, config: ContainerConfig) -> subprocess.Popen[str]:
        """Start the container; its stdout/stderr are the Popen's pipes."""

    @abstractmethod
    def kill(self, name: str, signal: str = "KILL") -> None: ...

    @abstractmethod
    def remove(self, name: str) -> None: ...

    def run(
        self, config: ContainerConfig, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run to completion; the container is removed afterwards."""
        proc = self.start(config)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(config.name)
            out, err = proc.communicate()
        finally:
            self.remove(config.name)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class RuncRuntime(Runtime):
    """Creates bundles under ``workdir`` and runs them with runc."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.state_root = workdir / "runc-state"

    def _bundle(self, config: ContainerConfig) -> Path:
        bundle = self.workdir / config.name
        rootfs, upper, work = bundle / "rootfs", bundle / "upper", bundle / "work"
        for d in (rootfs, upper, work):
            d.mkdir(parents=True, exist_ok=True)
        # Copy-on-write over the host root: mountpoints runc creates land in `upper`.
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir=/,upperdir={upper},workdir={work}",
                str(rootfs),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        (bundle / "config.json").write_text(json.dumps(oci_spec(config, rootfs), indent=1))
        return bundle

    def _cleanup(self, name: str) -> None:
        subprocess.run(
            ["runc", "--root", str(self.state_root), "delete", "-f", name],
            capture_output=True,
            check=False,
        )
        bundle = self.workdir / name
        subprocess.run(["umount", "-l", str(bundle / "rootfs")], capture_output=True, check=False)
        shutil.rmtree(bundle, ignore_errors=True)

    def start(self, config: ContainerConfig) -> subprocess.Popen[str]:
        """Start the container; its stdout/stderr are the Popen's pipes."""
        reason = runc_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self._cleanup(config.name)
        bundle = self._bundle(config)
        return subprocess.Popen(
            ["runc", "--root", str(self.state_root), "run", "--bundle", str(bundle), config.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.PIPE if config.stdin else subprocess.DEVNULL,
            text=True,
        )

    def kill(self, name: str, signal: str = "KILL") -> None:
        subprocess.run(
            ["runc", "--root", str(self.state_root), "kill", "--all", name, signal],
            capture_output=True,
            check=False,
        )

    def remove(self, name: str) -> None:
        self._cleanup(name)
