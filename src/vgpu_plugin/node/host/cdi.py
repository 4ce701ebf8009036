"""The allocations' CDI spec files on the host (docs/contracts.md#device-lists).

One file per allocation in the CDI spec dir (``--cdi-spec-dir``, default ``/var/run/cdi``),
written atomically before Allocate answers and removed with the allocation. The runtime's CDI
cache reads only ``*.json`` and ``*.yaml`` there, so the temporary file of an atomic write is
never taken for a spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vgpu_plugin.core import cdi
from vgpu_plugin.node.host.atomicfile import write_atomically


def spec_path(spec_dir: str | Path, allocation_id: str) -> Path:
    return Path(spec_dir) / cdi.spec_file_name(allocation_id)


def write_spec(
    spec_dir: str | Path,
    allocation_id: str,
    spec: dict[str, Any],
    sync_dir: bool = True,
    durable: bool = True,
) -> Path:
    """Write the allocation's spec (mode 0644: the runtime reads it); creates the dir. With
    ``sync_dir`` False the caller fsyncs the dir (once for many specs); with ``durable`` False
    nothing is synced (``atomicfile.write_atomically``)."""
    path = spec_path(spec_dir, allocation_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One line: the C encoder (``indent`` takes the pure-Python one, ~0.4 ms a spec).
    data = (json.dumps(spec) + "\n").encode()
    write_atomically(path, data, 0o644, sync_dir, durable)
    return path


def remove_spec(spec_dir: str | Path, allocation_id: str) -> None:
    """Remove the allocation's spec; a missing one is fine. ValueError for an unsafe id."""
    spec_path(spec_dir, allocation_id).unlink(missing_ok=True)
