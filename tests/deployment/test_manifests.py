"""The static manifests (deploy/manifests/) are the chart's defaults, object for object."""

from __future__ import annotations

from pathlib import Path

from deployment import k8s
from deployment.chart import (
    MANIFESTS,
    NAMESPACE,
    Helm,
    Obj,
    diff,
    key,
    manifest_objects,
    render,
)
from deployment.generate_manifests import MANAGED_BY, SERVICE_MONITOR, stale


def _without_managed_by(obj: Obj) -> Obj:
    labels = obj["metadata"].get("labels", {})
    assert labels.get("app.kubernetes.io/managed-by") in (None, "Helm", MANAGED_BY)
    out = {**obj, "metadata": {**obj["metadata"]}}
    out["metadata"]["labels"] = {
        k: v for k, v in labels.items() if k != "app.kubernetes.io/managed-by"
    }
    return out


def test_the_manifests_are_up_to_date(helm: Helm) -> None:
    assert stale(helm) == [], "run: python tests/deployment/generate_manifests.py"


def test_staleness_is_seen(helm: Helm, tmp_path: Path) -> None:
    for path in MANIFESTS.rglob("*.yaml"):
        target = tmp_path / path.relative_to(MANIFESTS)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert stale(helm, tmp_path) == []
    daemonset = tmp_path / "30-daemonset.yaml"
    daemonset.write_text(daemonset.read_text().replace("9400", "9401"))
    (tmp_path / "99-extra.yaml").write_text("{}\n")
    assert stale(helm, tmp_path) == ["30-daemonset.yaml", "99-extra.yaml"]


def test_the_manifests_are_the_charts_defaults_field_by_field(helm: Helm) -> None:
    files = manifest_objects()
    applied = {
        key(o): o for name, objs in files.items() if not name.startswith("extras/") for o in objs
    }
    namespace = applied.pop(("Namespace", "", NAMESPACE))
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    chart = {key(o): o for o in render(helm=helm).objects}
    assert sorted(applied) == sorted(chart)
    for k, obj in chart.items():
        assert diff(_without_managed_by(applied[k]), _without_managed_by(obj)) == [], k
    monitor = render({"metrics": {"serviceMonitor": {"enabled": True}}}, helm).one("ServiceMonitor")
    (extra,) = files[SERVICE_MONITOR]
    assert diff(_without_managed_by(extra), _without_managed_by(monitor)) == []


def test_the_comparison_sees_a_changed_field(helm: Helm) -> None:
    daemonset = render(helm=helm).one("DaemonSet")
    changed = render({"metrics": {"port": 9401}}, helm).one("DaemonSet")
    assert diff(daemonset, changed) != []


def test_every_manifest_is_a_valid_object() -> None:
    objects = [o for objs in manifest_objects().values() for o in objs]
    assert {o["kind"] for o in objects} == {
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
        "Service",
        "ServiceMonitor",
    }
    for obj in objects:
        k8s.validate(obj)
        assert k8s.semantic_problems(obj) == []


def test_apply_order_creates_the_namespace_first() -> None:
    # `kubectl apply -f deploy/manifests/` takes the files in name order.
    names = sorted(p.name for p in MANIFESTS.glob("*.yaml"))
    first = manifest_objects()[names[0]]
    assert [o["kind"] for o in first] == ["Namespace"]
