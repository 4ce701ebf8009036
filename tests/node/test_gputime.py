"""The GPU-time publisher's core (node/observe/gputime.py): attribution of node pids by the
container's limits mount, the per-container shares, the record the shim reads, and the
publisher's files. The whole loop against the shim: tests/libvgpu/test_shim_multiproc.py."""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
from conftest import NO_NAMESPACES

from vgpu_plugin.node.observe import gputime
from vgpu_plugin.node.observe.gputime import (
    GpuShare,
    GpuTimePublisher,
    PidOwner,
    container_shares,
    decode_record,
    encode_record,
    file_key,
    mount_owner,
    proc_owner,
)

HOST = (
    "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "40 22 253:2 / /var/lib/vgpu rw,relatime shared:9 - xfs /dev/vdb rw\n"
)
# A container: its root is an overlay, the limits file bind-mounted from the host's xfs.
CONTAINER_A = (
    "600 500 0:90 / / rw - overlay overlay rw\n"
    "611 600 253:2 /limits/aaa /etc/vgpu/limits ro,relatime - xfs /dev/vdb rw\n"
    "612 600 253:2 /containers/aaa /tmp/vgpu rw,relatime - xfs /dev/vdb rw\n"
    "613 600 253:2 /containers /etc/vgpu/peers ro,relatime - xfs /dev/vdb rw\n"
)


def test_a_limits_file_is_known_by_its_device_and_its_path_in_that_filesystem() -> None:
    assert file_key(HOST, "/var/lib/vgpu/limits/aaa") == ("253:2", "/limits/aaa")
    assert file_key(HOST, "/usr/local/vgpu/limits/aaa") == ("253:1", "/usr/local/vgpu/limits/aaa")


def test_a_pid_belongs_to_the_container_whose_limits_file_its_namespace_mounts() -> None:
    keys = {("253:2", "/limits/aaa"): "aaa", ("253:2", "/limits/bbb"): "bbb"}
    assert mount_owner(CONTAINER_A, keys) == "aaa"
    assert mount_owner(HOST, keys) is None  # a host process: nobody's


def test_a_tenant_cannot_pass_its_processes_off_as_another_containers() -> None:
    """It can mount only what it sees: a file named like B's limits in its own writable
    directory (same filesystem) or in a tmpfs of its user namespace is not B's file."""
    keys = {("253:2", "/limits/aaa"): "aaa", ("253:2", "/limits/bbb"): "bbb"}
    forged = (
        "620 600 253:2 /containers/aaa/limits/bbb /x ro - xfs /dev/vdb rw\n"
        "621 600 0:99 /limits/bbb /y ro - tmpfs tmpfs rw\n"
    )
    assert mount_owner(CONTAINER_A + forged, keys) == "aaa"
    assert mount_owner(forged, keys) is None


def test_mountinfo_escapes_are_undone() -> None:
    info = "1 0 8:1 /a\\040b/limits/x /etc/vgpu/limits ro - ext4 /dev/sda rw\n"
    assert mount_owner(info, {("8:1", "/a b/limits/x"): "x"}) == "x"


def test_each_containers_share_is_the_sum_of_its_processes_means() -> None:
    owners = {1: "a", 2: "a", 3: "b"}
    samples = [(1, 20), (1, 30), (2, 10), (3, 70), (4, 99)]  # pid 4: no container of ours
    assert container_shares(samples, owners.get) == {"a": 350, "b": 700}
    assert container_shares([(1, 90), (2, 90)], owners.get) == {"a": 1000}  # at most the GPU


def test_the_record_has_the_layout_the_shim_reads() -> None:
    data = encode_record([GpuShare("GPU-1", 250, 10, 20), GpuShare("GPU-2", 1500, 30, 40)])
    assert len(data) == gputime.SIZE == 32 + 16 * 104
    assert data[:8] == b"VGPUGPT\0"
    assert struct.unpack_from("<IIQ", data, 8) == (1, 2, gputime.SIZE)
    rec = 32 + 104
    assert data[rec : rec + 6] == b"GPU-2\0"
    assert struct.unpack_from("<IIQQ", data, rec + 80) == (1000, 0, 30, 40)  # clamped
    assert decode_record(data) == [GpuShare("GPU-1", 250, 10, 20), GpuShare("GPU-2", 1000, 30, 40)]
    with pytest.raises(ValueError, match="longer than 79"):
        encode_record([GpuShare("G" * 80, 0, 0, 0)])


