"""A full disk under the files we map: a clear error when the file is made, never a SIGBUS later.

A file sized with ftruncate is sparse; on a full filesystem the first touch of a page that has
no block yet kills the process with SIGBUS, whoever touches it (a CI run died that way inside
simgpu's node creation when its disk filled). The region, the compute budget and simgpu's node
are allocated when made (posix_fallocate), so the maker gets ENOSPC instead. Each test mounts a
tiny tmpfs in a private mount namespace and works in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_NAMESPACES
from test_shim_helpers import GIB, Shim, parse

from vgpu_plugin.node.observe.region import GpuLimit, create_region
from vgpu_plugin.sim.simgpu import Node

pytestmark = pytest.mark.skipif(
    NO_NAMESPACES,
    reason="needs root, unshare and mount (a tiny tmpfs in a private mount namespace)",
)

SIGBUS = -7
NO_SPACE = os.strerror(28)  # ENOSPC
CHUNK = 64 << 20
ALLOC_FOUR = ["handle", "0", "alloc", str(CHUNK), "4"]  # shim_mem: four chunks on GPU 0


def on_a_full_disk(
    mnt: Path, argv: list[str], env: dict[str, str], size: str = "12k"
) -> subprocess.CompletedProcess[str]:
    """argv with a `size` tmpfs mounted at `mnt`, seen by it alone."""
    mnt.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" vgpu-full "$2" && shift 2 && exec "$@"'
    ns = ["unshare", "-m", "--propagation", "private"]
    return subprocess.run(
        [*ns, "sh", "-c", script, "sh", size, str(mnt), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def make_in(mnt: Path, imports: str, call: str, error: str) -> subprocess.CompletedProcess[str]:
    """`call` (Python, with the dir as `d`) in a child on a full tmpfs at `mnt`: it prints
    "created" or "refused: <the error>", then what is left in the dir."""
    code = (
        f"import os, sys\n{imports}\nd = sys.argv[1]\n"
        f"try:\n    {call}\n    print('created')\n"
        f"except {error} as e:\n    print('refused:', e)\n"
        "print('left:', sorted(os.listdir(d)))\n"
    )
    return on_a_full_disk(mnt, [sys.executable, "-c", code, str(mnt)], dict(os.environ))


def test_a_region_on_a_full_disk_is_refused_when_made_and_leaves_nothing(
    native_tree: Path, tmp_path: Path
) -> None:
    mnt = tmp_path / "full"
    p = make_in(
        mnt,
        "from vgpu_plugin.node.observe.region import GpuLimit, RegionError, create_region",
        "create_region(d + '/r.cache', [GpuLimit('GPU-x', 1 << 30, 0)])",
        "RegionError",
    )
    assert p.returncode == 0, p.stderr
    assert f"refused: cannot create region {mnt}/r.cache: {NO_SPACE}" in p.stdout
    assert "left: []" in p.stdout  # neither the region nor its temporary file


def test_a_simgpu_node_on_a_full_disk_is_refused_when_made(
    native_tree: Path, tmp_path: Path
) -> None:
    p = make_in(
        tmp_path / "full",
        "from vgpu_plugin.sim.simgpu import GpuSpec, Node, SimGpuError",
        "Node.create(d, [GpuSpec()])",
        "SimGpuError",
    )
    assert p.returncode != SIGBUS, p.stderr
    assert p.returncode == 0, p.stderr
    assert "refused: cannot write" in p.stdout and NO_SPACE in p.stdout
    assert "left: []" in p.stdout


def test_a_container_whose_region_dir_is_full_is_told_and_never_killed(
    native_tree: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    """The shim makes the region on first use; on a full disk that fails with a line naming
    the file and the cause, and the program gets an error from the driver API, not a SIGBUS
    when a page of a half-backed region is first touched."""
    shim = Shim(native_tree, simgpu_node, tmp_path)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    argv = [str(shim.prog("shim_mem")), *ALLOC_FOUR]
    p = on_a_full_disk(shim.region.parent, argv, env)
    assert p.returncode != SIGBUS, p.stderr
    assert str(shim.region) in p.stderr and NO_SPACE in p.stderr, p.stderr
    assert p.returncode != 0, p.stdout  # no limit could be kept: CUDA is refused, not unlimited
    # With room the same program runs and is held to its limit.
    room = on_a_full_disk(shim.region.parent, argv, env, size="1m")
    assert room.returncode == 0, room.stderr
    assert int(parse(room.stdout)["allocated"]) == 4 * CHUNK < GIB


def test_a_compute_budget_that_finds_no_room_paces_the_process_on_its_own(
    native_tree: Path, simgpu_node: Node, tmp_path: Path
) -> None:
    """A tmpfs that holds the region but not the compute budget beside it: the shim says so
    and paces the process alone rather than dying on the budget's first page."""
    sample = tmp_path / "sample.cache"
    create_region(sample, [GpuLimit("GPU-x", GIB, 50)])
    page = os.sysconf("SC_PAGESIZE")
    region_only = -(-sample.stat().st_size // page) * page
    shim = Shim(native_tree, simgpu_node, tmp_path)
    env = shim.env({"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT": "50"})
    argv = [str(shim.prog("shim_mem")), *ALLOC_FOUR]
    p = on_a_full_disk(shim.region.parent, argv, env, size=str(region_only))
    assert p.returncode == 0, p.stderr
    pace = shim.region.with_suffix(".pace")
    assert f"cannot create the compute budget {pace}: {NO_SPACE}" in p.stderr
    assert "this process is paced on its own" in p.stderr
