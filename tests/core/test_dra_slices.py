"""The DRA driver's pure side: quantities, the node's ResourceSlice (validated strictly against
the Kubernetes OpenAPI schema of every version that serves resource.k8s.io/v1), claims read
from their allocation, and grants by amount through the same builder as Allocate."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from vgpu_plugin.core import cdi, dra
from vgpu_plugin.core.allocation import container_spec
from vgpu_plugin.core.config import ConfigError, parse_config
from vgpu_plugin.core.devices import MIB, PhysicalGpu
from vgpu_plugin.core.grant import Amount, InvalidRequest, grant_amounts
from vgpu_plugin.core.limits import parse_limits

GIB = 1 << 30
AAAA = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
BBBB = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
GPUS = (
    PhysicalGpu(0, AAAA, "NVIDIA A100-SXM4-40GB", 40960 * MIB, 0, "0000:07:00.0", 0),
    PhysicalGpu(1, BBBB, "NVIDIA A100-SXM4-40GB", 40960 * MIB, 1, "0000:0f:00.0", None),
)
# resource.k8s.io/v1 (with consumable capacity) is served from Kubernetes 1.34 on.
V1_VERSIONS = [v for v in ("1.34.0", "1.35.0", "1.36.0", "1.37.0")]


def k8s_validate(obj: dict[str, Any]) -> None:
    for version in V1_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("6Gi", 6 * GIB),
        ("256Mi", 256 * MIB),
        ("30", 30),
        ("1.5Gi", 3 * GIB // 2),
        ("1G", 10**9),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        (7, 7),
    ],
)
def test_quantities_parse_exactly(text: object, value: Fraction) -> None:
    assert dra.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "6 Gi", "6GB", "Gi", "1.2.3", None, True])
def test_a_bad_quantity_is_one_line(text: object) -> None:
    with pytest.raises(ValueError, match="is not a Kubernetes quantity") as err:
        dra.parse_quantity(text, "memory")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # Kubernetes keeps milli precision and rounds a finer fraction up, away from zero.
        ("0.1m", Fraction(1, 1000)),
        ("1.0001", Fraction(1001, 1000)),
        ("-1.0001", Fraction(-1001, 1000)),
        ("1n", Fraction(1, 1000)),
        ("1.5", Fraction(3, 2)),
        ("5.", 5),
        (".5", Fraction(1, 2)),
        ("+2k", 2000),
        ("2Ki", 2048),
        ("1.5Mi", 3 << 19),
        ("3E", 3 * 10**18),
        ("12e-3", Fraction(12, 1000)),
        ("1E+3", 1000),
        # ... and caps a magnitude at 2^63-1; an exponent costs nothing however large.
        ("9Ei", dra.QUANTITY_MAX),
        ("1e999999999", dra.QUANTITY_MAX),
        ("1e-999999999", Fraction(1, 1000)),
        ("0e999999999", 0),
        ("0.0000000001e50", dra.QUANTITY_MAX),
        (1 << 70, dra.QUANTITY_MAX),
    ],
)
def test_quantities_parse_as_kubernetes_parses_them(text: object, value: Fraction) -> None:
    assert dra.parse_quantity(text) == value


def test_an_overlong_quantity_is_refused_without_being_parsed() -> None:
    with pytest.raises(ValueError, match="is not a Kubernetes quantity") as err:
        dra.parse_quantity("1" * 100_000, "memory")
    assert len(str(err.value)) < 120


@pytest.mark.parametrize(
    ("consumed", "memory", "compute"),
    [
        ({"memory": "6Gi", "compute": "30"}, 6 * GIB, 30),
        # Only ever up, to the policy's minimum plus whole steps (1Gi + n x 256Mi; 1 %):
        ({"memory": "1.5", "compute": "0.1"}, GIB, 1),  # not a 2-byte limit
        ({"memory": "6Gi", "compute": "30.001"}, 6 * GIB, 31),
        ({"memory": "6442450945", "compute": "30"}, 6 * GIB + 256 * MIB, 30),
        ({"memory": "1G", "compute": "1e1"}, GIB, 10),  # 10^9 bytes: below the minimum
        ({"memory": "1.3Gi", "compute": "100"}, GIB + 512 * MIB, 100),
    ],
)
def test_consumed_capacity_rounds_only_up_to_the_policys_step(
    consumed: dict[str, str], memory: int, compute: int
) -> None:
    (d,) = dra.claim_devices(claim([{**RESULT, "consumedCapacity": consumed}]), dra.DRIVER_NAME)
    assert (d.memory_bytes, d.compute_percent) == (memory, compute)


def test_rounding_follows_the_policy_given() -> None:
    policy = dra.CapacityPolicy(default=1 << 30, minimum=1 << 30, step=1 << 30)
    body = claim([consuming(memory="1025Mi")])
    (d,) = dra.claim_devices(body, dra.DRIVER_NAME, memory=policy)
    assert d.memory_bytes == 2 << 30


def test_a_result_without_consumed_capacity_is_refused_not_the_whole_gpu() -> None:
    with pytest.raises(dra.ClaimError, match="no consumedCapacity 'memory'") as err:
        dra.claim_devices(
            claim([{k: v for k, v in RESULT.items() if k != "consumedCapacity"}]), dra.DRIVER_NAME
        )
    assert "device gpu-aaaaaaaa" in str(err.value) and "\n" not in str(err.value)


def _limit(uuid: str, memory: int, compute: int) -> Amount:
    return Amount(uuid, memory, compute)


def test_a_claim_that_fits_beside_the_prepared_ones_passes() -> None:
    totals = {"GPU-a": 16 * GIB, "GPU-b": 16 * GIB}
    prepared = [_limit("GPU-a", 10 * GIB, 60), _limit("GPU-b", 16 * GIB, 0)]
    dra.check_fits("ml/x", totals, prepared, [_limit("GPU-a", 6 * GIB, 40)])


@pytest.mark.parametrize(
    ("prepared", "new", "message"),
    [
        (
            [_limit("GPU-a", 12 * GIB, 30)],
            [_limit("GPU-a", 12 * GIB, 30)],
            "ml/x: GPU GPU-a has 16Gi of memory; prepared claims promise 12Gi and this one"
            " asks 12Gi",
        ),
        (
            [_limit("GPU-a", GIB, 70), _limit("GPU-b", 15 * GIB, 100)],
            [_limit("GPU-a", GIB, 31)],
            "GPU GPU-a has 100% of compute; prepared claims promise 70% and this one asks 31%",
        ),
        # 0 is "not limited": the whole GPU's compute, for the one holding it and the new one.
        ([_limit("GPU-a", GIB, 0)], [_limit("GPU-a", GIB, 1)], "promise 100% and this one asks 1%"),
        ([_limit("GPU-a", GIB, 1)], [_limit("GPU-a", GIB, 0)], "promise 1% and this one asks 100%"),
        # two requests of one claim on one GPU add up
        (
            [],
            [_limit("GPU-a", 9 * GIB, 1), _limit("GPU-a", 8 * GIB, 1)],
            "promise 0 and this one asks 17Gi",
        ),
    ],
)
def test_a_claim_that_would_overcommit_a_gpu_names_both_numbers(
    prepared: list[Amount], new: list[Amount], message: str
) -> None:
    totals = {"GPU-a": 16 * GIB, "GPU-b": 16 * GIB}
    with pytest.raises(dra.ClaimError, match=re.escape(message)):
        dra.check_fits("ml/x", totals, prepared, new)


def test_bytes_format_as_the_shortest_exact_binary_quantity() -> None:
    assert dra.format_bytes(16 * GIB) == "16Gi"
    assert dra.format_bytes(40960 * MIB) == "40Gi"
    assert dra.format_bytes(20389 * MIB) == "20389Mi"
    assert dra.format_bytes(1000) == "1000"


def a_slice(**kwargs: Any) -> dict[str, Any]:
    facts = dra.DeviceFacts("8.0", "535.104.05")
    return dra.resource_slice("node-a", dra.DRIVER_NAME, [(g, facts) for g in GPUS], **kwargs)


def test_the_resource_slice_is_valid_for_every_version_serving_resource_v1() -> None:
    k8s_validate(a_slice())


def test_each_gpu_is_one_shareable_device_with_typed_attributes_and_consumable_capacity() -> None:
    s = a_slice(generation=4)
    assert s["spec"]["pool"] == {"name": "node-a", "generation": 4, "resourceSliceCount": 1}
    a, b = s["spec"]["devices"]
    assert a["name"] == "gpu-aaaaaaaa-1111-2222-3333-444444444444"
    assert a["allowMultipleAllocations"] is True
    assert a["attributes"] == {
        "uuid": {"string": AAAA},
        "model": {"string": "NVIDIA A100-SXM4-40GB"},
        "index": {"int": 0},
        "memoryBytes": {"int": 40960 * MIB},
        "computeCapability": {"version": "8.0.0"},
        "driverVersion": {"string": "535.104.05"},
        "driverSemver": {"version": "535.104.5"},
        "numaNode": {"int": 0},
    }
    assert "numaNode" not in b["attributes"]  # NVML reports none: no attribute, not a guess
    for device in (a, b):
        for attr in device["attributes"].values():
            assert set(attr) <= {"bool", "int", "string", "version"}
    assert a["capacity"] == {
        "memory": {
            "value": "40Gi",
            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "256Mi"}},
        },
        "compute": {
            "value": "100",
            "requestPolicy": {
                "default": "10",
                "validRange": {"min": "1", "max": "100", "step": "1"},
            },
        },
    }


def test_request_policies_come_from_the_config() -> None:
    config = parse_config(
        "version: v1\ndra:\n  enabled: true\n  memory: {default: 2Gi, minimum: 1Gi, step: 1Gi}\n"
        "  compute: {default: 20, minimum: 5, step: 5}\n"
    )
    s = a_slice(
        memory=dra.CapacityPolicy(*config.dra.memory),
        compute=dra.CapacityPolicy(*config.dra.compute),
    )
    k8s_validate(s)
    cap = s["spec"]["devices"][0]["capacity"]
    assert cap["memory"]["requestPolicy"] == {
        "default": "2Gi",
        "validRange": {"min": "1Gi", "step": "1Gi"},
    }
    assert cap["compute"]["requestPolicy"]["default"] == "20"


def test_a_default_off_the_step_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"dra.memory.default: .* plus a multiple of step"):
        parse_config("version: v1\ndra:\n  memory: {default: 300Mi}\n")


def test_dra_gpus_select_by_uuid_or_index() -> None:
    config = parse_config("version: v1\ndra: {enabled: true, gpus: ['1']}\n")
    assert [config.dra.serves(g) for g in GPUS] == [False, True]
    assert not parse_config("version: v1\n").dra.serves(GPUS[0])  # off by default


def claim(results: list[dict[str, Any]], uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": dra.API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": "infer", "uid": uid},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "vgpu.example.com",
                            "capacity": {"requests": {"memory": "6Gi", "compute": "30"}},
                        },
                    }
                ]
            }
        },
        "status": {"allocation": {"devices": {"results": results}}},
    }


RESULT = {
    "request": "gpu",
    "driver": dra.DRIVER_NAME,
    "pool": "node-a",
    "device": "gpu-aaaaaaaa-1111-2222-3333-444444444444",
    "consumedCapacity": {"memory": "6Gi", "compute": "30"},
    "shareID": "0d5a7f6e-9c1b-4f7e-8a53-0f2b5c6d7e8f",
}


def consuming(**caps: str | None) -> dict[str, Any]:
    """RESULT with its consumedCapacity changed: a value replaces, None removes."""
    consumed = {**RESULT["consumedCapacity"], **caps}
    return {**RESULT, "consumedCapacity": {k: v for k, v in consumed.items() if v is not None}}


def test_the_claim_used_in_these_tests_is_a_valid_resource_claim() -> None:
    k8s_validate(claim([RESULT]))


def test_a_claims_devices_are_read_from_its_allocation() -> None:
    other = {**RESULT, "driver": "gpu.nvidia.com", "device": "gpu-0"}
    (d,) = dra.claim_devices(claim([RESULT, other]), dra.DRIVER_NAME, "u-1")
    assert d == dra.ClaimDevice("gpu", "node-a", RESULT["device"], 6 * GIB, 30, RESULT["shareID"])


@pytest.mark.parametrize(
    ("body", "uid", "message"),
    [
        ({**claim([RESULT]), "status": {}}, "u-1", "is not allocated"),
        (claim([RESULT]), "u-2", "is not the kubelet's"),
        (claim([{**RESULT, "driver": "x.io"}]), "u-1", "has no device of driver"),
        (claim([consuming(compute="130")]), "u-1", "outside 1..100"),
        (claim([consuming(memory="lots")]), "u-1", "not a Kubernetes"),
        (claim([consuming(memory="0")]), "u-1", "memory '0' is not positive"),
        (claim([consuming(compute="-5")]), "u-1", "compute '-5' is not positive"),
        (claim([consuming(memory=None)]), "u-1", "no consumedCapacity 'memory'"),
        (claim([consuming(compute=None)]), "u-1", "no consumedCapacity 'compute'"),
        (claim([{**RESULT, "consumedCapacity": None}]), "u-1", "no consumedCapacity 'memory'"),
    ],
)
def test_a_claim_that_cannot_be_prepared_says_why_in_one_line(
    body: dict[str, Any], uid: str, message: str
) -> None:
    with pytest.raises(dra.ClaimError, match=message) as err:
        dra.claim_devices(body, dra.DRIVER_NAME, uid)
    assert "\n" not in str(err.value)


def test_a_grant_by_amount_builds_the_same_kind_of_container_spec_as_slices() -> None:
    aid = dra.allocation_id("0d5a7f6e-9c1b-4f7e-8a53-0f2b5c6d7e8f")
    g = grant_amounts(GPUS, [Amount(AAAA, 6 * GIB, 30)], aid)
    spec = container_spec(g, "/usr/local/vgpu", "0.1.0-abc", "/tmp/vgpulock", (cdi.CDI_CRI,))
    assert spec.cdi_devices == (f"nvidia.com/gpu={AAAA}", f"vgpu-plugin/allocation={aid}")
    limits = parse_limits(spec.limits_text)
    assert [(x.uuid, x.memory_bytes, x.compute_percent) for x in limits.gpus] == [
        (AAAA, 6 * GIB, 30)
    ]
    assert spec.cdi_spec is not None
    env = spec.cdi_spec["devices"][0]["containerEdits"]["env"]
    assert "CUDA_DEVICE_MEMORY_LIMIT_0=6144m" in env and "CUDA_DEVICE_SM_LIMIT_0=30" in env


def test_amounts_on_one_gpu_add_up_and_are_checked() -> None:
    g = grant_amounts(GPUS, [Amount(BBBB, GIB, 60), Amount(BBBB, GIB, 60)], "dra-x")
    assert [(x.limit.memory_bytes, x.limit.compute_percent) for x in g.gpus] == [(2 * GIB, 100)]
    with pytest.raises(InvalidRequest, match="not one of this node's"):
        grant_amounts(GPUS, [Amount("GPU-nope", GIB, 1)], "dra-x")
    with pytest.raises(InvalidRequest, match="the GPU has"):
        grant_amounts(GPUS, [Amount(AAAA, 41 * GIB, 1)], "dra-x")
