"""operations.md describes the probes the chart renders (paths and timing), not older ones."""

from __future__ import annotations

from deployment.chart import Helm, render
from deployment.generate_docs import DOCS


def test_the_documented_probes_are_the_charts(helm: Helm) -> None:
    pod = render(helm=helm).one("DaemonSet")["spec"]["template"]["spec"]
    plugin = next(c for c in pod["containers"] if c["name"] == "vgpu-plugin")
    ready, live = plugin["readinessProbe"], plugin["livenessProbe"]
    ops = " ".join((DOCS / "operations.md").read_text().split())
    said = ops.split("**Probes**", 1)[1].split("\n- ", 1)[0]
    assert f"readiness on `{ready['httpGet']['path']}`" in said
    assert f"liveness on `{live['httpGet']['path']}`" in said
    assert (
        f"({live['failureThreshold']} x {live['periodSeconds']} s, "
        f"after {live['initialDelaySeconds']} s)"
    ) in said
    assert "no liveness probe" not in ops
