"""Cleanup of allocations whose container is gone, and the pod labels of the live ones.

The kubelet never tells a device plugin that a container ended. The pod-resources API says
which container holds which device ID now; an allocation none of whose devices is held for
longer than a grace period is gone, and its host files and record are removed.

The decision (``CleanupPolicy``) is pure: records, assignments and the time in, verdicts
out. ``Cleaner`` is the thin edge that asks the kubelet, removes files and drops records
through callables, so the record store stays its owner's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vgpu_plugin.core.allocation import host_allocation_dir, host_limits_path
from vgpu_plugin.core.grant import check_allocation_id
from vgpu_plugin.core.pods import CheckpointEntry, CheckpointError, PodRef, PodResourcesUnavailable
from vgpu_plugin.node.host.hostfiles import remove_allocation
from vgpu_plugin.node.ledger.state import DEVICE_PLUGIN, RELEASING, AllocationStore

log = logging.getLogger(__name__)

DEFAULT_GRACE = 60.0


class Allocation(Protocol):
    """What cleanup needs of an allocation record (``state.AllocationRecord`` is one)."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def device_ids(self) -> tuple[str, ...]: ...
    @property
    def created(self) -> float: ...


def holders(
    records: Iterable[Allocation],
    assignments: Mapping[str, PodRef],
    checkpoint: Sequence[CheckpointEntry] = (),
    ended_pods: Collection[str] = (),
) -> dict[str, PodRef]:
    """The container holding each allocation, by allocation id (absent: held by nobody).

    From pod-resources ``List`` (``assignments``): the kubelet hands a device to a new
    container once the old one has released it, so when several records name one device, the
    newest record is the one the current holder got.

    From the kubelet's device ``checkpoint``: an allocation its Allocate response named stays
    held while the kubelet keeps the entry, whether or not ``List`` shows the container
    (non-restartable init containers never show there), unless its pod is in ``ended_pods``
    (pod UIDs known to be gone although the kubelet has not rewritten the file yet). Its
    namespace and pod come from a sibling container that ``List`` shows, else the namespace
    is empty and the pod is the pod's UID.
    """
    records = list(records)
    out = _list_holders(records, assignments)
    if not checkpoint:
        return out
    names: dict[str, PodRef] = {}
    for e in checkpoint:
        for aid in e.allocation_ids:
            if aid in out:
                names[e.pod_uid] = out[aid]
    by_allocation = {aid: e for e in checkpoint for aid in e.allocation_ids}
    for r in records:
        entry = by_allocation.get(r.allocation_id)
        if r.allocation_id in out or entry is None or entry.pod_uid in ended_pods:
            continue
        pod = names.get(entry.pod_uid)
        out[r.allocation_id] = (
            PodRef(pod.namespace, pod.pod, entry.container)
            if pod is not None
            else PodRef("", entry.pod_uid, entry.container)
        )
    return out


def _list_holders(
    records: Sequence[Allocation], assignments: Mapping[str, PodRef]
) -> dict[str, PodRef]:
    newest: dict[str, Allocation] = {}
    for r in records:
        for d in r.device_ids:
            seen = newest.get(d)
            if seen is None or (r.created, r.allocation_id) > (seen.created, seen.allocation_id):
                newest[d] = r
    out: dict[str, PodRef] = {}
    for device_id, record in newest.items():
        ref = assignments.get(device_id)
        if ref is not None and record.allocation_id not in out:
            out[record.allocation_id] = ref
    return out


@dataclass(frozen=True)
class CleanupDecision:
    """One pass's verdict. ``available``: pod-resources answered; ``availability_changed``:
    it did not answer last pass and does now, or the reverse (first pass: only when it does
    not answer), so the edge logs each outage once."""

    gone: tuple[str, ...]
    holders: Mapping[str, PodRef]
    available: bool
    availability_changed: bool
    # Allocations held by nobody yet within the grace period: id -> when they may be gone.
    pending: Mapping[str, float] = field(default_factory=dict)


