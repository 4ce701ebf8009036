"""A DRA kubelet over real gRPC, and an API server in memory, for the DRA driver's tests.

``DraKubeletEmulator`` does what the kubelet's plugin manager and DRA manager do with a
driver: it watches the plugin registry directory for sockets, asks each ``GetInfo``, checks
the answer (type ``DRAPlugin``, a service it speaks, a service socket that answers), reports
with ``NotifyRegistrationStatus``, and then calls ``NodePrepareResources`` /
``NodeUnprepareResources`` on the service socket, as ``v1`` or ``v1beta1``; ``watch_health``
opens the ``v1alpha1.DRAResourceHealth`` stream the kubelet opens to a driver that advertises
it, and keeps the latest health of each device. ``restart()``
behaves like a restarted kubelet: the node's ResourceSlices are deleted (in the fake API
server) and every driver is registered again.

``FakeApiServer`` holds ResourceClaims and ResourceSlices; it is the driver's
``ClaimReader`` and ``SlicePublisher``. ``allocate`` writes a claim's allocation the way the
scheduler does for consumable capacity (rounded up to the policy's step, the default where
the claim does not ask, a share ID per allocation).
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc

from vgpu_plugin.api.dra.v1 import api_pb2 as v1
from vgpu_plugin.api.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_plugin.api.dra.v1beta1 import api_pb2 as v1beta1
from vgpu_plugin.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2 as health_pb
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from vgpu_plugin.api.pluginregistration.v1 import api_pb2 as reg
from vgpu_plugin.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_plugin.core import dra
from vgpu_plugin.node.serving.kubeapi import ApiError

_KEEP_OFF = ("NoSchedule", "NoExecute")


class FakeApiServer:
    """ResourceClaims and ResourceSlices in memory, with the calls the driver makes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        self.publishes = 0
        self.claim_reads = 0
        self.fail_reads = False
        self.nodes: dict[str, str] = {}  # node name -> UID; a node is made on first read
        self.node_reads = 0
        self.fail_node_reads = False
        self.device_taints = True  # False: drops devices' taints, as with DRADeviceTaints off

    # --- what tests do ---------------------------------------------------------------------

    def add_claim(
        self, namespace: str, name: str, requests: Mapping[str, Mapping[str, str]]
    ) -> dict[str, Any]:
        """A claim with one request per entry: request name -> capacity requests."""
        claim = {
            "apiVersion": dra.API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": str(uuid.uuid4())},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": req,
                            "exactly": {
                                "deviceClassName": "vgpu.example.com",
                                **({"capacity": {"requests": dict(caps)}} if caps else {}),
                            },
                        }
                        for req, caps in requests.items()
                    ]
                }
            },
        }
        with self._lock:
            self.claims[(namespace, name)] = claim
        return claim

    def allocate(self, namespace: str, name: str, device: str, node: str = "") -> dict[str, Any]:
        """Allocate every request of the claim on ``device`` of the published slice; a device
        tainted NoSchedule or NoExecute is not allocated (claims here tolerate no taint)."""
        with self._lock:
            claim = self.claims[(namespace, name)]
            found = [
                (s, d)
                for s in self.slices.values()
                for d in s["spec"]["devices"]
                if d["name"] == device
                and (not node or s["spec"]["nodeName"] == node)
                and not any(t.get("effect") in _KEEP_OFF for t in d.get("taints") or [])
            ]
            if not found:
                raise LookupError(f"no published, untainted device {device}")
            sl, dev = found[0]
            results = []
            for req in claim["spec"]["devices"]["requests"]:
                asked = req["exactly"].get("capacity", {}).get("requests", {})
                consumed = {
                    cap: _consume(asked.get(cap), spec["requestPolicy"], spec["value"])
                    for cap, spec in dev["capacity"].items()
                }
                results.append(
                    {
                        "request": req["name"],
                        "driver": sl["spec"]["driver"],
                        "pool": sl["spec"]["pool"]["name"],
                        "device": device,
                        "consumedCapacity": consumed,
                        "shareID": str(uuid.uuid4()),
                    }
                )
            claim["status"] = {
                "allocation": {
                    "devices": {"results": results},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": [sl["spec"]["nodeName"]],
                                    }
                                ]
                            }
                        ]
                    },
                }
            }
            return copy.deepcopy(claim)

    def delete_node_slices(self, node: str) -> None:
        with self._lock:
            for name in [n for n, s in self.slices.items() if s["spec"].get("nodeName") == node]:
                del self.slices[name]

    # --- what the driver calls -------------------------------------------------------------

    def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._lock:
            self.claim_reads += 1
            if self.fail_reads:
                raise ApiError(f"GET claim {namespace}/{name}: timed out")
            try:
                return copy.deepcopy(self.claims[(namespace, name)])
            except KeyError:
                raise ApiError(f"GET claim {namespace}/{name}: 404 Not Found", 404) from None

    def node_uid(self, name: str) -> str:
        with self._lock:
            self.node_reads += 1
            if self.fail_node_reads:
                raise ApiError(f"GET node {name}: timed out")
            return self.nodes.setdefault(name, str(uuid.uuid4()))

    def delete_node(self, name: str) -> None:
        """The node goes, and with it (as the garbage collector does) every slice it owns."""
        with self._lock:
            uid = self.nodes.pop(name, None)
            for key in [
                k
                for k, s in self.slices.items()
                if any(o.get("uid") == uid for o in s["metadata"].get("ownerReferences", []))
            ]:
                del self.slices[key]

    def publish(self, resource_slice: Mapping[str, Any]) -> Mapping[str, Any]:
        stored = copy.deepcopy(dict(resource_slice))
        if not self.device_taints:
            for d in stored["spec"]["devices"]:
                d.pop("taints", None)
        with self._lock:
            self.publishes += 1
            self.slices[stored["metadata"]["name"]] = stored
            return copy.deepcopy(stored)

    def delete(self, name: str) -> None:
        with self._lock:
            self.slices.pop(name, None)

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self.slices


