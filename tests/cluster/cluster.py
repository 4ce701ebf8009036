"""The host side of the cluster tier: start launcher.py, talk to its API server, tear it down.

The simulated GPU node (simgpu's state) and the stand-in for the NVIDIA toolkit (its CDI spec
and runtime, nvidia_runtime.py) are made here, on the host side of a work dir under
build/cluster/ (host paths: the launcher's tmpfs dirs would hide /tmp). The test process talks
to the API server at https://127.0.0.1:<port>, a port the launcher bound in the host's network
namespace before it left it; helm uses the same through ``kubeconfig``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .assets import CACHE, ROOT
from .images import Images

SIMGPU_IN_CONTAINER = "/usr/local/simgpu"
STATE_IN_CONTAINER = "/run/simgpu"
# A real driver's NVML lists processes by their pids on the node: simgpu reports those when it
# can read the node's /proc (SIMGPU_HOST_PROC, simgpu's NVML.md), bound here read-only.
NODE_PROC_IN_CONTAINER = "/run/simgpu-node-proc"
# What the stand-in spec sets in a GPU container: simgpu's libraries, state and node pids.
SIMGPU_ENV = (
    f"LD_LIBRARY_PATH={SIMGPU_IN_CONTAINER}",
    f"SIMGPU_STATE={STATE_IN_CONTAINER}",
    f"SIMGPU_HOST_PROC={NODE_PROC_IN_CONTAINER}",
)
BRING_UP_TIMEOUT = 300.0


def toolkit_spec(uuids: list[str], libdir: Path, state: Path) -> dict[str, object]:
    """The stand-in for the toolkit's generated CDI spec: a device per GPU UUID and index and
    ``all``; each gives the container simgpu's libcuda/libnvidia-ml, the node's state and the
    node's /proc (for the pids NVML reports)."""
    devices = [
        {"name": name, "containerEdits": {"env": [f"NVIDIA_VISIBLE_DEVICES={value}"]}}
        for i, u in enumerate(uuids)
        for name, value in ((u, u), (str(i), u))
    ]
    devices.append({"name": "all", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}})
    return {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": list(SIMGPU_ENV),
            "mounts": [
                {
                    "hostPath": str(libdir),
                    "containerPath": SIMGPU_IN_CONTAINER,
                    "options": ["ro", "rbind", "nosuid", "nodev"],
                },
                {
                    "hostPath": str(state),
                    "containerPath": STATE_IN_CONTAINER,
                    "options": ["rw", "rbind", "nosuid", "nodev"],
                },
                {
                    "hostPath": "/proc",
                    "containerPath": NODE_PROC_IN_CONTAINER,
                    "options": ["ro", "rbind", "nosuid", "nodev", "noexec"],
                },
            ],
        },
    }


@dataclass
class Cluster:
    work: Path
    proc: subprocess.Popen[bytes]
    cgroup: str
    port: int = 0
    gpus: list[str] = field(default_factory=list)
    bring_up_seconds: float = 0.0

    @property
    def kubeconfig(self) -> Path:
        return self.work / "host.kubeconfig"

    def node_path(self, path: str) -> Path:
        """A path as the node (the launcher's mount namespace) sees it. Absolute symlinks on
        the way (/var/run -> /run) are followed inside the node's root, not the host's."""
        root = Path(f"/proc/{self.proc.pid}/root")
        parts = [p for p in path.split("/") if p]
        resolved: list[str] = []
        for _ in range(40):  # symlink hops
            if not parts:
                break
            resolved.append(parts.pop(0))
            here = root.joinpath(*resolved)
            if here.is_symlink():
                target = os.readlink(here)
                base = [] if target.startswith("/") else resolved[:-1]
                parts = [p for p in target.split("/") if p] + parts
                resolved = base
        return root.joinpath(*resolved)

    def log(self, name: str) -> str:
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def control(self, command: str, timeout: float = 60) -> None:
        reply = self.work / "control.reply"
        reply.unlink(missing_ok=True)
        with open(self.work / "control", "w") as f:
            f.write(command + "\n")
        deadline = time.monotonic() + timeout
        while not reply.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"launcher did not answer {command!r}")
            time.sleep(0.2)
        answer = reply.read_text().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"launcher: {command!r}: {answer}")

    def api(self):  # type: ignore[no-untyped-def]
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(str(self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def leftovers(self) -> list[str]:
        """What is left of the cluster on the host: its cgroups (the process tree's home, so
        any process of it), mounts under its work dir or of its runtime, the API port."""
        found = []
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mountpoint, fstype, *_ = line.split()
            if fstype == "cgroup" and (Path(mountpoint) / self.cgroup).exists():
                found.append(f"cgroup {Path(mountpoint) / self.cgroup}")
            elif mountpoint.startswith(str(self.work)) or "/containerd/" in mountpoint:
                found.append(f"mount {mountpoint}")
        if self.port:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    found.append(f"listening 127.0.0.1:{self.port}")
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(images: Images, bin_dir: Path, gpus: int = 1, memory: str = "16g") -> Cluster:
    for old in CACHE.glob("run-*"):  # the last run's logs are kept until the next run
        shutil.rmtree(old, ignore_errors=True)
    work = CACHE / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    state = work / "simgpu"
    env = dict(os.environ, VGPU_NATIVE_DIR=str(images.native_dir), PYTHONPATH=str(ROOT / "src"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vgpu_plugin.sim.simgpu",
            "create",
            "--state",
            str(state),
            "--gpus",
            str(gpus),
            "--memory",
            memory,
            "--seed",
            "cluster",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    status = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin.sim.simgpu", "status", "--state", str(state)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    uuids = [g["uuid"] for g in json.loads(status.stdout)]
    toolkit = work / "toolkit-cdi"
    toolkit.mkdir()
    spec = toolkit / "nvidia.json"
    spec.write_text(json.dumps(toolkit_spec(uuids, images.native_dir / "simgpu", state)))
    runtime = work / "nvidia-runtime"
    runc = shutil.which("runc") or "/usr/sbin/runc"
    runtime.write_text(
        f"#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / 'nvidia_runtime.py'} "
        f'{spec} {runc} "$@"\n'
    )
    runtime.chmod(0o755)
    cgroup = f"vgpu-cluster-{os.getpid()}"
    settings = {
        "workdir": str(work),
        "bin": str(bin_dir),
        "node_name": "vgpu-node",
        "cgroup": cgroup,
        "images": [str(t) for t in images.tarballs],
        "toolkit_cdi_dir": str(toolkit),
        "runtime": str(runtime),
    }
    (work / "settings.json").write_text(json.dumps(settings))
    t0 = time.monotonic()
    out = open(work / "launcher.log", "ab")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "launcher.py"), str(work / "settings.json")],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    cluster = Cluster(work, proc, cgroup, gpus=uuids)
    deadline = t0 + BRING_UP_TIMEOUT
    while not (work / "ready").exists():
        if proc.poll() is not None or (work / "failed").exists() or time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(
                "the cluster did not come up:\n" + (work / "launcher.log").read_text()[-6000:]
            )
        time.sleep(0.5)
    cluster.port = int((work / "port").read_text())
    cluster.bring_up_seconds = time.monotonic() - t0
    return cluster