class CleanupPolicy:
    """Decides which allocations are gone. Keeps, between passes, when each allocation was
    first seen held by nobody."""

    def __init__(self, grace: float = DEFAULT_GRACE) -> None:
        if grace < 0:
            raise ValueError(f"grace must be >= 0, got {grace}")
        self.grace = grace
        self._unheld_since: dict[str, float] = {}
        self._available: bool | None = None
        # Pod UIDs (from the checkpoint) seen holding something in List, and those that did
        # and hold nothing there any more: gone, though the kubelet's file still names them.
        self._listed_pods: set[str] = set()
        self._ended_pods: set[str] = set()

    def decide(
        self,
        records: Sequence[Allocation],
        assignments: Mapping[str, PodRef] | None,
        now: float,
        checkpoint: Sequence[CheckpointEntry] = (),
    ) -> CleanupDecision:
        """``assignments`` None: pod-resources unavailable, so nothing is gone. ``checkpoint``:
        the kubelet's device checkpoint (empty: not known), see ``holders``."""
        available = assignments is not None
        changed = self._available != available and (self._available is not None or not available)
        self._available = available
        if assignments is None:
            # What happened while we could not look is unknown: every clock starts again.
            self._unheld_since.clear()
            return CleanupDecision((), {}, False, changed)
        self._track_pods(records, assignments, checkpoint)
        held = holders(records, assignments, checkpoint, self._ended_pods)
        ids = {r.allocation_id for r in records}
        for stale in set(self._unheld_since) - ids:
            del self._unheld_since[stale]
        gone: list[str] = []
        pending: dict[str, float] = {}
        for r in records:
            if r.allocation_id in held:
                self._unheld_since.pop(r.allocation_id, None)
                continue
            since = self._unheld_since.setdefault(r.allocation_id, now)
            # A fresh allocation's pod shows up only after Allocate returns: created counts too.
            due = max(since, r.created) + self.grace
            if now >= due:
                gone.append(r.allocation_id)
            else:
                pending[r.allocation_id] = due
        return CleanupDecision(tuple(gone), held, True, changed, pending)

    def _track_pods(
        self,
        records: Sequence[Allocation],
        assignments: Mapping[str, PodRef],
        checkpoint: Sequence[CheckpointEntry],
    ) -> None:
        listed = _list_holders(records, assignments)
        now_listed = {e.pod_uid for e in checkpoint for a in e.allocation_ids if a in listed}
        self._ended_pods |= self._listed_pods - now_listed
        self._ended_pods -= now_listed
        self._listed_pods = (self._listed_pods | now_listed) - self._ended_pods
        in_file = {e.pod_uid for e in checkpoint}
        self._ended_pods &= in_file
        self._listed_pods &= in_file

    def forget(self, allocation_id: str) -> None:
        self._unheld_since.pop(allocation_id, None)


def remove_allocation_files(
    host_root: Path, allocation_id: str, cdi_spec_dir: Path | None = None
) -> None:
    """Remove ``<root>/containers/<id>/``, ``<root>/limits/<id>`` and the allocation's CDI spec
    in ``cdi_spec_dir`` with the one remover (``hostfiles.remove_allocation``: what it cannot
    delete it moves aside and logs). Raises ValueError for an id that is not a safe file name,
    OSError when removal fails."""
    check_allocation_id(allocation_id)
    root = str(Path(host_root).absolute())
    remove_allocation(
        host_allocation_dir(root, allocation_id),
        host_limits_path(root, allocation_id),
        allocation_id,
        cdi_spec_dir,
    )


# The names this plugin gives allocations: Allocate's (core/grant.py new_allocation_id: 12 hex
# digits of milliseconds, 8 random) and a DRA claim's (core/dra.py allocation_id). A host root
# may be shared with another tool (HAMi's containers/<pod-uid>_<container>): the sweep never
# touches a name it did not make.
_PLUGIN_MADE = re.compile(
    r"^(?:[0-9a-f]{20}|dra-[a-z0-9][a-z0-9-]{0,123}[a-z0-9])(?:\.tmp-[0-9]+-[0-9a-f]+)?$"
)


def plugin_made(name: str) -> bool:
    """Whether ``name`` is an allocation id of this plugin's making."""
    return _PLUGIN_MADE.match(name) is not None


