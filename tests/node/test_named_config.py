"""Per-node config by node label: ``vgpu-plugin.io/config=<name>`` picks ``<name>.yaml`` beside
``config.yaml``; a changed label is a reload; a missing or unusable name is one line and the
running config stays (at start: exit 2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from vgpu_plugin.core.config import Config, default_config
from vgpu_plugin.core.named_config import (
    CONFIG_LABEL,
    NamedConfigError,
    config_file_for,
    selected_config_name,
)
from vgpu_plugin.node.serving.config_watch import ConfigWatcher


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[Config, Mapping[str, str]]] = []

    def __call__(self, config: Config, labels: Mapping[str, str]) -> None:
        self.calls.append((config, labels))


def configmap(dir_: Path, files: Mapping[str, str], generation: int) -> None:
    """The kubelet's ConfigMap update: a new timestamped dir holding every key, ..data
    swapped, one top-level link per key."""
    data = dir_ / f"..2026_11_27_{generation}"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    tmp = dir_ / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, dir_ / "..data")
    for name in files:
        link = dir_ / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")


def split(n: int) -> str:
    return f"version: v1\nsharing: {{splitCount: {n}}}\n"


@pytest.mark.parametrize(
    ("labels", "name"),
    [({}, None), ({CONFIG_LABEL: ""}, None), ({CONFIG_LABEL: "a100-80gb"}, "a100-80gb"),
     ({CONFIG_LABEL: "big.v2_x"}, "big.v2_x"), ({"other": "x"}, None)],
)  # fmt: skip
def test_the_label_picks_a_name_or_the_default(labels: dict[str, str], name: str | None) -> None:
    assert selected_config_name(labels) == name
    assert config_file_for(Path("/etc/v/config.yaml"), name) == (
        Path("/etc/v/config.yaml") if name is None else Path(f"/etc/v/{name}.yaml")
    )


@pytest.mark.parametrize("value", ["../etc/passwd", "a/b", ".hidden", "..", "x-", "a" * 64, "a b"])
def test_a_label_value_that_is_no_config_name_is_refused(value: str) -> None:
    with pytest.raises(NamedConfigError, match=f"node label {CONFIG_LABEL}=.*not a config name"):
        selected_config_name({CONFIG_LABEL: value})


def test_the_label_picks_the_named_config_and_a_changed_label_reloads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    configmap(conf, {"config.yaml": split(2), "big.yaml": split(8), "small.yaml": split(3)}, 1)
    labels = tmp_path / "labels"
    labels.write_text(f"zone=a\n{CONFIG_LABEL}=big\n")
    seen = Seen()
    w = ConfigWatcher(conf / "config.yaml", labels, seen)
    config, got = w.load_initial()
    assert config.sharing.split_count == 8
    assert got[CONFIG_LABEL] == "big" and w.source == conf / "big.yaml"
    assert not w.poll()
    caplog.set_level("INFO")
    labels.write_text(f"zone=a\n{CONFIG_LABEL}=small\n")
    assert w.poll()
    assert seen.calls[-1][0].sharing.split_count == 3
    assert f"config reloaded from {conf / 'small.yaml'}" in caplog.text
    labels.write_text("zone=a\n")  # label removed: back to the default
    assert w.poll()
    assert seen.calls[-1][0].sharing.split_count == 2 and w.source == conf / "config.yaml"


def test_an_edit_of_the_picked_config_reloads_and_one_of_another_does_not(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    configmap(conf, {"config.yaml": split(2), "big.yaml": split(8)}, 1)
    labels = tmp_path / "labels"
    labels.write_text(f"{CONFIG_LABEL}=big\n")
    seen = Seen()
    w = ConfigWatcher(conf / "config.yaml", labels, seen)
    w.load_initial()
    configmap(conf, {"config.yaml": split(5), "big.yaml": split(8)}, 2)
    assert not w.poll()  # the default changed; this node runs "big", which did not
    configmap(conf, {"config.yaml": split(5), "big.yaml": split(16)}, 3)
    assert w.poll()
    assert [c.sharing.split_count for c, _ in seen.calls] == [16]


def test_a_label_naming_a_missing_config_is_one_line_and_the_old_config_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    configmap(conf, {"config.yaml": split(2), "big.yaml": split(8)}, 1)
    labels = tmp_path / "labels"
    labels.write_text(f"{CONFIG_LABEL}=big\n")
    seen = Seen()
    w = ConfigWatcher(conf / "config.yaml", labels, seen)
    w.load_initial()
    labels.write_text(f"{CONFIG_LABEL}=huge\n")
    assert not w.poll()
    assert not w.poll()  # the same problem is reported once
    refusals = [r for r in caplog.records if "reload refused" in r.getMessage()]
    assert len(refusals) == 1
    line = refusals[0].getMessage()
    assert "\n" not in line
    assert f"node label {CONFIG_LABEL}=huge: no config file {conf / 'huge.yaml'}" in line
    assert w.failures == 1 and not seen.calls
    assert w.current is not None and w.current[0].sharing.split_count == 8
    assert w.source == conf / "big.yaml"
    # The ConfigMap gains the key: the node follows its label without a restart.
    configmap(conf, {"config.yaml": split(2), "big.yaml": split(8), "huge.yaml": split(32)}, 2)
    assert w.poll()
    assert seen.calls[-1][0].sharing.split_count == 32


def test_a_label_value_that_is_no_name_is_refused_on_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.yaml").write_text(split(2))
    labels = tmp_path / "labels"
    labels.write_text("")
    w = ConfigWatcher(tmp_path / "config.yaml", labels, Seen())
    w.load_initial()
    labels.write_text(f"{CONFIG_LABEL}=../x\n")
    assert not w.poll()
    assert "not a config name" in caplog.text and w.failures == 1


def _start(tmp_path: Path, config: Path, labels: Path) -> str:
    from vgpu_plugin.commands import serve
    from vgpu_plugin.commands.settings import settings_from

    settings = settings_from(
        argparse.Namespace(config=str(config), node_labels_file=str(labels)), {}
    )
    watcher = ConfigWatcher(settings.config, settings.node_labels_file, Seen())
    try:
        loaded, _ = serve._load_config(settings, watcher)
    except serve.StartupError as exc:
        assert exc.code == serve.EXIT_CONFIG
        return str(exc)
    return f"split {loaded.sharing.split_count}"


def test_serve_starts_with_the_named_config_and_refuses_a_missing_one(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    labels = tmp_path / "labels"
    (tmp_path / "big.yaml").write_text(split(8))
    labels.write_text(f"{CONFIG_LABEL}=big\n")
    # The named config is used even where no default config.yaml exists.
    assert _start(tmp_path, config, labels) == "split 8"
    labels.write_text(f"{CONFIG_LABEL}=huge\n")
    assert _start(tmp_path, config, labels) == (
        f"node label {CONFIG_LABEL}=huge: no config file {tmp_path / 'huge.yaml'} "
        "(with the chart: no key 'huge' under its configs value)"
    )
    (tmp_path / "bad.yaml").write_text("version: v1\nsharing: {splitCount: 0}\n")
    labels.write_text(f"{CONFIG_LABEL}=bad\n")
    assert _start(tmp_path, config, labels).startswith(f"config {tmp_path / 'bad.yaml'} is invalid")
    labels.write_text("")
    assert (
        _start(tmp_path, config, labels) == f"split {default_config().sharing.split_count}"
    )  # the defaults


def test_check_config_checks_the_file_the_label_picks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vgpu_plugin.commands.cli import main

    (tmp_path / "config.yaml").write_text(split(2))
    (tmp_path / "big.yaml").write_text(split(8))
    labels = tmp_path / "labels"
    labels.write_text(f"{CONFIG_LABEL}=big\n")
    argv = ["check-config", str(tmp_path / "config.yaml"), "--no-nvml", "--node-labels-file",
            str(labels), "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert f'"file": "{tmp_path / "big.yaml"}"' in out.out
    assert f"node label {CONFIG_LABEL}=big: checking {tmp_path / 'big.yaml'}" in out.err
    labels.write_text(f"{CONFIG_LABEL}=huge\n")
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert f"node label {CONFIG_LABEL}=huge: no config file {tmp_path / 'huge.yaml'}" in line
