"""Metrics scraped over real HTTP from a node of real records and region files."""

from __future__ import annotations

import gzip
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from synthetic_regions import Dev, Proc, Snap, prepared_claim

from vgpu_plugin.core.devices import MIB, GpuLimit
from vgpu_plugin.node.ledger.dra_claims import ClaimLedger
from vgpu_plugin.node.ledger.state import AllocationRecord, AllocationStore
from vgpu_plugin.node.observe import metrics
from vgpu_plugin.node.observe.nodeview import (
    DRIVER_LIMIT_KEY,
    SHIM_FOUND,
    SHIM_NONE,
    SHIM_UNCHECKED,
    GpuFacts,
    NodeView,
    region_path,
    staged_view_provider,
    view_provider,
)

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
BUILD = ("1.2.3", "1.2.3-0123456789ab")


class Regions:
    """Region contents by path; a file must exist on disk for a region to be read, as with
    the real reader, and a registered exception is raised instead of a snapshot."""

    def __init__(self) -> None:
        self.by_path: dict[Path, Snap | Exception] = {}

    def put(self, root: Path, alloc_id: str, snap: Snap | Exception) -> None:
        path = region_path(root, alloc_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"region")
        self.by_path[path] = snap

    def __call__(self, path: Path) -> Snap:
        if not path.exists():
            raise OSError(f"{path}: no such file")
        found = self.by_path[path]
        if isinstance(found, Exception):
            raise found
        return found


def record(
    alloc_id: str,
    created: float,
    *limits: GpuLimit,
    pod: str | None = None,
    k: int = 0,
    driver: str | None = None,
) -> AllocationRecord:
    devices = tuple(f"{lim.uuid}-{k}" for lim in limits)
    return AllocationRecord(
        allocation_id=alloc_id,
        device_ids=devices,
        resource_name="nvidia.com/gpu",
        created=created,
        limits=limits,
        namespace="ml" if pod else None,
        pod=pod,
        container="server" if pod else None,
        extra={} if driver is None else {DRIVER_LIMIT_KEY: driver},
    )


@dataclass
class Node:
    root: Path
    store: AllocationStore
    regions: Regions
    gpus: list[GpuFacts]
    metrics: metrics.PluginMetrics
    port: int

    def scrape(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    root = tmp_path / "host"
    store = AllocationStore(tmp_path / "state")
    regions = Regions()
    gpus = [
        GpuFacts(GPU_A, 0, "NVIDIA A100-SXM4-80GB", 80 << 30, 4, 30 << 30, True),
        GpuFacts(GPU_B, 1, "NVIDIA A100-SXM4-80GB", 80 << 30, 4, None, False),
    ]
    provider = view_provider(root, store.all, lambda: gpus, read_region=regions)
    pm = metrics.new_registry(
        provider, hostname="node-a", utilization=lambda: {GPU_A: 0.37}, build=BUILD
    )
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry)
    try:
        yield Node(root, store, regions, gpus, pm, port)
    finally:
        server.shutdown()


def samples(
    scraped: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str
) -> list[tuple[dict[str, str], float]]:
    return [
        (labels, v)
        for labels, v in scraped.get(name, [])
        if all(labels.get(k) == want for k, want in match.items())
    ]


