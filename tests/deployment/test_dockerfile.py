"""deploy/Dockerfile, checked by its structure (no Docker engine in the test environment): two
stages, pinned bases, the wheel built with the native code, a runtime stage whose entrypoint
and commands are the CLI's, and a build context that holds what the COPYs need."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from deployment.chart import ROOT, render
from vgpu_plugin.commands import cli

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


@dataclass(frozen=True)
class Instruction:
    op: str
    args: str
    heredoc: str = ""


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and heredoc bodies attached."""
    out: list[Instruction] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i].strip()
            i += 1
            if nxt.startswith("#"):
                continue
            line = line[:-1].rstrip() + " " + nxt
        op, _, args = line.partition(" ")
        body = ""
        m = re.search(r"<<-?'?\"?(\w+)'?\"?", args)
        if m:
            end = m.group(1)
            start = i
            while lines[i].strip() != end:
                i += 1
            body = "\n".join(lines[start:i])
            i += 1
        out.append(Instruction(op.upper(), args.strip(), body))
    return out


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    out: list[list[Instruction]] = []
    for ins in instructions:
        if ins.op == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    out = {}
    for ins in instructions:
        if ins.op == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            out[name.strip()] = value.strip().strip('"')
    return out


def test_two_stages_with_pinned_bases() -> None:
    instructions = parse(DOCKERFILE.read_text())
    build, runtime = stages(instructions)
    args = arg_defaults(instructions)
    for stage, name in ((build, "build"), (runtime, "runtime")):
        image, _, alias = stage[0].args.partition(" AS ")
        assert alias == name
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned"
        assert re.search(r"\d+\.\d+", tag), f"{image}: tag {tag} names no exact version"
    # The shim's glibc floor: the build base must be a manylinux_2_28 (glibc 2.28) image.
    assert "manylinux_2_28_" in args["BUILD_IMAGE"]


def test_the_build_stage_builds_the_wheel_with_the_native_code() -> None:
    build, runtime = stages(parse(DOCKERFILE.read_text()))
    runs = " ".join(i.args for i in build if i.op == "RUN")
    assert "pip wheel" in runs  # scikit-build-core runs CMake on native/ for the wheel
    copied = {i.args.split()[0] for i in build if i.op == "COPY"}
    assert {"native/", "src/"} <= copied
    checks = [i.heredoc for i in build if i.heredoc]
    assert any("GLIBC_" in body and "(2, 28)" in body for body in checks)
    assert not any(i.op in ("RUN", "COPY") and "apt-get" in i.args for i in runtime)


def test_the_runtime_runs_the_clis_commands() -> None:
    _, runtime = stages(parse(DOCKERFILE.read_text()))
    entry = [json.loads(i.args) for i in runtime if i.op == "ENTRYPOINT"]
    cmd = [json.loads(i.args) for i in runtime if i.op == "CMD"]
    assert entry == [["vgpu-plugin"]] and cmd == [["serve"]]
    parser = cli.build_parser()
    assert parser.parse_args(cmd[0]).command == "serve"
    installs = " ".join(i.args for i in runtime if i.op == "RUN")
    assert "--no-index" in installs and "vgpu-plugin --version" in installs
    # Every command the chart runs in this image exists in it.
    provided = {"vgpu-plugin"}
    for ins in runtime:
        if ins.op == "COPY":
            provided.add(Path(shlex.split(ins.args)[-1]).name)
    r = render({"nodeLabels": {"fromAPI": True}})
    pod = r.one("DaemonSet")["spec"]["template"]["spec"]
    for c in pod["initContainers"] + pod["containers"]:
        assert c["command"][0] in provided, c["name"]
        if c["command"] == ["vgpu-plugin"]:
            assert parser.parse_args(c["args"]).command in ("serve", "install-shim")


_GLOB = {"**": ".*", "*": "[^/]*", "?": "[^/]"}


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        regex = "".join(
            _GLOB.get(tok) or re.escape(tok) for tok in re.findall(r"\*\*|\*|\?|[^*?]+", pattern)
        )
        if any(re.fullmatch(regex, c) for c in candidates):
            verdict = not negate
    return verdict


