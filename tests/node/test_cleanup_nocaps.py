"""Cleanup as the chart runs it: root with every capability dropped, against a tenant that
did its worst inside its own dir (issue 14, item 8). Runs the removal in a subprocess under
``setpriv`` with empty capability sets, for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv (util-linux)"
)

REMOVE = """
import sys
from pathlib import Path
from vgpu_plugin.node.host.cleanup import remove_allocation_files
caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]
assert int(caps, 16) == 0, caps
remove_allocation_files(Path(sys.argv[1]), sys.argv[2])
"""


def run_without_caps(root: Path, allocation_id: str) -> subprocess.CompletedProcess[str]:
    assert SETPRIV is not None
    args = (str(root), allocation_id)
    return subprocess.run(
        [SETPRIV, "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", REMOVE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def tenant_dir(root: Path, allocation_id: str) -> Path:
    d = root / "containers" / allocation_id
    d.mkdir(parents=True)
    d.chmod(0o777)
    limits = root / "limits" / allocation_id
    limits.parent.mkdir(exist_ok=True)
    limits.write_text("vgpu-limits 1\n")
    return d


def test_a_hostile_tenants_dir_is_removed_without_capabilities(tmp_path: Path) -> None:
    root = tmp_path / "host"
    d = tenant_dir(root, "a1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (d / "a1.cache").write_bytes(b"region")
    ro = d / "readonly"
    ro.mkdir()
    (ro / "f1").write_text("x")
    (ro / "deeper").mkdir()
    (ro / "deeper" / "f2").write_text("y")
    (ro / "deeper" / "link-file").symlink_to(outside / "precious")
    (ro / "deeper").chmod(0)
    ro.chmod(0o555)
    (d / "link-out").symlink_to(outside)
    d.chmod(0)  # the tenant chmods its /tmp/vgpu to 000
    done = run_without_caps(root, "a1")
    assert done.returncode == 0, done.stderr
    assert not d.exists() and not (root / "limits" / "a1").exists()
    assert (outside / "precious").read_text() == "keep"
    assert (outside / "precious").stat().st_mode & 0o777 == 0o644


def test_files_of_another_uid_in_a_dir_it_made_read_only_are_moved_aside(tmp_path: Path) -> None:
    root = tmp_path / "host"
    tmp_path.chmod(0o755)
    d = tenant_dir(root, "b2")
    ro = d / "readonly"
    ro.mkdir()
    (ro / "f").write_text("x")
    os.chown(ro / "f", 1000, 1000)
    os.chown(ro, 1000, 1000)
    ro.chmod(0o555)
    done = run_without_caps(root, "b2")
    assert done.returncode == 0, done.stderr
    assert not d.exists() and not (root / "limits" / "b2").exists()
    assert (root / "containers" / ".unremovable-b2" / "readonly" / "f").exists()


UNPREPARE = """
import logging, sys
from pathlib import Path
from kubelet.test_dra_driver import make_driver
from vgpu_plugin.kubelet.dra.driver import ClaimRef
from vgpu_plugin.sim.dra_kubelet import FakeApiServer
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]
assert int(caps, 16) == 0, caps
make_driver(Path(sys.argv[1]), FakeApiServer()).unprepare(ClaimRef("ml", sys.argv[2], "infer"))
"""


def test_unprepare_of_a_dir_it_cannot_empty_moves_it_aside_and_says_so(tmp_path: Path) -> None:
    """DRA unprepare as the chart runs it: a tenant of another uid left a read-only subdir.
    Before the one remover, unprepare said success, logged nothing and left the dir forever."""
    from kubelet.test_dra_driver import DEV_A, make_driver

    from vgpu_plugin.kubelet.dra.driver import ClaimRef
    from vgpu_plugin.node.ledger.state import AllocationStore
    from vgpu_plugin.sim.dra_kubelet import FakeApiServer

    tmp_path.chmod(0o755)
    api = FakeApiServer()
    driver = make_driver(tmp_path, api)
    driver.publish("test")
    api.add_claim("ml", "infer", {"gpu": {"memory": "1Gi"}})
    uid = api.allocate("ml", "infer", DEV_A)["metadata"]["uid"]  # type: ignore[index]
    driver.prepare(ClaimRef("ml", uid, "infer"))
    aid = f"dra-{uid}"
    d = tmp_path / "vgpu" / "containers" / aid
    ro = d / "readonly"
    ro.mkdir()
    (ro / "f").write_text("x")
    os.chown(ro / "f", 1000, 1000)
    os.chown(ro, 1000, 1000)
    ro.chmod(0o555)
    assert SETPRIV is not None
    tests = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, tests])}
    done = subprocess.run(
        [SETPRIV, "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", UNPREPARE,
         str(tmp_path), uid],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    aside = tmp_path / "vgpu" / "containers" / f".unremovable-{aid}"
    assert not d.exists() and (aside / "readonly" / "f").exists()
    assert f"cannot remove everything in {d}" in done.stderr and str(aside) in done.stderr
    assert not (tmp_path / "vgpu" / "limits" / aid).exists()
    assert AllocationStore(tmp_path / "state").all() == []
