#!/usr/bin/env python3
"""vgpu-node-labels: write this node's labels, as ``key=value`` lines, for the plugin.

``vgpu-plugin serve --node-labels-file FILE`` matches config overrides on node labels. The
downward API gives a pod its own labels, never its node's, so the chart's
``nodeLabels.fromAPI`` runs this in the plugin's pod: once as an init container (the plugin
refuses to start without the file), then, optionally, as a sidecar that rewrites the file when
the labels change (the plugin applies that like a config change). Only these containers get an
API token; the plugin itself never talks to the API server.

Standard library only; installed in the image as ``/usr/local/bin/vgpu-node-labels``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class Failure(Exception):
    """The labels could not be read; the message says why."""


def api_server(environ: Mapping[str, str]) -> str:
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise Failure("KUBERNETES_SERVICE_HOST is not set (not in a pod?): pass --api-server")
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def labels_text(node_name: str, node: Mapping[str, Any]) -> str:
    """The file's content: a comment line, then one sorted ``key=value`` line per label."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    lines = [f"# labels of node {node_name}, written by vgpu-node-labels"]
    for key, value in sorted(labels.items()):
        text = f"{key}={value}"
        if "\n" in text or "\r" in text:
            raise Failure(f"label {key!r} has a line break")
        lines.append(text)
    return "\n".join(lines) + "\n"


def fetch_node(
    server: str, node_name: str, token_file: str, ca_file: str, timeout: float
) -> dict[str, Any]:
    # The token is read for every request: the kubelet rotates the projected token.
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise Failure(f"cannot read the API token {token_file}: {exc.strerror}") from None
    url = f"{server.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node_name, safe='')}"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
    )
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            node: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:
        hint = " (does the ClusterRole allow get on nodes?)" if exc.code == 403 else ""
        raise Failure(f"GET {url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Failure(f"GET {url}: {exc}") from None
    return node


def write_if_changed(path: Path, text: str) -> bool:
    """Replace ``path`` atomically (the plugin never reads half a file); False: unchanged."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{stamp} vgpu-node-labels: {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vgpu-node-labels", description="Write this node's labels as key=value lines."
    )
    p.add_argument("--output", required=True, help="the labels file to write")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), help="env NODE_NAME")
    p.add_argument("--api-server", help="default: from KUBERNETES_SERVICE_HOST/PORT")
    p.add_argument("--token-file", default=f"{SA_DIR}/token")
    p.add_argument("--ca-file", default=f"{SA_DIR}/ca.crt")
    p.add_argument(
        "--interval", type=float, default=0, help="seconds between refreshes; 0: write once"
    )
    p.add_argument("--attempts", type=int, default=6, help="tries when writing once")
    p.add_argument("--timeout", type=float, default=10, help="seconds per API request")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, stop: threading.Event | None = None) -> int:
    args = parse_args(argv)
    if not args.node_name:
        log("no node name: set NODE_NAME (downward API spec.nodeName) or --node-name")
        return 2
    try:
        server = args.api_server or api_server(os.environ)
    except Failure as exc:
        log(str(exc))
        return 2
    output = Path(args.output)

    def once() -> None:
        node = fetch_node(server, args.node_name, args.token_file, args.ca_file, args.timeout)
        if write_if_changed(output, labels_text(args.node_name, node)):
            log(f"wrote the labels of node {args.node_name} to {output}")

    if args.interval <= 0:
        for attempt in range(1, max(1, args.attempts) + 1):
            try:
                once()
                return 0
            except Failure as exc:
                log(f"attempt {attempt}: {exc}")
                if attempt < args.attempts:
                    time.sleep(min(2 ** (attempt - 1), 10))
        return 1

    stop = stop or threading.Event()

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    failing = False
    while not stop.is_set():
        try:
            once()
            if failing:
                log("the API server answers again")
            failing = False
        except Failure as exc:
            if not failing:  # one line per outage; the last good file stays in place
                log(f"{exc}; keeping the last labels written")
            failing = True
        stop.wait(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
