"""The DRA driver's health streams: ``v1alpha1.DRAResourceHealth/NodeWatchResources``.

The kubelet (ResourceHealthStatus, on by default from 1.36) opens one long-lived stream to
each driver that advertises the service at registration and puts each allocated device's
health into the pod's ``status.containerStatuses[].allocatedResourcesStatus``. Every message
is the full list of this driver's devices (pool = node, device = the ResourceSlice device
name): a new stream gets it at once, then again on every health change and at least every
``REFRESH_S`` seconds. The kubelet counts a device ``Unknown`` once its last report is older
than the report's ``health_check_timeout_seconds`` (30 s where it is 0); we send
``TIMEOUT_S``, three refreshes, so a loaded node never lets a device time out.

Each stream holds one of the gRPC server's threads while it lasts (a server-streaming
generator), so the number of open streams is bounded (``max_streams``): a new stream ends the
oldest one (a restarted kubelet's stream is the live one; its old one is dead), cancelling its
call so that a send stuck on a client that stopped reading lets go. A change never
waits on a stream: it only marks the stream stale, and the stream's own thread builds the
latest list when it can send (a queue of one, dropping to the latest); a slow or vanished
reader stalls only its own thread. ``stop`` ends every stream cleanly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2 as pb
from vgpu_plugin.api.drahealth.v1alpha1 import api_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

REFRESH_S = 20.0  # the full list is sent again at least this often
TIMEOUT_S = 60  # health_check_timeout_seconds: three refreshes
MAX_STREAMS = 2  # open streams (each holds a server thread); a new one ends the oldest


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    healthy: bool
    message: str = ""


class _Stream:
    def __init__(self, context: Any) -> None:
        self.context = context
        self.cond = threading.Condition()
        self.stale = True  # the first list goes out at once
        self.closed = False

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class HealthStreams:
    """The open streams and what each one sends."""

    def __init__(
        self,
        devices: Callable[[], Sequence[DeviceHealth]],
        *,
        refresh_s: float = REFRESH_S,
        timeout_s: int = TIMEOUT_S,
        max_streams: int = MAX_STREAMS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams {max_streams}: at least 1")
        self._devices = devices
        self._refresh = refresh_s
        self._timeout = timeout_s
        self._max = max_streams
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: list[_Stream] = []  # oldest first
        self._stopping = False
        self.sent = 0  # messages sent, all streams together

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def changed(self) -> None:
        """A device's health changed: every stream sends the full list again. Never blocks
        on a stream."""
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            with s.cond:
                s.stale = True
                s.cond.notify_all()

    def stop(self) -> None:
        """Ends every stream (each returns: the kubelet sees the stream end, not an error)
        and refuses new ones until ``resume``."""
        with self._lock:
            self._stopping = True
            streams, self._streams = self._streams, []
        for s in streams:
            s.close()

    def _replace(self, stream: _Stream) -> None:
        """Ends a stream a newer one replaces, cancelling the call as well: its thread may be
        stuck sending to a client that no longer reads, and only the cancel frees it."""
        log.info("a newer health stream replaces the oldest one")
        stream.close()
        if stream.context is not None:
            stream.context.cancel()

    def resume(self) -> None:
        with self._lock:
            self._stopping = False

    def response(self) -> Any:
        now = int(self._clock())
        return pb.NodeWatchResourcesResponse(
            devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                    health=pb.HEALTHY if d.healthy else pb.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=self._timeout,
                    message=d.message,
                )
                for d in self._devices()
            ]
        )

    def watch(self, context: Any) -> Iterator[Any]:
        stream = _Stream(context)
        with self._lock:
            if self._stopping:
                return
            self._streams.append(stream)
            ended = self._streams[: -self._max]
            del self._streams[: -self._max]
        for old in ended:
            self._replace(old)
        if context is not None:
            # A client that goes away wakes the stream's thread at once.
            context.add_callback(stream.close)
        try:
            while True:
                with stream.cond:
                    if not stream.stale and not stream.closed:
                        stream.cond.wait(self._refresh)
                    if stream.closed:
                        return
                    stream.stale = False
                message = self.response()  # the latest, built when it can be sent
                with self._lock:
                    self.sent += 1
                yield message
        finally:
            with self._lock:
                if stream in self._streams:
                    self._streams.remove(stream)


class HealthServicer(pb_grpc.DRAResourceHealthServicer):
    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        return self._streams.watch(context)
