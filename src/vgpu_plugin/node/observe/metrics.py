"""Prometheus metrics (docs/contracts.md#metrics-and-cli), in a registry of their own.

Per-allocation and per-GPU values are not kept in gauges that something must remember to
update: a collector builds them from the node view at each scrape. So an allocation's limits
are exported from the moment its record exists, before its container's first CUDA call (the
region is missing then and usage reads 0), and an allocation that is cleaned up disappears.
The plugin's own counters (Allocate latency, errors, registrations, reloads, health changes)
are ordinary instruments in the same registry.
"""

from __future__ import annotations

import gzip
import itertools
import logging
import math
import os
import select
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vgpu_plugin.node.observe.nodeview import (
    DRIVER_LIMIT_NOT_APPLIED,
    AllocationGpuView,
    AllocationView,
    GpuView,
    NodeView,
)

log = logging.getLogger(__name__)

# frontend: device-plugin or dra; claim: a DRA allocation's claim (its namespace is in
# namespace; pod and container are empty: a claim's containers share it).
# UUID, gpu, modelName and Hostname are dcgm-exporter's names for the GPU's UUID, index, model
# and node, beside our own: a join with its series is then a plain ``on(UUID)``.
ALLOCATION_LABELS = (
    "namespace", "pod", "container", "gpu_uuid", "allocation_id", "frontend", "claim", "UUID",
)  # fmt: skip
GPU_LABELS = ("gpu_uuid", "gpu_index", "model", "UUID", "gpu", "modelName", "Hostname")
# The body's format: what prometheus_client writes and Prometheus parses as text 0.0.4.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
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


