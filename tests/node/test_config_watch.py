"""Config hot reload: valid changes applied, invalid ones refused, ConfigMap symlink swaps seen."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from vgpu_plugin.core.config import Config, ConfigError
from vgpu_plugin.node.serving.config_watch import (
    ConfigWatcher,
    NodeLabelsError,
    parse_node_labels,
)


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[Config, Mapping[str, str]]] = []

    def __call__(self, config: Config, labels: Mapping[str, str]) -> None:
        self.calls.append((config, labels))


def configmap(dir_: Path, text: str, generation: int) -> None:
    """What the kubelet does on a ConfigMap update: a new timestamped dir, ..data swapped."""
    data = dir_ / f"..2026_11_21_{generation}"
    data.mkdir()
    (data / "config.yaml").write_text(text)
    tmp = dir_ / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, dir_ / "..data")
    link = dir_ / "config.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/config.yaml")


def test_symlink_swap_is_applied(tmp_path: Path) -> None:
    configmap(tmp_path, "version: v1\nsharing: {splitCount: 4}\n", 1)
    seen = Seen()
    w = ConfigWatcher(tmp_path / "config.yaml", None, seen)
    config, _ = w.load_initial()
    assert config.sharing.split_count == 4
    assert not w.poll()
    configmap(tmp_path, "version: v1\nsharing: {splitCount: 8}\n", 2)
    assert w.poll()
    assert [c.sharing.split_count for c, _ in seen.calls] == [8]
    assert w.current is not None and w.current[0].sharing.split_count == 8
    assert w.reloads == 1


def test_invalid_config_is_refused_and_the_old_one_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nsharing: {splitCount: 4}\n")
    seen = Seen()
    w = ConfigWatcher(path, None, seen)
    w.load_initial()
    path.write_text("version: v1\nsharing: {splitCount: 0}\n")
    assert not w.poll()
    assert seen.calls == []
    assert w.current is not None and w.current[0].sharing.split_count == 4
    assert w.failures == 1
    assert "sharing.splitCount" in caplog.text and "keeping the running config" in caplog.text
    assert not w.poll(), "the same bad content is reported once, not every poll"
    path.write_text("version: v1\nsharing: {splitCount: 2}\n")
    assert w.poll() and seen.calls[-1][0].sharing.split_count == 2


def test_labels_file_change_triggers_reload(tmp_path: Path) -> None:
    path, labels = tmp_path / "config.yaml", tmp_path / "labels"
    path.write_text("version: v1\nsharing: {splitCount: 4}\n")
    labels.write_text("zone=a\n")
    seen = Seen()
    w = ConfigWatcher(path, labels, seen)
    assert w.load_initial()[1] == {"zone": "a"}
    labels.write_text("zone=b\n")
    assert w.poll()
    assert seen.calls[-1][1] == {"zone": "b"}


def test_initial_invalid_config_raises(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nsharing: {splitCount: 999}\n")
    with pytest.raises(ConfigError, match="splitCount"):
        ConfigWatcher(path, None, Seen()).load_initial()


def test_node_labels_parsing() -> None:
    text = '# written by an init container\nzone=a\n\nnvidia.com/gpu.product="H100"\n'
    assert parse_node_labels(text) == {"zone": "a", "nvidia.com/gpu.product": "H100"}
    with pytest.raises(NodeLabelsError, match="labels:2"):
        parse_node_labels("a=b\nnonsense\n", "labels")


@pytest.mark.timeout(30)  # without the fix, reading a FIFO blocks the watcher forever
def test_a_fifo_as_config_or_labels_is_refused_without_blocking(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    labels = tmp_path / "labels"
    os.mkfifo(labels)
    w = ConfigWatcher(config, labels, Seen(), interval=0.01)
    with pytest.raises(NodeLabelsError, match="not a regular file \\(a FIFO\\)"):
        w.load_initial()
    labels.unlink()
    labels.write_text("a=b\n")
    w.load_initial()
    config.unlink()
    os.mkfifo(config)
    assert not w.poll()
    assert w.failures == 1


def test_reload_of_a_file_that_is_not_utf8_is_refused_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    w = ConfigWatcher(path, None, Seen())
    w.load_initial()
    path.write_bytes(b"version: v1\n\xff")
    assert not w.poll()
    assert w.failures == 1


@pytest.mark.parametrize("target", ["missing", "dir", "loop"])
def test_a_data_swap_to_something_unreadable_is_reported_once(
    tmp_path: Path, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    configmap(tmp_path, "version: v1\nsharing: {splitCount: 4}\n", 1)
    seen = Seen()
    w = ConfigWatcher(tmp_path / "config.yaml", None, seen)
    w.load_initial()
    if target == "dir":
        (tmp_path / "dir" / "config.yaml").mkdir(parents=True)
    elif target == "loop":
        (tmp_path / "loop").mkdir()
        (tmp_path / "loop" / "config.yaml").symlink_to("config.yaml")
    tmp = tmp_path / "..data_tmp"
    tmp.symlink_to(target)
    os.replace(tmp, tmp_path / "..data")
    assert not w.poll() and not w.poll()
    assert w.failures == 1  # reported, once
    assert "keeping the running config" in caplog.text and "config.yaml" in caplog.text
    configmap(tmp_path, "version: v1\nsharing: {splitCount: 8}\n", 2)
    assert w.poll() and seen.calls[-1][0].sharing.split_count == 8


def test_an_alias_bomb_on_reload_is_refused_and_the_old_config_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from core import yaml_bombs

    configmap(tmp_path, "version: v1\nsharing: {splitCount: 4}\n", 1)
    seen = Seen()
    w = ConfigWatcher(tmp_path / "config.yaml", None, seen)
    w.load_initial()
    for generation, bomb in enumerate((yaml_bombs.COMPLEX_KEY, yaml_bombs.VALUE), start=2):
        configmap(tmp_path, bomb, generation)
        cpu = time.process_time()
        assert not w.poll()
        assert time.process_time() - cpu < 1.0  # CPU time: a loaded machine does not inflate it
    assert seen.calls == [] and w.failures == 2
    assert w.current is not None and w.current[0].sharing.split_count == 4
    assert "a key must be a plain value" in caplog.text and "aliases expand" in caplog.text
