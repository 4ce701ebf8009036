"""The node plan in words (what ``vgpu-plugin check-config`` prints), and the size of the
ListAndWatch message that advertises it."""

from __future__ import annotations

from vgpu_plugin.core.devices import GpuPlan, NodePlan, Slice

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


def _varint_len(value: int) -> int:
    if value < 0:
        return 10  # negative int64s always take ten bytes
    n = 1
    while value >= 0x80:
        value >>= 7
        n += 1
    return n


def _field_len(payload: int) -> int:
    """A length-delimited field with a one-byte tag (field numbers below 16)."""
    return 1 + _varint_len(payload) + payload


def _device_len(s: Slice, health: str) -> int:
    size = _field_len(len(s.id.encode())) + _field_len(len(health.encode()))
    if s.numa_node is not None:
        # topology { nodes { ID: numa } }; proto3 leaves ID 0 out of the wire.
        numa = 0 if s.numa_node == 0 else 1 + _varint_len(s.numa_node)
        size += _field_len(_field_len(numa))
    return size


def listandwatch_size(plan: NodePlan, health: str = "Unhealthy") -> int:
    """Exact size in bytes of the serialized ListAndWatchResponse when every slice reports
    ``health`` (the default, the longer of the two, gives the upper bound) and carries its NUMA
    node as the one topology node when known. The kubelet drops messages over 4 MiB."""
    return sum(_field_len(_device_len(s, health)) for s in plan.all_slices())
