"""The cluster tier's fixtures: one real single-node Kubernetes per session (docs/testing.md),
the plugin installed into it by helm from deploy/helm/vgpu-plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deployment import helm as deployment_helm

from .assets import ROOT, Missing, binaries, check_host
from .cluster import Cluster, start
from .images import Images
from .images import build as build_images
from .kube import Kube, wait_for

CHART = ROOT / "deploy" / "helm" / "vgpu-plugin"
VALUES = Path(__file__).parent / "values.yaml"
RELEASE, PLUGIN_NS = "vgpu", "vgpu-system"
GPUS = 2  # GPU 0: DRA (values.yaml dra.gpus), GPU 1: the device plugin's slices
SPLIT = 4
GRACE = 4.0  # values.yaml cleanupGraceSeconds
HOST_ROOT = "/var/lib/vgpu"  # values.yaml hostRoot
CDI_DIR = "/var/run/cdi"  # values.yaml cdiSpecDir


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cluster)
            # The first test also waits for the images and the bring-up: 106 s from a fresh
            # clone on an idle 2-CPU VM, 645 s at load 15 (2026-11-29); a hang guard, not a bound.
            item.add_marker(pytest.mark.timeout(1800))


def _timing(msg: str) -> None:
    sys.stderr.write(f"\n[cluster tier] {msg}\n")


@pytest.fixture(scope="package")
def images() -> Images:
    """The tier's images (images.py), built once; a skip naming what the host lacks first."""
    try:
        check_host()
        binaries()
    except Missing as exc:
        pytest.skip(str(exc))
    built = build_images()
    _timing(f"images built in {built.seconds:.1f}s")
    return built


@pytest.fixture(scope="package")
def cluster(images: Images) -> Iterator[Cluster]:
    c = start(images, binaries(), gpus=GPUS)
    _timing(f"cluster up in {c.bring_up_seconds:.1f}s (port {c.port})")
    try:
        yield c
    finally:
        c.stop()
        left = c.leftovers()
        if c.proc.returncode != 0 or left:
            pytest.fail(f"cluster teardown: launcher exit {c.proc.returncode}, left behind: {left}")


@pytest.fixture(scope="package")
def kube(cluster: Cluster) -> Kube:
    return Kube(cluster.api())


def helm_binary() -> str:
    """helm 4, found as the chart tests find it (VGPU_HELM4, .ci/install-helm.sh's, PATH)."""
    found = deployment_helm.find(4)
    if found is None:
        pytest.skip(deployment_helm.missing_reason(4))
    return found.path


