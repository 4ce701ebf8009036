"""The CLI: `check-config` plans and errors, and `serve` refusing bad settings cleanly."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
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


def test_check_config_plans_both_front_ends_and_prints_the_dra_policy_per_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "version: v1\nsharing: {splitCount: 4}\n"
        "dra: {enabled: true, gpus: ['1'], memory: {default: 2Gi, minimum: 512Mi, step: 256Mi},"
        " compute: {default: 20, minimum: 5, step: 5}}\n"
    )
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    plugin, dra = out.split("DRA driver ")
    # GPU 1 is the DRA driver's: the device plugin plans slices for GPU 0 only.
    assert "1 GPU(s), 4 slice(s)" in plugin
    assert "GPU-00000000-0000-0000-0000-000000000000" in plugin
    assert "GPU-00000000-0000-0000-0000-000000000001" not in plugin
    assert dra.startswith("gpu.vgpu-plugin.io: 1 GPU(s) (dra.gpus: 1)")
    (row,) = [
        line for line in dra.splitlines() if "GPU-00000000-0000-0000-0000-000000000001" in line
    ]
    assert "default 2048 MiB, min 512 MiB, step 256 MiB" in row
    assert "default 20 %, min 5 %, step 5 %" in row
    cfg.write_text("version: v1\ndra: {enabled: true, gpus: [all]}\n")
    assert main(["check-config", str(cfg), "--no-nvml", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "0 GPU(s), 0 slice(s)" in out and "DRA driver gpu.vgpu-plugin.io: 2 GPU(s)" in out


def test_invalid_config_lists_every_error_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nsharing: {splitCount: 0, memoryScaling: -1, placment: binpack}\n")
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


def test_check_config_lists_the_nvidia_flags_it_ignores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "version: v1\nflags:\n  migStrategy: none\n  failOnInitError: true\n"
        "  nvidiaDriverRoot: /\n  plugin:\n    passDeviceSpecs: true\n"
        "    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n"
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    assert main(["check-config", str(cfg), "--no-nvml"]) == 0
    out = capsys.readouterr().out
    ignored = [line for line in out.splitlines() if line.startswith("NVIDIA flag ")]
    assert [line.split(":")[0] for line in ignored] == [
        "NVIDIA flag flags.nvidiaDriverRoot",
        "NVIDIA flag flags.plugin.passDeviceSpecs",
    ]


def _nvml_here() -> bool:
    from vgpu_plugin.node.gpu.nvml import NvmlUnavailable, nvml_session

    try:
        with nvml_session():
            return True
    except NvmlUnavailable:
        return False


def probe(port: int, path: str) -> tuple[int, str]:
    """GET a probe of a plugin on 127.0.0.1: its status and body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read().decode()


