"""The schema table is the one truth about the config's keys: the validator must agree with it."""

from __future__ import annotations

import pytest
import yaml

from vgpu_plugin.core.config import Config, default_config, parse_config
from vgpu_plugin.core.schema import SCHEMA, KeySpec, children

# Where each defaulted leaf lands in Config: the test's own view, so a drift shows up here.
CONFIG_FIELD = {
    "resourceName": lambda c: c.resource_name,
    "sharing.splitCount": lambda c: c.sharing.split_count,
    "sharing.memoryScaling": lambda c: c.sharing.memory_scaling,
    "sharing.compute": lambda c: c.sharing.compute,
    "sharing.computeLimit": lambda c: c.sharing.compute_limit,
    "sharing.placement": lambda c: c.sharing.placement,
    "overrides": lambda c: c.overrides,
    "hostRoot": lambda c: c.host_root,
    "health.ignoredXids": lambda c: c.health.ignored_xids,
    "health.recoverySeconds": lambda c: c.health.recovery_seconds,
    "deviceListStrategy": lambda c: c.device_list_strategy,
    "driverMemoryLimit": lambda c: c.driver_memory_limit,
    "flags.failOnInitError": lambda c: c.fail_on_init_error,
    "dra.enabled": lambda c: c.dra.enabled,
    "dra.driverName": lambda c: c.dra.driver_name,
    "dra.gpus": lambda c: c.dra.gpus,
    "dra.memory.default": lambda c: c.dra.memory[0],
    "dra.memory.minimum": lambda c: c.dra.memory[1],
    "dra.memory.step": lambda c: c.dra.memory[2],
    "dra.compute.default": lambda c: c.dra.compute[0],
    "dra.compute.minimum": lambda c: c.dra.compute[1],
    "dra.compute.step": lambda c: c.dra.compute[2],
}


def test_paths_are_unique_and_every_parent_is_a_container() -> None:
    paths = [spec.path for spec in SCHEMA]
    assert len(paths) == len(set(paths))
    by_path = {spec.path: spec for spec in SCHEMA}
    for spec in SCHEMA:
        if spec.parent:
            parent = by_path[spec.parent.removesuffix("[]")]
            assert parent.is_container, spec.path
            assert parent.type == ("list of maps" if spec.parent.endswith("[]") else "map")


def test_every_key_is_documented() -> None:
    for spec in SCHEMA:
        assert spec.type and spec.description.endswith("."), spec.path


@pytest.mark.parametrize(
    "spec", [s for s in SCHEMA if s.path in CONFIG_FIELD], ids=lambda s: s.path
)
def test_schema_defaults_are_the_config_defaults(spec: KeySpec) -> None:
    assert CONFIG_FIELD[spec.path](default_config()) == spec.default


def test_every_defaulted_setting_has_its_config_field() -> None:
    defaulted = {
        s.path
        for s in SCHEMA
        if s.default is not None and not s.path.startswith(("sharing.timeSlicing", "overrides["))
    }
    assert defaulted == set(CONFIG_FIELD)


@pytest.mark.parametrize("spec", [s for s in SCHEMA if not s.is_container], ids=lambda s: s.path)
def test_each_leaf_default_passes_its_own_check(spec: KeySpec) -> None:
    assert spec.check is not None
    if spec.default is not None:
        default = list(spec.default) if isinstance(spec.default, tuple) else spec.default
        cleaned = spec.check(default)
        assert (tuple(cleaned) if isinstance(cleaned, tuple) else cleaned) == spec.default


def test_a_file_written_from_the_schema_defaults_parses_to_the_default_config() -> None:
    tree: dict[str, object] = {"version": "v1"}  # required, so it has no default
    for spec in SCHEMA:
        if spec.path not in CONFIG_FIELD or spec.is_container:
            continue
        node = tree
        *parents, key = spec.path.split(".")
        for parent in parents:
            child = node.setdefault(parent, {})
            assert isinstance(child, dict)
            node = child
        node[key] = list(spec.default) if isinstance(spec.default, tuple) else spec.default
    assert parse_config(yaml.safe_dump(tree)) == Config()


def test_override_sharing_accepts_exactly_the_plain_sharing_keys() -> None:
    leaves = {k for k, s in children("sharing").items() if not s.is_container}
    assert leaves == {"splitCount", "memoryScaling", "compute", "placement", "computeLimit"}
    text = (
        "version: v1\noverrides: [{match: {nodeNames: [a]}, sharing: {splitCount: 2,"
        " memoryScaling: 2, compute: 5, placement: spread, computeLimit: 90}}]\n"
    )
    assert len(parse_config(text).overrides[0].sharing) == len(leaves)


def test_default_text_reads_back_as_the_default() -> None:
    for spec in SCHEMA:
        if spec.default is None:
            assert spec.default_text == ""
            continue
        loaded = yaml.safe_load(spec.default_text)
        expected = list(spec.default) if isinstance(spec.default, tuple) else spec.default
        assert loaded == expected, spec.path
    assert {s.path: s.default_text for s in SCHEMA}["health.ignoredXids"] == (
        "[13, 31, 43, 45, 68, 109]"
    )
