"""Merging slices per GPU and the Allocate response (docs/contracts.md#allocate-response)."""

from __future__ import annotations

import random
import re
import time

import pytest

from vgpu_plugin.core.allocation import Mount, container_spec
from vgpu_plugin.core.config import Config, Match, Override, Sharing
from vgpu_plugin.core.devices import MIB, GpuLimit, NodePlan, PhysicalGpu, plan_node
from vgpu_plugin.core.grant import InvalidRequest, grant, new_allocation_id
from vgpu_plugin.core.limits import Limits, LimitsError, limits_of, parse_limits, render_limits

AAAA = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
BBBB = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def h100(index: int, uuid: str) -> PhysicalGpu:
    return PhysicalGpu(index, uuid, "NVIDIA H100 80GB HBM3", 81559 * MIB, index, "b", index)


def design_plan(compute: str | int = "proportional") -> NodePlan:
    """docs/contracts.md#worked-example: two 80 GB GPUs, splitCount 4, proportional compute."""
    config = Config(sharing=Sharing(split_count=4, memory_scaling=1.0, compute=compute))
    # Discovery order must not matter: B is listed first on purpose.
    return plan_node(config, [h100(1, BBBB), h100(0, AAAA)], "node", {})


def test_design_example_exactly() -> None:
    plan = design_plan()
    # The kubelet's order puts GPU B first; the response still lists GPUs physically.
    g = grant(plan, [f"{BBBB}-1", f"{AAAA}-0", f"{AAAA}-3"], "0193ab12cd34ef56")
    spec = container_spec(g, "/usr/local/vgpu", "0.1.0")
    assert spec.envs == {
        "NVIDIA_VISIBLE_DEVICES": f"{AAAA},{BBBB}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "40778m",
        "CUDA_DEVICE_SM_LIMIT_0": "50",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "20389m",
        "CUDA_DEVICE_SM_LIMIT_1": "25",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/vgpu/0193ab12cd34ef56.cache",
        "CUDA_OVERSUBSCRIBE": "false",
        "VGPU_ALLOCATION_ID": "0193ab12cd34ef56",
    }
    assert spec.mounts == (
        Mount("/etc/vgpu/libvgpu.so", "/usr/local/vgpu/lib/libvgpu.so.0.1.0", True),
        Mount("/etc/ld.so.preload", "/usr/local/vgpu/ld.so.preload", True),
        Mount("/etc/vgpu/limits", "/usr/local/vgpu/limits/0193ab12cd34ef56", True),
        Mount("/tmp/vgpu", "/usr/local/vgpu/containers/0193ab12cd34ef56", False),
        Mount("/tmp/vgpulock", "/tmp/vgpulock", False),
    )
    # A pod may mount a read-only volume at /usr: no mount point of ours may lie under it,
    # or the runtime cannot create it and the container never starts (issue 14, item 12).
    assert not [m.container_path for m in spec.mounts if m.container_path.startswith("/usr/")]
    # The shim is found through ld.so.preload, which names it (install-shim writes it).
    assert spec.mounts[0].container_path == "/etc/vgpu/libvgpu.so"
    assert spec.limits_path == "/usr/local/vgpu/limits/0193ab12cd34ef56"
    assert spec.allocation_dir == "/usr/local/vgpu/containers/0193ab12cd34ef56"
    assert spec.limits_text == (
        "vgpu-limits 1\n"
        "allocation 0193ab12cd34ef56\n"
        "oversubscribe 0\n"
        f"gpu {AAAA} {40778 * MIB} 50\n"
        f"gpu {BBBB} {20389 * MIB} 25\n"
    )


def test_grant_merges_slices_of_one_gpu() -> None:
    g = grant(design_plan(), [f"{AAAA}-3", f"{AAAA}-1"], "x")
    (only,) = g.gpus
    assert only.gpu.uuid == AAAA
    assert only.slice_ids == (f"{AAAA}-1", f"{AAAA}-3")
    assert (only.limit.memory_mib, only.limit.compute_percent) == (2 * 20389, 50)
    assert only.limit.memory_bytes == 2 * 20389 * MIB
    assert g.device_ids == (f"{AAAA}-1", f"{AAAA}-3")


def test_uniform_compute_also_sets_the_index_less_variable() -> None:
    g = grant(design_plan(), [f"{AAAA}-0", f"{BBBB}-0"], "x")
    envs = container_spec(g, "/usr/local/vgpu", "1").envs
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert envs["CUDA_DEVICE_SM_LIMIT_0"] == envs["CUDA_DEVICE_SM_LIMIT_1"] == "25"


