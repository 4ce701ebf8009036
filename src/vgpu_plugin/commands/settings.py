"""``serve`` settings: every flag has an environment variable (docs/contracts.md#serve-flags).

The other commands take the flags they share with ``serve`` from here too (:func:`add_shared_flag`),
so a flag, its variable and its default are written once."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.api.constants import DEVICE_PLUGIN_PATH, POD_RESOURCES_SOCKET
from vgpu_plugin.core import cdi, defaults


@dataclass(frozen=True)
class Flag:
    name: str
    env: str
    default: str | None
    help: str


FLAGS: tuple[Flag, ...] = (
    Flag("config", "VGPU_CONFIG", defaults.CONFIG_PATH, "config file (YAML)"),
    Flag(
        "device-plugin-dir",
        "VGPU_DEVICE_PLUGIN_DIR",
        DEVICE_PLUGIN_PATH,
        "the kubelet's device-plugin socket dir",
    ),
    Flag(
        "pod-resources-socket",
        "VGPU_POD_RESOURCES_SOCKET",
        POD_RESOURCES_SOCKET,
        "the kubelet's pod-resources socket",
    ),
    Flag(
        "host-root",
        "VGPU_HOST_ROOT",
        None,
        "host dir of the shim, limits and container dirs (default: the config's hostRoot, "
        f"{defaults.HOST_ROOT})",
    ),
    Flag("state-dir", "VGPU_STATE_DIR", defaults.STATE_DIR, "allocation records"),
    Flag("lock-dir", "VGPU_LOCK_DIR", defaults.LOCK_DIR, "node-wide per-GPU lock dir"),
    Flag(
        "cdi-spec-dir",
        "VGPU_CDI_SPEC_DIR",
        cdi.SPEC_DIR,
        "where the CDI specs of allocations are written (CDI device list strategies)",
    ),
    Flag("node-name", "NODE_NAME", None, "this node's name (default: the host name)"),
    Flag(
        "node-labels-file",
        "VGPU_NODE_LABELS_FILE",
        None,
        "node labels as key=value lines, for config overrides",
    ),
    Flag(
        "metrics-address",
        "VGPU_METRICS_ADDRESS",
        defaults.METRICS_ADDRESS,
        "Prometheus metrics address",
    ),
    Flag(
        "cleanup-grace",
        "VGPU_CLEANUP_GRACE",
        "60",
        "seconds an allocation no pod holds is kept before its files are removed",
    ),
    Flag(
        "gputime-interval",
        "VGPU_GPUTIME_INTERVAL",
        "0.2",
        "seconds between readings of the driver's per-process GPU time, published to each "
        "guaranteed container (0: not read)",
    ),
    Flag("log-format", "VGPU_LOG_FORMAT", "text", "text or json"),
    Flag("log-level", "VGPU_LOG_LEVEL", "info", "error, warning, info or debug"),
)


@dataclass(frozen=True)
class ServeSettings:
    config: Path
    device_plugin_dir: Path
    pod_resources_socket: Path
    host_root: str | None
    state_dir: Path
    lock_dir: str
    cdi_spec_dir: str
    node_name: str
    node_labels_file: Path | None
    metrics_address: str
    cleanup_grace: float
    log_format: str
    log_level: str
    gputime_interval: float = 0.2


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for f in FLAGS:
        default = f" (default: {f.default})" if f.default else ""
        parser.add_argument(f"--{f.name}", help=f"{f.help}; env {f.env}{default}")


def add_shared_flag(
    parser: argparse.ArgumentParser, name: str, help: str, default: str | None = None
) -> None:
    """One of serve's flags on another command, with serve's variable; ``default`` where serve
    has none of its own (``--host-root``: serve falls back to the config's hostRoot)."""
    f = next(f for f in FLAGS if f.name == name)
    parser.add_argument(
        f"--{name}",
        default=os.environ.get(f.env) or f.default or default,
        help=f"{help}; env {f.env} (default: %(default)s)",
    )


def settings_from(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServeSettings:
    """Flag, else environment variable, else default."""
    env = os.environ if environ is None else environ
    values: dict[str, str | None] = {}
    for f in FLAGS:
        given = getattr(args, f.name.replace("-", "_"), None)
        values[f.name] = given if given is not None else env.get(f.env) or f.default
    labels = values["node-labels-file"]
    return ServeSettings(
        config=Path(str(values["config"])),
        device_plugin_dir=Path(str(values["device-plugin-dir"])),
        pod_resources_socket=Path(str(values["pod-resources-socket"])),
        host_root=values["host-root"],
        state_dir=Path(str(values["state-dir"])),
        lock_dir=str(values["lock-dir"]),
        cdi_spec_dir=str(values["cdi-spec-dir"]),
        node_name=values["node-name"] or socket.gethostname(),
        node_labels_file=Path(labels) if labels else None,
        metrics_address=str(values["metrics-address"]),
        cleanup_grace=_seconds(str(values["cleanup-grace"]), "--cleanup-grace"),
        log_format=str(values["log-format"]),
        log_level=str(values["log-level"]),
        gputime_interval=_seconds(str(values["gputime-interval"]), "--gputime-interval"),
    )


def _seconds(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise SystemExit(f"{what}: expected a number of seconds >= 0, got {text!r}")
    return value
