"""An allocation's files on the host, written before the kubelet gets its answer and removed
with the allocation: the region dir (mode 0777), the read-only limits file and, for the CDI
strategies and DRA, the CDI spec (docs/contracts.md#mounts, #device-lists)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vgpu_plugin.core.allocation import ContainerSpec
from vgpu_plugin.node.host import cdi as cdi_files
from vgpu_plugin.node.host.atomicfile import write_atomically
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
