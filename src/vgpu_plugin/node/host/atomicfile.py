"""Whole-file replacement that a crash, or a reader, never sees half done; and syncs deferred
off a caller's path (``DeferredSync``).

Used for everything the plugin writes that another process reads or maps: the allocation
records, each container's limits file, the installed shim and ld.so.preload. The old inode is
never written, so a process that has it open or mapped keeps exactly what it had.

Two different crashes: a SIGKILL (or any death of the process) loses nothing that reached the
page cache, so a tmp file renamed into place is whole the moment ``rename`` returns; only a
power loss or kernel crash needs the ``fsync``s. ``durable=False`` writes skip them, for a caller
that has them done shortly after by a ``DeferredSync`` (docs/contracts.md#durability).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"


def tmp_pattern(path: Path) -> str:
    """A glob matching the temporary files ``write_atomically`` may leave for ``path`` if the
    writer dies mid-write (to be removed by whoever owns the file)."""
    return f"{path.name}{TMP_MARK}*"


def write_atomically(
    path: Path, data: bytes, mode: int = 0o600, sync_dir: bool = True, durable: bool = True
) -> None:
    """Replace ``path`` with a new file holding ``data`` with permissions ``mode``: tmp file in
    the same dir, fsync, rename, fsync of the dir (the rename is durable only then). With
    ``sync_dir`` False the caller fsyncs the dir itself (``fsync_dir``), once for many files.
    With ``durable`` False nothing is synced: whole for readers and after a SIGKILL, durable
    only once the caller has the file and its dir synced (``DeferredSync``)."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if sync_dir and durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the renames and creations done in ``directory`` durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class DeferredSync:
    """Makes writes durable shortly after they were acknowledged, off the writer's path.

    Writers ``note`` the files and dirs they wrote without syncing; one thread syncs them
    (file contents first, then the dirs that name them, then every registered flusher, e.g.
    the allocation journal's ``flush``) in passes: a pass starts as soon as something is noted
    and covers everything noted before it began. What was noted is durable once the pass after
    the note ends: the bound is two passes' time (a few fsyncs each; a pass slower than
    ``slow_pass`` seconds is logged). ``wait`` blocks until then (shutdown, tests).

    A path gone by the time of its pass (the allocation was removed meanwhile) is skipped; a
    sync that fails is logged, one line, and the pass goes on: the write was acknowledged
    already, and a container's files are rebuilt at start from the kubelet's checkpoint."""

    def __init__(
        self,
        fsync: Callable[[int], None] | None = None,
        slow_pass: float = 1.0,
        name: str = "sync",
    ) -> None:
        self._fsync = fsync  # a seam for tests; None: os.fsync
        self._slow_pass = slow_pass
        self._name = name
        self._cond = threading.Condition()
        self._files: set[str] = set()
        self._dirs: set[str] = set()
        self._flushers: list[Callable[[], None]] = []
        self._noted = 0  # notes so far
        self._synced = 0  # notes covered by a finished pass
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.errors = 0
        # Seconds from the earliest note a pass covered to the pass's end: how long a write
        # stayed acknowledged but not durable (the largest seen; for figures).
        self.max_lag = 0.0
        self._oldest: float | None = None

    def register(self, flush: Callable[[], None]) -> None:
        """``flush`` runs at the end of every pass (after the files and dirs)."""
        with self._cond:
            self._flushers.append(flush)

    def note(self, files: Iterable[str | Path] = (), dirs: Iterable[str | Path] = ()) -> None:
        with self._cond:
            self._files.update(map(str, files))
            self._dirs.update(map(str, dirs))
            self._noted += 1
            if self._oldest is None:
                self._oldest = time.monotonic()
            self._cond.notify_all()

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Sync what is still noted, then end the thread."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        self._pass()  # anything noted after the thread's last look

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until everything noted before this call is durable; False on timeout. Without
        the thread running the pass runs here."""
        with self._cond:
            target = self._noted
            if self._thread is not None:
                return self._cond.wait_for(lambda: self._synced >= target, timeout)
        self._pass()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._noted > self._synced)
                if self._stopping:
                    return
            self._pass()

    def _pass(self) -> None:
        with self._cond:
            files, self._files = self._files, set()
            dirs, self._dirs = self._dirs, set()
            flushers, target = list(self._flushers), self._noted
            oldest, self._oldest = self._oldest, None
        start = time.monotonic()
        for path in sorted(files):
            self._sync_path(path, os.O_RDONLY)
        for path in sorted(dirs):
            self._sync_path(path, os.O_RDONLY | os.O_DIRECTORY)
        for flush in flushers:
            try:
                flush()
            except OSError as exc:
                self.errors += 1
                log.error(
                    "deferred sync failed: %s; acknowledged writes may not survive a power loss",
                    exc,
                )
        took = time.monotonic() - start
        if took > self._slow_pass:
            log.warning(
                "deferred sync of %d files and %d dirs took %.2f s", len(files), len(dirs), took
            )
        with self._cond:
            if oldest is not None:
                self.max_lag = max(self.max_lag, time.monotonic() - oldest)
            self.passes += 1
            self._synced = max(self._synced, target)
            self._cond.notify_all()

    def _sync_path(self, path: str, flags: int) -> None:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # removed since it was written: nothing to keep
        except OSError as exc:
            self.errors += 1
            log.error("deferred sync cannot open %s: %s", path, exc)
            return
        try:
            (self._fsync or os.fsync)(fd)
        except OSError as exc:
            self.errors += 1
            log.error(
                "deferred sync of %s failed: %s; acknowledged writes may not survive a power loss",
                path,
                exc,
            )
        finally:
            os.close(fd)
