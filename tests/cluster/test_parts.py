"""The tier's own parts without a cluster: the assets' checks and the toolkit runtime's edits."""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path

import pytest

from . import assets, launcher, nvidia_runtime
from .cluster import toolkit_spec


def test_missing_assets_name_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VGPU_K8S_ASSETS", str(tmp_path))
    with pytest.raises(assets.Missing, match="SHA256SUMS missing"):
        assets.binaries()


def test_a_tampered_binary_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = lzma.compress(b"#!/bin/sh\n", format=lzma.FORMAT_XZ)
    lines = []
    for name in assets.BINARIES:
        (tmp_path / f"{name}.xz").write_bytes(packed)
        lines.append(f"{hashlib.sha256(packed).hexdigest()}  {name}.xz")
    lines[0] = "0" * 64 + lines[0][64:]
    (tmp_path / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("VGPU_K8S_ASSETS", str(tmp_path))
    monkeypatch.setattr(assets, "CACHE", tmp_path / "cache")
    with pytest.raises(assets.Missing, match=f"{assets.BINARIES[0]}.xz: sha256 .* does not match"):
        assets.binaries()


def _config(*mounts: str) -> dict[str, object]:
    return {
        "process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]},
        "mounts": [{"destination": m, "source": "/dev/null", "type": "bind"} for m in mounts],
    }


def test_runtime_gives_the_gpus_named_by_volume_mounts() -> None:
    spec = toolkit_spec(["GPU-a", "GPU-b"], Path("/lib/simgpu"), Path("/state"))
    config = nvidia_runtime.apply(_config(nvidia_runtime.PREFIX + "GPU-b"), spec)
    env = config["process"]["env"]  # type: ignore[index]
    assert "NVIDIA_VISIBLE_DEVICES=GPU-b" in env and "NVIDIA_VISIBLE_DEVICES=all" not in env
    assert "SIMGPU_STATE=/run/simgpu" in env
    sources = {m["destination"]: m["source"] for m in config["mounts"]}  # type: ignore[attr-defined]
    assert sources["/usr/local/simgpu"] == "/lib/simgpu"
    assert sources["/run/simgpu"] == "/state"


def test_runtime_leaves_other_containers_alone_and_refuses_unknown_gpus() -> None:
    spec = toolkit_spec(["GPU-a"], Path("/lib/simgpu"), Path("/state"))
    plain = _config("/data")
    assert nvidia_runtime.apply(plain, spec) == _config("/data")
    with pytest.raises(SystemExit, match="unknown GPU 'GPU-z'"):
        nvidia_runtime.apply(_config(nvidia_runtime.PREFIX + "GPU-z"), spec)


def test_paths_under_the_tiers_tmpfs_are_kept_topmost(tmp_path: Path) -> None:
    """A fresh clone under /tmp: its checkout (binaries, images, work dir) must be bound back
    over the tmpfs the launcher mounts on /tmp, or the node cannot find kube-apiserver."""
    repo = tmp_path / "repo"
    (repo / "build" / "cluster").mkdir(parents=True)
    paths = [repo, repo / "build" / "cluster", Path("/usr/bin"), tmp_path / "shared" / "k8s"]
    tmpfs = (str(tmp_path), "/run")
    assert launcher.covered_by(paths, tmpfs) == sorted([repo, tmp_path / "shared" / "k8s"])
    assert launcher.covered_by([Path("/usr/bin")], tmpfs) == []
    with pytest.raises(RuntimeError, match="where the tier mounts a tmpfs"):
        launcher.covered_by([tmp_path], tmpfs)
