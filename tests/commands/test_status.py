"""``status`` on a populated synthetic node: the table, the JSON, and what collect_view gathers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from synthetic_regions import Dev, Proc, Snap, pace_bytes, prepared_claim

from vgpu_plugin.api.podresources.v1 import api_pb2 as pb
from vgpu_plugin.api.podresources.v1 import api_pb2_grpc as pb_grpc
from vgpu_plugin.commands.status import collect_view, render_status, status_json
from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.core.pods import PodRef
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import JOURNAL_FILE_NAME, AllocationRecord, AllocationStore
from vgpu_plugin.node.observe import region
from vgpu_plugin.node.observe.nodeview import (
    DRIVER_LIMIT_KEY,
    SHIM_ERROR,
    SHIM_FOUND,
    SHIM_NO_CGROUP,
    SHIM_NONE,
    SHIM_UNCHECKED,
    SHIM_UNSUPPORTED,
    GpuFacts,
    NodeView,
    build_view,
    region_path,
)
from vgpu_plugin.sim.kubelet_emulator import short_tmp_dir

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
RES = "nvidia.com/gpu"
NOT_REQUESTED = "not requested: its GPUs have different limits (the hook applies one to all)"


def rec(
    alloc_id: str,
    created: float,
    devices: tuple[str, ...],
    *limits: GpuLimit,
    driver: str | None = None,
    **pod: str,
) -> AllocationRecord:
    extra = {} if driver is None else {DRIVER_LIMIT_KEY: driver}
    return AllocationRecord(alloc_id, devices, RES, created, limits, **pod, extra=extra)


@dataclass
class SyntheticNode:
    root: Path
    state: Path
    regions: dict[Path, Snap | Exception]

    def read_region(self, path: Path) -> Snap:
        if not path.exists():
            raise OSError(f"{path}: missing")
        found = self.regions[path]
        if isinstance(found, Exception):
            raise found
        return found

    def region(self, alloc_id: str, snap: Snap | Exception) -> None:
        path = region_path(self.root, alloc_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        self.regions[path] = snap

    def collect(self, socket: Path, nvml: bool = False) -> NodeView:
        return collect_view(self.root, self.state, socket, nvml, read_region=self.read_region)


@pytest.fixture
def node(tmp_path: Path) -> SyntheticNode:
    n = SyntheticNode(tmp_path / "host", tmp_path / "state", {})
    store = AllocationStore(n.state)
    # Two GPUs of one container, labelled by cleanup; one fresh container; one bad region.
    store.add(
        rec(
            "alloc-1",
            100,
            (f"{GPU_A}-0", f"{GPU_B}-0", f"{GPU_B}-1"),
            GpuLimit(GPU_A, 20389 * MIB, 25),
            GpuLimit(GPU_B, 40778 * MIB, 50),
            driver="not requested: its GPUs have different limits (the hook applies one to all)",
            namespace="ml",
            pod="infer-a",
            container="server",
        )
    )
    # alloc-2 asked the driver to hold it too; alloc-3's record predates that state.
    store.add(
        rec("alloc-2", 200, (f"{GPU_A}-1",), GpuLimit(GPU_A, 20389 * MIB, 0), driver="requested")
    )
    store.add(rec("alloc-3", 300, (f"{GPU_A}-2",), GpuLimit(GPU_A, 20389 * MIB, 25)))
    n.region(
        "alloc-1",
        Snap(
            (
                Dev(
                    GPU_A, 1024 * MIB, refused=3, fallbacks=1, peak=2048 * MIB, gpu_ns=1_500_000_000
                ),
                Dev(GPU_B, 300 * MIB, peak=300 * MIB),
            ),
            (Proc(True, (1000 * MIB, 300 * MIB)), Proc(True, (24 * MIB, 0)), Proc(False, (0, 0))),
        ),
    )
    n.region("alloc-3", ValueError("region file: bad magic 'garbage'"))
    # alloc-1's launches were held back 2.5 s on GPU A, none on B; alloc-3's pacing file is
    # not one (its figures are refused, its neighbours' kept).
    pace = region_path(n.root, "alloc-1").with_suffix(".pace")
    pace.write_bytes(pace_bytes((GPU_A, 0, 2_500_000_000), (GPU_B, 0, 0)))
    region_path(n.root, "alloc-3").with_suffix(".pace").write_bytes(b"garbage")
    return n


def test_the_table_shows_gpus_then_containers(node: SyntheticNode, tmp_path: Path) -> None:
    view = node.collect(tmp_path / "no-kubelet.sock")
    text = render_status(view)
    lines = text.splitlines()
    assert lines[0] == "GPUs"
    header = lines[1].split()
    assert header[:4] == ["IDX", "UUID", "MODEL", "SLICES"]
    # Without NVML and the kubelet: index, model, totals unknown; what the records say is there.
    row_a = next(line for line in lines if GPU_A in line and line.startswith("  ?"))
    assert row_a.split() == ["?", GPU_A, "?", "3/?", "61167/-", "1024", "-", "unknown"]
    row_b = next(line for line in lines if GPU_B in line and line.startswith("  ?"))
    assert row_b.split() == ["?", GPU_B, "?", "2/?", "40778/-", "300", "-", "unknown"]

    containers = lines[lines.index("Containers") + 1 :]
    assert containers[0].split()[:4] == ["NAMESPACE/POD/CONTAINER", "FRONTEND", "ALLOCATION", "GPU"]
    # used/limit, then peak, refused, fell back to managed memory, GPU seconds (the region's),
    # seconds held back (the pacing file's).
    first = ["ml/infer-a/server", "device-plugin", "alloc-1", GPU_A, "1024/20389", "2048", "3"]
    first += ["1", "1.5", "2.5", "25%"]
    assert containers[1].split()[:13] == [*first, "2", "ok"]
    assert containers[1].split("ok", 1)[1].strip() == (
        "not requested: its GPUs have different limits (the hook applies one to all)"
    )
    assert containers[2].split()[:8] == [GPU_B, "300/40778", "300", "0", "0", "0.0", "0.0", "50%"]
    assert containers[2].endswith(
        "not requested: its GPUs have different limits (the hook applies one to all)"
    )
    assert containers[3].split() == [
        "(pod",
        "not",
        "known",
        "yet)",
        "device-plugin",
        "alloc-2",
        GPU_A,
        "0/20389",
        "0",
        "0",
        "0",
        "0.0",
        "0.0",
        "unlimited",
        "0",
        "missing",
        "requested",
    ]
    assert containers[4].split()[:8] == [
        "(pod",
        "not",
        "known",
        "yet)",
        "device-plugin",
        "alloc-3",
        GPU_A,
        "-/20389",
    ]
    assert containers[4].split()[12:14] == ["?", "25%"]  # its pacing file refused
    assert "invalid: region file: bad magic 'garbage'" in containers[4]
    assert containers[4].endswith("unknown")  # a record from before the driver limit
    assert "warning: allocation alloc-3: region invalid: region file: bad magic" in text
    assert "warning: allocation alloc-3: pacing file invalid: 7 bytes, not 3136" in text
    assert "note: NVML not queried" in text
    assert "no-kubelet.sock does not exist" in text
    # Columns line up: every container row starts its GPU column at the same place.
    gpu_col = containers[0].index("GPU")
    assert containers[1][gpu_col:].startswith(GPU_A)
    assert containers[2][gpu_col:].startswith(GPU_B)


def test_json_has_stable_keys_and_exact_values(node: SyntheticNode, tmp_path: Path) -> None:
    view = node.collect(tmp_path / "no-kubelet.sock")
    text = status_json(view)
    assert text == status_json(node.collect(tmp_path / "no-kubelet.sock"))
    doc = json.loads(text)
    assert list(doc) == ["allocations", "gpus", "notes", "version"]
    assert doc["version"] == 1
    a1 = doc["allocations"][0]
    assert list(a1) == sorted(a1)
    assert a1 == {
        "claim": None,
        "created": 100.0,
        "driver_memory_limit": "not requested: its GPUs have different limits"
        " (the hook applies one to all)",
        "ended": False,
        "frontend": "device-plugin",
        "gpus": [
            {
                "compute_held_back_seconds": 2.5,
                "compute_limit": 25,
                "compute_guarantee": 0,
                "driver_limit": NOT_REQUESTED,
                "driver_limit_confirmed": 0,
                "fallbacks": 1,
                "gpu_seconds": 1.5,
                "memory_limit": 20389 * MIB,
                "memory_peak": 2048 * MIB,
                "memory_used": 1024 * MIB,
                "processes": 2,
                "refused": 3,
                "unshimmed_memory": 0,
                "unshimmed_processes": 0,
                "uuid": GPU_A,
            },
            {
                "compute_held_back_seconds": 0.0,
                "compute_limit": 50,
                "compute_guarantee": 0,
                "driver_limit": NOT_REQUESTED,
                "driver_limit_confirmed": 0,
                "fallbacks": 0,
                "gpu_seconds": 0.0,
                "memory_limit": 40778 * MIB,
                "memory_peak": 300 * MIB,
                "memory_used": 300 * MIB,
                "processes": 1,
                "refused": 0,
                "unshimmed_memory": 0,
                "unshimmed_processes": 0,
                "uuid": GPU_B,
            },
        ],
        "id": "alloc-1",
        "pod": {"container": "server", "namespace": "ml", "pod": "infer-a"},
        "pace_state": "ok",
        "processes_alive": 2,
        "region_state": "ok",
    }
    a2, a3 = doc["allocations"][1:]
    assert (a2["pod"], a2["region_state"], a2["gpus"][0]["memory_used"]) == (None, "missing", 0)
    assert (a2["driver_memory_limit"], a3["driver_memory_limit"]) == ("requested", "unknown")
    assert a3["region_state"].startswith("invalid: ") and a3["gpus"][0]["memory_used"] is None
    assert a3["pace_state"].startswith("invalid: ")
    assert a3["gpus"][0]["compute_held_back_seconds"] is None
    assert (a2["pace_state"], a2["gpus"][0]["compute_held_back_seconds"]) == ("missing", 0.0)
    gpu_a = doc["gpus"][0]
    assert gpu_a == {
        "compute_lent_seconds": 0.0,
        "healthy": None,
        "index": None,
        "memory_limited": 3 * 20389 * MIB,
        "memory_total": None,
        "memory_used_by_containers": 1024 * MIB,
        "memory_used_nvml": None,
        "name": None,
        "slices_allocated": 3,
        "slices_total": None,
        "uuid": GPU_A,
    }
    assert any("NVML not queried" in n for n in doc["notes"])


class Lister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, pods: list[Any], allocatable: list[str]) -> None:
        self.pods = pods
        self.allocatable = allocatable

    def List(self, request: Any, context: Any) -> Any:
        return pb.ListPodResourcesResponse(pod_resources=self.pods)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        return pb.AllocatableResourcesResponse(
            devices=[pb.ContainerDevices(resource_name=RES, device_ids=self.allocatable)]
        )


@pytest.fixture
def kubelet_socket() -> Iterator[tuple[Path, Lister]]:
    tmp = short_tmp_dir("st-")
    sock = tmp / "kubelet.sock"
    lister = Lister([], [])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield sock, lister
    finally:
        server.stop(grace=None).wait(5)
        shutil.rmtree(tmp, ignore_errors=True)


def _pod(ns: str, name: str, container: str, devices: list[str]) -> Any:
    return pb.PodResources(
        namespace=ns,
        name=name,
        containers=[
            pb.ContainerResources(
                name=container,
                devices=[pb.ContainerDevices(resource_name=RES, device_ids=devices)],
            )
        ],
    )


def test_the_kubelet_names_containers_and_counts_slices(
    node: SyntheticNode, kubelet_socket: tuple[Path, Lister]
) -> None:
    sock, lister = kubelet_socket
    lister.pods = [_pod("web", "fresh-pod", "app", [f"{GPU_A}-1"])]
    lister.allocatable = [f"{GPU_A}-{k}" for k in range(4)] + [f"{GPU_B}-{k}" for k in range(8)]
    view = node.collect(sock)
    pods = {a.id: a.pod for a in view.allocations}
    assert pods["alloc-2"] == PodRef("web", "fresh-pod", "app")
    # Not held now, but the plugin's record still names its last holder.
    assert pods["alloc-1"] == PodRef("ml", "infer-a", "server")
    assert pods["alloc-3"] is None
    assert {g.uuid: g.slices_total for g in view.gpus} == {GPU_A: 4, GPU_B: 8}
    assert not any("pod-resources" in n for n in view.notes)
    assert "web/fresh-pod/app" in render_status(view)


def test_a_refused_state_file_is_reported_and_left_in_place(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / JOURNAL_FILE_NAME).write_bytes(b"\xc1 not a journal")
    view = collect_view(tmp_path / "host", state, tmp_path / "none.sock", nvml=False)
    assert view.allocations == ()
    assert any("not a vgpu-plugin allocations journal" in n for n in view.notes)
    assert (state / JOURNAL_FILE_NAME).read_bytes() == b"\xc1 not a journal"
    assert [p.name for p in state.iterdir()] == [JOURNAL_FILE_NAME]
    assert "no allocations" in render_status(view)


def test_nvml_figures_and_drift_warning() -> None:
    record = rec("a", 1, (f"{GPU_A}-0",), GpuLimit(GPU_A, 1000 * MIB, 10))
    facts = [GpuFacts(GPU_A, 0, "NVIDIA H100", 80 << 30, 8, 100 * MIB, True)]
    snap = Snap((Dev(GPU_A, 500 * MIB),), (Proc(True, (500 * MIB,)),))
    view = build_view([record], {"a": snap}, facts)
    text = render_status(view)
    row = next(line for line in text.splitlines() if line.startswith("  0 "))
    want = ["0", GPU_A, "NVIDIA", "H100", "1/8", "1000/81920", "500", "100", "healthy"]
    assert row.split() == want
    assert f"warning: GPU {GPU_A}: containers account 500 MiB but NVML reports 100 MiB" in text
    # Containers name the GPU by index when it is known.
    assert f"0 {GPU_A}" in text.split("Containers")[1]


def test_an_init_containers_slice_reused_by_the_app_container_is_counted_once() -> None:
    """The kubelet gives an ended init container's slices to the app container after it: one
    slice, two records (the init one kept while the pod lives). The GPU counts it once, for the
    app container; the init container's shows as ended (issue 20: 18432/16384 MiB on 8/8)."""
    slice_ = GpuLimit(GPU_A, 2048 * MIB, 0)
    pod = {"namespace": "ml", "pod": "train"}
    init = rec("init", 100, (f"{GPU_A}-0",), slice_, **pod, container="fetch")
    main = rec("main", 101, (f"{GPU_A}-0",), slice_, **pod, container="server")
    other = rec("other", 102, (f"{GPU_A}-1",), slice_, **pod, container="side")
    facts = [GpuFacts(GPU_A, 0, "sim", 16 << 30, 8, None, True)]
    view = build_view([init, main, other], {}, facts)
    (gpu,) = view.gpus
    assert (gpu.slices_allocated, gpu.memory_limited) == (2, 4096 * MIB)
    assert {a.id: a.ended for a in view.allocations} == {
        "init": True,
        "main": False,
        "other": False,
    }
    assert "ml/train/fetch (ended)" in render_status(view)
    # While a process of the init container is alive it counts (the app one has not started).
    live = Snap((Dev(GPU_A, 100 * MIB),), (Proc(True, (100 * MIB,)),))
    view = build_view([init, main], {"init": live}, facts)
    assert not next(a for a in view.allocations if a.id == "init").ended


