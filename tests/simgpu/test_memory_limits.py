"""The driver's per-cgroup memory limit in simgpu (nvmlDeviceSetMemoryLimits_v1 and
nvmlDeviceGetMemoryLimits_v1): set through the real pynvml or a C program, held by the CUDA
driver against every process of the cgroup (and of the cgroups below it), contexts included.

A process's cgroup is ``SIMGPU_CGROUP`` where set (the simulation's knob), else its own
``0::<path>`` of /proc/self/cgroup. tests/native/nvml_gpu_process stands in for a GPU process
(it charges memory as the CUDA front does, on the same path).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vgpu_plugin.sim.simgpu import Node

MIB = 1 << 20
GIB = 1 << 30
MAX = 0xFFFFFFFFFFFFFFFF
SYSFS_KNOB = "SIMGPU_SYSFS_CGROUP"

# Runs NVML calls in a child on the node, as the toolkit's hook does: each argument is
# "set:GPU:NAMESPACE:SOFT:HARD" or "get:GPU:NAMESPACE"; prints one JSON answer per call.
_CALLS = r"""
import json, sys
import pynvml as N
N.nvmlInit()
out = []
for call in sys.argv[1:]:
    op, gpu, ns, *vals = call.split(":")
    h = N.nvmlDeviceGetHandleByIndex(int(gpu))
    try:
        if op == "set":
            N.nvmlDeviceSetMemoryLimits_v1(h, N.c_nvmlSetMemoryLimits_v1_t(
                ns.encode(), int(vals[0]), int(vals[1])))
            out.append("ok")
        else:
            got = N.c_nvmlGetMemoryLimits_v1_t(ns.encode())
            N.nvmlDeviceGetMemoryLimits_v1(h, got)
            out.append([got.softLimit, got.hardLimit, got.currentUsed])
    except N.NVMLError as exc:
        out.append(type(exc).__name__)
print(json.dumps(out))
"""


def env_for(node: Node, cgroup: str | None, sysfs: Path | None = None) -> dict[str, str]:
    """The environment of a process on ``node`` in ``cgroup``, for which ``sysfs`` (where
    given) stands for /sys/fs/cgroup, as a container's own cgroup is mounted there."""
    env = node.env()
    for k in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "SIMGPU_CGROUP", SYSFS_KNOB):
        env.pop(k, None)
    if cgroup is not None:
        env["SIMGPU_CGROUP"] = cgroup
    if sysfs is not None:
        env[SYSFS_KNOB] = str(sysfs)
    return env


def nvml(node: Node, *calls: str, sysfs: Path | None = None) -> list[Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CALLS, *calls],
        env=env_for(node, "/system/hook", sysfs),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answers: list[Any] = json.loads(proc.stdout)
    return answers


def ns(cgroup: str) -> str:
    return "/sys/fs/cgroup" + cgroup


