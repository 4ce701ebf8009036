"""Each guaranteed container's GPU time as the driver measures it, published read-only to it
(sharing.compute: guaranteed, docs/compute.md; docs/security.md#compute-guarantees).

A container's shim holds each of its processes to the container's rate with a private budget,
but the budget the processes share is in a file the tenant can write: a container of n
processes that keeps it full would get n times its rate. The measure that closes this comes
from outside the container: every ``interval`` the node agent reads the driver's per-process
utilisation of each GPU that has guaranteed containers, attributes each node pid to the
container whose limits file is bind-mounted in the pid's mount namespace (the kernel's
``/proc/<pid>/mountinfo``: that file's device and path, which a tenant cannot mount for
another container, seeing no other's; a region's process slots are the tenant's to write
and are not used), or, for a pid that hides the mount by changing its root, by the cgroup it
cannot leave (``CgroupMemo``), sums each container's share of the window the new samples
cover, and replaces ``<root>/containers/<id>.gputime``. Containers see that directory
only through the read-only peers mount (``/etc/vgpu/peers/<id>.gputime``), beside, not in,
their own writable directory; the shim finds it by the allocation its read-only limits file
names, and scales its processes' private rate so the container together keeps to its rate
(native/libvgpu/src/pace.c, gputime_scale).

The record (docs/contracts.md, Compute), little-endian: a header of 32 bytes (magic
``VGPUGPT``, version 1, count, size), then 16 GPU records of 104 bytes: UUID (80 bytes,
NUL-terminated), the container's share of the window in per mille (``uint32``) at 80, the
window's start and end at 88 and 96 (``uint64`` ns of CLOCK_MONOTONIC, the shim's clock).

The driver's samples: NVML gives per process the share of its sample period its kernels ran
(smUtil, percent); a process with several samples in the window counts their mean. Percent
steps make a container of n processes off by up to n/2 points in one window. A driver
samples every 1/6 s to 1 s (by product), stamps each sample with its period's end (CPU
realtime) and answers nothing new between two ends, as when nobody ran. So the window is the
samples', not the reader's: per GPU, from the newest stamp seen to the newest now (mapped to
CLOCK_MONOTONIC by the clocks' offset at the read). A read that finds no new sample
publishes nothing (the record stays: "used nothing" would let the shim grow the rate); only
when none has come for longer than the longest period (``SILENT_US``) did nobody run, and the
time since is published as share 0, so an idle container's record still moves. A driver
exact per call (simgpu by default) stamps each call's samples with the call's time.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vgpu_plugin.core.grant import check_allocation_id
from vgpu_plugin.node.host.atomicfile import write_atomically

log = logging.getLogger(__name__)

MAGIC = b"VGPUGPT\0"
VERSION = 1
HEADER = 32
RECORD = 104
MAX_DEVICES = 16
SIZE = HEADER + RECORD * MAX_DEVICES
UUID_SIZE = 80
SUFFIX = ".gputime"
# The driver keeps a second of samples (NVML's longest period): a longer gap is measured
# as its last second.
MAX_WINDOW_NS = 1_000_000_000
# No sample newer than the newest for longer than the driver's longest period (1 s), with a
# margin for a driver late with its sample: nobody ran. Shorter: the period is not over yet.
SILENT_US = 1_500_000
DEFAULT_INTERVAL = 0.2  # seconds; NVML's own per-process samples are about 1/6 s
# How often /proc may be searched for the other pids of an unattributed pid's cgroup.
SCAN_EVERY_NS = 5_000_000_000

_HEADER = struct.Struct("<8sIIQQ")
_RECORD = struct.Struct(f"<{UUID_SIZE}sIIQQ")

# (pid, smUtil percent, timeStamp) samples of one GPU newer than a CPU time; times in CPU
# (realtime) microseconds, each sample's the end of the period it covers.
ReadSamples = Callable[[str, int], list[tuple[int, int, int]]]
# The allocation whose limits file a pid's mount namespace shows, or None.
PidOwner = Callable[[int], str | None]


@dataclass(frozen=True)
class GpuShare:
    uuid: str
    share: int  # per mille of the GPU in the window
    start_ns: int
    end_ns: int


def encode_record(shares: Iterable[GpuShare]) -> bytes:
    """The record's bytes for one container (at most 16 GPUs, each once)."""
    items = list(shares)
    if len(items) > MAX_DEVICES:
        raise ValueError(f"{len(items)} GPUs: a record holds at most {MAX_DEVICES}")
    out = bytearray(SIZE)
    _HEADER.pack_into(out, 0, MAGIC, VERSION, len(items), SIZE, 0)
    for i, g in enumerate(items):
        raw = g.uuid.encode("ascii")
        if len(raw) >= UUID_SIZE:
            raise ValueError(f"GPU UUID {g.uuid!r} is longer than {UUID_SIZE - 1} bytes")
        share = min(max(g.share, 0), 1000)
        _RECORD.pack_into(out, HEADER + i * RECORD, raw, share, 0, g.start_ns, g.end_ns)
    return bytes(out)


