"""install-shim on real files: idempotent, atomic, and harmless to processes that map the shim."""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu_plugin.commands import install_shim
from vgpu_plugin.node.host import install, native

# A process that maps the installed shim, as a container's processes do, and answers pings
# with the shim's own version string and the inode its mapping comes from.
_MAPPER = r"""
import ctypes, os, sys
path = sys.argv[1]
lib = ctypes.CDLL(path)
lib.vgpu_shim_version.restype = ctypes.c_char_p
def mapped_inode():
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real:
                return int(fields[4])
    return -1
for line in sys.stdin:
    print(lib.vgpu_shim_version().decode(), mapped_inode(), flush=True)
"""


def _readline(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no answer from the mapping process in {timeout} s")
    return proc.stdout.readline()


def _ping(proc: subprocess.Popen[str]) -> tuple[str, int]:
    assert proc.stdin is not None
    proc.stdin.write("ping\n")
    proc.stdin.flush()
    line = _readline(proc)
    assert line, f"the mapping process died (exit {proc.poll()})"
    version, inode = line.split()
    return version, int(inode)


@pytest.fixture
def shim_build(tmp_path: Path, native_tree: Path) -> Path:
    """A copy of the packaged shim, standing for one build."""
    out = tmp_path / "build-1" / "libvgpu.so"
    out.parent.mkdir()
    shutil.copyfile(native.shim_library(), out)
    return out


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime_ns, mode) of everything under root."""
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(root.rglob("*"))
    }


def test_install_creates_the_layout_and_a_second_run_changes_nothing(
    tmp_path: Path, shim_build: Path
) -> None:
    root = tmp_path / "host"
    first = install.install_shim(root, shim_build)
    digest = hashlib.sha256(shim_build.read_bytes()).hexdigest()
    assert first.version == f"{install.__version__}-{digest[:12]}"
    assert first.shim_path == root / "lib" / f"libvgpu.so.{first.version}"
    assert first.shim_path.read_bytes() == shim_build.read_bytes()
    assert first.shim_path.stat().st_mode & 0o777 == 0o755
    assert (root / "ld.so.preload").read_text() == "/etc/vgpu/libvgpu.so\n"
    assert (root / "limits").is_dir() and (root / "containers").is_dir()
    assert first.changed and first.shim_written and first.preload_written
    # No temporary file is left behind.
    assert not [p for p in root.rglob(".tmp-*")]

    before = _tree(root)
    second = install.install_shim(root, shim_build)
    assert not second.changed and not second.shim_written and not second.preload_written
    assert second.version == first.version
    assert _tree(root) == before


def test_upgrade_keeps_a_process_that_maps_the_old_version_running(
    tmp_path: Path, shim_build: Path
) -> None:
    root = tmp_path / "host"
    old = install.install_shim(root, shim_build)
    old_stat = old.shim_path.stat()
    old_digest = hashlib.sha256(old.shim_path.read_bytes()).hexdigest()

    proc = subprocess.Popen(
        [sys.executable, "-c", _MAPPER, str(old.shim_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        shim_version, inode = _ping(proc)
        assert inode == old_stat.st_ino

        # A changed build: same code, different bytes (trailing data after the ELF sections).
        new_build = tmp_path / "build-2" / "libvgpu.so"
        new_build.parent.mkdir()
        new_build.write_bytes(shim_build.read_bytes() + b"\0rebuilt\0" * 64)
        new = install.install_shim(root, new_build)

        assert new.version != old.version and new.shim_written
        assert new.shim_path.parent == old.shim_path.parent
        assert new.shim_path.read_bytes() == new_build.read_bytes()
        assert new.kept_versions == (old.shim_path,)
        assert not new.preload_written  # same content, left alone
        # The old version is untouched: same inode, size, mtime, content.
        after = old.shim_path.stat()
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            old_stat.st_ino,
            old_stat.st_size,
            old_stat.st_mtime_ns,
        )
        assert hashlib.sha256(old.shim_path.read_bytes()).hexdigest() == old_digest
        # ... and the process that maps it carries on, on the same inode.
        for _ in range(3):
            assert _ping(proc) == (shim_version, old_stat.st_ino)
        assert proc.poll() is None
        # The plugin now mounts the new build.
        assert install.shim_path_for(root, new_build) == new.shim_path
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_check_installed_names_what_is_missing_and_the_fix(
    tmp_path: Path, shim_build: Path
) -> None:
    root = tmp_path / "host"
    with pytest.raises(install.ShimNotInstalled) as err:
        install.check_installed(root, shim_build)
    text = str(err.value)
    assert str(root / "lib") in text and "is missing" in text
    assert f"vgpu-plugin install-shim --host-root {root}" in text

    result = install.install_shim(root, shim_build)
    assert install.check_installed(root, shim_build) == result.shim_path
    assert install.installed_shim_version(root, shim_build) == result.version

    (root / "ld.so.preload").write_text("/somewhere/else.so\n")
    with pytest.raises(install.ShimNotInstalled, match=r"ld\.so\.preload does not name"):
        install.check_installed(root, shim_build)


def test_a_different_build_than_the_plugins_is_not_taken_for_it(
    tmp_path: Path, shim_build: Path
) -> None:
    root = tmp_path / "host"
    install.install_shim(root, shim_build)
    other = tmp_path / "other.so"
    other.write_bytes(shim_build.read_bytes() + b"x")
    with pytest.raises(install.ShimNotInstalled, match="is missing"):
        install.check_installed(root, other)


def test_without_a_packaged_shim_the_last_installed_version_is_used(
    tmp_path: Path, shim_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "host"
    result = install.install_shim(root, shim_build)
    monkeypatch.setenv(native.NATIVE_DIR_ENV, str(tmp_path / "no-native-here"))
    assert install.check_installed(root) == result.shim_path


@pytest.fixture
def versions(tmp_path: Path) -> Iterator[list[tuple[Path, float]]]:
    yield [(tmp_path / f"libvgpu.so.v{i}", 1000.0 * i) for i in (1, 2, 3)]


def test_pruning_removes_only_versions_superseded_before_the_oldest_live_allocation(
    versions: list[tuple[Path, float]],
) -> None:
    current = 4000.0  # v4 installed at 4000; v3 at 3000, v2 at 2000, v1 at 1000
    v1, v2, v3 = (p for p, _ in versions)
    # Unknown live allocations: nothing goes.
    assert install.prunable_versions(versions, current, keep=1, live_since=None) == []
    # The oldest allocation began at 2500, while v2 was handed out (until 3000): v1 may go.
    assert install.prunable_versions(versions, current, keep=1, live_since=2500) == [v1]
    # Every allocation is newer than v4's install: all old ones may go, but keep counts.
    assert install.prunable_versions(versions, current, keep=1, live_since=9000) == [v3, v2, v1]
    assert install.prunable_versions(versions, current, keep=2, live_since=9000) == [v2, v1]


def test_install_with_keep_prunes_unused_old_versions(tmp_path: Path, shim_build: Path) -> None:
    root = tmp_path / "host"
    old = install.install_shim(root, shim_build)
    os.utime(old.shim_path, (1000, 1000))
    newer = tmp_path / "new.so"
    newer.write_bytes(shim_build.read_bytes() + b"y")
    kept = install.install_shim(root, newer, keep=1, live_since=None)
    assert kept.kept_versions == (old.shim_path,) and old.shim_path.exists()
    os.utime(kept.shim_path, (2000, 2000))
    again = install.install_shim(root, newer, keep=1, live_since=5000)
    assert again.pruned_versions == (old.shim_path,) and not old.shim_path.exists()
    assert again.shim_path.exists()


def test_reinstalling_an_older_build_marks_it_current_without_rewriting_it(
    tmp_path: Path, shim_build: Path
) -> None:
    root = tmp_path / "host"
    first = install.install_shim(root, shim_build)
    os.utime(first.shim_path, (1000, 1000))
    newer = tmp_path / "new.so"
    newer.write_bytes(shim_build.read_bytes() + b"z")
    second = install.install_shim(root, newer)
    ino = first.shim_path.stat().st_ino
    back = install.install_shim(root, shim_build)
    assert not back.shim_written and back.changed
    assert first.shim_path.stat().st_ino == ino
    assert first.shim_path.stat().st_mtime > second.shim_path.stat().st_mtime
    # v1 is current again, so v2 was superseded just now: a live allocation may use it.
    assert install.install_shim(root, shim_build, keep=1, live_since=1500).pruned_versions == ()


def test_the_command_reports_what_it_did(
    tmp_path: Path, shim_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    install_shim.add_flags(parser)
    args = parser.parse_args(["--host-root", str(tmp_path / "host"), "--source", str(shim_build)])
    assert install_shim.run(args) == 0
    assert "installed" in capsys.readouterr().out
    assert install_shim.run(args) == 0
    out = capsys.readouterr().out
    assert "already installed" in out and "up to date" in out
    bad = parser.parse_args(["--host-root", str(tmp_path / "h2"), "--source", "/nonexistent"])
    assert install_shim.run(bad) == 1
    assert "/nonexistent" in capsys.readouterr().err


def test_live_since_is_unknown_when_a_container_has_no_record(tmp_path: Path) -> None:
    from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore

    root, state = tmp_path / "host", tmp_path / "state"
    (root / "containers").mkdir(parents=True)
    before = time.time()
    assert (install.live_since(root, state) or 0) >= before  # nothing runs: now
    store = AllocationStore(state)
    for alloc_id, created in (("a", 500.0), ("b", 300.0)):
        store.add(AllocationRecord(alloc_id, (f"GPU-x-{alloc_id}",), "r/g", created))
        (root / "containers" / alloc_id).mkdir()
    assert install.live_since(root, state) == 300.0
    (root / "containers" / "unknown").mkdir()
    assert install.live_since(root, state) is None


def test_another_tools_preload_is_refused_and_named_unless_the_flag_says_replace(
    tmp_path: Path, shim_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    root = tmp_path / "host"
    root.mkdir()
    hami = "/usr/local/vgpu/libvgpu.so\n"  # what HAMi writes in a shared /usr/local/vgpu
    (root / "ld.so.preload").write_text(hami)
    parser = argparse.ArgumentParser()
    install_shim.add_flags(parser)
    args = parser.parse_args(["--host-root", str(root), "--source", str(shim_build)])
    assert install_shim.run(args) == install_shim.EXIT_FOREIGN_PRELOAD
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HAMi" in err and "/usr/local/vgpu/libvgpu.so" in err
    assert "--replace-preload" in err
    assert (root / "ld.so.preload").read_text() == hami
    assert sorted(p.name for p in root.iterdir()) == ["ld.so.preload"]  # nothing written
    forced = parser.parse_args([*map(str, ["--host-root", root, "--source", shim_build]),
                                "--replace-preload"])  # fmt: skip
    assert install_shim.run(forced) == 0
    assert (root / "ld.so.preload").read_text() == install.PRELOAD_TEXT
    # Our own file, or one with only our entry and comments, is no other tool's.
    (root / "ld.so.preload").write_text(f"# vgpu\n{install.SHIM_PATH}\n")
    assert install_shim.run(args) == 0


def test_an_unknown_tools_preload_is_named_by_its_library(tmp_path: Path) -> None:
    (tmp_path / "ld.so.preload").write_text("/opt/x/libsomething.so:/etc/vgpu/libvgpu.so\n")
    with pytest.raises(install.ForeignPreload) as info:
        install.install_shim(tmp_path, Path("/nonexistent"))
    assert "an unknown tool's libsomething.so" in str(info.value)


def test_a_relative_native_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its paths go into containers whose working dir is another (preload's is the pod's)."""
    (tmp_path / "built" / "simgpu").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(native.NATIVE_DIR_ENV, "built")
    assert native.simgpu_dir() == tmp_path / "built" / "simgpu"