def _serve(tmp_path: Path, config_text: str) -> subprocess.Popen[str]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config_text)
    return subprocess.Popen(
        [sys.executable, "-m", "vgpu_plugin", "serve", "--config", str(cfg),
         "--device-plugin-dir", str(tmp_path / "dp"), "--host-root", str(tmp_path / "root"),
         "--state-dir", str(tmp_path / "state"), "--lock-dir", str(tmp_path / "lock"),
         "--metrics-address", "127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_nvidia_fail_on_init_error_false_waits_instead_of_exiting(tmp_path: Path) -> None:
    if _nvml_here():
        pytest.skip("NVML initialises here; this checks serve where it cannot")
    (tmp_path / "a").mkdir()
    default = _serve(tmp_path / "a", "version: v1\n")
    _, err = default.communicate(timeout=60)
    assert default.returncode == 3 and "NVML" in err
    (tmp_path / "b").mkdir()
    waiting = _serve(tmp_path / "b", "version: v1\nflags: {failOnInitError: false}\n")
    assert waiting.stderr is not None
    port = 0
    for line in waiting.stderr:
        found = re.search(r"probes on \S+ \(port (\d+)\) while waiting", line)
        if found:
            port = int(found.group(1))
            break
    assert waiting.poll() is None  # still up, advertising nothing
    # Alive to the chart's liveness probe (no restart loop), never ready.
    assert probe(port, "/healthz") == (200, "ok\n")
    status, body = probe(port, "/readyz")
    assert status == 503 and body.startswith("not serving: ") and "NVML" in body
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=60) == 0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--gpu-memory", "1.5g"], "--gpu-memory: '1.5g' is not a size"),
        (["--gpus", "100000000"], "--gpus: must be 0..1024"),
    ],
)
def test_check_config_refuses_bad_node_flags_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\n")
    assert main(["check-config", str(cfg), "--no-nvml", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_check_config_refuses_a_labels_file_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\n")
    labels = tmp_path / "labels"
    labels.write_bytes(b"zone=\xff\n")
    assert main(["check-config", str(cfg), "--no-nvml", "--node-labels-file", str(labels)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.timeout(30)  # without the fix, serve blocks opening the FIFO (and ignores SIGTERM)
def test_serve_refuses_a_fifo_config_or_labels_file(tmp_path: Path) -> None:
    from vgpu_plugin.commands import serve
    from vgpu_plugin.commands.settings import settings_from
    from vgpu_plugin.node.serving.config_watch import ConfigWatcher

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    good = tmp_path / "config.yaml"
    good.write_text("version: v1\n")
    for config, labels in [(fifo, None), (good, fifo)]:
        settings = settings_from(
            argparse.Namespace(config=str(config), node_labels_file=labels and str(labels)), {}
        )
        watcher = ConfigWatcher(settings.config, settings.node_labels_file, lambda c, n: None)
        with pytest.raises(serve.StartupError) as caught:
            serve._load_config(settings, watcher)
        assert caught.value.code == serve.EXIT_CONFIG
        assert "not a regular file (a FIFO)" in str(caught.value)


def test_serve_refuses_a_state_dir_that_is_a_file(tmp_path: Path) -> None:
    from vgpu_plugin.commands import serve

    state = tmp_path / "state"
    state.write_text("")
    with pytest.raises(serve.StartupError) as caught:
        serve._open_store(state)
    assert caught.value.code == serve.EXIT_NODE
    assert str(caught.value).startswith(f"state dir {state}: ")


def test_version_names_the_shim_build_that_allocate_mounts(
    native_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vgpu_plugin import __version__
    from vgpu_plugin.node.host.install import content_version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    shim = content_version((native_tree / "lib" / "libvgpu.so").read_bytes())
    assert capsys.readouterr().out == f"vgpu-plugin {__version__} (shim {shim})\n"


def test_version_says_none_without_a_shim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vgpu_plugin.node.host import native

    monkeypatch.setenv(native.NATIVE_DIR_ENV, str(tmp_path))  # a tree with no shim built
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.endswith(" (shim none)\n")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from vgpu_plugin.commands.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["serve", "check-config", "status", "install-shim", "demo"])
def test_each_commands_help_has_a_description_and_its_defaults(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from vgpu_plugin.commands.cli import COMMANDS

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    description = next(d for name, _, d in COMMANDS if name == command)
    assert " ".join(description.split()) in text
    for action in _subparsers()[command]._actions:
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS):
            continue
        if isinstance(default, list):
            continue
        assert f"default: {default}" in text or f"{default})" in text, (
            command,
            action.option_strings,
        )


@pytest.mark.parametrize("seconds", ["-5", "0", "nan", "inf", "soon"])
def test_demo_refuses_a_time_that_is_not_above_zero(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--seconds", seconds])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seconds: {seconds!r}" in err


@pytest.mark.parametrize("flag", ["--state-dir", "--host-root"])
@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_status_with_a_wrong_dir_is_an_error_not_an_empty_node(
    flag: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = {"--state-dir": tmp_path / "state", "--host-root": tmp_path / "host"}
    for path in dirs.values():
        path.mkdir()
    wrong = tmp_path / "wrong"
    if kind == "a file":
        wrong.write_text("x")
    dirs[flag] = wrong
    argv = ["status", "--no-nvml", "--pod-resources-socket", str(tmp_path / "none.sock")]
    for name, path in dirs.items():
        argv += [name, str(path)]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    why = "does not exist" if kind == "missing" else "is not a directory"
    assert err.splitlines() == [
        f"vgpu-plugin status: {flag} {wrong} {why}: not a plugin's "
        f"{'state dir' if flag == '--state-dir' else 'host root'} (give the plugin's own, "
        "as its DaemonSet sets it)"
    ]
    # The right dirs, even empty, are a node with nothing on it: rc 0.
    dirs[flag] = tmp_path / ("state" if flag == "--state-dir" else "host")
    argv = argv[:4] + [x for name, path in dirs.items() for x in (name, str(path))]
    assert main(argv) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["allocations.journal", "allocations.lock"])
@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_serve_names_a_journal_or_lock_that_is_no_regular_file(
    tmp_path: Path, name: str, kind: str
) -> None:
    from vgpu_plugin.commands import serve

    state = tmp_path / "state"
    state.mkdir()
    path = state / name
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(serve.StartupError) as caught:
        serve._open_store(state)
    assert caught.value.code == serve.EXIT_NODE
    assert str(caught.value) == f"state file {path} is not a regular file ({kind})"