class FakeDriver:
    """NVML's per-process samples (pid, smUtil, stamp): a read answers those newer than its
    lastSeenTimeStamp and, given the clock, of periods that have ended, as the driver does."""

    def __init__(self, clocks: Clocks | None = None) -> None:
        self.samples: dict[str, list[tuple[int, int, int]]] = {}
        self.asked: list[tuple[str, int]] = []
        self.clocks = clocks

    def read(self, uuid: str, since_us: int) -> list[tuple[int, int, int]]:
        self.asked.append((uuid, since_us))
        now = self.clocks.wall_us if self.clocks else 2**63
        return [s for s in self.samples.get(uuid, []) if since_us < s[2] <= now]


class Clocks:
    """The node's clocks: CPU realtime (us) and monotonic (ns), a known offset apart."""

    def __init__(self, wall_us: int) -> None:
        self.wall_us = wall_us

    def wall(self) -> int:
        return self.wall_us

    def mono(self) -> int:
        return mono(self.wall_us)


def mono(wall_us: int) -> int:
    return (wall_us - 1_000_000) * 1000


def owners(table: dict[int, str]) -> Callable[[Path, Collection[str]], PidOwner]:
    def owner_of(limits_dir: Path, ids: Collection[str]) -> PidOwner:
        return lambda pid: table.get(pid) if table.get(pid) in ids else None

    return owner_of


def record(root: Path, alloc: str) -> list[GpuShare]:
    path = root / "containers" / f"{alloc}.gputime"
    return decode_record(path.read_bytes()) if path.exists() else []


def test_the_publisher_writes_each_containers_window_and_removes_what_it_made(
    tmp_path: Path,
) -> None:
    (tmp_path / "containers").mkdir()
    driver = FakeDriver()
    clocks = Clocks(5_000_000)
    pub = GpuTimePublisher(
        tmp_path, driver.read, owners({7: "a", 8: "a", 9: "b"}), clocks.mono, clocks.wall
    )
    allocs = {"a": {"GPU-1"}, "b": {"GPU-1"}}
    pub.publish(allocs)  # starts the window
    assert driver.asked == []
    assert not (tmp_path / "containers" / "a.gputime").exists()
    driver.samples["GPU-1"] = [(7, 10, 5_150_000), (8, 15, 5_150_000), (9, 70, 5_150_000)]
    clocks.wall_us = 5_200_000
    pub.publish(allocs)
    assert driver.asked == [("GPU-1", 5_000_000)]
    a = tmp_path / "containers" / "a.gputime"
    assert record(tmp_path, "a") == [GpuShare("GPU-1", 250, mono(5_000_000), mono(5_150_000))]
    assert record(tmp_path, "b")[0].share == 700
    assert a.stat().st_mode & 0o777 == 0o444
    # B is gone; a long gap is measured as the driver's last second
    driver.samples["GPU-1"] = [(7, 10, 9_000_000)]
    clocks.wall_us = 9_100_000
    pub.publish({"a": {"GPU-1"}})
    assert record(tmp_path, "a")[0].start_ns == mono(8_000_000)
    assert not (tmp_path / "containers" / "b.gputime").exists()
    (tmp_path / "containers" / "other").write_text("not ours")
    pub.close()
    assert sorted(os.listdir(tmp_path / "containers")) == ["other"]


def run_periods(
    tmp_path: Path, driver: FakeDriver, clocks: Clocks, until_us: int, every_us: int = 200_000
) -> list[list[GpuShare]]:
    """Publishes for container "a" (pid 7) every ``every_us`` until ``until_us``: each
    record that came new."""
    (tmp_path / "containers").mkdir(exist_ok=True)
    pub = GpuTimePublisher(tmp_path, driver.read, owners({7: "a"}), clocks.mono, clocks.wall)
    out: list[list[GpuShare]] = []
    while clocks.wall_us <= until_us:
        pub.publish({"a": {"GPU-1"}})
        got = record(tmp_path, "a")
        if got and (not out or got != out[-1]):
            out.append(got)
        clocks.wall_us += every_us
    return out


