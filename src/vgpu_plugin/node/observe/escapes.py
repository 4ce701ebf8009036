"""Processes that use a GPU from inside a container the plugin limits, without the shim in
them: their memory and compute are held by nothing (docs/security.md, what a tenant can do).

The shim fails open where the container's loader cannot preload it (a musl image, a glibc
older than 2.28: the loader prints one line and goes on), in a static binary, or where a
process bypasses the loader. Such a process is on the GPU all the same, so the driver lists
it: every ``INTERVAL`` seconds the node agent takes NVML's running compute processes of each
GPU (node pids, with the memory each holds), attributes each to the container whose limits
file its mount namespace mounts (as ``gputime.proc_owner`` does, without its search by
cgroup: a process that changes its root to hide the mount is no accident), and looks for it
among the process slots of that container's region, where each shimmed process registers
before it can make a context: by its pid in its own pid namespace (the last of ``NSpid`` in
``/proc/<pid>/status``) and its start time (field 22 of ``/proc/<pid>/stat``), which a
recycled pid does not share. A listed process of the container found in no live slot is
unshimmed. The regions are read after NVML's list, so a shimmed process that made its
context by then is in its slot.

What it needs: the node's pids (the chart's ``hostPID: true``); without them nothing is
attributed and nothing is reported. What it is not: a defence against a hostile tenant, who
can write a slot for its unshimmed process (the region is the tenant's), or hide it the ways
``proc_owner`` describes. It tells an operator about the accidents: an image the shim cannot
load into.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vgpu_plugin.node.observe.gputime import MountKey, PidOwner, file_key, mount_owner, mounts

log = logging.getLogger(__name__)

INTERVAL = 10.0  # seconds between two looks (serve; the metrics show the latest)
# Looks a process of a container not named yet waits before it is logged by its allocation
# alone: the kubelet's pod-resources names a device plugin container within about 10 s.
NAME_WAIT_LOOKS = 3


@dataclass(frozen=True)
class Escape:
    """A process of allocation ``allocation_id`` on GPU ``uuid`` that the shim does not
    account: ``pid`` is the node's, ``memory`` the bytes NVML says it holds there (0: NVML
    does not say)."""

    allocation_id: str
    uuid: str
    pid: int
    memory: int


class SlotLike(Protocol):
    """A region's process slot (``region.ProcessUsage``)."""

    @property
    def pid(self) -> int: ...  # in the container's pid namespace
    @property
    def start_time(self) -> int: ...  # field 22 of /proc/<pid>/stat
    @property
    def alive(self) -> bool: ...


# (pid in its own namespace, start time in clock ticks since boot)
Identity = tuple[int, int]
# Each GPU's running compute processes: UUID -> (node pid, bytes held; 0 unknown)
Listed = Mapping[str, Sequence[tuple[int, int]]]
# An allocation's process slots: () where its region does not exist yet (nothing registered),
# None where it cannot be read (a finding of its own; nothing is said of its processes).
Slots = Callable[[str], "Sequence[SlotLike] | None"]


def find_escapes(
    listed: Listed,
    allocations: Mapping[str, Collection[str]],
    owner: Callable[[int], str | None],
    identity: Callable[[int], Identity | None],
    slots: Slots,
) -> list[Escape]:
    """The listed processes that belong to an allocation (``allocations``: its GPUs' UUIDs)
    on one of its GPUs and are in no live slot of its region. A pid that is gone by the time
    it is looked at (no identity) is left out."""
    found: list[Escape] = []
    regions: dict[str, set[Identity] | None] = {}
    for uuid in sorted(listed):
        for pid, memory in listed[uuid]:
            alloc = owner(pid)
            if alloc is None or uuid not in allocations.get(alloc, ()):
                continue
            if alloc not in regions:
                got = slots(alloc)
                regions[alloc] = (
                    None if got is None else {(s.pid, s.start_time) for s in got if s.alive}
                )
            known = regions[alloc]
            if known is None:
                continue
            who = identity(pid)
            if who is None or who in known:
                continue
            found.append(Escape(alloc, uuid, pid, max(memory, 0)))
    return found


def parse_identity(status: str, stat: str) -> Identity | None:
    """(pid in the innermost pid namespace, start time) from a pid's ``status`` and ``stat``
    texts (proc(5)); None where either says nothing usable."""
    ns_pid = None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            if fields and fields[-1].isdigit():
                ns_pid = int(fields[-1])
            break
    # The command name (field 2) is in parentheses and may hold anything: fields are
    # counted after its last ')'. Field 22 is then the 20th.
    rest = stat[stat.rfind(")") + 1 :].split()
    if ns_pid is None or len(rest) < 20 or not rest[19].isdigit():
        return None
    return ns_pid, int(rest[19])