def test_unlimited_compute_is_zero_everywhere() -> None:
    g = grant(design_plan(compute="none"), [f"{AAAA}-0", f"{AAAA}-1"], "x")
    envs = container_spec(g, "/usr/local/vgpu", "1").envs
    assert g.gpus[0].limit.compute_percent == 0
    assert (envs["CUDA_DEVICE_SM_LIMIT_0"], envs["CUDA_DEVICE_SM_LIMIT"]) == ("0", "0")


def test_compute_is_capped_at_100() -> None:
    g = grant(design_plan(compute=60), [f"{AAAA}-0", f"{AAAA}-1"], "x")
    assert g.gpus[0].limit.compute_percent == 100


def test_oversubscribed_iff_some_granted_gpu_scales_memory_above_one() -> None:
    config = Config(
        sharing=Sharing(split_count=4),
        overrides=(Override(Match(gpu_uuids=(BBBB,)), {"memory_scaling": 2.0}),),
    )
    plan = plan_node(config, [h100(0, AAAA), h100(1, BBBB)], "n", {})
    on_a = container_spec(grant(plan, [f"{AAAA}-0"], "x"), "/r", "1")
    on_b = container_spec(grant(plan, [f"{AAAA}-0", f"{BBBB}-0"], "x"), "/r", "1")
    assert on_a.envs["CUDA_OVERSUBSCRIBE"] == "false"
    assert on_b.envs["CUDA_OVERSUBSCRIBE"] == "true"
    assert "oversubscribe 1\n" in on_b.limits_text
    assert on_b.envs["CUDA_DEVICE_MEMORY_LIMIT_1"] == f"{81559 * 2 // 4}m"


def test_host_root_and_lock_dir_are_configurable() -> None:
    g = grant(design_plan(), [f"{AAAA}-0"], "abc")
    spec = container_spec(g, "/var/lib/vgpu/", "2.0.1", lock_dir="/run/vgpulock")
    hosts = {m.container_path: m.host_path for m in spec.mounts}
    assert hosts == {
        "/etc/vgpu/libvgpu.so": "/var/lib/vgpu/lib/libvgpu.so.2.0.1",
        "/etc/ld.so.preload": "/var/lib/vgpu/ld.so.preload",
        "/etc/vgpu/limits": "/var/lib/vgpu/limits/abc",
        "/tmp/vgpu": "/var/lib/vgpu/containers/abc",
        "/tmp/vgpulock": "/run/vgpulock",
    }


@pytest.mark.parametrize(
    ("root", "version", "lock"),
    [("relative", "1", "/l"), ("/r", "../1", "/l"), ("/r", "", "/l"), ("/r", "1", "l")],
)
def test_unsafe_paths_are_refused(root: str, version: str, lock: str) -> None:
    g = grant(design_plan(), [f"{AAAA}-0"], "abc")
    with pytest.raises(ValueError):
        container_spec(g, root, version, lock_dir=lock)


# Invalid requests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "bad", "why"),
    [
        ([], None, "empty request"),
        ([f"{AAAA}-0", "nvidia0"], "nvidia0", "malformed"),
        ([f"{AAAA}::1"], f"{AAAA}::1", "malformed"),
        ([f"{AAAA}-01"], f"{AAAA}-01", "malformed"),
        (["GPU-cccc-1"], "GPU-cccc-1", "not one of this node's nvidia.com/gpu GPUs"),
        ([f"{BBBB}-4"], f"{BBBB}-4", "slice 4 out of range, GPU " + BBBB + " has 4 slices (0..3)"),
        ([f"{AAAA}-2", f"{BBBB}-0", f"{AAAA}-2"], f"{AAAA}-2", "requested twice"),
    ],
)
def test_invalid_requests_name_the_id_and_why(ids: list[str], bad: str | None, why: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        grant(design_plan(), ids, "x")
    assert caught.value.device_id == bad
    assert why in str(caught.value)
    if bad is not None:
        assert repr(bad) in str(caught.value)


def test_fail_requests_greater_than_one() -> None:
    plan = plan_node(
        Config(sharing=Sharing(split_count=4), fail_requests_greater_than_one=True),
        [h100(0, AAAA)],
        "n",
        {},
    )
    assert grant(plan, [f"{AAAA}-0"], "x").device_ids == (f"{AAAA}-0",)
    with pytest.raises(InvalidRequest, match="failRequestsGreaterThanOne"):
        grant(plan, [f"{AAAA}-0", f"{AAAA}-1"], "x")


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "a b", "x" * 129])
def test_allocation_ids_must_be_safe_file_names(bad: str) -> None:
    with pytest.raises(ValueError, match="allocation id"):
        grant(design_plan(), [f"{AAAA}-0"], bad)


def test_new_allocation_ids_are_unique_safe_and_time_ordered() -> None:
    first = [new_allocation_id() for _ in range(500)]
    time.sleep(0.002)
    later = new_allocation_id()
    assert len(set(first)) == len(first)
    assert all(re.fullmatch(r"[0-9a-f]{20}", i) for i in [*first, later])
    assert max(i[:12] for i in first) < later[:12]
    grant(design_plan(), [f"{AAAA}-0"], later)  # accepted as an allocation id


