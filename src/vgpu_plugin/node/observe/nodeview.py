"""The host's view of the node: GPUs, slices, and each allocation's limits and usage.

One builder feeds both the metrics and ``vgpu-plugin status``. ``build_view`` is pure: it
joins allocation records (the limits the plugin handed out: the truth about limits), region
snapshots (what the shim accounted: the truth about usage), pod refs and per-GPU facts
(NVML). ``read_regions`` is the edge that reads the region files.

A region lives in a directory the tenant can write, so it is checked, not trusted: a missing
region (no CUDA call yet) reads as zero usage, and one that cannot be read, or that speaks of
GPUs the allocation does not have, is reported as such and contributes no usage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from vgpu_plugin.core.allocation import DRIVER_LIMIT_SET
from vgpu_plugin.core.devices import GpuLimit, NodePlan, PhysicalGpu, parse_device_id
from vgpu_plugin.core.pods import PodRef
from vgpu_plugin.node.gpu.facts import GpuFacts as GpuFacts  # the view is built of it
from vgpu_plugin.node.ledger.dra_claims import PreparedClaim, prepared_claims
from vgpu_plugin.node.ledger.state import DEVICE_PLUGIN, DRA, AllocationRecord
from vgpu_plugin.node.observe.escapes import Escape, SlotLike, Slots
from vgpu_plugin.node.observe.lending import LendingMeter, LendingSample
from vgpu_plugin.node.observe.pace import (
    PaceProblem,
    PaceRead,
    held_back_bound,
    pace_path,
    read_pace,
)

REGION_OK = "ok"
REGION_MISSING = "missing"

# What Allocate asked of the driver's own memory limit for the container (ContainerSpec's
# ``driver_limit``: 'requested', 'off' or 'not requested: <why>'), kept in the record under
# this key (``AllocationRecord.extra``, which round-trips fields the record class does not
# name). What was *requested*: whether the node's toolkit applied it is not known here.
DRIVER_LIMIT_KEY = "driver_memory_limit"
DRIVER_LIMIT_UNKNOWN = "unknown"  # a record written before the plugin recorded it
DRIVER_LIMIT_OFF = "off"
# Per GPU, what a process of the container found (the region's driver_limit_state) turns the
# request into: the driver holds the container to at most its grant, or a process looked and
# found it does not ("not applied: <why>").
DRIVER_LIMIT_CONFIRMED = "confirmed"
DRIVER_LIMIT_NOT_APPLIED = "not applied"

# enum vgpu_driver_limit_state (native/libvgpu/include/vgpu/region.h); a test holds them equal.
SHIM_UNCHECKED, SHIM_FOUND, SHIM_NONE, SHIM_UNSUPPORTED, SHIM_NO_CGROUP, SHIM_ERROR = range(6)
_NOT_APPLIED_WHY = {
    SHIM_NONE: "no limit on the container's cgroup",
    SHIM_UNSUPPORTED: "the driver cannot report one (no nvmlDeviceGetMemoryLimits_v1)",
    SHIM_NO_CGROUP: "the container is in no cgroup v2",
}


# --- what is read from a region (``region.RegionSnapshot`` has this shape) -------------------


class RegionDevice(Protocol):
    @property
    def uuid(self) -> str: ...
    @property
    def used(self) -> int: ...
    @property
    def refused(self) -> int: ...  # allocations refused at the limit, ever
    @property
    def fallbacks(self) -> int: ...  # allocations that became managed memory (oversubscription)
    @property
    def peak(self) -> int: ...  # the highest usage charged, bytes
    @property
    def gpu_ns(self) -> int: ...  # GPU time of the container's measured (paced) launches
    @property
    def driver_limit(self) -> int: ...  # bytes a process found the driver holds it to
    @property
    def driver_limit_state(self) -> int: ...  # SHIM_* above: what that process found


class RegionProcess(Protocol):
    @property
    def pid(self) -> int: ...  # in the container's pid namespace
    @property
    def start_time(self) -> int: ...  # clock ticks since boot (field 22 of /proc/<pid>/stat)
    @property
    def alive(self) -> bool: ...
    @property
    def used(self) -> Sequence[int]: ...  # per device, in the order of the snapshot's devices


class RegionSnapshotLike(Protocol):
    @property
    def devices(self) -> Sequence[RegionDevice]: ...
    @property
    def processes(self) -> Sequence[RegionProcess]: ...


@dataclass(frozen=True)
class RegionProblem:
    """A region that gave no usage: ``state`` is 'missing', 'invalid: …' or 'busy: …'."""

    state: str


RegionRead = RegionSnapshotLike | RegionProblem
ReadRegion = Callable[[Path], RegionSnapshotLike]
# The unshimmed processes as last found (escapes.EscapeWatch.latest)
FindEscapes = Callable[[], Sequence[Escape]]


# --- inputs and outputs ---------------------------------------------------------------------


@dataclass(frozen=True)
class GpuView:
    uuid: str
    index: int | None
    name: str | None
    slices_total: int | None
    slices_allocated: int
    memory_total: int | None
    memory_limited: int  # bytes: the sum of the allocations' limits on this GPU
    memory_used_by_containers: int  # bytes: the sum the regions account
    memory_used_nvml: int | None  # bytes NVML reports used: the gap to the above is drift
    healthy: bool | None
    # Seconds of GPU time containers with a guarantee used beyond it (lending.py), since the
    # plugin started; 0 where nobody measured (status, a GPU without guarantees).
    compute_lent_seconds: float = 0.0


@dataclass(frozen=True)
class AllocationGpuView:
    uuid: str
    memory_limit: int  # bytes
    memory_used: int | None  # bytes; None: the region could not be trusted
    compute_limit: int  # percent, 0 = not limited (with a guarantee: the cap, 100 none)
    processes: int  # live processes with a charge on this GPU
    refused: int = 0  # allocations refused at the limit (the region's counters, 0 untrusted)
    fallbacks: int = 0  # allocations that fell back to managed memory
    memory_peak: int = 0  # bytes, the highest usage charged
    gpu_seconds: float = 0.0  # GPU time of measured (paced) launches
    compute_guarantee: int = 0  # percent guaranteed while others are busy; 0 = none
    # Seconds the container's launches on this GPU waited for their share in all (its pacing
    # file; 0 where nothing was paced), clamped; None: the pacing file cannot be trusted.
    compute_held_back_seconds: float | None = 0.0
    # Whether the driver holds the container to its limit on this GPU: 'confirmed' (a process
    # of the container found a hard limit at most the grant), 'requested' (asked, nothing
    # confirmed yet), 'not applied: <why>' (a process looked: none, or a larger one), 'off',
    # 'not requested: <why>' or 'unknown' (the allocation's request, nobody looked).
    # Reported from inside the container: the tenant can forge it (docs/security.md).
    driver_limit: str = DRIVER_LIMIT_UNKNOWN
    driver_limit_confirmed: int = 0  # bytes: the hard limit found, where 'confirmed'
    # Processes of the container on this GPU that the shim does not account (escapes.py:
    # NVML lists them, their region has no slot for them) and the memory NVML says they hold.
    unshimmed_processes: int = 0
    unshimmed_memory: int = 0


@dataclass(frozen=True)
class AllocationView:
    id: str
    pod: PodRef | None
    gpus: tuple[AllocationGpuView, ...]
    processes_alive: int
    region_state: str  # 'ok', 'missing', 'invalid: …' or 'busy: …'
    created: float
    # No live process and held by no container (the cleaner's verdict: waiting out the cleanup
    # grace) or its every device handed on to a newer container (an init container's, reused
    # by the app container). Shown, but not counted in the GPUs' slices and limits.
    ended: bool = False
    frontend: str = DEVICE_PLUGIN  # DEVICE_PLUGIN or DRA
    # A DRA allocation's claim, "<namespace>/<name>" (its containers share the allocation).
    claim: str | None = None
    # The driver memory limit Allocate requested (DRIVER_LIMIT_KEY above).
    driver_memory_limit: str = DRIVER_LIMIT_UNKNOWN
    # Its pacing file: 'ok', 'missing' (nothing paced yet) or 'invalid: …' (figures not shown).
    pace_state: str = REGION_MISSING

    @property
    def driver_limit_requested(self) -> bool:
        return self.driver_memory_limit == DRIVER_LIMIT_SET


@dataclass(frozen=True)
class NodeView:
    gpus: tuple[GpuView, ...]
    allocations: tuple[AllocationView, ...]
    # What the view could not see, in words (e.g. NVML not queried, pod-resources down).
    notes: tuple[str, ...] = ()


# --- the edge: region files -----------------------------------------------------------------


def region_path(host_root: Path, allocation_id: str) -> Path:
    """The host path of the region the container sees as /tmp/vgpu/<id>.cache."""
    # One Path built from a joined string: a scrape makes one per allocation, and each
    # ``/`` re-parses the path.
    return Path(os.path.join(host_root, "containers", allocation_id, f"{allocation_id}.cache"))


def default_read_region() -> ReadRegion:
    from vgpu_plugin.node.observe import region

    return region.read_region


def read_one_region(host_root: Path, allocation_id: str, read_region: ReadRegion) -> RegionRead:
    path = region_path(host_root, allocation_id)
    try:
        return read_region(path)
    except Exception as exc:  # any failure of a tenant-writable file is a finding, not a crash
        if not os.path.lexists(path):
            return RegionProblem(REGION_MISSING)
        kind = "busy" if type(exc).__name__ == "RegionBusy" else "invalid"
        return RegionProblem(f"{kind}: {exc}")


def read_regions(
    host_root: Path, allocation_ids: Iterable[str], read_region: ReadRegion | None = None
) -> dict[str, RegionRead]:
    reader = read_region or default_read_region()
    return {i: read_one_region(host_root, i, reader) for i in allocation_ids}


def read_one_pace(host_root: Path, allocation_id: str) -> PaceRead | None:
    """The allocation's pacing file, beside its region; None where there is none."""
    try:
        return read_pace(pace_path(region_path(host_root, allocation_id)))
    except Exception as exc:  # a tenant's file: a finding, never a failed view
        return PaceProblem(f"invalid: {exc}")


