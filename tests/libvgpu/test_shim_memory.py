"""The shim's memory limit: every allocation path, several processes, dead holders, bad values.

Programs: tests/native/shim_mem.c (allocate on one path until refused, optionally hold, free)
on a simulated node of 2 x 16 GiB GPUs whose contexts take 300 MiB each. A context's memory
counts against the limit, so a process can allocate `limit - 300 MiB`.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from test_shim_helpers import CONTEXT, GIB, MIB, OOM, Shim, finish, read_until, start_together

from vgpu_plugin.sim.simgpu import Node

INVALID_HANDLE = 400  # CUDA_ERROR_INVALID_HANDLE

PATHS = [
    "alloc",
    "alloc_v1",
    "pitch",
    "managed",
    "async",
    "async_ptsz",
    "pool",
    "pool_ptsz",
    "vmm",
    "array",
    "array3d",
    "mipmapped",
]


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


def limit_env(shim: Shim, value: str = "1g", **more: str) -> dict[str, str]:
    return shim.env({"CUDA_DEVICE_MEMORY_LIMIT": value, **more})


@pytest.mark.parametrize("path", PATHS)
def test_every_path_fills_the_limit_is_refused_past_it_and_frees_back(
    shim: Shim, path: str
) -> None:
    chunk = 64 * MIB
    r = shim.run("shim_mem", "handle", 0, path, chunk, 100, env=limit_env(shim))
    assert r.rc == 0, r.stderr
    room = GIB - CONTEXT
    assert r.int("allocated") == room // chunk * chunk
    assert r.int("refusal") == OOM
    assert r.int("view_free") == room - r.int("allocated")
    # Every free gave back exactly what its allocation charged.
    assert r.int("after_view_free") == room


@pytest.mark.parametrize("mode", ["handle", "default", "getproc"])
@pytest.mark.parametrize("path", ["alloc", "async_ptsz", "vmm"])
def test_every_way_of_reaching_the_driver_is_enforced(shim: Shim, mode: str, path: str) -> None:
    """dlsym on libcuda's handle, the exported symbols, and cuGetProcAddress (with _ptsz)."""
    chunk = 128 * MIB
    r = shim.run("shim_mem", mode, 0, path, chunk, 100, env=limit_env(shim))
    assert r.rc == 0, r.stderr
    assert r.int("allocated") == (GIB - CONTEXT) // chunk * chunk
    assert r.int("refusal") == OOM


def level_bytes(w: int, h: int, d: int, levels: int, keep_depth: bool) -> int:
    """A float4 array's levels [0, levels): max(1, extent >> l) per spatial dimension; layers
    and cubemap faces (keep_depth) do not shrink."""
    total = 0
    for lvl in range(levels):
        depth = (d if keep_depth else max(1, d >> lvl)) if d else 1
        total += max(1, w >> lvl) * (max(1, h >> lvl) if h else 1) * depth * 16
    return total


@pytest.mark.parametrize("mode", ["handle", "default", "getproc"])
def test_arrays_are_charged_layers_faces_and_levels_and_sparse_ones_nothing(
    shim: Shim, mode: str
) -> None:
    r = shim.run("shim_arrays", mode, 0, env=limit_env(shim))
    assert r.rc == 0, r.stderr
    # Depth is a layered array's layer count and a cubemap's faces (6, or 6 per layer).
    for name, size in {
        "layered1d": 1024 * 64 * 16,
        "layered2d": 256 * 256 * 16 * 16,
        "cubemap": 512 * 512 * 6 * 16,
        "cubemap_layered": 256 * 256 * 12 * 16,
    }.items():
        assert (r.int(name), r.int(f"{name}_free")) == (size, -size), name
    # A mipmapped array: the sum of its levels, given back whole by its destroy; a level is
    # its own, and destroying that (refused by the driver) gives nothing back.
    mip = level_bytes(256, 256, 6, 3, keep_depth=True)
    assert r.int("mip_cubemap") == mip
    assert (r.int("mip_level_destroy_rc"), r.int("mip_level_destroy")) == (INVALID_HANDLE, 0)
    assert r.int("mip_cubemap_free") == -mip
    assert r.int("mip_destroy_twice_rc") == INVALID_HANDLE
    # Its first level alone fits in the limit, all of them do not: refused, nothing charged.
    assert level_bytes(2048, 2048, 10, 1, keep_depth=True) < GIB - CONTEXT
    assert (r.int("mip_over_rc"), r.int("mip_over")) == (OOM, 0)
    # It goes with its context, as the context's own memory does.
    in_ctx = level_bytes(512, 512, 0, 10, keep_depth=False)
    assert r.int("mip_in_ctx") == in_ctx
    assert r.int("mip_ctx_destroyed") == -(in_ctx + CONTEXT)
    # Sparse and deferred-mapping arrays (16 GiB, 4 GiB and 1.3 GiB nominal, past the limit)
    # take nothing; the tile pool bound into them is charged once, by cuMemCreate, and held to
    # the limit.
    assert [r.int(f"{k}_rc") for k in ("sparse", "deferred", "sparse_mip")] == [0, 0, 0]
    assert r.int("sparse") == 0
    assert (r.int("tile_pool"), r.int("map")) == (64 * MIB, 0)
    assert r.int("tile_pool_over_rc") == OOM
    assert (r.int("tile_pool_free"), r.int("sparse_free")) == (-64 * MIB, 0)
    assert r.int("end") == 0