def value(scraped: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    found = samples(scraped, name, **match)
    assert len(found) == 1, f"{name} {match}: {found}"
    return found[0][1]


def test_allocations_and_gpus_are_exported_with_their_labels(node: Node) -> None:
    node.store.add(
        record(
            "a1",
            100,
            GpuLimit(GPU_A, 20389 * MIB, 25),
            GpuLimit(GPU_B, 40778 * MIB, 50),
            pod="infer-a",
        )
    )
    node.store.add(record("a2", 200, GpuLimit(GPU_A, 20389 * MIB, 25), k=1))
    node.regions.put(
        node.root,
        "a1",
        Snap(
            (
                Dev(GPU_A, 3 * MIB, refused=4, fallbacks=2, peak=7 * MIB, gpu_ns=2_500_000_000),
                Dev(GPU_B, 5 * MIB),
            ),
            (Proc(True, (1 * MIB, 5 * MIB)), Proc(True, (2 * MIB, 0)), Proc(False, (0, 0))),
        ),
    )
    got = node.scrape()

    a1 = {"namespace": "ml", "pod": "infer-a", "container": "server", "allocation_id": "a1"}
    a1 |= {"frontend": "device-plugin", "claim": ""}
    assert samples(got, "vgpu_container_memory_limit_bytes", gpu_uuid=GPU_A, **a1)[0][0] == {
        **a1,
        "gpu_uuid": GPU_A,
        "UUID": GPU_A,  # dcgm-exporter's name, for a plain on(UUID) join
    }
    assert value(got, "vgpu_container_memory_limit_bytes", gpu_uuid=GPU_B, **a1) == 40778 * MIB
    assert value(got, "vgpu_container_memory_used_bytes", gpu_uuid=GPU_A, **a1) == 3 * MIB
    assert value(got, "vgpu_container_memory_used_bytes", gpu_uuid=GPU_B, **a1) == 5 * MIB
    assert value(got, "vgpu_container_compute_limit_ratio", gpu_uuid=GPU_B, **a1) == 0.5
    assert value(got, "vgpu_container_processes", gpu_uuid=GPU_A, **a1) == 2
    assert value(got, "vgpu_container_processes", gpu_uuid=GPU_B, **a1) == 1
    # The region's counters: refusals, managed fallbacks, peak, measured GPU time.
    assert value(got, "vgpu_container_memory_refusals_total", gpu_uuid=GPU_A, **a1) == 4
    assert value(got, "vgpu_container_managed_fallbacks_total", gpu_uuid=GPU_A, **a1) == 2
    assert value(got, "vgpu_container_memory_peak_bytes", gpu_uuid=GPU_A, **a1) == 7 * MIB
    assert value(got, "vgpu_container_gpu_seconds_total", gpu_uuid=GPU_A, **a1) == 2.5
    assert value(got, "vgpu_container_memory_refusals_total", gpu_uuid=GPU_B, **a1) == 0

    # No region yet (no CUDA call in the container) and no pod known yet: limits still there.
    a2 = {"namespace": "", "pod": "", "container": "", "allocation_id": "a2", "gpu_uuid": GPU_A}
    assert value(got, "vgpu_container_memory_limit_bytes", **a2) == 20389 * MIB
    assert value(got, "vgpu_container_memory_used_bytes", **a2) == 0
    assert value(got, "vgpu_container_compute_limit_ratio", **a2) == 0.25
    assert value(got, "vgpu_container_processes", **a2) == 0

    gpu_a = {"gpu_uuid": GPU_A, "gpu_index": "0", "model": "NVIDIA A100-SXM4-80GB"}
    gpu_b = {**gpu_a, "gpu_uuid": GPU_B, "gpu_index": "1"}
    # dcgm-exporter's labels beside ours, the same values.
    dcgm_a = {"UUID": GPU_A, "gpu": "0", "modelName": "NVIDIA A100-SXM4-80GB", "Hostname": "node-a"}
    assert samples(got, "vgpu_gpu_slices", gpu_uuid=GPU_A)[0][0] == gpu_a | dcgm_a
    assert value(got, "vgpu_gpu_memory_total_bytes", **gpu_a) == 80 << 30
    assert value(got, "vgpu_gpu_utilization_ratio", **dcgm_a) == 0.37
    assert samples(got, "vgpu_gpu_utilization_ratio", gpu_uuid=GPU_B) == []  # NVML unknown
    assert got["vgpu_build_info"] == [({"version": BUILD[0], "shim_build_id": BUILD[1]}, 1)]
    assert not [name for name in got if name.endswith("_created")]
    assert value(got, "vgpu_gpu_slices", **gpu_a) == 4
    assert value(got, "vgpu_gpu_slices_allocated", **gpu_a) == 2
    assert value(got, "vgpu_gpu_slices_allocated", **gpu_b) == 1
    assert value(got, "vgpu_gpu_memory_used_bytes", **gpu_a) == 30 << 30
    assert samples(got, "vgpu_gpu_memory_used_bytes", gpu_uuid=GPU_B) == []  # NVML unknown
    assert value(got, "vgpu_gpu_memory_containers_bytes", **gpu_a) == 3 * MIB
    assert value(got, "vgpu_gpu_memory_limited_bytes", **gpu_a) == 2 * 20389 * MIB
    assert value(got, "vgpu_gpu_healthy", **gpu_a) == 1
    assert value(got, "vgpu_gpu_healthy", **gpu_b) == 0
    assert value(got, "vgpu_node_view_up") == 1


def test_an_allocation_is_exported_from_its_record_until_the_record_is_dropped(
    node: Node,
) -> None:
    assert samples(node.scrape(), "vgpu_container_memory_limit_bytes") == []
    node.store.add(record("fresh", 1, GpuLimit(GPU_A, 1000 * MIB, 0)))
    got = node.scrape()
    assert value(got, "vgpu_container_memory_limit_bytes", allocation_id="fresh") == 1000 * MIB
    # The pod shows up in the record's labels once cleanup has learnt it.
    labelled = replace(node.store.get("fresh"), namespace="ns", pod="p", container="c")
    node.store.add(labelled)
    got = node.scrape()
    assert value(got, "vgpu_container_memory_limit_bytes", allocation_id="fresh", pod="p") > 0
    node.store.remove("fresh")
    assert samples(node.scrape(), "vgpu_container_memory_limit_bytes") == []


def test_the_driver_limit_is_its_memory_limit_where_requested_else_0(node: Node) -> None:
    node.store.add(record("asked", 1, GpuLimit(GPU_A, 1000 * MIB, 0), driver="requested"))
    node.store.add(record("off", 2, GpuLimit(GPU_A, 1000 * MIB, 0), k=1, driver="off"))
    node.store.add(
        record(
            "mixed",
            3,
            GpuLimit(GPU_A, 1000 * MIB, 0),
            GpuLimit(GPU_B, 2000 * MIB, 0),
            k=2,
            driver="not requested: its GPUs have different limits (the hook applies one to all)",
        )
    )
    node.store.add(record("old", 4, GpuLimit(GPU_A, 1000 * MIB, 0), k=3))  # before the state
    got = node.scrape()
    name = "vgpu_container_driver_memory_limit_bytes"
    assert value(got, name, allocation_id="asked") == 1000 * MIB
    assert value(got, name, allocation_id="off") == 0
    assert [v for _, v in samples(got, name, allocation_id="mixed")] == [0, 0]
    assert value(got, name, allocation_id="old") == 0


def test_the_driver_limit_a_process_found_is_exported_as_confirmed_or_not_applied(
    node: Node,
) -> None:
    limit = GpuLimit(GPU_A, 1000 * MIB, 0)
    for k, (alloc, found, bytes_found) in enumerate(
        [
            ("held", SHIM_FOUND, 1000 * MIB),  # the hook set exactly the grant
            ("tighter", SHIM_FOUND, 900 * MIB),
            ("looser", SHIM_FOUND, 2000 * MIB),  # not its slice: the shim alone holds it
            ("none", SHIM_NONE, 0),  # the node's toolkit lacks the hook
            ("unasked", SHIM_UNCHECKED, 0),  # no CUDA process yet
        ]
    ):
        node.store.add(record(alloc, k, limit, k=k, driver="requested"))
        dev = Dev(GPU_A, 0, driver_limit=bytes_found, driver_limit_state=found)
        node.regions.put(node.root, alloc, Snap((dev,), ()))
    got = node.scrape()
    confirmed = "vgpu_container_driver_memory_limit_confirmed_bytes"
    not_applied = "vgpu_container_driver_memory_limit_not_applied"
    requested = "vgpu_container_driver_memory_limit_bytes"
    assert value(got, confirmed, allocation_id="held") == 1000 * MIB
    assert value(got, confirmed, allocation_id="tighter") == 900 * MIB
    for alloc in ("looser", "none", "unasked"):
        assert value(got, confirmed, allocation_id=alloc) == 0
    assert [value(got, not_applied, allocation_id=a) for a in ("held", "looser", "none")] == [
        0,
        1,
        1,
    ]
    assert value(got, not_applied, allocation_id="unasked") == 0
    assert value(got, requested, allocation_id="none") == 1000 * MIB  # the request stays


def test_an_untrusted_region_exports_its_limit_but_no_usage(node: Node) -> None:
    node.store.add(record("bad", 1, GpuLimit(GPU_A, 1000 * MIB, 0)))
    node.store.add(record("foreign", 2, GpuLimit(GPU_A, 1000 * MIB, 0), k=1))
    node.regions.put(node.root, "bad", ValueError("bad magic"))
    node.regions.put(node.root, "foreign", Snap((Dev(GPU_B, 1 << 40),), ()))
    got = node.scrape()
    for alloc in ("bad", "foreign"):
        assert value(got, "vgpu_container_memory_limit_bytes", allocation_id=alloc) == 1000 * MIB
        assert samples(got, "vgpu_container_memory_used_bytes", allocation_id=alloc) == []
        assert value(got, "vgpu_container_region_valid", allocation_id=alloc) == 0
    # The foreign region's 1 TiB is not charged to any GPU.
    assert value(got, "vgpu_gpu_memory_containers_bytes", gpu_uuid=GPU_A) == 0


def test_the_plugins_own_instruments(node: Node) -> None:
    pm = node.metrics
    pm.allocate_seconds.observe(0.0003)
    pm.allocate_seconds.observe(0.2)
    pm.allocate_errors.inc()
    pm.registrations.inc(2)
    pm.config_reloaded(ok=True)
    pm.config_reloaded(ok=False)
    pm.config_reloaded(ok=False)
    pm.health_changed(healthy=False)
    got = node.scrape()
    assert value(got, "vgpu_allocate_seconds_bucket", le="0.0001") == 0
    assert value(got, "vgpu_allocate_seconds_bucket", le="0.0005") == 1
    assert value(got, "vgpu_allocate_seconds_bucket", le="0.25") == 2
    assert value(got, "vgpu_allocate_seconds_count") == 2
    assert value(got, "vgpu_allocate_errors_total") == 1
    assert value(got, "vgpu_registrations_total") == 2
    assert value(got, "vgpu_config_reloads_total", result="ok") == 1
    assert value(got, "vgpu_config_reloads_total", result="error") == 2
    assert value(got, "vgpu_health_changes_total", healthy="false") == 1
    assert value(got, "vgpu_health_changes_total", healthy="true") == 0


def test_a_failing_view_keeps_the_plugins_metrics_served() -> None:
    def broken() -> NodeView:
        raise RuntimeError("state dir unreadable")

    pm = metrics.new_registry(broken)
    pm.registrations.inc()
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
    assert "vgpu_node_view_up 0.0" in text
    assert "vgpu_registrations_total 1.0" in text


def test_nothing_lands_in_the_global_registry() -> None:
    metrics.new_registry(lambda: NodeView((), ()))
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not [n for n in names if n.startswith("vgpu_")]


def test_shutdown_closes_the_port() -> None:
    pm = metrics.new_registry()
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry)
    assert port > 0
    server.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # The port is free again.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        (":9400", ("0.0.0.0", 9400)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9400", ("::1", 9400)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
    ],
)
def test_parse_address(address: str, parsed: tuple[str, int]) -> None:
    assert metrics.parse_address(address) == parsed


