"""simgpu reports pids as a real driver does: a process in its own pid namespace is listed by
its pid in the node's namespace when SIMGPU_HOST_PROC names the node's procfs (NVML.md, Pids).

The process runs under ``unshare --pid --fork`` with the node's /proc bound at a directory
before a /proc of its own namespace is mounted, as a container runtime would leave it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import child_of, require_root
from test_nvml import (
    USAGE,
    answered_by,
    busy_span,
    env_with,
    process_util,
    pynvml_on,
    sleep_until,
)

from vgpu_plugin.sim.simgpu import Node

MIB = 1 << 20


def in_pid_namespace(argv: list[str], host_proc: Path) -> list[str]:
    """argv run as pid 1 of a new pid namespace, the node's /proc bound at host_proc."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a pid namespace")
    require_root()
    script = 'mount --bind /proc "$0" && mount -t proc proc /proc && exec "$@"'
    return ["unshare", "--mount", "--pid", "--fork", "sh", "-c", script, str(host_proc), *argv]


@pytest.mark.parametrize("knob", [True, False])
def test_a_process_in_its_own_pid_namespace_is_listed_by_its_node_pid(
    simgpu_node: Node, native_bin: Path, tmp_path: Path, knob: bool
) -> None:
    host_proc = tmp_path / "host-proc"
    host_proc.mkdir()
    env = env_with(simgpu_node)
    if knob:
        env["SIMGPU_HOST_PROC"] = str(host_proc)
    argv = in_pid_namespace(
        [str(native_bin / "nvml_gpu_process"), "mem:0:64", "busy:0:10000"], host_proc
    )
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line != "ready\n":
            pytest.skip(f"cannot make a pid namespace here: {proc.wait(10)}")
        node_pid = child_of(proc.pid)
        assert node_pid != 1
        want = node_pid if knob else 1  # unset: the pid it sees, pid 1 of its namespace
        start, end = busy_span(proc)
        with pynvml_on(env_with(simgpu_node)) as nvml:
            assert nvml(USAGE)[0][1] == [[want, 64 * MIB]]
            sleep_until(start + 10_000_000)  # 10 ms of its kernels have run
            [[pid, *_]] = process_util(nvml, 0)
            answered_by(end, "nvmlDeviceGetProcessUtilization")
            assert pid == want
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    assert os.listdir(host_proc) == []  # the bind stayed in the namespace