# The node view's families, defined once for both ways of exposing them: as families for
# the registry (``collect``) and as text rendered by NodeViewExposition (the scrape's path).
# (name, help, type, value of one allocation's GPU: None = no sample)
AllocationValue = Callable[[AllocationView, AllocationGpuView], "float | int | None"]
ALLOCATION_FAMILIES: tuple[tuple[str, str, str, AllocationValue], ...] = (
    (
        "vgpu_container_memory_used_bytes",
        "GPU memory the container's processes use, as the shim accounts it",
        "gauge",
        lambda a, g: g.memory_used,
    ),
    (
        "vgpu_container_memory_limit_bytes",
        "GPU memory limit of the container on this GPU",
        "gauge",
        lambda a, g: g.memory_limit,
    ),
    (
        "vgpu_container_compute_limit_ratio",
        "compute share of the container on this GPU, 0-1; 0 = not limited",
        "gauge",
        lambda a, g: g.compute_limit / 100,
    ),
    (
        "vgpu_container_compute_guarantee_ratio",
        "compute guaranteed to the container on this GPU while others are busy, 0-1 (compute:"
        " guaranteed; compute_limit_ratio is then its cap); 0 = none",
        "gauge",
        lambda a, g: g.compute_guarantee / 100,
    ),
    (
        "vgpu_container_processes",
        "live processes of the container with memory on this GPU",
        "gauge",
        lambda a, g: g.processes,
    ),
    (
        "vgpu_container_memory_refusals",
        "allocations (and contexts, graph launches) refused at the container's memory limit",
        "counter",
        lambda a, g: g.refused,
    ),
    (
        "vgpu_container_managed_fallbacks",
        "allocations that fell back to managed memory (CUDA_OVERSUBSCRIBE)",
        "counter",
        lambda a, g: g.fallbacks,
    ),
    (
        "vgpu_container_memory_peak_bytes",
        "the highest GPU memory the container's processes were charged on this GPU",
        "gauge",
        lambda a, g: g.memory_peak,
    ),
    (
        "vgpu_container_gpu_seconds",
        "GPU time of the container's launches, as measured where its compute is limited",
        "counter",
        lambda a, g: g.gpu_seconds,
    ),
    (
        "vgpu_container_compute_held_back_seconds",
        "time the container's launches on this GPU waited for their compute share, as its"
        " pacing file says (summed over its processes; clamped; absent where the file cannot"
        " be trusted)",
        "counter",
        lambda a, g: g.compute_held_back_seconds,
    ),
    (
        "vgpu_container_region_valid",
        "0 when the container's region exists but cannot be read or trusted (usage unknown)",
        "gauge",
        lambda a, g: 0 if a.region_state.startswith("invalid") else 1,
    ),
    (
        "vgpu_container_driver_memory_limit_bytes",
        "memory limit the plugin asked the driver to hold the container to on this GPU"
        " (NVIDIA_GPU_MEMORY_LIMIT, for the toolkit's apply-cuda-memory-limits hook);"
        " 0 = not requested. The request: vgpu_container_driver_memory_limit_confirmed_bytes"
        " says whether it holds",
        "gauge",
        lambda a, g: g.memory_limit if a.driver_limit_requested else 0,
    ),
    (
        "vgpu_container_driver_memory_limit_confirmed_bytes",
        "hard memory limit a process of the container found the driver holds its cgroup to"
        " on this GPU (nvmlDeviceGetMemoryLimits_v1), where at most the container's limit;"
        " 0 = not confirmed. Reported from inside the container",
        "gauge",
        lambda a, g: g.driver_limit_confirmed,
    ),
    (
        "vgpu_container_driver_memory_limit_not_applied",
        "1 when a process of the container looked and found the driver does not hold it to"
        " the requested limit on this GPU (no limit, a larger one, or no way to ask)",
        "gauge",
        lambda a, g: 1 if g.driver_limit.startswith(DRIVER_LIMIT_NOT_APPLIED) else 0,
    ),
    (
        "vgpu_container_unshimmed_processes",
        "processes of the container on this GPU that the shim does not account (NVML lists"
        " them, the container's region has no slot for them): nothing holds their memory or"
        " compute to the limits. Needs the node's pids (hostPID)",
        "gauge",
        lambda a, g: g.unshimmed_processes,
    ),
    (
        "vgpu_container_unshimmed_memory_bytes",
        "GPU memory NVML says the container's unshimmed processes hold on this GPU",
        "gauge",
        lambda a, g: g.unshimmed_memory,
    ),
)
GpuValue = Callable[[GpuView], "float | int | None"]
GPU_FAMILIES: tuple[tuple[str, str, str, GpuValue], ...] = (
    ("vgpu_gpu_slices", "slices advertised for this GPU", "gauge", lambda g: g.slices_total),
    (
        "vgpu_gpu_memory_total_bytes",
        "GPU memory in all, as NVML reports it",
        "gauge",
        lambda g: g.memory_total,
    ),
    (
        "vgpu_gpu_slices_allocated",
        "slices allocated to containers",
        "gauge",
        lambda g: g.slices_allocated,
    ),
    (
        "vgpu_gpu_memory_used_bytes",
        "GPU memory in use as NVML reports it",
        "gauge",
        lambda g: g.memory_used_nvml,
    ),
    (
        "vgpu_gpu_memory_containers_bytes",
        "GPU memory the containers' regions account; the gap to NVML's figure is drift",
        "gauge",
        lambda g: g.memory_used_by_containers,
    ),
    (
        "vgpu_gpu_memory_limited_bytes",
        "sum of the containers' memory limits",
        "gauge",
        lambda g: g.memory_limited,
    ),
    (
        "vgpu_gpu_compute_lent_seconds",
        "GPU time containers with a guarantee used beyond it (idle time lent to them), as"
        " measured between the plugin's metrics builds since it started (a lower bound)",
        "counter",
        lambda g: g.compute_lent_seconds,
    ),
    (
        "vgpu_gpu_healthy",
        "1 healthy, 0 unhealthy",
        "gauge",
        lambda g: None if g.healthy is None else (1 if g.healthy else 0),
    ),
)
# Not in the node view: NVML's busy time per GPU UUID, gathered beside it at each build.
UTILIZATION_NAME = "vgpu_gpu_utilization_ratio"
UTILIZATION_HELP = (
    "share of the last sample period in which a kernel ran on this GPU, 0-1, as NVML reports it"
)
Utilization = Callable[[], Mapping[str, float]]
UP_NAME = "vgpu_node_view_up"
UP_HELP = "1 if the node view (records, regions, NVML) could be built"


