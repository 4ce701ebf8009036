"""Shared fixtures: the native build and a fresh simulated GPU node per test."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import native_build

from vgpu_plugin.node.host import native
from vgpu_plugin.node.ledger.state import AllocationStore
from vgpu_plugin.sim.node import EmulatedNode
from vgpu_plugin.sim.simgpu import GpuSpec, Node
from vgpu_plugin.sim.toolkit import ToolkitSettings

# The session fixtures that hold a native build, and the build each needs. A build takes from
# seconds to minutes (a loaded 2-CPU host, the sanitizer variants): pytest_collection_finish
# makes the ones the selected tests use before the first test starts, so that no test's
# pytest-timeout counts a compiler's time. The fixtures then find them made.
NATIVE_BUILDS: dict[str, Callable[[], Path]] = {
    "native_tree": lambda: native_build.build("release"),
    "asan_tree": lambda: native_build.build("asan"),
    "tsan_tree": lambda: native_build.build("tsan"),
    "compat_tree": lambda: native_build.build("compat", native_build.compat_targets()),
}


# pytest-xdist's `-n auto` (pyproject's addopts): one worker per CPU, at most this many. The
# suite was proven with up to 4 workers (on 2 CPUs: docs/testing.md); past that, more workers
# mostly add native-build waits and start-up.
MAX_WORKERS = 4
# Tiers whose tests share one thing outside their tmp_path (one Kubernetes; one real GPU):
# each is one unit of work, run in order by one worker.
ONE_UNIT = ("tests/cluster/", "tests/gpu/")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's default (`--dist load`) hands out single tests, so two workers would each bring
    up the cluster tier's one Kubernetes (and race to build its images), or measure one real
    GPU's memory at once. Here every test is a unit of its own but those tiers, each one unit:
    one worker runs it in order (the biggest units are handed out first) while the others
    take the rest. (`--dist loadgroup` would do it with marks, but pytest 9.2 ignores the node
    ids xdist 3.8 rewrites for it.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TiersAsOneUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((tier for tier in ONE_UNIT if nodeid.startswith(tier)), nodeid)

    return TiersAsOneUnit(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for name, make in NATIVE_BUILDS.items():
        if name not in used:
            continue
        if reporter is not None:
            reporter.write_line(f"native build for {name} (before the tests, untimed)")
        # A failure is raised again by the fixture, as the error of the tests that need it.
        with contextlib.suppress(RuntimeError):
            make()


@pytest.fixture(scope="session")
def native_tree() -> Path:
    """The release build of native/ with the test programs; the package's code uses it too."""
    tree = NATIVE_BUILDS["native_tree"]()
    os.environ[native.NATIVE_DIR_ENV] = str(tree)
    return tree


@pytest.fixture(scope="session")
def asan_tree(native_tree: Path) -> Path:
    """The AddressSanitizer + UBSan build. native_tree: the host's reads (read_region) go through
    the release build of this tree, not whatever an earlier install left."""
    return NATIVE_BUILDS["asan_tree"]()


@pytest.fixture(scope="session")
def tsan_tree(native_tree: Path) -> Path:
    """The ThreadSanitizer build (native_tree: as asan_tree)."""
    return NATIVE_BUILDS["tsan_tree"]()


@pytest.fixture(scope="session")
def compat_tree() -> Path:
    """The compat variant (our own cuda.h and nvml.h), its drivers and ABI programs only."""
    return NATIVE_BUILDS["compat_tree"]()


@pytest.fixture(scope="session")
def native_bin(native_tree: Path) -> Path:
    """Where the C test programs of tests/native are built."""
    return native_tree / "tests"


@pytest.fixture
def simgpu_node(native_tree: Path, tmp_path: Path) -> Iterator[Node]:
    """A fresh node of 2 simulated 16 GiB GPUs; ``node.env()`` runs a subprocess on it."""
    gpus = [GpuSpec(memory=16 << 30, numa_node=i) for i in range(2)]
    yield Node.create(tmp_path / "simgpu", gpus, seed=tmp_path.name)


def make_node(tmp_path: Path, gpus: list[GpuSpec]) -> Node:
    """A node of the given GPUs, for tests that need another shape."""
    return Node.create(tmp_path / "simgpu", gpus, seed=tmp_path.name)


def child_of(pid: int, timeout: float = 10.0) -> int:
    """The one child of pid (unshare's forked child), by its pid in the node's namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise AssertionError(f"{pid} has no child")


def say_to_each(procs: Sequence[subprocess.Popen[str]], line: str) -> None:
    """Write `line` to each started program's stdin (a go, or a stop) without closing it."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()


# Tests that make containers of mount namespaces themselves (unshare, mount) need root and both.
NO_NAMESPACES = os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("mount"))


def require_root() -> None:
    """Skip, with the reason, where the test needs root and namespaces and has neither."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount/pid namespaces); run the tests as root to include it")


@pytest.fixture
def make_emulated_node(native_tree: Path, tmp_path: Path) -> Iterator[Callable[..., EmulatedNode]]:
    """Whole emulated nodes (simgpu, the plugin process, kubelet, runc containers); the
    factory's arguments shape the node, and every node made is stopped afterwards."""
    nodes: list[EmulatedNode] = []

    def make(
        gpus: int = 1,
        memory_mib: int = 16384,
        context_mib: int = 256,
        config: str = "version: v1\nsharing: {splitCount: 4, compute: proportional}\n",
        cleanup_grace: float | None = None,
        toolkit: ToolkitSettings | None = None,
    ) -> EmulatedNode:
        specs = [
            GpuSpec(memory=memory_mib << 20, context_overhead=context_mib << 20, numa_node=i)
            for i in range(gpus)
        ]
        node = EmulatedNode(
            tmp_path / f"node{len(nodes)}", specs, config, cleanup_grace, toolkit=toolkit
        )
        nodes.append(node)
        node.start()
        return node

    yield make
    for node in nodes:
        node.stop()


def mounts_under(root: Path) -> list[str]:
    """Mount points below `root` in this mount namespace, deepest first."""
    prefix = str(root).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = line.split(" ")[4]
            # mountinfo escapes space, tab, newline and backslash as octal.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
            if point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """pytest's tmp_path, checked for mounts the test left in it. pyproject keeps only failed
    tests' dirs (a full run wrote gigabytes of passed tests' nodes and filled a CI disk), and
    removing a dir through a leaked overlay of the host's root would walk all of it: a leak is
    detached first and fails the test."""
    yield tmp_path
    left = mounts_under(tmp_path)
    for point in left:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    if left:
        pytest.fail(f"the test left mounts in its tmp dir (detached now): {left}")


@pytest.fixture(autouse=True)
def _close_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every AllocationStore a test opens is closed after it: the plugin keeps its journal open
    for its life, and a test run that opens a thousand stores must not keep them all open."""
    made: list[AllocationStore] = []
    init = AllocationStore.__init__

    def tracking(self: AllocationStore, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(AllocationStore, "__init__", tracking)
    yield
    for store in made:
        store.close()
