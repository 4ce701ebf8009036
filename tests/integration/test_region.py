"""The shared region (native/libvgpu/src/region*.c) and its Python view (vgpu_plugin.region).

The C side runs as real processes (tests/native/region_*.c, loading libvgpu.so as the shim is
loaded): exact accounting, limits, fork, pid reuse, processes killed while holding charges or
the region's lock, files that are not regions, and a stress of 16 processes x 4 threads with
and without SIGKILLs, also under ASan+UBSan and ThreadSanitizer.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import native_build
import pytest

from vgpu_plugin.region import (
    DeviceLimit,
    RegionBusy,
    RegionError,
    create_region,
    read_region,
)

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Tools:
    """The region test programs of one native build."""

    tree: Path

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            VGPU_SHIM_LIB=str(self.tree / "lib" / "libvgpu.so"),
            TSAN_OPTIONS="halt_on_error=1 exitcode=66",
            ASAN_OPTIONS="abort_on_error=0 exitcode=23",
        )

    def run(
        self, prog: str, *args: object, timeout: float = 60, ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.tree / "tests" / prog), *map(str, args)],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if ok:
            assert proc.returncode == 0, f"{prog} {args}: {proc.stdout}{proc.stderr}"
        assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
        return proc

    def start(self, *args: object) -> subprocess.Popen[str]:
        """A region_tool that sets a scene and waits; returns once it says so."""
        proc = subprocess.Popen(
            [str(self.tree / "tests" / "region_tool"), *map(str, args)],
            env=self.env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(("ready", "locked", "child")), line
        return proc


@pytest.fixture(scope="module")
def tools(native_tree: Path) -> Tools:
    return Tools(native_tree)


@pytest.fixture
def region(tools: Tools, tmp_path: Path) -> Path:
    """A fresh region: one device limited to 1 GiB."""
    path = tmp_path / "alloc.cache"
    tools.run("region_tool", "create", path, 1, "1g")
    return path


@pytest.fixture
def killer() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def granted_ms(proc: subprocess.CompletedProcess[str]) -> int:
    m = re.search(r"granted after (\d+) ms", proc.stdout)
    assert m, proc.stdout
    return int(m.group(1))


# --- accounting -------------------------------------------------------------------------------


def test_reserve_to_the_limit_refuse_past_it_release_exactly(tools: Tools, region: Path) -> None:
    out = tools.run("region_tool", "basic", region)
    assert "basic ok" in out.stdout
    usable = re.search(r"usable=(\d+)", out.stdout)
    assert usable and int(usable.group(1)) >= 0.99 * GIB
    # Over-release is clamped with exactly one warning per process.
    assert out.stderr.count("clamped") == 1
    snap = read_region(region)
    assert snap.devices[0].used == 0 and snap.processes == ()


def test_own_limits_cannot_raise_the_region_limit(tools: Tools, region: Path) -> None:
    tools.run("region_tool", "limits", region)
    assert read_region(region).devices[0].memory_limit == GIB


def test_creation_race_has_one_creator_and_no_half_made_region(
    tools: Tools, tmp_path: Path
) -> None:
    path = tmp_path / "race.cache"
    assert "created=1" in tools.run("region_tool", "race", path, 24).stdout
    assert (path.stat().st_mode & 0o777) == 0o666
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary file left behind


def test_forked_child_registers_its_own_slot(tools: Tools, region: Path) -> None:
    tools.run("region_tool", "fork", region, "100m", "200m")


def test_parent_slot_dies_with_the_parent_although_a_child_lives(
    tools: Tools, region: Path, killer: list[subprocess.Popen[str]]
) -> None:
    proc = tools.run("region_tool", "fork-orphan", region, "900m")
    child = int(proc.stdout.split()[1])
    try:
        snap = read_region(region)
        assert [(p.alive, p.used) for p in snap.processes] == [(False, (900 * MIB,))]
        assert granted_ms(tools.run("region_tool", "reserve", region, "900m", 1000)) < 1000
    finally:
        os.kill(child, signal.SIGKILL)


def test_pid_reuse_cannot_inherit_usage(tools: Tools, region: Path) -> None:
    tools.run("region_tool", "pid-reuse", region)


# --- processes killed at the worst moments ------------------------------------------------------


@pytest.mark.parametrize("mode", ["committed", "pending"])
def test_sigkilled_holder_is_reclaimed_within_a_second(
    tools: Tools, region: Path, killer: list[subprocess.Popen[str]], mode: str
) -> None:
    holder = tools.start("hold", region, "700m", mode)
    killer.append(holder)
    snap = read_region(region)
    (p,) = snap.processes
    assert p.alive and p.pid == holder.pid and p.used == (700 * MIB,)
    assert p.pending == ((700 * MIB,) if mode == "pending" else (0,))
    assert tools.run("region_tool", "reserve", region, "700m", 100, ok=False).returncode == 2
    kill(holder)
    t0 = time.monotonic()
    assert granted_ms(tools.run("region_tool", "reserve", region, "700m", 1000)) < 1000
    assert time.monotonic() - t0 < 5
    snap = read_region(region)
    assert snap.devices[0].used == sum(p.used[0] for p in snap.processes) < 700 * MIB


def test_writer_killed_inside_the_lock(tools: Tools, region: Path) -> None:
    """A process dies holding the lock mid-update (a torn total): nobody blocks, the host
    sees what the repair will give, and the first tenant repairs it."""
    tools.run("region_tool", "lock-and", region, "kill", ok=False)
    snap = read_region(region)
    assert snap.recovered and snap.devices[0].used == 0
    assert granted_ms(tools.run("region_tool", "reserve", region, "1g", 1000)) < 1000
    snap = read_region(region)
    assert not snap.recovered and snap.devices[0].used == 0


def test_writer_stopped_inside_the_lock_then_killed(
    tools: Tools, region: Path, killer: list[subprocess.Popen[str]]
) -> None:
    stopped = tools.start("lock-and", region, "pause")
    killer.append(stopped)
    with pytest.raises(RegionBusy, match="busy"):
        read_region(region)
    waiter = subprocess.Popen(
        [str(tools.tree / "tests" / "region_tool"), "reserve", region, "1g", "3000"],
        env=tools.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killer.append(waiter)
    time.sleep(0.3)
    assert waiter.poll() is None  # a stopped holder blocks the tenants, as any lock holder
    kill(stopped)
    out, err = waiter.communicate(timeout=1.0)  # ... and its death releases them at once
    assert waiter.returncode == 0 and "granted" in out, out + err
    assert "totals recomputed" in err
    assert read_region(region).devices[0].used == 0


# --- files that are not regions -------------------------------------------------------------------


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bad magic":
        data[0:8] = b"NOTVGPU\0"
    elif how == "wrong version":
        data[8:12] = (2).to_bytes(4, "little")
    elif how == "truncated":
        del data[4096:]
    elif how == "size field":
        data[16:24] = (len(data) + 4096).to_bytes(8, "little")
    elif how == "device count":
        data[12:16] = (99).to_bytes(4, "little")
    elif how == "foreign":
        data = bytearray(os.urandom(len(data)))
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


REFUSALS = {
    "bad magic": "not a vgpu region: bad magic",
    "wrong version": "layout version 2, this build reads version 1",
    "truncated": "is truncated: 4096 bytes",
    "size field": "wrong size",
    "device count": "is corrupt: 99 devices",
    "foreign": "not a vgpu region: bad magic",
    "empty": "not a vgpu region: bad magic, 0 bytes",
}


@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_files_that_are_not_regions_are_refused(tools: Tools, region: Path, how: str) -> None:
    _corrupt(region, how)
    before = region.read_bytes()
    reason = REFUSALS[how]
    for cmd in ("open", "snapshot"):
        out = tools.run("region_tool", cmd, region, ok=False)
        assert out.returncode != 0 and reason in out.stdout and str(region) in out.stdout
    with pytest.raises(RegionError, match=re.escape(reason)) as info:
        read_region(region)
    assert info.value.path == region and str(region) in str(info.value)
    assert region.read_bytes() == before  # refused, never repaired


def test_symlinked_or_missing_region_is_refused(tools: Tools, region: Path) -> None:
    link = region.with_name("link.cache")
    link.symlink_to(region)
    with pytest.raises(RegionError, match="cannot open region"):
        read_region(link)
    assert "cannot open region" in tools.run("region_tool", "open", link, ok=False).stdout
    with pytest.raises(RegionError, match="No such file"):
        read_region(region.with_name("missing.cache"))


def test_books_that_do_not_add_up_are_refused(tools: Tools, region: Path) -> None:
    data = bytearray(region.read_bytes())
    data[120:128] = (5 * MIB).to_bytes(8, "little")  # device 0's total, no slot holds it
    region.write_bytes(bytes(data))
    with pytest.raises(RegionError, match="corrupt: device 0 has 5242880 bytes charged"):
        read_region(region)


# --- the host's view ------------------------------------------------------------------------------


def test_plugin_precreates_and_tenants_attach(tools: Tools, tmp_path: Path) -> None:
    path = tmp_path / "pre.cache"
    uuids = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-aaaa"]
    assert create_region(path, [DeviceLimit(uuids[0], GIB, 25), DeviceLimit(uuids[1], 2 * GIB)])
    assert not create_region(path, [DeviceLimit(uuids[0], 8 * GIB)])  # written once
    assert (path.stat().st_mode & 0o777) == 0o666
    tools.run("region_tool", "basic", path)
    snap = read_region(path)
    assert [(d.uuid, d.memory_limit, d.sm_percent, d.used) for d in snap.devices] == [
        (uuids[0], GIB, 25, 0),
        (uuids[1], 2 * GIB, 0, 0),
    ]
    with pytest.raises(RegionError, match="listed twice"):
        create_region(tmp_path / "dup.cache", [DeviceLimit("GPU-x", 1), DeviceLimit("GPU-x", 1)])
    with pytest.raises(RegionError, match="out of range"):
        create_region(tmp_path / "neg.cache", [DeviceLimit("GPU-x", -1)])
    with pytest.raises(RegionError, match="bad uuid or SM percent"):
        create_region(tmp_path / "sm.cache", [DeviceLimit("GPU-x", 1, 101)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pre.cache"]


def test_dead_slot_shows_as_not_alive(tools: Tools, region: Path) -> None:
    tools.run("region_tool", "forge", region, "64m", os.getpid())
    (p,) = read_region(region).processes
    assert p.pid == os.getpid() and not p.alive and p.used == (64 * MIB,)


def test_python_reads_consistent_snapshots_while_c_allocates(tools: Tools, tmp_path: Path) -> None:
    path = tmp_path / "busy.cache"
    stress = subprocess.Popen(
        [
            str(tools.tree / "tests" / "region_stress"),
            path,
            "--no-check",
            "--seconds",
            "3",
            "--devices",
            "2",
            "--procs",
            "8",
        ],
        env=tools.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not path.exists():
            time.sleep(0.01)
        seen, busy_seen, deadline = 0, 0, time.monotonic() + 2.5
        while time.monotonic() < deadline:
            snap = read_region(path)
            for d, dev in enumerate(snap.devices):
                assert dev.used == sum(p.used[d] for p in snap.processes) <= dev.memory_limit
            seen += 1
            busy_seen += any(d.used > 0 for d in snap.devices)
        out, err = stress.communicate(timeout=30)
    finally:
        if stress.poll() is None:
            stress.kill()
            stress.wait()
    assert stress.returncode == 0, out + err
    assert seen > 50 and busy_seen > 10
    assert read_region(path).devices[0].used == 0


# --- stress, also under the sanitizers ------------------------------------------------------------


def _stress(tools: Tools, path: Path, *args: object) -> dict[str, float]:
    out = tools.run("region_stress", path, *args, timeout=120)
    assert "stress ok" in out.stdout, out.stdout + out.stderr
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", out.stdout)}


@pytest.fixture(scope="module")
def asan_tools() -> Tools:
    return Tools(native_build.build("asan"))


@pytest.fixture(scope="module")
def tsan_tools() -> Tools:
    return Tools(native_build.build("tsan"))


@pytest.mark.slow
@pytest.mark.parametrize("kill_ms", [0, 100], ids=["no-kills", "sigkills"])
def test_stress_16_processes_4_threads(tools: Tools, tmp_path: Path, kill_ms: int) -> None:
    stats = _stress(tools, tmp_path / "s.cache", "--seconds", 5, "--kill-ms", kill_ms)
    assert stats["snapshots"] > 100 and stats["denied"] > 0
    assert stats["max_used"] <= stats["limit"]
    assert stats["kills"] >= (30 if kill_ms else 0)


@pytest.mark.slow
@pytest.mark.parametrize("kill_ms", [0, 100], ids=["no-kills", "sigkills"])
def test_stress_under_asan_ubsan(asan_tools: Tools, tmp_path: Path, kill_ms: int) -> None:
    stats = _stress(asan_tools, tmp_path / "a.cache", "--seconds", 4, "--kill-ms", kill_ms)
    assert stats["snapshots"] > 20


@pytest.mark.slow
def test_killed_writers_under_asan_ubsan(asan_tools: Tools, tmp_path: Path) -> None:
    path = tmp_path / "k.cache"
    asan_tools.run("region_tool", "create", path, 1, "1g")
    asan_tools.run("region_tool", "lock-and", path, "kill", ok=False)
    assert granted_ms(asan_tools.run("region_tool", "reserve", path, "1g", 1000)) < 1000
    for cmd in (("basic",), ("fork", "1m", "2m"), ("pid-reuse",)):
        asan_tools.run("region_tool", cmd[0], path, *cmd[1:])


@pytest.mark.slow
def test_stress_under_tsan(tsan_tools: Tools, tmp_path: Path) -> None:
    stats = _stress(tsan_tools, tmp_path / "t.cache", "--seconds", 4, "--kill-ms", 200)
    assert stats["snapshots"] > 20
