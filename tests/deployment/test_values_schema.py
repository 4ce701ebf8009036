"""values.schema.json: every pattern compiles under Go's regexp (real helm loads and uses it),
and its `config` part takes exactly what the plugin's own check (core/schema.py) takes, so a
config the plugin would refuse fails `helm install`, and one it takes is never refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from deployment import helm as helm_cli
from deployment.chart import CHART, Helm, HelmError, render
from vgpu_plugin.core.schema import SCHEMA, Invalid, KeySpec, children

SCHEMA_FILE = CHART / "values.schema.json"
# Config keys the chart refuses in `config` (a template says which chart value to set).
CHART_OWNED = ("resourceName", "hostRoot", "dra")


def values_schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return loaded


def patterns(node: object, at: str = "#") -> dict[str, str]:
    """Every `pattern` of the schema, by the JSON pointer of the object that holds it."""
    out: dict[str, str] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "pattern" and isinstance(v, str):
                out[at] = v
            else:
                out |= patterns(v, f"{at}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out |= patterns(v, f"{at}/{i}")
    return out


# (pointer of a pattern, values, does the chart take them): each pattern with a value it
# matches and one it does not, through real helm, whose regexp is Go's.
_TS = "config.sharing.timeSlicing.resources[0].name"


def _config(**keys: Any) -> dict[str, Any]:
    return {"config": {"version": "v1", **keys}}


def _ts(name: str) -> dict[str, Any]:
    return _config(sharing={"timeSlicing": {"resources": [{"name": name, "replicas": 2}]}})


def _named(name: str) -> dict[str, Any]:
    return {"configs": {name: {"version": "v1"}}, "nodeLabels": {"fromAPI": True}}


def _dls(value: str) -> dict[str, Any]:
    return _config(deviceListStrategy=value)


P = "#/properties"
D = "#/definitions"
PATTERN_CASES: list[tuple[str, dict[str, Any], bool]] = [
    (f"{D}/absolutePath", {"hostRoot": "/var/lib/vgpu"}, True),
    (f"{D}/absolutePath", {"hostRoot": "/var/lib\x00/vgpu"}, False),
    (f"{D}/absolutePath", {"hostRoot": "/var//lib"}, False),
    (f"{D}/dnsSubdomain", {"dra": {"deviceClass": {"name": "gpu.example.com"}}}, True),
    (f"{D}/dnsSubdomain", {"dra": {"deviceClass": {"name": "Gpu_Class"}}}, False),
    (f"{D}/size/anyOf/1", {"dra": {"claimTemplates": [{"name": "a", "memory": "10G"}]}}, True),
    (f"{D}/size/anyOf/1", {"dra": {"claimTemplates": [{"name": "a", "memory": "10GB"}]}}, False),
    (f"{D}/configResourceName", _ts("gpu"), True),
    (f"{D}/configResourceName", _ts("nvidia.com/gpu!"), False),
    (f"{D}/reservedResourceName/anyOf/0", _ts("nvidia.com/migrate"), True),
    (f"{D}/reservedResourceName/anyOf/0", _ts("nvidia.com/mig-1g.5gb"), False),
    (f"{D}/reservedResourceName/anyOf/1", _ts("kubernetes.example.com/gpu"), True),
    (f"{D}/reservedResourceName/anyOf/1", _ts("x.kubernetes.io/gpu"), False),
    (f"{D}/resourceName", {"resourceName": "nvidia.com/gpu.shared"}, True),
    (f"{D}/resourceName", {"resourceName": "gpu"}, False),
    (f"{D}/sharingKeys/compute/anyOf/2", _config(sharing={"compute": " 100 %"}), True),
    (f"{D}/sharingKeys/compute/anyOf/2", _config(sharing={"compute": "0%"}), False),
    (f"{D}/byteSize/anyOf/1", {"dra": {"memory": {"minimum": "1Gi"}}}, True),
    (f"{D}/byteSize/anyOf/1", {"dra": {"memory": {"minimum": "1G"}}}, False),
    (f"{P}/configs/propertyNames", _named("a100-80gb.v2"), True),
    (f"{P}/configs/propertyNames", _named("a100/80gb"), False),
    (f"{P}/image/properties/digest", {"image": {"digest": "sha256:" + "ab" * 32}}, True),
    (f"{P}/image/properties/digest", {"image": {"digest": "sha256:xyz"}}, False),
    (f"{P}/config/properties/deviceListStrategy/anyOf/0", _dls("cdi-cri, volume-mounts"), True),
    (f"{P}/config/properties/deviceListStrategy/anyOf/0", _dls("nvidia"), False),
    (f"{P}/config/properties/deviceListStrategy/not/anyOf/0", _dls("envvar,cdi-cri"), True),
    (f"{P}/config/properties/deviceListStrategy/not/anyOf/0", _dls("envvar,volume-mounts"), False),
    (f"{P}/config/properties/deviceListStrategy/not/anyOf/1", _dls("cdi-cri , envvar"), True),
    (
        f"{P}/config/properties/deviceListStrategy/not/anyOf/1",
        _dls("volume-mounts , envvar"),
        False,
    ),
    (f"{P}/dra/properties/driverName/allOf/1", {"dra": {"driverName": "gpu.example.com"}}, True),
    (f"{P}/dra/properties/driverName/allOf/1", {"dra": {"driverName": "gpu"}}, False),
    (
        f"{P}/dra/properties/deviceClass/properties/extendedResourceName/anyOf/1",
        {"dra": {"deviceClass": {"name": "c", "extendedResourceName": "example.com/gpu"}}},
        True,
    ),
    (
        f"{P}/dra/properties/deviceClass/properties/extendedResourceName/anyOf/1",
        {"dra": {"deviceClass": {"name": "c", "extendedResourceName": "gpu"}}},
        False,
    ),
    (
        f"{P}/dra/properties/claimTemplates/items/properties/namespace",
        {"dra": {"claimTemplates": [{"name": "a", "namespace": "ml"}]}},
        True,
    ),
    (
        f"{P}/dra/properties/claimTemplates/items/properties/namespace",
        {"dra": {"claimTemplates": [{"name": "a", "namespace": "ML"}]}},
        False,
    ),
    (
        f"{P}/metrics/properties/grafanaDashboard/properties/namespace",
        {"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}},
        True,
    ),
    (
        f"{P}/metrics/properties/grafanaDashboard/properties/namespace",
        {"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "Monitoring"}}},
        False,
    ),
]


def test_every_pattern_has_a_case_each_way() -> None:
    cases = {(at, ok) for at, _, ok in PATTERN_CASES}
    for at in patterns(values_schema()):
        assert {(at, True), (at, False)} <= cases, f"{at}: add a value it takes and one it refuses"
    assert {at for at, _ in cases} <= set(patterns(values_schema())), "a case names no pattern"


@pytest.mark.parametrize(
    ("at", "overrides", "accepted"),
    PATTERN_CASES,
    ids=[f"{at.rsplit('/properties/', 1)[-1]}-{ok}" for at, _, ok in PATTERN_CASES],
)
def test_every_pattern_works_in_real_helm(
    at: str, overrides: dict[str, Any], accepted: bool, helm: Helm
) -> None:
    # Python's jsonschema agrees, so the agreement tests below speak for Go's regexp too.
    assert jsonschema.Draft7Validator(values_schema()).is_valid(_merged(overrides)) is accepted
    if accepted:
        assert render(overrides, helm).objects
    else:
        with pytest.raises(HelmError):
            render(overrides, helm)
        with pytest.raises(HelmError, match="failed"):
            helm_cli.lint(helm, yaml.safe_dump(overrides))


def _merged(overrides: dict[str, Any]) -> dict[str, Any]:
    """The chart's values with ``overrides`` merged in as helm merges them (maps key by key)."""

    def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for k, v in top.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(values, overrides)


