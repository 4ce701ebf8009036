"""check-config's warning about a DRA memory minimum that cannot hold a CUDA context."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_plugin.commands.cli import main
from vgpu_plugin.core import dra
from vgpu_plugin.core.config import DraConfig
from vgpu_plugin.sim.demo import CONTEXT_MIB


def test_the_context_constant_is_the_simulators() -> None:
    assert dra.CUDA_CONTEXT_BYTES == CONTEXT_MIB << 20


def test_the_default_memory_minimum_holds_a_context_and_is_the_charts() -> None:
    policy = dra.CapacityPolicy(*DraConfig().memory)
    assert policy == dra.MEMORY_POLICY and policy.minimum == 1 << 30  # values.yaml: 1Gi
    assert dra.policy_warnings(policy) == []


@pytest.mark.parametrize(
    ("minimum", "warned"), [("256Mi", True), ("128Mi", True), ("512Mi", False)]
)
def test_check_config_warns_when_the_memory_minimum_is_one_context_or_less(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], minimum: str, warned: bool
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "version: v1\n"
        f"dra: {{enabled: true, memory: {{default: 1Gi, minimum: {minimum}, step: 128Mi}}}}\n"
    )
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "1"]) == 0
    err = capsys.readouterr().err
    line = (
        f"warning: dra.memory.minimum {minimum} does not exceed one CUDA context (256Mi):"
        " the smallest claim could not start CUDA; 1Gi is the default\n"
    )
    assert err == (line if warned else "")
