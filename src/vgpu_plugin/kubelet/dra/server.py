"""The DRA driver's gRPC edge: plugin registration and the DRAPlugin service (v1, v1beta1).

- The **service socket** ``<plugins dir>/<driver>/dra.sock`` serves ``v1.DRAPlugin``,
  ``v1beta1.DRAPlugin`` and ``v1alpha1.DRAResourceHealth`` (the kubelet's device health
  streams, ``health.py``).
- The **registration socket** ``<registry dir>/<driver>-reg.sock`` serves
  ``pluginregistration.Registration``: the kubelet's plugin watcher finds it, asks
  ``GetInfo`` (type ``DRAPlugin``, the driver name, the service socket, the service names) and
  reports with ``NotifyRegistrationStatus``. A kubelet that restarts finds the socket again
  and registers the driver anew, having deleted the node's ResourceSlices: the driver
  republishes on every successful registration (``on_registered``).

A supervisor thread re-serves when either socket file disappears (a kubelet that wipes its
directories), so the driver does not depend on being restarted with the kubelet.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from vgpu_plugin.api.dra.v1 import api_pb2 as v1
from vgpu_plugin.api.dra.v1 import api_pb2_grpc as v1_grpc
from vgpu_plugin.api.dra.v1beta1 import api_pb2 as v1beta1
from vgpu_plugin.api.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from vgpu_plugin.api.pluginregistration.v1 import api_pb2 as reg
from vgpu_plugin.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vgpu_plugin.core import dra
from vgpu_plugin.kubelet import peers
from vgpu_plugin.kubelet.dra.driver import ClaimRef, DraDriver
from vgpu_plugin.kubelet.dra.health import MAX_STREAMS, HealthServicer, HealthStreams
from vgpu_plugin.kubelet.dra.queue import (
    KUBELET_DEADLINE_S,
    PrepareQueue,
    QueueFull,
    StillPreparing,
)
from vgpu_plugin.kubelet.peers import (
    INVALID_REQUEST,
    PREPARE_QUEUE_FULL,
    server_limits,
    tame_grpc_logs,
)
from vgpu_plugin.kubelet.watch import FileId, file_id

log = logging.getLogger(__name__)

SERVICE_SOCKET = "dra.sock"


class _Calls:
    """NodePrepareResources and NodeUnprepareResources for both API versions: prepares go
    through the bounded queue (``queue.py``) and every claim is answered before the caller's
    deadline; at most ``waiters`` calls wait on the queue at once, so the server's other
    threads stay free for unprepares and registration."""

    def __init__(self, driver: DraDriver, queue: PrepareQueue[Any], waiters: int) -> None:
        self.driver = driver
        self.queue = queue
        self._waiters = threading.BoundedSemaphore(waiters)
        self._told: set[str] = set()  # claims whose slow prepare was logged
        self._told_lock = threading.Lock()

    def _tell_once(self, uid: str, job: Future[Any], message: str) -> None:
        """Logs a slow prepare once per job, not once per call: retries, or a peer asking in
        a loop, add no lines."""
        with self._told_lock:
            if uid in self._told:
                return
            self._told.add(uid)
        job.add_done_callback(lambda _: self._forget_told(uid))
        log.warning("%s", message)

    def _forget_told(self, uid: str) -> None:
        with self._told_lock:
            self._told.discard(uid)

    def prepare(self, request: Any, pb: Any, with_share_id: bool, context: Any) -> Any:
        answer_by = _answer_by(context)
        out = pb.NodePrepareResourcesResponse()
        jobs = []
        # Only so many calls wait; the others answer at once, so threads stay free.
        waiting = self._waiters.acquire(blocking=False)
        try:
            for c in request.claims:
                entry = out.claims[c.uid]
                ref = ClaimRef(c.namespace, c.uid, c.name)
                left = answer_by - time.monotonic() if waiting else 0.0
                try:
                    job = self.queue.submit(c.uid, partial(self.driver.prepare, ref), left)
                except QueueFull as exc:
                    entry.error = f"cannot prepare claim {c.namespace}/{c.name} now: {exc}; retry"
                    peers.PEER_ERRORS.note(PREPARE_QUEUE_FULL, "%s", entry.error)
                    continue
                jobs.append((ref, entry, job))
            for ref, entry, job in jobs:
                try:
                    left = answer_by - time.monotonic() if waiting else 0.0
                    devices = self.queue.wait(job, left)
                except StillPreparing:
                    entry.error = (
                        f"claim {ref.namespace}/{ref.name} is still being prepared (the API"
                        " server is slow to answer); a retry gets the result"
                    )
                    self._tell_once(ref.uid, job, entry.error)
                    continue
                except dra.ClaimError as exc:  # what the claim says: any peer can name one
                    peers.PEER_ERRORS.note(
                        INVALID_REQUEST,
                        "cannot prepare claim %s/%s: %s",
                        ref.namespace,
                        ref.name,
                        exc,
                    )
                    entry.error = str(exc)
                    continue
                except ValueError as exc:
                    log.error("cannot prepare claim %s/%s: %s", ref.namespace, ref.name, exc)
                    entry.error = str(exc)
                    continue
                except Exception as exc:  # a bug: the claim fails, the others are answered
                    log.error("cannot prepare claim %s/%s: %r", ref.namespace, ref.name, exc)
                    entry.error = f"cannot prepare claim {ref.namespace}/{ref.name}: {exc}"
                    continue
                for d in devices:
                    fields: dict[str, Any] = {
                        "request_names": list(d.request_names),
                        "pool_name": d.pool_name,
                        "device_name": d.device_name,
                        "cdi_device_ids": list(d.cdi_device_ids),
                    }
                    if with_share_id and d.share_id:  # optional upstream: unset, not ""
                        fields["share_id"] = d.share_id
                    entry.devices.append(pb.Device(**fields))
        finally:
            if waiting:
                self._waiters.release()
        return out

    def unprepare(self, request: Any, pb: Any, context: Any) -> Any:
        answer_by = _answer_by(context)
        out = pb.NodeUnprepareResourcesResponse()
        waiting = self._waiters.acquire(blocking=False)  # waits count as prepares' do
        try:
            for c in request.claims:
                entry = out.claims[c.uid]
                try:
                    # A prepare still in flight would land after this unprepare: settle it.
                    left = answer_by - time.monotonic() if waiting else 0.0
                    self.queue.settle(c.uid, left)
                    self.driver.unprepare(ClaimRef(c.namespace, c.uid, c.name))
                except StillPreparing:
                    entry.error = f"claim {c.namespace}/{c.name} is still being prepared; retry"
                    log.warning("cannot unprepare yet: %s", entry.error)
                except (OSError, ValueError) as exc:
                    log.error("cannot unprepare claim %s/%s: %s", c.namespace, c.name, exc)
                    entry.error = str(exc)
        finally:
            if waiting:
                self._waiters.release()
        return out


def _answer_by(context: Any) -> float:
    """When (monotonic) to answer: a tenth (at least half a second) before the caller's
    deadline, the kubelet's 45 s where the call carries none."""
    remaining = context.time_remaining() if context is not None else None
    if remaining is None or remaining > KUBELET_DEADLINE_S:
        remaining = KUBELET_DEADLINE_S
    return time.monotonic() + remaining - max(0.5, remaining / 10)


