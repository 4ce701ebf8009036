"""Prometheus metrics (docs/contracts.md#metrics-and-cli), in a registry of their own.

Per-allocation and per-GPU values are not kept in gauges that something must remember to
update: a collector builds them from the node view at each scrape. So an allocation's limits
are exported from the moment its record exists, before its container's first CUDA call (the
region is missing then and usage reads 0), and an allocation that is cleaned up disappears.
The plugin's own counters (Allocate latency, errors, registrations, reloads, health changes)
are ordinary instruments in the same registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu_plugin.node.nodeview import NodeView

log = logging.getLogger(__name__)

# frontend: device-plugin or dra; claim: a DRA allocation's claim (its namespace is in
# namespace; pod and container are empty: a claim's containers share it).
ALLOCATION_LABELS = (
    "namespace", "pod", "container", "gpu_uuid", "allocation_id", "frontend", "claim",
)  # fmt: skip
GPU_LABELS = ("gpu_uuid", "gpu_index", "model")
# Allocate is sub-millisecond when healthy; seconds means a stalled disk.
ALLOCATE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


class NodeViewCollector(Collector):
    """Exports the per-allocation and per-GPU figures of ``view_provider()`` at each scrape."""

    def __init__(self, view_provider: Callable[[], NodeView]) -> None:
        self._view_provider = view_provider

    def describe(self) -> Iterator[Any]:
        # Nothing up front: the registry must not call view_provider when this is registered.
        return iter(())

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(
            "vgpu_node_view_up", "1 if the node view (records, regions, NVML) could be built"
        )
        try:
            view = self._view_provider()
        except Exception:  # the plugin's own metrics must still be served
            log.exception("cannot build the node view for metrics")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _allocation_families(view)
        yield from _gpu_families(view)


def _gauge(name: str, doc: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _allocation_families(view: NodeView) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    used = _gauge(
        "vgpu_container_memory_used_bytes",
        "GPU memory the container's processes use, as the shim accounts it",
        ALLOCATION_LABELS,
    )
    limit = _gauge(
        "vgpu_container_memory_limit_bytes",
        "GPU memory limit of the container on this GPU",
        ALLOCATION_LABELS,
    )
    compute = _gauge(
        "vgpu_container_compute_limit_percent",
        "compute share of the container on this GPU in percent, 0 = not limited",
        ALLOCATION_LABELS,
    )
    procs = _gauge(
        "vgpu_container_processes",
        "live processes of the container with memory on this GPU",
        ALLOCATION_LABELS,
    )
    refused = CounterMetricFamily(
        "vgpu_container_memory_refusals",
        "allocations (and contexts, graph launches) refused at the container's memory limit",
        labels=list(ALLOCATION_LABELS),
    )
    fallbacks = CounterMetricFamily(
        "vgpu_container_managed_fallbacks",
        "allocations that fell back to managed memory (CUDA_OVERSUBSCRIBE)",
        labels=list(ALLOCATION_LABELS),
    )
    peak = _gauge(
        "vgpu_container_memory_peak_bytes",
        "the highest GPU memory the container's processes were charged on this GPU",
        ALLOCATION_LABELS,
    )
    gpu_time = CounterMetricFamily(
        "vgpu_container_gpu_seconds",
        "GPU time of the container's launches, as measured where its compute is limited",
        labels=list(ALLOCATION_LABELS),
    )
    region = _gauge(
        "vgpu_container_region_valid",
        "0 when the container's region exists but cannot be read or trusted (usage unknown)",
        ALLOCATION_LABELS,
    )
    driver = _gauge(
        "vgpu_container_driver_memory_limit_bytes",
        "memory limit the plugin asked the driver to hold the container to on this GPU"
        " (NVIDIA_GPU_MEMORY_LIMIT, for the toolkit's apply-cuda-memory-limits hook);"
        " 0 = not requested. Requested, not confirmed applied",
        ALLOCATION_LABELS,
    )
    for a in view.allocations:
        if a.ended:  # nothing holds it: its container is gone, its files wait for cleanup
            continue
        ns, pod, ctr = (a.pod.namespace, a.pod.pod, a.pod.container) if a.pod else ("", "", "")
        claim = ""
        if a.claim is not None:
            ns, _, claim = a.claim.partition("/")
        invalid = a.region_state.startswith("invalid")
        for g in a.gpus:
            labels = [ns, pod, ctr, g.uuid, a.id, a.frontend, claim]
            if g.memory_used is not None:
                used.add_metric(labels, g.memory_used)
            limit.add_metric(labels, g.memory_limit)
            compute.add_metric(labels, g.compute_limit)
            procs.add_metric(labels, g.processes)
            refused.add_metric(labels, g.refused)
            fallbacks.add_metric(labels, g.fallbacks)
            peak.add_metric(labels, g.memory_peak)
            gpu_time.add_metric(labels, g.gpu_seconds)
            region.add_metric(labels, 0 if invalid else 1)
            driver.add_metric(labels, g.memory_limit if a.driver_limit_requested else 0)
    yield from (used, limit, compute, procs, refused, fallbacks, peak, gpu_time, region, driver)


def _gpu_families(view: NodeView) -> Iterator[GaugeMetricFamily]:
    total = _gauge("vgpu_gpu_slices", "slices advertised for this GPU", GPU_LABELS)
    allocated = _gauge("vgpu_gpu_slices_allocated", "slices allocated to containers", GPU_LABELS)
    nvml = _gauge("vgpu_gpu_memory_used_bytes", "GPU memory in use as NVML reports it", GPU_LABELS)
    containers = _gauge(
        "vgpu_gpu_memory_containers_bytes",
        "GPU memory the containers' regions account; the gap to NVML's figure is drift",
        GPU_LABELS,
    )
    limited = _gauge(
        "vgpu_gpu_memory_limited_bytes", "sum of the containers' memory limits", GPU_LABELS
    )
    healthy = _gauge("vgpu_gpu_healthy", "1 healthy, 0 unhealthy", GPU_LABELS)
    for g in view.gpus:
        labels = [g.uuid, "" if g.index is None else str(g.index), g.name or ""]
        if g.slices_total is not None:
            total.add_metric(labels, g.slices_total)
        allocated.add_metric(labels, g.slices_allocated)
        if g.memory_used_nvml is not None:
            nvml.add_metric(labels, g.memory_used_nvml)
        containers.add_metric(labels, g.memory_used_by_containers)
        limited.add_metric(labels, g.memory_limited)
        if g.healthy is not None:
            healthy.add_metric(labels, 1 if g.healthy else 0)
    yield from (total, allocated, nvml, containers, limited, healthy)


@dataclass(frozen=True)
class PluginMetrics:
    """The plugin's own instruments, for the code paths that count."""

    registry: CollectorRegistry
    allocate_seconds: Histogram
    allocate_errors: Counter
    registrations: Counter
    config_reloads: Counter  # label result: ok | error
    health_changes: Counter  # label healthy: true | false

    def config_reloaded(self, ok: bool) -> None:
        self.config_reloads.labels(result="ok" if ok else "error").inc()

    def health_changed(self, healthy: bool) -> None:
        self.health_changes.labels(healthy="true" if healthy else "false").inc()


