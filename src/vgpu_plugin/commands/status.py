"""``vgpu-plugin status``: the node's GPUs, slices and containers, as a table or as JSON.

``collect_view`` gathers from the same places the plugin uses (state dir, host root,
pod-resources socket, NVML), read-only, so it works from the host or from inside the plugin's
pod, whether or not the plugin runs. What it could not see is said in the view's notes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vgpu_plugin.commands.settings import add_shared_flag
from vgpu_plugin.core import defaults
from vgpu_plugin.core.devices import parse_device_id
from vgpu_plugin.core.pods import PodRef, PodResourcesUnavailable
from vgpu_plugin.core.sizes import format_mib
from vgpu_plugin.kubelet.podresources import allocatable_devices, list_assignments
from vgpu_plugin.node.host.cleanup import holders
from vgpu_plugin.node.ledger.dra_claims import read_prepared_claims
from vgpu_plugin.node.ledger.state import read_records
from vgpu_plugin.node.observe.escapes import (
    Escape,
    find_escapes,
    mount_attribution,
    proc_identity,
)
from vgpu_plugin.node.observe.nodeview import (
    REGION_OK,
    AllocationView,
    GpuFacts,
    GpuView,
    NodeView,
    ReadRegion,
    allocation_gpus,
    build_view,
    read_paces,
    read_regions,
    region_slots,
)

log = logging.getLogger(__name__)

JSON_VERSION = 1

# --- gathering (the edge) -------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _merge_slices(facts: list[GpuFacts], slices: Mapping[str, int]) -> list[GpuFacts]:
    by_uuid = {f.uuid: f for f in facts}
    for uuid in slices:
        by_uuid.setdefault(uuid, GpuFacts(uuid))
    return [
        GpuFacts(
            f.uuid,
            f.index,
            f.name,
            f.memory_total,
            slices.get(f.uuid, f.slices_total),
            f.memory_used_nvml,
            f.healthy,
        )
        for f in by_uuid.values()
    ]


def collect_view(
    host_root: Path,
    state_dir: Path,
    podresources_socket: Path,
    nvml: bool,
    resource_name: str | None = None,
    read_region: ReadRegion | None = None,
    timeout: float = 2.0,
) -> NodeView:
    """The node as the plugin's files, the kubelet and NVML show it now.

    Without pod-resources, containers are named as the plugin last recorded them and slices
    totals are unknown; without NVML (``nvml=False`` or no driver), NVML figures are None.
    """
    notes: list[str] = []
    records, problem = read_records(state_dir)
    if problem:
        notes.append(problem)
    names = (
        [resource_name]
        if resource_name
        else sorted({r.resource_name for r in records} or {defaults.RESOURCE_NAME})
    )
    pods: dict[str, PodRef] = {
        r.allocation_id: PodRef(r.namespace, r.pod, r.container)
        for r in records
        if r.namespace is not None and r.pod is not None and r.container is not None
    }
    slices: dict[str, int] = {}
    try:
        for name in names:
            assignments = list_assignments(podresources_socket, name, timeout)
            pods.update(holders([r for r in records if r.resource_name == name], assignments))
    except PodResourcesUnavailable as exc:
        notes.append(f"{exc} (containers named as the plugin last recorded them)")
    else:
        try:
            for name in names:
                for device_id in allocatable_devices(podresources_socket, name, timeout):
                    parsed = parse_device_id(device_id)
                    if parsed is not None:
                        slices[parsed[0]] = slices.get(parsed[0], 0) + 1
        except PodResourcesUnavailable as exc:
            notes.append(f"slices per GPU unknown: {exc}")

    claims, claims_problem = read_prepared_claims(state_dir)
    if claims_problem:
        notes.append(f"{claims_problem} (DRA allocations not shown)")
    facts: list[GpuFacts] = []
    escapes: list[Escape] = []
    if not nvml:
        notes.append("NVML not queried: NVML figures unknown")
    else:
        from vgpu_plugin.node.gpu.nvml import NvmlUnavailable, nvml_facts, running_processes

        try:
            facts = nvml_facts()
            # Listed before the regions are read: a shimmed process listed is in its slot.
            listed = running_processes()
        except NvmlUnavailable as exc:
            notes.append(f"{exc}: NVML figures unknown")
        else:
            allocations = allocation_gpus(records, claims)
            escapes = find_escapes(
                listed,
                allocations,
                mount_attribution(host_root / "limits", list(allocations)),
                proc_identity(),
                region_slots(host_root, read_region),
            )
    ids = [r.allocation_id for r in records] + [c.allocation_id for c in claims]
    regions = read_regions(host_root, ids, read_region)
    paces = read_paces(host_root, ids)
    return build_view(
        records, regions, _merge_slices(facts, slices), pods, notes, claims,
        paces=paces, now=time.time(), escapes=escapes,
    )  # fmt: skip


# --- rendering (pure) -----------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "-" if n is None else str(n // (1 << 20))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]
    return lines


def _health(g: GpuView) -> str:
    return "unknown" if g.healthy is None else "healthy" if g.healthy else "UNHEALTHY"


def _gpu_rows(view: NodeView) -> list[list[str]]:
    rows = []
    for g in view.gpus:
        total = "?" if g.slices_total is None else str(g.slices_total)
        memory = f"{_mib(g.memory_limited)}/{_mib(g.memory_total)}"
        rows.append(
            [
                "?" if g.index is None else str(g.index),
                g.uuid,
                g.name or "?",
                f"{g.slices_allocated}/{total}",
                memory,
                _mib(g.memory_used_by_containers),
                _mib(g.memory_used_nvml),
                _health(g),
            ]
        )
    return rows


def _gpu_label(view: NodeView, uuid: str) -> str:
    for g in view.gpus:
        if g.uuid == uuid and g.index is not None:
            return f"{g.index} {uuid}"
    return uuid


def _allocation_rows(view: NodeView, a: AllocationView) -> list[list[str]]:
    if a.claim is not None:
        who = f"claim {a.claim}"
    else:
        who = str(a.pod) if a.pod else "(pod not known yet)"
    if a.ended:
        who += " (ended)"
    rows = []
    for i, g in enumerate(a.gpus or ()):
        compute = "unlimited" if g.compute_limit == 0 else f"{g.compute_limit}%"
        if g.compute_guarantee:  # guaranteed, up to the cap
            compute = f"{g.compute_guarantee}%..{g.compute_limit}%"
        rows.append(
            [
                who if i == 0 else "",
                a.frontend if i == 0 else "",
                a.id if i == 0 else "",
                _gpu_label(view, g.uuid),
                f"{_mib(g.memory_used)}/{_mib(g.memory_limit)}",
                _mib(g.memory_peak),
                str(g.refused),
                str(g.fallbacks),
                f"{g.gpu_seconds:.1f}",
                "?"
                if g.compute_held_back_seconds is None
                else f"{g.compute_held_back_seconds:.1f}",
                compute,
                str(a.processes_alive) if i == 0 else "",
                a.region_state if i == 0 else "",
                g.driver_limit,
            ]
        )
    return rows


def render_status(view: NodeView) -> str:
    """A readable table: GPUs, then each container's share and usage (memory in MiB)."""
    out = ["GPUs"]
    if view.gpus:
        gpu_headers = (
            "IDX",
            "UUID",
            "MODEL",
            "SLICES",
            "LIMITED/TOTAL MiB",
            "SHIM USED MiB",
            "NVML USED MiB",
            "HEALTH",
        )
        out += ["  " + line for line in _table(gpu_headers, _gpu_rows(view))]
    else:
        out.append("  none seen")
    out += ["", "Containers"]
    rows = [row for a in view.allocations for row in _allocation_rows(view, a)]
    if rows:
        headers = (
            "NAMESPACE/POD/CONTAINER",
            "FRONTEND",
            "ALLOCATION",
            "GPU",
            "USED/LIMIT MiB",
            "PEAK MiB",
            "REFUSED",
            "MANAGED",
            "GPU s",
            "HELD s",
            "COMPUTE",
            "PROCS",
            "REGION",
            "DRIVER LIMIT",
        )
        out += ["  " + line for line in _table(headers, rows)]
    else:
        out.append("  no allocations")
    drift = [
        g
        for g in view.gpus
        if g.memory_used_nvml is not None and g.memory_used_nvml < g.memory_used_by_containers
    ]
    for g in drift:
        out.append(
            f"warning: GPU {g.uuid}: containers account {format_mib(g.memory_used_by_containers)}"
            f" but NVML reports {format_mib(g.memory_used_nvml or 0)} used"
        )
    bad = [a for a in view.allocations if a.region_state not in (REGION_OK, "missing")]
    for a in bad:
        out.append(f"warning: allocation {a.id}: region {a.region_state}")
    for a in view.allocations:
        if a.pace_state not in (REGION_OK, "missing"):
            out.append(f"warning: allocation {a.id}: pacing file {a.pace_state}")
    for a in view.allocations:
        for ag in a.gpus:
            if ag.unshimmed_processes:
                out.append(
                    f"warning: allocation {a.id}: {ag.unshimmed_processes} process(es) on GPU"
                    f" {_gpu_label(view, ag.uuid)} without the shim, holding"
                    f" {format_mib(ag.unshimmed_memory)}: not held to the container's limits"
                    " (the plugin's log names them; docs/security.md)"
                )
    out += [f"note: {n}" for n in view.notes]
    return "\n".join(out) + "\n"


