"""Physical GPUs and the virtual devices (slices) the plugin advertises for them.

A slice's ID is ``<GPU UUID>-<k>``, k = 0..splitCount-1: derived from the GPU and the config
only, so the same config gives the same IDs across plugin restarts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from vgpu_plugin.core.config import Config, Sharing, matching_override

MIB = 1 << 20


@dataclass(frozen=True, slots=True)  # slots: the plugin keeps one per GPU of every record
class GpuLimit:
    """What one container may use of one physical GPU: the one shape of a limit, from the grant
    through the limits file, the records and the region to the node's view."""

    uuid: str
    memory_bytes: int
    compute_percent: int  # 1..100; 0: not limited (with a request: the cap, 100 none)
    compute_request: int = 0  # guaranteed percent (sharing.compute: guaranteed); 0: none

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // MIB

    @property
    def promised_percent(self) -> int:
        """The GPU time promised to the container: its guarantee, else its cap (0: none)."""
        return self.compute_request or self.compute_percent


@dataclass(frozen=True)
class PhysicalGpu:
    """A GPU as discovery (NVML) reports it; ``memory_total`` in bytes."""

    index: int
    uuid: str
    name: str
    memory_total: int
    minor: int
    pci_bus_id: str
    numa_node: int | None

    @property
    def memory_mib(self) -> int:
        return self.memory_total // MIB


@dataclass(frozen=True)
class Slice:
    """One virtual device. ``compute_percent`` 0 means not limited."""

    id: str
    gpu_uuid: str
    k: int
    memory_mib: int
    compute_percent: int
    numa_node: int | None


@dataclass(frozen=True)
class GpuPlan:
    """How one GPU is split. ``override`` is the index of the override that chose ``sharing``
    (None: the config's base sharing)."""

    gpu: PhysicalGpu
    sharing: Sharing
    slice_memory_mib: int
    slice_compute_percent: int
    slices: tuple[Slice, ...]
    override: int | None = None


@dataclass(frozen=True)
class NodePlan:
    """Every slice of the node. ``placement`` is the policy GetPreferredAllocation uses."""

    resource_name: str
    gpus: tuple[GpuPlan, ...]  # in physical index order
    placement: str = "binpack"
    fail_requests_greater_than_one: bool = False
    _slices: Mapping[str, Slice] = field(init=False, repr=False, compare=False)
    _gpus: Mapping[str, GpuPlan] = field(init=False, repr=False, compare=False)
    _all: tuple[Slice, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Indexes built once: Allocate and GetPreferredAllocation look IDs up on every call.
        every = tuple(s for g in self.gpus for s in g.slices)
        object.__setattr__(self, "_all", every)
        object.__setattr__(self, "_slices", {s.id: s for s in every})
        object.__setattr__(self, "_gpus", {g.gpu.uuid: g for g in self.gpus})

    def slice(self, device_id: str) -> Slice | None:
        return self._slices.get(device_id)

    def gpu(self, uuid: str) -> GpuPlan | None:
        return self._gpus.get(uuid)

    def all_slices(self) -> tuple[Slice, ...]:
        return self._all


def device_id(gpu_uuid: str, k: int) -> str:
    return f"{gpu_uuid}-{k}"


# \Z, not $: "$" also matches before a final newline, and "<id>\n" is not an ID.
_DEVICE_ID = re.compile(r"^(\S*[^\s-])-(0|[1-9][0-9]{0,5})\Z")


def parse_device_id(text: str) -> tuple[str, int] | None:
    """(GPU UUID, k) of a slice ID; None when it is not ``<uuid>-<k>`` with a canonical k."""
    m = _DEVICE_ID.match(text)
    return None if m is None else (m.group(1), int(m.group(2)))


def slice_memory_mib(memory_total: int, sharing: Sharing) -> int:
    """floor(total MiB x memoryScaling / splitCount), at least 1 MiB.

    Exact arithmetic on the scaling as written (1.1 is 11/10), so a float rounding error can
    never cost a MiB (0.29 x 100 is 28.999... in floats).
    """
    scaling = Fraction(repr(float(sharing.memory_scaling)))
    share = Fraction(memory_total // MIB) * scaling / sharing.split_count
    return max(1, int(share))  # int() of a non-negative Fraction is its floor


def slice_compute_percent(sharing: Sharing) -> int:
    if sharing.compute == "none":
        return 0
    if sharing.compute in ("proportional", "guaranteed"):  # a cap, or a guarantee
        return max(1, 100 // sharing.split_count)
    if isinstance(sharing.compute, int) and 1 <= sharing.compute <= 100:
        return sharing.compute
    raise ValueError(
        f"compute must be none, proportional, guaranteed or 1..100, got {sharing.compute!r}"
    )


def plan_gpu(gpu: PhysicalGpu, sharing: Sharing, override: int | None = None) -> GpuPlan:
    memory = slice_memory_mib(gpu.memory_total, sharing)
    compute = slice_compute_percent(sharing)
    slices = tuple(
        Slice(device_id(gpu.uuid, k), gpu.uuid, k, memory, compute, gpu.numa_node)
        for k in range(sharing.split_count)
    )
    return GpuPlan(gpu, sharing, memory, compute, slices, override)


def plan_node(
    config: Config,
    gpus: Sequence[PhysicalGpu],
    node_name: str,
    node_labels: Mapping[str, str],
) -> NodePlan:
    """Split every GPU of the node as the config says for it (first matching override wins)."""
    for attr in ("index", "uuid"):
        values = [getattr(g, attr) for g in gpus]
        if len(set(values)) != len(values):
            raise ValueError(f"GPUs with the same {attr}: {sorted(map(str, values))}")
    plans = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        i = matching_override(config, node_name, node_labels, gpu)
        sharing = config.sharing if i is None else config.overrides[i].apply(config.sharing)
        plans.append(plan_gpu(gpu, sharing, i))
    # One policy per request: the GPUs' own when they agree, else the node's base policy.
    policies = {p.sharing.placement for p in plans}
    placement = policies.pop() if len(policies) == 1 else config.sharing.placement
    return NodePlan(
        config.resource_name, tuple(plans), placement, config.fail_requests_greater_than_one
    )
