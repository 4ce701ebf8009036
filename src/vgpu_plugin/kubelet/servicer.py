"""The DevicePlugin gRPC service: turns kubelet calls into Backend calls.

It knows nothing of sockets or registration (``server.py`` does). One ``DeviceFeed`` per
plugin turns the Backend's change notifications into a generation counter that any number of
ListAndWatch streams can wait on, so a stale stream and a fresh one never steal each other's
wake-ups.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2 as pb
from vgpu_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.kubelet import peers
from vgpu_plugin.kubelet.backend import Backend, BackendError
from vgpu_plugin.kubelet.peers import INVALID_REQUEST, STREAMS_OVER_LIMIT, StreamSlots

log = logging.getLogger(__name__)

# Streams re-check for a dead peer at least this often, even with no device change.
_STREAM_RECHECK_S = 1.0
# ListAndWatch streams one socket serves at once: the kubelet's, and room for a restarting
# kubelet's or a status tool's; each holds a server thread for its life.
DEFAULT_MAX_STREAMS = 4

RpcHook = Callable[[str, float, "str | None"], None]
"""Called after each unary RPC with (method, seconds, gRPC code name or None if it succeeded)."""


@dataclass
class ServerHooks:
    """How the server tells of its events (the metrics count them from here): optional
    callbacks that run on the server's threads and must be quick and never raise."""

    on_register: Callable[[str], None] | None = None  # the endpoint just registered
    on_register_failure: Callable[[str], None] | None = None  # the gRPC code's name
    on_restart: Callable[[str], None] | None = None  # a kubelet restart was seen: why
    on_rpc: RpcHook | None = None