def decode_record(data: bytes) -> list[GpuShare]:
    """The GPU records of a record's bytes (tests, tools); ValueError saying what is wrong."""
    if len(data) != SIZE:
        raise ValueError(f"{len(data)} bytes, not {SIZE}")
    magic, version, count, size, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or size != SIZE or count > MAX_DEVICES:
        raise ValueError("not a GPU-time record of this layout")
    out = []
    for i in range(count):
        raw, share, _r, start, end = _RECORD.unpack_from(data, HEADER + i * RECORD)
        out.append(GpuShare(raw.split(b"\0", 1)[0].decode("ascii"), share, start, end))
    return out


def container_shares(
    samples: Iterable[tuple[int, int]], owner: Callable[[int], str | None]
) -> dict[str, int]:
    """Each container's share (per mille) from per-pid samples: a pid's samples averaged,
    summed per owning container; pids of no container are left out."""
    per_pid: dict[int, list[int]] = {}
    for pid, util in samples:
        per_pid.setdefault(pid, []).append(min(max(util, 0), 100))
    out: dict[str, int] = {}
    for pid, utils in per_pid.items():
        who = owner(pid)
        if who is not None:
            out[who] = min(out.get(who, 0) + 10 * sum(utils) // len(utils), 1000)
    return out


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (space, tab, newline, backslash) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


MountKey = tuple[str, str]  # (major:minor, the mount's root within that filesystem)


def mounts(mountinfo: str) -> Iterable[tuple[str, str, str]]:
    """(major:minor, root, mount point) of each line of a mountinfo (proc(5))."""
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) >= 5:
            yield fields[2], _unescape(fields[3]), _unescape(fields[4])


def file_key(mountinfo: str, path: str) -> MountKey | None:
    """What a bind mount of the file at ``path`` (absolute, no links) shows in another mount
    namespace's mountinfo: its filesystem's device and its path within that filesystem, from
    the mount of ``mountinfo`` (the caller's own) that holds ``path``."""
    best: tuple[str, str, str] | None = None
    for dev, root, point in mounts(mountinfo):
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[2])):
            best = (dev, root, point)
    if best is None:
        return None
    dev, root, point = best
    rest = path[len(point.rstrip("/")) :]
    return dev, (root.rstrip("/") + rest) or "/"


def mount_owner(mountinfo: str, keys: Mapping[MountKey, str]) -> str | None:
    """The one allocation whose limits file (``keys``: ``file_key`` of each) is mounted in
    the mount namespace ``mountinfo`` shows; None for none, or for more than one (no
    container of ours has two). The key is exact, device and path: a tenant can mount only
    files it sees, and it sees no other container's limits file."""
    found = {keys[(dev, root)] for dev, root, _ in mounts(mountinfo) if (dev, root) in keys}
    return found.pop() if len(found) == 1 else None


def record_path(host_root: Path, allocation_id: str) -> Path:
    """``<root>/containers/<id>.gputime``: under the peers mount, outside the container's own
    writable directory (``<root>/containers/<id>/``)."""
    check_allocation_id(allocation_id)
    return Path(host_root) / "containers" / f"{allocation_id}{SUFFIX}"


class CgroupMemo:
    """Each container's cgroup, learnt from its pids that the limits mount attributes. A
    process that changes its root (chroot, pivot_root) no longer shows the mount in its
    mountinfo, but it cannot leave its container's cgroup: it is that container's. A cgroup
    learnt for two allocations is nobody's (our containers never share one). Kept across
    publications; an allocation's cgroups are forgotten when it ends."""

    def __init__(self, scan_every_ns: int = SCAN_EVERY_NS) -> None:
        self._owner: dict[str, str | None] = {}
        self._scanned: dict[str, int] = {}  # cgroup -> when /proc was last searched for it
        self._scan_every = scan_every_ns

    def learn(self, cgroup: str, alloc: str) -> None:
        if cgroup:
            self._owner[cgroup] = alloc if self._owner.get(cgroup, alloc) == alloc else None

    def owner(self, cgroup: str) -> str | None:
        return self._owner.get(cgroup) if cgroup else None

    def keep(self, live: Collection[str]) -> None:
        for cgroup, alloc in list(self._owner.items()):
            if alloc is not None and alloc not in live:
                del self._owner[cgroup]

    def may_scan(self, cgroup: str, now_ns: int) -> bool:
        """Whether /proc may be searched for ``cgroup``'s other pids now: at most once per
        ``scan_every_ns`` for each (a search reads every pid's cgroup)."""
        last = self._scanned.get(cgroup)
        if last is not None and now_ns - last < self._scan_every:
            return False
        self._scanned[cgroup] = now_ns
        return True


