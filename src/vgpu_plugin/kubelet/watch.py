"""Noticing a kubelet restart from the device-plugins directory.

A restarting kubelet deletes every socket in the directory (ours included) and creates a new
``kubelet.sock``. We poll both files' identities (device, inode, change time): polling needs
no extra thread or inotify dependency, costs two ``lstat`` calls per tick, and cannot miss an
event the way a watch set up too late can. The change time matters: a deleted-and-recreated
file often gets the same inode number back.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileId:
    """Which file a path names right now; a recreated file gets a different FileId."""

    dev: int
    ino: int
    ctime_ns: int


def file_id(path: Path) -> FileId | None:
    """The identity of the socket at ``path``, or None if there is no socket there."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return FileId(st.st_dev, st.st_ino, st.st_ctime_ns)


class RestartDetector:
    """Remembers the two sockets of a registration and says when either was replaced."""

    def __init__(self, kubelet_socket: Path) -> None:
        self.kubelet_socket = kubelet_socket
        self._own: tuple[Path, FileId | None] | None = None
        self._kubelet: FileId | None = None

    def arm(self, own_socket: Path, own: FileId | None, kubelet: FileId | None) -> None:
        """Records the sockets as they were when Register succeeded."""
        self._own = (own_socket, own)
        self._kubelet = kubelet

    def disarm(self) -> None:
        self._own = None
        self._kubelet = None

    def check(self) -> str | None:
        """Why we must serve and register again, or None while the registration stands."""
        if self._own is None:
            return None
        own_path, own = self._own
        if file_id(own_path) != own:
            return f"our socket {own_path.name} was removed"
        now = file_id(self.kubelet_socket)
        # An absent kubelet.sock alone is a kubelet going down: wait for the new one.
        if now is not None and now != self._kubelet:
            return f"{self.kubelet_socket.name} was recreated"
        return None
