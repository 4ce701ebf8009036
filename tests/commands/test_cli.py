"""The CLI: `check-config` plans and errors, and `serve` refusing bad settings cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_plugin.commands.cli import main


def test_valid_config_prints_the_per_gpu_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "version: v1\nsharing: {splitCount: 4, compute: proportional}\n"
        "overrides:\n  - match: {gpuModels: ['*A100*']}\n    sharing: {splitCount: 2}\n"
    )
    rc = main(
        [
            "check-config",
            str(cfg),
            "--no-nvml",
            "--gpus",
            "2",
            "--gpu-model",
            "NVIDIA A100-SXM4-80GB",
            "--gpu-memory",
            "81920m",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "valid" in out and "hypothetical node of 2 x NVIDIA A100-SXM4-80GB" in out
    assert "40960 MiB" in out  # 81920 / 2 from the override
    assert "ListAndWatch message:" in out


def test_invalid_config_lists_every_error_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("sharing: {splitCount: 0, memoryScaling: -1, placment: binpack}\n")
    assert main(["check-config", str(cfg), "--no-nvml"]) == 1
    err = capsys.readouterr().err
    assert "sharing.splitCount: must be 1..256, got 0" in err
    assert "sharing.memoryScaling" in err
    assert "sharing.placment: unknown key" in err


def test_missing_file_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(tmp_path / "nope.yaml"), "--no-nvml"]) == 1
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "named"), [("--log-format=xml", "log format"), ("--log-level=loud", "log level")]
)
def test_serve_refuses_bad_log_settings_with_one_line(
    flag: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", flag]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
