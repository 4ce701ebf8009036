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
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

RESOURCE_API = "/apis/resource.k8s.io/v1"


class ApiError(RuntimeError):
    """The API server did not answer as needed; the message says what was asked and why not."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The ResourceClaim as the API server has it now (a JSON object); ApiError."""
        ...


class SlicePublisher(Protocol):
    def publish(self, resource_slice: Mapping[str, Any]) -> None:
        """Create the ResourceSlice, or replace the one of that name; ApiError."""
        ...

    def delete(self, name: str) -> None:
        """Delete the ResourceSlice; a missing one is fine. ApiError."""
        ...


class KubeApi:
    """``ClaimReader`` and ``SlicePublisher`` over the ``kubernetes`` client: in-cluster
    credentials (the DaemonSet's service account) unless a kubeconfig file is given."""

    def __init__(self, timeout: float = 10.0, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        self._api: Any = client.ApiClient()
        self._timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._api.call_api(
                path,
                method,
                body=body,
                header_params={"Accept": "application/json", "Content-Type": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=(self._timeout, self._timeout),
            )
        except ApiException as exc:
            raise ApiError(f"{method} {path}: {exc.status} {exc.reason}", exc.status) from exc
        except Exception as exc:  # urllib3's timeouts and connection errors, among others
            raise ApiError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        return json.loads(resp[0].data or b"null")

    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        claim = self._call("GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")
        if not isinstance(claim, dict):
            raise ApiError(f"claim {namespace}/{name}: the API server answered no object")
        return claim

    def publish(self, resource_slice: Mapping[str, Any]) -> None:
        name = resource_slice["metadata"]["name"]
        path = f"{RESOURCE_API}/resourceslices/{name}"
        try:
            current = self._call("GET", path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            self._call("POST", f"{RESOURCE_API}/resourceslices", dict(resource_slice))
            return
        body = dict(resource_slice)
        body["metadata"] = {
            **resource_slice["metadata"],
            "resourceVersion": current["metadata"]["resourceVersion"],
        }
        self._call("PUT", path, body)

    def delete(self, name: str) -> None:
        try:
            self._call("DELETE", f"{RESOURCE_API}/resourceslices/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
