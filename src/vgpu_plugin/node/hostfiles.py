"""An allocation's files on the host, written before the kubelet gets its answer and removed
with the allocation: the region dir (mode 0777), the read-only limits file and, for the CDI
strategies and DRA, the CDI spec (docs/contracts.md#mounts, #device-lists)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from vgpu_plugin.core.allocation import ContainerSpec
from vgpu_plugin.node import cdi as cdi_files
from vgpu_plugin.node.atomicfile import write_atomically


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
    except OSError:
        remove_allocation(spec.allocation_dir, spec.limits_path, allocation_id, cdi_spec_dir)
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
    cdi_spec_dir: str | Path,
) -> None:
    """Everything ``write_allocation`` made; what is already gone is fine."""
    shutil.rmtree(allocation_dir, ignore_errors=True)
    Path(limits_path).unlink(missing_ok=True)
    cdi_files.remove_spec(cdi_spec_dir, allocation_id)
