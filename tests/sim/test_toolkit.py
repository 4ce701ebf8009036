"""The toolkit emulation's apply-cuda-memory-limits hook, without containers: when it runs,
with what, and what the container gets (the runc tests in tests/e2e run it for real)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import make_node

from vgpu_plugin.sim.runc import ContainerConfig
from vgpu_plugin.sim.simgpu import GpuSpec
from vgpu_plugin.sim.toolkit import (
    CGROUP_ENV,
    ToolkitSettings,
    apply,
    container_cgroup,
    set_memory_limits_with,
)

MIB = 1 << 20
A, B = "GPU-a", "GPU-b"
SAFE = ToolkitSettings()
LIMIT_ENVS = {"NVIDIA_GPU_MEMORY_REQUEST": "1024", "NVIDIA_GPU_MEMORY_LIMIT": "2048"}


class Calls:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], int, int]] = []

    def __call__(self, name_space: str, uuids: Sequence[str], soft: int, hard: int) -> None:
        self.calls.append((name_space, list(uuids), soft, hard))


def run(envs: dict[str, str], settings: ToolkitSettings = SAFE) -> tuple[Calls, dict[str, str]]:
    calls = Calls()
    config = ContainerConfig("ctr", ["true"], {"NVIDIA_VISIBLE_DEVICES": f"{B},{A}", **envs})
    privileged = True  # the env names the GPUs: enough for these tests
    out = apply(config, settings, [A, B], privileged=privileged, set_memory_limits=calls)
    return calls, dict(out.envs)


def test_the_hook_sets_both_limits_on_every_gpu_for_the_containers_cgroup() -> None:
    calls, envs = run(LIMIT_ENVS)
    cgroup = container_cgroup("ctr")
    assert calls.calls == [("/sys/fs/cgroup" + cgroup, [B, A], 1024 * MIB, 2048 * MIB)]
    assert envs[CGROUP_ENV] == cgroup


@pytest.mark.parametrize(
    ("envs", "settings"),
    [
        ({"NVIDIA_GPU_MEMORY_LIMIT": "2048"}, ToolkitSettings()),  # both are needed
        ({"NVIDIA_GPU_MEMORY_REQUEST": "1024"}, ToolkitSettings()),
        (LIMIT_ENVS, ToolkitSettings(apply_cuda_memory_limits=False)),  # an older toolkit
        ({**LIMIT_ENVS, "NVIDIA_VISIBLE_DEVICES": "void"}, ToolkitSettings()),  # no GPU
    ],
)
def test_the_hook_does_nothing(envs: dict[str, str], settings: ToolkitSettings) -> None:
    calls, out = run(envs, settings)
    assert calls.calls == [] and CGROUP_ENV not in out


def test_a_malformed_value_fails_the_container() -> None:
    with pytest.raises(RuntimeError, match="apply-cuda-memory-limits"):
        run({**LIMIT_ENVS, "NVIDIA_GPU_MEMORY_LIMIT": "2g"})


def test_the_hook_process_sets_the_limit_through_simgpus_nvml(
    native_tree: Path, tmp_path: Path
) -> None:
    node = make_node(tmp_path, [GpuSpec(memory=4096 * MIB), GpuSpec(memory=4096 * MIB)])
    uuids = [g.uuid for g in node.gpus()]
    hook = set_memory_limits_with(node.env())
    hook("/sys/fs/cgroup/kubepods/x", uuids, 512 * MIB, 1024 * MIB)
    with pytest.raises(RuntimeError, match="nvmlDeviceSetMemoryLimits_v1"):
        hook("/sys/fs/cgroup/kubepods/x", uuids, 0, 8192 * MIB)  # above the GPU's memory
