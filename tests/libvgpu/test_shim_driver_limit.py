"""The shim confirms the driver's own memory limit (docs/contracts.md, "Driver memory limit"):
the first process of a container that attaches to the region asks NVML
(nvmlDeviceGetMemoryLimits_v1) for its own cgroup on each of the region's GPUs, and writes
what it found into the region's per-device stats, where the node reads it.

The toolkit's hook is ``python -m vgpu_plugin.sim.toolkit`` (the same process the runc tests
run). ``SIMGPU_SYSFS_CGROUP`` stands for the mount of the cgroup fs: the hook sees the host's
(a directory here), the shim's process sees its container's own cgroup there, as under a cgroup
namespace; so the limit is found by the directory, not by the host path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_shim_helpers import GIB, MIB, Shim

from vgpu_plugin.core.devices import GpuLimit
from vgpu_plugin.node.observe.nodeview import (
    SHIM_FOUND,
    SHIM_NONE,
    SHIM_UNCHECKED,
    SHIM_UNSUPPORTED,
)
from vgpu_plugin.node.observe.region import create_region, read_region
from vgpu_plugin.sim.simgpu import Node

CONTAINER = "kubepods/pod-x/ctr"


@pytest.fixture
def shim(native_tree: Path, simgpu_node: Node, tmp_path: Path) -> Shim:
    return Shim(native_tree, simgpu_node, tmp_path)


@pytest.fixture
def cgroupfs(tmp_path: Path) -> Path:
    root = tmp_path / "cgroupfs"
    (root / CONTAINER).mkdir(parents=True)
    return root


def hook(shim: Shim, cgroupfs: Path, hard: int, *uuids: str) -> None:
    env = shim.env(shim=False)
    env["SIMGPU_SYSFS_CGROUP"] = str(cgroupfs)
    args = [f"/sys/fs/cgroup/{CONTAINER}", str(hard), str(hard), *uuids]
    subprocess.run(
        [sys.executable, "-m", "vgpu_plugin.sim.toolkit", *args],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )


def run_in_container(shim: Shim, cgroupfs: Path, **extra: str) -> None:
    env = shim.env()
    env["SIMGPU_SYSFS_CGROUP"] = str(cgroupfs / CONTAINER)
    env.update(extra)
    r = shim.run("shim_mem", "handle", 0, "alloc", 64 * MIB, 1, env=env)
    assert r.rc == 0, r.stderr


def test_a_process_records_the_limit_the_driver_holds_its_cgroup_to(
    shim: Shim, cgroupfs: Path
) -> None:
    g0, g1 = shim.node.gpus()[:2]
    shim.write_limits([(g0.uuid, 2 * GIB, 0), (g1.uuid, 2 * GIB, 0)])
    hook(shim, cgroupfs, 2 * GIB, g0.uuid)  # the hook ran for GPU 0 only
    run_in_container(shim, cgroupfs)
    devices = {d.uuid: d for d in read_region(shim.region).devices}
    assert (devices[g0.uuid].driver_limit_state, devices[g0.uuid].driver_limit) == (
        SHIM_FOUND,
        2 * GIB,
    )
    assert (devices[g1.uuid].driver_limit_state, devices[g1.uuid].driver_limit) == (SHIM_NONE, 0)


def test_without_the_hook_a_process_records_that_the_driver_holds_nothing(
    shim: Shim, cgroupfs: Path
) -> None:
    g0 = shim.node.gpus()[0]
    shim.write_limits([(g0.uuid, 2 * GIB, 0)])
    run_in_container(shim, cgroupfs)
    (dev,) = read_region(shim.region).devices
    assert (dev.driver_limit_state, dev.driver_limit) == (SHIM_NONE, 0)


def test_a_driver_that_cannot_report_a_limit_is_recorded_as_unsupported(
    shim: Shim, cgroupfs: Path
) -> None:
    """NVML answers NOT_SUPPORTED (a driver with the entry points, without the feature): the
    node must say the driver holds nothing, and why, not "none on the cgroup"."""
    g0 = shim.node.gpus()[0]
    shim.write_limits([(g0.uuid, 2 * GIB, 0)])
    hook(shim, cgroupfs, 2 * GIB, g0.uuid)  # set while the driver could: still not reported
    run_in_container(shim, cgroupfs, SIMGPU_NO_MEMORY_LIMITS="1")
    (dev,) = read_region(shim.region).devices
    assert (dev.driver_limit_state, dev.driver_limit) == (SHIM_UNSUPPORTED, 0)


def test_the_first_answer_stands_for_the_container(shim: Shim, cgroupfs: Path) -> None:
    """Once per container: a later process does not ask again (one NVML init less each)."""
    g0 = shim.node.gpus()[0]
    shim.write_limits([(g0.uuid, 2 * GIB, 0)])
    run_in_container(shim, cgroupfs)
    hook(shim, cgroupfs, GIB, g0.uuid)
    run_in_container(shim, cgroupfs)
    (dev,) = read_region(shim.region).devices
    assert dev.driver_limit_state == SHIM_NONE


def test_a_region_no_process_attached_to_is_unchecked(shim: Shim) -> None:
    """A region made by the plugin and no CUDA process yet: nothing confirmed."""
    g0 = shim.node.gpus()[0]
    shim.region.parent.mkdir(parents=True, exist_ok=True)
    create_region(shim.region, [GpuLimit(g0.uuid, 2 * GIB, 0)])
    (dev,) = read_region(shim.region).devices
    assert dev.driver_limit_state == SHIM_UNCHECKED


def cgroup2_mount() -> Path | None:
    """Where this host mounts the cgroup v2 hierarchy (/sys/fs/cgroup, or .../unified)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


@pytest.fixture
def child_cgroup() -> Iterator[tuple[Path, str]]:
    """A real cgroup below this test's own: (its directory, its path as /proc/self/cgroup
    says it). Root and a cgroup v2 hierarchy are needed to make one and move a process in."""
    mount, own = cgroup2_mount(), own_cgroup_path()
    if os.geteuid() != 0 or mount is None or own is None:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    path = own.rstrip("/") + f"/vgpu-test-{os.getpid()}"
    directory = mount / path.lstrip("/")
    try:
        directory.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        yield directory, path
    finally:
        directory.rmdir()  # its process has exited: the cgroup is empty


def own_cgroup_path() -> str | None:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return next((line[3:] for line in lines if line.startswith("0::/")), None)


def test_a_process_in_a_child_cgroup_finds_its_containers_limit(
    shim: Shim, cgroupfs: Path, child_cgroup: tuple[Path, str]
) -> None:
    """The hook sets the container's cgroup; a process in a cgroup below it asks for its own,
    which has none, and walks up to the container's."""
    directory, path = child_cgroup
    g0 = shim.node.gpus()[0]
    shim.write_limits([(g0.uuid, 2 * GIB, 0)])
    hook(shim, cgroupfs, 2 * GIB, g0.uuid)
    inside = cgroupfs / CONTAINER
    (inside / path.lstrip("/")).mkdir(parents=True)  # the child, in the container's view
    env = shim.env()
    env["SIMGPU_SYSFS_CGROUP"] = str(inside)
    prog = shim.prog("shim_mem")
    script = f"echo $$ > {directory}/cgroup.procs && exec {prog} handle 0 alloc {64 * MIB} 1"
    proc = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (dev,) = read_region(shim.region).devices
    assert (dev.driver_limit_state, dev.driver_limit) == (SHIM_FOUND, 2 * GIB)