def _labels_of(a: AllocationView, g: AllocationGpuView) -> list[str]:
    """ALLOCATION_LABELS' values for one GPU of one allocation."""
    ns, pod, ctr = (a.pod.namespace, a.pod.pod, a.pod.container) if a.pod else ("", "", "")
    claim = ""
    if a.claim is not None:
        ns, _, claim = a.claim.partition("/")
    return [ns, pod, ctr, g.uuid, a.id, a.frontend, claim, g.uuid]


def _gpu_labels_of(g: GpuView, hostname: str) -> list[str]:
    index, name = "" if g.index is None else str(g.index), g.name or ""
    return [g.uuid, index, name, g.uuid, index, name, hostname]


def node_hostname() -> str:
    """The node's name as dcgm-exporter's ``Hostname`` has it: NODE_NAME (the chart sets it
    from the pod's node), else the host name."""
    import socket

    return os.environ.get("NODE_NAME") or socket.gethostname()


def no_utilization() -> Mapping[str, float]:
    return {}


def _utilization_of(source: Utilization) -> Mapping[str, float]:
    try:
        return source()
    except Exception:  # a figure missing, not a failed scrape
        log.exception("cannot read the GPUs' utilisation for metrics")
        return {}


def _family(name: str, doc: str, kind: str, labels: tuple[str, ...]) -> Any:
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=list(labels))
    return GaugeMetricFamily(name, doc, labels=list(labels))


class NodeViewCollector(Collector):
    """Exports the per-allocation and per-GPU figures of ``view_provider()`` at each scrape."""

    def __init__(
        self,
        view_provider: Callable[[], NodeView],
        hostname: str = "",
        utilization: Utilization = no_utilization,
    ) -> None:
        self._view_provider = view_provider
        self._hostname = hostname
        self._utilization = utilization

    def describe(self) -> Iterator[Any]:
        # Nothing up front: the registry must not call view_provider when this is registered.
        return iter(())

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(UP_NAME, UP_HELP)
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
        yield from _gpu_families(view, self._hostname, _utilization_of(self._utilization))


def _allocation_families(view: NodeView) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    families = [(_family(n, d, k, ALLOCATION_LABELS), f) for n, d, k, f in ALLOCATION_FAMILIES]
    for a in view.allocations:
        if a.ended:  # nothing holds it: its container is gone, its files wait for cleanup
            continue
        for g in a.gpus:
            labels = _labels_of(a, g)
            for family, value in families:
                v = value(a, g)
                if v is not None:
                    family.add_metric(labels, v)
    yield from (family for family, _ in families)


def _gpu_families(
    view: NodeView, hostname: str, utilization: Mapping[str, float]
) -> Iterator[GaugeMetricFamily]:
    families = [(_family(n, d, k, GPU_LABELS), f) for n, d, k, f in GPU_FAMILIES]
    busy = GaugeMetricFamily(UTILIZATION_NAME, UTILIZATION_HELP, labels=list(GPU_LABELS))
    for g in view.gpus:
        labels = _gpu_labels_of(g, hostname)
        for family, value in families:
            v = value(g)
            if v is not None:
                family.add_metric(labels, v)
        if g.uuid in utilization:
            busy.add_metric(labels, utilization[g.uuid])
    yield from (family for family, _ in families)
    yield busy


# --- the scrape's path: the node view as text, cached -----------------------------------------