@pytest.mark.parametrize("address", ["9400", "host:", "host:port", ":99999"])
def test_parse_address_refuses(address: str) -> None:
    with pytest.raises(ValueError, match="not \\[HOST\\]:PORT"):
        metrics.parse_address(address)


def test_an_ended_allocation_in_its_cleanup_grace_is_not_counted(node: Node) -> None:
    """A pod deleted and created again: the old allocation waits out the grace, held by
    nobody; the GPU counts only the new one's slices and limits (issue 14, item 11)."""
    lim = GpuLimit(GPU_A, 8192 * MIB, 50)
    old = replace(record("old", 100.0, lim, pod="infer-a", k=0), released=150.0)
    node.store.add(old)
    node.store.add(record("new", 160.0, lim, pod="infer-a", k=1))
    scraped = node.scrape()
    assert value(scraped, "vgpu_gpu_slices_allocated", gpu_uuid=GPU_A) == 1
    assert value(scraped, "vgpu_gpu_memory_limited_bytes", gpu_uuid=GPU_A) == 8192 * MIB
    limits = samples(scraped, "vgpu_container_memory_limit_bytes", pod="infer-a")
    assert [labels["allocation_id"] for labels, _ in limits] == ["new"]


def test_an_ended_allocation_with_live_processes_still_counts(node: Node) -> None:
    lim = GpuLimit(GPU_A, 8192 * MIB, 50)
    node.store.add(replace(record("old", 100.0, lim, pod="infer-a"), released=150.0))
    node.regions.put(node.root, "old", Snap((Dev(GPU_A, 100 * MIB),), (Proc(True, (100 * MIB,)),)))
    scraped = node.scrape()
    assert value(scraped, "vgpu_gpu_slices_allocated", gpu_uuid=GPU_A) == 1
    assert value(scraped, "vgpu_gpu_memory_limited_bytes", gpu_uuid=GPU_A) == 8192 * MIB