def mount_attribution(
    limits_dir: Path, allocation_ids: Collection[str], proc: Path = Path("/proc")
) -> PidOwner:
    """Node pids to allocations by the limits file their mount namespace mounts (``gputime``'s
    keys: a tenant sees, so can mount, no other container's limits file). The keys are made
    at the first pid asked about (a build with no process on the GPUs reads nothing), from
    the one mount that holds the limits directory: O(mounts + allocations), not their product
    (2,000 allocations on a node of 60 mounts)."""
    keys: dict[MountKey, str] | None = None

    def make_keys() -> dict[MountKey, str]:
        try:
            own = (proc / "self" / "mountinfo").read_text(errors="replace")
        except OSError:
            own = ""
        base = os.path.realpath(limits_dir)
        found = file_key(own, base)
        if found is None:
            return {}
        inner = base.rstrip("/") + "/"
        if any(p.startswith(inner) for _, _, p in mounts(own)):  # a mount within: each its own
            pairs = ((file_key(own, f"{base}/{a}"), a) for a in allocation_ids)
            return {k: a for k, a in pairs if k is not None}
        dev, root = found
        return {(dev, f"{root.rstrip('/')}/{a}"): a for a in allocation_ids}

    def owner(pid: int) -> str | None:
        nonlocal keys
        if keys is None:
            keys = make_keys()
        try:
            return mount_owner((proc / str(pid) / "mountinfo").read_text(errors="replace"), keys)
        except OSError:
            return None

    return owner


def proc_identity(proc: Path = Path("/proc")) -> Callable[[int], Identity | None]:
    def identity(pid: int) -> Identity | None:
        try:
            status = (proc / str(pid) / "status").read_text(errors="replace")
            stat = (proc / str(pid) / "stat").read_text(errors="replace")
        except OSError:
            return None
        return parse_identity(status, stat)

    return identity


class EscapeWatch:
    """At each call, the unshimmed processes of the allocations given (``find_escapes`` over
    NVML's list, ``list_processes``), each logged once as a warning naming its container.
    ``list_processes`` raising (no NVML) finds nothing, said once at info."""

    def __init__(
        self,
        host_root: Path,
        list_processes: Callable[[], Listed],
        slots: Slots,
        owner_of: Callable[[Path, Collection[str]], PidOwner] | None = None,
        identity: Callable[[int], Identity | None] | None = None,
    ) -> None:
        self._limits_dir = Path(host_root) / "limits"
        self._list = list_processes
        self._slots = slots
        self._owner_of = owner_of or mount_attribution
        self._identity = identity or proc_identity()
        self._told: dict[tuple[str, str, int], Identity | None] = {}
        self._waiting: dict[tuple[str, str, int], int] = {}  # looks while not named
        self._said_no_nvml = False
        self.latest: list[Escape] = []  # what the last call found (replaced whole)

    def __call__(
        self, allocations: Mapping[str, Collection[str]], names: Mapping[str, str]
    ) -> list[Escape]:
        """``names``: how the log names each allocation's container (its pod, or claim)."""
        if not allocations:
            self._told.clear()
            self.latest = []
            return []
        try:
            listed = self._list()
        except Exception as exc:  # NVML absent or failing: nothing can be said this time
            if not self._said_no_nvml:
                self._said_no_nvml = True
                log.info("GPU processes are not checked for the shim: %s", exc)
            return []
        # Identities are read once per pid and round: the one the check used is the one logged.
        seen: dict[int, Identity | None] = {}

        def identity(pid: int) -> Identity | None:
            if pid not in seen:
                seen[pid] = self._identity(pid)
            return seen[pid]

        owner = self._owner_of(self._limits_dir, list(allocations))
        found = find_escapes(listed, allocations, owner, identity, self._slots)
        self._tell(found, names, seen)
        self.latest = found
        return found

    def _tell(
        self, found: Iterable[Escape], names: Mapping[str, str], seen: Mapping[int, Identity | None]
    ) -> None:
        now: dict[tuple[str, str, int], Identity | None] = {}
        waiting: dict[tuple[str, str, int], int] = {}
        for e in found:
            key = (e.allocation_id, e.uuid, e.pid)
            who = seen.get(e.pid)
            if key in self._told and self._told[key] == who:
                now[key] = who
                continue
            if e.allocation_id not in names:  # its pod not known yet: a few looks more
                looks = self._waiting.get(key, 0) + 1
                if looks < NAME_WAIT_LOOKS:
                    waiting[key] = looks
                    continue
            now[key] = who
            log.warning(
                "%s: process %d (the node's pid) uses GPU %s (%d MiB) without the shim: its "
                "memory and compute are not held to the container's limits (an image whose "
                "loader cannot preload the shim, such as musl or glibc < 2.28, a static binary, "
                "or a process that bypasses the loader; docs/security.md)",
                names.get(e.allocation_id, f"allocation {e.allocation_id}"),
                e.pid,
                e.uuid,
                e.memory >> 20,
                extra={"allocation_id": e.allocation_id, "gpu_uuid": e.uuid, "pid": e.pid},
            )
        self._told = now
        self._waiting = waiting


def run_watch(
    watch: EscapeWatch,
    allocations: Callable[[], tuple[Mapping[str, Collection[str]], Mapping[str, str]]],
    stop: threading.Event,
    interval: float = INTERVAL,
) -> None:
    """Look every ``interval`` seconds until ``stop`` is set (``allocations``: each live
    allocation's GPUs, and how to name it); a failed look is logged and the next one tried."""
    while not stop.is_set():
        try:
            watch(*allocations())
        except Exception:  # one bad look must not end the watch
            log.exception("looking for processes without the shim failed")
        stop.wait(interval)
