"""Per-node config chosen by a node label (NVIDIA's plugin does it with
``nvidia.com/device-plugin.config``): the directory of the config file may hold named configs,
``<name>.yaml`` beside ``config.yaml``, and the node label ``vgpu-plugin.io/config=<name>``
picks one; a node without the label (or with it empty) runs ``config.yaml``.

Kept apart from core/config.py: choosing a file is not parsing one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from vgpu_plugin.core.schema import clip

CONFIG_LABEL = "vgpu-plugin.io/config"

# A label value (at most 63 characters, alphanumeric at both ends) that is also a ConfigMap key
# and a plain file name: no '/', never '.' or '..'.
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?\Z")


class NamedConfigError(ValueError):
    """The node label names no usable config; the message names the label and the file."""


def selected_config_name(labels: Mapping[str, str]) -> str | None:
    """The name the node's labels pick, or None for the default config."""
    value = labels.get(CONFIG_LABEL, "")
    if value == "":
        return None
    if not _NAME.match(value):
        raise NamedConfigError(
            f"node label {CONFIG_LABEL}={clip(value)}: not a config name (1-63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit)"
        )
    return value


def config_file_for(default: Path, name: str | None) -> Path:
    """The file of config ``name``: ``<name>.yaml`` beside the default config file."""
    return default if name is None else default.with_name(f"{name}.yaml")


def missing_config(default: Path, name: str) -> NamedConfigError:
    """The one line for a label that names a config the directory lacks."""
    return NamedConfigError(
        f"node label {CONFIG_LABEL}={name}: no config file {config_file_for(default, name)} "
        f"(with the chart: no key {name!r} under its configs value)"
    )