def _escape(value: str) -> str:
    """A label value as the text format writes it (as prometheus_client does)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_text(names: tuple[str, ...], values: list[str]) -> str:
    """``{a="x",b="y"}`` with the names sorted, as prometheus_client writes them."""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _header(name: str, doc: str, kind: str) -> str:
    shown = name + "_total" if kind == "counter" else name
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {shown} {doc}\n# TYPE {shown} {kind}\n"


class NodeViewExposition:
    """The node view's families as Prometheus text (format 0.0.4), the same bytes
    ``generate_latest`` writes for NodeViewCollector, made cheaply and kept gzipped.

    A scrape costs the plugin's Allocate path what it holds the GIL for, so:

    - the body is rebuilt at most once per ``min_interval`` seconds, and never more often than
      ten times its own last build time (so rebuilds take at most ~10 % of one CPU however
      often the node is scraped); scrapes in between are served the last body (metrics up
      to that old; Prometheus scrapes every 15 s or more);
    - the label text of each allocation's GPU is kept between builds and reused while the
      allocation's labels are unchanged: a build formats values only;
    - the body is kept gzipped (a Prometheus server takes it as it is), not as text: a few
      per cent of the text's size, and a client without gzip gets it inflated as it is sent.

    ``min_interval`` 0 (the default) rebuilds at every scrape.

    ``forked``: build in a forked child instead (serve does). ``forked()`` runs here and
    gathers what needs the plugin's locks or NVML, and returns the part that reads the
    regions and builds the view; the child runs that part, renders, gzips, writes the body to
    a pipe and exits. The build then holds no GIL of ours (Allocate's threads never wait for
    it) and its transient objects (tens of MiB at thousands of containers) die with the
    child instead of staying in our heap. A child that fails or takes more than
    ``fork_timeout`` seconds is killed and the scrape says ``vgpu_node_view_up 0``."""

    def __init__(
        self,
        view_provider: Callable[[], NodeView],
        min_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        forked: Callable[[], Callable[[], NodeView]] | None = None,
        fork_timeout: float = 60.0,
        hostname: str = "",
        utilization: Utilization = no_utilization,
    ) -> None:
        self._view_provider = view_provider
        self._hostname = hostname
        self._utilization = utilization
        self._forked = forked
        self.fork_timeout = fork_timeout
        self.min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._next_build = -math.inf
        self._labels: dict[tuple[str, ...], str] = {}
        self._gpu_labels: dict[tuple[str, ...], str] = {}
        self._values: dict[float | int, str] = {}
        self.builds = 0  # bodies built (for tests and figures)

    def gzipped(self) -> bytes:
        """The body (gzip), rebuilt if it is older than allowed."""
        with self._lock:
            now = self._clock()
            if self._body is None or now >= self._next_build:
                t0 = time.perf_counter()
                self._body = self._build()
                took = time.perf_counter() - t0
                self.builds += 1
                self._next_build = self._clock() + max(self.min_interval, 10 * took)
                if self.min_interval <= 0:
                    self._next_build = -math.inf
            return self._body

    def text_chunks(self, piece: int = 1 << 18) -> Iterator[bytes]:
        """The body inflated, ``piece`` bytes at a time (for a client that takes no gzip):
        small pieces, because what inflating holds the GIL for (growing and copying its
        output) grows with the piece, and the text is ~30 times the gzip."""
        inflate = zlib.decompressobj(wbits=31)
        pending = self.gzipped()
        while pending:
            out = inflate.decompress(pending, piece)
            pending = inflate.unconsumed_tail
            if out:
                yield out
        tail = inflate.flush()
        if tail:
            yield tail

    def _build(self) -> bytes:
        # NVML is asked here, beside the inputs the forked build needs, not in the child.
        busy = _utilization_of(self._utilization)
        if self._forked is None:
            return self._build_here(self._view_provider, busy)
        try:
            build = self._forked()
        except Exception:  # the plugin's own metrics must still be served
            log.exception("cannot gather the node view's inputs for metrics")
            return self._failed()
        return self._build_in_child(build, busy)

    def _build_here(self, provider: Callable[[], NodeView], busy: Mapping[str, float]) -> bytes:
        deflate = zlib.compressobj(1, zlib.DEFLATED, 31)
        out: list[bytes] = []
        for chunk in self._render(provider, busy):
            out.append(deflate.compress(chunk.encode()))
        out.append(deflate.flush())
        return b"".join(out)

    def _failed(self) -> bytes:
        up = _header(UP_NAME, UP_HELP, "gauge") + f"{UP_NAME} 0.0\n"
        return gzip.compress(up.encode(), 1)

    def _build_in_child(self, build: Callable[[], NodeView], busy: Mapping[str, float]) -> bytes:
        try:
            r, w = os.pipe()
        except OSError:
            log.exception("cannot start the metrics build")
            return self._failed()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            log.exception("cannot start the metrics build")
            return self._failed()
        if pid == 0:  # the child: build, write, exit; never return into the caller's code
            code = 1
            try:
                os.close(r)
                body = memoryview(self._build_here(build, busy))
                while body:
                    body = body[os.write(w, body) :]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        chunks: list[bytes] = []
        deadline = time.monotonic() + self.fork_timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    log.error("the metrics build took over %.0f s: killed it", self.fork_timeout)
                    break
                chunk = os.read(r, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(r)
            _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            log.error("the metrics build's process failed (wait status %d)", status)
            return self._failed()
        return b"".join(chunks)

    def _value(self, v: float | int) -> str:
        text = self._values.get(v)
        if text is None:
            text = str(floatToGoString(v))  # type: ignore[no-untyped-call]
            if len(self._values) < 4096:
                self._values[v] = text
        return text

    def _render(self, provider: Callable[[], NodeView], busy: Mapping[str, float]) -> Iterator[str]:
        up = _header(UP_NAME, UP_HELP, "gauge")
        try:
            view = provider()
        except Exception:  # the plugin's own metrics must still be served
            log.exception("cannot build the node view for metrics")
            yield up + f"{UP_NAME} 0.0\n"
            return
        yield up + f"{UP_NAME} 1.0\n"
        # Each live allocation's GPUs with their label text, reused from the last build.
        labels: dict[tuple[str, ...], str] = {}
        rows: list[tuple[AllocationView, AllocationGpuView, str]] = []
        for a in view.allocations:
            if a.ended:
                continue
            for g in a.gpus:
                key = tuple(_labels_of(a, g))
                text = self._labels.get(key) or _label_text(ALLOCATION_LABELS, list(key))
                labels[key] = text
                rows.append((a, g, text))
        self._labels = labels
        value = self._value
        for name, doc, kind, get in ALLOCATION_FAMILIES:
            sample = name + "_total" if kind == "counter" else name
            lines = [_header(name, doc, kind)]
            for a, g, text in rows:
                v = get(a, g)
                if v is not None:
                    lines.append(f"{sample}{text} {value(v)}\n")
            yield "".join(lines)
        del rows
        gpu_rows: list[tuple[GpuView, str]] = []
        gpu_labels: dict[tuple[str, ...], str] = {}
        for gpu in view.gpus:
            key = tuple(_gpu_labels_of(gpu, self._hostname))
            text = self._gpu_labels.get(key) or _label_text(GPU_LABELS, list(key))
            gpu_labels[key] = text
            gpu_rows.append((gpu, text))
        self._gpu_labels = gpu_labels
        for name, doc, kind, get_gpu in GPU_FAMILIES:
            sample = name + "_total" if kind == "counter" else name
            lines = [_header(name, doc, kind)]
            for gpu, text in gpu_rows:
                v = get_gpu(gpu)
                if v is not None:
                    lines.append(f"{sample}{text} {value(v)}\n")
            yield "".join(lines)
        lines = [_header(UTILIZATION_NAME, UTILIZATION_HELP, "gauge")]
        for gpu, text in gpu_rows:
            if gpu.uuid in busy:
                lines.append(f"{UTILIZATION_NAME}{text} {value(busy[gpu.uuid])}\n")
        yield "".join(lines)


class PluginRegistry(CollectorRegistry):
    """The plugin's registry: its own instruments, and the node view beside them (not
    registered as a collector, so a scrape can take it from its cache). ``collect`` yields
    both, as a registry holding the node view's collector would."""

    def __init__(
        self,
        node_view: Callable[[], NodeView] | None = None,
        min_interval: float = 0.0,
        forked: Callable[[], Callable[[], NodeView]] | None = None,
        hostname: str = "",
        utilization: Utilization = no_utilization,
    ) -> None:
        super().__init__(auto_describe=True)
        self.node_view_collector = (
            None if node_view is None else NodeViewCollector(node_view, hostname, utilization)
        )
        self.node_view = (
            None
            if node_view is None
            else NodeViewExposition(
                node_view, min_interval, forked=forked, hostname=hostname, utilization=utilization
            )
        )

    def collect(self) -> Iterator[Any]:
        yield from super().collect()
        if self.node_view_collector is not None:
            yield from self.node_view_collector.collect()

    def own(self) -> Collector:
        """The plugin's own instruments only."""
        registry = self

        class _Own(Collector):
            def collect(self) -> Iterator[Any]:
                yield from CollectorRegistry.collect(registry)

        return _Own()