def view_to_dict(view: NodeView) -> dict[str, Any]:
    def allocation(a: AllocationView) -> dict[str, Any]:
        d = asdict(a)
        d["pod"] = None if a.pod is None else asdict(a.pod)
        return d

    return {
        "version": JSON_VERSION,
        "gpus": [asdict(g) for g in view.gpus],
        "allocations": [allocation(a) for a in view.allocations],
        "notes": list(view.notes),
    }


def status_json(view: NodeView) -> str:
    """The view as JSON with stable, sorted keys; sizes in bytes; unknowns are null."""
    return json.dumps(view_to_dict(view), indent=2, sort_keys=True) + "\n"


# --- the command ----------------------------------------------------------------------------


def add_flags(p: argparse.ArgumentParser) -> None:
    add_shared_flag(p, "host-root", "the plugin's host root", defaults.HOST_ROOT)
    add_shared_flag(p, "state-dir", "the plugin's state dir")
    add_shared_flag(p, "pod-resources-socket", "the kubelet's pod-resources socket")
    p.add_argument(
        "--resource-name", help="resource to show (default: those of the allocation records)"
    )
    p.add_argument("--no-nvml", action="store_true", help="do not query NVML")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


EXIT_NOT_FOUND = 1


def missing_dir(flag: str, path: Path, what: str) -> str | None:
    """One line when ``path`` (given by ``flag``) is not a directory, else None."""
    if path.is_dir():
        return None
    why = "is not a directory" if path.exists() else "does not exist"
    return (
        f"vgpu-plugin status: {flag} {path} {why}: not {what} (give the plugin's own, "
        f"as its DaemonSet sets it)"
    )


def run(args: argparse.Namespace) -> int:
    # A wrong path would read as a node with nothing on it: say so instead.
    for flag, path, what in (
        ("--state-dir", Path(args.state_dir), "a plugin's state dir"),
        ("--host-root", Path(args.host_root), "a plugin's host root"),
    ):
        problem = missing_dir(flag, path, what)
        if problem is not None:
            print(problem, file=sys.stderr)
            return EXIT_NOT_FOUND
    view = collect_view(
        Path(args.host_root),
        Path(args.state_dir),
        Path(args.pod_resources_socket),
        nvml=not args.no_nvml,
        resource_name=args.resource_name,
    )
    sys.stdout.write(status_json(view) if args.json else render_status(view))
    return 0
