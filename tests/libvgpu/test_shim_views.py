"""What a container sees of GPU memory, and what contexts cost it.

cuMemGetInfo, cuDeviceTotalMem and NVML's memory info report the container's view: total is
the limit (or the GPU, if smaller), used is the container's charge, free what it may still take
and the GPU still has. Program: tests/native/shim_views.c (NVML through dlopen + dlsym, as
pynvml does). Contexts take 300 MiB on the simulated GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_shim_helpers import CONTEXT, GIB, MIB, Shim, finish, read_until

from vgpu_plugin.sim.simgpu import Node


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def test_every_view_reports_the_containers_share(shim: Shim) -> None:
    limit, alloc = 2 * GIB, 512 * MIB
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g"})
    r = shim.run("shim_views", "handle", 0, alloc, env=env)
    assert r.rc == 0, r.stderr
    used = CONTEXT + alloc
    assert (r.int("start_total"), r.int("start_free")) == (limit, limit - CONTEXT)
    assert r.int("total_mem") == limit
    assert (r.int("total"), r.int("free")) == (limit, limit - used)
    for v in ("nvml", "nvml2"):
        assert r.int(f"{v}_total") == limit
        assert r.int(f"{v}_used") == used
        assert r.int(f"{v}_free") == limit - used
    assert r.int("nvml2_reserved") == 0


def test_free_never_exceeds_what_the_gpu_still_has(shim: Shim) -> None:
    # Another tenant, not limited, holds 12 GiB of the 16 GiB GPU.
    other = shim.start("shim_views", "handle", 0, 12 * GIB, "hold", env=shim.env(shim=False))
    read_until(other, "holding")
    r = shim.run("shim_views", "handle", 0, 0, env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "8g"}))
    finish(other)
    physical_free = 16 * GIB - 12 * GIB - 2 * CONTEXT
    assert r.int("total") == 8 * GIB
    assert r.int("free") == physical_free
    assert r.int("nvml_free") == physical_free
    assert r.int("nvml_used") == CONTEXT  # the container's, not the other tenant's


def test_without_limits_views_are_the_drivers(shim: Shim) -> None:
    r = shim.run("shim_views", "handle", 0, 512 * MIB)
    assert r.int("total") == r.int("nvml_total") == r.int("total_mem") == 16 * GIB
    assert r.int("free") == 16 * GIB - CONTEXT - 512 * MIB


def test_an_nvml_only_process_sees_the_whole_containers_usage(shim: Shim) -> None:
    g0, g1 = shim.node.gpus()
    shim.write_limits([(g0.uuid, 2 * GIB, 0), (g1.uuid, 3 * GIB, 0)])
    holder = shim.start("shim_views", "handle", 0, GIB, "hold")
    read_until(holder, "holding")
    r = shim.run("shim_views", "nvml", 2)
    finish(holder)
    assert r.rc == 0, r.stderr
    assert (r.int("gpu0_nvml_total"), r.int("gpu0_nvml_used")) == (2 * GIB, CONTEXT + GIB)
    assert r.int("gpu0_nvml_free") == 2 * GIB - CONTEXT - GIB
    assert (r.int("gpu1_nvml_total"), r.int("gpu1_nvml_used")) == (3 * GIB, 0)
    assert r.int("gpu1_nvml2_free") == 3 * GIB
    assert r.int("libcuda_mapped") == 0


def test_contexts_are_charged_and_given_back(shim: Shim) -> None:
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "2g"})
    r = shim.run("shim_views", "handle", 0, 256 * MIB, "ctx", "reset", env=env)
    assert r.rc == 0, r.stderr
    assert r.int("start_free") == 2 * GIB - CONTEXT  # the primary context
    assert r.int("ctx_free") == r.int("free") - CONTEXT  # a second one
    assert r.int("ctx_gone_free") == r.int("free")  # destroyed: given back
    # The primary context's last release frees its allocations: their charge goes too.
    assert r.int("reset_free") == 2 * GIB - CONTEXT


def test_a_context_the_limit_cannot_hold_is_refused(shim: Shim) -> None:
    r = shim.run("shim_views", "handle", 0, 0, env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "200m"}))
    assert r.rc == 10 and "-> 2" in r.stderr  # CUDA_ERROR_OUT_OF_MEMORY
    assert shim.node.gpu(0).used_memory == 0  # and nothing stays on the GPU


@pytest.mark.parametrize(
    "level,shown",
    [
        ("", {"warn"}),
        ("error", set()),
        ("info", {"warn", "info"}),
        ("debug", {"warn", "info", "debug"}),
    ],
)
def test_log_lines_follow_libvgpu_log_level(shim: Shim, level: str, shown: set[str]) -> None:
    # A context the limit refuses: the refused charge (info), the refusal (warn), and the
    # device's limits (debug).
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "200m", "LIBVGPU_LOG_LEVEL": level})
    r = shim.run("shim_views", "handle", 0, 0, env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[vgpu] ")]
    assert {ln.split()[1].rstrip(":") for ln in lines} == shown, lines


# --- NVML-only processes: the limits, never libcuda --------------------------------------------
#
# nvidia-smi or a monitoring agent in a limited container calls NVML alone. The shim then reads
# the limits but does not load libcuda (nor initialise CUDA: a process that forks after cuInit
# leaves its children unable to use CUDA).


def nvml_limits(shim: Shim, source: str) -> dict[str, str]:
    """GPU 0 limited to 2 GiB and GPU 1 to 3 GiB, by the limits file or envs naming UUIDs."""
    g0, g1 = shim.node.gpus()
    if source == "file":
        shim.write_limits([(g0.uuid, 2 * GIB, 0), (g1.uuid, 3 * GIB, 0)])
        return shim.env()
    return shim.env(
        {
            "NVIDIA_VISIBLE_DEVICES": f"{g0.uuid},{g1.uuid}",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "2g",
            "CUDA_DEVICE_MEMORY_LIMIT_1": "3g",
        }
    )


@pytest.mark.parametrize("source", ["file", "env-uuids"])
def test_an_nvml_only_process_is_limited_without_loading_libcuda(shim: Shim, source: str) -> None:
    r = shim.run("shim_views", "nvml", 2, env=nvml_limits(shim, source))
    assert r.rc == 0, r.stderr
    for gpu, limit in (("gpu0", 2 * GIB), ("gpu1", 3 * GIB)):
        for v in ("nvml", "nvml2"):
            assert r.int(f"{gpu}_{v}_total") == limit
            assert r.int(f"{gpu}_{v}_used") == 0
            assert r.int(f"{gpu}_{v}_free") == limit
    assert r.int("libcuda_mapped") == 0
    assert "[vgpu]" not in r.stderr
    assert shim.region.exists()  # made from the limits alone, for the container's processes


@pytest.mark.parametrize("source", ["file", "env-uuids"])
def test_a_gpu_seen_through_nvml_then_cuda_is_accounted_once(shim: Shim, source: str) -> None:
    alloc = 512 * MIB
    r = shim.run("shim_views", "nvml-cuda", 0, alloc, env=nvml_limits(shim, source))
    assert r.rc == 0, r.stderr
    assert r.out["before_uuid"] == r.out["cuda_uuid"]
    assert (r.int("before_nvml_total"), r.int("before_nvml_used")) == (2 * GIB, 0)
    assert r.int("libcuda_mapped") == 0  # NVML alone so far
    used = CONTEXT + alloc
    assert (r.int("total"), r.int("free")) == (2 * GIB, 2 * GIB - used)
    for v in ("nvml", "nvml2"):  # what CUDA charged, NVML shows: one account of the GPU
        assert (r.int(f"after_{v}_total"), r.int(f"after_{v}_used")) == (2 * GIB, used)
        assert r.int(f"after_{v}_free") == 2 * GIB - used
    assert shim.node.gpu(0).used_memory == 0


# Envs that do not name GPUs by UUID: only CUDA maps "index i" (or "every GPU") to a GPU.
# (limits, GPU 0's limit, GPU 1's limit)
BY_INDEX = [
    pytest.param({"CUDA_DEVICE_MEMORY_LIMIT_0": "2g"}, 2 * GIB, 16 * GIB, id="index"),
    pytest.param({"CUDA_DEVICE_MEMORY_LIMIT": "2g"}, 2 * GIB, 2 * GIB, id="default"),
    pytest.param(
        {"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_0": "4g"},
        4 * GIB,
        2 * GIB,
        id="index-over-default",
    ),
]


@pytest.mark.parametrize("limits,gpu0_limit,gpu1_limit", BY_INDEX)
def test_an_nvml_only_process_with_limits_by_index_says_why_it_is_not_limited(
    shim: Shim, limits: dict[str, str], gpu0_limit: int, gpu1_limit: int
) -> None:
    env = shim.env(limits)
    # No process of the container has used CUDA: NVML shows the GPUs as the driver does, and
    # one line says why and what to do; CUDA is neither loaded nor initialised for it.
    r = shim.run("shim_views", "nvml", 2, env=env)
    assert r.rc == 0, r.stderr
    assert r.int("gpu0_nvml_total") == r.int("gpu0_nvml_free") == 16 * GIB
    assert r.int("libcuda_mapped") == 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[vgpu] ")]
    assert len(lines) == 1 and lines[0].startswith("[vgpu] warn: NVML memory info is not limited")
    assert "NVIDIA_VISIBLE_DEVICES" in lines[0]
    assert not shim.region.exists()
    # Once a CUDA process has made the container's region, it maps the GPUs: NVML is limited.
    holder = shim.start("shim_views", "handle", 0, GIB, "hold", env=env)
    read_until(holder, "holding")
    r = shim.run("shim_views", "nvml", 2, env=env)
    finish(holder)
    assert r.rc == 0, r.stderr
    assert (r.int("gpu0_nvml_total"), r.int("gpu0_nvml_used")) == (gpu0_limit, CONTEXT + GIB)
    assert (r.int("gpu1_nvml_total"), r.int("gpu1_nvml_used")) == (gpu1_limit, 0)
    assert r.int("libcuda_mapped") == 0
    assert "[vgpu]" not in r.stderr


@pytest.mark.parametrize("limits,gpu0_limit,gpu1_limit", BY_INDEX)
def test_limits_by_index_nvml_first_then_cuda_in_one_process(
    shim: Shim, limits: dict[str, str], gpu0_limit: int, gpu1_limit: int
) -> None:
    alloc = 512 * MIB
    r = shim.run("shim_views", "nvml-cuda", 0, alloc, env=shim.env(limits))
    # NVML first could not be limited, and that leaves CUDA unharmed: limited and accounted.
    assert r.rc == 0, r.stderr
    assert r.int("before_nvml_total") == 16 * GIB and r.int("libcuda_mapped") == 0
    assert "[vgpu] warn: NVML memory info is not limited" in r.stderr
    used = CONTEXT + alloc
    assert (r.int("total"), r.int("free")) == (gpu0_limit, gpu0_limit - used)
    assert (r.int("after_nvml_total"), r.int("after_nvml_used")) == (gpu0_limit, used)


@pytest.mark.parametrize("limits,gpu0_limit,gpu1_limit", BY_INDEX)
def test_limits_by_index_in_a_process_that_initialised_cuda_itself(
    shim: Shim, limits: dict[str, str], gpu0_limit: int, gpu1_limit: int
) -> None:
    # The program's own cuInit: the shim may ask CUDA which GPU is index i, so NVML is limited
    # from its first call, and the GPU has one account with CUDA's.
    alloc = 512 * MIB
    r = shim.run("shim_views", "nvml-cuda", 0, alloc, "init", env=shim.env(limits))
    assert r.rc == 0, r.stderr
    assert (r.int("before_nvml_total"), r.int("before_nvml_used")) == (gpu0_limit, 0)
    assert "[vgpu]" not in r.stderr
    used = CONTEXT + alloc
    assert (r.int("total"), r.int("free")) == (gpu0_limit, gpu0_limit - used)
    assert (r.int("after_nvml_total"), r.int("after_nvml_used")) == (gpu0_limit, used)


def test_limits_by_index_nvml_first_keeps_the_processs_own_lower_limit(shim: Shim) -> None:
    # The container's region says 4 GiB; this process's own envs say 1 GiB. Its NVML view
    # before CUDA can only be the region's, and its CUDA allocations are still held to 1 GiB.
    made = shim.run(
        "shim_views", "handle", 0, 0, env=shim.env({"CUDA_DEVICE_MEMORY_LIMIT_0": "4g"})
    )
    assert made.rc == 0, made.stderr
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT_0": "1g"})
    r = shim.run("shim_views", "nvml-cuda", 0, 900 * MIB, env=env)
    assert r.int("before_nvml_total") == 4 * GIB and r.int("libcuda_mapped") == 0
    assert r.rc == 10 and "-> 2" in r.stderr  # CUDA_ERROR_OUT_OF_MEMORY: 300 + 900 MiB > 1 GiB
    r = shim.run("shim_views", "nvml-cuda", 0, 512 * MIB, env=env)
    assert r.rc == 0, r.stderr
    assert (r.int("total"), r.int("free")) == (GIB, GIB - CONTEXT - 512 * MIB)