def _consume(asked: str | None, policy: Mapping[str, Any], total: str) -> str:
    """What the scheduler puts in consumedCapacity: the default when not asked, else the
    request rounded up to min + a multiple of step (quantities as plain numbers)."""
    if asked is None:
        return str(policy["default"])
    value = dra.parse_quantity(asked)
    valid = policy["validRange"]
    lo, step = dra.parse_quantity(valid["min"]), dra.parse_quantity(valid["step"])
    value = max(value, lo)
    value = lo + math.ceil((value - lo) / step) * step
    if value > dra.parse_quantity(valid.get("max", total)):
        raise ValueError(f"cannot allocate {asked}: over the device's {total}")
    return str(int(value))


@dataclass
class DriverRegistration:
    name: str
    endpoint: str
    versions: tuple[str, ...]


class DraKubeletEmulator:
    """The kubelet's side of a DRA driver: registration from the registry dir, then calls."""

    def __init__(
        self,
        registry_dir: Path | str,
        node_name: str = "node-a",
        api: FakeApiServer | None = None,
        *,
        poll_interval: float = 0.1,
        call_timeout: float = 10.0,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.node_name = node_name
        self.api = api
        self._poll = poll_interval
        self._timeout = call_timeout
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._seen: dict[Path, int] = {}  # socket -> inode registered
        self.drivers: dict[str, DriverRegistration] = {}
        self.rejected: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def restart(self) -> None:
        """A kubelet restart: the node's slices go, every driver registers again."""
        self.stop()
        with self._lock:
            self._seen.clear()
            self.drivers.clear()
        if self.api is not None:
            self.api.delete_node_slices(self.node_name)
        self.start()

    def __enter__(self) -> DraKubeletEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_registered(self, driver: str, timeout: float = 10.0) -> DriverRegistration:
        with self._cond:
            if not self._cond.wait_for(lambda: driver in self.drivers, timeout):
                raise TimeoutError(
                    f"DRA driver {driver} did not register in {timeout}s; rejected: {self.rejected}"
                )
            return self.drivers[driver]

    def _watch(self) -> None:
        while not self._stop.is_set():
            for path in sorted(self.registry_dir.glob("*.sock")):
                try:
                    inode = path.stat().st_ino
                except FileNotFoundError:
                    continue
                if self._seen.get(path) == inode:
                    continue
                self._seen[path] = inode
                self._register(path)
            self._stop.wait(self._poll)

    def _register(self, path: Path) -> None:
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
                info = stub.GetInfo(reg.InfoRequest(), timeout=self._timeout)
                problem = self._check(info)
                stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=problem is None, error=problem or ""),
                    timeout=self._timeout,
                )
        except grpc.RpcError as exc:
            self.rejected.append(f"{path}: {exc}")
            return
        if problem is not None:
            self.rejected.append(problem)
            return
        with self._cond:
            self.drivers[info.name] = DriverRegistration(
                info.name, info.endpoint, tuple(info.supported_versions)
            )
            self._cond.notify_all()

    def _check(self, info: Any) -> str | None:
        if info.type != dra.PLUGIN_TYPE:
            return f"plugin type {info.type!r} is not {dra.PLUGIN_TYPE}"
        if not ({dra.SERVICE_V1, dra.SERVICE_V1BETA1} & set(info.supported_versions)):
            return f"{info.name}: no DRA service this kubelet speaks in {info.supported_versions}"
        if not Path(info.endpoint).is_socket():
            return f"{info.name}: endpoint {info.endpoint} is not a socket"
        return None

    def _stub(self, driver: str, version: str) -> tuple[Any, Any, Any]:
        r = self.drivers.get(driver)
        if r is None:
            raise LookupError(f"DRA driver {driver} is not registered")
        channel = grpc.insecure_channel(f"unix://{r.endpoint}")
        if version == "v1":
            return channel, v1_grpc.DRAPluginStub(channel), v1  # type: ignore[no-untyped-call]
        return channel, v1beta1_grpc.DRAPluginStub(channel), v1beta1  # type: ignore[no-untyped-call]

    def prepare(self, driver: str, *claims: Mapping[str, Any], version: str = "v1") -> Any:
        """NodePrepareResources for the claims (objects with metadata namespace/name/uid)."""
        channel, stub, pb = self._stub(driver, version)
        with channel:
            return stub.NodePrepareResources(
                pb.NodePrepareResourcesRequest(claims=[_ref(pb, c) for c in claims]),
                timeout=self._timeout,
            )

    def unprepare(self, driver: str, *claims: Mapping[str, Any], version: str = "v1") -> Any:
        channel, stub, pb = self._stub(driver, version)
        with channel:
            return stub.NodeUnprepareResources(
                pb.NodeUnprepareResourcesRequest(claims=[_ref(pb, c) for c in claims]),
                timeout=self._timeout,
            )

    def watch_health(self, driver: str) -> HealthWatch:
        """The health stream a negotiating kubelet opens: only to a driver that lists the
        service at registration (LookupError otherwise)."""
        r = self.drivers.get(driver)
        if r is None:
            raise LookupError(f"DRA driver {driver} is not registered")
        if dra.SERVICE_HEALTH not in r.versions:
            raise LookupError(f"DRA driver {driver} does not advertise {dra.SERVICE_HEALTH}")
        return HealthWatch(r.endpoint)


