"""Whole-file replacement that a crash, or a reader, never sees half done.

Used for everything the plugin writes that another process reads or maps: the allocation
records, each container's limits file, the installed shim and ld.so.preload. The old inode is
never written, so a process that has it open or mapped keeps exactly what it had.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TMP_MARK = ".tmp-"


def tmp_pattern(path: Path) -> str:
    """A glob matching the temporary files ``write_atomically`` may leave for ``path`` if the
    writer dies mid-write (to be removed by whoever owns the file)."""
    return f"{path.name}{TMP_MARK}*"


def write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with a new file holding ``data`` with permissions ``mode``: tmp file in
    the same dir, fsync, rename, fsync of the dir (the rename is durable only then)."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