def test_helm_compiles_every_pattern_even_one_no_value_reaches(helm: Helm, tmp_path: Path) -> None:
    """Why a passing lint proves every pattern is Go-compatible: helm checks them all when it
    loads the schema, also those no value reaches (the \\u0000 that broke every install)."""
    chart = tmp_path / "vgpu-plugin"
    shutil.copytree(CHART, chart)
    schema = values_schema()
    schema["properties"]["image"]["properties"]["digest"]["pattern"] = "^(?!md5:)"  # Perl-only
    (chart / "values.schema.json").write_text(json.dumps(schema))
    with pytest.raises(HelmError, match=r"(?i)regex|metaschema|pattern"):
        helm_cli.template(helm, "", release="r", namespace="n", chart=chart)


# -- the config part agrees with core/schema.py ---------------------------------------------


def _config_schema() -> dict[str, Any]:
    config: dict[str, Any] = values_schema()["properties"]["config"]
    return config


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = values_schema()
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _schema_paths(node: dict[str, Any], at: str = "") -> set[str]:
    """Dotted key paths of a schema's maps (``[]`` for list items), as core/schema.py writes
    them."""
    node = _resolve(node)
    out: set[str] = set()
    if "items" in node and isinstance(node["items"], dict):
        out |= _schema_paths(node["items"], f"{at}[]")
    for key, child in node.get("properties", {}).items():
        path = f"{at}.{key}" if at else key
        out.add(path)
        out |= _schema_paths(child, path)
    return out