class HealthWatch:
    """One ``NodeWatchResources`` stream, read by a thread: every message it got, the
    latest health by ``pool/device``, and how the stream ended (``None`` while open, ``"ok"``
    when the driver ended it, else the gRPC status code's name)."""

    def __init__(self, endpoint: str) -> None:
        self._channel = grpc.insecure_channel(f"unix://{endpoint}")
        stub = health_grpc.DRAResourceHealthStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest())
        self._cond = threading.Condition()
        self.messages: list[Any] = []
        self.ended: str | None = None
        self._thread = threading.Thread(target=self._read, name="dra-health", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                with self._cond:
                    self.messages.append(message)
                    self._cond.notify_all()
            end = "ok"
        except grpc.RpcError as exc:
            end = exc.code().name
        with self._cond:
            self.ended = end
            self._cond.notify_all()

    def health(self) -> dict[str, tuple[str, str]]:
        """The latest message: ``pool/device`` -> (HEALTHY|UNHEALTHY|UNKNOWN, message)."""
        with self._cond:
            if not self.messages:
                return {}
            last = self.messages[-1]
        return {
            f"{d.device.pool_name}/{d.device.device_name}": (
                health_pb.HealthStatus.Name(d.health),
                d.message,
            )
            for d in last.devices
        }

    def wait_for(self, what: str, check: Any, timeout: float = 10.0) -> None:
        """Until ``check(self)`` is true after a message or the end (TimeoutError naming
        ``what`` and the messages so far)."""
        with self._cond:
            if not self._cond.wait_for(lambda: check(self), timeout):
                raise TimeoutError(f"health stream: no {what} in {timeout}s: {self.messages}")

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()


def _ref(pb: Any, claim: Mapping[str, Any]) -> Any:
    m = claim["metadata"]
    return pb.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])