# The kinds of vgpu_grpc_peer_errors_total (kubelet/peers.py tells them apart; docs/metrics.md).
PEER_ERROR_KINDS: Final = (
    "malformed_request",
    "invalid_request",
    "handler_error",
    "stream_error",
    "streams_over_limit",
    "prepare_queue_full",
    "other",
)


@dataclass(frozen=True)
class PluginMetrics:
    """The plugin's own instruments, for the code paths that count."""

    registry: CollectorRegistry
    allocate_seconds: Histogram
    allocate_errors: Counter
    registrations: Counter
    config_reloads: Counter  # label result: ok | error
    health_changes: Counter  # label healthy: true | false
    peer_errors: Counter  # label kind: PEER_ERROR_KINDS

    def peer_error(self, kind: str) -> None:
        self.peer_errors.labels(kind=kind).inc()

    def config_reloaded(self, ok: bool) -> None:
        self.config_reloads.labels(result="ok" if ok else "error").inc()

    def health_changed(self, healthy: bool) -> None:
        self.health_changes.labels(healthy="true" if healthy else "false").inc()


def new_registry(
    view_provider: Callable[[], NodeView] | None = None,
    min_interval: float = 0.0,
    forked: Callable[[], Callable[[], NodeView]] | None = None,
    hostname: str | None = None,
    utilization: Utilization | None = None,
    build: tuple[str, str] | None = None,
) -> PluginMetrics:
    """A fresh registry with the plugin's instruments and, given a provider, the node view
    (rebuilt for a scrape at most once per ``min_interval`` seconds, in a forked child given
    ``forked``: NodeViewExposition). ``hostname`` (default ``node_hostname()``) fills the GPU
    series' ``Hostname``; ``utilization`` (default NVML's, when there is a node view) their
    ``vgpu_gpu_utilization_ratio``; ``build`` (default ``build_ids()``) is ``vgpu_build_info``'s
    (version, shim build id)."""
    # Counters without their _created series: no dashboard or rule uses them, and five extra
    # families only cost the scrape (process-wide, as prometheus_client has it).
    disable_created_metrics()  # type: ignore[no-untyped-call]
    if utilization is None:
        utilization = nvml_utilization if view_provider is not None else no_utilization
    registry = PluginRegistry(
        view_provider,
        min_interval,
        forked,
        node_hostname() if hostname is None else hostname,
        utilization,
    )
    version, shim = build_ids() if build is None else build
    Gauge(
        "vgpu_build_info",
        "1, labelled with the plugin's version and the build id of the shim it ships"
        " (the version Allocate mounts; none: no shim in this package)",
        labelnames=["version", "shim_build_id"],
        registry=registry,
    ).labels(version=version, shim_build_id=shim).set(1)
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
        peer_errors=Counter(
            "vgpu_grpc_peer_errors",
            "errors a peer of the plugin's gRPC sockets caused, by kind (each logged in one"
            " rate-limited line)",
            labelnames=["kind"],
            registry=registry,
        ),
    )
    # Zero series up front, so a rate() over them works before the first event.
    for result in ("ok", "error"):
        metrics.config_reloads.labels(result=result)
    for state in ("true", "false"):
        metrics.health_changes.labels(healthy=state)
    for kind in PEER_ERROR_KINDS:
        metrics.peer_errors.labels(kind=kind)
    return metrics


