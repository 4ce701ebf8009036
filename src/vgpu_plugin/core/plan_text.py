"""The node plan in words (what ``vgpu-plugin check-config`` prints)."""

from __future__ import annotations

from collections.abc import Sequence

from vgpu_plugin.core.config import DraConfig
from vgpu_plugin.core.devices import MIB, GpuPlan, NodePlan, PhysicalGpu

_COLUMNS = (
    "GPU",
    "MODEL",
    "UUID",
    "MEMORY",
    "SPLIT",
    "SLICE MEMORY",
    "SLICE COMPUTE",
    "SCALING",
    "PLACEMENT",
    "RULE",
)


def render_plan(plan: NodePlan) -> str:
    """A header line, then one table row per GPU in physical index order."""
    slices = len(plan.all_slices())
    head = (
        f"resource {plan.resource_name}: {len(plan.gpus)} GPU(s), {slices} slice(s),"
        f" placement {plan.placement}"
    )
    if plan.fail_requests_greater_than_one:
        head += ", at most 1 slice per container"
    if not plan.gpus:
        return head + "\n(no GPUs)\n"
    rows = [_COLUMNS, *(_row(g) for g in plan.gpus)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS))]
    lines = [head]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def _row(g: GpuPlan) -> tuple[str, ...]:
    sharing = g.sharing
    if g.slice_compute_percent == 0:
        compute = "not limited"
    else:
        how = " (proportional)" if sharing.compute == "proportional" else ""
        compute = f"{g.slice_compute_percent} %{how}"
    scaling = repr(float(sharing.memory_scaling))
    if sharing.oversubscribed:
        scaling += " (oversubscribed)"
    return (
        str(g.gpu.index),
        g.gpu.name,
        g.gpu.uuid,
        f"{g.gpu.memory_mib} MiB",
        str(sharing.split_count),
        f"{g.slice_memory_mib} MiB",
        compute,
        scaling,
        sharing.placement,
        "default" if g.override is None else f"overrides[{g.override}]",
    )


_DRA_COLUMNS = ("GPU", "MODEL", "UUID", "MEMORY", "CLAIM MEMORY", "CLAIM COMPUTE")


def render_dra(dra: DraConfig, gpus: Sequence[PhysicalGpu]) -> str:
    """The DRA driver's share of the node: a header line, then one row per GPU with the
    request policy a claim on it meets (default, minimum, step of each capacity)."""
    head = f"DRA driver {dra.driver_name}: {len(gpus)} GPU(s) (dra.gpus: {', '.join(dra.gpus)})"
    if not gpus:
        return head + "\n(no GPUs)\n"
    mem_default, mem_min, mem_step = (v // MIB for v in dra.memory)
    cpu_default, cpu_min, cpu_step = dra.compute
    memory = f"default {mem_default} MiB, min {mem_min} MiB, step {mem_step} MiB"
    compute = f"default {cpu_default} %, min {cpu_min} %, step {cpu_step} %"
    rows = [
        _DRA_COLUMNS,
        *(
            (str(g.index), g.name, g.uuid, f"{g.memory_mib} MiB", memory, compute)
            for g in sorted(gpus, key=lambda g: g.index)
        ),
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_DRA_COLUMNS))]
    lines = [head]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"
