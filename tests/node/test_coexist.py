"""A node where HAMi ran (or runs): serve finds its files and says so in one line, and neither
install-shim (without --replace-preload) nor a full cleanup pass changes any of them."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from vgpu_plugin.commands import install_shim
from vgpu_plugin.commands.serve import log_hami_files, new_cleaner
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.core.pods import PodRef
from vgpu_plugin.node.host import install, native
from vgpu_plugin.node.host.coexist import coexistence_line, find_hami
from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore

POD_DIR = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0_server"  # HAMi's <pod-uid>_<container>
OTHER_POD_DIR = "11111111-2222-3333-4444-555555555555_sidecar"


def hami_node(root: Path, preload: bool = True) -> Path:
    """HAMi's files under ``root`` (standing for the host's /), all a day old; its dir."""
    hami = root / "usr" / "local" / "vgpu"
    (hami / "containers" / POD_DIR).mkdir(parents=True)
    (hami / "containers" / OTHER_POD_DIR).mkdir()
    (hami / "libvgpu.so").write_bytes(b"\x7fELF HAMi-core")
    (hami / "containers" / POD_DIR / "0.cache").write_bytes(b"HAMi's region")
    if preload:
        (hami / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.preload").write_text("/usr/local/vgpu/libvgpu.so\n")
    (root / "tmp" / "vgpulock").mkdir(parents=True)
    (root / "tmp" / "vgpulock" / "lock").write_bytes(b"")
    old = time.time() - 86400
    for p in [*root.rglob("*"), root]:
        os.utime(p, (old, old), follow_symlinks=False)
    return hami


def snapshot(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    """(content of a file, mtime_ns, mode) of everything under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        content = p.read_bytes() if p.is_file() and not p.is_symlink() else None
        out[str(p.relative_to(root))] = (content, st.st_mtime_ns, st.st_mode)
    return out


def test_find_hami_names_each_kind_of_file_and_nothing_on_a_clean_node(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    clean.mkdir()
    assert find_hami(clean / "ours", clean / "locks", root=clean) == []
    assert coexistence_line([]) is None
    root = tmp_path / "node"
    hami = hami_node(root)
    found = find_hami(tmp_path / "ours", tmp_path / "locks", root=root)
    text = "\n".join(found)
    assert f"HAMi-core's library {hami / 'libvgpu.so'}" in text
    assert f"2 HAMi container dir(s) in {hami / 'containers'}" in text and POD_DIR in text
    assert f"{root / 'etc' / 'ld.so.preload'} preloading /usr/local/vgpu/libvgpu.so" in text
    assert f"{hami / 'ld.so.preload'} preloading" in text
    assert f"HAMi's lock dir {root / 'tmp' / 'vgpulock'}" in text
    assert len(found) == 5
    # Our lock dir where HAMi's is (both default to /tmp/vgpulock): the dir tells nothing.
    shared = find_hami(hami, root / "tmp" / "vgpulock", root=root)
    assert not any("lock dir" in f for f in shared) and len(shared) == 4  # hami dir: once


def test_our_own_files_are_not_taken_for_hamis(tmp_path: Path, native_tree: Path) -> None:
    host = tmp_path / "host"
    install.install_shim(host, native.shim_library())
    (host / "containers" / "0190a1b2c3d400000000").mkdir(parents=True)
    assert find_hami(host, tmp_path / "locks", root=tmp_path) == []


def test_serve_logs_one_line_of_what_it_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hami = hami_node(tmp_path)
    caplog.set_level(logging.DEBUG, logger="vgpu_plugin.commands.serve")
    log_hami_files(hami, tmp_path / "our-locks", root=tmp_path)
    (record,) = [r for r in caplog.records if "HAMi" in r.getMessage()]
    line = record.getMessage()
    assert record.levelno == logging.INFO and "\n" not in line
    assert "changes, moves and removes none of them" in line and POD_DIR in line


@pytest.mark.parametrize("preload", [True, False], ids=["hami-preload", "no-hami-preload"])
def test_a_hami_nodes_files_survive_install_shim_and_a_cleanup_pass(
    tmp_path: Path, native_tree: Path, preload: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our host root is HAMi's dir (both default to /usr/local/vgpu). With HAMi's preload
    there install-shim refuses, writing nothing; without it, it installs beside HAMi's files.
    Either way, then a cleanup pass that removes an ended allocation of ours: every file and
    dir of HAMi's keeps its bytes, mode and mtime."""
    root = tmp_path / "node"
    hami = hami_node(root, preload)
    before = snapshot(root)
    parser = argparse.ArgumentParser()
    install_shim.add_flags(parser)
    source = tmp_path / "build" / "libvgpu.so"
    source.parent.mkdir()
    shutil.copyfile(native.shim_library(), source)
    rc = install_shim.run(parser.parse_args(["--host-root", str(hami), "--source", str(source)]))
    capsys.readouterr()
    assert rc == (install_shim.EXIT_FOREIGN_PRELOAD if preload else 0)
    # An allocation of ours that ended, so the pass has work to do, in the shared dirs.
    ours = "0190a1b2c3d400000001"
    (hami / "containers" / ours).mkdir()
    (hami / "limits").mkdir(exist_ok=True)
    (hami / "limits" / ours).write_text("vgpu-limits 1\n")
    store = AllocationStore(tmp_path / "state")
    limit = GpuLimit("GPU-a", 1024 * MIB, 25)
    store.add(AllocationRecord(ours, ("GPU-a-0",), "nvidia.com/gpu", 1000.0, (limit,)))
    now = [1000.0]
    cleaner = new_cleaner(
        store,
        hami,
        lambda: dict[str, PodRef](),  # the kubelet answers: no container holds it
        grace=60,
        cdi_spec_dir=tmp_path / "cdi",
        clock=lambda: now[0],
    )
    cleaner.run_once()  # first seen unheld
    now[0] += 3600
    cleaner.run_once()
    assert not (hami / "containers" / ours).exists() and store.all() == []
    after = snapshot(root)
    # The dirs this plugin shares (the host root, containers/) change as its own entries
    # come and go; everything of HAMi's in them, and elsewhere, stays as it was.
    shared = {str(hami.relative_to(root)), str((hami / "containers").relative_to(root))}
    changed = [p for p, state in before.items() if p not in shared and after.get(p) != state]
    assert changed == []
