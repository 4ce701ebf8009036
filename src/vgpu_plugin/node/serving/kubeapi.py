"""The DRA driver's access to the API server: read a ResourceClaim, publish the node's
ResourceSlice. The one module that imports the ``kubernetes`` client, and only when a real
``KubeApi`` is made, so tests (and the device plugin alone) never need a cluster.

``ClaimReader`` and ``SlicePublisher`` are what the driver needs; tests feed claims and catch
slices through their own implementations (``sim/dra_kubelet.py``'s ``FakeApiServer``).

Every call carries a timeout (``timeout`` seconds, connect and read): NodePrepareResources
waits on the claim read, and the kubelet waits on NodePrepareResources.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

RESOURCE_API = "/apis/resource.k8s.io/v1"
# How long a read bearer token is used before the client is asked again: well inside the
# in-cluster loader's one-minute re-read and a projected token's hour.
AUTH_REFRESH_S = 10.0


class ApiError(RuntimeError):
    """The API server did not answer as needed; the message says what was asked and why not."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ClientMissing(RuntimeError):
    """The ``kubernetes`` client is not installed: it comes with the ``dra`` extra only."""


# One line for the log (docs/operations.md, exit codes of serve): what is missing and how to
# get it, rather than an ImportError's traceback.
CLIENT_MISSING = (
    "dra.enabled needs the kubernetes client, which this installation lacks ({error}): "
    "install vgpu-plugin[dra] (the image: build it with --build-arg DRA=true), "
    "or set dra.enabled: false"
)


def _client_modules() -> tuple[Any, Any]:
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ClientMissing(CLIENT_MISSING.format(error=exc)) from exc
    return client, config


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The ResourceClaim as the API server has it now (a JSON object); ApiError."""
        ...


class SlicePublisher(Protocol):
    def node_uid(self, name: str) -> str:
        """The UID of Node ``name``, for the slice's ownerReference; ApiError."""
        ...

    def publish(self, resource_slice: Mapping[str, Any]) -> Mapping[str, Any]:
        """Create the ResourceSlice, or replace the one of that name: the slice as stored
        (without the fields the API server does not keep); ApiError."""
        ...

    def delete(self, name: str) -> None:
        """Delete the ResourceSlice; a missing one is fine. ApiError."""
        ...

    def exists(self, name: str) -> bool:
        """Whether the API server has the ResourceSlice ``name``; ApiError."""
        ...


class KubeApi:
    """``ClaimReader`` and ``SlicePublisher`` over the ``kubernetes`` client: in-cluster
    credentials (the DaemonSet's service account) unless a kubeconfig file is given."""

    def __init__(self, timeout: float = 10.0, kubeconfig: str | None = None) -> None:
        client, config = _client_modules()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
        api: Any = client.ApiClient()
        self._config: Any = api.configuration
        # Requests go straight to the client's connection pool (its TLS, client certificate
        # and proxy settings), not through the generated call path, which re-reads the
        # proxy environment on every request (a pod's environment holds variables for every
        # Service of its namespace) on top of its own serialising.
        self._pool: Any = api.rest_client.pool_manager
        self._host: str = self._config.host.rstrip("/")
        self._timeout = timeout
        self._auth: dict[str, str] = {}
        self._auth_at: float | None = None

    def _auth_headers(self) -> dict[str, str]:
        """The bearer token as the client has it, asked at most every AUTH_REFRESH_S: the
        client's refresh hook re-reads the token file when due and re-applies every setting
        on each ask (the proxy environment too)."""
        now = time.monotonic()
        if self._auth_at is None or now - self._auth_at >= AUTH_REFRESH_S:
            auth = self._config.auth_settings().values()
            self._auth = {
                a["key"]: a["value"] for a in auth if a.get("in") == "header" and a.get("value")
            }
            self._auth_at = now
        return self._auth

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import urllib3

        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        headers.update(self._auth_headers())
        try:
            resp = self._pool.request(
                method,
                self._host + path,
                body=None if body is None else json.dumps(body),
                headers=headers,
                timeout=urllib3.Timeout(connect=self._timeout, read=self._timeout),
                retries=False,
            )
        except Exception as exc:  # urllib3's timeouts and connection errors, among others
            raise ApiError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status == 401:
            self._auth_at = None  # a token renewed early: read it again next time
        if not 200 <= resp.status < 300:
            raise ApiError(f"{method} {path}: {resp.status} {resp.reason}", resp.status)
        try:
            return json.loads(resp.data or b"null")
        except ValueError as exc:
            raise ApiError(f"{method} {path}: the answer is not JSON: {exc}") from exc

    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        claim = self._call("GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")
        if not isinstance(claim, dict):
            raise ApiError(f"claim {namespace}/{name}: the API server answered no object")
        return claim

    def node_uid(self, name: str) -> str:
        node = self._call("GET", f"/api/v1/nodes/{name}")
        uid = node.get("metadata", {}).get("uid") if isinstance(node, dict) else None
        if not isinstance(uid, str) or not uid:
            raise ApiError(f"node {name}: the API server answered no metadata.uid")
        return uid

    def publish(self, resource_slice: Mapping[str, Any]) -> Mapping[str, Any]:
        name = resource_slice["metadata"]["name"]
        path = f"{RESOURCE_API}/resourceslices/{name}"
        try:
            current = self._call("GET", path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return _stored(
                self._call("POST", f"{RESOURCE_API}/resourceslices", dict(resource_slice))
            )
        body = dict(resource_slice)
        body["metadata"] = {
            **resource_slice["metadata"],
            "resourceVersion": current["metadata"]["resourceVersion"],
        }
        return _stored(self._call("PUT", path, body))

    def exists(self, name: str) -> bool:
        try:
            self._call("GET", f"{RESOURCE_API}/resourceslices/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            return False
        return True

    def delete(self, name: str) -> None:
        try:
            self._call("DELETE", f"{RESOURCE_API}/resourceslices/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise


def _stored(answer: Any) -> Mapping[str, Any]:
    if not isinstance(answer, dict):
        raise ApiError("ResourceSlice: the API server answered no object")
    return answer
