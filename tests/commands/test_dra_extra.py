"""The ``kubernetes`` client comes with the ``dra`` extra only: without it the device plugin
serves as before, and ``serve`` with ``dra.enabled`` refuses to start in one line naming the
extra (exit 3, docs/operations.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from commands.test_serve import install_shim

from vgpu_plugin.node.serving import kubeapi
from vgpu_plugin.sim.simgpu import Node


def test_kube_api_without_the_client_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes `import kubernetes` raise ImportError, as where it is missing.
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(kubeapi.ClientMissing) as caught:
        kubeapi.KubeApi()
    message = str(caught.value)
    assert "vgpu-plugin[dra]" in message and "dra.enabled" in message
    assert "\n" not in message


def _blocking_env(node: Node, tmp_path: Path) -> dict[str, str]:
    """An environment where ``import kubernetes`` fails as on an install without the extra."""
    block = tmp_path / "block" / "kubernetes"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError(\"No module named 'kubernetes'\")\n")
    env = node.env()
    env["PYTHONPATH"] = os.pathsep.join([str(block.parent), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_serve_with_dra_and_no_client_exits_3_in_one_line(
    simgpu_node: Node, native_tree: Path, tmp_path: Path
) -> None:
    host_root = tmp_path / "host"
    install_shim(host_root, native_tree)
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nhostRoot: {host_root}\ndra: {{enabled: true}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(config),
         "--device-plugin-dir", str(tmp_path / "dp"), "--state-dir", str(tmp_path / "state"),
         "--lock-dir", str(tmp_path / "locks"), "--cdi-spec-dir", str(tmp_path / "cdi"),
         "--metrics-address", "127.0.0.1:0"],
        env=_blocking_env(simgpu_node, tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "cannot start" in x]
    assert "vgpu-plugin[dra]" in line and "kubernetes client" in line
    assert "Traceback" not in proc.stderr


def test_the_device_plugin_modules_load_without_the_client(
    simgpu_node: Node, tmp_path: Path
) -> None:
    code = (
        "import vgpu_plugin.commands.serve, vgpu_plugin.commands.check_config, sys; "
        "assert 'kubernetes' not in sys.modules or sys.modules['kubernetes'] is None"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_blocking_env(simgpu_node, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
