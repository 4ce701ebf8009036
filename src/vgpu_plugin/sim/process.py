"""Run a container's workload as a plain process where runc cannot run: the demo's fallback.

Two ways, both from the same :class:`ContainerConfig` as :class:`RuncRuntime`:

- ``namespace`` (root, no runc): a private mount and pid namespace (``unshare``) where an
  overlay over the host's root gets the response's mounts, then ``chroot`` into it. The
  container's ``/etc/ld.so.preload`` is the plugin's file, so every process loads the shim as in
  a pod; nothing on the host changes (the overlay and the mounts end with the namespace).
- ``preload`` (no root): the process runs on the host with ``LD_PRELOAD`` naming the shim, and
  the container paths in its envs mapped to their host paths (the limits file through
  ``VGPU_LIMITS_FILE``, the lock dir through ``VGPU_LOCK_DIR``, the peers' pacing files
  through ``VGPU_COMPUTE_PEERS``). The shim enforces the same
  limits; only a process that clears ``LD_PRELOAD`` escapes, which a pod's ld.so.preload
  prevents.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal as signal_module
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from vgpu_plugin.core.allocation import Mount
from vgpu_plugin.core.defaults import CONTAINER_LOCK_DIR, LIMITS_PATH, PEERS_PATH, SHIM_PATH
from vgpu_plugin.sim.runc import DEFAULT_PATH, ContainerConfig, Runtime, runc_unavailable_reason

RUNTIMES = ("runc", "namespace", "preload")


def namespace_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "private mount namespaces need root"
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return "unshare or chroot is not installed (util-linux, coreutils)"
    return None


def choose_runtime(wanted: str = "auto") -> tuple[str, str]:
    """(runtime, why) for ``wanted`` (``auto`` or one of RUNTIMES); ValueError when ``wanted``
    cannot run here, naming why."""
    reasons = {
        "runc": runc_unavailable_reason(),
        "namespace": namespace_unavailable_reason(),
        "preload": None,
    }
    if wanted != "auto":
        if wanted not in reasons:
            raise ValueError(f"unknown runtime {wanted!r}: choose auto, {', '.join(RUNTIMES)}")
        if reasons[wanted]:
            raise ValueError(f"runtime {wanted} cannot run here: {reasons[wanted]}")
        return wanted, "as asked"
    for kind in RUNTIMES:
        if reasons[kind] is None:
            skipped = "; ".join(f"not {k}: {reasons[k]}" for k in RUNTIMES[: RUNTIMES.index(kind)])
            return kind, skipped or "runc is available"
    raise AssertionError("preload always runs")


def host_path(mounts: Sequence[Mount], path: str) -> str:
    """Where a container path lives on the host, through the mount that holds it."""
    best: Mount | None = None
    for m in mounts:
        inside = path == m.container_path or path.startswith(m.container_path.rstrip("/") + "/")
        if inside and (best is None or len(m.container_path) > len(best.container_path)):
            best = m
    if best is None:
        return path
    return best.host_path + path[len(best.container_path) :]


def preload_env(config: ContainerConfig) -> dict[str, str]:
    """The environment of a ``preload`` process: the container's envs with container paths
    mapped to the host, the shim in LD_PRELOAD, the limits file and lock dir named."""
    env = {"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": os.environ.get("HOME", "/")}
    for key, value in config.envs.items():
        env[key] = host_path(config.mounts, value) if value.startswith("/") else value
    env["LD_PRELOAD"] = host_path(config.mounts, SHIM_PATH)
    env["VGPU_LIMITS_FILE"] = host_path(config.mounts, LIMITS_PATH)
    env["VGPU_LOCK_DIR"] = host_path(config.mounts, CONTAINER_LOCK_DIR)
    if any(m.container_path == PEERS_PATH for m in config.mounts):  # compute guarantees
        env["VGPU_COMPUTE_PEERS"] = host_path(config.mounts, PEERS_PATH)
    return env


def namespace_script(config: ContainerConfig, bundle: Path) -> str:
    """The shell run inside ``unshare``: overlay, the response's mounts, proc, chroot."""
    root, upper, work = bundle / "rootfs", bundle / "upper", bundle / "work"
    q = shlex.quote
    lines = [
        "set -e",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={q(str(upper))},"
        f"workdir={q(str(work))} {q(str(root))}",
    ]
    for m in config.mounts:
        target = q(str(root) + m.container_path)
        make = f"mkdir -p {target}" if os.path.isdir(m.host_path) else (
            f"mkdir -p {q(os.path.dirname(str(root) + m.container_path))} && touch {target}"
        )  # fmt: skip
        lines.append(make)
        lines.append(f"mount --bind {q(m.host_path)} {target}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines += [
        f"mount -t proc proc {q(str(root / 'proc'))}",
        f"mount --rbind /dev {q(str(root / 'dev'))}",
        f"mount --rbind /sys {q(str(root / 'sys'))}",
    ]
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", **config.envs}
    envs = " ".join(q(f"{k}={v}") for k, v in env.items())
    args = " ".join(q(a) for a in config.args)
    lines.append(
        f"exec chroot {q(str(root))} /usr/bin/env -i {envs} sh -c "
        + q(f"cd {q(config.cwd)} && exec {args}")
    )
    return "\n".join(lines) + "\n"


class ProcessRuntime(Runtime):
    """The :class:`RuncRuntime` interface (start, run, kill, remove) over plain processes."""

    def __init__(self, workdir: Path, kind: str) -> None:
        if kind not in ("namespace", "preload"):
            raise ValueError(f"a process runtime is 'namespace' or 'preload', not {kind!r}")
        self.workdir = workdir
        self.kind = kind
        self._procs: dict[str, subprocess.Popen[str]] = {}

    def _command(self, config: ContainerConfig) -> tuple[list[str], Mapping[str, str] | None]:
        if self.kind == "preload":
            return list(config.args), preload_env(config)
        bundle = self.workdir / config.name
        for d in ("rootfs", "upper", "work"):
            (bundle / d).mkdir(parents=True, exist_ok=True)
        script = bundle / "start.sh"
        script.write_text(namespace_script(config, bundle))
        unshare = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork"]
        return [*unshare, "--kill-child", "sh", str(script)], None

    def start(self, config: ContainerConfig) -> subprocess.Popen[str]:
        self.remove(config.name)
        args, env = self._command(config)
        proc = subprocess.Popen(
            args,
            env=env,
            cwd=config.cwd if self.kind == "preload" else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.PIPE if config.stdin else subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # one signal reaches the whole container
        )
        self._procs[config.name] = proc
        return proc

    def kill(self, name: str, signal: str = "KILL") -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal_module.Signals[f"SIG{signal}"])

    def remove(self, name: str) -> None:
        self.kill(name)
        proc = self._procs.pop(name, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        shutil.rmtree(self.workdir / name, ignore_errors=True)