def _core_paths() -> set[str]:
    paths = {s.path for s in SCHEMA}
    # overrides[].sharing takes sharing's leaf keys (same_keys_as).
    for spec in SCHEMA:
        if spec.same_keys_as:
            paths |= {
                f"{spec.path}.{k}"
                for k, c in children(spec.same_keys_as).items()
                if not c.is_container
            }
    return paths


def _not_chart_owned(paths: set[str]) -> set[str]:
    return {p for p in paths if p.split(".")[0].split("[")[0] not in CHART_OWNED}


def test_the_config_schema_has_every_key_of_the_plugins_and_no_other() -> None:
    assert _not_chart_owned(_schema_paths(_config_schema())) == _not_chart_owned(_core_paths())
    assert set(_config_schema()["required"]) == {
        s.path for s in SCHEMA if s.required and "." not in s.path
    }


def _subschema(path: str) -> dict[str, Any]:
    node = _config_schema()
    for part in path.split("."):
        name, _, rest = part.partition("[]")
        node = _resolve(_resolve(node)["properties"][name])
        if rest == "" and part.endswith("[]"):
            node = _resolve(node)["items"]
    return {**node, "definitions": values_schema()["definitions"]}


# Values every config key is tried with; each key's rule picks which it takes.
SAMPLES: list[object] = [
    None, True, False, 0, 1, -1, 10, 100, 101, 256, 257, 1.5, 0.0, -0.5,
    "", "x", "v1", "v2", "none", "proportional", "30", "30%", " 30 % ", "0%", "100%", "101%",
    "binpack", "spread", "all", "uuid", "index", "single", "mixed",
    "envvar", "volume-mounts", "cdi-cri", "cdi-annotations", "envvar,cdi-cri",
    "envvar, volume-mounts", "volume-mounts,envvar", "envvar,nope", ",",
    [], ["envvar"], ["envvar", "volume-mounts"], ["cdi-cri", "cdi-annotations"], ["x"],
    ["a"], [""], [1], [-1], [13, 31], [True],
    {}, {"a": "b"}, {"a": 1}, {"": "b"},
    "nvidia.com/gpu", "gpu", "nvidia.com/mig-1g.5gb", "MIG-x", "Example.com/gpu",
    "x.kubernetes.io/gpu", "kubernetes.io/gpu", "a/b/c", "/abs/path", "1Gi", "256Mi",
]  # fmt: skip

# Where the schema knowingly differs from the plugin's check, and why that is harmless.
KNOWN: dict[tuple[str, str], str] = {}


def _leaves() -> list[KeySpec]:
    return [
        s
        for s in SCHEMA
        if not s.is_container and s.path.split(".")[0].split("[")[0] not in CHART_OWNED
    ]


@pytest.mark.parametrize("spec", _leaves(), ids=lambda s: s.path)
def test_each_config_key_takes_what_the_plugin_takes(spec: KeySpec) -> None:
    validator = jsonschema.Draft7Validator(_subschema(spec.path))
    assert spec.check is not None
    disagree = []
    for sample in SAMPLES:
        try:
            spec.check(sample)
            plugin = True
        except Invalid:
            plugin = False
        if validator.is_valid(sample) != plugin and (spec.path, repr(sample)) not in KNOWN:
            disagree.append(f"{sample!r}: plugin {'takes' if plugin else 'refuses'} it")
    assert disagree == []


def test_the_agreement_check_sees_a_difference() -> None:
    spec = next(s for s in SCHEMA if s.path == "sharing.splitCount")
    loose = jsonschema.Draft7Validator({"type": "integer", "minimum": 0, "maximum": 256})
    assert spec.check is not None
    with pytest.raises(Invalid):
        spec.check(0)
    assert loose.is_valid(0)  # what the test above reports as a disagreement