def test_dra_claims_are_exported_beside_the_device_plugins_allocations(tmp_path: Path) -> None:
    root = tmp_path / "host"
    store = AllocationStore(tmp_path / "state")
    store.add(record("a1", 1.0, GpuLimit(GPU_A, 10 * MIB, 25), pod="infer-a"))
    # One ledger: the claim is a record of the same store.
    ClaimLedger(store).put(
        prepared_claim("u-1", GpuLimit(GPU_A, 6 << 30, 30), created=2.0), "prepared"
    )
    regions = Regions()
    regions.put(root, "dra-u-1", Snap((Dev(GPU_A, 2 * MIB),), (Proc(True, (2 * MIB,)),)))
    gpus = [GpuFacts(GPU_A, 0, "NVIDIA A100-SXM4-80GB", 80 << 30, None, None, True)]
    provider = view_provider(root, store.all, lambda: gpus, read_region=regions)
    pm = metrics.new_registry(provider)
    server, port = metrics.serve_metrics("127.0.0.1:0", pm.registry)
    try:
        got = Node(root, store, regions, gpus, pm, port).scrape()
    finally:
        server.shutdown()
    dra = {"namespace": "ml", "pod": "", "container": "", "claim": "infer", "frontend": "dra"}
    dra |= {"allocation_id": "dra-u-1", "gpu_uuid": GPU_A}
    assert value(got, "vgpu_container_memory_limit_bytes", **dra) == 6 << 30
    assert value(got, "vgpu_container_memory_used_bytes", **dra) == 2 * MIB
    assert value(got, "vgpu_container_compute_limit_ratio", **dra) == 0.3
    assert value(got, "vgpu_container_processes", **dra) == 1
    plugin = {"allocation_id": "a1", "frontend": "device-plugin", "claim": ""}
    assert value(got, "vgpu_container_memory_limit_bytes", **plugin) == 10 * MIB
    # The GPU's limited memory counts both front ends.
    assert value(got, "vgpu_gpu_memory_limited_bytes", gpu_uuid=GPU_A) == (6 << 30) + 10 * MIB
    assert value(got, "vgpu_gpu_memory_containers_bytes", gpu_uuid=GPU_A) == 2 * MIB