@pytest.mark.parametrize("seed", range(30))
def test_merged_grant_properties(seed: int) -> None:
    rng = random.Random(seed)
    split = rng.randint(1, 16)
    gpus = [h100(i, f"GPU-{i:04d}-abcd") for i in range(rng.randint(1, 8))]
    choices: list[str | int] = ["none", "proportional", rng.randint(1, 100)]
    compute = rng.choice(choices)
    plan = plan_node(Config(sharing=Sharing(split, compute=compute)), gpus, "n", {})
    every = [s.id for s in plan.all_slices()]
    chosen = rng.sample(every, rng.randint(1, len(every)))
    g = grant(plan, chosen, "x")
    assert sorted(g.device_ids) == sorted(chosen)
    indexes = [gg.gpu.index for gg in g.gpus]
    assert indexes == sorted(indexes) and len(set(indexes)) == len(indexes)
    for gg in g.gpus:
        slices = [plan.slice(i) for i in gg.slice_ids]
        assert gg.limit.memory_mib == sum(s.memory_mib for s in slices if s)
        assert gg.limit.compute_percent == min(100, sum(s.compute_percent for s in slices if s))
    spec = container_spec(g, "/usr/local/vgpu", "1")
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == [gg.gpu.uuid for gg in g.gpus]
    for i, gg in enumerate(g.gpus):
        assert spec.envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{gg.limit.memory_mib}m"
    assert parse_limits(spec.limits_text) == limits_of(g)


# The limits file -------------------------------------------------------------------------------


def test_limits_round_trip() -> None:
    g = grant(design_plan(), [f"{BBBB}-0", f"{AAAA}-2"], "abc")
    assert parse_limits(render_limits(g)) == Limits(
        "abc",
        False,
        (GpuLimit(AAAA, 20389 * MIB, 25), GpuLimit(BBBB, 20389 * MIB, 25)),
    )


GOOD = "vgpu-limits 1\nallocation abc\noversubscribe 1\ngpu GPU-1 1048576 0\n"


def test_limits_comments_are_skipped_and_record_order_is_free() -> None:
    text = "vgpu-limits 1\n# written by the plugin\ngpu GPU-1 1048576 0\n"
    text += "oversubscribe 1\nallocation abc\n"
    assert parse_limits(text) == parse_limits(GOOD)
    assert parse_limits(GOOD.rstrip("\n")) == parse_limits(GOOD)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("", 1, "first line"),
        ("vgpu-limits 2\n", 1, "first line"),
        ("# c\nvgpu-limits 1\n", 1, "first line"),
        ("vgpu-limits 1\r\nallocation a\n", 1, "first line"),
        (GOOD + "cores 3\n", 5, "unknown record"),
        (GOOD + "\n", 5, "unknown record"),
        (GOOD.replace("allocation abc", "allocation  abc"), 2, "single spaces"),
        (GOOD.replace("allocation abc", "allocation a/b"), 2, "allocation id"),
        (GOOD + "allocation abc\n", 5, "second allocation"),
        (GOOD.replace("oversubscribe 1", "oversubscribe true"), 3, "0 or 1"),
        (GOOD + "oversubscribe 0\n", 5, "second oversubscribe"),
        (GOOD.replace("1048576 0", "0 0"), 4, "bytes > 0"),
        (GOOD.replace("1048576 0", "1m 0"), 4, "bytes > 0"),
        (GOOD.replace("1048576 0", "-5 0"), 4, "bytes > 0"),
        (GOOD.replace("1048576 0", "1048576 101"), 4, "0..100"),
        (GOOD.replace("1048576 0", "1048576 -1"), 4, "0..100"),
        (GOOD.replace("1048576 0", "1048576"), 4, "3 value(s)"),
        (GOOD + "gpu GPU-1 1 1\n", 5, "second gpu line"),
        (GOOD.replace("gpu GPU-1", "gpu GPU-1\t"), 4, "UUID"),
        ("vgpu-limits 1\noversubscribe 0\ngpu G 1 1\n", 0, "no allocation"),
        ("vgpu-limits 1\nallocation a\ngpu G 1 1\n", 0, "no oversubscribe"),
        ("vgpu-limits 1\nallocation a\noversubscribe 0\n", 0, "no gpu"),
    ],
)
def test_bad_limits_files_name_the_line(text: str, line: int, fragment: str) -> None:
    with pytest.raises(LimitsError) as caught:
        parse_limits(text)
    assert caught.value.line == line
    assert fragment in str(caught.value)
    if line:
        assert str(caught.value).startswith(f"limits line {line}: ")