def test_sample_periods_sparser_than_the_publications_leave_the_record_as_it_is(
    tmp_path: Path,
) -> None:
    """A driver of 1 s periods, read every 0.2 s: four reads of five find no new sample. That
    is not "nobody ran": the record of the last period stays until the next one ends."""
    clocks = Clocks(5_100_000)
    driver = FakeDriver(clocks)
    # pid 7 ran 30 % of each period; the periods end at whole seconds
    driver.samples["GPU-1"] = [(7, 30, t) for t in (5_000_000, 6_000_000, 7_000_000, 8_000_000)]
    got = run_periods(tmp_path, driver, clocks, 8_100_000)
    assert [g.share for [g] in got] == [300, 300, 300], got  # never a share of 0
    assert [(g.start_ns, g.end_ns) for [g] in got] == [
        (mono(5_100_000), mono(6_000_000)),  # the first read only started the window
        (mono(6_000_000), mono(7_000_000)),
        (mono(7_000_000), mono(8_000_000)),
    ]


def test_the_window_is_the_one_the_samples_cover_by_their_stamps(tmp_path: Path) -> None:
    """Periods of 1/6 s read every 0.25 s: a read brings the periods that ended since the last
    sample seen, each covering the period before its stamp, not the publisher's own times."""
    clocks = Clocks(5_010_000)
    driver = FakeDriver(clocks)
    ends = [5_000_000 + 166_667 * i for i in range(1, 7)]
    driver.samples["GPU-1"] = [(7, 10 * i, t) for i, t in enumerate(ends, 1)]
    got = run_periods(tmp_path, driver, clocks, 6_010_000, every_us=250_000)
    assert [(g.start_ns, g.end_ns) for [g] in got] == [
        (mono(5_010_000), mono(ends[0])),
        (mono(ends[0]), mono(ends[2])),  # two periods ended since: their mean
        (mono(ends[2]), mono(ends[3])),
        (mono(ends[3]), mono(ends[5])),
    ]
    assert [g.share for [g] in got] == [100, 250, 400, 550]
    assert ("GPU-1", ends[2]) in driver.asked  # read from the newest stamp seen


def test_a_driver_silent_for_longer_than_its_longest_period_means_nobody_ran(
    tmp_path: Path,
) -> None:
    """An idle container's record still moves (so its shim can grow its rate), over the time
    since the last sample, once no period can still be running."""
    clocks = Clocks(5_100_000)
    driver = FakeDriver(clocks)
    driver.samples["GPU-1"] = [(7, 40, 6_000_000)]
    got = run_periods(tmp_path, driver, clocks, 9_300_000)
    assert [g.share for [g] in got] == [400, 0, 0], got
    # 1.5 s after the sample of 6.0 s, and after that record's end: the time since, capped
    # at a second as every window
    assert gputime.SILENT_US == 1_500_000
    assert [(g.start_ns, g.end_ns) for [g] in got[1:]] == [
        (mono(6_700_000), mono(7_700_000)),
        (mono(8_300_000), mono(9_300_000)),
    ]


def test_the_exact_answer_per_call_is_measured_as_before(tmp_path: Path) -> None:
    """SIMGPU_UTIL_PERIOD_MS unset: each read answers one sample per process of the caller's
    own window, stamped at the call (here 1 ms before the publisher's clocks)."""
    (tmp_path / "containers").mkdir()
    clocks = Clocks(5_000_000)

    def exact(uuid: str, since_us: int) -> list[tuple[int, int, int]]:
        return [(7, 20, clocks.wall_us - 1000), (9, 50, clocks.wall_us - 1000)]

    pub = GpuTimePublisher(tmp_path, exact, owners({7: "a", 9: "b"}), clocks.mono, clocks.wall)
    allocs = {"a": {"GPU-1"}, "b": {"GPU-1"}}
    windows = []
    for _ in range(4):
        pub.publish(allocs)
        windows.append([record(tmp_path, n) for n in ("a", "b")])
        clocks.wall_us += 200_000
    assert windows[0] == [[], []]
    for i, (a, b) in enumerate(windows[1:], 1):
        assert [a[0].share, b[0].share] == [200, 500]
        end = mono(5_000_000 + 200_000 * i - 1000)
        assert a[0].end_ns == b[0].end_ns == end
        assert a[0].start_ns == (mono(5_000_000) if i == 1 else end - 200_000_000)


