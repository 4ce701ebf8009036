"""node/serving/kubeapi.py over HTTP: the calls the DRA driver makes, through the real
``kubernetes`` client's connection pool and a kubeconfig, against the fake API server
(sim/dra_kubelet.py's FakeApiHttp). The real API server answers the same calls in the cluster
tier (tests/cluster/test_dra.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes client is the dra extra's")

from vgpu_plugin.node.serving.kubeapi import ApiError, KubeApi
from vgpu_plugin.sim.dra_kubelet import FakeApiHttp, FakeApiServer


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FakeApiServer, FakeApiHttp, KubeApi]]:
    api = FakeApiServer()
    http = FakeApiHttp(api).start()
    try:
        yield api, http, KubeApi(timeout=5, kubeconfig=str(http.write_kubeconfig(tmp_path / "kc")))
    finally:
        http.stop()


def test_a_claim_is_read_with_the_kubeconfigs_token(
    served: tuple[FakeApiServer, FakeApiHttp, KubeApi],
) -> None:
    api, http, kube = served
    claim = api.add_claim("ns", "c", {"gpu": {"memory": "1Gi"}})
    for _ in range(3):
        assert kube.get_claim("ns", "c") == claim
    assert http.calls == ["GET /apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"] * 3
    assert http.tokens == ["Bearer fake"] * 3


def test_an_error_status_is_an_api_error_with_the_status(
    served: tuple[FakeApiServer, FakeApiHttp, KubeApi],
) -> None:
    _, _, kube = served
    with pytest.raises(ApiError) as caught:
        kube.get_claim("ns", "missing")
    assert caught.value.status == 404
    assert str(caught.value) == (
        "GET /apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/missing: 404 Not Found"
    )


def test_a_slice_is_created_then_replaced_then_deleted(
    served: tuple[FakeApiServer, FakeApiHttp, KubeApi],
) -> None:
    api, http, kube = served
    body = {"metadata": {"name": "node-1-vgpu"}, "spec": {"nodeName": "node-1", "devices": []}}
    kube.publish(body)
    kube.publish(body)
    assert kube.exists("node-1-vgpu")
    kube.delete("node-1-vgpu")
    kube.delete("node-1-vgpu")  # a missing one is fine
    assert not kube.exists("node-1-vgpu")
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    assert http.calls == [
        f"GET {slices}/node-1-vgpu",
        f"POST {slices}",
        f"GET {slices}/node-1-vgpu",
        f"PUT {slices}/node-1-vgpu",
        f"GET {slices}/node-1-vgpu",
        f"DELETE {slices}/node-1-vgpu",
        f"DELETE {slices}/node-1-vgpu",
        f"GET {slices}/node-1-vgpu",
    ]
    assert api.publishes == 2 and not api.slices


def test_a_server_that_does_not_answer_is_an_api_error_within_the_timeout(
    tmp_path: Path,
) -> None:
    """A listener that accepts and never answers: the read's timeout, not a hang."""
    with socket.create_server(("127.0.0.1", 0)) as quiet:
        port = quiet.getsockname()[1]
        kc = tmp_path / "kc"
        kc.write_text(
            '{"apiVersion": "v1", "kind": "Config", "current-context": "q",'
            f' "clusters": [{{"name": "q", "cluster": {{"server": "http://127.0.0.1:{port}"}}}}],'
            ' "users": [{"name": "u", "user": {"token": "t"}}],'
            ' "contexts": [{"name": "q", "context": {"cluster": "q", "user": "u"}}]}'
        )
        kube = KubeApi(timeout=0.5, kubeconfig=str(kc))
        t0 = time.monotonic()
        with pytest.raises(ApiError) as caught:
            kube.get_claim("ns", "c")
        assert time.monotonic() - t0 < 30
    assert caught.value.status is None
    assert "GET /apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c: ReadTimeoutError" in str(
        caught.value
    )