class DeviceFeed:
    """Counts device-list changes reported by the Backend; streams wait for a newer count."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._cond = threading.Condition()
        self._generation = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> int:
        with self._cond:
            return self._generation

    def start(self) -> None:
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, name="vgpu-device-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self.poke()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def bump(self) -> None:
        """Tells every stream the list changed (the Backend's watcher calls this for us)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def poke(self) -> None:
        """Wakes waiting streams without a change, so they re-check whether to end."""
        with self._cond:
            self._cond.notify_all()

    def wait_newer(self, seen: int, timeout: float, done: Callable[[], bool]) -> int:
        """Blocks until the generation passes ``seen``, ``done()`` or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._generation <= seen and not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._generation

    def _watch(self) -> None:
        while not self._stopped.is_set():
            try:
                changed = self._backend.wait_for_change(0.5)
            except Exception:
                log.exception("backend.wait_for_change failed; retrying")
                self._stopped.wait(1.0)
                continue
            if changed:
                self.bump()


_Resp = TypeVar("_Resp")

# A status's details travel in a header, which the peer refuses past 16 KiB (it would see
# RESOURCE_EXHAUSTED instead of the reason): a refusal naming 20,000 IDs is cut short.
_MAX_DETAILS = 4096


def _details(message: str) -> str:
    if len(message) <= _MAX_DETAILS:
        return message
    return f"{message[:_MAX_DETAILS]}... ({len(message)} characters)"


class DevicePluginService(pb_grpc.DevicePluginServicer):
    """The five DevicePlugin RPCs, backed by a ``Backend``."""

    def __init__(
        self,
        backend: Backend,
        feed: DeviceFeed,
        hooks: ServerHooks,
        stopping: threading.Event,
        streams: StreamSlots | None = None,
    ) -> None:
        self._backend = backend
        self._feed = feed
        self._hooks = hooks
        self._stopping = stopping
        self._streams = streams or StreamSlots(DEFAULT_MAX_STREAMS)
        # Set by a stop that takes the devices off the node: streams send an empty list.
        self.withdrawn = threading.Event()
        # Streams are numbered as they open; a stream that ends while we serve on means the
        # kubelet let go of this endpoint (a kubelet disconnects the resource's current
        # plugin when an older instance's stream ends, as in a rolling update with surge),
        # and the server registers again. By number, so that the server counts only the
        # streams of its latest registration, whenever their end is noticed: the kubelet
        # opens one before it answers Register, so it may end before the answer arrives.
        self._numbers = threading.Lock()
        self._opened = 0
        self._dropped = 0  # the highest number of a stream that ended while we serve on
        self._sent_empty = 0
        self._sent_cond = threading.Condition()

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return self._unary("GetDevicePluginOptions", context, self._backend.options)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        return self._unary(
            "GetPreferredAllocation",
            context,
            lambda: self._backend.preferred_allocation(request),
        )

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        return self._unary("Allocate", context, lambda: self._backend.allocate(request))

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return self._unary(
            "PreStartContainer", context, lambda: self._backend.pre_start_container(request)
        )

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        """The full list now and after every change, until the peer or the server goes.

        Each open stream holds one of the server's threads for its life, so only
        ``streams.limit`` may be open at once (the kubelet opens one): past it a new stream
        is refused with RESOURCE_EXHAUSTED, and Allocate keeps the other threads."""
        release = self._streams.acquire()
        if release is None:
            peers.PEER_ERRORS.note(
                STREAMS_OVER_LIMIT,
                "ListAndWatch refused: %d streams are open on this socket, the limit"
                " (the kubelet opens one)",
                self._streams.limit,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._streams.limit} ListAndWatch streams are open, the limit",
            )
            return
        with self._numbers:
            self._opened += 1
            number = self._opened
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            release()
            if not self._stopping.is_set() and not self.withdrawn.is_set():
                with self._numbers:
                    self._dropped = max(self._dropped, number)
            self._feed.poke()

        context.add_callback(on_end)

        def done() -> bool:
            return ended.is_set() or self._stopping.is_set()

        last_sent: bytes | None = None
        try:
            while not done():
                # Read the generation before the list: a change after this read wakes us.
                seen = self._feed.generation
                withdrawn = self.withdrawn.is_set()
                devices = [] if withdrawn else self._backend.devices()
                response = pb.ListAndWatchResponse(devices=devices)
                wire = response.SerializeToString(deterministic=True)
                if wire != last_sent:
                    yield response
                    last_sent = wire
                if withdrawn:
                    with self._sent_cond:
                        self._sent_empty += 1
                        self._sent_cond.notify_all()
                    return
                while not done() and self._feed.wait_newer(seen, _STREAM_RECHECK_S, done) <= seen:
                    if not context.is_active():
                        return
        finally:
            release()

    def streams_opened(self) -> int:
        """How many ListAndWatch streams were opened so far: the mark to pass dropped_since."""
        with self._numbers:
            return self._opened

    def dropped_since(self, mark: int) -> bool:
        """Whether a stream opened after ``mark`` (streams_opened before a Register) ended
        while we serve on."""
        with self._numbers:
            return self._dropped > mark

    def withdraw(self, timeout: float) -> int:
        """Sends every open stream an empty device list and ends it; returns how many were
        told within ``timeout``. The kubelet then counts none of our devices on the node."""
        with self._sent_cond:
            before = self._sent_empty
        open_streams = self._streams.open
        self.withdrawn.set()
        self._feed.bump()
        deadline = time.monotonic() + timeout
        with self._sent_cond:
            while self._sent_empty - before < open_streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._sent_cond.wait(left)
            return self._sent_empty - before

    def _unary(self, method: str, context: Any, call: Callable[[], _Resp]) -> _Resp:
        start = time.perf_counter()
        code: str | None = None
        try:
            return call()
        except BackendError as err:
            code = err.code.name
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:  # the request's fault: any peer's
                peers.PEER_ERRORS.note(INVALID_REQUEST, "%s refused: %s", method, err.message)
            else:
                log.warning("%s refused: %s", method, err.message, extra={"grpc_code": code})
            context.abort(err.code, _details(err.message))
            raise  # abort raises; this keeps the type checker and readers sure of it
        except Exception as err:
            code = grpc.StatusCode.INTERNAL.name
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, _details(f"{method} failed: {err}"))
            raise
        finally:
            elapsed = time.perf_counter() - start
            if self._hooks.on_rpc is not None:
                self._hooks.on_rpc(method, elapsed, code)