def test_the_build_context_holds_what_the_copies_need() -> None:
    patterns = [
        line.strip()
        for line in IGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources: list[str] = []
    for ins in parse(DOCKERFILE.read_text()):
        if ins.op == "COPY" and "--from" not in ins.args:
            words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        kept = [f for f in files if not _ignored(str(f.relative_to(ROOT)), patterns)]
        assert kept, f"{source}: excluded from the build context"
        if path.is_file():
            assert kept == [path]
    # What the wheel build reads is in; local build output and tests are out.
    assert not _ignored("native/libvgpu/src/load.c", patterns)
    assert not _ignored("src/vgpu_plugin/api/deviceplugin/v1beta1/api_pb2.py", patterns)
    for ignored in (
        "build/x/lib/libvgpu.so",
        "tests/conftest.py",
        ".git/HEAD",
        "src/vgpu_plugin/__pycache__/cli.cpython-312.pyc",
    ):
        assert _ignored(ignored, patterns), ignored


@pytest.mark.slow
def test_the_image_wheel_ships_no_simulator(tmp_path: Path) -> None:
    """Builds the wheel as the build stage does (its `rm` and its pip options, read from the
    Dockerfile) and looks inside: the shim and the commands, no simulator."""
    build, _ = stages(parse(DOCKERFILE.read_text()))
    runs = [i.args for i in build if i.op == "RUN" and not i.heredoc]
    removed = [a for r in runs if r.startswith("rm ") for a in shlex.split(r)[1:] if a[0] != "-"]
    (wheel_run,) = [r for r in runs if "pip wheel" in r]
    options = [a for a in shlex.split(wheel_run) if a.startswith("cmake.define.")]
    assert removed == ["src/vgpu_plugin/sim"] and options == ["cmake.define.VGPU_BUILD_SIMGPU=OFF"]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "_native", "*.so")
    for name in ("native", "src"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for path in removed:
        shutil.rmtree(src / path)
    out = tmp_path / "wheels"
    args = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
    # pip's long spelling: -C came with pip 23.1, and a fresh Debian 12 venv has 23.0.1
    args += [a for o in options for a in ("--config-settings", o)] + [str(src)]
    built = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("vgpu_plugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("/_native/lib/libvgpu.so") for n in names)
    assert "vgpu_plugin/commands/demo.py" in names and "vgpu_plugin/commands/serve.py" in names
    assert not [n for n in names if n.startswith("vgpu_plugin/sim/") or "simgpu" in n]


def test_the_dra_build_arg_chooses_the_extra_default_on() -> None:
    """The runtime stage's DRA build arg (default true: the chart can enable DRA) installs
    vgpu-plugin[dra] or plain vgpu-plugin and checks the result; any other value stops the
    build. The choice is run here as the build runs it, by sh."""
    build, runtime = stages(parse(DOCKERFILE.read_text()))
    (wheel_run,) = [i.args for i in build if i.op == "RUN" and "pip wheel" in i.args]
    assert shlex.split(wheel_run)[-1] == ".[dra]"  # the extra's wheels are always at hand
    assert "DRA=true" in [i.args for i in runtime if i.op == "ARG"]
    (install,) = [i.args for i in runtime if i.op == "RUN" and "${DRA}" in i.args]
    choice = install.split(" ", 1)[1].split(" && pip install")[0]  # after the --mount flag
    assert choice.startswith("case ")

    def chosen(value: str) -> subprocess.CompletedProcess[str]:
        script = f'DRA={shlex.quote(value)}; {choice} && echo "$package|$check"'
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)

    on, off, bad = chosen("true"), chosen("false"), chosen("yes")
    assert on.stdout == "vgpu-plugin[dra]|import kubernetes\n"
    assert off.stdout.startswith("vgpu-plugin|") and 'find_spec("kubernetes") is None' in off.stdout
    assert bad.returncode == 1 and "DRA must be true or false" in bad.stderr and not bad.stdout
    assert '"${package}"' in install and 'python -c "${check}"' in install
