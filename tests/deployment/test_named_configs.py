"""The chart's `configs`: named configs beside `config` in the one ConfigMap, each a config the
plugin takes, with the chart's resourceName and dra in every one, and the node label
`vgpu-plugin.io/config` picking one on the node (through the plugin's own watcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deployment import k8s
from deployment.chart import Helm, HelmError, render
from vgpu_plugin.core.config import parse_config
from vgpu_plugin.core.named_config import CONFIG_LABEL
from vgpu_plugin.node.serving.config_watch import ConfigWatcher

LABELS = {"nodeLabels": {"fromAPI": True}}
BIG = {"version": "v1", "sharing": {"splitCount": 16, "compute": "proportional"}}


def _values(**more: Any) -> dict[str, Any]:
    return {**LABELS, "configs": {"a100-80gb": BIG}, **more}


def test_each_named_config_is_a_file_of_the_configmap_the_plugin_takes(helm: Helm) -> None:
    r = render(_values(config={"version": "v1", "sharing": {"splitCount": 4}}), helm)
    cm = r.one("ConfigMap")
    k8s.validate(cm)
    assert set(cm["data"]) == {"config.yaml", "a100-80gb.yaml"}
    default = parse_config(cm["data"]["config.yaml"])
    named = parse_config(cm["data"]["a100-80gb.yaml"], "a100-80gb.yaml")
    assert default.sharing.split_count == 4
    assert named.sharing.split_count == 16
    # The chart's own values are written into every config, not only the default one.
    assert named.resource_name == default.resource_name == "nvidia.com/gpu"
    assert not named.dra.enabled


def test_the_chart_writes_its_dra_values_into_named_configs_too(helm: Helm) -> None:
    r = render(_values(dra={"enabled": True, "gpus": ["1"]}, resourceName="example.com/vgpu"), helm)
    named = parse_config(r.one("ConfigMap")["data"]["a100-80gb.yaml"])
    assert named.dra.enabled and named.dra.gpus == ("1",)
    assert named.resource_name == "example.com/vgpu"


def test_the_node_label_picks_the_rendered_config_on_the_node(helm: Helm, tmp_path: Path) -> None:
    data = render(_values(), helm).one("ConfigMap")["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    labels = tmp_path / "labels"
    labels.write_text(f"{CONFIG_LABEL}=a100-80gb\n")
    watcher = ConfigWatcher(tmp_path / "config.yaml", labels, lambda c, n: None)
    config, _ = watcher.load_initial()
    assert config.sharing.split_count == 16
    labels.write_text("kubernetes.io/hostname=gpu-7\n")
    assert watcher.poll()
    assert watcher.current is not None and watcher.current[0].sharing.split_count == 10


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"configs": {"a": BIG}}, "configs: a node picks one by its label vgpu-plugin.io/config"),
        (
            {**LABELS, "configs": {"a": {**BIG, "resourceName": "x.com/y"}}},
            "configs.a.resourceName: set the chart's resourceName value instead",
        ),
        # "config" would replace config.yaml.
        ({**LABELS, "configs": {"config": BIG}}, r"(?i)property ?name (of )?['\"]config['\"]"),
        ({**LABELS, "configs": {"../a": BIG}}, r"(?i)property ?name (of )?['\"]\.\./a['\"]"),
        (
            {**LABELS, "configs": {"a": {"version": "v1", "sharing": {"splitCount": 0}}}},
            "configs.a.sharing.splitCount",
        ),
        ({**LABELS, "configs": {"a": {"sharing": {"splitCount": 2}}}}, "configs.a.*version"),
    ],
    ids=[
        "no-label-source",
        "chart-owned-key",
        "named-config",
        "bad-name",
        "bad-value",
        "no-version",
    ],
)
def test_the_chart_refuses_named_configs_that_would_not_work(
    values: dict[str, Any], message: str, helm: Helm
) -> None:
    with pytest.raises(HelmError, match=message):
        render(values, helm)


def test_the_docs_name_the_label_and_the_line_the_plugin_writes() -> None:
    from vgpu_plugin.core.named_config import missing_config

    doc = " ".join((Path(__file__).parents[2] / "docs" / "configuration.md").read_text().split())
    line = str(missing_config(Path("/d/config.yaml"), "NAME"))
    assert f"{CONFIG_LABEL}=<name>" in doc
    assert line.split(":")[0].replace("NAME", "<name>") in doc  # "node label ...=<name>"
    assert "no config file <dir>/<name>.yaml" in doc and "no config file /d/NAME.yaml" in line