# --- end to end: a real region held by a live process, NVML from the simulated GPUs ----------

# Attaches to the region as a container's process does, charges `bytes` on device 0, reports,
# and holds its slot until stdin closes.
_HOLDER = r"""
import sys
from cffi import FFI
from vgpu_plugin.node.host import native
ffi = FFI()
ffi.cdef(native.cdef_source(native.include_dir() / "vgpu" / "region.h"))
lib = ffi.dlopen(str(native.shim_library()))
path, uuid, limit, charge = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
limits = ffi.new("struct vgpu_limits *")
limits.count = 1
limits.devices[0].uuid = uuid.encode()
limits.devices[0].memory_limit = limit
limits.devices[0].sm_percent = 25
err = ffi.new("char[]", 320)
r = ffi.new("struct vgpu_region **")
assert lib.vgpu_region_open(path.encode(), limits, r, err, 320) == 0, ffi.string(err)
assert lib.vgpu_region_reserve(r[0], 0, charge) == 0
lib.vgpu_region_commit(r[0], 0, charge)
print("ready", flush=True)
sys.stdin.read()
"""

_STATUS = r"""
import sys
from pathlib import Path
from vgpu_plugin.commands.status import collect_view, status_json
root, state, sock = map(Path, sys.argv[1:4])
sys.stdout.write(status_json(collect_view(root, state, sock, nvml=True)))
"""


