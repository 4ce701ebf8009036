"""The pod-resources client against a real gRPC server on a unix socket, as the kubelet serves."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from vgpu_plugin.api.podresources.v1 import api_pb2 as pb
from vgpu_plugin.api.podresources.v1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.core.pods import PodRef, PodResourcesUnavailable
from vgpu_plugin.kubelet.podresources import allocatable_devices, list_assignments
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir

RES = "nvidia.com/gpu"


class FakeLister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    """Answers with whatever the test put in ``pods`` / ``allocatable``."""

    def __init__(self) -> None:
        self.pods: list[pb.PodResources] = []
        self.allocatable: list[pb.ContainerDevices] | None = []
        self.fail: grpc.StatusCode | None = None
        self.hang = threading.Event()
        self.release = threading.Event()

    def List(self, request: Any, context: Any) -> pb.ListPodResourcesResponse:
        if self.fail is not None:
            context.abort(self.fail, "kubelet says no")
        if self.hang.is_set():
            self.release.wait(60)  # past the tests' 30 s bounds: a deadline ignored shows
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        if self.allocatable is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "feature gate off")
        return pb.AllocatableResourcesResponse(devices=self.allocatable)


def pod(ns: str, name: str, *containers: tuple[str, list[tuple[str, list[str]]]]) -> Any:
    return pb.PodResources(
        namespace=ns,
        name=name,
        containers=[
            pb.ContainerResources(
                name=c,
                devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devs],
            )
            for c, devs in containers
        ],
    )


@pytest.fixture
def kubelet() -> Iterator[tuple[FakeLister, Path]]:
    tmp = short_tmp_dir("pr-")
    sock = tmp / "kubelet.sock"
    lister = FakeLister()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield lister, sock
    finally:
        lister.release.set()
        server.stop(grace=None).wait(5)
        shutil.rmtree(tmp, ignore_errors=True)


def test_lists_which_container_holds_each_device(kubelet: tuple[FakeLister, Path]) -> None:
    lister, sock = kubelet
    lister.pods = [
        pod("ml", "infer-a", ("server", [(RES, ["GPU-a-0", "GPU-a-1"]), ("cpu/x", ["c0"])])),
        pod(
            "ml",
            "train-b",
            ("main", [(RES, ["GPU-b-3"])]),
            ("sidecar", [("other.com/gpu", ["GPU-b-9"])]),
        ),
        pod("kube-system", "no-gpus", ("app", [])),
    ]
    got = list_assignments(sock, RES, timeout=5)
    assert got == {
        "GPU-a-0": PodRef("ml", "infer-a", "server"),
        "GPU-a-1": PodRef("ml", "infer-a", "server"),
        "GPU-b-3": PodRef("ml", "train-b", "main"),
    }
    assert list_assignments(sock, "other.com/gpu", timeout=5) == {
        "GPU-b-9": PodRef("ml", "train-b", "sidecar")
    }
    assert str(got["GPU-b-3"]) == "ml/train-b/main"


def test_allocatable_devices(kubelet: tuple[FakeLister, Path]) -> None:
    lister, sock = kubelet
    lister.allocatable = [
        pb.ContainerDevices(resource_name=RES, device_ids=["GPU-a-1", "GPU-a-0"]),
        pb.ContainerDevices(resource_name="x.io/y", device_ids=["z"]),
    ]
    assert allocatable_devices(sock, RES, timeout=5) == ["GPU-a-0", "GPU-a-1"]
    lister.allocatable = None
    with pytest.raises(PodResourcesUnavailable, match="UNIMPLEMENTED"):
        allocatable_devices(sock, RES, timeout=5)


def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesUnavailable, match="does not exist"):
        list_assignments(tmp_path / "kubelet.sock", RES, timeout=1)


def test_a_socket_nobody_serves_is_unavailable_within_the_timeout() -> None:
    tmp = short_tmp_dir("pr-")
    try:
        sock = tmp / "kubelet.sock"
        # What a dead kubelet leaves behind: the socket file, nobody listening.
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(sock))
        s.close()
        start = time.monotonic()
        with pytest.raises(PodResourcesUnavailable):
            list_assignments(sock, RES, timeout=1)
        assert time.monotonic() - start < 30  # bounded: far from a hang, far from load's delays
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_errors_and_hangs_are_unavailable(kubelet: tuple[FakeLister, Path]) -> None:
    lister, sock = kubelet
    lister.fail = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE: kubelet says no"):
        list_assignments(sock, RES, timeout=5)
    lister.fail = None
    lister.hang.set()
    start = time.monotonic()
    with pytest.raises(PodResourcesUnavailable, match="DEADLINE_EXCEEDED"):
        list_assignments(sock, RES, timeout=0.3)
    assert time.monotonic() - start < 30  # the 0.3 s deadline, not the 60 s hang, ended it
