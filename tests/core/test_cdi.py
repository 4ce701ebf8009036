"""Device list strategies and the allocation's CDI spec (docs/contracts.md#device-lists),
validated against the CDI project's own JSON schema (tests/core/data/cdi-schema)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from vgpu_plugin.core import cdi
from vgpu_plugin.core.allocation import Mount, container_spec
from vgpu_plugin.core.config import Config, Sharing
from vgpu_plugin.core.devices import MIB, PhysicalGpu, plan_node
from vgpu_plugin.core.grant import Grant, grant

AAAA = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
BBBB = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
AID = "0193ab12cd34ef56"
SCHEMA_DIR = Path(__file__).parent / "data" / "cdi-schema"
# CDI's name rules, as the CDI project's parser states them (pkg/parser), written anew here.
KIND_PART = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=_draft7())
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def _draft7() -> Any:
    from referencing.jsonschema import DRAFT7

    return DRAFT7


def a_grant(split: int = 4, scaling: float = 1.0, ids: list[str] | None = None) -> Grant:
    config = Config(sharing=Sharing(split_count=split, memory_scaling=scaling))
    gpus = [
        PhysicalGpu(i, u, "NVIDIA H100 80GB HBM3", 81559 * MIB, i, "", 0)
        for i, u in enumerate((AAAA, BBBB))
    ]
    plan = plan_node(config, gpus, "node", {})
    return grant(plan, ids or [f"{BBBB}-1", f"{AAAA}-0", f"{AAAA}-3"], AID)


@pytest.mark.parametrize(
    "strategies", [["cdi-cri"], ["cdi-annotations"], ["volume-mounts", "cdi-cri"]]
)
def test_the_cdi_spec_is_valid_and_carries_the_shim(strategies: list[str]) -> None:
    g = a_grant()
    spec = container_spec(g, "/usr/local/vgpu", "1.0", "/locks", strategies)
    legacy = container_spec(g, "/usr/local/vgpu", "1.0", "/locks", ["envvar"])
    assert spec.cdi_spec is not None
    validator().validate(spec.cdi_spec)
    assert spec.cdi_spec["kind"] == cdi.KIND
    vendor, klass = cdi.KIND.split("/")
    assert KIND_PART.match(vendor) and KIND_PART.match(klass)
    (device,) = spec.cdi_spec["devices"]
    assert device["name"] == AID and DEVICE.match(device["name"])
    edits = device["containerEdits"]
    # The same envs and mounts as the envvar response, less the device list itself.
    shim_envs = {k: v for k, v in legacy.envs.items() if k != "NVIDIA_VISIBLE_DEVICES"}
    assert edits["env"] == [f"{k}={v}" for k, v in shim_envs.items()]
    assert [(m["containerPath"], m["hostPath"], "ro" in m["options"]) for m in edits["mounts"]] == [
        (m.container_path, m.host_path, m.read_only) for m in legacy.mounts
    ]
    names = (f"nvidia.com/gpu={AAAA}", f"nvidia.com/gpu={BBBB}", f"{cdi.KIND}={AID}")
    if "cdi-cri" in strategies:
        assert spec.cdi_devices == names
    else:
        assert spec.cdi_devices == ()
    if "cdi-annotations" in strategies:
        assert spec.annotations == {f"cdi.k8s.io/vgpu-plugin_{AID}": ",".join(names)}
        (key,) = spec.annotations
        assert len(key.removeprefix("cdi.k8s.io/")) <= 63
    else:
        assert spec.annotations == {}
    # The shim is not given twice: the response carries only the device list.
    assert not any(m.container_path.startswith("/usr/local/vgpu") for m in spec.mounts)
    assert "VGPU_ALLOCATION_ID" not in spec.envs


def test_the_schema_catches_a_broken_spec() -> None:
    """The validator is not vacuous: what CDI's schema forbids fails here too."""
    spec = container_spec(a_grant(), "/r", "1", "/l", ["cdi-cri"]).cdi_spec
    assert spec is not None
    for broken in (
        {k: v for k, v in spec.items() if k != "kind"},
        {**spec, "extra": 1},
        {**spec, "devices": [{"name": AID}]},
        {**spec, "devices": [{"name": AID, "containerEdits": {"mounts": [{"hostPath": "/x"}]}}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validator().validate(broken)


def test_volume_mounts_name_each_gpu_by_a_dev_null_mount() -> None:
    spec = container_spec(a_grant(), "/r", "1", "/l", ["volume-mounts"])
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert spec.mounts[-2:] == (
        Mount(f"/var/run/nvidia-container-devices/{AAAA}", "/dev/null", True),
        Mount(f"/var/run/nvidia-container-devices/{BBBB}", "/dev/null", True),
    )
    assert spec.cdi_spec is None and spec.cdi_devices == () and spec.annotations == {}
    assert spec.envs["VGPU_ALLOCATION_ID"] == AID  # the shim still travels in the response


def test_envvar_is_todays_response() -> None:
    spec = container_spec(a_grant(), "/r", "1", "/l", ["envvar"])
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == f"{AAAA},{BBBB}"
    assert not any(m.container_path.startswith(cdi.VOLUME_MOUNTS_ROOT) for m in spec.mounts)


def test_the_default_is_volume_mounts() -> None:
    assert Config().device_list_strategy == ("volume-mounts",)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("nope", "unknown device list strategy 'nope'"),
        ("envvar,volume-mounts", "cannot be combined"),
        ([], "no device list strategy"),
    ],
)
def test_bad_strategies_are_refused_in_one_line(value: str | list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error) as exc:
        cdi.parse_strategies(value)
    assert "\n" not in str(exc.value)


def test_strategies_accept_a_comma_list_and_drop_repeats() -> None:
    assert cdi.parse_strategies("cdi-cri, cdi-annotations,cdi-cri") == (
        "cdi-cri",
        "cdi-annotations",
    )


def test_names_that_break_cdis_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="breaks CDI's rules"):
        cdi.qualified_name(cdi.KIND, "ends-with-dash-")
    with pytest.raises(ValueError, match="not <vendor>/<class>"):
        cdi.qualified_name("1vendor/class", "x")
    with pytest.raises(ValueError, match="63 characters"):
        cdi.annotation("a" * 60, ["x/y=z"])