def proc_owner(
    limits_dir: Path,
    allocation_ids: Collection[str],
    proc: Path = Path("/proc"),
    memo: CgroupMemo | None = None,
    clock: Callable[[], int] = time.monotonic_ns,
) -> PidOwner:
    """Attribution of node pids by their mount namespace (see the module doc): the pid whose
    mountinfo shows the bind mount of ``<limits_dir>/<id>``; a pid whose mountinfo shows no
    limits file, by its cgroup (``memo``): that of pids the mount attributed, these or
    earlier ones, or, at most every few seconds, another pid of that cgroup found in
    ``proc``. Cached per pid for one publication (a pid does not change container)."""
    try:
        own = (proc / "self" / "mountinfo").read_text(errors="replace")
    except OSError:
        own = ""
    base = os.path.realpath(limits_dir)
    keys: dict[MountKey, str] = {}
    for alloc in allocation_ids:
        key = file_key(own, f"{base}/{alloc}")
        if key is not None:
            keys[key] = alloc
    cgroups = memo if memo is not None else CgroupMemo()
    cgroups.keep(allocation_ids)
    cache: dict[int, str | None] = {}

    def read(pid: int | str, name: str) -> str:
        try:
            return (proc / str(pid) / name).read_text(errors="replace")
        except OSError:
            return ""

    def by_mount(pid: int | str) -> str | None:
        who = mount_owner(read(pid, "mountinfo"), keys)
        if who is not None:
            cgroups.learn(read(pid, "cgroup"), who)
        return who

    def search(cgroup: str) -> None:
        """Learn ``cgroup``'s owner from any pid in it that the mount attributes."""
        try:
            pids = [n for n in os.listdir(proc) if n.isdigit()]
        except OSError:
            return
        for other in pids:
            if read(other, "cgroup") == cgroup and by_mount(other) is not None:
                return

    def owner(pid: int) -> str | None:
        if pid not in cache:
            who = by_mount(pid)
            if who is None:
                cgroup = read(pid, "cgroup")
                who = cgroups.owner(cgroup)
                if who is None and cgroup and cgroups.may_scan(cgroup, clock()):
                    search(cgroup)
                    who = cgroups.owner(cgroup)
            cache[pid] = who
        return cache[pid]

    return owner


def _nobody(_pid: int) -> str | None:
    return None


