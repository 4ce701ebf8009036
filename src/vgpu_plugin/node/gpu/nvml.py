"""NVML edge: discovery of the node's GPUs and the health-event loop (pynvml).

Everything NVML-specific stays here; the decisions (what is healthy, what to advertise) live in
``health.py`` and ``core/``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pynvml

from vgpu_plugin.core.devices import PhysicalGpu
from vgpu_plugin.core.dra import DeviceFacts
from vgpu_plugin.node.gpu.facts import GpuFacts
from vgpu_plugin.node.gpu.health import HealthChange, HealthTracker

log = logging.getLogger(__name__)

EVENT_WAIT_MS = 500


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised (no driver, no GPU): the message says what NVML said."""


@contextmanager
def nvml_session() -> Iterator[None]:
    """nvmlInit/nvmlShutdown around a block; NVML counts nested sessions itself."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML init failed: {exc}") from exc
    try:
        yield
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:  # shutdown problems must not mask the block's result
            log.debug("nvmlShutdown: %s", exc)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _numa_node(handle: Any) -> int | None:
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except (pynvml.NVMLError, AttributeError):
        return None
    return node if node >= 0 else None


def discover() -> list[PhysicalGpu]:
    """Every GPU NVML sees, in index order. Call inside ``nvml_session()``."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gpus.append(
            PhysicalGpu(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                numa_node=_numa_node(handle),
            )
        )
    return gpus


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class HealthWatcher:
    """Waits on NVML XID events and probes each GPU; reports changes to ``on_change``.

    Runs in its own thread inside an NVML session. A probe is a cheap query on each GPU every
    ``probe_interval`` seconds: a lost GPU fails it, a recovered one answers again.
    """

    def __init__(
        self,
        tracker: HealthTracker,
        uuids: list[str],
        on_change: Callable[[list[HealthChange]], None],
        probe_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracker = tracker
        self._uuids = uuids
        self._on_change = on_change
        self._probe_interval = probe_interval
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with nvml_session():
                self._loop()
        except NvmlUnavailable as exc:
            log.error("health checks stopped: %s", exc)
        except Exception:  # a bug here must not kill the plugin silently
            log.exception("health watcher crashed")

    def _handles(self) -> dict[str, Any]:
        handles = {}
        for uuid in self._uuids:
            try:
                handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError as exc:
                log.warning("GPU %s: no NVML handle (%s); it will be probed again", uuid, exc)
        return handles

    def _register(self, handles: dict[str, Any]) -> Any:
        event_set = pynvml.nvmlEventSetCreate()
        for uuid, handle in handles.items():
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, event_set
                )
            except pynvml.NVMLError as exc:
                log.warning("GPU %s: XID events unavailable (%s); probes only", uuid, exc)
        return event_set

    def _loop(self) -> None:
        handles = self._handles()
        by_address = {_address(h): u for u, h in handles.items()}
        event_set = self._register(handles)
        next_probe = 0.0
        try:
            while not self._stop.is_set():
                changes = []
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, EVENT_WAIT_MS)
                    uuid = by_address.get(_address(data.device))
                    if uuid is not None and data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                        changes.append(self._tracker.xid(uuid, int(data.eventData), self._clock()))
                except pynvml.NVMLError_Timeout:
                    pass
                except pynvml.NVMLError as exc:
                    # A lost GPU can end the wait with an error: the probes below tell which.
                    log.debug("event wait: %s", exc)
                    self._stop.wait(0.1)
                now = self._clock()
                if now >= next_probe:
                    next_probe = now + self._probe_interval
                    changes.extend(self._probe(handles, now))
                real = [c for c in changes if c is not None]
                if real:
                    self._on_change(real)
        finally:
            try:
                pynvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)

    def _probe(self, handles: dict[str, Any], now: float) -> list[HealthChange | None]:
        out: list[HealthChange | None] = []
        for uuid in self._uuids:
            handle = handles.get(uuid)
            try:
                if handle is None:
                    handle = handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError as exc:
                log.debug("probe of %s failed: %s", uuid, exc)
                out.append(self._tracker.lost(uuid, now))
            else:
                if not self._tracker.healthy(uuid):
                    action = _recovery_action(handle)
                    if action is not None:
                        self._tracker.recovery_action(uuid, action)
                out.append(self._tracker.probe_ok(uuid, now))
        return out


