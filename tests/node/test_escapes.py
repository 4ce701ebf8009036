"""Processes on a container's GPU without the shim (node/observe/escapes.py): found by NVML's
list, the container's mounts and its region's slots, logged once, exported per container."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from synthetic_regions import Dev, Proc, Snap
from test_gputime import CONTAINER_A, HOST  # the host's mounts and a container's

from vgpu_plugin.commands.status import render_status
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.ledger.state import AllocationRecord
from vgpu_plugin.node.observe import metrics
from vgpu_plugin.node.observe.escapes import (
    NAME_WAIT_LOOKS,
    Escape,
    EscapeWatch,
    find_escapes,
    mount_attribution,
    parse_identity,
    proc_identity,
)
from vgpu_plugin.node.observe.nodeview import build_view, region_slots

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"

# node pid -> (allocation, (pid in its namespace, start time))
PIDS = {
    1001: ("alloc-a", (7, 500)),  # shimmed: in alloc-a's region
    1002: ("alloc-a", (8, 510)),  # not in it
    1003: ("alloc-b", (7, 520)),  # alloc-b's region cannot be read
    1004: (None, (1, 100)),  # no container of ours (the node's, or another tool's pod)
    1005: ("alloc-a", None),  # gone by the time it is looked at
    1006: ("alloc-c", (3, 600)),  # alloc-c has no region yet: nobody registered
    1007: ("alloc-a", (9, 530)),  # a dead slot with its identity does not account it
}
SLOTS: dict[str, list[Proc] | None] = {
    "alloc-a": [
        Proc(True, (0,), pid=7, start_time=500),
        Proc(False, (0,), pid=9, start_time=530),
        Proc(True, (0,), pid=8, start_time=999),  # pid 8 again, another process (recycled)
    ],
    "alloc-b": None,
    "alloc-c": [],
}
ALLOCS = {"alloc-a": {GPU_A}, "alloc-b": {GPU_A}, "alloc-c": {GPU_A, GPU_B}}


def find(listed: dict[str, list[tuple[int, int]]]) -> list[Escape]:
    return find_escapes(
        listed, ALLOCS, lambda pid: PIDS[pid][0], lambda pid: PIDS[pid][1], SLOTS.get
    )


def test_a_containers_process_in_no_live_slot_of_its_region_is_unshimmed() -> None:
    listed = {GPU_A: [(p, (p - 1000) * MIB) for p in PIDS]}
    got = find(listed)
    assert got == [
        Escape("alloc-a", GPU_A, 1002, 2 * MIB),
        Escape("alloc-c", GPU_A, 1006, 6 * MIB),
        Escape("alloc-a", GPU_A, 1007, 7 * MIB),
    ]


def test_a_process_on_a_gpu_its_allocation_lacks_is_not_taken_for_one_of_its() -> None:
    assert find({GPU_B: [(1002, MIB), (1006, MIB)]}) == [Escape("alloc-c", GPU_B, 1006, MIB)]


def test_identity_is_the_innermost_pid_and_the_start_time() -> None:
    status = "Name:\tpython3\nPid:\t4242\nNSpid:\t4242\t17\t3\n"
    # a command name holding ') (' and spaces does not shift the fields
    stat = "4242 (we ird) (x) S 1 4242 4242 0 -1 4194560 500 0 0 0 1 2 0 0 20 0 1 0 98765 1 2"
    assert parse_identity(status, stat) == (3, 98765)
    assert parse_identity("Name:\tx\n", stat) is None  # no NSpid line: a kernel without it
    assert parse_identity(status, "4242 (x) S 1") is None


def test_identity_of_a_live_pid_and_of_a_gone_one(tmp_path: Path) -> None:
    me = proc_identity()(os.getpid())
    assert me is not None
    assert proc_identity(tmp_path)(os.getpid()) is None


def record(alloc: str, uuid: str, pod: str, k: int) -> AllocationRecord:
    return AllocationRecord(
        allocation_id=alloc,
        device_ids=(f"{uuid}-{k}",),
        resource_name="nvidia.com/gpu",
        created=1.0,
        limits=(GpuLimit(uuid, 1024 * MIB, 0),),
        namespace="ml",
        pod=pod,
        container="server",
    )


@pytest.mark.parametrize("within", [False, True])
def test_a_pid_is_its_containers_by_the_limits_file_its_namespace_mounts(
    tmp_path: Path, within: bool
) -> None:
    proc = tmp_path / "proc"
    # within: a mount below the limits dir in the plugin's own namespace (each key its own)
    host = HOST + (
        "41 40 253:3 / /var/lib/vgpu/limits/zzz rw - xfs /dev/vdc rw\n" if within else ""
    )
    pids = {"self": host, "42": CONTAINER_A, "43": HOST, "45": CONTAINER_A.replace("aaa", "ccc")}
    for name, text in pids.items():
        (proc / name).mkdir(parents=True)
        (proc / name / "mountinfo").write_text(text)
    owner = mount_attribution(Path("/var/lib/vgpu/limits"), ["aaa", "bbb"], proc)
    assert [owner(p) for p in (42, 43, 44, 45)] == ["aaa", None, None, None]


def test_the_watch_logs_each_unshimmed_process_once_naming_its_container(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listed = {GPU_A: [(1001, MIB), (1002, 300 * MIB)]}
    watch = EscapeWatch(
        Path("/nonexistent"),
        lambda: listed,
        SLOTS.get,
        owner_of=lambda _d, _ids: lambda pid: PIDS[pid][0],
        identity=lambda pid: PIDS[pid][1],
    )
    names = {"alloc-a": "pod ml/infer container server (allocation alloc-a)"}
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.observe.escapes"):
        for _ in range(3):
            assert watch({"alloc-a": {GPU_A}}, names) == [Escape("alloc-a", GPU_A, 1002, 300 * MIB)]
    assert watch.latest == [Escape("alloc-a", GPU_A, 1002, 300 * MIB)]
    assert watch({}, names) == [] and watch.latest == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("pod ml/infer container server (allocation alloc-a): process 1002")
    assert "300 MiB" in lines[0] and "without the shim" in lines[0]
    # the same pid, another process (recycled): said again
    pids_again = {**PIDS, 1002: ("alloc-a", (8, 777))}
    watch = EscapeWatch(
        Path("/nonexistent"),
        lambda: listed,
        SLOTS.get,
        owner_of=lambda _d, _ids: lambda pid: PIDS[pid][0],
        identity=lambda pid: pids_again[pid][1] if pid in pids_again else None,
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.observe.escapes"):
        watch({"alloc-a": {GPU_A}}, names)
        watch({"alloc-a": {GPU_A}}, names)
    assert len(caplog.records) == 1


def test_a_process_of_a_container_not_named_yet_is_logged_once_named_or_after_a_few_looks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listed = {GPU_A: [(1002, MIB)]}
    watch = EscapeWatch(
        Path("/nonexistent"),
        lambda: listed,
        SLOTS.get,
        owner_of=lambda _d, _ids: lambda pid: PIDS[pid][0],
        identity=lambda pid: PIDS[pid][1],
    )
    allocs = {"alloc-a": {GPU_A}}
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.observe.escapes"):
        watch(allocs, {})
        assert watch.latest and not caplog.records  # found (the metrics show it), not logged
        watch(allocs, {"alloc-a": "pod ml/infer container server (allocation alloc-a)"})
        watch(allocs, {})
    assert [r.getMessage()[:35] for r in caplog.records] == ["pod ml/infer container server (allo"]
    caplog.clear()
    watch = EscapeWatch(
        Path("/nonexistent"),
        lambda: listed,
        SLOTS.get,
        owner_of=lambda _d, _ids: lambda pid: PIDS[pid][0],
        identity=lambda pid: PIDS[pid][1],
    )
    with caplog.at_level(logging.WARNING, logger="vgpu_plugin.node.observe.escapes"):
        for _ in range(NAME_WAIT_LOOKS + 2):
            watch(allocs, {})
    assert [r.getMessage()[:28] for r in caplog.records] == ["allocation alloc-a: process "]


def test_without_nvml_nothing_is_found_and_that_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_nvml() -> dict[str, list[tuple[int, int]]]:
        raise RuntimeError("NVML init failed: Driver Not Loaded")

    watch = EscapeWatch(Path("/nonexistent"), no_nvml, SLOTS.get)
    with caplog.at_level(logging.INFO, logger="vgpu_plugin.node.observe.escapes"):
        assert watch({"alloc-a": {GPU_A}}, {}) == []
        assert watch({"alloc-a": {GPU_A}}, {}) == []
    assert [r.getMessage() for r in caplog.records] == [
        "GPU processes are not checked for the shim: NVML init failed: Driver Not Loaded"
    ]


def test_the_view_and_the_metrics_carry_each_containers_unshimmed_processes(
    tmp_path: Path,
) -> None:
    recs = [record("alloc-a", GPU_A, "infer", 0), record("alloc-b", GPU_A, "other", 1)]
    escapes = [Escape("alloc-a", GPU_A, 1002, 300 * MIB), Escape("alloc-a", GPU_A, 1003, MIB)]
    view = build_view(recs, {}, [], escapes=escapes)
    by_id = {a.id: a.gpus[0] for a in view.allocations}
    assert (by_id["alloc-a"].unshimmed_processes, by_id["alloc-a"].unshimmed_memory) == (
        2,
        301 * MIB,
    )
    assert (by_id["alloc-b"].unshimmed_processes, by_id["alloc-b"].unshimmed_memory) == (0, 0)
    pm = metrics.new_registry(lambda: view, hostname="n", utilization=dict, build=("1", "1"))
    text = generate_latest(pm.registry).decode()
    got = {
        (s.name, s.labels["pod"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vgpu_container_unshimmed_")
    }
    assert got == {
        ("vgpu_container_unshimmed_processes", "infer"): 2,
        ("vgpu_container_unshimmed_processes", "other"): 0,
        ("vgpu_container_unshimmed_memory_bytes", "infer"): 301 * MIB,
        ("vgpu_container_unshimmed_memory_bytes", "other"): 0,
    }


def test_status_warns_of_each_containers_unshimmed_processes() -> None:
    recs = [record("alloc-a", GPU_A, "infer", 0), record("alloc-b", GPU_A, "other", 1)]
    escapes = [Escape("alloc-a", GPU_A, 1002, 300 * MIB), Escape("alloc-a", GPU_A, 1003, MIB)]
    text = render_status(build_view(recs, {}, [], escapes=escapes))
    warned = [ln for ln in text.splitlines() if "without the shim" in ln]
    assert warned == [
        f"warning: allocation alloc-a: 2 process(es) on GPU {GPU_A} without the shim, holding"
        " 301 MiB: not held to the container's limits (the plugin's log names them;"
        " docs/security.md)"
    ]
    assert "without the shim" not in render_status(build_view(recs, {}, []))


def test_region_slots_tell_a_missing_region_from_one_that_cannot_be_read(tmp_path: Path) -> None:
    def reader(path: Path) -> Snap:
        if "bad" in str(path):
            raise RuntimeError("refused: not a region")
        raise FileNotFoundError(path)

    (tmp_path / "containers" / "bad").mkdir(parents=True)
    (tmp_path / "containers" / "bad" / "bad.cache").write_bytes(b"x")
    slots = region_slots(tmp_path, reader)
    assert slots("none") == ()
    assert slots("bad") is None
    good = Snap((Dev(GPU_A, 1, 0, 0),), (Proc(True, (0,), pid=5, start_time=9),))
    assert region_slots(tmp_path, lambda _p: good)("any") == good.processes
