"""``install-shim``: put the shim and ``ld.so.preload`` into the host root, safely.

Running containers have ``<root>/lib/libvgpu.so.<version>`` bind-mounted and mmapped. Writing
into that file (``cp -f``) changes the code under their feet and crashes them (PRIOR_ART: the
ancestor plugin, HAMi #727/#753), so nothing here ever opens an existing file for writing:
every file is built under a temporary name in the same directory, fsynced and renamed into
place. The version carries a hash of the content, so two different builds never share a name
and a new build lands beside the old one, which stays for the containers that use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin import __version__
from vgpu_plugin.core.defaults import SHIM_PATH
from vgpu_plugin.node.host import native
from vgpu_plugin.node.host.atomicfile import TMP_MARK, write_atomically
from vgpu_plugin.node.ledger.state import read_records

LIB_DIR = "lib"
SHIM_PREFIX = "libvgpu.so."
PRELOAD_FILE = "ld.so.preload"
# Names the version the last install put in place, for hosts whose package carries no shim.
CURRENT_FILE = "current"
LIMITS_DIR = "limits"
CONTAINERS_DIR = "containers"
# What the container's /etc/ld.so.preload says: the shim's path inside the container.
PRELOAD_TEXT = f"{SHIM_PATH}\n"
_HASH_CHARS = 12


class ShimNotInstalled(RuntimeError):
    """The host root lacks what Allocate mounts; the message names the path and the fix."""

    def __init__(self, host_root: Path, missing: Path, why: str) -> None:
        super().__init__(
            f"the vgpu shim is not installed in {host_root}: {missing} {why}; run "
            f"`vgpu-plugin install-shim --host-root {host_root}` (the DaemonSet's init "
            f"container does this) and start the plugin again"
        )
        self.host_root = host_root
        self.missing = missing


class ForeignPreload(RuntimeError):
    """``<root>/ld.so.preload`` lists another tool's library: replacing it would take that
    tool out of every container that mounts the file."""

    def __init__(self, preload: Path, entries: list[str]) -> None:
        tools = sorted({_tool_of(e) for e in entries})
        super().__init__(
            f"{preload} lists {', '.join(entries)} ({', '.join(tools)}), not this plugin's "
            f"{SHIM_PATH}: not replaced; give this plugin a hostRoot of its own, or pass "
            "--replace-preload to replace it"
        )
        self.preload = preload
        self.entries = entries
        self.tools = tools


# Libraries other GPU-sharing tools preload, by a part of their path: to name the tool found.
_KNOWN_TOOLS = (
    ("libvgpu.so", "HAMi's HAMi-core"),
    ("libcuda_hook", "a CUDA hook library"),
)


def _tool_of(entry: str) -> str:
    name = entry.rsplit("/", 1)[-1]
    for part, tool in _KNOWN_TOOLS:
        if name.startswith(part):
            return tool
    return f"an unknown tool's {name}"


def foreign_preload_entries(preload: Path) -> list[str]:
    """The entries of an existing ``ld.so.preload`` that are not this plugin's shim (empty:
    none, or no file). ld.so separates entries by white space or ':'; '#' starts a comment."""
    try:
        text = preload.read_text(errors="replace")
    except FileNotFoundError:
        return []
    except IsADirectoryError:
        return [str(preload)]
    entries = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        entries += [e for e in line.replace(":", " ").split() if e != SHIM_PATH]
    return entries


@dataclass(frozen=True)
class InstallResult:
    """What an install found and did. ``changed``: some file or dir was created or replaced."""

    version: str
    shim_path: Path
    preload_path: Path
    changed: bool
    shim_written: bool
    preload_written: bool
    # Other versions still in lib/, newest first: containers may still use them.
    kept_versions: tuple[Path, ...]
    pruned_versions: tuple[Path, ...]


def content_version(data: bytes) -> str:
    """``<package version>-<hash>``: a different build never gets the same name."""
    return f"{__version__}-{hashlib.sha256(data).hexdigest()[:_HASH_CHARS]}"


def _source(source: Path | None) -> Path:
    return source if source is not None else native.shim_library()


def _shim_file(host_root: Path, version: str) -> Path:
    return host_root / LIB_DIR / f"{SHIM_PREFIX}{version}"


def _same_content(path: Path, data: bytes) -> bool:
    try:
        if path.stat().st_size != len(data):
            return False
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def _ensure_dir(path: Path, mode: int) -> bool:
    if path.is_dir():
        return False
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    return True


def install_shim(
    host_root: Path,
    source: Path | None = None,
    keep: int | None = None,
    live_since: float | None = None,
    replace_preload: bool = False,
) -> InstallResult:
    """Install ``source`` (default: the packaged shim) as ``<root>/lib/libvgpu.so.<version>``
    and write ``<root>/ld.so.preload``; create ``limits/`` and ``containers/``. Idempotent:
    a second run with the same build changes nothing.

    Old versions stay. With ``keep`` N, versions beyond the newest N are removed only when no
    container can still use them: ``live_since`` is the creation time of the oldest allocation
    that may still run (None: unknown, so nothing is removed). See ``prunable_versions``.

    An ``ld.so.preload`` that lists another tool's library raises ``ForeignPreload`` before
    anything is written, unless ``replace_preload``.
    """
    host_root = Path(host_root)
    preload = host_root / PRELOAD_FILE
    foreign = foreign_preload_entries(preload)
    if foreign and not replace_preload:
        raise ForeignPreload(preload, foreign)
    data = _source(source).read_bytes()
    version = content_version(data)
    lib = host_root / LIB_DIR
    changed = _ensure_dir(lib, 0o755)
    for name in (LIMITS_DIR, CONTAINERS_DIR):
        changed |= _ensure_dir(host_root / name, 0o755)

    shim = _shim_file(host_root, version)
    shim_written = not _same_content(shim, data)
    if shim_written:
        write_atomically(shim, data, 0o755)
    elif any(p.stat().st_mtime > shim.stat().st_mtime for p in _installed_versions(lib)):
        # An older build reinstalled: the newest mtime must mark the version handed out now,
        # which is what pruning orders by. Metadata only; the mapped content is untouched.
        os.utime(shim)
        changed = True
    preload_written = not _same_content(preload, PRELOAD_TEXT.encode())
    if preload_written:
        write_atomically(preload, PRELOAD_TEXT.encode(), 0o644)
    current = lib / CURRENT_FILE
    if not _same_content(current, f"{version}\n".encode()):
        write_atomically(current, f"{version}\n".encode(), 0o644)
        changed = True

    others = [(p, p.stat().st_mtime) for p in _installed_versions(lib) if p != shim]
    pruned: list[Path] = []
    if keep is not None:
        for path in prunable_versions(others, shim.stat().st_mtime, keep, live_since):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            pruned.append(path)
    kept = tuple(p for p, _ in sorted(others, key=lambda x: -x[1]) if p not in pruned)
    return InstallResult(
        version=version,
        shim_path=shim,
        preload_path=preload,
        changed=changed or shim_written or preload_written or bool(pruned),
        shim_written=shim_written,
        preload_written=preload_written,
        kept_versions=kept,
        pruned_versions=tuple(pruned),
    )


def _installed_versions(lib: Path) -> list[Path]:
    if not lib.is_dir():
        return []
    # A writer's leftover tmp file (named after its target) is not an installed version.
    return [
        p
        for p in lib.iterdir()
        if p.name.startswith(SHIM_PREFIX) and TMP_MARK not in p.name and p.is_file()
    ]


def prunable_versions(
    others: Sequence[tuple[Path, float]],
    current_mtime: float,
    keep: int,
    live_since: float | None,
    margin: float = 60.0,
) -> list[Path]:
    """Which old versions may go. ``others``: (path, install time) of every version but the
    current one. A version stops being handed out when the next newer one is installed; an
    allocation created before that may have it mounted. So a version beyond the newest
    ``keep`` goes only if it was superseded (with ``margin`` for clock skew) before the oldest
    live allocation was created. Unknown ``live_since``: nothing goes."""
    if live_since is None:
        return []
    newest_first = sorted(others, key=lambda x: -x[1])
    # The time each version was superseded: the install time of the next newer one.
    superseded = [current_mtime] + [mtime for _, mtime in newest_first]
    out = []
    for i, (path, _) in enumerate(newest_first):
        if i + 1 < keep:  # the current version counts as one of the `keep`
            continue
        if superseded[i] + margin < live_since:
            out.append(path)
    return out


def installed_shim_version(host_root: Path, source: Path | None = None) -> str:
    """The shim version Allocate mounts: the packaged build's (or ``source``'s), which must be
    installed. When the package carries no shim, the version the last install put in place.
    Raises ShimNotInstalled naming what is missing."""
    host_root = Path(host_root)
    try:
        data = _source(source).read_bytes()
    except (native.NativeArtifactMissing, FileNotFoundError):
        data = None
    if data is not None:
        version = content_version(data)
        shim = _shim_file(host_root, version)
        if not _same_content(shim, data):
            why = "is missing" if not shim.exists() else "differs from this plugin's build"
            raise ShimNotInstalled(host_root, shim, why)
    else:
        current = host_root / LIB_DIR / CURRENT_FILE
        try:
            version = current.read_text().strip()
        except FileNotFoundError:
            raise ShimNotInstalled(host_root, current, "is missing") from None
        shim = _shim_file(host_root, version)
        if not shim.is_file():
            raise ShimNotInstalled(host_root, shim, "is missing")
    preload = host_root / PRELOAD_FILE
    if not _same_content(preload, PRELOAD_TEXT.encode()):
        why = "is missing" if not preload.exists() else f"does not name {SHIM_PATH}"
        raise ShimNotInstalled(host_root, preload, why)
    for name in (LIMITS_DIR, CONTAINERS_DIR):
        if not (host_root / name).is_dir():
            raise ShimNotInstalled(host_root, host_root / name, "is not a directory")
    return version


def check_installed(host_root: Path, source: Path | None = None) -> Path:
    """The installed shim Allocate mounts; raises ShimNotInstalled. Call it at plugin start."""
    return _shim_file(Path(host_root), installed_shim_version(host_root, source))


def shim_path_for(host_root: Path, source: Path | None = None) -> Path:
    """The host path of the shim that Allocate mounts at /etc/vgpu/libvgpu.so."""
    return check_installed(host_root, source)


def describe(result: InstallResult) -> str:
    """What an install did, for the command's output."""
    lines = [
        f"shim {result.version}: "
        + (f"installed {result.shim_path}" if result.shim_written else "already installed"),
        f"{result.preload_path}: " + ("written" if result.preload_written else "up to date"),
    ]
    if result.kept_versions:
        lines.append(
            f"kept {len(result.kept_versions)} older version(s) that containers may still use: "
            + ", ".join(p.name for p in result.kept_versions)
        )
    if result.pruned_versions:
        lines.append("removed unused: " + ", ".join(p.name for p in result.pruned_versions))
    return "\n".join(lines)


def live_since(host_root: Path, state_dir: Path) -> float | None:
    """When the oldest allocation that may still run was created, for pruning: the oldest
    record, or now when there is none. None (prune nothing) when the records cannot be read
    or a container dir has no record, since then an unknown container may use any version."""
    records, problem = read_records(state_dir)
    if problem:
        return None
    known = {r.allocation_id for r in records}
    containers = Path(host_root) / CONTAINERS_DIR
    if containers.is_dir() and any(p.name not in known for p in containers.iterdir()):
        return None
    return min((r.created for r in records), default=time.time())
