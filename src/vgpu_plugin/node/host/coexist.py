"""HAMi's files on this node, found at ``serve``'s start so its log says they are there and
that the plugin leaves them alone (docs/migrating.md#from-hami).

Read only: this module stats, lists and reads, and never opens anything for writing. It looks
where HAMi puts its files (``/usr/local/vgpu``: ``libvgpu.so``, ``ld.so.preload``,
``containers/<pod-uid>_<container>``; the lock dir ``/tmp/vgpulock``; the host's
``/etc/ld.so.preload``) as this process sees them, and in this plugin's own host root, which may
be the same directory. In the DaemonSet's container only the host root and the lock dir are
mounted, so those are what it can see there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vgpu_plugin.node.host.install import CONTAINERS_DIR, PRELOAD_FILE, foreign_preload_entries

HAMI_ROOT = "usr/local/vgpu"
HAMI_LOCK_DIR = "tmp/vgpulock"
HOST_PRELOAD = "etc/ld.so.preload"
# HAMi-core's library: ``libvgpu.so`` itself (this plugin's are ``lib/libvgpu.so.<build>``).
HAMI_LIBRARY = "libvgpu.so"
# HAMi names a container's dir <pod-uid>_<container name>; this plugin never does.
_HAMI_CONTAINER = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}_.+$")
# How many container dirs a finding names before it only counts them: one log line.
SHOWN = 3


def _hami_containers(directory: Path) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return sorted(e.name for e in entries if _HAMI_CONTAINER.match(e.name))
    except OSError:
        return []


def _hami_preload_entries(preload: Path) -> list[str]:
    try:
        entries = foreign_preload_entries(preload)
    except OSError:
        return []
    return [e for e in entries if e.rsplit("/", 1)[-1].startswith(HAMI_LIBRARY)]


def find_hami(host_root: Path, lock_dir: Path, root: Path = Path("/")) -> list[str]:
    """What of HAMi's this process can see, one short phrase each (empty: nothing). ``root``
    is where the host's ``/`` is seen (``/`` on a bare node; tests give a directory)."""
    found: list[str] = []
    # One look per directory: this plugin's host root is /usr/local/vgpu by default too.
    dirs = list({d.resolve(): d for d in (root / HAMI_ROOT, Path(host_root))}.values())
    for d in dirs:
        if (d / HAMI_LIBRARY).is_file():
            found.append(f"HAMi-core's library {d / HAMI_LIBRARY}")
        names = _hami_containers(d / CONTAINERS_DIR)
        if names:
            shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
            found.append(f"{len(names)} HAMi container dir(s) in {d / CONTAINERS_DIR} ({shown})")
    for preload in dict.fromkeys([root / HOST_PRELOAD, *(d / PRELOAD_FILE for d in dirs)]):
        entries = _hami_preload_entries(preload)
        if entries:
            found.append(f"{preload} preloading {', '.join(entries)}")
    # Where this plugin's lock dir is HAMi's (both default to /tmp/vgpulock), the dir itself
    # tells nothing: it is shared by design, one lock file per GPU.
    hami_locks = root / HAMI_LOCK_DIR
    if hami_locks.is_dir() and hami_locks.resolve() != Path(lock_dir).resolve():
        found.append(f"HAMi's lock dir {hami_locks}")
    return found


def coexistence_line(found: list[str]) -> str | None:
    """The one log line for ``serve``'s start, None where nothing of HAMi's is seen."""
    if not found:
        return None
    return (
        f"HAMi's files are on this node: {'; '.join(found)}. vgpu-plugin changes, moves and "
        "removes none of them (docs/migrating.md#from-hami)"
    )
