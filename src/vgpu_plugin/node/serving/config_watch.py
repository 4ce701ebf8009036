"""Hot reload of the config file and the node-labels file.

The node label ``vgpu-plugin.io/config`` may pick a named config beside the default one
(core/named_config.py): the watcher follows whichever file the labels pick now, so a changed
label, like a changed file, is a reload; a label naming a config that is not there is refused
like an invalid file.

A ConfigMap update swaps a symlink (``..data``) rather than rewriting the file, so the watcher
compares the *content* behind the path, not the inode it once opened. A valid new config is
handed to ``on_config``; an invalid one, or a path that cannot be read (a swap to a missing
target, a directory, a loop, a FIFO), is logged once and counted, and the old one stays.
Files are read without ever blocking (``read_text_file``), so no file can stall the thread.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from vgpu_plugin.core.config import (
    Config,
    ConfigError,
    UnreadableFile,
    parse_config,
    read_text_file,
)
from vgpu_plugin.core.named_config import (
    NamedConfigError,
    config_file_for,
    missing_config,
    selected_config_name,
)
from vgpu_plugin.core.schema import clip

log = logging.getLogger(__name__)


class NodeLabelsError(ValueError):
    """A node-labels file line is not ``key=value``; the message names file and line."""


def parse_node_labels(text: str, source: str = "<labels>") -> dict[str, str]:
    """``key=value`` lines (blank lines and ``#`` comments allowed), as the downward API or an
    init container writes them; values may be quoted."""
    labels: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise NodeLabelsError(f"{source}:{number}: expected key=value, got {clip(raw)}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        labels[key.strip()] = value
    return labels


def read_node_labels(path: Path | None) -> dict[str, str]:
    """The labels in the file at ``path`` ({} for None); NodeLabelsError naming the file."""
    if path is None:
        return {}
    try:
        text = read_text_file(path)
    except UnreadableFile as exc:
        raise NodeLabelsError(f"{path}: {exc}") from None
    return parse_node_labels(text, str(path))


def _digest(path: Path | None) -> str | None:
    """What the path holds now: a hash of its content, or why it cannot be read."""
    if path is None:
        return None
    try:
        return hashlib.sha256(read_text_file(path).encode()).hexdigest()
    except UnreadableFile as exc:
        return f"unreadable: {exc}"


class ConfigWatcher:
    """Polls the config (and labels) file; calls ``on_change(config, labels)`` on a valid change.

    ``current`` always holds the last valid pair. Polling (default every second) is simple and
    survives every way a file can be replaced; the cost is one small read per interval.
    """

    def __init__(
        self,
        config_path: Path,
        labels_path: Path | None,
        on_change: Callable[[Config, Mapping[str, str]], None],
        interval: float = 1.0,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.config_path = config_path
        self.labels_path = labels_path
        self._on_change = on_change
        self._on_error = on_error
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple[str | None, ...] = (None, None)
        self.current: tuple[Config, Mapping[str, str]] | None = None
        # The file the running config came from (the default one or a named one).
        self.source: Path = config_path
        self.reloads = 0
        self.failures = 0

    def load_initial(self) -> tuple[Config, Mapping[str, str]]:
        """Read both files now; raises ConfigError/NodeLabelsError/NamedConfigError (or
        OSError) if unusable."""
        seen = self._snapshot()
        self.current, self.source = self._read()
        self._seen = seen
        return self.current

    def selected(self) -> Path:
        """The config file the node's labels pick now; NodeLabelsError/NamedConfigError."""
        labels = read_node_labels(self.labels_path)
        return config_file_for(self.config_path, selected_config_name(labels))

    def _snapshot(self) -> tuple[str | None, ...]:
        """What the labels file and the config file it picks hold now (or why not)."""
        labels = _digest(self.labels_path)
        try:
            path = self.selected()
        except (NodeLabelsError, NamedConfigError) as exc:
            return (labels, f"unusable: {exc}")
        return (labels, str(path), _digest(path))

    def _read(self) -> tuple[tuple[Config, Mapping[str, str]], Path]:
        """The labels and the config they pick, parsed, and that config's file;
        ConfigError/NodeLabelsError/NamedConfigError (or OSError) when unusable."""
        labels = read_node_labels(self.labels_path)
        name = selected_config_name(labels)
        path = config_file_for(self.config_path, name)
        try:
            text = read_text_file(path)
        except UnreadableFile as exc:
            if name is not None and not path.exists():
                raise missing_config(self.config_path, name) from None
            raise ConfigError([str(exc)], str(path)) from None
        return (parse_config(text, str(path)), labels), path

    def poll(self) -> bool:
        """Check once; True when a new valid config was applied."""
        seen = self._snapshot()
        if seen == self._seen:
            return False  # unchanged, or still the same problem (reported once)
        self._seen = seen
        try:
            (config, labels), source = self._read()
        except (ConfigError, NodeLabelsError, NamedConfigError) as exc:
            self.failures += 1
            log.error("config reload refused, keeping the running config: %s", exc)
            if self._on_error is not None:
                self._on_error(exc)
            return False
        self.current = (config, labels)
        self.source = source
        self.reloads += 1
        log.info("config reloaded from %s", source)
        self._on_change(config, labels)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="config-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception:  # keep watching whatever one poll hit
                log.exception("config watch failed")