def read_paces(host_root: Path, allocation_ids: Iterable[str]) -> dict[str, PaceRead | None]:
    return {i: read_one_pace(host_root, i) for i in allocation_ids}


def live_processes(
    host_root: Path, allocation_id: str, read_region: ReadRegion | None = None
) -> int:
    """Processes of the allocation's container alive now (0 when its region gives no view).
    Liveness is the kernel lock each process holds on its slot, so pids are never compared:
    for cleanup's ``still_running``."""
    read = read_one_region(host_root, allocation_id, read_region or default_read_region())
    if isinstance(read, RegionProblem):
        return 0
    return sum(1 for p in read.processes if p.alive)


# --- the pure part --------------------------------------------------------------------------


def _record_pod(record: AllocationRecord) -> PodRef | None:
    if record.namespace is None or record.pod is None or record.container is None:
        return None
    return PodRef(record.namespace, record.pod, record.container)


def driver_limit_of(record: AllocationRecord) -> str:
    value = record.extra.get(DRIVER_LIMIT_KEY)
    return value if isinstance(value, str) and value else DRIVER_LIMIT_UNKNOWN


def _limits(record: AllocationRecord) -> list[GpuLimit]:
    """The limit per GPU; from the device IDs when the record
    carries no limits (then both are 0: unknown)."""
    if record.limits:
        return list(record.limits)
    uuids: dict[str, None] = {}
    for d in record.device_ids:
        parsed = parse_device_id(d)
        if parsed is not None:
            uuids[parsed[0]] = None
    return [GpuLimit(u, 0, 0) for u in uuids]