@contextmanager
def holding(
    native_bin: Path, node: Node, cgroup: str | None, mib: int, sysfs: Path | None = None
) -> Iterator[bool]:
    """A GPU process in ``cgroup`` that tried to charge ``mib`` MiB on GPU 0: True while it
    holds them, False when the driver refused."""
    proc = subprocess.Popen(
        [str(native_bin / "nvml_gpu_process"), f"mem:0:{mib}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_for(node, cgroup, sysfs),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line != "ready\n":
            proc.wait(10)
            assert proc.stderr is not None
            assert "cannot charge" in proc.stderr.read()
        yield line == "ready\n"
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_a_c_program_is_held_to_its_cgroups_limit(native_bin: Path, simgpu_node: Node) -> None:
    proc = subprocess.run(
        [str(native_bin / "cuda_memory_limits"), "1024"],
        env=env_for(simgpu_node, "/kubepods/pod-a/ctr"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    context = out["context"]
    assert context > 0  # the context counts against the limit, as on the real driver
    assert out["refused"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert out["allocated_mib"] == (GIB - context) // (64 * MIB) * 64
    assert out["used_at_limit"] == context + out["allocated_mib"] * MIB <= GIB
    assert (out["soft"], out["hard"]) == (GIB // 2, GIB)
    assert out["gpu1_mib"] == 2048  # the limit was set on GPU 0 only
    assert out["after_clear"] == 0


def test_pynvml_sets_gets_and_clears_as_nvml_documents(simgpu_node: Node) -> None:
    a = ns("/kubepods/pod-a/ctr")
    answers = nvml(
        simgpu_node,
        f"get:0:{a}",
        f"set:0:{a}:{GIB}:{2 * GIB}",
        f"get:0:{a}",
        f"get:1:{a}",
        f"get:0:{a}/",  # the same cgroup
        f"set:0:{a}:{3 * GIB}:{2 * GIB}",  # soft above hard
        f"set:0:{a}:0:{17 * GIB}",  # above the GPU's 16 GiB
        "set:0:/tmp/elsewhere:0:1",  # not a cgroup
        f"set:0:{a}:0:{GIB}",  # replaces the limit
        f"get:0:{a}",
        f"set:0:{a}:0:{MAX}",  # clears it
        f"get:0:{a}",
    )
    assert answers == [
        "NVMLError_NotFound",
        "ok",
        [GIB, 2 * GIB, 0],
        "NVMLError_NotFound",
        [GIB, 2 * GIB, 0],
        "NVMLError_InvalidArgument",
        "NVMLError_InvalidArgument",
        "NVMLError_OperatingSystem",
        "ok",
        [0, GIB, 0],
        "ok",
        "NVMLError_NotFound",
    ]


def test_usage_sums_over_the_cgroup_and_its_children_and_dies_with_them(
    native_bin: Path, simgpu_node: Node
) -> None:
    pod = "/kubepods/pod-b"
    assert nvml(simgpu_node, f"set:0:{ns(pod)}:0:{GIB}") == ["ok"]
    with holding(native_bin, simgpu_node, pod + "/ctr-1", 600) as first:
        assert first
        assert nvml(simgpu_node, f"get:0:{ns(pod)}") == [[0, GIB, 600 * MIB]]
        # Another process of the pod would take it over: refused, whichever child it is in.
        with holding(native_bin, simgpu_node, pod, 600) as second:
            assert not second
        with holding(native_bin, simgpu_node, pod + "/ctr-2", 424) as fits:
            assert fits  # exactly up to the limit
        # Other cgroups, and processes whose cgroup is an unrelated prefix, are not held.
        with holding(native_bin, simgpu_node, "/kubepods/pod-bb", 2048) as other:
            assert other
    # The holder died: its usage with it, and the room is there again.
    assert nvml(simgpu_node, f"get:0:{ns(pod)}") == [[0, GIB, 0]]
    with holding(native_bin, simgpu_node, pod, 1000) as again:
        assert again


def own_cgroup() -> str | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:] for line in lines if line.startswith("0::/")), None)


def test_without_the_knob_a_process_is_in_its_own_cgroup(
    native_bin: Path, simgpu_node: Node
) -> None:
    cgroup = own_cgroup()
    if cgroup is None:
        pytest.skip("no cgroup v2 line in /proc/self/cgroup")
    assert "SIMGPU_CGROUP" not in os.environ
    assert nvml(simgpu_node, f"set:0:{ns(cgroup)}:0:{512 * MIB}") == ["ok"]
    with holding(native_bin, simgpu_node, None, 600) as over:
        assert not over  # a child of this test is in this test's cgroup
    with holding(native_bin, simgpu_node, None, 500) as under:
        assert under


@pytest.fixture
def cgroupfs(tmp_path: Path) -> Path:
    """A directory standing for the host's /sys/fs/cgroup, with a container's cgroup in it."""
    root = tmp_path / "cgroupfs"
    (root / "kubepods/pod-c/ctr").mkdir(parents=True)
    (root / "kubepods/pod-d/ctr").mkdir(parents=True)
    return root


def test_the_container_finds_the_limit_the_host_set_by_its_own_path(
    simgpu_node: Node, cgroupfs: Path
) -> None:
    # The hook names the cgroup by its host path; inside the container (own cgroup namespace)
    # the same directory is /sys/fs/cgroup, and /proc/self/cgroup says "/".
    host = ns("/kubepods/pod-c/ctr")
    assert nvml(simgpu_node, f"set:0:{host}:0:{GIB}", sysfs=cgroupfs) == ["ok"]
    inside = cgroupfs / "kubepods/pod-c/ctr"
    assert nvml(simgpu_node, "get:0:/sys/fs/cgroup", "get:0:/sys/fs/cgroup/", sysfs=inside) == [
        [0, GIB, 0],
        [0, GIB, 0],
    ]
    # Another container's cgroup, or a path that names no directory there, has none.
    other = cgroupfs / "kubepods/pod-d/ctr"
    assert nvml(simgpu_node, "get:0:/sys/fs/cgroup", sysfs=other) == ["NVMLError_NotFound"]
    assert nvml(simgpu_node, f"get:0:{host}", sysfs=inside) == ["NVMLError_NotFound"]
    # The host still finds it by its path, and a set through either path is the same limit.
    assert nvml(simgpu_node, f"get:0:{host}", sysfs=cgroupfs) == [[0, GIB, 0]]
    assert nvml(simgpu_node, f"set:0:/sys/fs/cgroup:0:{2 * GIB}", sysfs=inside) == ["ok"]
    assert nvml(simgpu_node, f"get:0:{host}", sysfs=cgroupfs) == [[0, 2 * GIB, 0]]


def test_the_driver_holds_the_container_by_its_directory(
    native_bin: Path, simgpu_node: Node, cgroupfs: Path
) -> None:
    assert nvml(simgpu_node, f"set:0:{ns('/kubepods/pod-c/ctr')}:0:{GIB}", sysfs=cgroupfs) == ["ok"]
    inside, other = cgroupfs / "kubepods/pod-c/ctr", cgroupfs / "kubepods/pod-d/ctr"
    # A process of the container, its cgroup "/" in its own view: held, and counted.
    with holding(native_bin, simgpu_node, "/", 600, sysfs=inside) as first:
        assert first
        assert nvml(simgpu_node, "get:0:/sys/fs/cgroup", sysfs=inside) == [[0, GIB, 600 * MIB]]
        with holding(native_bin, simgpu_node, "/", 600, sysfs=inside) as second:
            assert not second
        # In a child cgroup of the container: held by its parent's limit.
        (inside / "child").mkdir()
        with holding(native_bin, simgpu_node, "/child", 600, sysfs=inside) as child:
            assert not child
        # Another container's process, also "/" in its own view: not held.
        with holding(native_bin, simgpu_node, "/", 2048, sysfs=other) as free:
            assert free


def test_a_real_mount_of_the_cgroup_is_the_same_cgroup(simgpu_node: Node, cgroupfs: Path) -> None:
    """As under a real container runtime: no knob, the directory bind-mounted on
    /sys/fs/cgroup in a private mount namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private mount namespace needs root and unshare")
    host = ns("/kubepods/pod-c/ctr")
    assert nvml(simgpu_node, f"set:0:{host}:0:{GIB}", sysfs=cgroupfs) == ["ok"]
    script = (
        f"mount --bind {cgroupfs / 'kubepods/pod-c/ctr'} /sys/fs/cgroup && "
        f'exec {sys.executable} -c "$0" get:0:/sys/fs/cgroup'
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, _CALLS],
        env=env_for(simgpu_node, "/system/hook"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0 and "mount" in proc.stderr:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[0, GIB, 0]]