def _odd_node(tmp_path: Path) -> tuple[AllocationStore, Regions, list[GpuFacts]]:
    """Records with every kind of value: odd label text, no pod, an ended one, two GPUs,
    regions missing, valid, untrusted and foreign."""
    store = AllocationStore(tmp_path / "state")
    regions = Regions()
    root = tmp_path / "host"
    store.add(record("a1", 1, GpuLimit(GPU_A, 1000 * MIB, 25), GpuLimit(GPU_B, 3 * MIB, 0)))
    store.add(
        replace(
            record("a2", 2, GpuLimit(GPU_A, 7, 0), k=1),
            namespace='n"s\\',
            pod="p\nq",
            container="c",
        )
    )
    store.add(record("a3", 3, GpuLimit(GPU_B, 5 * MIB, 50), pod="x", k=2, driver="requested"))
    store.add(replace(record("gone", 4, GpuLimit(GPU_A, 9, 0), k=3), released=10.0))
    store.add(record("bad", 5, GpuLimit(GPU_A, 9, 0), k=4))
    store.add(record("foreign", 6, GpuLimit(GPU_A, 9, 0), k=5))
    regions.put(
        root,
        "a1",
        Snap(
            (Dev(GPU_A, 3 * MIB, refused=4, peak=7 * MIB, gpu_ns=2_500_000_001), Dev(GPU_B, 1)),
            (Proc(True, (1 * MIB, 1)), Proc(False, (5, 0))),
        ),
    )
    regions.put(root, "bad", ValueError("bad magic"))
    regions.put(root, "foreign", Snap((Dev(GPU_B, 1 << 40),), ()))
    gpus = [
        GpuFacts(GPU_A, 0, 'Model "x"', 80 << 30, 4, 123456789012, True),
        GpuFacts(GPU_B, None, None, None, None, None, None),
    ]
    return store, regions, gpus