def build_ids() -> tuple[str, str]:
    """(plugin version, shim build id): the id is the name install-shim gives this package's
    shim (``<version>-<hash>``), ``none`` where the package carries no shim."""
    from vgpu_plugin import __version__
    from vgpu_plugin.node.host import native
    from vgpu_plugin.node.host.install import content_version

    try:
        return __version__, content_version(native.shim_library().read_bytes())
    except (native.NativeArtifactMissing, OSError):
        return __version__, "none"


def nvml_utilization() -> Mapping[str, float]:
    from vgpu_plugin.node.gpu.nvml import nvml_utilization as read

    return read()


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


class ScrapePacer:
    """Keeps serving scrapes to a share of one CPU, so scrapes back to back cannot crowd out
    Allocate on a small node: one scrape is served at a time, and the next starts only once
    ``ratio`` times the CPU the last one cost (its thread's CPU: rendering its head, inflating
    for a client without gzip, writing) has passed since it ended, at most ``max_wait``
    seconds. A waiting scrape sleeps (no GIL, no CPU); Prometheus's scrape timeout (10 s by
    default) is far above what a scrape then waits. A turn is held until its body is sent, so
    a client that stops reading would hold it for good: a scrape that has waited ``max_wait``
    for the turn is served without one (unpaced), and one stalled reader delays the others
    by ``max_wait`` at most. ``ratio`` 0: no pacing."""

    def __init__(
        self,
        ratio: float,
        max_wait: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ratio = ratio
        self.max_wait = max_wait
        self._clock, self._cpu, self._sleep = clock, cpu, sleep
        self._lock = threading.Lock()
        self._next = -math.inf
        self.waited = 0.0  # seconds scrapes slept for their turn (for figures)
        self.unpaced = 0  # scrapes served without a turn (a turn held past max_wait)

    def begin(self) -> float | None:
        """Waits for this scrape's turn; returns the token ``end`` takes (None: no turn came
        within ``max_wait``, and the scrape goes unpaced)."""
        if not self._lock.acquire(timeout=self.max_wait):
            self.unpaced += 1
            return None
        wait = min(self._next - self._clock(), self.max_wait)
        if wait > 0:
            self.waited += wait
            self._sleep(wait)
        return self._cpu()

    def end(self, token: float | None) -> None:
        if token is None:
            return
        cost = self._cpu() - token
        self._next = self._clock() + self.ratio * cost
        self._lock.release()


class _Paced:
    """A response body that ends its scrape's turn when the server closes it (sent, failed or
    cut short: WSGI servers always call ``close``)."""

    def __init__(self, parts: Iterable[bytes], pacer: ScrapePacer, token: float | None) -> None:
        self._parts = parts
        self._pacer = pacer
        self._token: float | None = token

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._parts)

    def close(self) -> None:
        if self._token is not None:
            token, self._token = self._token, None
            self._pacer.end(token)