class _V1(v1_grpc.DRAPluginServicer):
    def __init__(self, calls: _Calls) -> None:
        self._calls = calls

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return self._calls.prepare(request, v1, True, context)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return self._calls.unprepare(request, v1, context)


class _V1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, calls: _Calls) -> None:
        self._calls = calls

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return self._calls.prepare(request, v1beta1, False, context)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return self._calls.unprepare(request, v1beta1, context)


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, server: DraServer) -> None:
        self._server = server

    def GetInfo(self, request: Any, context: Any) -> Any:
        return reg.PluginInfo(
            type=dra.PLUGIN_TYPE,
            name=self._server.driver.driver_name,
            endpoint=str(self._server.service_socket),
            # The health service too: a kubelet that negotiates opens its stream only then.
            supported_versions=[dra.SERVICE_V1, dra.SERVICE_V1BETA1, dra.SERVICE_HEALTH],
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self._server.registration_status(bool(request.plugin_registered), request.error)
        return reg.RegistrationStatusResponse()


class DraServer:
    """Serves the driver's two sockets and keeps them there."""

    def __init__(
        self,
        driver: DraDriver,
        registry_dir: Path | str = dra.REGISTRY_DIR,
        plugins_dir: Path | str = dra.PLUGINS_DIR,
        *,
        on_registered: Callable[[], object] | None = None,
        poll_interval: float = 0.5,
        max_workers: int = 8,
        prepare_workers: int = 2,
        queue_capacity: int = 64,
        health_streams: int = MAX_STREAMS,
    ) -> None:
        if max_workers < 3:
            raise ValueError(f"max_workers {max_workers}: the DRA server needs at least 3")
        self.driver = driver
        self.registry_dir = Path(registry_dir)
        self.service_socket = Path(plugins_dir) / driver.driver_name / SERVICE_SOCKET
        self.registration_socket = self.registry_dir / f"{driver.driver_name}-reg.sock"
        self._on_registered = on_registered
        self._poll = poll_interval
        self._max_workers = max_workers
        self._grpc: Any = None
        self._own: dict[Path, FileId | None] = {}  # the socket files this process made
        self._stopping = threading.Event()
        self._registered = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.registrations = 0
        self.queue: PrepareQueue[Any] = PrepareQueue(prepare_workers, queue_capacity)
        # Two threads stay free of waiting prepares: for unprepares and registration.
        self._calls = _Calls(driver, self.queue, max_workers - 2)
        # Each open health stream holds a thread of its own: the pool has one more per stream,
        # so streams never take the prepares' threads.
        self.health = HealthStreams(driver.device_health, max_streams=health_streams)
        self._health_streams = health_streams
        driver.on_health_change(self.health.changed)

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def registration_status(self, registered: bool, error: str) -> None:
        if not registered:
            self._registered.clear()
            log.error("the kubelet refused DRA driver %s: %s", self.driver.driver_name, error)
            return
        self.registrations += 1
        log.info("DRA driver %s registered with the kubelet", self.driver.driver_name)
        if self._on_registered is not None:
            # The kubelet deletes the node's slices when it starts: publish again.
            self._on_registered()
        self._registered.set()

    def start(self) -> None:
        if not self.registry_dir.is_dir():
            raise FileNotFoundError(f"plugin registry directory {self.registry_dir} does not exist")
        tame_grpc_logs()
        self.health.resume()
        self._serve()
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="dra-server", daemon=True)
        self._supervisor.start()

    def _serve(self) -> None:
        """Serves both sockets. Each is bound under a hidden, unique name beside its path and
        then renamed over the path: the replacement is atomic (no moment without a socket
        during a rolling update), the kubelet's plugin watcher ignores the dot-name, and the
        name gRPC unlinks when this server stops is the unique one, never the path a newer
        process now serves."""
        self.service_socket.parent.mkdir(parents=True, exist_ok=True)
        threads = self._max_workers + self._health_streams
        server = grpc.server(
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dra-grpc"),
            **server_limits(threads),
        )
        v1_grpc.add_DRAPluginServicer_to_server(_V1(self._calls), server)  # type: ignore[no-untyped-call]
        v1beta1_grpc.add_DRAPluginServicer_to_server(_V1beta1(self._calls), server)  # type: ignore[no-untyped-call]
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)  # type: ignore[no-untyped-call]
        health_grpc.add_DRAResourceHealthServicer_to_server(HealthServicer(self.health), server)  # type: ignore[no-untyped-call]
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        bound = {p: p.with_name(f".{p.name}.{tag}") for p in self._paths()}
        try:
            for path, tmp in bound.items():
                if server.add_insecure_port(f"unix://{tmp}") == 0:
                    raise RuntimeError(f"cannot serve on {path}")
            server.start()
            for path, tmp in bound.items():
                os.replace(tmp, path)
        except BaseException:
            server.stop(None)
            for tmp in bound.values():
                tmp.unlink(missing_ok=True)
            raise
        self._grpc = server
        self._own = {p: file_id(p) for p in bound}
        log.info(
            "DRA driver %s serving %s, registration at %s",
            self.driver.driver_name,
            self.service_socket,
            self.registration_socket,
        )

    def _paths(self) -> tuple[Path, Path]:
        return (self.service_socket, self.registration_socket)

    def _supervise(self) -> None:
        while not self._stopping.wait(self._poll):
            if self.service_socket.exists() and self.registration_socket.exists():
                continue
            log.warning("a DRA socket disappeared: serving anew")
            self._registered.clear()
            old, self._grpc = self._grpc, None
            if old is not None:
                self._stop_grpc(old)
                self.health.resume()
            try:
                self._serve()
            except (OSError, RuntimeError) as exc:
                log.error("cannot serve the DRA sockets: %s", exc)

    def _stop_grpc(self, server: Any) -> None:
        """Ends the health streams first, so that the kubelet sees them end rather than
        fail, then the server (a second's grace for those ends to go out)."""
        self.health.stop()
        server.stop(1.0).wait()

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        if self._grpc is not None:
            self._stop_grpc(self._grpc)
            self._grpc = None
        self.queue.stop()
        # During a rolling update the next plugin pod may have served these paths already:
        # delete only the files this process made, never the newer one's (same file identity
        # check as the device plugin's server).
        own, self._own = self._own, {}
        for path, ident in own.items():
            if ident is not None and file_id(path) == ident:
                path.unlink(missing_ok=True)
        self._registered.clear()