def test_usable_memory_is_at_least_99_percent_of_the_limit(shim: Shim) -> None:
    limit = 4 * GIB
    r = shim.run("shim_mem", "handle", 0, "alloc", MIB, 10000, env=limit_env(shim, "4g"))
    assert r.rc == 0, r.stderr
    used = r.int("allocated") + CONTEXT
    assert 0.99 * limit <= used <= limit
    assert r.int("view_free") == limit - used


def test_without_limits_the_shim_passes_through_and_makes_no_files(shim: Shim) -> None:
    r = shim.run("shim_mem", "handle", 0, "alloc", GIB, 100)
    assert r.rc == 0, r.stderr
    assert r.int("allocated") == 15 * GIB  # what a 16 GiB GPU holds beside a context
    assert r.int("refusal") == OOM  # the driver's own answer
    assert r.int("view_total") == 16 * GIB
    assert not shim.region.parent.exists()
    assert not (shim.tmp / "lock").exists()


def test_processes_of_a_container_share_one_limit_and_free_back_to_zero(shim: Shim) -> None:
    limit, chunk, n = 4 * GIB, 32 * MIB, 4
    env = limit_env(shim, "4g")
    procs = [
        shim.start("shim_mem", "handle", 0, "alloc", chunk, 1000, "hold", "gate", env=env)
        for _ in range(n)
    ]
    start_together(procs)  # all allocate at once
    held = [read_until(p, "holding") for p in procs]
    total = sum(int(h["allocated"]) for h in held) + n * CONTEXT
    assert total <= limit
    assert total > limit - n * chunk  # and the limit was usable
    assert all(int(h["refusal"]) == OOM for h in held)
    for p in procs:
        assert finish(p).rc == 0
    # Everything came back: a newcomer gets the whole limit.
    r = shim.run("shim_mem", "handle", 0, "alloc", chunk, 1000, env=env)
    assert r.int("allocated") == (limit - CONTEXT) // chunk * chunk


def test_a_killed_holders_memory_is_back_within_a_second(shim: Shim) -> None:
    env = limit_env(shim, "2g")
    holder = shim.start("shim_mem", "handle", 0, "alloc", 64 * MIB, 1000, "hold", env=env)
    held = read_until(holder, "holding")
    assert int(held["allocated"]) == (2 * GIB - CONTEXT) // (64 * MIB) * (64 * MIB)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    r = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 1000, env=env)
    assert time.monotonic() - t0 < 1.0
    assert r.int("allocated") == int(held["allocated"])


