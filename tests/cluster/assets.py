"""The cluster tier's binaries, found like envtest's assets.

``VGPU_K8S_ASSETS`` names a directory of xz-compressed binaries with a SHA256SUMS file (the
layout of ``../shared/k8s`` beside the repo root, its default). They are checked and unpacked once
into ``build/cluster/bin-<sums hash>/``; a directory that already holds the plain binaries is
used as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "cluster"
BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
)
# From Debian (.ci/cluster-deps.sh installs them): command -> package.
HOST_TOOLS = {
    "etcd": "etcd-server",
    "runc": "runc",
    "iptables": "iptables",
    "debootstrap": "debootstrap",
    "openssl": "openssl",
    "xz": "xz-utils",
    "unshare": "util-linux",
    "ip": "iproute2",
    "gcc": "gcc",
}
CNI_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")


class Missing(Exception):
    """Something the tier needs is not here; the message is the skip reason."""


def asset_dir() -> Path:
    """VGPU_K8S_ASSETS, else ``shared/k8s`` beside the repo root (for a git worktree: beside
    its main checkout too)."""
    given = os.environ.get("VGPU_K8S_ASSETS")
    if given:
        return Path(given)
    candidates = [ROOT.parent / "shared" / "k8s"]
    dotgit = ROOT / ".git"
    if dotgit.is_file():  # a worktree: "gitdir: <main>/.git/worktrees/<name>"
        gitdir = Path(dotgit.read_text().partition("gitdir:")[2].strip())
        if gitdir.parent.name == "worktrees":
            candidates.append(gitdir.parent.parent.parent.parent / "shared" / "k8s")
    return next((c for c in candidates if c.is_dir()), candidates[0])


def binaries() -> Path:
    """The directory of the plain binaries (unpacked and checked on first use)."""
    src = asset_dir()
    if all((src / b).is_file() and os.access(src / b, os.X_OK) for b in BINARIES):
        return src
    sums = src / "SHA256SUMS"
    if not sums.is_file():
        raise Missing(f"no Kubernetes binaries: {sums} missing (set VGPU_K8S_ASSETS)")
    expected: dict[str, str] = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if name:
            expected[name.lstrip("*")] = digest
    out = CACHE / ("bin-" + hashlib.sha256(sums.read_bytes()).hexdigest()[:16])
    if all((out / b).is_file() for b in BINARIES):
        return out
    if shutil.which("xz") is None:
        raise Missing("xz is not installed (apt-get install xz-utils)")
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in BINARIES:
        packed = src / f"{name}.xz"
        if not packed.is_file():
            raise Missing(f"no Kubernetes binaries: {packed} missing")
        digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        if expected.get(packed.name) != digest:
            raise Missing(f"{packed}: sha256 {digest} does not match {sums}")
        with open(tmp / name, "wb") as f:
            subprocess.run(["xz", "-dc", str(packed)], stdout=f, check=True)
        (tmp / name).chmod(0o755)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def check_host() -> None:
    """Raises Missing naming the first thing this host lacks for the tier."""
    if os.geteuid() != 0:
        raise Missing("the cluster tier needs root (namespaces, mounts, cgroups)")
    for tool, package in HOST_TOOLS.items():
        if shutil.which(tool) is None:
            raise Missing(f"{tool} is not installed (apt-get install {package})")
    for plugin in CNI_PLUGINS:
        if not (CNI_DIR / plugin).is_file():
            raise Missing(
                f"CNI plugin {CNI_DIR / plugin} missing "
                "(apt-get install containernetworking-plugins)"
            )
    if not Path("/sys/fs/cgroup").is_dir():
        raise Missing("no /sys/fs/cgroup")
    probe = subprocess.run(
        ["unshare", "--mount", "--net", "--fork", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise Missing(f"cannot make mount+network namespaces: {probe.stderr.strip()}")
