"""sharing.compute: guaranteed (docs/compute.md): the config, the grant, the Allocate envs and
mounts, the limits file and the allocation record carry each container's guarantee beside
its cap, in the forms the shim reads (tests/libvgpu/test_shim_guarantee.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vgpu_plugin.commands.cli import main
from vgpu_plugin.core.allocation import Mount, container_spec
from vgpu_plugin.core.config import Config, ConfigError, Sharing, parse_config
from vgpu_plugin.core.devices import MIB, GpuLimit, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.dra import ClaimError, check_fits
from vgpu_plugin.core.grant import Amount, grant, grant_amounts
from vgpu_plugin.core.limits import LimitsError, parse_limits, render_limits
from vgpu_plugin.core.placement import held_by_gpu
from vgpu_plugin.node.ledger.state import AllocationRecord
from vgpu_plugin.node.observe.metrics import ALLOCATION_FAMILIES
from vgpu_plugin.node.observe.nodeview import REGION_MISSING, RegionProblem, allocation_view

AAAA = "GPU-aaaaaaaa-1111-2222-3333-444444444444"


def plan(limit: int = 100, split: int = 4) -> NodePlan:
    gpu = PhysicalGpu(0, AAAA, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "b", 0)
    sharing = Sharing(split_count=split, compute="guaranteed", compute_limit=limit)
    return plan_node(Config(sharing=sharing), [gpu], "node", {})


def test_the_config_takes_guaranteed_and_a_compute_limit() -> None:
    config = parse_config("version: v1\nsharing: {compute: guaranteed, computeLimit: 80}\n")
    assert (config.sharing.compute, config.sharing.compute_limit) == ("guaranteed", 80)
    override = parse_config(
        "version: v1\noverrides:\n- match: {gpuModels: ['*']}\n"
        "  sharing: {compute: guaranteed, computeLimit: 60}\n"
    )
    assert override.overrides[0].apply(Sharing()).compute_limit == 60
    assert parse_config("version: v1\n").sharing.compute_limit == 100


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("sharing: {computeLimit: 0}", "sharing.computeLimit"),
        ("sharing: {computeLimit: 101}", "sharing.computeLimit"),
        ("sharing: {compute: guaranted}", "guaranteed"),
    ],
)
def test_bad_guarantee_settings_are_named(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_config(f"version: v1\n{text}\n")


def test_slices_are_the_guarantee_and_the_compute_limit_the_cap() -> None:
    g = grant(plan(limit=80), [f"{AAAA}-0", f"{AAAA}-2"], "alloc1")
    assert g.gpus[0].limit == GpuLimit(AAAA, 2 * 20389 * MIB, 80, 50)
    spec = container_spec(g, "/usr/local/vgpu", "1")
    assert spec.envs["CUDA_DEVICE_SM_LIMIT_0"] == "80"
    assert spec.envs["CUDA_DEVICE_SM_REQUEST_0"] == "50"
    # Every container's directory, read-only: where the shim sees its busy peers.
    assert Mount("/etc/vgpu/peers", "/usr/local/vgpu/containers", True) in spec.mounts
    assert spec.limits_text.endswith(f"gpu {AAAA} {2 * 20389 * MIB} 80 50\n")
    assert parse_limits(spec.limits_text).gpus == (g.gpus[0].limit,)


def test_a_guarantee_above_the_cap_is_cut_to_it() -> None:
    g = grant(plan(limit=30), [f"{AAAA}-0", f"{AAAA}-1"], "x")
    assert (g.gpus[0].limit.compute_percent, g.gpus[0].limit.compute_request) == (30, 30)


def test_other_modes_write_no_request_and_no_peers_mount() -> None:
    gpu = PhysicalGpu(0, AAAA, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "b", 0)
    config = Config(sharing=Sharing(split_count=4, compute="proportional"))
    g = grant(plan_node(config, [gpu], "node", {}), [f"{AAAA}-0"], "x")
    spec = container_spec(g, "/usr/local/vgpu", "1")
    assert not [k for k in spec.envs if k.startswith("CUDA_DEVICE_SM_REQUEST")]
    assert not [m for m in spec.mounts if m.container_path == "/etc/vgpu/peers"]
    assert render_limits(g).endswith(f"gpu {AAAA} {20389 * MIB} 25\n")


@pytest.mark.parametrize(
    "line",
    [
        f"gpu {AAAA} 1024 50 60",
        f"gpu {AAAA} 1024 0 101",
        f"gpu {AAAA} 1024 50 0",
        f"gpu {AAAA} 1024 50 x",
    ],
)
def test_a_request_above_the_cap_or_out_of_range_is_refused(line: str) -> None:
    text = f"vgpu-limits 1\nallocation a\noversubscribe 0\n{line}\n"
    with pytest.raises(LimitsError, match="sm request"):
        parse_limits(text)


def test_the_record_keeps_the_guarantee() -> None:
    limit = GpuLimit(AAAA, 4096 * MIB, 100, 25)
    record = AllocationRecord("a1", (f"{AAAA}-0",), "nvidia.com/gpu", 1.0, (limit,))
    again = AllocationRecord.from_wire(record.to_wire())
    assert again.limits == (limit,)
    plain = AllocationRecord("a2", (), "nvidia.com/gpu", 1.0, (GpuLimit(AAAA, MIB, 25),))
    assert len(plain.to_wire()["limits"][0]) == 4  # readers before the field see no change


def test_check_config_shows_the_guarantee_and_the_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nsharing: {splitCount: 4, compute: guaranteed, computeLimit: 75}\n")
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "1", "--json"]) == 0
    (gpu,) = json.loads(capsys.readouterr().out)["devicePlugin"]["gpus"]
    assert (gpu["compute"], gpu["sliceComputePercent"], gpu["computeLimit"]) == (
        "guaranteed",
        25,
        75,
    )


def test_a_dra_claims_compute_is_its_guarantee_under_a_compute_limit() -> None:
    gpu = PhysicalGpu(0, AAAA, "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, "b", 0)
    config = parse_config("version: v1\ndra: {enabled: true, computeLimit: 90}\n")
    assert config.dra.compute_limit == 90
    g = grant_amounts([gpu], [Amount(AAAA, MIB, 30)], "dra-x", config.dra.compute_limit)
    assert g.gpus[0].limit == GpuLimit(AAAA, MIB, 90, 30)
    assert container_spec(g, "/r", "1").envs["CUDA_DEVICE_SM_REQUEST_0"] == "30"
    # A claim of "all of it" (compute 0) is guaranteed all of it, up to the cap.
    whole = grant_amounts([gpu], [Amount(AAAA, MIB, 0)], "dra-y", 90)
    assert whole.gpus[0].limit.compute_request == 90
    # Unset: as before, the claim's compute is its cap.
    assert grant_amounts([gpu], [Amount(AAAA, MIB, 30)], "dra-z").gpus[0].limit == GpuLimit(
        AAAA, MIB, 30
    )


def test_what_a_guaranteed_allocation_holds_is_its_guarantee_not_its_cap() -> None:
    held = [GpuLimit(AAAA, MIB, 100, 50), GpuLimit(AAAA, MIB, 100, 25)]
    assert held_by_gpu(held)[AAAA].compute_percent == 75
    # DRA's own check: 75 % promised, a claim of 25 % fits, one of 30 % does not.
    check_fits("ns/c", {AAAA: 81559 * MIB}, held, [Amount(AAAA, MIB, 25)])
    with pytest.raises(ClaimError, match="promise 75%"):
        check_fits("ns/c", {AAAA: 81559 * MIB}, held, [Amount(AAAA, MIB, 30)])


def test_the_node_view_and_metrics_show_the_guarantee_beside_the_cap() -> None:
    limit = GpuLimit(AAAA, 4096 * MIB, 80, 25)
    record = AllocationRecord("a1", (f"{AAAA}-0",), "nvidia.com/gpu", 1.0, (limit,))
    view = allocation_view(record, RegionProblem(REGION_MISSING), None)
    (gpu,) = view.gpus
    assert (gpu.compute_guarantee, gpu.compute_limit) == (25, 80)
    values = {name: value(view, gpu) for name, _, _, value in ALLOCATION_FAMILIES}
    assert values["vgpu_container_compute_guarantee_ratio"] == 0.25
    assert values["vgpu_container_compute_limit_ratio"] == 0.8