def new_registry(view_provider: Callable[[], NodeView] | None = None) -> PluginMetrics:
    """A fresh registry with the plugin's instruments and, given a provider, the node view."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = PluginMetrics(
        registry=registry,
        allocate_seconds=Histogram(
            "vgpu_allocate_seconds",
            "time to answer the kubelet's Allocate",
            buckets=ALLOCATE_BUCKETS,
            registry=registry,
        ),
        allocate_errors=Counter(
            "vgpu_allocate_errors", "Allocate calls answered with an error", registry=registry
        ),
        registrations=Counter(
            "vgpu_registrations", "successful Register calls to the kubelet", registry=registry
        ),
        config_reloads=Counter(
            "vgpu_config_reloads",
            "config changes seen, by result",
            labelnames=["result"],
            registry=registry,
        ),
        health_changes=Counter(
            "vgpu_health_changes",
            "GPU health transitions, by new state",
            labelnames=["healthy"],
            registry=registry,
        ),
    )
    # Zero series up front, so a rate() over them works before the first event.
    for result in ("ok", "error"):
        metrics.config_reloads.labels(result=result)
    for state in ("true", "false"):
        metrics.health_changes.labels(healthy=state)
    if view_provider is not None:
        registry.register(NodeViewCollector(view_provider))
    return metrics


# --- the HTTP edge --------------------------------------------------------------------------


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)


class MetricsServer:
    """An HTTP server of ``/metrics`` in a daemon thread; ``shutdown`` stops and closes it."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        # A short poll keeps shutdown quick; the idle cost is ten wake-ups a second.
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.1,), name="vgpu-metrics", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def shutdown(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)


def parse_address(address: str) -> tuple[str, int]:
    """``:9400`` (every interface), ``127.0.0.1:0``, ``[::1]:9400`` -> (host, port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics address {address!r} is not [HOST]:PORT (e.g. :9400)")
    host = host.strip("[]")
    return host or "0.0.0.0", int(port)


def serve_metrics(address: str, registry: CollectorRegistry) -> tuple[MetricsServer, int]:
    """Serve ``registry`` as Prometheus text on ``address``; returns the server and its port
    (the one the OS picked for port 0)."""
    import socket

    host, port = parse_address(address)
    server_class: type[_Server] = _Server
    if ":" in host:

        class _Server6(_Server):
            address_family = socket.AF_INET6

        server_class = _Server6
    httpd = make_server(
        host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_QuietHandler
    )
    server = MetricsServer(httpd)
    return server, server.port