class Helm:
    def __init__(self, binary: str, cluster: Cluster) -> None:
        self.binary, self.cluster = binary, cluster

    def __call__(self, *args: str, timeout: float = 300) -> str:
        cmd = [self.binary, "--kubeconfig", str(self.cluster.kubeconfig), *args]
        env = dict(
            os.environ,
            HELM_CACHE_HOME=str(self.cluster.work / "helm"),
            HELM_CONFIG_HOME=str(self.cluster.work / "helm"),
            HELM_DATA_HOME=str(self.cluster.work / "helm"),
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {proc.returncode}:\n{proc.stderr}")
        return proc.stdout

    def install(self) -> None:
        self(
            "upgrade",
            "--install",
            RELEASE,
            str(CHART),
            "-n",
            PLUGIN_NS,
            "--create-namespace",
            "-f",
            str(VALUES),
        )  # readiness: wait_plugin_ready

    def uninstall(self) -> None:
        self("uninstall", RELEASE, "-n", PLUGIN_NS, "--wait", "--timeout", "2m")


@pytest.fixture(scope="package")
def helm(cluster: Cluster) -> Helm:
    return Helm(helm_binary(), cluster)


def plugin_pods(kube: Kube) -> list[object]:
    return list(kube.core.list_namespaced_pod(PLUGIN_NS).items)


def crash_looping(kube: Kube) -> None:
    """Fails with the plugin container's last log when it has exited twice."""
    for p in plugin_pods(kube):
        for s in p.status.container_statuses or []:  # type: ignore[attr-defined]
            if s.restart_count >= 2:
                log = kube.core.read_namespaced_pod_log(
                    p.metadata.name,  # type: ignore[attr-defined]
                    PLUGIN_NS,
                    container=s.name,
                    previous=True,
                )
                raise AssertionError(f"plugin container {s.name} crash-loops:\n{log[-4000:]}")


def wait_plugin_ready(kube: Kube, cluster: Cluster) -> None:
    """Both front ends up: the node's slice capacity and the driver's ResourceSlice."""

    def capacity() -> bool:
        crash_looping(kube)
        return kube.allocatable("nvidia.com/gpu") == str(SPLIT)

    wait_for(f"{SPLIT} nvidia.com/gpu allocatable", capacity, 180)
    wait_for("the driver's ResourceSlice", kube.resource_slices, 120)


@pytest.fixture
def plugin(cluster: Cluster, kube: Kube, helm: Helm) -> Iterator[Helm]:
    """The chart installed (once; again after a test uninstalled it) and both front ends up."""
    if not plugin_pods(kube):
        t0 = time.monotonic()
        try:
            helm.install()
        except AssertionError as exc:
            log = "\n".join(
                f"--- {p.metadata.name}: {p.status.phase}"
                for p in plugin_pods(kube)  # type: ignore[attr-defined]
            )
            raise AssertionError(f"{exc}\n{log}\n{cluster.log('kubelet')[-3000:]}") from exc
        _timing(f"chart installed in {time.monotonic() - t0:.1f}s")
    wait_plugin_ready(kube, cluster)
    yield helm


def plugin_status(kube: Kube) -> dict[str, Any]:
    """``vgpu-plugin status --json`` in the plugin's pod, as docs/operations.md runs it."""
    (p,) = plugin_pods(kube)
    out = kube.exec(
        p.metadata.name,  # type: ignore[attr-defined]
        ["vgpu-plugin", "status", "--json"],
        container="vgpu-plugin",
        namespace=PLUGIN_NS,
    )
    result: dict[str, Any] = json.loads(out)
    return result


def allocation_files(cluster: Cluster) -> set[str]:
    """The per-allocation files on the node: limits, container dirs, CDI specs."""
    found: set[str] = set()
    for d in (f"{HOST_ROOT}/limits", f"{HOST_ROOT}/containers", CDI_DIR):
        path: Path = cluster.node_path(d)
        if path.is_dir():
            found.update(f"{d}/{p.name}" for p in path.iterdir())
    return found


def upgrade(helm: Helm, *sets: str) -> None:
    """``helm upgrade`` of the release with the tier's values and ``--set`` each of ``sets``."""
    args = [a for s in sets for a in ("--set", s)]
    helm("upgrade", RELEASE, str(CHART), "-n", PLUGIN_NS, "-f", str(VALUES), *args)


def ready_plugin_pods(kube: Kube) -> list[Any]:
    return [
        p
        for p in plugin_pods(kube)
        if p.metadata.deletion_timestamp is None  # type: ignore[attr-defined]
        and any(s.ready for s in p.status.container_statuses or [])  # type: ignore[attr-defined]
    ]


@contextmanager
def in_node_pid_namespace(
    kube: Kube, cluster: Cluster, helm: Helm, *sets: str
) -> Iterator[Callable[[], Any]]:
    """The plugin upgraded to ``hostPID=true`` (and ``sets``), ready, for the block: yields
    the new plugin pod (a call, read when asked); afterwards the tier's values again, rolled
    out, so that the next test meets a plugin that stays."""
    (old,) = plugin_pods(kube)
    upgrade(helm, "hostPID=true", *sets)
    try:

        def moved() -> list[Any]:
            return [
                p
                for p in ready_plugin_pods(kube)
                if p.spec.host_pid and p.metadata.uid != old.metadata.uid  # type: ignore[attr-defined]
            ]

        wait_for("the plugin pod in the node's pid namespace, ready", moved, 180)
        wait_plugin_ready(kube, cluster)
        yield lambda: moved()[0]
    finally:
        helm.install()  # the tier's values: no hostPID

        def back() -> list[Any]:
            return [p for p in ready_plugin_pods(kube) if not p.spec.host_pid]  # type: ignore[attr-defined]

        wait_for("the plugin pod out of the node's pid namespace, ready", back, 180)
        wait_for("one plugin pod", lambda: len(plugin_pods(kube)) == 1, 120)
        wait_plugin_ready(kube, cluster)