# --- the driver's own limit (NVIDIA_GPU_MEMORY_REQUEST / _LIMIT) --------------------------


def test_driver_limit_envs_in_whole_mib_when_one_limit_fits_all() -> None:
    g = a_grant(ids=[f"{AAAA}-0", f"{BBBB}-0"])  # one slice on each: the same limit
    spec = container_spec(g, "/r", "1", "/l", ["volume-mounts"], driver_limit=True)
    assert spec.envs["NVIDIA_GPU_MEMORY_REQUEST"] == spec.envs["NVIDIA_GPU_MEMORY_LIMIT"] == "20389"
    assert spec.driver_limit == "requested"
    cdi_spec = container_spec(g, "/r", "1", "/l", ["cdi-cri"], driver_limit=True).cdi_spec
    assert cdi_spec is not None
    assert "NVIDIA_GPU_MEMORY_LIMIT=20389" in cdi_spec["devices"][0]["containerEdits"]["env"]


@pytest.mark.parametrize(
    ("g", "why"),
    [
        (a_grant(), "different limits"),  # 2 slices on A, 1 on B
        (a_grant(scaling=2.0, ids=[f"{AAAA}-0"]), "oversubscribed"),
    ],
)
def test_no_driver_limit_where_it_could_hurt(g: Grant, why: str) -> None:
    spec = container_spec(g, "/r", "1", "/l", ["volume-mounts"], driver_limit=True)
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in spec.envs
    assert "NVIDIA_GPU_MEMORY_REQUEST" not in spec.envs
    assert why in spec.driver_limit


def test_driver_limit_switched_off() -> None:
    g = a_grant(ids=[f"{AAAA}-0"])
    spec = container_spec(g, "/r", "1", "/l", ["volume-mounts"], driver_limit=False)
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in spec.envs and spec.driver_limit == "off"
    assert Config().driver_memory_limit is True