class FakeApiHttp:
    """``FakeApiServer`` over HTTP, for a driver in another process (``vgpu-plugin serve``):
    the few ``resource.k8s.io/v1`` calls ``node/serving/kubeapi.py`` makes, through the real
    ``kubernetes`` client, and a kubeconfig file that points at it (``write_kubeconfig``)."""

    _CLAIM = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)$")
    _SLICES = "/apis/resource.k8s.io/v1/resourceslices"
    _NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")

    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.calls: list[str] = []
        self.tokens: list[str] = []  # each call's Authorization header ("" when none)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            # Connections kept alive, as a real API server keeps the client's (HTTP/1.0 made
            # every read a new connection and a new server thread: a cost no cluster has).
            protocol_version = "HTTP/1.1"
            # The headers and the body are two writes: Nagle would hold the body for the
            # client's delayed ACK (40 ms) on a kept connection.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _handle(self) -> None:
                method, path = self.command, self.path.split("?")[0]
                outer.calls.append(f"{method} {path}")
                outer.tokens.append(self.headers.get("Authorization", ""))
                found = outer._CLAIM.match(path)
                node = outer._NODE.match(path)
                name = path.removeprefix(outer._SLICES + "/") if path != outer._SLICES else ""
                try:
                    if method == "GET" and node:
                        uid = api.node_uid(node.group(1))
                        self._answer(
                            200, {"kind": "Node", "metadata": {"name": node.group(1), "uid": uid}}
                        )
                    elif method == "GET" and found:
                        self._answer(200, dict(api.get_claim(found.group(1), found.group(2))))
                    elif method == "GET" and name and name in api.slices:
                        body = copy.deepcopy(api.slices[name])
                        body["metadata"]["resourceVersion"] = str(api.publishes)
                        self._answer(200, body)
                    elif method in ("POST", "PUT") and path.startswith(outer._SLICES):
                        stored = api.publish(self._body())
                        self._answer(201 if method == "POST" else 200, dict(stored))
                    elif method == "DELETE" and name:
                        api.delete(name)
                        self._answer(200, {"kind": "Status", "status": "Success"})
                    else:
                        self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                except ApiError as exc:
                    self._answer(exc.status or 500, {"kind": "Status", "message": str(exc)})

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeApiHttp:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "driver", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "driver"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path
