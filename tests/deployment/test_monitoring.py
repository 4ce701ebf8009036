"""The chart's alerts and dashboard, checked by Prometheus's own tools: `promtool check rules`
and `promtool test rules` on the one rules file, the chart shipping that file and the
dashboard as they are, and a real Prometheus (Debian's `prometheus`, on loopback) scraping a
running `vgpu-plugin serve` on simulated GPUs, where every dashboard query and every alert's
expression evaluates without error and each dashboard query returns data."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployment import k8s
from deployment.chart import CHART, NAMESPACE, Helm, render
from vgpu_plugin.sim.kubelet_emulator import KubeletEmulator, PodResourcesEmulator, short_tmp_dir
from vgpu_plugin.sim.simgpu import Node

RULES = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
ALERT_TESTS = Path(__file__).parent / "data" / "alerts_test.yaml"
RES = "nvidia.com/gpu"
# What a dashboard query's Grafana variables become for a plain Prometheus: every plugin pod,
# and a window that holds several of the test's 1 s scrapes.
VARIABLES = {"$instance": ".*", "$__rate_interval": "30s"}


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"no {name} on PATH: apt-get install prometheus (CI does, .ci/run)")
    return found


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, its variables as above."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a variable the test does not know"
            out.append((panel["title"], expr))
    return out


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


# --- the rules file, by promtool --------------------------------------------------------------


def test_promtool_checks_the_rules_file() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_the_issues_alerts_are_there() -> None:
    # The alerts docs/metrics.md promises: near the memory limit, refusals rising, GPU
    # unhealthy, plugin not registered, driver limit not applied, a process without the shim
    # (and the node view down).
    names = {r["alert"] for r in rules()}
    assert names == {
        "VgpuContainerNearMemoryLimit",
        "VgpuMemoryRefusalsRising",
        "VgpuGpuUnhealthy",
        "VgpuPluginNotRegistered",
        "VgpuDriverMemoryLimitNotApplied",
        "VgpuUnshimmedProcess",
        "VgpuNodeViewDown",
    }
    doc = (CHART.parents[2] / "docs" / "metrics.md").read_text()
    for name in names:
        assert f"`{name}`" in doc, f"docs/metrics.md does not explain {name}"


def test_each_alert_has_unit_tests_that_fire_it_and_keep_it_quiet() -> None:
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {r["alert"] for r in rules()}
    assert fired == names
    assert quiet == names
    out = promtool("test", "rules", str(ALERT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_unit_tests_fail_when_an_alert_changes(tmp_path: Path) -> None:
    """The unit tests bite: the same tests on rules with a threshold moved fail."""
    changed = RULES.read_text().replace("> 0.95", "> 0.97")
    assert changed != RULES.read_text()
    (tmp_path / "rules.yaml").write_text(changed)
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    tests["rule_files"] = ["rules.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    out = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert out.returncode != 0
    assert "VgpuContainerNearMemoryLimit" in out.stdout + out.stderr


# --- the chart ships them ---------------------------------------------------------------------


def test_the_chart_ships_the_rules_file_as_its_prometheus_rule(helm: Helm) -> None:
    off = render(helm=helm)
    assert "PrometheusRule" not in off.kinds()
    values = {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}}}}
    rule = render(values, helm).one("PrometheusRule")
    k8s.validate(rule)
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prom"
    # Every rule as promtool checked it, $labels templates untouched by helm.
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar(helm: Helm) -> None:
    off = render(helm=helm)
    assert not [o for o in off.objects if o["metadata"]["name"].endswith("-dashboard")]
    on = render({"metrics": {"grafanaDashboard": {"enabled": True}}}, helm)
    cm = on.one("ConfigMap", "vgpu-plugin-dashboard")
    k8s.validate(cm)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert json.loads(cm["data"]["vgpu-plugin.json"]) == json.loads(DASHBOARD.read_text())
    values = {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}
    elsewhere = render({"metrics": values}, helm).one("ConfigMap", "vgpu-plugin-dashboard")
    assert elsewhere["metadata"]["namespace"] == "monitoring"


def test_the_dashboard_covers_what_the_issue_asks() -> None:
    # Per GPU: memory promised and used per container, compute share, refusals; per
    # container: usage against its limit over time.
    exprs = " ".join(e for _, e in dashboard_queries())
    for name in (
        "vgpu_gpu_memory_limited_bytes",
        "vgpu_container_memory_used_bytes",
        "vgpu_container_compute_limit_ratio",
        "vgpu_container_memory_refusals_total",
        "vgpu_container_memory_limit_bytes",
        "vgpu_gpu_utilization_ratio",
    ):
        assert name in exprs, name


# --- a real Prometheus scraping a running plugin ----------------------------------------------


@dataclass
class Plugin:
    kubelet: KubeletEmulator
    port: int
    uuids: list[str]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")  # session: set up before the session's native build
def prometheus_binary() -> str:
    return tool("prometheus")


@pytest.fixture
def plugin(
    prometheus_binary: str, simgpu_node: Node, native_tree: Path, tmp_path: Path
) -> Iterator[Plugin]:
    """`serve` on a simulated node; first of all, skipped where there is no Prometheus."""
    from vgpu_plugin.node.host import install

    host_root = tmp_path / "host"
    install.install_shim(host_root, native_tree / "lib" / "libvgpu.so")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"version: v1\nsharing: {{splitCount: 4, compute: proportional}}\nhostRoot: {host_root}\n"
    )
    plugin_dir = short_tmp_dir()
    log = tmp_path / "plugin.log"
    argv = [
        sys.executable, "-m", "vgpu_plugin", "serve",
        "--config", str(config), "--device-plugin-dir", str(plugin_dir),
        "--state-dir", str(tmp_path / "state"), "--lock-dir", str(tmp_path / "locks"),
        "--metrics-address", "127.0.0.1:0",
        "--pod-resources-socket", str(plugin_dir / "podres.sock"),
    ]  # fmt: skip
    gpus = [g.uuid for g in simgpu_node.gpus()]
    # The kubelet's pod-resources answer: the pods holding the test's slices (an allocation
    # no container holds would be cleaned up, and its series go).
    podres = PodResourcesEmulator(plugin_dir / "podres.sock")
    podres.assign("ml", "infer", "main", RES, [f"{gpus[0]}-0", f"{gpus[0]}-1"])
    podres.assign("ml", "train", "main", RES, [f"{gpus[1]}-0"])
    kubelet = KubeletEmulator(plugin_dir)
    kubelet.start()
    podres.start()
    with open(log, "ab") as out:
        # The node's name as the chart gives it (NODE_NAME, from the pod's spec.nodeName).
        env = {**simgpu_node.env(), "NODE_NAME": "node-1"}
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
    try:
        kubelet.wait_registrations(1, timeout=60)
        port = None
        deadline = time.monotonic() + 60
        while port is None:
            assert time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if "metrics on" in line and "(port " in line:
                    port = int(line.rsplit("(port ", 1)[1].rstrip(")"))
            time.sleep(0.05)
        yield Plugin(kubelet, port, gpus)
    finally:
        proc.kill()
        proc.wait()
        podres.stop()
        kubelet.stop()


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping ``target`` every second with
    the chart's rules loaded; stopped by ``stop``."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        binary = tool("prometheus")
        shutil.copy(RULES, tmp_path / "rules.yaml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": "vgpu-plugin", "honor_labels": True,
                 "static_configs": [{"targets": [target]}]}
            ],
        }  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp_path / "prometheus.log"
        for _ in range(5):  # a port taken between picking and binding: pick another
            self.port = _free_port()
            argv = [
                binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ]  # fmt: skip
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=out)
            if self._ready():
                return
            self.stop()
        raise AssertionError(f"prometheus did not start:\n{self.log.read_text()}")

    def _ready(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=5) as resp:
                    if resp.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(self.url(f"/api/v1/{path}?{query}"), timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait(self, expr: str, what: str, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            assert time.monotonic() < deadline, f"{what}: {expr} returned nothing"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _scrapes(prom: Prometheus) -> float:
    result = prom.query('count_over_time(up{job="vgpu-plugin"}[1h])')
    return float(result[0]["value"][1]) if result else 0.0


def test_prometheus_scrapes_serve_and_every_dashboard_query_returns_data(
    plugin: Plugin, tmp_path: Path
) -> None:
    a, b = plugin.uuids
    plugin.kubelet.allocate(RES, [f"{a}-0", f"{a}-1"])
    prom = Prometheus(tmp_path, f"127.0.0.1:{plugin.port}")
    try:
        assert prom.wait('up{job="vgpu-plugin"} == 1', "the plugin scraped")
        # One more Allocate between scrapes, so the latency histogram has a rate.
        plugin.kubelet.allocate(RES, [f"{b}-0"])
        prom.wait("vgpu_allocate_seconds_count >= 2", "the second Allocate scraped")
        scrapes = _scrapes(prom)
        deadline = time.monotonic() + 60
        while _scrapes(prom) < scrapes + 3:  # a few scrapes more: every rate has its samples
            assert time.monotonic() < deadline, "prometheus stopped scraping"
            time.sleep(0.2)
        for title, expr in dashboard_queries():
            result = prom.wait(expr, f"panel {title!r}")
            values = [float(r["value"][1]) for r in result]
            assert all(math.isfinite(v) for v in values), (title, expr, result)
        # The labels a join with dcgm-exporter uses are there as scraped.
        gpu = prom.query(f'vgpu_gpu_memory_total_bytes{{UUID="{a}"}}')
        assert gpu and gpu[0]["metric"]["gpu"] == "0" and gpu[0]["metric"]["Hostname"] == "node-1"
        assert float(gpu[0]["value"][1]) == 16 << 30
        # The dashboard's instance variable has values.
        assert prom.api("label/instance/values", **{"match[]": "vgpu_build_info"})
        # Every alert is loaded from the chart's file and evaluates against the real series.
        deadline = time.monotonic() + 60
        while True:
            groups = prom.api("rules")["groups"]
            health = {
                r["name"]: (r["health"], r.get("lastError")) for g in groups for r in g["rules"]
            }
            if all(h == "ok" for h, _ in health.values()):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert set(health) == {r["alert"] for r in rules()}
        # A quiet, healthy node: nothing fires (registered, GPUs healthy, far from limits).
        assert prom.query('ALERTS{alertstate="firing"}') == []
    finally:
        prom.stop()