def _recovery_action(handle: Any) -> int | None:
    """NVML's recovery action for the GPU (R550+ drivers), None where it is not reported."""
    try:
        field = pynvml.nvmlDeviceGetFieldValues(
            handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
        )[0]
    except (pynvml.NVMLError, AttributeError, IndexError):
        return None
    if field.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    return int(field.value.uiVal)


def nvml_facts() -> list[GpuFacts]:
    """Every GPU NVML sees, with its used memory. Raises NvmlUnavailable."""
    out = []
    with nvml_session():
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            try:
                name = _text(pynvml.nvmlDeviceGetName(handle))
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError:  # a GPU that has fallen off answers nothing else
                out.append(GpuFacts(uuid, index, healthy=False))
                continue
            out.append(GpuFacts(uuid, index, name, int(memory.total), None, int(memory.used), True))
    return out


def nvml_memory_used() -> dict[str, int]:
    """NVML's used memory per GPU UUID, for the plugin's metrics at each scrape; empty when
    NVML does not answer (the scrape goes on without these figures)."""
    try:
        facts = nvml_facts()
    except (NvmlUnavailable, pynvml.NVMLError) as exc:
        log.debug("NVML used memory unavailable: %s", exc)
        return {}
    return {f.uuid: f.memory_used_nvml for f in facts if f.memory_used_nvml is not None}


def nvml_utilization() -> dict[str, float]:
    """NVML's GPU utilisation per GPU UUID as a ratio (0-1), for the plugin's metrics at each
    scrape; a GPU that does not answer is left out, and all are when NVML does not."""
    out: dict[str, float] = {}
    try:
        with nvml_session():
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                    out[uuid] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
                except pynvml.NVMLError:
                    continue
    except (NvmlUnavailable, pynvml.NVMLError) as exc:
        log.debug("NVML utilisation unavailable: %s", exc)
    return out


def process_utilization(uuid: str, since_us: int) -> list[tuple[int, int, int]]:
    """(pid, smUtil percent, timeStamp) of each sample NVML holds for GPU ``uuid`` newer than
    ``since_us`` (CPU microseconds, as the timestamps): the processes whose kernels ran since
    then, node pids. A real driver stamps each sample with the end of the period it covers,
    which is why the stamps are kept. Call inside ``nvml_session()``; no process ran: empty."""
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except pynvml.NVMLError_NotFound:
        return []
    return [(int(s.pid), int(s.smUtil), int(s.timeStamp)) for s in samples]


def running_processes() -> dict[str, list[tuple[int, int]]]:
    """Each GPU's running compute processes, by UUID: (node pid, bytes it holds there; 0 where
    the driver does not say), in a session of its own. A GPU that does not answer is left
    out; raises NvmlUnavailable when NVML cannot be had."""
    out: dict[str, list[tuple[int, int]]] = {}
    with nvml_session():
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except pynvml.NVMLError:
                continue
            out[uuid] = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
    return out


def memory_info(index: int = 0) -> tuple[int, int]:
    """(total, used) bytes of the GPU NVML numbers ``index``, in a session of its own."""
    with nvml_session():
        mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return int(mem.total), int(mem.used)


def device_facts() -> dict[str, DeviceFacts]:
    """Each GPU's compute capability and the driver's version, by UUID, for the DRA driver's
    ResourceSlice attributes; what NVML cannot say is left empty. Raises NvmlUnavailable."""
    out: dict[str, DeviceFacts] = {}
    with nvml_session():
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = ""
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                cc = f"{int(major)}.{int(minor)}"
            except pynvml.NVMLError:
                cc = ""
            out[uuid] = DeviceFacts(cc, driver)
    return out
