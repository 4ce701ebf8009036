"""vgpu-node-labels (deploy/image/): the node's labels from the API server, in the file format
the plugin reads (``--node-labels-file``), against a local stand-in for the API server."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from deployment.chart import ROOT
from vgpu_plugin.node.serving.config_watch import read_node_labels

SCRIPT = ROOT / "deploy" / "image" / "vgpu-node-labels.py"
TOKEN = "s3cret"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vgpu_node_labels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


labels_tool = _load()


class FakeApi:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, str]] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.status = 200
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append((self.path, self.headers.get("Authorization")))
                name = self.path.removeprefix("/api/v1/nodes/")
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_response(401)
                elif api.status != 200:
                    self.send_response(api.status)
                elif name not in api.nodes:
                    self.send_response(404)
                else:
                    body = json.dumps(
                        {"kind": "Node", "metadata": {"name": name, "labels": api.nodes[name]}}
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def run(api: FakeApi, tmp_path: Path, *extra: str, stop: threading.Event | None = None) -> int:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    argv = ["--api-server", api.url, "--token-file", str(token), "--node-name", "gpu-a1"]
    argv += ["--output", str(tmp_path / "labels"), "--attempts", "1", *extra]
    code: int = labels_tool.main(argv, stop=stop)
    return code


def test_writes_the_nodes_labels_as_the_plugin_reads_them(api: FakeApi, tmp_path: Path) -> None:
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "kubernetes.io/hostname": "gpu-a1",
        "empty": "",
    }
    api.nodes["gpu-a1"] = labels
    assert run(api, tmp_path) == 0
    assert read_node_labels(tmp_path / "labels") == labels
    assert api.requests == [("/api/v1/nodes/gpu-a1", f"Bearer {TOKEN}")]


def test_fails_loudly_without_access(
    api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api.nodes["gpu-a1"] = {"a": "b"}
    api.status = 403
    assert run(api, tmp_path) == 1
    assert "HTTP 403" in capsys.readouterr().err
    assert not (tmp_path / "labels").exists()  # the plugin then refuses to start: exit 2


def test_refresh_rewrites_the_file_when_labels_change(api: FakeApi, tmp_path: Path) -> None:
    api.nodes["gpu-a1"] = {"zone": "a"}
    stop = threading.Event()
    result: list[int] = []
    worker = threading.Thread(
        target=lambda: result.append(run(api, tmp_path, "--interval", "0.05", stop=stop))
    )
    worker.start()
    try:
        labels = tmp_path / "labels"
        _wait_for(lambda: labels.exists() and read_node_labels(labels) == {"zone": "a"})
        api.status = 500  # an outage keeps the last good file
        _wait_for(lambda: len(api.requests) >= 4)
        assert read_node_labels(labels) == {"zone": "a"}
        api.status = 200
        api.nodes["gpu-a1"] = {"zone": "b"}
        _wait_for(lambda: read_node_labels(labels) == {"zone": "b"})
    finally:
        stop.set()
        worker.join(5)
    assert result == [0]


def test_in_cluster_defaults() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert labels_tool.api_server(env) == "https://[fd00::1]:6443"
    with pytest.raises(labels_tool.Failure):
        labels_tool.api_server({})


def _wait_for(condition: Any, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)
