"""An allocation's files on the host, written before the kubelet gets its answer and removed
with the allocation: the region dir (mode 0777), the read-only limits file and, for the CDI
strategies and DRA, the CDI spec (docs/contracts.md#mounts, #device-lists)."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from vgpu_plugin.core.allocation import ContainerSpec
from vgpu_plugin.node.host import cdi as cdi_files
from vgpu_plugin.node.host.atomicfile import fsync_dir, write_atomically
from vgpu_plugin.node.host.rmtree import remove_tree

log = logging.getLogger(__name__)

# What the remover could not delete is renamed to this prefix + the allocation id, beside it.
UNREMOVABLE_PREFIX = ".unremovable-"


def write_allocation(
    spec: ContainerSpec,
    allocation_id: str,
    cdi_spec_dir: str | Path,
    sync_dir: bool = True,
    durable: bool = True,
) -> None:
    """All or nothing: on OSError, what was written of this allocation is removed first.
    ``sync_dir`` False: the caller fsyncs the files' dirs once for many allocations.
    ``durable`` False: nothing is synced; the caller has ``allocation_paths`` synced later."""
    try:
        alloc_dir = Path(spec.allocation_dir)
        alloc_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(alloc_dir, 0o777)  # the container's processes may run as any user
        limits = Path(spec.limits_path)
        limits.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(limits, spec.limits_text.encode(), 0o644, sync_dir, durable)
        if spec.cdi_spec is not None:
            cdi_files.write_spec(cdi_spec_dir, allocation_id, spec.cdi_spec, sync_dir, durable)
    except OSError as exc:
        try:
            remove_allocation(spec.allocation_dir, spec.limits_path, allocation_id, cdi_spec_dir)
        except OSError as again:  # a read-only root fails the roll-back too: one error, logged
            log.error(
                "cannot roll back the files of %s after %s: %s",
                allocation_id,
                exc.strerror or exc,
                again,
                extra={"allocation_id": allocation_id},
            )
        raise


def allocation_paths(
    spec: ContainerSpec, allocation_id: str, cdi_spec_dir: str | Path
) -> tuple[list[Path], list[Path]]:
    """The files ``write_allocation`` wrote and the dirs whose entries it made, to be synced:
    the limits file and CDI spec (contents), then their dirs and the region dir's parent."""
    files = [Path(spec.limits_path)]
    dirs = [Path(spec.limits_path).parent, Path(spec.allocation_dir).parent]
    if spec.cdi_spec is not None:
        path = cdi_files.spec_path(cdi_spec_dir, allocation_id)
        files.append(path)
        dirs.append(path.parent)
    return files, dirs


def restore_limits_and_dir(
    limits_path: str | Path, limits_text: str, allocation_dir: str | Path
) -> list[str]:
    """Writes again, synced, a limits file missing or not ``limits_text`` (torn: a renamed
    file whose data never reached the disk reads empty) and a region dir missing or not 0777;
    what is intact is left alone. Returns what it wrote; OSError when it cannot."""
    done: list[str] = []
    limits = Path(limits_path)
    text = limits_text.encode()
    try:
        intact = limits.read_bytes() == text
    except FileNotFoundError:
        intact = False
    if not intact:
        limits.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(limits, text, 0o644)
        done.append("limits file")
    alloc_dir = Path(allocation_dir)
    if not alloc_dir.is_dir() or stat.S_IMODE(alloc_dir.stat().st_mode) != 0o777:
        alloc_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(alloc_dir, 0o777)  # as write_allocation makes it
        fsync_dir(alloc_dir.parent)
        done.append("region dir")
    return done


def restore_allocation(
    spec: ContainerSpec, allocation_id: str, cdi_spec_dir: str | Path
) -> list[str]:
    """Writes again, synced, what a power loss took of ``write_allocation``'s files for
    ``spec`` (written unsynced and not synced yet): a limits file missing or not ``spec``'s
    (torn: a renamed file whose data never reached the disk reads empty), a region dir
    missing or not 0777, a CDI spec missing or not a whole JSON object (torn). What is
    intact is left as it is: a CDI spec that reads whole is never rewritten. Returns what
    it wrote; OSError when it cannot."""
    done = restore_limits_and_dir(spec.limits_path, spec.limits_text, spec.allocation_dir)
    if spec.cdi_spec is not None:
        path = cdi_files.spec_path(cdi_spec_dir, allocation_id)
        if not _whole_json(path):
            cdi_files.write_spec(cdi_spec_dir, allocation_id, spec.cdi_spec)
            done.append("CDI spec")
    return done


def _whole_json(path: Path) -> bool:
    """Whether ``path`` holds a whole JSON object (a torn file is empty or zeros)."""
    try:
        return isinstance(json.loads(path.read_bytes()), dict)
    except (FileNotFoundError, ValueError):  # UnicodeDecodeError is a ValueError
        return False


def remove_allocation(
    allocation_dir: str | Path,
    limits_path: str | Path,
    allocation_id: str,
    cdi_spec_dir: str | Path | None,
) -> None:
    """Everything ``write_allocation`` made (no CDI spec where ``cdi_spec_dir`` is None); what
    is already gone is fine. The one remover of every path that ends an allocation
    (Allocate's roll-back, unprepare, the cleanup, the rebuild). The region dir is the
    tenant's: it is removed by dir fds, never following its symlinks, whatever modes the
    tenant set on what it owns (``rmtree``). What the kernel still refuses (another uid's
    files in a dir that uid made read-only; the plugin holds no capability) is renamed aside
    to ``.unremovable-<id>`` beside it, with an error logged, so the allocation ends and its
    id is free. Raises OSError when even that fails."""
    directory = Path(allocation_dir)
    if os.path.lexists(directory):
        try:
            remove_tree(str(directory.parent), directory.name)
        except OSError as exc:
            aside = _free_name(directory.with_name(UNREMOVABLE_PREFIX + allocation_id))
            os.rename(directory, aside)
            log.error(
                "cannot remove everything in %s (%s): moved it to %s; remove it by hand",
                directory,
                exc,
                aside,
                extra={"allocation_id": allocation_id, "moved_to": str(aside)},
            )
    Path(limits_path).unlink(missing_ok=True)
    if cdi_spec_dir is not None:
        cdi_files.remove_spec(cdi_spec_dir, allocation_id)


def _free_name(path: Path) -> Path:
    n, out = 0, path
    while os.path.lexists(out):  # one left from an earlier allocation with this id
        n += 1
        out = path.with_name(f"{path.name}-{n}")
    return out