class GpuTimePublisher:
    """Publishes each guaranteed container's measured share per GPU at each call of
    ``publish`` that finds new samples of its GPUs (or a GPU silent long enough).
    ``read_samples`` is the driver (``node.gpu.nvml.process_utilization`` inside a session);
    ``owner_of`` makes a pid attribution for a set of allocation ids (default: ``proc_owner``
    with the cgroups it learns kept from one publication to the next)."""

    def __init__(
        self,
        host_root: Path,
        read_samples: ReadSamples,
        owner_of: Callable[[Path, Collection[str]], PidOwner] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        pid_visible: Callable[[int], bool] = lambda pid: os.path.exists(f"/proc/{pid}"),
    ) -> None:
        self._root = Path(host_root)
        self._read = read_samples
        memo = CgroupMemo()
        self._owner_of = owner_of or (lambda d, ids: proc_owner(d, ids, memo=memo))
        self._clock = clock
        self._wall_us = wall_us
        self._newest: dict[str, int] = {}  # per GPU: the newest sample's stamp (wall us)
        self._published: set[str] = set()
        self._shares: dict[str, dict[str, GpuShare]] = {}  # per allocation, per GPU: the last
        self._swept = False
        self._pid_visible = pid_visible
        self._warned = False

    def publish(self, allocations: Mapping[str, Collection[str]]) -> None:
        """``allocations``: each guaranteed container's GPUs (UUIDs). The first call per GPU
        only starts its window."""
        gpus = sorted({u for uuids in allocations.values() for u in uuids})
        owner: PidOwner = _nobody
        if gpus:  # the node's mounts are read only where there is something to attribute
            owner = self._owner_of(self._root / "limits", list(allocations))
        changed: set[str] = set()
        for uuid in gpus:
            newest = self._newest.get(uuid)
            if newest is None:
                self._newest[uuid] = self._wall_us()
                continue
            try:
                samples = [s for s in self._read(uuid, newest) if s[2] > newest]
            except Exception as exc:  # a GPU NVML fails on stays unmeasured this round
                log.debug("per-process utilisation of %s: %s", uuid, exc)
                continue
            if samples and not self._warned and not any(self._pid_visible(p) for p, *_ in samples):
                self._warned = True
                log.warning(
                    "no process NVML lists on GPU %s is in this process's pid namespace: the "
                    "GPU time of guaranteed containers cannot be attributed, and a container "
                    "of several processes is paced as without it (the plugin needs the node's "
                    "pids: hostPID; docs/security.md#compute-guarantees)",
                    uuid,
                )
            # Taken after the read: every stamp it returned is before them.
            wall, now = self._wall_us(), self._clock()
            window = self._window(uuid, newest, samples, wall, now)
            if window is None:
                continue
            start, end = window
            shares = container_shares(((p, u) for p, u, _ in samples), owner)
            for alloc, uuids in allocations.items():
                if uuid in uuids:
                    share = GpuShare(uuid, shares.get(alloc, 0), start, end)
                    self._shares.setdefault(alloc, {})[uuid] = share
                    changed.add(alloc)
        for alloc in changed:
            # A GPU without a new window keeps its last one: left out, the shim would take
            # it for unmeasured.
            last = self._shares[alloc]
            items = [last[u] for u in sorted(allocations[alloc]) if u in last]
            self._write(alloc, items[:MAX_DEVICES])
        for gone in set(self._shares) - set(allocations):
            del self._shares[gone]
        if not self._swept:
            self._sweep(set(allocations))
        for gone in self._published - set(allocations):
            self._remove(gone)
        for uuid in set(self._newest) - set(gpus):
            del self._newest[uuid]

    def _window(
        self, uuid: str, newest: int, samples: list[tuple[int, int, int]], wall: int, now: int
    ) -> tuple[int, int] | None:
        """The monotonic window ``samples`` cover: from the newest stamp before them to theirs
        (each covers the period up to its stamp), the stamps mapped by the clocks' offset now;
        None where there is nothing new to publish. Advances the GPU's newest stamp."""
        if samples:
            stamp = max(t for _, _, t in samples)
        elif newest > wall:  # the wall clock stepped back: start again from now
            self._newest[uuid] = wall
            return None
        elif wall - newest > SILENT_US:
            stamp = wall  # nobody ran since the newest sample
        else:
            return None  # a sample period is not over: the record published stays
        self._newest[uuid] = stamp
        offset = now - wall * 1000
        end = min(stamp * 1000 + offset, now)  # the shim ignores a window ending after its now
        start = max(newest * 1000 + offset, end - MAX_WINDOW_NS)
        return (start, end) if start < end else None

    def _write(self, alloc: str, items: list[GpuShare]) -> None:
        path = record_path(self._root, alloc)
        try:
            # Replaced whole (rename): a shim reads either record, never half of one; not
            # synced: a new one comes every interval.
            write_atomically(path, encode_record(items), 0o444, durable=False)
        except OSError as exc:
            log.warning("cannot publish the GPU time of %s at %s: %s", alloc, path, exc)
            return
        self._published.add(alloc)

    def _sweep(self, live: set[str]) -> None:
        """Once: the records an earlier run left (a crash, a kill) for allocations no longer
        live; only names of this module's making (``<allocation id>.gputime``)."""
        self._swept = True
        try:
            names = os.listdir(self._root / "containers")
        except OSError:
            return
        for name in names:
            alloc = name[: -len(SUFFIX)]
            if not name.endswith(SUFFIX) or alloc in live:
                continue
            try:
                check_allocation_id(alloc)
            except ValueError:
                continue
            self._published.add(alloc)  # removed below, as one of ours

    def _remove(self, alloc: str) -> None:
        self._published.discard(alloc)
        try:
            record_path(self._root, alloc).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove the GPU-time record of %s: %s", alloc, exc)

    def close(self) -> None:
        """Remove the records this publisher made (their containers fall back to today's
        pacing once the shims see them gone)."""
        for alloc in list(self._published):
            self._remove(alloc)


def run_publisher(
    publisher: GpuTimePublisher,
    allocations: Callable[[], Mapping[str, Collection[str]]],
    stop: threading.Event,
    interval: float = DEFAULT_INTERVAL,
) -> None:
    """Publish every ``interval`` seconds until ``stop`` is set; a failed round is logged and
    the next one tried."""
    try:
        while not stop.is_set():
            try:
                publisher.publish(allocations())
            except Exception:  # one bad round must not end the publisher
                log.exception("publishing the containers' GPU time failed")
            stop.wait(interval)
    finally:
        publisher.close()
