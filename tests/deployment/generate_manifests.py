"""Writes deploy/manifests/ from the chart rendered by real helm with its default values.

    python tests/deployment/generate_manifests.py          # rewrite the files
    python tests/deployment/generate_manifests.py --check  # exit 1 when they are out of date

helm: $VGPU_HELM4 or $VGPU_HELM3, else a helm on PATH (.ci/install-helm.sh installs both).

The static manifests are the chart's defaults for users without Helm, so they are generated,
never edited by hand; ``test_manifests.py`` fails when they differ from the chart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `deployment.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployment import helm as helm_cli
from deployment.chart import MANIFESTS, NAMESPACE, RELEASE, chart_meta, render
from deployment.helm import Helm

# Who manages the objects, in their app.kubernetes.io/managed-by label.
MANAGED_BY = "kubectl"

# Numbered so that `kubectl apply -f deploy/manifests/` creates the namespace first.
FILES: tuple[tuple[str, str], ...] = (
    ("10-serviceaccount.yaml", "templates/serviceaccount.yaml"),
    ("20-configmap.yaml", "templates/configmap.yaml"),
    ("30-daemonset.yaml", "templates/daemonset.yaml"),
    ("40-service.yaml", "templates/service.yaml"),
)
# Needs the Prometheus Operator's CRDs, so outside the directory applied by default.
SERVICE_MONITOR = "extras/servicemonitor.yaml"

NAMESPACE_TEXT = f"""apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
  labels:
    # The plugin's pod mounts host paths (the kubelet's sockets, the host root), which only
    # the privileged Pod Security level admits. Keep this namespace for the plugin alone.
    pod-security.kubernetes.io/enforce: privileged
    pod-security.kubernetes.io/warn: privileged
    pod-security.kubernetes.io/audit: privileged
"""


def _header() -> str:
    meta = chart_meta()
    return (
        f"# Generated from the chart deploy/helm/vgpu-plugin {meta['version']} with its default\n"
        f"# values (release {RELEASE}, namespace {NAMESPACE}) by\n"
        "# tests/deployment/generate_manifests.py. Do not edit: change the chart and run it"
        " again.\n"
    )


def _managed_by(text: str) -> str:
    # helm always renders managed-by Helm; these objects are applied with kubectl.
    return text.replace(
        "app.kubernetes.io/managed-by: Helm", f"app.kubernetes.io/managed-by: {MANAGED_BY}"
    )


def expected(helm: Helm) -> dict[str, str]:
    """Every file of deploy/manifests/ as it must read, by path relative to it."""
    defaults = render(helm=helm)
    with_monitor = render({"metrics": {"serviceMonitor": {"enabled": True}}}, helm)
    out = {"00-namespace.yaml": _header() + NAMESPACE_TEXT}
    for target, template in FILES:
        out[target] = _header() + _managed_by(defaults.files[template])
    out[SERVICE_MONITOR] = _header() + _managed_by(
        with_monitor.files["templates/servicemonitor.yaml"]
    )
    return out


def stale(helm: Helm, directory: Path = MANIFESTS) -> list[str]:
    """Paths (relative) that are missing, differ, or should not be there."""
    want = expected(helm)
    problems = [name for name, text in want.items() if _read(directory / name) != text]
    extra = [
        str(p.relative_to(directory))
        for p in directory.rglob("*.yaml")
        if str(p.relative_to(directory)) not in want
    ]
    return sorted(problems + extra)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    helm = helm_cli.find(4) or helm_cli.find(3)
    if helm is None:
        print(helm_cli.missing_reason(4), file=sys.stderr)
        return 2
    if args.check:
        problems = stale(helm)
        for name in problems:
            print(f"deploy/manifests/{name} is out of date", file=sys.stderr)
        return 1 if problems else 0
    for name, text in expected(helm).items():
        path = MANIFESTS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if _read(path) != text:
            path.write_text(text)
            print(f"wrote deploy/manifests/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
