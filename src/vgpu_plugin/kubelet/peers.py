"""What the plugin's gRPC servers do about the peers on their sockets (docs/security.md).

Anyone who can connect to a socket can send malformed requests, open streams, or call in a
loop. Two things here keep that from costing the node:

- ``PeerErrors``: every error a peer causes is one log line, rate-limited per kind (a burst,
  then one line per window saying how many were left out), and counted by kind for the
  metrics. grpcio's own logger writes a multi-line traceback for each malformed request;
  ``tame_grpc_logs`` routes those records here instead.
- ``StreamSlots``: long-lived streams (ListAndWatch) may hold only so many of a server's
  threads; past the limit a new stream is refused, so unary calls (Allocate, the DRA calls)
  always find a thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from vgpu_plugin.node.observe.metrics import PEER_ERROR_KINDS

log = logging.getLogger(__name__)

(
    MALFORMED_REQUEST,
    INVALID_REQUEST,
    HANDLER_ERROR,
    STREAM_ERROR,
    STREAMS_OVER_LIMIT,
    PREPARE_QUEUE_FULL,
    OTHER,
) = PEER_ERROR_KINDS
KINDS: Final = PEER_ERROR_KINDS

# grpcio's server-side loggers and the beginnings of the messages they log per call.
GRPC_LOGGERS: Final = ("grpc._server", "grpc._common")
_GRPC_KINDS: Final = (
    ("Exception deserializing", MALFORMED_REQUEST),
    ("Exception calling application", HANDLER_ERROR),
    ("Exception servicing handler", HANDLER_ERROR),
    ("Exception iterating responses", STREAM_ERROR),
    ("Exception serializing response", HANDLER_ERROR),
)
_MAX_DETAIL = 200  # characters of a peer-controlled message kept in a line
_MAX_LINE = 500  # characters of a line, whatever a request put in its message


@dataclass
class _Window:
    start: float
    logged: int = 0
    left_out: int = 0


class PeerErrors(logging.Filter):
    """Counts peer errors by kind and logs at most ``burst`` lines per kind per ``window``
    seconds (``clock``: monotonic seconds), the first line after a quiet spell saying how
    many were left out."""

    def __init__(
        self, burst: int = 5, window: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._counts: dict[str, int] = {}
        self._listeners: list[Callable[[str], None]] = []

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(kind)`` is called for every error (the metrics count there); it must be
        quick and never raise."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def count(self, kind: str) -> int:
        with self._lock:
            return self._counts.get(kind, 0)

    def note(self, kind: str, message: str, *args: object) -> None:
        """One peer error: counted, and logged as one warning unless over the rate."""
        kind = kind if kind in KINDS else OTHER
        now = self._clock()
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            listeners = list(self._listeners)
            w = self._windows.get(kind)
            if w is None or now - w.start >= self.window:
                left_out = 0 if w is None else w.left_out
                w = self._windows[kind] = _Window(now)
            else:
                left_out = 0
            show = w.logged < self.burst
            if show:
                w.logged += 1
            else:
                w.left_out += 1
        for listener in listeners:
            listener(kind)
        if not show:
            return
        text = message % args if args else message
        text = " ".join(text.split())  # one line, whatever the peer put in it
        if len(text) > _MAX_LINE:
            text = f"{text[:_MAX_LINE]}... ({len(text)} characters)"
        if left_out:
            text += f" ({left_out} more {kind} errors in the last {self.window:g} s not logged)"
        log.warning("gRPC peer error (%s): %s", kind, text, extra={"peer_error": kind})

    def filter(self, record: logging.LogRecord) -> bool:
        """For grpcio's loggers: each per-call record becomes ``note`` (one line, no
        traceback); other records pass."""
        message = record.getMessage()
        kind = next((k for prefix, k in _GRPC_KINDS if message.startswith(prefix)), None)
        if kind is None:
            return True
        detail = message.rstrip("!")
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            detail += f": {type(exc).__name__}: {exc}"
        self.note(kind, "%s", detail[:_MAX_DETAIL])
        return False


PEER_ERRORS: Final = PeerErrors()
"""The process's one counter of peer errors (grpcio's loggers are process-wide too)."""


class _ToPeerErrors(logging.Filter):
    """On grpcio's loggers: hands each record to whatever ``PEER_ERRORS`` is when it comes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return PEER_ERRORS.filter(record)


_TO_PEER_ERRORS: Final = _ToPeerErrors()


def tame_grpc_logs() -> None:
    """Routes grpcio's per-call error records through ``PEER_ERRORS``; idempotent."""
    for name in GRPC_LOGGERS:
        logger = logging.getLogger(name)
        if _TO_PEER_ERRORS not in logger.filters:
            logger.addFilter(_TO_PEER_ERRORS)


class StreamSlots:
    """At most ``limit`` streams at a time; ``acquire`` says whether one more may open."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"stream limit {limit} must be at least 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._open = 0

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    def acquire(self) -> Callable[[], None] | None:
        """A release function (idempotent) for a new stream, or None when at the limit."""
        with self._lock:
            if self._open >= self.limit:
                return None
            self._open += 1
        released = threading.Event()
        guard = threading.Lock()

        def release() -> None:
            with guard:
                if released.is_set():
                    return
                released.set()
            with self._lock:
                self._open -= 1

        return release


def server_limits(max_workers: int) -> dict[str, Any]:
    """``grpc.server`` arguments that bound what peers can queue: at most 8 calls per worker
    thread in flight or waiting (beyond, gRPC answers RESOURCE_EXHAUSTED without running the
    handler), and 64 concurrent streams per connection (a client queues its excess)."""
    return {
        "maximum_concurrent_rpcs": 8 * max_workers,
        "options": [("grpc.max_concurrent_streams", 64)],
    }