def _mib(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


def driver_limit_state(requested: str, grant: int, dev: RegionDevice | None) -> tuple[str, int]:
    """(state, confirmed bytes) of one GPU of an allocation: the request (``requested``, the
    record's), turned by what a process of the container found (``dev``; None: nobody looked,
    or the region is not trusted) into 'confirmed' or 'not applied: <why>'.

    A hard limit found above the grant (``grant`` bytes; 0: unknown, any limit found counts)
    does not hold the container to its slice, only the shim does: 'not applied'. Where nothing
    was requested ('off', 'not requested: …') a process that found nothing changes nothing."""
    found = SHIM_UNCHECKED if dev is None else int(dev.driver_limit_state)
    limit = 0 if dev is None else int(dev.driver_limit)
    if found == SHIM_FOUND and (grant == 0 or limit <= grant):
        return DRIVER_LIMIT_CONFIRMED, limit
    if found == SHIM_UNCHECKED or requested not in (DRIVER_LIMIT_SET, DRIVER_LIMIT_UNKNOWN):
        return requested, 0
    if found == SHIM_FOUND:
        why = f"the driver's limit, {_mib(limit)}, is above the grant of {_mib(grant)}"
    elif found == SHIM_ERROR:
        why = f"NVML error {limit} when asked"
    else:
        why = _NOT_APPLIED_WHY.get(found, f"unknown answer {found} in the region")
    return f"{DRIVER_LIMIT_NOT_APPLIED}: {why}", 0


def _counters(dev: RegionDevice | None) -> dict[str, Any]:
    """The region's counters of one GPU, as AllocationGpuView's fields (none: all 0)."""
    if dev is None:
        return {}
    return {
        "refused": int(dev.refused),
        "fallbacks": int(dev.fallbacks),
        "memory_peak": int(dev.peak),
        "gpu_seconds": int(dev.gpu_ns) / 1e9,
    }


def _held_back(
    pace: PaceRead | None, ours: Collection[str], age: float | None
) -> tuple[str, dict[str, float]]:
    """(the pacing file's state, seconds held back per GPU of ``ours``): a record of a GPU the
    allocation lacks is ignored, a figure above what the container's processes could have
    waited in ``age`` seconds (None: unknown) is cut to that."""
    if pace is None:
        return REGION_MISSING, {}
    if isinstance(pace, PaceProblem):
        return pace.state, {}
    bound = held_back_bound(age) if age is not None else 1 << 63
    held: dict[str, float] = {}
    for dev in pace:
        if dev.uuid in ours and dev.uuid not in held:
            held[dev.uuid] = min(dev.held_ns, bound) / 1e9
    return REGION_OK, held


def allocation_view(
    record: AllocationRecord,
    region: RegionRead,
    pod: PodRef | None,
    pace: PaceRead | None = None,
    now: float | None = None,
) -> AllocationView:
    """``pace``: its pacing file (None: none); ``now``: the time (``time.time()``) its
    held-back figures are bounded by the allocation's age at (None: no such bound)."""
    limits = _limits(record)
    ours = {g.uuid for g in limits}
    state = region.state if isinstance(region, RegionProblem) else REGION_OK
    used: dict[str, int] = {}
    procs: dict[str, int] = {}
    counters: dict[str, RegionDevice] = {}
    alive = 0
    if not isinstance(region, RegionProblem):
        foreign = [d.uuid for d in region.devices if d.uuid not in ours]
        if foreign:
            state = f"invalid: region accounts GPU {foreign[0]}, which this allocation lacks"
        else:
            for i, dev in enumerate(region.devices):
                # Only live processes count: a dead one's charge stays in the region's total
                # until a tenant process reaps it, but it no longer holds GPU memory.
                used[dev.uuid] = used.get(dev.uuid, 0) + sum(
                    int(p.used[i]) for p in region.processes if p.alive and i < len(p.used)
                )
                procs[dev.uuid] = sum(
                    1 for p in region.processes if p.alive and i < len(p.used) and p.used[i] > 0
                )
                counters[dev.uuid] = dev
            alive = sum(1 for p in region.processes if p.alive)
    trusted = state in (REGION_OK, REGION_MISSING)
    requested = driver_limit_of(record)
    age = None if now is None else now - record.created
    pace_state, held = _held_back(pace, ours, age)
    pace_ok = pace_state in (REGION_OK, REGION_MISSING)

    def gpu_view(g: GpuLimit) -> AllocationGpuView:
        dev = counters.get(g.uuid) if trusted else None
        driver, confirmed = driver_limit_state(requested, g.memory_bytes, dev)
        return AllocationGpuView(
            uuid=g.uuid,
            memory_limit=g.memory_bytes,
            memory_used=used.get(g.uuid, 0) if trusted else None,
            compute_limit=g.compute_percent,
            processes=procs.get(g.uuid, 0),
            compute_guarantee=g.compute_request,
            compute_held_back_seconds=held.get(g.uuid, 0.0) if pace_ok else None,
            **_counters(dev),
            driver_limit=driver,
            driver_limit_confirmed=confirmed,
        )

    gpus = tuple(gpu_view(g) for g in limits)
    ended = record.released is not None and alive == 0
    return AllocationView(
        record.allocation_id, pod, gpus, alive, state, record.created, ended,
        driver_memory_limit=requested, pace_state=pace_state,
    )  # fmt: skip


def claim_view(
    claim: PreparedClaim,
    region: RegionRead,
    pace: PaceRead | None = None,
    now: float | None = None,
) -> AllocationView:
    """A prepared DRA claim as an allocation: its limits, its region's usage, its name."""
    record = AllocationRecord(claim.allocation_id, (), DRA, claim.created, claim.limits)
    view = allocation_view(record, region, None, pace, now)
    return replace(view, frontend=DRA, claim=f"{claim.namespace}/{claim.name}")


def _mark_handed_on(
    records: Sequence[AllocationRecord], views: Sequence[AllocationView]
) -> list[AllocationView]:
    """Ends each allocation whose every device the kubelet gave to a newer container and which
    has no live process: an init container's slices reused by the app container after it. The
    record stays (held through the kubelet's checkpoint while the pod lives, in case the init
    container runs again), but one slice is counted once, for its newest holder."""
    newest: dict[str, tuple[float, str]] = {}
    for r, v in zip(records, views, strict=True):
        if v.ended:
            continue
        for d in r.device_ids:
            key = (r.created, r.allocation_id)
            newest[d] = max(newest.get(d, key), key)
    out = []
    for r, v in zip(records, views, strict=True):
        key = (r.created, r.allocation_id)
        handed_on = bool(r.device_ids) and all(newest.get(d, key) > key for d in r.device_ids)
        out.append(replace(v, ended=True) if handed_on and v.processes_alive == 0 else v)
    return out


def _with_escapes(view: AllocationView, escapes: Sequence[Escape]) -> AllocationView:
    mine = [e for e in escapes if e.allocation_id == view.id]
    if not mine:
        return view
    gpus = tuple(
        replace(
            g,
            unshimmed_processes=sum(1 for e in mine if e.uuid == g.uuid),
            unshimmed_memory=sum(e.memory for e in mine if e.uuid == g.uuid),
        )
        for g in view.gpus
    )
    return replace(view, gpus=gpus)


def build_view(
    records: Sequence[AllocationRecord],
    regions: Mapping[str, RegionRead],
    gpus: Sequence[GpuFacts],
    pods: Mapping[str, PodRef] | None = None,
    notes: Sequence[str] = (),
    claims: Sequence[PreparedClaim] = (),
    paces: Mapping[str, PaceRead | None] | None = None,
    now: float | None = None,
    lent: Mapping[str, float] | None = None,
    escapes: Sequence[Escape] = (),
) -> NodeView:
    """The node as one value. ``paces``: each allocation's pacing file (absent: none);
    ``now``: the time its held-back figures are bounded at (``allocation_view``); ``lent``:
    each GPU's lent seconds (``lending.LendingMeter``); ``escapes``: the processes found on
    the allocations' GPUs without the shim (``escapes.py``). ``pods``: each allocation's
    container (default: what the records were labelled with); an allocation absent from
    ``regions`` reads as region 'missing'.
    DRA records among ``records`` (and ``claims``: those of a claims file not migrated into the
    ledger yet) are listed as claims beside the device plugin's allocations and counted in
    their GPUs' limits and usage (not in slices); DRA records not ``prepared`` are left out.
    Ended allocations (released, or handed on: see ``_mark_handed_on``) are listed but count
    in no GPU's slices, limits or usage."""
    missing = RegionProblem(REGION_MISSING)
    paces = paces or {}
    lent = lent or {}
    ledger_claims = prepared_claims([r for r in records if r.front_end == DRA])
    known = {c.allocation_id for c in ledger_claims}
    claims = ledger_claims + [c for c in claims if c.allocation_id not in known]
    records = [r for r in records if r.front_end == DEVICE_PLUGIN]
    plugin = [
        allocation_view(
            r,
            regions.get(r.allocation_id, missing),
            pods.get(r.allocation_id) if pods is not None else _record_pod(r),
            paces.get(r.allocation_id),
            now,
        )
        for r in records
    ]
    plugin = _mark_handed_on(records, plugin)
    dra = [
        claim_view(c, regions.get(c.allocation_id, missing), paces.get(c.allocation_id), now)
        for c in claims
    ]
    allocations = tuple(
        sorted((_with_escapes(a, escapes) for a in plugin + dra), key=lambda a: (a.created, a.id))
    )
    ended = {a.id for a in allocations if a.ended}
    slices: dict[str, set[str]] = {}
    for r in records:
        if r.allocation_id in ended:
            continue
        for d in r.device_ids:
            parsed = parse_device_id(d)
            if parsed is not None:
                slices.setdefault(parsed[0], set()).add(d)
    limited: dict[str, int] = {}
    used: dict[str, int] = {}
    for a in allocations:
        if a.ended:
            continue
        for g in a.gpus:
            limited[g.uuid] = limited.get(g.uuid, 0) + g.memory_limit
            used[g.uuid] = used.get(g.uuid, 0) + (g.memory_used or 0)
    facts = {f.uuid: f for f in gpus}
    # GPUs the records name but nobody reported (gone from NVML) are still shown.
    for uuid in sorted(set(slices) | set(limited)):
        facts.setdefault(uuid, GpuFacts(uuid))
    order = sorted(facts.values(), key=lambda f: (f.index is None, f.index or 0, f.uuid))
    views = tuple(
        GpuView(
            uuid=f.uuid,
            index=f.index,
            name=f.name,
            slices_total=f.slices_total,
            slices_allocated=len(slices.get(f.uuid, ())),
            memory_total=f.memory_total,
            memory_limited=limited.get(f.uuid, 0),
            memory_used_by_containers=used.get(f.uuid, 0),
            memory_used_nvml=f.memory_used_nvml,
            healthy=f.healthy,
            compute_lent_seconds=lent.get(f.uuid, 0.0),
        )
        for f in order
    )
    return NodeView(views, allocations, tuple(notes))


def _facts(
    gpu: PhysicalGpu, slices: int | None, unhealthy: Collection[str], used: Mapping[str, int]
) -> GpuFacts:
    return GpuFacts(
        uuid=gpu.uuid,
        index=gpu.index,
        name=gpu.name,
        memory_total=gpu.memory_total,
        slices_total=slices,
        memory_used_nvml=used.get(gpu.uuid),
        healthy=gpu.uuid not in unhealthy,
    )


def gpu_facts_from_plan(
    plan: NodePlan,
    unhealthy: Collection[str] = (),
    memory_used_nvml: Mapping[str, int] | None = None,
) -> list[GpuFacts]:
    """The plugin's own facts: its plan (slices per GPU), its health state, NVML's used."""
    return [_facts(g.gpu, len(g.slices), unhealthy, memory_used_nvml or {}) for g in plan.gpus]


def dra_gpu_facts(
    gpus: Sequence[PhysicalGpu],
    unhealthy: Collection[str] = (),
    memory_used_nvml: Mapping[str, int] | None = None,
) -> list[GpuFacts]:
    """The DRA driver's GPUs: no slices (claims take amounts), the same health and NVML."""
    return [_facts(g, None, unhealthy, memory_used_nvml or {}) for g in gpus]


def view_provider(
    host_root: Path,
    records: Callable[[], Sequence[AllocationRecord]],
    gpus: Callable[[], Sequence[GpuFacts]],
    read_region: ReadRegion | None = None,
    pods: Callable[[], Mapping[str, PodRef]] | None = None,
    claims: Callable[[], Sequence[PreparedClaim]] | None = None,
    meter: LendingMeter | None = None,
) -> Callable[[], NodeView]:
    """A ``() -> NodeView`` for the metrics collector: reads records, prepared DRA claims and
    regions at each call, so an allocation shows (with its limits, used 0) from the moment its
    record exists."""

    prepare = staged_view_provider(host_root, records, gpus, read_region, pods, claims, meter)

    def provide() -> NodeView:
        return prepare()()

    return provide


def staged_view_provider(
    host_root: Path,
    records: Callable[[], Sequence[AllocationRecord]],
    gpus: Callable[[], Sequence[GpuFacts]],
    read_region: ReadRegion | None = None,
    pods: Callable[[], Mapping[str, PodRef]] | None = None,
    claims: Callable[[], Sequence[PreparedClaim]] | None = None,
    meter: LendingMeter | None = None,
    clock: Callable[[], float] = time.monotonic,
    escapes: FindEscapes | None = None,
) -> Callable[[], Callable[[], NodeView]]:
    """``view_provider`` in two stages: ``prepare()`` gathers what comes from the plugin's
    own state (records, claims, GPU facts, pods: the parts that take its locks or NVML) and
    returns ``build()``, which reads the regions and builds the view from files only, so it
    can run in a forked child (node/observe/metrics.py's forked builds).

    ``meter``: each GPU's idle time lent is measured at each ``prepare()``, here, since the
    meter's memory must outlive a forked child (it reads the regions of the allocations with
    a guarantee only).

    ``escapes``: the processes on the allocations' GPUs without the shim, as last found
    (``escapes.EscapeWatch.latest``, which serve's watch thread replaces)."""
    reader = read_region

    def prepare() -> Callable[[], NodeView]:
        rs = records()
        cs = claims() if claims is not None else ()
        facts = gpus()
        holders = pods() if pods is not None else None
        lent = None
        if meter is not None:
            samples = lending_samples(host_root, rs, cs, reader or default_read_region())
            lent = meter.observe(clock(), samples)
        found = escapes() if escapes is not None else ()

        def build() -> NodeView:
            ids = [r.allocation_id for r in rs] + [c.allocation_id for c in cs]
            regions = read_regions(host_root, ids, reader)
            paces = read_paces(host_root, ids)
            return build_view(
                rs, regions, facts, holders, claims=cs, paces=paces, now=time.time(), lent=lent,
                escapes=found,
            )  # fmt: skip

        return build

    return prepare


def _requests(
    records: Sequence[AllocationRecord], claims: Sequence[PreparedClaim]
) -> dict[str, dict[str, int]]:
    """Each live allocation's guarantee per GPU (0: none): the device plugin's live records,
    DRA's prepared claims (the ledger's and ``claims``)."""
    guaranteed: dict[str, dict[str, int]] = {}
    for r in records:  # DRA's below, oldest claim first
        if r.front_end == DEVICE_PLUGIN and _live(r):
            guaranteed[r.allocation_id] = {g.uuid: g.compute_request for g in r.limits}
    for c in [*prepared_claims([r for r in records if r.front_end == DRA]), *claims]:
        guaranteed[c.allocation_id] = {g.uuid: g.compute_request for g in c.limits}
    return guaranteed


def allocation_gpus(
    records: Sequence[AllocationRecord], claims: Sequence[PreparedClaim]
) -> dict[str, set[str]]:
    """Each live allocation's GPUs (UUIDs): the device plugin's live records, DRA's prepared
    claims (the ledger's and ``claims``)."""
    return {a: set(requests) for a, requests in _requests(records, claims).items()}


def allocation_names(
    records: Sequence[AllocationRecord], claims: Sequence[PreparedClaim]
) -> dict[str, str]:
    """How a log line names each allocation: its pod's container, or its DRA claim."""
    out = {}
    for r in records:
        pod = _record_pod(r)
        if r.front_end == DEVICE_PLUGIN and pod is not None:
            out[r.allocation_id] = (
                f"pod {pod.namespace}/{pod.pod} container {pod.container}"
                f" (allocation {r.allocation_id})"
            )
    for c in [*prepared_claims([r for r in records if r.front_end == DRA]), *claims]:
        out[c.allocation_id] = f"claim {c.namespace}/{c.name} (allocation {c.allocation_id})"
    return out


def region_slots(host_root: Path, read_region: ReadRegion | None = None) -> Slots:
    """An allocation's region's process slots, for ``escapes.find_escapes``: () where the
    region does not exist, None where it cannot be read or trusted."""
    reader = read_region or default_read_region()

    def slots(allocation_id: str) -> Sequence[SlotLike] | None:
        read = read_one_region(host_root, allocation_id, reader)
        if isinstance(read, RegionProblem):
            return () if read.state == REGION_MISSING else None
        return read.processes

    return slots


def guaranteed_gpus(
    records: Sequence[AllocationRecord], claims: Sequence[PreparedClaim]
) -> dict[str, set[str]]:
    """The GPUs on which each live allocation has a guarantee (for the GPU-time publisher,
    ``gputime.py``); allocations without one are left out."""
    out = {r.allocation_id: u for r in records if (u := _guaranteed_by(r))}
    return _with_claims(out, claims)


def _guaranteed_by(r: AllocationRecord) -> set[str]:
    """The GPUs on which ``r``'s allocation has a guarantee, if it is live."""
    return {g.uuid for g in r.limits if g.compute_request} if _live(r) else set()


def _live(r: AllocationRecord) -> bool:
    """Whether ``r``'s allocation is live: a device-plugin record not released, a DRA record
    of a prepared claim (``prepared_claims``)."""
    if r.front_end == DEVICE_PLUGIN:
        return r.released is None
    return r.front_end == DRA and bool(prepared_claims([r]))


def _with_claims(out: dict[str, set[str]], claims: Sequence[PreparedClaim]) -> dict[str, set[str]]:
    for c in claims:
        uuids = {g.uuid for g in c.limits if g.compute_request}
        if uuids:
            out[c.allocation_id] = uuids
        else:
            out.pop(c.allocation_id, None)
    return out


class Ledger(Protocol):
    """What ``GuaranteeIndex`` reads of the node's AllocationStore."""

    def snapshot(self) -> tuple[int, list[AllocationRecord]]: ...

    def changed_since(
        self, version: int
    ) -> tuple[int, dict[str, AllocationRecord | None]] | None: ...


class GuaranteeIndex:
    """``guaranteed_gpus`` of a ledger, kept by what changed since the last call: the GPU-time
    publisher asks five times a second, and a pass over 2,000 records held the GIL for
    2 - 3 ms each time (2 ms on the DRA prepare's p99, bench/RESULTS.md); now a call costs
    what changed, and the ledger is read whole only at first or when too much changed."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._version: int | None = None
        self._by_id: dict[str, set[str]] = {}

    def current(self, claims: Sequence[PreparedClaim] = ()) -> dict[str, set[str]]:
        """As ``guaranteed_gpus(every record, claims)``; a new dict each call."""
        got = None if self._version is None else self._ledger.changed_since(self._version)
        if got is None:
            self._version, records = self._ledger.snapshot()
            self._by_id = {r.allocation_id: u for r in records if (u := _guaranteed_by(r))}
        else:
            self._version, changed = got
            for aid, r in changed.items():
                uuids = _guaranteed_by(r) if r is not None else set()
                if uuids:
                    self._by_id[aid] = uuids
                else:
                    self._by_id.pop(aid, None)
        return _with_claims(dict(self._by_id), claims)


def lending_samples(
    host_root: Path,
    records: Sequence[AllocationRecord],
    claims: Sequence[PreparedClaim],
    read_region: ReadRegion,
) -> list[LendingSample]:
    """Each guaranteed allocation's GPU time per GPU, from its region (for LendingMeter):
    the device plugin's live records, DRA's prepared claims (the ledger's and ``claims``).
    A region that cannot be read, or that accounts a GPU the allocation lacks, gives none."""
    guaranteed = _requests(records, claims)
    out = []
    for allocation_id, requests in guaranteed.items():
        if not any(requests.values()):
            continue
        read = read_one_region(host_root, allocation_id, read_region)
        if isinstance(read, RegionProblem):
            continue
        if any(d.uuid not in requests for d in read.devices):
            continue
        for d in read.devices:
            if requests[d.uuid]:
                out.append(LendingSample(allocation_id, d.uuid, requests[d.uuid], int(d.gpu_ns)))
    return out
