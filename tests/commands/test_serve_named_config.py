"""The real `vgpu-plugin serve` on a simulated node runs the config its node label names
(`vgpu-plugin.io/config`), follows a relabel without a restart, keeps its config when the label
names a config that is not there, and refuses to start on such a label (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from commands.test_serve import RES, Served, install_shim, sample, scrape

from vgpu_plugin.core.named_config import CONFIG_LABEL
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, PodResourcesEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import Node


def split(n: int, host_root: Path) -> str:
    return f"version: v1\nsharing: {{splitCount: {n}}}\nhostRoot: {host_root}\n"


@pytest.fixture
def labelled(simgpu_node: Node, native_tree: Path, tmp_path: Path) -> Iterator[Served]:
    host_root = tmp_path / "host"
    install_shim(host_root, native_tree)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(split(4, host_root))
    (conf / "big.yaml").write_text(split(8, host_root))
    labels = tmp_path / "labels"
    labels.write_text(f"kubernetes.io/hostname=node-1\n{CONFIG_LABEL}=big\n")
    plugin_dir = short_tmp_dir()
    argv = [
        sys.executable, "-m", "vgpu_plugin", "serve",
        "--config", str(conf / "config.yaml"), "--node-labels-file", str(labels),
        "--device-plugin-dir", str(plugin_dir), "--state-dir", str(tmp_path / "state"),
        "--lock-dir", str(tmp_path / "locks"), "--node-name", "node-1",
        "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", str(plugin_dir / "podres.sock"),
    ]  # fmt: skip
    s = Served(
        simgpu_node, KubeletEmulator(plugin_dir), plugin_dir, host_root, tmp_path / "state",
        conf / "config.yaml", tmp_path / "plugin.log", argv,
        PodResourcesEmulator(plugin_dir / "podres.sock"),
    )  # fmt: skip
    s.kubelet.start()
    s.start()
    try:
        s.kubelet.wait_registrations(1, timeout=30)
        yield s
    finally:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s.kubelet.stop()


def test_serve_runs_the_labelled_config_and_follows_a_relabel(labelled: Served) -> None:
    labels = labelled.config.parent.parent / "labels"
    labelled.wait_for(lambda d: len(d) == 16, timeout=30)  # 2 GPUs x big.yaml's 8
    assert f"node label {CONFIG_LABEL} picks config {labelled.config.parent / 'big.yaml'}" in (
        labelled.logs()
    )
    # A label naming a config the ConfigMap lacks: one line, the running config stays.
    labels.write_text(f"{CONFIG_LABEL}=huge\n")
    logs = labelled.wait_log(f"node label {CONFIG_LABEL}=huge: no config file", timeout=30)
    (line,) = [x for x in logs.splitlines() if "=huge" in x]
    assert "keeping the running config" in line
    assert len(labelled.kubelet.devices(RES) or []) == 16
    assert sample(scrape(labelled), "vgpu_config_reloads_total", result="error") == 1
    # The label removed: back to config.yaml's split, without a restart.
    labels.write_text("kubernetes.io/hostname=node-1\n")
    labelled.wait_for(lambda d: len(d) == 8, timeout=30)
    assert labelled.proc is not None and labelled.proc.poll() is None


def test_serve_refuses_to_start_on_a_label_naming_no_config(
    simgpu_node: Node, tmp_path: Path
) -> None:
    (tmp_path / "config.yaml").write_text("version: v1\n")
    labels = tmp_path / "labels"
    labels.write_text(f"{CONFIG_LABEL}=a100-80gb\n")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(tmp_path / "config.yaml"),
         "--node-labels-file", str(labels), "--device-plugin-dir", str(tmp_path / "dp"),
         "--host-root", str(tmp_path / "empty"), "--state-dir", str(tmp_path / "state"),
         "--metrics-address", "127.0.0.1:0"],
        env=simgpu_node.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "cannot start" in x]
    assert f"node label {CONFIG_LABEL}=a100-80gb: no config file {tmp_path / 'a100-80gb.yaml'}" in (
        line
    )
    assert "Traceback" not in proc.stderr
