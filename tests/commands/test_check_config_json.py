"""`check-config --json`: the plan the text shows, as one JSON document on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vgpu_plugin.commands.cli import main

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-00000000-0000-0000-0000-000000000001"


def test_json_plan_has_both_front_ends_per_gpu_slices_and_the_dra_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "version: v1\nsharing: {splitCount: 4, compute: proportional}\n"
        "overrides:\n  - match: {gpuModels: ['*A100*']}\n    sharing: {splitCount: 2}\n"
        "dra: {enabled: true, gpus: ['1'], memory: {default: 2Gi, minimum: 512Mi, step: 256Mi},"
        " compute: {default: 20, minimum: 5, step: 5}}\n"
    )
    argv = ["check-config", str(cfg), "--no-nvml", "--gpus", "2", "--gpu-memory", "81920m"]
    assert main([*argv, "--gpu-model", "NVIDIA A100-SXM4-80GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] is True and doc["servable"] is True and doc["problem"] is None
    assert doc["frontEnds"] == ["device-plugin", "dra"]
    plugin = doc["devicePlugin"]
    assert plugin["resourceName"] == "nvidia.com/gpu" and plugin["slices"] == 2
    (gpu,) = plugin["gpus"]
    assert gpu["uuid"] == GPU0 and gpu["index"] == 0 and gpu["override"] == 0
    assert gpu["splitCount"] == 2 and gpu["sliceMemoryMiB"] == 40960
    assert gpu["slices"] == [f"{GPU0}-0", f"{GPU0}-1"]
    assert 0 < plugin["listAndWatchBytes"] < plugin["listAndWatchLimitBytes"]
    dra = doc["dra"]
    assert dra["driverName"] == "gpu.vgpu-plugin.io" and dra["gpuSelectors"] == ["1"]
    assert [g["uuid"] for g in dra["gpus"]] == [GPU1]
    assert dra["claimMemoryMiB"] == {"default": 2048, "min": 512, "step": 256}
    assert dra["claimComputePercent"] == {"default": 20, "min": 5, "step": 5}


def test_json_plan_without_dra_and_the_same_numbers_as_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nsharing: {splitCount: 3}\n")
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["frontEnds"] == ["device-plugin"] and doc["dra"] is None
    assert [g["splitCount"] for g in doc["devicePlugin"]["gpus"]] == [3, 3]
    assert f"ListAndWatch message: {doc['devicePlugin']['listAndWatchBytes']} bytes" in text
    for g in doc["devicePlugin"]["gpus"]:
        assert f"{g['sliceMemoryMiB']} MiB" in text


def test_json_of_an_invalid_config_is_nothing_on_stdout_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nsharing: {splitCount: 0}\n")
    assert main(["check-config", str(cfg), "--no-nvml", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "splitCount" in err