# A probe: None when the check passes, else why not (one line).
Probe = Callable[[], str | None]


def probes_app(
    probes: Mapping[str, Probe], app: Callable[..., Iterable[bytes]]
) -> Callable[..., Iterable[bytes]]:
    """``app`` with the kubelet's probes in front: each path of ``probes`` answers 200 "ok"
    or 503 and the reason, as plain text; every other path goes to ``app``."""

    def with_probes(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        check = probes.get(environ.get("PATH_INFO", ""))
        if check is None:
            return app(environ, start_response)
        try:
            why = check()
        except Exception as exc:  # a probe that fails is a failed probe, not a 500 page
            why = f"the check failed: {exc!r}"
        body = b"ok\n" if why is None else f"{why}\n".encode()
        status = "200 OK" if why is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    return with_probes


def metrics_app(registry: CollectorRegistry, pace: float = 0.0) -> Callable[..., Iterable[bytes]]:
    """The WSGI app of ``/metrics``. For a PluginRegistry with a node view: the plugin's own
    instruments, then the node view's cached body, as text format 0.0.4 (what Prometheus
    takes whatever it asks first), gzipped for a client that accepts gzip (two gzip members:
    one stream). Anything else, and a request filtering by ``name[]``, goes to
    prometheus_client's own app. ``pace``: the ``ScrapePacer`` ratio (0: none)."""
    fallback = make_wsgi_app(registry)
    node_view = registry.node_view if isinstance(registry, PluginRegistry) else None
    if node_view is None:
        return fallback
    own = registry.own() if isinstance(registry, PluginRegistry) else registry
    pacer = ScrapePacer(pace) if pace > 0 else None

    def body(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        assert node_view is not None
        head = generate_latest(own)
        headers = [("Content-Type", CONTENT_TYPE)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            parts = [gzip.compress(head, 1), node_view.gzipped()]
            headers += [
                ("Content-Encoding", "gzip"),
                ("Content-Length", str(sum(len(x) for x in parts))),
            ]
            start_response("200 OK", headers)
            return parts
        start_response("200 OK", headers)
        return itertools.chain([head], node_view.text_chunks())

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if "name[]" in environ.get("QUERY_STRING", "") or environ.get("PATH_INFO") == (
            "/favicon.ico"
        ):
            return fallback(environ, start_response)  # type: ignore[no-any-return]
        if pacer is None:
            return body(environ, start_response)
        token = pacer.begin()
        try:
            return _Paced(body(environ, start_response), pacer, token)
        except BaseException:
            pacer.end(token)
            raise

    return app


def parse_address(address: str) -> tuple[str, int]:
    """``:9400`` (every interface), ``127.0.0.1:0``, ``[::1]:9400`` -> (host, port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics address {address!r} is not [HOST]:PORT (e.g. :9400)")
    host = host.strip("[]")
    return host or "0.0.0.0", int(port)


def serve_metrics(
    address: str,
    registry: CollectorRegistry,
    pace: float = 0.0,
    probes: Mapping[str, Probe] | None = None,
) -> tuple[MetricsServer, int]:
    """Serve ``registry`` as Prometheus text on ``address``; returns the server and its port
    (the one the OS picked for port 0). ``pace``: see ``metrics_app``; ``probes``: paths
    answered by a check (``probes_app``), such as ``/healthz`` and ``/readyz``."""
    import socket

    host, port = parse_address(address)
    server_class: type[_Server] = _Server
    if ":" in host:

        class _Server6(_Server):
            address_family = socket.AF_INET6

        server_class = _Server6
    httpd = make_server(
        host,
        port,
        probes_app(probes or {}, metrics_app(registry, pace)),
        server_class=server_class,
        handler_class=_QuietHandler,
    )
    server = MetricsServer(httpd)
    return server, server.port