def test_a_gpu_without_a_new_window_keeps_its_last_one_in_the_record(tmp_path: Path) -> None:
    """A container of two GPUs whose driver periods end at different times: the record
    rewritten for one keeps the other's (left out, the shim would take it as unmeasured)."""
    clocks = Clocks(5_900_000)
    driver = FakeDriver(clocks)
    driver.samples["GPU-1"] = [(7, 30, 6_000_000), (7, 30, 7_000_000)]
    driver.samples["GPU-2"] = [(8, 60, 6_500_000)]
    (tmp_path / "containers").mkdir()
    pub = GpuTimePublisher(
        tmp_path, driver.read, owners({7: "a", 8: "a"}), clocks.mono, clocks.wall
    )
    pub.publish({"a": {"GPU-1", "GPU-2"}})
    for wall in (6_100_000, 7_100_000):
        clocks.wall_us = wall
        pub.publish({"a": {"GPU-1", "GPU-2"}})
    assert record(tmp_path, "a") == [
        GpuShare("GPU-1", 300, mono(6_000_000), mono(7_000_000)),
        GpuShare("GPU-2", 600, mono(5_900_000), mono(6_500_000)),
    ]


def test_records_an_earlier_run_left_are_removed_and_nothing_else(tmp_path: Path) -> None:
    containers = tmp_path / "containers"
    containers.mkdir()
    for name in ("old.gputime", "live.gputime", "old.pace", ".x.gputime"):
        (containers / name).write_bytes(b"x")
    (containers / "old").mkdir()
    pub = GpuTimePublisher(tmp_path, FakeDriver().read, owners({}))
    pub.publish({"live": {"GPU-1"}})
    assert sorted(os.listdir(containers)) == [".x.gputime", "live.gputime", "old", "old.pace"]


def test_a_plugin_that_cannot_see_the_nodes_pids_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "containers").mkdir()
    driver = FakeDriver()
    # stamped ahead of the publisher's clock: every read finds it new
    driver.samples["GPU-1"] = [(4242, 50, 2**62)]
    pub = GpuTimePublisher(tmp_path, driver.read, owners({}), pid_visible=lambda pid: False)
    for _ in range(3):
        pub.publish({"a": {"GPU-1"}})
    said = [r for r in caplog.records if "pid namespace" in r.getMessage()]
    assert len(said) == 1 and "hostPID" in said[0].getMessage()
    seen = GpuTimePublisher(tmp_path, driver.read, owners({}), pid_visible=lambda pid: True)
    caplog.clear()
    for _ in range(3):
        seen.publish({"a": {"GPU-1"}})
    assert not [r for r in caplog.records if "pid namespace" in r.getMessage()]


