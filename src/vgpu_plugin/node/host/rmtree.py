"""Removal of a tree a tenant could write, by the plugin running as root without capabilities.

Without CAP_DAC_OVERRIDE and CAP_FOWNER, root is an ordinary owner: it cannot list a 000
dir, nor unlink from a 0555 one, until it gives itself the permission back, which it may do
on what it owns (the tenant's files are root's when the tenant runs as root, the usual case).
``shutil.rmtree`` gives up there. This walks by dir fds (``openat``/``unlinkat`` through
``dir_fd``), never follows a symlink (an entry swapped for a link is unlinked, not entered),
and restores the owner's rwx on each dir before reading or emptying it, through the fd it
opened (``/proc/self/fd/N`` for an ``O_PATH`` fd), never through a name a tenant could swap.
"""

from __future__ import annotations

import contextlib
import errno
import os

_NOFOLLOW_DIR = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, parent_fd: int) -> int:
    """An O_RDONLY fd on the dir ``name`` in ``parent_fd``, made rwx for its owner first when
    it was not readable; raises NotADirectoryError/ELOOP when it is not a dir (a symlink)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW_DIR, dir_fd=parent_fd)
    except PermissionError:
        path_fd = os.open(name, os.O_PATH | _NOFOLLOW_DIR, dir_fd=parent_fd)
        try:
            proc = f"/proc/self/fd/{path_fd}"
            os.chmod(proc, 0o700)  # the inode the O_PATH fd holds, not a name
            fd = os.open(proc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(path_fd)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700 and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o700)  # to unlink what it holds
    except BaseException:
        os.close(fd)
        raise
    return fd


def _empty(fd: int) -> None:
    for entry in list(os.scandir(fd)):
        remove_at(entry.name, fd)


def remove_at(name: str, parent_fd: int) -> None:
    """Removes ``name`` (in the dir ``parent_fd``) and, for a dir, everything under it; a
    missing one is fine. Raises OSError when the kernel refuses (a tenant of another uid)."""
    try:
        os.unlink(name, dir_fd=parent_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    except PermissionError as exc:
        # EPERM from unlink of a dir on Linux; EACCES when parent_fd is not writable.
        if exc.errno != errno.EPERM:
            raise
    try:
        fd = _open_dir(name, parent_fd)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        os.unlink(name, dir_fd=parent_fd)
        return
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        os.unlink(name, dir_fd=parent_fd)  # a symlink: the link goes, its target stays
        return
    try:
        _empty(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent_fd)


def remove_tree(parent: str, name: str) -> None:
    """Removes ``parent/name`` as ``remove_at`` does; ``parent`` is the plugin's own dir."""
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        remove_at(name, parent_fd)
    finally:
        os.close(parent_fd)