def test_real_region_and_simulated_nvml(
    simgpu_node: Any, native_tree: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from vgpu_plugin.node.observe.nodeview import live_processes
    from vgpu_plugin.node.observe.nodeview import region_path as path_of

    root, state = tmp_path / "host", tmp_path / "state"
    uuid = simgpu_node.gpu(0).uuid
    AllocationStore(state).add(
        rec(
            "live",
            1,
            (f"{uuid}-0",),
            GpuLimit(uuid, 4096 * MIB, 25),
            namespace="a",
            pod="b",
            container="c",
        )
    )
    region = path_of(root, "live")
    region.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(region), uuid, str(4096 * MIB), str(100 * MIB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [sys.executable, "-c", _STATUS, str(root), str(state), str(tmp_path / "no.sock")],
            env=simgpu_node.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        doc = json.loads(out)
        gpus = {g["uuid"]: g for g in doc["gpus"]}
        assert len(gpus) == 2 and gpus[uuid]["index"] == 0
        assert gpus[uuid]["memory_total"] == 16 << 30 and gpus[uuid]["name"]
        assert isinstance(gpus[uuid]["memory_used_nvml"], int) and gpus[uuid]["healthy"] is True
        assert gpus[uuid]["memory_used_by_containers"] == 100 * MIB
        (live,) = doc["allocations"]
        assert live["region_state"] == "ok" and live["processes_alive"] == 1
        assert live["gpus"][0]["memory_used"] == 100 * MIB
        assert live["gpus"][0]["processes"] == 1
        assert not any("NVML" in n for n in doc["notes"])
        assert live_processes(root, "live") == 1
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert live_processes(root, "live") == 0
    assert live_processes(root, "never-allocated") == 0
    # The process is gone: the host sees no live process, without needing its pid.
    after = collect_view(root, state, tmp_path / "no.sock", nvml=False)
    assert after.allocations[0].processes_alive == 0
    assert after.allocations[0].region_state == "ok"
    # ...and none of its memory: a dead process's charge is not usage, reaped or not.
    assert after.allocations[0].gpus[0].memory_used == 0


def test_nvml_memory_used_is_empty_without_nvml() -> None:
    from vgpu_plugin.node.gpu.nvml import nvml_memory_used

    # This test process has no libnvidia-ml on its library path (no driver here).
    assert nvml_memory_used() == {}


def test_dra_claims_are_listed_beside_the_device_plugins_allocations(
    node: SyntheticNode, tmp_path: Path
) -> None:
    store = AllocationStore(node.state)
    ClaimLedger(store).put(
        prepared_claim("u-1", GpuLimit(GPU_A, 6 << 30, 30), created=150.0), "prepared"
    )
    store.close()
    node.region("dra-u-1", Snap((Dev(GPU_A, 512 * MIB),), (Proc(True, (512 * MIB,)),)))
    view = node.collect(tmp_path / "no-kubelet.sock")
    lines = render_status(view).splitlines()
    row = next(line for line in lines if "dra-u-1" in line)
    # used/limit, peak, refused, fallbacks, GPU seconds, held back, compute, procs, region,
    # driver limit
    assert row.split() == [
        "claim", "ml/infer", "dra", "dra-u-1", GPU_A, "512/6144", "0", "0", "0", "0.0", "0.0",
        "30%",
        "1", "ok", "unknown",
    ]  # fmt: skip
    # Between alloc-1 (created 100) and alloc-2 (200), as every allocation: oldest first.
    ids = [a.id for a in view.allocations]
    assert ids.index("alloc-1") < ids.index("dra-u-1") < ids.index("alloc-2")
    doc = json.loads(status_json(view))
    (claim,) = [a for a in doc["allocations"] if a["frontend"] == "dra"]
    assert (claim["claim"], claim["pod"], claim["id"]) == ("ml/infer", None, "dra-u-1")
    assert claim["gpus"][0]["memory_limit"] == 6 << 30
    (gpu_a,) = [g for g in doc["gpus"] if g["uuid"] == GPU_A]
    # alloc-1 and alloc-2 hold 20389 MiB each on GPU A (alloc-3 too); the claim adds 6 GiB.
    plugin_only = sum(
        g.memory_limit for a in view.allocations if a.frontend != "dra" and not a.ended
        for g in a.gpus if g.uuid == GPU_A
    )  # fmt: skip
    assert gpu_a["memory_limited"] == plugin_only + (6 << 30)
    assert gpu_a["slices_allocated"] == 3  # slices are the device plugin's only


def test_an_unreadable_dra_claims_file_is_a_note_and_left_alone(
    node: SyntheticNode, tmp_path: Path
) -> None:
    path = node.state / "dra-claims.json"
    path.write_text("{not json")
    view = node.collect(tmp_path / "no-kubelet.sock")
    assert any("DRA claims file" in n and "not shown" in n for n in view.notes)
    assert all(a.frontend == "device-plugin" for a in view.allocations)
    assert path.read_text() == "{not json"  # status is read-only: nothing moved aside


def test_the_driver_limit_is_confirmed_per_gpu_by_what_a_process_of_the_container_found() -> None:
    grant = GpuLimit(GPU_A, 4096 * MIB, 0)
    cases = {  # allocation: (requested, what a process found, bytes/code, expected state)
        "held": ("requested", SHIM_FOUND, 4096 * MIB, "confirmed"),
        "looser": ("requested", SHIM_FOUND, 8192 * MIB, "not applied: the driver's limit, "
                   "8192 MiB, is above the grant of 4096 MiB"),
        "no-hook": ("requested", SHIM_NONE, 0, "not applied: no limit on the container's cgroup"),
        "old-driver": ("requested", SHIM_UNSUPPORTED, 0, "not applied: the driver cannot report "
                       "one (no nvmlDeviceGetMemoryLimits_v1)"),
        "v1": ("requested", SHIM_NO_CGROUP, 0, "not applied: the container is in no cgroup v2"),
        "failed": ("requested", SHIM_ERROR, 999, "not applied: NVML error 999 when asked"),
        "no-cuda-yet": ("requested", SHIM_UNCHECKED, 0, "requested"),
        "off": ("off", SHIM_NONE, 0, "off"),
        "set-by-someone": ("off", SHIM_FOUND, 2048 * MIB, "confirmed"),
    }  # fmt: skip
    records = [
        rec(a, i, (f"{GPU_A}-{i}",), grant, driver=asked)
        for i, (a, (asked, _, _, _)) in enumerate(cases.items())
    ]
    regions = {
        a: Snap((Dev(GPU_A, 0, driver_limit=v, driver_limit_state=found),), ())
        for a, (_, found, v, _) in cases.items()
    }
    view = build_view(records, regions, [])
    got = {a.id: (a.driver_memory_limit, a.gpus[0].driver_limit) for a in view.allocations}
    assert got == {a: (asked, want) for a, (asked, _, _, want) in cases.items()}
    doc = json.loads(status_json(view))
    held = next(a for a in doc["allocations"] if a["id"] == "held")
    assert held["driver_memory_limit"] == "requested"  # what Allocate asked, as before
    assert held["gpus"][0]["driver_limit"] == "confirmed"
    assert held["gpus"][0]["driver_limit_confirmed"] == 4096 * MIB
    looser = next(a for a in doc["allocations"] if a["id"] == "looser")
    assert looser["gpus"][0]["driver_limit_confirmed"] == 0
    table = render_status(view)
    row = next(line for line in table.splitlines() if "held" in line)
    assert row.endswith(" confirmed")


def test_the_shims_states_are_the_regions_enum() -> None:
    _, lib = region._lib()
    assert [
        SHIM_UNCHECKED,
        SHIM_FOUND,
        SHIM_NONE,
        SHIM_UNSUPPORTED,
        SHIM_NO_CGROUP,
        SHIM_ERROR,
    ] == [
        lib.VGPU_DRIVER_LIMIT_UNCHECKED,
        lib.VGPU_DRIVER_LIMIT_FOUND,
        lib.VGPU_DRIVER_LIMIT_NONE,
        lib.VGPU_DRIVER_LIMIT_UNSUPPORTED,
        lib.VGPU_DRIVER_LIMIT_NO_CGROUP,
        lib.VGPU_DRIVER_LIMIT_ERROR,
    ]
