"""NodePrepareResources under a slow or absent API server (docs/dra.md, "A slow API server").

Preparing a claim reads it from the API server, which may take up to the reader's timeout, or
longer than the kubelet waits (45 s for a whole NodePrepareResources call). So prepares run
here, on threads of their own, and never on the gRPC server's: each claim goes into a bounded
queue (one entry per claim UID however often the kubelet asks), and the call waits for room
and for the result only until shortly before the kubelet's deadline. A claim not done by then
is answered with an error the kubelet retries, while its prepare goes on: the prepared claim
is recorded, so the retry answers from the record. A claim that found no room is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

# What the kubelet gives a DRA call when its request carries no deadline (PluginClientTimeout).
KUBELET_DEADLINE_S = 45.0

T = TypeVar("T")


class QueueFull(RuntimeError):
    """No room for another claim; the message says how many are in flight."""


class StillPreparing(RuntimeError):
    """The claim's prepare is still running (or waiting) when its caller must answer."""


class PrepareQueue(Generic[T]):
    """Runs ``prepare(uid, ...)`` jobs on ``workers`` threads, at most ``capacity`` claims
    waiting or running at once, one job per UID."""

    def __init__(self, workers: int = 2, capacity: int = 64) -> None:
        if workers < 1 or capacity < workers:
            raise ValueError(f"workers {workers}, capacity {capacity}: need 1 <= workers <= it")
        self.capacity = capacity
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="dra-prepare")
        self._room = threading.Condition()
        self._jobs: dict[str, Future[T]] = {}

    def in_flight(self) -> int:
        with self._room:
            return len(self._jobs)

    def submit(self, uid: str, job: Callable[[], T], timeout: float = 0.0) -> Future[T]:
        """The claim's job: the one already in flight for ``uid``, or ``job`` queued now,
        waiting up to ``timeout`` seconds for room; QueueFull when ``capacity`` claims are
        still in flight then."""
        deadline = time.monotonic() + timeout
        with self._room:
            while True:
                running = self._jobs.get(uid)
                if running is not None:
                    return running
                if len(self._jobs) < self.capacity:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueFull(
                        f"{len(self._jobs)} claims are being prepared, the queue's limit"
                        " (is the API server slow?)"
                    )
                self._room.wait(left)
            future = self._executor.submit(job)
            self._jobs[uid] = future
        future.add_done_callback(lambda f: self._forget(uid, f))
        return future

    def _forget(self, uid: str, future: Future[T]) -> None:
        with self._room:
            if self._jobs.get(uid) is future:
                del self._jobs[uid]
                self._room.notify_all()

    @staticmethod
    def wait(future: Future[T], timeout: float) -> T:
        """The job's result; StillPreparing when not done within ``timeout`` (it goes on), the
        job's own exception when it failed."""
        try:
            return future.result(timeout=max(0.0, timeout))
        except FutureTimeout as exc:
            raise StillPreparing("still being prepared") from exc

    def settle(self, uid: str, timeout: float) -> None:
        """Before the claim is unprepared: a job that has not started is dropped; one running
        is waited for (StillPreparing after ``timeout``), so no prepare lands after the
        unprepare and leaves files nobody removes."""
        with self._room:
            future = self._jobs.get(uid)
        if future is None or future.cancel():
            return
        try:
            future.result(timeout=max(0.0, timeout))
        except FutureTimeout as exc:
            raise StillPreparing("still being prepared") from exc
        except (CancelledError, Exception):  # its outcome is its caller's; it is over
            return

    def stop(self) -> None:
        """Drops the jobs not started; those running finish on their own threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)