def test_proc_owner_reads_the_pids_mountinfo(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for name, text in (("self", HOST), ("42", CONTAINER_A), ("43", HOST)):
        (proc / name).mkdir(parents=True)
        (proc / name / "mountinfo").write_text(text)
    owner = proc_owner(Path("/var/lib/vgpu/limits"), ["aaa", "bbb"], proc)
    assert (owner(42), owner(43), owner(44)) == ("aaa", None, None)


# A process of container A that changed its root (chroot into a dir of its image): its
# mountinfo shows no limits file, its cgroup is A's.
CHROOTED = "700 600 0:90 /srv/jail / rw - overlay overlay rw\n"
CGROUP_A = "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope\n"
CGROUP_B = "0::/kubepods.slice/kubepods-pod2.slice/cri-containerd-b.scope\n"
CONTAINER_B = CONTAINER_A.replace("aaa", "bbb")


def fake_proc(root: Path, pids: dict[str, tuple[str, str]]) -> Path:
    """A /proc of (mountinfo, cgroup) per pid; ``self`` the host's mounts."""
    proc = root / "proc"
    for pid, (mountinfo, cgroup) in {"self": (HOST, "0::/\n"), **pids}.items():
        (proc / pid).mkdir(parents=True, exist_ok=True)
        (proc / pid / "mountinfo").write_text(mountinfo)
        (proc / pid / "cgroup").write_text(cgroup)
    return proc


def drop(proc: Path, pid: str) -> None:
    for name in ("mountinfo", "cgroup"):
        (proc / pid / name).unlink()
    (proc / pid).rmdir()


LIMITS = Path("/var/lib/vgpu/limits")


def test_a_process_that_hides_its_limits_mount_is_its_containers_by_its_cgroup(
    tmp_path: Path,
) -> None:
    """Found by another pid of its cgroup that the mount attributes (a search of /proc), and
    remembered after that pid is gone; forgotten when the allocation ends."""
    proc = fake_proc(
        tmp_path, {"42": (CONTAINER_A, CGROUP_A), "44": (CHROOTED, CGROUP_A), "45": (HOST, "")}
    )
    memo = gputime.CgroupMemo()
    owner = proc_owner(LIMITS, ["aaa", "bbb"], proc, memo)
    assert (owner(44), owner(42), owner(45)) == ("aaa", "aaa", None)
    drop(proc, "42")
    owner = proc_owner(LIMITS, ["aaa", "bbb"], proc, memo)
    assert owner(44) == "aaa"  # no pid shows the mount now: the cgroup learnt before
    owner = proc_owner(LIMITS, ["bbb"], proc, memo)
    assert owner(44) is None  # A ended: its cgroup is forgotten


def test_a_cgroup_two_containers_share_attributes_nobody_by_it(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            "42": (CONTAINER_A, CGROUP_A),
            "43": (CONTAINER_B, CGROUP_A),
            "44": (CHROOTED, CGROUP_A),
        },
    )
    owner = proc_owner(LIMITS, ["aaa", "bbb"], proc, gputime.CgroupMemo())
    assert (owner(42), owner(43), owner(44)) == ("aaa", "bbb", None)


def test_proc_is_searched_for_a_cgroup_at_most_every_few_seconds(tmp_path: Path) -> None:
    now = [0]
    proc = fake_proc(tmp_path, {"44": (CHROOTED, CGROUP_B)})
    memo = gputime.CgroupMemo(scan_every_ns=5_000_000_000)

    def owner(pid: int) -> str | None:
        return proc_owner(LIMITS, ["bbb"], proc, memo, clock=lambda: now[0])(pid)

    assert owner(44) is None  # searched: no pid of B's cgroup shows B's mount
    fake_proc(tmp_path, {"47": (CONTAINER_B, CGROUP_B)})
    now[0] = 4_000_000_000
    assert owner(44) is None  # not searched again yet
    now[0] = 5_000_000_000
    assert owner(44) == "bbb"


@pytest.mark.skipif(
    NO_NAMESPACES,
    reason="needs root and unshare(1)/mount(8): a container is a mount namespace here",
)
def test_on_the_real_proc_a_pid_without_the_mount_is_known_by_its_cgroup(
    tmp_path: Path,
) -> None:
    """Two real processes of one cgroup (this test's): one with the limits file bind-mounted
    in a mount namespace of its own, one without any (as after a chroot)."""
    limits = tmp_path / "limits"
    limits.mkdir()
    (limits / "aaa").write_text("vgpu-limits 1\n")
    point = tmp_path / "point"
    point.touch()
    mounted = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" "$2" && echo up && exec sleep 60', "sh", str(limits / "aaa"),
         str(point)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    hidden = subprocess.Popen(["sleep", "60"])
    try:
        assert mounted.stdout is not None and mounted.stdout.readline() == "up\n"
        owner = proc_owner(limits, ["aaa"], memo=gputime.CgroupMemo())
        assert owner(hidden.pid) == "aaa"  # by the search: the mount's pid shares its cgroup
        assert owner(mounted.pid) == "aaa"
    finally:
        for p in (mounted, hidden):
            p.kill()
            p.wait()