def orphans(host_root: Path, owned: Collection[str], now: float, min_age: float) -> list[str]:
    """Allocation ids whose dir (``containers/<id>``) or limits file (``limits/<id>``) exists
    although no record owns them: left by a kill or ENOSPC between creating them and writing
    the record. Only names this plugin makes count (``plugin_made``), and only entries older
    than ``min_age`` seconds, so an Allocate in flight (files written, record not yet) is never
    one."""
    found: set[str] = set()
    for sub in ("containers", "limits"):
        try:
            entries = list(os.scandir(Path(host_root) / sub))
        except OSError:
            continue
        for e in entries:
            name = e.name
            if name in owned or name in found:
                continue
            if not plugin_made(name):
                continue
            try:
                age = now - e.stat(follow_symlinks=False).st_mtime
            except (ValueError, OSError):
                continue
            if age >= min_age:
                found.add(name)
    return sorted(found)


def _labels_of(record: Allocation) -> PodRef | None:
    ns, pod, ctr = (getattr(record, k, None) for k in ("namespace", "pod", "container"))
    if ns is None or pod is None or ctr is None:
        return None
    return PodRef(ns, pod, ctr)


class Cleaner:
    """Runs the policy against the kubelet and the host: removes the files and the record of
    every gone allocation, and passes each allocation's holder to ``relabel`` when it changes.

    ``still_running(id)`` (optional) is asked before removing: an allocation whose region
    still has live processes is kept, whatever the kubelet says (a kubelet that lost its
    device checkpoint must not cost a running container its accounting).

    ``checkpoint()`` (optional) reads the kubelet's device checkpoint (None: there is none);
    an allocation it names is held while its pod lives (init containers: see ``holders``).
    ``mark_released(id, when)`` (optional) records when an allocation was first seen held by
    nobody (None: held again), so the node view counts only what something holds.
    """

    def __init__(
        self,
        host_root: Path,
        records: Callable[[], Sequence[Allocation]],
        drop_record: Callable[[str], object],
        assignments: Callable[[], Mapping[str, PodRef]],
        relabel: Callable[[str, PodRef], object] | None = None,
        still_running: Callable[[str], bool] | None = None,
        grace: float = DEFAULT_GRACE,
        clock: Callable[[], float] = time.time,
        cdi_spec_dir: Path | None = None,
        checkpoint: Callable[[], Sequence[CheckpointEntry] | None] | None = None,
        mark_released: Callable[[str, float | None], object] | None = None,
        mark_releasing: Callable[[str], object] | None = None,
    ) -> None:
        self.host_root = Path(host_root)
        self.cdi_spec_dir = cdi_spec_dir
        self.policy = CleanupPolicy(grace)
        self._records = records
        self._drop_record = drop_record
        self._assignments = assignments
        self._relabel = relabel
        self._still_running = still_running
        self._clock = clock
        self._checkpoint = checkpoint
        self._mark_released = mark_released
        self._mark_releasing = mark_releasing
        self._checkpoint_problem: str | None = None
        self._kept_running: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> CleanupDecision:
        try:
            assignments: Mapping[str, PodRef] | None = self._assignments()
            why = ""
        except PodResourcesUnavailable as exc:
            assignments, why = None, str(exc)
        # The ledger holds both front ends' allocations; only the device plugin's end when their
        # container does (a DRA claim ends at its unprepare). All of them own their files.
        records = [
            r for r in self._records() if getattr(r, "front_end", DEVICE_PLUGIN) == DEVICE_PLUGIN
        ]
        decision = self.policy.decide(records, assignments, self._clock(), self._read_checkpoint())
        if decision.availability_changed:
            if decision.available:
                log.info("pod-resources answers again: cleanup of ended containers resumes")
            else:
                log.warning(
                    "%s: nothing is cleaned up until the kubelet answers again",
                    why,
                    extra={"event": "podresources_unavailable"},
                )
        if self._relabel is not None:
            self._apply_labels(records, decision.holders)
        if self._mark_released is not None and decision.available:
            self._apply_released(records, decision)
        for allocation_id in decision.gone:
            self._remove(allocation_id)
        if decision.available:
            self._sweep_orphans()
        return decision

    def _sweep_orphans(self) -> None:
        """Files no record owns; read the records after listing, so one written meanwhile
        counts as owning its files."""
        candidates = orphans(self.host_root, (), self._clock(), self.policy.grace)
        if not candidates:
            return
        owned = {r.allocation_id for r in self._records()}  # every front end's, every state
        for allocation_id in candidates:
            if allocation_id in owned:
                continue
            if self._still_running is not None and self._still_running(allocation_id):
                continue  # a live region: never removed
            try:
                remove_allocation_files(self.host_root, allocation_id, self.cdi_spec_dir)
            except (ValueError, OSError) as exc:
                log.error("cannot remove the orphaned files of %s: %s", allocation_id, exc)
                continue
            log.info(
                "removed the files of %s, which no allocation record owns",
                allocation_id,
                extra={"allocation_id": allocation_id},
            )

    def _apply_labels(self, records: Sequence[Allocation], held: Mapping[str, PodRef]) -> None:
        assert self._relabel is not None
        for r in records:
            ref = held.get(r.allocation_id)
            if ref is None or ref == _labels_of(r):
                continue
            try:
                self._relabel(r.allocation_id, ref)
            except Exception:  # one bad record must not stop the pass
                log.exception("cannot label allocation %s with %s", r.allocation_id, ref)

    def _read_checkpoint(self) -> Sequence[CheckpointEntry]:
        if self._checkpoint is None:
            return ()
        try:
            entries = self._checkpoint()
            problem = None if entries is not None else "the kubelet's device checkpoint is absent"
        except CheckpointError as exc:
            entries, problem = None, str(exc)
        if problem != self._checkpoint_problem:
            self._checkpoint_problem = problem
            if problem is None:
                log.info("reading the kubelet's device checkpoint: init containers are kept")
            else:
                log.warning(
                    "%s: allocations of init containers are known only from pod-resources",
                    problem,
                    extra={"event": "checkpoint_unavailable"},
                )
        return entries or ()

    def _apply_released(self, records: Sequence[Allocation], decision: CleanupDecision) -> None:
        assert self._mark_released is not None
        for r in records:
            was = getattr(r, "released", None)
            if r.allocation_id in decision.holders:
                if was is not None:
                    self._mark_released(r.allocation_id, None)
            elif was is None:
                self._mark_released(r.allocation_id, self._clock())

    def _remove(self, allocation_id: str) -> None:
        if self._still_running is not None and self._still_running(allocation_id):
            if allocation_id not in self._kept_running:
                self._kept_running.add(allocation_id)
                log.warning(
                    "allocation %s is held by no container the kubelet knows, but its "
                    "processes are alive: keeping it",
                    allocation_id,
                    extra={"allocation_id": allocation_id},
                )
            return
        self._kept_running.discard(allocation_id)
        try:
            # The lifecycle's release: mark, remove with the one remover, drop.
            if self._mark_releasing is not None:
                self._mark_releasing(allocation_id)
            remove_allocation_files(self.host_root, allocation_id, self.cdi_spec_dir)
        except ValueError as exc:
            log.error("allocation record %r names no safe path: %s", allocation_id, exc)
        except OSError as exc:
            # The record stays, so the next pass tries again.
            log.error("cannot remove the files of allocation %s: %s", allocation_id, exc)
            return
        self._drop_record(allocation_id)
        self.policy.forget(allocation_id)
        log.info(
            "allocation %s ended: its files and record are removed",
            allocation_id,
            extra={"allocation_id": allocation_id},
        )

    def start(self, interval: float = 10.0) -> None:
        """Run a pass every ``interval`` seconds in a daemon thread until ``stop``."""

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.run_once()
                except Exception:  # keep cleaning up after a bug in one pass
                    log.exception("cleanup pass failed")
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="vgpu-cleanup", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def store_relabeler(store: AllocationStore) -> Callable[[str, PodRef], None]:
    """``relabel`` for a Cleaner over an AllocationStore: records the holder in the record."""

    def relabel(allocation_id: str, ref: PodRef) -> None:
        record = store.get(allocation_id)
        if record is not None:
            store.add(
                dataclasses.replace(
                    record, namespace=ref.namespace, pod=ref.pod, container=ref.container
                )
            )

    return relabel


def store_releasing_marker(store: AllocationStore) -> Callable[[str], None]:
    """``mark_releasing`` for a Cleaner over an AllocationStore: the record's state."""

    def mark(allocation_id: str) -> None:
        record = store.get(allocation_id)
        if record is not None and record.state != RELEASING:
            store.add(dataclasses.replace(record, state=RELEASING))

    return mark


def store_release_marker(store: AllocationStore) -> Callable[[str, float | None], None]:
    """``mark_released`` for a Cleaner over an AllocationStore."""

    def mark(allocation_id: str, when: float | None) -> None:
        record = store.get(allocation_id)
        if record is not None:
            store.add(dataclasses.replace(record, released=when))

    return mark