def test_the_scrape_body_is_byte_for_byte_what_generate_latest_writes(tmp_path: Path) -> None:
    store, regions, gpus = _odd_node(tmp_path)
    provider = view_provider(tmp_path / "host", store.all, lambda: gpus, read_region=regions)
    pm = metrics.new_registry(provider)
    pm.registrations.inc()
    registry = pm.registry
    assert isinstance(registry, metrics.PluginRegistry) and registry.node_view is not None
    expected = prometheus_client.generate_latest(registry)
    assert b'pod="p\\nq"' in expected and b'namespace="n\\"s\\\\"' in expected
    body = gzip.decompress(registry.node_view.gzipped())
    assert prometheus_client.generate_latest(registry.own()) + body == expected
    server, port = metrics.serve_metrics("127.0.0.1:0", registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.read() == expected
        request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(resp.read()) == expected
    finally:
        server.shutdown()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_body_is_rebuilt_only_when_older_than_its_interval(tmp_path: Path) -> None:
    store, regions, gpus = _odd_node(tmp_path)
    provider = view_provider(tmp_path / "host", store.all, lambda: gpus, read_region=regions)
    clock = Clock()
    exposition = metrics.NodeViewExposition(provider, min_interval=30.0, clock=clock)

    def text() -> str:
        return b"".join(exposition.text_chunks()).decode()

    first = text()
    assert exposition.builds == 1
    # A new record and a changed region: not seen until the body is older than 30 s.
    store.add(record("new", 7, GpuLimit(GPU_A, 11 * MIB, 0), k=6))
    regions.put(tmp_path / "host", "a1", Snap((Dev(GPU_A, 9 * MIB), Dev(GPU_B, 0)), ()))
    clock.now += 29.9
    assert text() == first and exposition.builds == 1
    clock.now += 0.1
    second = text()
    assert exposition.builds == 2
    assert 'allocation_id="new"' in second and 'allocation_id="new"' not in first
    used = "vgpu_container_memory_used_bytes{"
    line = next(x for x in second.splitlines() if x.startswith(used) and 'id="a1"' in x)
    assert line.endswith(" 0.0")
    # A record dropped goes at the next build too.
    store.remove("new")
    clock.now += 30
    assert 'allocation_id="new"' not in text() and exposition.builds == 3


def test_interval_0_rebuilds_at_every_scrape(tmp_path: Path) -> None:
    store, regions, gpus = _odd_node(tmp_path)
    provider = view_provider(tmp_path / "host", store.all, lambda: gpus, read_region=regions)
    exposition = metrics.NodeViewExposition(provider)
    exposition.gzipped()
    store.add(record("new", 7, GpuLimit(GPU_A, 11 * MIB, 0), k=6))
    assert b'allocation_id="new"' in gzip.decompress(exposition.gzipped())
    assert exposition.builds == 2


def test_a_forked_build_gives_the_same_body_and_runs_only_the_build_in_the_child(
    tmp_path: Path,
) -> None:
    store, regions, gpus = _odd_node(tmp_path)
    root = tmp_path / "host"
    prepare = staged_view_provider(root, store.all, lambda: gpus, read_region=regions)
    here = metrics.NodeViewExposition(lambda: prepare()())
    pids: list[int] = []

    def gather() -> Callable[[], NodeView]:
        pids.append(os.getpid())  # the inputs are gathered in this process, not the child
        return prepare()

    forked = metrics.NodeViewExposition(lambda: prepare()(), forked=gather)
    assert gzip.decompress(forked.gzipped()) == gzip.decompress(here.gzipped())
    assert pids == [os.getpid()]
    # The child's work (reading regions) happens in another process: a reader that records
    # its pid on disk shows it.
    seen = tmp_path / "reader-pids"

    def reader(path: Path) -> Snap:
        with seen.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return regions(path)

    prepare = staged_view_provider(root, store.all, lambda: gpus, read_region=reader)
    assert b"vgpu_node_view_up 1.0" in gzip.decompress(forked.gzipped())
    assert str(os.getpid()) not in seen.read_text().split()


def test_a_forked_build_that_fails_or_hangs_says_the_view_is_down(tmp_path: Path) -> None:
    def crash() -> NodeView:
        os._exit(3)

    def hang() -> NodeView:
        time.sleep(3600)
        raise AssertionError("unreachable")

    for build, timeout in ((crash, 60.0), (hang, 0.5)):
        exposition = metrics.NodeViewExposition(
            lambda: NodeView((), ()), forked=lambda b=build: b, fork_timeout=timeout
        )
        body = gzip.decompress(exposition.gzipped()).decode()
        assert body.endswith("vgpu_node_view_up 0.0\n") and "vgpu_container" not in body


def test_a_fork_that_fails_says_the_view_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fork() -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    view = NodeView((), ())
    exposition = metrics.NodeViewExposition(lambda: view, forked=lambda: lambda: view)
    assert gzip.decompress(exposition.gzipped()).decode().endswith("vgpu_node_view_up 0.0\n")


@pytest.mark.parametrize("encoding", ["gzip", "identity"])
def test_the_content_type_is_the_text_format_the_docs_name(node: Node, encoding: str) -> None:
    node.store.add(record("ct", 1, GpuLimit(GPU_A, 1000 * MIB, 0)))
    url = f"http://127.0.0.1:{node.port}/metrics"
    req = urllib.request.Request(url, headers={"Accept-Encoding": encoding})
    with urllib.request.urlopen(req, timeout=5) as resp:
        content_type = resp.headers["Content-Type"]
        body = resp.read()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = (gzip.decompress(body) if encoding == "gzip" else body).decode()
    assert "vgpu_container_memory_limit_bytes{" in text
    docs = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert f"`Content-Type: {content_type}`" in docs.read_text()


def test_the_probes_answer_ok_or_503_with_the_reason_and_leave_metrics_alone() -> None:
    def broken() -> str | None:
        raise RuntimeError("boom")

    calls: list[str] = []

    def inner(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
        calls.append(str(environ["PATH_INFO"]))
        start_response("200 OK", [])
        return [b"metrics"]

    app = metrics.probes_app(
        {"/healthz": lambda: None, "/readyz": lambda: "not registered", "/x": broken}, inner
    )

    def get(path: str) -> tuple[str, bytes]:
        got: list[str] = []
        body = b"".join(app({"PATH_INFO": path}, lambda status, headers: got.append(status)))
        return got[0], body

    assert get("/healthz") == ("200 OK", b"ok\n")
    assert get("/readyz") == ("503 Service Unavailable", b"not registered\n")
    assert get("/x") == ("503 Service Unavailable", b"the check failed: RuntimeError('boom')\n")
    assert get("/metrics") == ("200 OK", b"metrics") and calls == ["/metrics"]
