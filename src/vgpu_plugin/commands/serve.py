"""``vgpu-plugin serve``: the DaemonSet's process, wiring the edges around the backend.

Start-up order matters to the kubelet: everything that can refuse to start (config, NVML,
shim, device-list size) is checked before the socket is served and Register is called, so a
broken node never advertises devices it cannot allocate.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

from prometheus_client import CollectorRegistry

from vgpu_plugin.commands.logs import setup_logging
from vgpu_plugin.commands.serve_dra import DraRunner, split_gpus
from vgpu_plugin.commands.settings import ServeSettings
from vgpu_plugin.core.config import Config, ConfigError, default_config
from vgpu_plugin.core.named_config import CONFIG_LABEL, NamedConfigError
from vgpu_plugin.core.pods import CheckpointEntry, CheckpointError, PodRef
from vgpu_plugin.kubelet import peers
from vgpu_plugin.kubelet.backend import ListTooLargeError
from vgpu_plugin.kubelet.checkpoint import read_checkpoint
from vgpu_plugin.kubelet.plugin import VgpuBackend
from vgpu_plugin.kubelet.podresources import list_assignments
from vgpu_plugin.kubelet.rebuild import rebuild
from vgpu_plugin.kubelet.server import DevicePluginServer
from vgpu_plugin.kubelet.servicer import ServerHooks
from vgpu_plugin.node.gpu.health import HealthChange, HealthTracker
from vgpu_plugin.node.gpu.nvml import (
    HealthWatcher,
    NvmlUnavailable,
    discover,
    nvml_memory_used,
    nvml_session,
    process_utilization,
    running_processes,
)
from vgpu_plugin.node.host.atomicfile import DeferredSync, write_atomically
from vgpu_plugin.node.host.cleanup import (
    Cleaner,
    store_relabeler,
    store_release_marker,
    store_releasing_marker,
)
from vgpu_plugin.node.host.coexist import coexistence_line, find_hami
from vgpu_plugin.node.host.install import ShimNotInstalled, installed_shim_version
from vgpu_plugin.node.ledger.dra_claims import migrate_claims_file, read_prepared_claims
from vgpu_plugin.node.ledger.state import AllocationStore, NotRegularFile
from vgpu_plugin.node.observe import region
from vgpu_plugin.node.observe.escapes import EscapeWatch, run_watch
from vgpu_plugin.node.observe.gputime import GpuTimePublisher, run_publisher
from vgpu_plugin.node.observe.lending import LendingMeter
from vgpu_plugin.node.observe.metrics import (
    MetricsServer,
    PluginMetrics,
    new_registry,
    serve_metrics,
)
from vgpu_plugin.node.observe.nodeview import (
    GpuFacts,
    GuaranteeIndex,
    allocation_gpus,
    allocation_names,
    dra_gpu_facts,
    gpu_facts_from_plan,
    live_processes,
    region_slots,
    staged_view_provider,
)
from vgpu_plugin.node.serving.config_watch import ConfigWatcher, NodeLabelsError, read_node_labels

log = logging.getLogger("vgpu_plugin.commands.serve")

# A scrape rebuilds the node view's metrics at most once a second (and at most ~10 % of one
# CPU's time however often it is scraped): node/observe/metrics.py's NodeViewExposition.
METRICS_MIN_INTERVAL = 1.0
# Serving scrapes takes at most ~1/10 of one CPU, however often the node is scraped.
SCRAPE_PACE = 10.0
# The GIL's switch interval (CPython's default: 5 ms). A thread that comes back from a
# syscall waits up to this long for a CPU-bound thread (a metrics rebuild) to let go of the
# GIL, and an Allocate makes dozens of syscalls: a shorter interval keeps scrapes from adding
# tens of milliseconds to it.
SWITCH_INTERVAL = 0.0005

# glibc's malloc arenas for the whole process (limit_malloc_arenas); mallopt's M_ARENA_MAX.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8

# Exit codes a DaemonSet's operator can tell apart in `kubectl describe`.
EXIT_CONFIG = 2
EXIT_NODE = 3


def config_digest(config: Config) -> str:
    """A short sha256 of the effective config's canonical form (JSON, sorted keys): two
    nodes that log the same digest run the same config, whatever its file's layout."""
    canonical = json.dumps(
        dataclasses.asdict(config), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def start_line(node_name: str, config: Config) -> str:
    """The one line ``serve`` logs first: what runs (version, shim build id, config digest),
    where (node name) and which front ends, so one grep of the node logs tells them apart."""
    from vgpu_plugin.node.observe.metrics import build_ids

    version, shim = build_ids()
    fronts = "device-plugin, dra" if config.dra.enabled else "device-plugin"
    return (
        f"vgpu-plugin {version} (shim {shim}) starting on node {node_name}: "
        f"config sha256 {config_digest(config)}, front ends: {fronts}"
    )


def log_hami_files(host_root: Path, lock_dir: Path, root: Path = Path("/")) -> None:
    """One line where HAMi's files are on the node (node/host/coexist.py): what, and that they
    stay as they are. Never fails the start: it only looks."""
    try:
        line = coexistence_line(find_hami(host_root, lock_dir, root))
    except (OSError, RuntimeError) as exc:  # a permission or a symlink loop: only a look
        log.warning("cannot look for HAMi's files: %s", exc)
        return
    if line is None:
        log.debug("no HAMi files seen")
    else:
        log.info("%s", line)


class StartupError(RuntimeError):
    """The plugin cannot start on this node; the message says what to fix. ``wait``: rather
    than exit, wait to be stopped (NVIDIA's ``failOnInitError: false``)."""

    def __init__(self, message: str, code: int, wait: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.wait = wait


def _with_host_root(config: Config, host_root: str | None) -> Config:
    return config if host_root is None else dataclasses.replace(config, host_root=host_root)


def _load_config(
    settings: ServeSettings, watcher: ConfigWatcher
) -> tuple[Config, Mapping[str, str]]:
    try:
        labels = read_node_labels(settings.node_labels_file)
    except (OSError, NodeLabelsError) as exc:
        raise StartupError(f"node labels file: {exc}", EXIT_CONFIG) from exc
    try:
        path = watcher.selected()
    except NamedConfigError as exc:
        raise StartupError(str(exc), EXIT_CONFIG) from exc
    if path == settings.config and not path.exists():
        log.warning("config %s does not exist: running with the defaults", settings.config)
        return default_config(), labels
    try:
        loaded = watcher.load_initial()
    except NamedConfigError as exc:
        raise StartupError(str(exc), EXIT_CONFIG) from exc
    except (ConfigError, NodeLabelsError, OSError) as exc:
        raise StartupError(f"config {path} is invalid: {exc}", EXIT_CONFIG) from exc
    if path != settings.config:
        log.info("node label %s picks config %s", CONFIG_LABEL, path)
    return loaded


class Plugin:
    """Everything ``serve`` runs, started and stopped as one."""

    def __init__(
        self, settings: ServeSettings, shim_version: Callable[[str], str] | None = None
    ) -> None:
        self.settings = settings
        self._shim_version = shim_version or _installed_shim_version
        self._stop = threading.Event()
        self._server: DevicePluginServer | None = None
        self._health: HealthWatcher | None = None
        self._watcher = ConfigWatcher(
            settings.config,
            settings.node_labels_file,
            self._on_config,
            on_error=self._reload_failed,
        )
        self._tracker: HealthTracker | None = None
        self.backend: VgpuBackend | None = None
        self._metrics: PluginMetrics | None = None
        self._metrics_server: MetricsServer | None = None
        self._cleaner: Cleaner | None = None
        self._dra: DraRunner | None = None
        self._syncer: DeferredSync | None = None
        self._gputime: threading.Thread | None = None
        self._gputime_stop = threading.Event()
        self._escapes: EscapeWatch | None = None
        self._escapes_thread: threading.Thread | None = None
        self._escapes_stop = threading.Event()

    def start(self) -> None:
        s = self.settings
        config, labels = _load_config(s, self._watcher)
        config = _with_host_root(config, s.host_root)
        log.info("%s", start_line(s.node_name, config))
        log_hami_files(Path(config.host_root), Path(s.lock_dir))
        for line in config.ignored_flags:
            log.warning("NVIDIA flag %s", line)
        try:
            with nvml_session():
                gpus = discover()
        except NvmlUnavailable as exc:
            raise StartupError(
                f"{exc}: is the NVIDIA driver loaded on this node?",
                EXIT_NODE,
                wait=not config.fail_on_init_error,
            ) from exc
        if not gpus:
            log.warning("NVML reports no GPU on this node: advertising no devices")
        version = self._shim_version(config.host_root)
        _make_shared_dir(Path(s.lock_dir))
        store = _open_store(s.state_dir)
        settle_heap(collect=True)  # the ledger's records, before any call can be waiting
        gpus, dra_gpus = split_gpus(config, gpus)
        # Allocate's and prepare's writes are synced after they answer; what a power loss took
        # is rebuilt at the first start of a boot (docs/contracts.md#durability).
        syncer = self._syncer = DeferredSync(name="vgpu-sync")
        syncer.register(store.flush)
        syncer.start()
        first_start = self._first_start_of_boot()
        if config.dra.enabled:
            try:
                self._dra = DraRunner(
                    config, dra_gpus, s.node_name, store, version, s.lock_dir,
                    s.cdi_spec_dir, syncer,
                )  # fmt: skip
                self._dra.start(rebuild=first_start)
            except (RuntimeError, OSError) as exc:
                raise StartupError(f"DRA driver: {exc}", EXIT_NODE) from exc
        try:
            self.backend = VgpuBackend(
                gpus, config, s.node_name, labels, store, version, s.lock_dir,
                cdi_spec_dir=s.cdi_spec_dir, syncer=syncer,
            )  # fmt: skip
        except ListTooLargeError as exc:
            raise StartupError(str(exc), EXIT_CONFIG) from exc
        if first_start and self._rebuild_from_checkpoint():
            self._mark_boot()
        for g in self.backend.plan.gpus:
            log.info(
                "GPU %d %s %s: %d slices of %d MiB, compute %d%%",
                g.gpu.index,
                g.gpu.uuid,
                g.gpu.name,
                len(g.slices),
                g.slice_memory_mib,
                g.slice_compute_percent,
            )
        log.info("%d allocation records on file in %s", len(store.all()), s.state_dir)
        tracker = self._tracker = HealthTracker(
            [g.uuid for g in gpus] + [g.uuid for g in dra_gpus],
            ignored_xids=frozenset(config.health.ignored_xids),
            recovery_seconds=config.health.recovery_seconds,
        )
        self._start_escapes(store)
        self._start_metrics(store)
        self._start_gputime(store)
        watched = [g.uuid for g in gpus] + [g.uuid for g in dra_gpus]
        self._health = HealthWatcher(tracker, watched, self._on_health)
        self._health.start()
        self._server = self._new_server(config.resource_name)
        self._server.start()
        self._watcher.start()
        self._cleaner = new_cleaner(
            store,
            Path(config.host_root),
            lambda: list_assignments(s.pod_resources_socket, self._resource_name(), timeout=2.0),
            grace=s.cleanup_grace,
            cdi_spec_dir=Path(s.cdi_spec_dir),
            checkpoint=lambda: read_checkpoint(s.device_plugin_dir),
        )
        self._cleaner.start(interval=min(10.0, max(0.5, s.cleanup_grace / 4)))
        settle_heap(collect=False)  # calls may be in flight: no collection now

    def _first_start_of_boot(self) -> bool:
        """Whether this is the first start since the node booted (the state dir's ``boot_id``
        names another boot, or none): only then can a power loss have taken writes, and only
        then are they rebuilt. Within one boot nothing was lost, and what is missing was
        removed on purpose (the kubelet's checkpoint may still name allocations the cleanup
        removed: the kubelet drops a pod's entries only at its next write), which must not
        come back. True where the kernel does not say its boot."""
        boot = _boot_id()
        try:
            last = (self.settings.state_dir / BOOT_ID_FILE_NAME).read_text().strip()
        except OSError:
            last = None
        return boot is None or last != boot

    def _mark_boot(self) -> None:
        """Records this boot as the last start's: its rebuilds are done."""
        boot = _boot_id()
        if boot is None:
            return
        marker = self.settings.state_dir / BOOT_ID_FILE_NAME
        try:
            write_atomically(marker, f"{boot}\n".encode(), 0o644)
        except OSError as exc:
            log.warning("cannot write %s: %s (the next start checks again)", marker, exc)

    def _rebuild_from_checkpoint(self) -> bool:
        """Before the kubelet can start a container again, at the first start of a boot:
        what a power loss took of an allocation it keeps in its checkpoint is rebuilt
        (``kubelet/rebuild.py``). False when the checkpoint cannot be read (the next start
        checks again)."""
        assert self.backend is not None
        try:
            entries = read_checkpoint(self.settings.device_plugin_dir)
        except CheckpointError as exc:
            log.warning("cannot check the allocations against the kubelet's checkpoint: %s", exc)
            return False
        if entries:
            report = rebuild(self.backend, entries)
            log.info(
                "first start since the node booted: of the allocations in the kubelet's "
                "checkpoint %d intact, %d rebuilt, %d not rebuildable",
                report.intact,
                len(report.rebuilt),
                len(report.refused),
            )
        return True

    def _resource_name(self) -> str:
        assert self.backend is not None
        return self.backend.config.resource_name

    def _host_root(self) -> str:
        assert self.backend is not None
        return self.backend.config.host_root

    def _start_gputime(self, store: AllocationStore) -> None:
        """The guaranteed containers' driver-measured GPU time, published to each every
        ``--gputime-interval`` (node/observe/gputime.py; docs/security.md)."""
        interval = self.settings.gputime_interval
        if interval <= 0:
            log.info("--gputime-interval 0: guaranteed containers' GPU time is not measured")
            return
        host_root = Path(self._host_root())
        state_dir = self.settings.state_dir

        index = GuaranteeIndex(store)  # costs what changed since the last round

        def allocations() -> dict[str, set[str]]:
            return index.current(read_prepared_claims(state_dir)[0])

        def loop() -> None:
            try:
                with nvml_session():
                    publisher = GpuTimePublisher(host_root, process_utilization)
                    run_publisher(publisher, allocations, self._gputime_stop, interval)
            except NvmlUnavailable as exc:
                log.warning("guaranteed containers' GPU time is not measured: %s", exc)

        self._gputime = threading.Thread(target=loop, name="vgpu-gputime", daemon=True)
        self._gputime.start()

    def _start_escapes(self, store: AllocationStore) -> None:
        """Every escapes.INTERVAL, the containers' processes on their GPUs without the shim:
        logged, and shown by the metrics (node/observe/escapes.py; docs/security.md)."""
        host_root = Path(self._host_root())
        state_dir = self.settings.state_dir
        watch = self._escapes = EscapeWatch(host_root, running_processes, region_slots(host_root))

        def allocations() -> tuple[dict[str, set[str]], dict[str, str]]:
            records, claims = store.all(), read_prepared_claims(state_dir)[0]
            return allocation_gpus(records, claims), allocation_names(records, claims)

        self._escapes_thread = threading.Thread(
            target=run_watch,
            args=(watch, allocations, self._escapes_stop),
            name="vgpu-escapes",
            daemon=True,
        )
        self._escapes_thread.start()

    def _start_metrics(self, store: AllocationStore) -> None:
        backend = self.backend
        assert backend is not None
        dra = self._dra

        def gpus() -> list[GpuFacts]:
            used = nvml_memory_used()
            facts = gpu_facts_from_plan(backend.plan, backend.unhealthy, used)
            if dra is not None:
                facts += dra_gpu_facts(dra.driver.gpus, backend.unhealthy, used)
            return facts

        # The store's own records (one copy in memory, shared with Allocate): it catches up
        # with other plugin processes' appends as a reader would.
        host_root = Path(backend.config.host_root)
        prepare = staged_view_provider(
            host_root,
            store.all,
            gpus,
            claims=lambda: read_prepared_claims(self.settings.state_dir)[0],
            meter=LendingMeter(),
            escapes=lambda: self._escapes.latest if self._escapes is not None else [],
        )
        self._metrics = new_registry(
            lambda: prepare()(),
            min_interval=METRICS_MIN_INTERVAL,
            forked=prepare,
            hostname=self.settings.node_name,  # dcgm-exporter's Hostname: --node-name
        )
        peers.PEER_ERRORS.add_listener(self._metrics.peer_error)
        with contextlib.suppress(Exception):  # a region that cannot be read is reported as such
            region.bind()  # once here, not again in each forked build
        try:
            self._metrics_server, port = serve_metrics(
                self.settings.metrics_address,
                self._metrics.registry,
                pace=SCRAPE_PACE,
                probes={"/healthz": lambda: self.alive(store), "/readyz": self.ready},
            )
        except (OSError, ValueError) as exc:
            raise StartupError(
                f"cannot serve metrics on {self.settings.metrics_address}: {exc}", EXIT_NODE
            ) from exc
        log.info("metrics on %s (port %d)", self.settings.metrics_address, port)

    def alive(self, store: AllocationStore) -> str | None:
        """The liveness probe (``/healthz``): None while Allocate's store can be taken; a
        wedged writer (or a process too busy to answer at all) fails it, and the kubelet
        restarts the container."""
        if not store.responsive(LIVENESS_LOCK_TIMEOUT):
            return f"the allocation store's lock is held for over {LIVENESS_LOCK_TIMEOUT} s"
        return None

    def ready(self) -> str | None:
        """The readiness probe (``/readyz``): None once the device plugin (and the DRA driver,
        where enabled) is registered with the kubelet; between a kubelet restart and the
        registration again, not ready."""
        if self._server is None or not self._server.registered:
            return "the device plugin is not registered with the kubelet"
        if self._dra is not None and not self._dra.server.registered:
            return "the DRA driver is not registered with the kubelet"
        return None

    def _new_server(self, resource_name: str) -> DevicePluginServer:
        assert self.backend is not None
        metrics = self._metrics

        def on_register(endpoint: str) -> None:
            if metrics is not None:
                metrics.registrations.inc()

        def on_rpc(method: str, seconds: float, code: str | None) -> None:
            if metrics is not None and method == "Allocate":
                metrics.allocate_seconds.observe(seconds)
                if code is not None:
                    metrics.allocate_errors.inc()

        return DevicePluginServer(
            self.backend,
            resource_name,
            self.settings.device_plugin_dir,
            hooks=ServerHooks(on_register=on_register, on_rpc=on_rpc),
        )

    def _on_health(self, changes: list[HealthChange]) -> None:
        assert self.backend is not None
        self.backend.apply_health(changes)
        if self._dra is not None:
            for c in changes:
                self._dra.apply_health(c.uuid, c.healthy)
        if self._metrics is not None:
            for c in changes:
                self._metrics.health_changed(c.healthy)

    def _reload_failed(self, _: Exception) -> None:
        if self._metrics is not None:
            self._metrics.config_reloaded(False)

    def _on_config(self, config: Config, labels: Mapping[str, str]) -> None:
        backend = self.backend
        if backend is None:
            return
        config = _with_host_root(config, self.settings.host_root)
        old_resource = backend.config.resource_name
        if config.host_root != backend.config.host_root:
            # Running containers mount the old root; new ones would get a root where no shim
            # was installed (the init container installs it at start).
            log.error(
                "config refused, keeping the running one: hostRoot %s -> %s needs a restart "
                "of the plugin (its init container installs the shim there)",
                backend.config.host_root,
                config.host_root,
            )
            self._reload_failed(ValueError("hostRoot changed"))
            return
        try:
            backend.apply_config(config, labels)
        except (ValueError, ListTooLargeError) as exc:
            log.error("config refused, keeping the running one: %s", exc)
            self._reload_failed(exc)
            return
        if self._metrics is not None:
            self._metrics.config_reloaded(True)
        if self._dra is not None:
            self._dra.apply_config(config)
        if self._tracker is not None:
            # Health settings apply from the next event on.
            self._tracker.ignored_xids = frozenset(config.health.ignored_xids)
            self._tracker.recovery_seconds = config.health.recovery_seconds
        if config.resource_name != old_resource and self._server is not None:
            # The kubelet knows a plugin by its resource name: serve and register anew.
            log.info(
                "resource name %s -> %s: registering again", old_resource, config.resource_name
            )
            self._server.stop(withdraw=True)  # the old name leaves no capacity behind
            self._server = self._new_server(config.resource_name)
            self._server.start()

    def wait(self) -> None:
        self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._watcher.stop()
        if self._cleaner is not None:
            self._cleaner.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self._metrics is not None:
            peers.PEER_ERRORS.remove_listener(self._metrics.peer_error)
        if self._server is not None:
            # Stopped for good (uninstall, node drain, upgrade): the node's capacity goes
            # to 0 until a plugin registers again, never stays stale.
            self._server.stop(withdraw=True)
        if self._health is not None:
            self._health.stop()
        if self._dra is not None:
            self._dra.stop()
        self._gputime_stop.set()
        if self._gputime is not None:
            self._gputime.join(timeout=10)  # its records removed: the shims pace as before
        self._escapes_stop.set()
        if self._escapes_thread is not None:
            self._escapes_thread.join(timeout=10)
        if self._syncer is not None:
            self._syncer.stop()  # the last Allocates' writes, durable before we exit
        log.info("stopped")


LIVENESS_LOCK_TIMEOUT = 3.0  # s; under the chart's probe timeout (5 s)
BOOT_ID_FILE_NAME = "boot_id"  # in the state dir: the boot the last start ran in


def _boot_id() -> str | None:
    """This boot's id (changes at every boot); None where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Caps glibc's malloc arenas (as ``MALLOC_ARENA_MAX`` would), before any thread starts.
    glibc gives each new thread that contends for malloc an arena of its own, up to 8 per
    CPU, and each keeps the memory freed into it: with gRPC's and the metrics server's
    threads that was ~8 MiB of the plugin's RSS at 7,000 records, for no speed that matters
    here. False where the C library has no ``mallopt`` (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_ARENA_MAX, arenas) == 1)
    except (OSError, AttributeError):
        return False


def settle_heap(collect: bool) -> None:
    """Moves every object alive now out of the cycle collector's reach (``gc.freeze``): what
    start-up built (the ledger's records, the plan, modules) lives as long as the process, and
    a full collection walked it all, ~25-50 ms with 2,000 records, on whatever thread's call
    was running. Frozen objects are still freed by reference counting. ``collect``: first
    collect what start-up left (only before any call can be waiting on the GIL)."""
    if collect:
        gc.collect()
    gc.freeze()


def _make_shared_dir(path: Path) -> None:
    """The node-wide lock dir every container mounts: it must exist before the first one
    starts (a bind mount of a missing host path fails the container) and be usable by any uid."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)
    except OSError as exc:
        raise StartupError(f"cannot create the lock dir {path}: {exc}", EXIT_NODE) from exc


def new_cleaner(
    store: AllocationStore,
    host_root: Path,
    assignments: Callable[[], Mapping[str, PodRef]],
    grace: float,
    cdi_spec_dir: Path,
    checkpoint: Callable[[], Sequence[CheckpointEntry] | None] | None = None,
    clock: Callable[[], float] = time.time,
) -> Cleaner:
    """The cleanup over the one ledger (both front ends' records), as ``serve`` runs it."""
    return Cleaner(
        host_root,
        store.all,
        store.remove,
        assignments,
        relabel=store_relabeler(store),
        still_running=lambda aid: live_processes(host_root, aid) > 0,
        grace=grace,
        clock=clock,
        cdi_spec_dir=cdi_spec_dir,
        checkpoint=checkpoint,
        mark_released=store_release_marker(store),
        mark_releasing=store_releasing_marker(store),
    )


def _open_store(state_dir: Path) -> AllocationStore:
    """The allocation records, in a dir that must be writable now: finding out at the first
    Allocate would fail a pod instead of the plugin's start. The DRA claims file of a plugin
    before the one ledger is imported into it here, before anything reads the ledger."""
    try:
        store = AllocationStore(state_dir)
        probe = state_dir / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        migrate_claims_file(store)
    except NotRegularFile as exc:
        raise StartupError(f"state file {exc}", EXIT_NODE) from exc
    except OSError as exc:
        # Name the file where the error names one (a journal the kernel refused), not the dir.
        what = exc.strerror or str(exc)
        if exc.filename is not None and exc.filename != str(state_dir):
            what = f"{exc.filename}: {what}"
        raise StartupError(
            f"state dir {state_dir}: {what} (it must be a writable directory)", EXIT_NODE
        ) from exc
    return store


def _serve_waiting_probes(settings: ServeSettings, why: str) -> MetricsServer | None:
    """``/healthz`` (alive) and ``/readyz`` (not ready: ``why``) while serve waits for NVML,
    so the chart's liveness probe does not restart a plugin told to wait."""
    try:
        server, _ = serve_metrics(
            settings.metrics_address,
            CollectorRegistry(),
            probes={"/healthz": lambda: None, "/readyz": lambda: f"not serving: {why}"},
        )
    except (OSError, ValueError) as exc:
        log.warning("cannot serve the probes on %s: %s", settings.metrics_address, exc)
        return None
    log.info("probes on %s (port %d) while waiting", settings.metrics_address, server.port)
    return server


def _installed_shim_version(host_root: str) -> str:
    try:
        return installed_shim_version(Path(host_root))
    except ShimNotInstalled as exc:
        raise StartupError(str(exc), EXIT_NODE) from exc


def run(settings: ServeSettings) -> int:
    try:
        setup_logging(settings.log_format, settings.log_level)
    except ValueError as exc:
        print(f"vgpu-plugin serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sys.setswitchinterval(SWITCH_INTERVAL)
    limit_malloc_arenas()
    plugin = Plugin(settings)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        plugin.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        plugin.start()
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        plugin.stop()
        if exc.wait:
            # NVIDIA's failOnInitError: false: stay up, advertising nothing, until stopped;
            # alive to the kubelet's liveness probe, never ready.
            log.info("failOnInitError is false: waiting, advertising nothing, until stopped")
            probes = _serve_waiting_probes(settings, str(exc))
            plugin.wait()
            if probes is not None:
                probes.shutdown()
            return 0
        return exc.code
    plugin.wait()
    plugin.stop()
    return 0