@pytest.mark.parametrize("value", ["1.5g", "-1", "12x", "99999999999999999999g", ""])
def test_a_bad_memory_limit_fails_closed_with_one_line_naming_it(shim: Shim, value: str) -> None:
    uuids = ",".join(g.uuid for g in shim.node.gpus())
    env = shim.env(
        {
            "NVIDIA_VISIBLE_DEVICES": uuids,
            "CUDA_DEVICE_MEMORY_LIMIT_0": value,
            "CUDA_DEVICE_MEMORY_LIMIT_1": "1g",
        }
    )
    bad = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 10, env=env)
    # Not even a context: the device has no memory to give.
    assert bad.rc == 10 and "-> 2" in bad.stderr
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("[vgpu]")]
    assert len(lines) == 1 and "CUDA_DEVICE_MEMORY_LIMIT_0" in lines[0], bad.stderr
    good = shim.run("shim_mem", "handle", 1, "alloc", 64 * MIB, 100, env=env)
    assert good.int("allocated") == (GIB - CONTEXT) // (64 * MIB) * (64 * MIB)


@pytest.mark.parametrize(
    "var,value", [("CUDA_DEVICE_SM_LIMIT", "150"), ("CUDA_DEVICE_SM_LIMIT", "5%")]
)
def test_a_bad_compute_limit_fails_closed(shim: Shim, var: str, value: str) -> None:
    r = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 10, env=shim.env({var: value}))
    assert r.rc == 10 and "-> 2" in r.stderr
    assert var in r.stderr


def test_the_limits_file_wins_over_envs_and_follows_uuids_not_ordinals(shim: Shim) -> None:
    g0, g1 = shim.node.gpus()
    shim.write_limits([(g0.uuid, GIB, 0), (g1.uuid, 2 * GIB, 0)])
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "8g", "CUDA_VISIBLE_DEVICES": "1,0"})
    chunk = 64 * MIB
    first = shim.run("shim_mem", "handle", 0, "alloc", chunk, 1000, env=env)  # physical GPU 1
    second = shim.run("shim_mem", "handle", 1, "alloc", chunk, 1000, env=env)  # physical GPU 0
    assert first.int("allocated") == (2 * GIB - CONTEXT) // chunk * chunk
    assert second.int("allocated") == (GIB - CONTEXT) // chunk * chunk


def test_indexed_envs_follow_nvidia_visible_devices_through_a_reordering(shim: Shim) -> None:
    g0, g1 = shim.node.gpus()
    env = shim.env(
        {
            "NVIDIA_VISIBLE_DEVICES": f"{g0.uuid},{g1.uuid}",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "1g",
            "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m",
            "CUDA_VISIBLE_DEVICES": "1",
        }
    )
    r = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 1000, env=env)
    assert r.int("allocated") == (2 * GIB - CONTEXT) // (64 * MIB) * (64 * MIB)


@pytest.mark.parametrize(
    "text,reason",
    [
        ("vgpu-limits 2\n", "line 1"),
        ("vgpu-limits 1\nallocation a\nbogus 1\n", "line 3"),
        ("vgpu-limits 1\ngpu GPU-x 12x 0\n", "line 2"),
        ("", "line 1"),
    ],
)
def test_a_bad_limits_file_refuses_everything_and_says_where(
    shim: Shim, text: str, reason: str
) -> None:
    shim.write_limits([], text=text)
    r = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 10)
    assert r.rc == 10 and "-> 2" in r.stderr
    assert str(shim.limits_path) in r.stderr and reason in r.stderr


def test_a_gpu_the_limits_file_does_not_name_is_refused(shim: Shim) -> None:
    g0, _ = shim.node.gpus()
    shim.write_limits([(g0.uuid, GIB, 0)])
    assert shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 1).rc == 0
    other = shim.run("shim_mem", "handle", 1, "alloc", 64 * MIB, 1)
    assert other.rc == 10 and "-> 2" in other.stderr


def test_oversubscription_falls_back_to_managed_memory(shim: Shim) -> None:
    chunk = GIB
    plain = shim.run("shim_mem", "handle", 0, "alloc", chunk, 100, env=limit_env(shim, "24g"))
    assert plain.int("allocated") == 15 * GIB  # the physical GPU's, beside a context
    over = shim.run(
        "shim_mem",
        "handle",
        0,
        "alloc",
        chunk,
        100,
        env=limit_env(shim, "24g", CUDA_OVERSUBSCRIBE="true"),
    )
    assert over.int("allocated") == 23 * GIB  # the limit's, part of it host-backed
    assert over.int("refusal") == OOM
    assert over.int("after_view_free") == 16 * GIB - CONTEXT  # all back; the GPU's free
