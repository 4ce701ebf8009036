"""Cleanup: which allocations are gone (pure), and what the edge removes (real files, store)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.core.pods import CheckpointEntry, PodRef, PodResourcesUnavailable
from vgpu_plugin.node.host.cleanup import (
    Cleaner,
    CleanupPolicy,
    holders,
    store_relabeler,
    store_release_marker,
)
from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore

A = PodRef("ml", "infer-a", "server")
B = PodRef("ml", "infer-b", "server")


def rec(alloc_id: str, devices: tuple[str, ...], created: float) -> AllocationRecord:
    return AllocationRecord(
        allocation_id=alloc_id,
        device_ids=devices,
        resource_name="nvidia.com/gpu",
        created=created,
        limits=(GpuLimit("GPU-a", 1024 * MIB, 25),),
    )


def test_a_fresh_allocation_gets_the_grace_period_before_its_pod_shows_up() -> None:
    policy = CleanupPolicy(grace=60)
    r = rec("x", ("GPU-a-0",), created=100)
    assert policy.decide([r], {}, now=100).pending == {"x": 160}
    assert policy.decide([r], {}, now=159.9).gone == ()
    assert policy.decide([r], {}, now=160).gone == ("x",)


def test_a_released_allocation_is_gone_a_grace_period_after_it_was_first_seen_unheld() -> None:
    policy = CleanupPolicy(grace=60)
    r = rec("x", ("GPU-a-0", "GPU-a-1"), created=0)
    for now in (0, 500, 1000):
        d = policy.decide([r], {"GPU-a-1": A}, now=now)
        assert d.gone == () and d.holders == {"x": A}
    assert policy.decide([r], {}, now=1001).pending == {"x": 1061}
    assert policy.decide([r], {}, now=1060).gone == ()
    # Held again (a brief gap in the kubelet's answer) resets the clock.
    assert policy.decide([r], {"GPU-a-0": A}, now=1060.5).gone == ()
    assert policy.decide([r], {}, now=1061).gone == ()
    assert policy.decide([r], {}, now=1121).gone == ("x",)


def test_one_held_device_keeps_the_whole_allocation() -> None:
    policy = CleanupPolicy(grace=0)
    r = rec("x", ("GPU-a-0", "GPU-b-0"), created=0)
    assert policy.decide([r], {"GPU-b-0": B}, now=10_000).gone == ()


def test_a_device_handed_to_a_new_container_belongs_to_the_newest_allocation() -> None:
    old = rec("old", ("GPU-a-0",), created=10)
    new = rec("new", ("GPU-a-0", "GPU-a-1"), created=500)
    assignments = {"GPU-a-0": B, "GPU-a-1": B}
    assert holders([new, old], assignments) == {"new": B}
    policy = CleanupPolicy(grace=60)
    assert policy.decide([old, new], assignments, now=600).gone == ()
    assert policy.decide([old, new], assignments, now=660).gone == ("old",)


def test_nothing_is_gone_while_pod_resources_is_unavailable_and_clocks_restart_after() -> None:
    policy = CleanupPolicy(grace=60)
    r = rec("x", ("GPU-a-0",), created=0)
    assert policy.decide([r], {}, now=0).pending == {"x": 60}
    for now in (30, 100, 10_000):
        d = policy.decide([r], None, now=now)
        assert d.gone == () and not d.available
    d = policy.decide([r], {}, now=10_001)
    assert d.gone == () and d.pending == {"x": 10_061}


def test_availability_changes_are_reported_once_each_way() -> None:
    policy = CleanupPolicy()
    seen = [policy.decide([], a, now=0).availability_changed for a in (None, None, {}, {}, None)]
    assert seen == [True, False, True, False, True]
    # A first pass that finds the kubelet answering is no change worth a line.
    assert CleanupPolicy().decide([], {}, now=0).availability_changed is False


class Kubelet:
    """What the kubelet answers, switchable between answering and down."""

    def __init__(self) -> None:
        self.assignments: dict[str, PodRef] = {}
        self.down = False

    def __call__(self) -> Mapping[str, PodRef]:
        if self.down:
            raise PodResourcesUnavailable("pod-resources socket /x/kubelet.sock does not exist")
        return dict(self.assignments)


def materialise(root: Path, alloc_id: str) -> tuple[Path, Path]:
    d = root / "containers" / alloc_id
    d.mkdir(parents=True)
    (d / f"{alloc_id}.cache").write_bytes(b"region")
    limits = root / "limits" / alloc_id
    limits.parent.mkdir(exist_ok=True)
    limits.write_text("vgpu-limits 1\n")
    return d, limits


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, AllocationStore, Kubelet, list[float]]:
    return tmp_path / "host", AllocationStore(tmp_path / "state"), Kubelet(), [1000.0]


def make_cleaner(node: tuple[Path, AllocationStore, Kubelet, list[float]], **kw: object) -> Cleaner:
    root, store, kubelet, now = node
    return Cleaner(
        root,
        records=store.all,
        drop_record=store.remove,
        assignments=kubelet,
        relabel=store_relabeler(store),
        grace=60,
        clock=lambda: now[0],
        **kw,  # type: ignore[arg-type]
    )


def test_cleaner_removes_ended_allocations_and_labels_live_ones(
    node: tuple[Path, AllocationStore, Kubelet, list[float]],
) -> None:
    root, store, kubelet, now = node
    live_files = materialise(root, "live")
    ended_files = materialise(root, "ended")
    store.add(rec("live", ("GPU-a-0",), created=900))
    store.add(rec("ended", ("GPU-a-1",), created=900))
    kubelet.assignments = {"GPU-a-0": A}
    cleaner = make_cleaner(node)

    assert cleaner.run_once().gone == ()
    labelled = store.get("live")
    assert labelled is not None
    assert (labelled.namespace, labelled.pod, labelled.container) == ("ml", "infer-a", "server")
    assert all(p.exists() for p in (*live_files, *ended_files))

    now[0] = 1060
    assert cleaner.run_once().gone == ("ended",)
    assert store.get("ended") is None and store.get("live") is not None
    assert not any(p.exists() for p in ended_files)
    assert all(p.exists() for p in live_files)
    # Done once: the next pass has nothing to do.
    assert cleaner.run_once().gone == ()


def test_cleaner_logs_an_outage_once_and_deletes_nothing_during_it(
    node: tuple[Path, AllocationStore, Kubelet, list[float]], caplog: pytest.LogCaptureFixture
) -> None:
    root, store, kubelet, now = node
    files = materialise(root, "x")
    store.add(rec("x", ("GPU-a-0",), created=0))
    kubelet.down = True
    cleaner = make_cleaner(node)
    with caplog.at_level(logging.INFO, logger="vgpu_plugin.node.host.cleanup"):
        for i in range(5):
            now[0] = 1000 + i * 100
            assert cleaner.run_once().gone == ()
        kubelet.down = False
        for i in range(3):
            now[0] = 2000 + i
            cleaner.run_once()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("does not exist" in m for m in messages) == 1
    assert sum("cleanup of ended containers resumes" in m for m in messages) == 1
    assert all(p.exists() for p in files) and store.get("x") is not None


def test_cleaner_keeps_an_allocation_whose_processes_are_alive(
    node: tuple[Path, AllocationStore, Kubelet, list[float]], caplog: pytest.LogCaptureFixture
) -> None:
    root, store, _, now = node
    files = materialise(root, "x")
    store.add(rec("x", ("GPU-a-0",), created=0))
    running = {"x": True}
    cleaner = make_cleaner(node, still_running=lambda i: running[i])
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.host.cleanup"):
        for t in (1000, 1100, 1200):
            now[0] = t
            cleaner.run_once()
    assert sum("processes are alive" in r.getMessage() for r in caplog.records) == 1
    assert all(p.exists() for p in files) and store.get("x") is not None
    running["x"] = False
    now[0] = 1300
    cleaner.run_once()
    assert store.get("x") is None and not any(p.exists() for p in files)


def test_a_failed_removal_keeps_the_record_for_the_next_pass(
    node: tuple[Path, AllocationStore, Kubelet, list[float]],
) -> None:
    root, store, _, now = node
    d, limits = materialise(root, "x")
    limits.unlink()
    limits.mkdir()  # unlink() of a directory fails
    store.add(rec("x", ("GPU-a-0",), created=0))
    cleaner = make_cleaner(node)
    now[0] = 1000
    cleaner.run_once()
    now[0] = 1060
    cleaner.run_once()
    assert store.get("x") is not None
    limits.rmdir()
    now[0] = 1061
    cleaner.run_once()
    assert store.get("x") is None and not d.exists()


def test_a_container_dir_that_is_a_symlink_is_unlinked_not_followed(
    node: tuple[Path, AllocationStore, Kubelet, list[float]], tmp_path: Path
) -> None:
    root, store, _, now = node
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (root / "containers").mkdir(parents=True)
    (root / "containers" / "x").symlink_to(outside)
    store.add(rec("x", ("GPU-a-0",), created=0))
    cleaner = make_cleaner(node)
    cleaner.run_once()
    now[0] = 1060
    assert cleaner.run_once().gone == ("x",)
    assert (outside / "precious").read_text() == "keep me"
    assert not (root / "containers" / "x").exists()


def test_the_background_loop_runs_passes_until_stopped(
    node: tuple[Path, AllocationStore, Kubelet, list[float]],
) -> None:
    root, store, _, _ = node
    materialise(root, "x")
    store.add(rec("x", ("GPU-a-0",), created=0))
    cleaner = make_cleaner(node)
    cleaner.policy.grace = 0
    cleaner.start(interval=0.01)
    try:
        for _ in range(500):
            if store.get("x") is None:
                break
            time.sleep(0.01)  # bounded: 500 polls at most
    finally:
        cleaner.stop()
    assert store.get("x") is None


# --- init containers: the kubelet's device checkpoint (issue 14, item 1) ---------------------


def ck(uid: str, container: str, allocation_id: str, devices: tuple[str, ...]) -> CheckpointEntry:
    return CheckpointEntry(uid, container, "nvidia.com/gpu", devices, (allocation_id,))


def test_an_init_containers_allocation_stays_while_its_pod_lives() -> None:
    """The kubelet gives the init container's devices to the app container after it (and
    List shows only the app container): the init allocation is held through the checkpoint
    whether or not a process of it runs, and goes when the pod goes."""
    records = [rec("init", ("GPU-a-0",), 100), rec("main", ("GPU-a-0",), 101)]
    checkpoint = [
        ck("uid-1", "download", "init", ("GPU-a-0",)),
        ck("uid-1", "server", "main", ("GPU-a-0",)),
    ]
    policy = CleanupPolicy(grace=60)
    for t in (200, 1000, 5000):
        d = policy.decide(records, {"GPU-a-0": A}, t, checkpoint)
        assert d.gone == () and d.pending == {}
        assert d.holders["init"] == PodRef("ml", "infer-a", "download")
    # The pod is deleted: List drops it at once, the kubelet's file only at its next write.
    assert policy.decide(records, {}, 6000, checkpoint).pending == {"init": 6060, "main": 6060}
    assert set(policy.decide(records, {}, 6060, checkpoint).gone) == {"init", "main"}


def test_without_the_checkpoint_the_init_allocation_would_be_taken_for_ended() -> None:
    records = [rec("init", ("GPU-a-0",), 100), rec("main", ("GPU-a-0",), 101)]
    policy = CleanupPolicy(grace=60)
    policy.decide(records, {"GPU-a-0": A}, 200)
    assert policy.decide(records, {"GPU-a-0": A}, 260).gone == ("init",)


def test_an_init_container_on_a_kubelet_that_lists_it_is_held_either_way() -> None:
    records = [rec("init", ("GPU-a-0",), 100), rec("main", ("GPU-a-1",), 101)]
    checkpoint = [
        ck("uid-1", "download", "init", ("GPU-a-0",)),
        ck("uid-1", "server", "main", ("GPU-a-1",)),
    ]
    init = PodRef("ml", "infer-a", "download")
    for cp in ([], checkpoint):
        policy = CleanupPolicy(grace=60)
        for t in (200, 1000):
            d = policy.decide(records, {"GPU-a-0": init, "GPU-a-1": A}, t, cp)
            assert d.gone == () and d.holders["init"] == init


def test_a_pod_whose_only_gpu_container_is_an_init_container_is_held_by_the_checkpoint() -> None:
    records = [rec("init", ("GPU-a-0",), 100)]
    checkpoint = [ck("uid-9", "compile", "init", ("GPU-a-0",))]
    policy = CleanupPolicy(grace=60)
    for t in (200, 1000):
        d = policy.decide(records, {}, t, checkpoint)
        assert d.gone == () and d.holders["init"] == PodRef("", "uid-9", "compile")
    # The kubelet rewrites its file without the pod: the allocation is over.
    policy.decide(records, {}, 2000, [])
    assert policy.decide(records, {}, 2060, []).gone == ("init",)


def test_the_cleaner_marks_released_allocations_and_clears_the_mark_when_held_again(
    node: tuple[Path, AllocationStore, Kubelet, list[float]],
) -> None:
    root, store, kubelet, now = node
    materialise(root, "x")
    store.add(rec("x", ("GPU-a-0",), created=900))
    cleaner = make_cleaner(node, mark_released=store_release_marker(store))
    kubelet.assignments = {"GPU-a-0": A}
    cleaner.run_once()
    assert store.get("x").released is None  # type: ignore[union-attr]
    kubelet.assignments = {}
    now[0] = 1010
    cleaner.run_once()
    assert store.get("x").released == 1010  # type: ignore[union-attr]
    kubelet.assignments = {"GPU-a-0": A}
    now[0] = 1020
    cleaner.run_once()
    assert store.get("x").released is None  # type: ignore[union-attr]


def test_the_cleaner_reads_the_checkpoint_and_keeps_an_init_allocation(
    node: tuple[Path, AllocationStore, Kubelet, list[float]], caplog: pytest.LogCaptureFixture
) -> None:
    root, store, kubelet, now = node
    files = materialise(root, "init")
    store.add(rec("init", ("GPU-a-0",), created=900))
    store.add(rec("main", ("GPU-a-0",), created=901))
    kubelet.assignments = {"GPU-a-0": A}
    entries = [ck("u", "download", "init", ("GPU-a-0",)), ck("u", "server", "main", ("GPU-a-0",))]
    cleaner = make_cleaner(node, checkpoint=lambda: entries)
    for t in (1000, 1100, 1200):
        now[0] = t
        assert cleaner.run_once().gone == ()
    assert all(p.exists() for p in files) and store.get("init") is not None


# --- orphans: files no record owns (issue 14, item 7) ----------------------------------------


# Names as the plugin makes them (core/grant.py new_allocation_id, core/dra.py allocation_id).
ORPHAN, FRESH, OWNED, LIVE = (f"0190a1b2c3d4{n:08x}" for n in range(4))
HAMI = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0_server"  # HAMi's containers/<pod-uid>_<container>


def test_orphaned_files_are_swept_but_never_fresh_owned_live_or_foreign_ones(
    node: tuple[Path, AllocationStore, Kubelet, list[float]],
) -> None:
    root, store, _, now = node
    old = time.time() - 3600
    paths = {}
    for aid in (ORPHAN, FRESH, OWNED, LIVE, "dra-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"):
        d, limits = materialise(root, aid)
        paths[aid] = (d, limits)
        if aid != FRESH:
            for p in (d, limits):
                os.utime(p, (old, old))
    only_limits = root / "limits" / f"{ORPHAN[:-1]}9.tmp-123-abcd"  # a writer killed mid-write
    only_limits.write_text("half")
    os.utime(only_limits, (old, old))
    foreign = [root / "containers" / ".not-an-id", root / "containers" / HAMI]
    for f in foreign:
        f.mkdir()
        (f / "vgpu.cache").write_bytes(b"HAMi's")
        os.utime(f, (old, old))
    store.add(rec(OWNED, ("GPU-a-0",), created=time.time()))
    now[0] = time.time()
    cleaner = make_cleaner(node, still_running=lambda aid: aid == LIVE)
    cleaner.run_once()
    assert not any(p.exists() for p in paths[ORPHAN]) and not only_limits.exists()
    assert not any(p.exists() for p in paths["dra-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"])
    for aid in (FRESH, OWNED, LIVE):
        assert all(p.exists() for p in paths[aid]), aid
    for f in foreign:
        assert (f / "vgpu.cache").read_bytes() == b"HAMi's", f
