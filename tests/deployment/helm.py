"""Real helm for the chart tests: finds helm 4 and helm 3 and runs ``helm template`` and
``helm lint``, returning parsed YAML documents.

The binaries come from ``VGPU_HELM4`` / ``VGPU_HELM3`` (paths; ``.ci/install-helm.sh``
installs them and ``.ci/run`` exports both), else where that script installs them by default
(``.ci/tools/bin``), else from a ``helm`` on PATH for the major it is.
A variable that names a missing file is an error, not a skip: CI must never skip the chart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "vgpu-plugin"

MAJORS = (4, 3)
ENV = {4: "VGPU_HELM4", 3: "VGPU_HELM3"}
# Kubernetes version the chart is rendered for unless a test names another: the one the
# project checks DRA on (docs/dra.md). Explicit, since each helm's default differs (helm 3.17:
# 1.32, helm 4.1: 1.35) and the chart's DRA objects need 1.34.
KUBE_VERSION = "1.36.0"
# Seconds one helm command may take: a render takes ~0.1 s; this only stops a hung binary.
TIMEOUT = 120


class HelmError(Exception):
    """helm refused (exit status not 0); the message is what it printed."""


@dataclass(frozen=True)
class Helm:
    major: int
    path: str

    def __str__(self) -> str:  # the pytest id
        return f"helm{self.major}"

    def run(self, *args: str, stdin: str = "") -> str:
        done = subprocess.run(
            [self.path, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=_env(),
            check=False,
        )
        if done.returncode != 0:
            # helm lint prints its findings on stdout, its verdict on stderr.
            raise HelmError("\n".join(t for t in (done.stderr.strip(), done.stdout.strip()) if t))
        return done.stdout


def _env() -> dict[str, str]:
    # No user config, cache or kubeconfig leaks in; helm writes nothing but to these.
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"vgpu-helm-home-{os.getuid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
    env |= {
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": os.devnull,
    }
    return env


def _major_of(path: str) -> int | None:
    try:
        out = subprocess.run(
            [path, "version", "--short"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=_env(),
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.strip().lstrip("v")
    return int(text.split(".", 1)[0]) if text[:1].isdigit() else None


@cache
def find(major: int) -> Helm | None:
    """The helm of ``major``, or None where there is none (then the caller skips)."""
    named = os.environ.get(ENV[major])
    if named:
        if not os.access(named, os.X_OK):
            raise FileNotFoundError(f"{ENV[major]}={named}: no executable there")
        got = _major_of(named)
        if got != major:
            raise RuntimeError(f"{ENV[major]}={named} is helm {got}, not helm {major}")
        return Helm(major, named)
    installed = ROOT / ".ci" / "tools" / "bin" / f"helm{major}"  # .ci/install-helm.sh's
    if os.access(installed, os.X_OK) and _major_of(str(installed)) == major:
        return Helm(major, str(installed))
    on_path = shutil.which("helm")
    if on_path and _major_of(on_path) == major:
        return Helm(major, on_path)
    return None


def missing_reason(major: int) -> str:
    return (
        f"no helm {major}: run .ci/install-helm.sh (helm 4 and 3 into .ci/tools/bin), or set"
        f" {ENV[major]} to its path, or put a helm {major} on PATH"
    )


def template(
    helm: Helm,
    values_yaml: str = "",
    *,
    release: str,
    namespace: str,
    kube_version: str = KUBE_VERSION,
    sets: tuple[str, ...] = (),
    chart: Path = CHART,
) -> str:
    """``helm template`` of the chart with ``values_yaml`` (a -f file) and ``--set`` flags."""
    args = ["template", release, str(chart), "--namespace", namespace]
    args += ["--kube-version", kube_version, "--values", "-"]
    for s in sets:
        args += ["--set", s]
    return helm.run(*args, stdin=values_yaml or "{}")


def lint(helm: Helm, values_yaml: str = "", *, sets: tuple[str, ...] = ()) -> str:
    """``helm lint --strict``; raises HelmError with its findings when it fails."""
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, "--values", "-"]
    for s in sets:
        args += ["--set", s]
    return helm.run(*args, stdin=values_yaml or "{}")


def notes(helm: Helm, values_yaml: str = "", *, release: str, namespace: str) -> str:
    """NOTES.txt as ``helm install`` prints it, rendered client-side (``--dry-run=client``)."""
    out = helm.run(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--dry-run=client",
        "--values",
        "-",
        stdin=values_yaml or "{}",
    )
    _, sep, text = out.partition("\nNOTES:\n")
    if not sep:
        raise HelmError(f"helm install --dry-run printed no NOTES:\n{out}")
    return text


SOURCE = "# Source: "


def split_sources(output: str) -> dict[str, str]:
    """``helm template``'s output by template (``templates/x.yaml`` -> its documents' text,
    without the Source comments), in the order helm printed them."""
    files: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []

    def flush() -> None:
        if current is not None:
            text = "\n".join(lines).strip("\n") + "\n"
            files[current] = files[current] + "---\n" + text if current in files else text

    for line in output.splitlines():
        if line == "---":
            flush()
            current, lines = None, []
        elif line.startswith(SOURCE) and current is None:
            current = line[len(SOURCE) :].split("/", 1)[1]
        else:
            lines.append(line)
    flush()
    return files


def documents(text: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for doc in yaml.safe_load_all(text):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise AssertionError(f"a manifest document is not a map: {doc!r}")
        out.append(doc)
    return out
