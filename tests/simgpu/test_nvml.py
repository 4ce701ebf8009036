"""The simulated libnvidia-ml.so.1 under the real pynvml and real C NVML programs.

pynvml runs in a child process on the node's environment (library path and state dir), driven
line by line from the test, so faults can be injected while it waits. Other GPU processes are
stood in for by tests/native/nvml_gpu_process, which uses the node through libsimgpu.
"""

from __future__ import annotations

import itertools
import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import native_build
import pytest
from conftest import make_node

from vgpu_plugin.sim.simgpu import GpuSpec, Node

MIB = 1 << 20
GIB = 1 << 30

# The child: runs each request (a JSON-encoded code string) in one namespace and answers with
# the value of `out`, made JSON-able, or the name of the NVML error it raised.
_SERVER = r"""
import ctypes, json, sys
import pynvml as N

def plain(v):
    if isinstance(v, ctypes.Structure):
        return {f[0]: plain(getattr(v, f[0])) for f in v._fields_}
    if isinstance(v, (list, tuple)) or isinstance(v, ctypes.Array):
        return [plain(x) for x in v]
    if isinstance(v, bytes):
        return v.decode()
    if hasattr(v, "__dict__") and not isinstance(v, type):
        return {k: plain(x) for k, x in vars(v).items()}
    return v

def index_of(handle):
    return N.nvmlDeviceGetIndex(handle)

ns = {"N": N, "index_of": index_of}
for line in sys.stdin:
    ns["out"] = None
    try:
        exec(json.loads(line), ns)
        reply = {"ok": plain(ns["out"])}
    except N.NVMLError as exc:
        reply = {"error": type(exc).__name__}
    print(json.dumps(reply), flush=True)
"""


class NvmlError(Exception):
    """pynvml raised in the child; the message is the exception class, e.g. NVMLError_Timeout."""


class Pynvml:
    """A child process running pynvml against a node."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(env),
        )

    def send(self, code: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 20.0) -> Any:
        assert self.proc.stdout is not None
        # A selector, not select(): the test process may hold descriptors past FD_SETSIZE.
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"pynvml child gave no answer (exit code {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise NvmlError(reply["error"])
        return reply["ok"]

    def __call__(self, code: str) -> Any:
        self.send(code)
        return self.result()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@contextmanager
def pynvml_on(env: Mapping[str, str], init: bool = True) -> Iterator[Pynvml]:
    child = Pynvml(env)
    try:
        if init:
            child("N.nvmlInit()")
        yield child
    finally:
        child.close()


def env_with(node: Node, **extra: str) -> dict[str, str]:
    env = node.env()
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


@contextmanager
def gpu_process(native_bin: Path, node: Node, *steps: str) -> Iterator[subprocess.Popen[str]]:
    """tests/native/nvml_gpu_process holding what `steps` set up, until the block ends."""
    proc = subprocess.Popen(
        [str(native_bin / "nvml_gpu_process"), *steps],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env_with(node),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n", f"nvml_gpu_process {steps} failed"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


SECOND = 1_000_000_000  # ns


def busy_span(proc: subprocess.Popen[str]) -> tuple[int, int]:
    """The span a busy step of nvml_gpu_process put on the timeline, on simgpu's clock (ns)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("busy "), f"nvml_gpu_process said {line!r}, not its busy span"
    _, _gpu, start, end = line.split()
    return int(start), int(end)


def sleep_until(t_ns: int) -> None:
    """Sleep until simgpu's clock (CLOCK_MONOTONIC, which time.monotonic_ns reads) passes t_ns:
    the NVML windows are placed on the timeline by the clock, not by how long a sleep took."""
    while (left := t_ns - time.monotonic_ns()) >= 0:
        time.sleep(left / SECOND + 0.001)


def answered_by(end_ns: int, what: str) -> None:
    """A query meant to fall inside a busy span did: else say so, rather than fail on a
    figure. The spans leave seconds for one query; only a host that starved this test for
    that long misses it."""
    late = time.monotonic_ns() - end_ns
    assert late <= 0, f"{what} answered {late / SECOND:.1f} s after the busy span: a starved host"


DEVICES = """
out = []
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    pci = N.nvmlDeviceGetPciInfo(h)
    out.append({
        "index": N.nvmlDeviceGetIndex(h),
        "name": N.nvmlDeviceGetName(h),
        "uuid": N.nvmlDeviceGetUUID(h),
        "serial": N.nvmlDeviceGetSerial(h),
        "minor": N.nvmlDeviceGetMinorNumber(h),
        "numa": N.nvmlDeviceGetNumaNodeId(h),
        "total": N.nvmlDeviceGetMemoryInfo(h).total,
        "bus_id": pci.busId,
        "bus_id_legacy": pci.busIdLegacy,
        "pci_device_id": pci.pciDeviceId,
        "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
        "arch": N.nvmlDeviceGetArchitecture(h),
        "brand": N.nvmlDeviceGetBrand(h),
        "multi_gpu_board": N.nvmlDeviceGetMultiGpuBoard(h),
        "cpus": list(N.nvmlDeviceGetCpuAffinity(h, 4)),
        "by_uuid": index_of(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(h))),
        "by_bus_id": index_of(N.nvmlDeviceGetHandleByPciBusId(pci.busId)),
    })
"""


def test_pynvml_lists_the_configured_gpus(native_tree: Path, tmp_path: Path) -> None:
    specs = [
        GpuSpec(
            memory=16 * GIB, numa_node=0, serial="1654321000017", pci_bus_id="00000000:17:00.0"
        ),
        GpuSpec(
            name="NVIDIA A100-SXM4-40GB",
            memory=40 * GIB,
            numa_node=1,
            uuid="GPU-0b2c4d6e-8f00-4a1b-9c2d-3e4f5a6b7c8d",
            serial="1654321000042",
            pci_bus_id="00000000:C3:00.0",
            cc=(8, 0),
            pci_device_id=0x20B010DE,
        ),
    ]
    node = make_node(tmp_path, specs)
    with pynvml_on(env_with(node)) as nvml:
        devices = nvml(DEVICES)
        versions = nvml(
            "out = [N.nvmlSystemGetDriverVersion(), N.nvmlSystemGetNVMLVersion(),"
            " N.nvmlSystemGetCudaDriverVersion(), N.nvmlSystemGetCudaDriverVersion_v2()]"
        )
    configured = node.gpus()
    assert [d["uuid"] for d in devices] == [g.uuid for g in configured]
    for d, g, spec in zip(devices, configured, specs, strict=True):
        assert d["index"] == d["minor"] == g.index
        assert (d["name"], d["serial"], d["total"]) == (g.name, spec.serial, spec.memory)
        assert (d["numa"], d["cc"], d["pci_device_id"]) == (
            spec.numa_node,
            list(spec.cc),
            spec.pci_device_id,
        )
        assert d["bus_id"] == spec.pci_bus_id
        assert d["bus_id_legacy"] == spec.pci_bus_id[4:]  # NVML 1's 4-digit domain
        assert d["by_uuid"] == d["by_bus_id"] == g.index
        assert d["brand"] == 14 and d["multi_gpu_board"] == 0  # NVML_BRAND_NVIDIA
        assert any(d["cpus"]), "a GPU must be near some CPU"
    assert [d["arch"] for d in devices] == [9, 7]  # NVML_DEVICE_ARCH_HOPPER, _AMPERE
    driver, nvml_version, cuda, cuda_v2 = versions
    assert nvml_version == f"{cuda // 1000}.{driver}" and cuda == cuda_v2 and cuda >= 12000


def test_without_a_node_the_driver_is_not_loaded(native_tree: Path, tmp_path: Path) -> None:
    node = Node(tmp_path / "nothing-here")
    for env in (env_with(node), {k: v for k, v in env_with(node).items() if k != "SIMGPU_STATE"}):
        env["SIMGPU_QUIET"] = "1"
        with pynvml_on(env, init=False) as nvml, pytest.raises(NvmlError, match="DriverNotLoaded"):
            nvml("N.nvmlInit()")


def test_xid_reaches_every_event_set_once(simgpu_node: Node) -> None:
    simgpu_node.inject_xid(1, 13)  # before registration: never delivered
    with pynvml_on(env_with(simgpu_node)) as nvml:
        nvml(
            "sets = [N.nvmlEventSetCreate(), N.nvmlEventSetCreate()]\n"
            "for s in sets:\n"
            "    for i in range(N.nvmlDeviceGetCount()):\n"
            "        h = N.nvmlDeviceGetHandleByIndex(i)\n"
            "        xid = N.nvmlEventTypeXidCriticalError\n"
            "        assert N.nvmlDeviceGetSupportedEventTypes(h) & xid\n"
            "        N.nvmlDeviceRegisterEvents(h, xid, s)\n"
        )
        wait = (
            "d = N.nvmlEventSetWait_v2(sets[{}], {})\n"
            "out = [index_of(d.device), d.eventType, d.eventData]"
        )
        with pytest.raises(NvmlError, match="NVMLError_Timeout"):
            nvml(wait.format(0, 50))

        # The event wakes the wait: its 60 s timeout is far beyond the 30 s bound, which is
        # far beyond any delay a loaded host adds to a wake-up.
        nvml.send(wait.format(0, 60000))
        time.sleep(0.2)  # the child is likely waiting now (if not, the event waits for it)
        start = time.monotonic()
        simgpu_node.inject_xid(1, 79)
        assert nvml.result() == [1, 8, 79]  # nvmlEventTypeXidCriticalError = 8
        assert time.monotonic() - start < 30
        assert nvml(wait.format(1, 1000)) == [1, 8, 79]  # the other set gets it too
        for s in (0, 1):
            with pytest.raises(NvmlError, match="NVMLError_Timeout"):
                nvml(wait.format(s, 20))  # ...once

        simgpu_node.inject_xid(0, 48)
        simgpu_node.inject_xid(0, 63)
        assert [nvml(wait.format(0, 1000)) for _ in range(2)] == [[0, 8, 48], [0, 8, 63]]
        nvml("[N.nvmlEventSetFree(s) for s in sets]")


def test_a_lost_gpu_answers_gpu_is_lost_until_it_is_back(simgpu_node: Node) -> None:
    uuid0 = simgpu_node.gpu(0).uuid
    with pynvml_on(env_with(simgpu_node)) as nvml:
        nvml(
            "h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(2)]\n"
            "s = N.nvmlEventSetCreate()\n"
            "for x in h: N.nvmlDeviceRegisterEvents(x, N.nvmlEventTypeXidCriticalError, s)"
        )
        simgpu_node.set_lost(0)
        for query in (
            "N.nvmlDeviceGetMemoryInfo(h[0])",
            "N.nvmlDeviceGetName(h[0])",
            "N.nvmlDeviceGetUUID(h[0])",
            "N.nvmlDeviceGetHandleByIndex(0)",
            f"N.nvmlDeviceGetHandleByUUID({uuid0!r})",
        ):
            with pytest.raises(NvmlError, match="NVMLError_GpuIsLost"):
                nvml(query)
        assert nvml("out = N.nvmlDeviceGetCount()") == 2  # still on the bus, just dead
        assert nvml("out = N.nvmlDeviceGetMemoryInfo(h[1]).total") == 16 * GIB
        start = time.monotonic()
        with pytest.raises(NvmlError, match="NVMLError_GpuIsLost"):
            nvml("N.nvmlEventSetWait_v2(s, 60000)")  # ends the wait at once, not at 60 s
        assert time.monotonic() - start < 30

        simgpu_node.set_lost(0, False)
        assert nvml("out = N.nvmlDeviceGetMemoryInfo(h[0]).total") == 16 * GIB
        assert nvml("out = N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByIndex(0))") == 0
        with pytest.raises(NvmlError, match="NVMLError_Timeout"):
            nvml("N.nvmlEventSetWait_v2(s, 20)")


def test_an_event_wait_sleeps_until_something_happens(simgpu_node: Node) -> None:
    """As the driver's wait sleeps in the kernel: a wait on a quiet node wakes the process next
    to never (a plugin's health thread waits all day; looking every 2 ms woke it 1,000 times
    in 2 s and cost it 8 ms of CPU a second), and a GPU lost while it waits ends it at once."""
    with pynvml_on(env_with(simgpu_node)) as nvml:
        nvml(
            "s = N.nvmlEventSetCreate()\n"
            "for i in range(2):\n"
            "    N.nvmlDeviceRegisterEvents("
            "N.nvmlDeviceGetHandleByIndex(i), N.nvmlEventTypeXidCriticalError, s)"
        )
        # Sleeps the process chose (voluntary context switches): what polling multiplies,
        # whatever the machine's speed or load (load adds involuntary ones).
        woke = nvml(
            "import resource\n"
            "c = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw\n"
            "try:\n"
            "    N.nvmlEventSetWait_v2(s, 2000)\n"
            "except N.NVMLError_Timeout:\n"
            "    pass\n"
            "out = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - c"
        )
        assert woke < 100, f"the process slept {woke} times in a 2 s wait with nothing to see"

        nvml.send("N.nvmlEventSetWait_v2(s, 60000)")
        time.sleep(0.2)  # the child is likely waiting now (if not, the loss waits for it)
        start = time.monotonic()
        simgpu_node.set_lost(1)
        with pytest.raises(NvmlError, match="NVMLError_GpuIsLost"):
            nvml.result()
        assert time.monotonic() - start < 30  # at once, not at 60 s


COUNT_AND_UUIDS = (
    "out = [N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(i))"
    " for i in range(N.nvmlDeviceGetCount())]"
)


def test_nvidia_visible_devices_limits_the_view(simgpu_node: Node) -> None:
    uuid0, uuid1 = (g.uuid for g in simgpu_node.gpus())
    with pynvml_on(env_with(simgpu_node, NVIDIA_VISIBLE_DEVICES=uuid1)) as nvml:
        assert nvml(COUNT_AND_UUIDS) == [uuid1]
        h = "N.nvmlDeviceGetHandleByIndex(0)"
        assert nvml(f"out = [N.nvmlDeviceGetIndex({h}), N.nvmlDeviceGetMinorNumber({h})]") == [0, 1]
        with pytest.raises(NvmlError, match="NVMLError_NotFound"):
            nvml(f"N.nvmlDeviceGetHandleByUUID({uuid0!r})")  # not this container's GPU
    with pynvml_on(env_with(simgpu_node, NVIDIA_VISIBLE_DEVICES="1,0")) as nvml:
        assert nvml(COUNT_AND_UUIDS) == [uuid0, uuid1]  # physical order, whatever the list's
    for nothing in ("none", "void"):
        with pynvml_on(env_with(simgpu_node, NVIDIA_VISIBLE_DEVICES=nothing)) as nvml:
            assert nvml(COUNT_AND_UUIDS) == []
    with pynvml_on(env_with(simgpu_node, CUDA_VISIBLE_DEVICES="1")) as nvml:
        assert nvml(COUNT_AND_UUIDS) == [uuid0, uuid1]  # NVML ignores CUDA's variable


USAGE = """
out = []
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    procs = N.nvmlDeviceGetComputeRunningProcesses(h)  # first: it must see the dead by itself
    m = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    assert (m2.used, m2.free, m2.reserved) == (m.used, m.free, 0)
    assert m.free + m.used == m.total
    out.append([m.used, sorted([p.pid, p.usedGpuMemory] for p in procs)])
"""


def test_memory_and_processes_show_other_processes(simgpu_node: Node, native_bin: Path) -> None:
    overhead = simgpu_node.gpu(0).context_overhead
    with pynvml_on(env_with(simgpu_node)) as nvml:
        assert nvml(USAGE) == [[0, []], [0, []]]
        with (
            gpu_process(native_bin, simgpu_node, "mem:0:1024", "ctx:0") as a,
            gpu_process(native_bin, simgpu_node, "mem:1:256", "mem:0:64") as b,
        ):
            on0 = sorted([[a.pid, GIB + overhead], [b.pid, 64 * MIB]])
            assert nvml(USAGE) == [
                [GIB + overhead + 64 * MIB, on0],
                [256 * MIB, [[b.pid, 256 * MIB]]],
            ]
            assert simgpu_node.gpu(0).used_memory == GIB + overhead + 64 * MIB

            a.send_signal(signal.SIGKILL)  # the driver frees a dead process's memory
            a.wait(10)
            assert nvml(USAGE) == [
                [64 * MIB, [[b.pid, 64 * MIB]]],
                [256 * MIB, [[b.pid, 256 * MIB]]],
            ]
        assert nvml(USAGE) == [[0, []], [0, []]]


def test_utilization_follows_the_timeline(simgpu_node: Node, native_bin: Path) -> None:
    util = (
        "out = [N.nvmlDeviceGetUtilizationRates(N.nvmlDeviceGetHandleByIndex(i)).gpu"
        " for i in (0, 1)]"
    )
    with pynvml_on(env_with(simgpu_node)) as nvml:
        assert nvml(util) == [0, 0]
        with gpu_process(native_bin, simgpu_node, "busy:0:60000") as proc:
            start, end = busy_span(proc)
            sleep_until(start + SECOND)  # a full one-second window of back-to-back kernels
            busy, idle = nvml(util)
            answered_by(end, "nvmlDeviceGetUtilizationRates")
        assert (busy, idle) == (100, 0)


PROCESS_UTIL = """
h = N.nvmlDeviceGetHandleByIndex(GPU)
try:
    out = sorted([s.pid, s.smUtil, s.memUtil, s.timeStamp > 0] for s in
                 N.nvmlDeviceGetProcessUtilization(h, SINCE))
except N.NVMLError_NotFound:
    out = "not found"
"""


def process_util(nvml: Any, gpu: int, since: int = 0) -> Any:
    return nvml(PROCESS_UTIL.replace("GPU", str(gpu)).replace("SINCE", str(since)))


def test_process_utilization_names_the_process_that_kept_the_gpu_busy(
    simgpu_node: Node, native_bin: Path
) -> None:
    with pynvml_on(env_with(simgpu_node)) as nvml:
        assert process_util(nvml, 0) == "not found"  # nothing ran yet: NVML_ERROR_NOT_FOUND
        with gpu_process(native_bin, simgpu_node, "busy:0:2500") as busy:
            start, end = busy_span(busy)
            sleep_until(start + SECOND)  # the whole sample period inside the busy span
            samples = process_util(nvml, 0)
            answered_by(end, "nvmlDeviceGetProcessUtilization")
            assert process_util(nvml, 1) == "not found"  # the other GPU stayed idle
        [[pid, sm, mem, stamped]] = samples
        assert pid == busy.pid and sm == 100 and mem == 0 and stamped
        # A lastSeenTimeStamp in the future leaves no sample to report.
        assert process_util(nvml, 0, since=int((time.time() + 60) * 1e6)) == "not found"
        sleep_until(end + SECOND)  # the one-second sample period has passed: nothing ran since
        assert process_util(nvml, 0) == "not found"


SAMPLES = """
h = N.nvmlDeviceGetHandleByIndex(0)
try:
    got = N.nvmlDeviceGetProcessUtilization(h, SINCE)
    out = sorted([s.timeStamp, s.pid, s.smUtil] for s in got)
except N.NVMLError_NotFound:
    out = []
"""


def test_process_utilization_comes_in_the_drivers_sample_periods(
    simgpu_node: Node, native_bin: Path
) -> None:
    """SIMGPU_UTIL_PERIOD_MS, as a real driver samples (every 1/6 s to 1 s by product): one
    sample per process per period it ran in, stamped with the period's end, a second of them
    kept; a caller between two periods' ends gets nothing new."""
    period_us = 250_000

    def samples(since: int) -> list[list[int]]:
        got: list[list[int]] = nvml(SAMPLES.replace("SINCE", str(since)))
        return got

    with pynvml_on(env_with(simgpu_node, SIMGPU_UTIL_PERIOD_MS="250")) as nvml:
        with gpu_process(native_bin, simgpu_node, "busy:0:4000") as busy:
            start, end = busy_span(busy)
            sleep_until(start + 1_300_000_000)  # the kept second: all of it busy
            kept = samples(0)
            answered_by(end, "nvmlDeviceGetProcessUtilization")
            stamps = [t for t, _, _ in kept]
            assert [(pid, sm) for _, pid, sm in kept] == [(busy.pid, 100)] * 4, kept
            assert [b - a for a, b in itertools.pairwise(stamps)] == [period_us] * 3
            # Between two periods' ends nothing is new; the next end brings one sample.
            newer = samples(stamps[-1])
            assert all(t - stamps[-1] == period_us for t, _, _ in newer), (stamps, newer)
            last = newer[-1][0] if newer else stamps[-1]
            sleep_until(time.monotonic_ns() + period_us * 1000)
            one = samples(last)
            answered_by(end, "nvmlDeviceGetProcessUtilization")
            assert one and one[0] == [last + period_us, busy.pid, 100], one
        sleep_until(end + 2 * period_us * 1000)  # the period the work ended in is over
        tail = samples(one[-1][0])
        assert tail and all(0 < sm <= 100 for _, _, sm in tail), tail
        assert samples(tail[-1][0]) == []  # nothing ran since: nothing new


NVLINK = """
h = N.nvmlDeviceGetHandleByIndex(0)
out = []
for call in (N.nvmlDeviceGetNvLinkRemoteDeviceType, N.nvmlDeviceGetNvLinkRemotePciInfo,
             N.nvmlDeviceGetNvLinkState):
    for link in (0, N.NVML_NVLINK_MAX_LINKS):
        try:
            call(h, link)
            out.append("ok")
        except N.NVMLError as exc:
            out.append(type(exc).__name__)
"""


def test_nvlink_queries_exist_and_say_a_pcie_gpu_has_no_nvlink(simgpu_node: Node) -> None:
    # PyTorch resolves these at start and asserts they exist; a simulated GPU is PCIe only.
    with pynvml_on(env_with(simgpu_node)) as nvml:
        assert nvml(NVLINK) == ["NVMLError_NotSupported", "NVMLError_InvalidArgument"] * 3


def _api_check(tree: Path, env: Mapping[str, str], *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(tree / "tests" / "nvml_api_check"), *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_c_program_built_against_nvidia_header(simgpu_node: Node, native_tree: Path) -> None:
    if native_build.nvml_include_dir() is None:
        pytest.skip("NVIDIA's nvml.h (pip package nvidia-nvml-dev) is not installed")
    out = _api_check(native_tree, env_with(simgpu_node), "64")
    assert out["real_header"] == 1
    gpus = simgpu_node.gpus()
    assert out["count"] == 2
    assert [d["uuid"] for d in out["devices"]] == [g.uuid for g in gpus]
    assert [d["bus_id"] for d in out["devices"]] == [g.pci_bus_id for g in gpus]
    assert [d["numa"] for d in out["devices"]] == [0, 1]
    # The program charged 64 MiB on GPU 0 itself and found itself in the process list.
    assert [(d["used"], d["processes"]) for d in out["devices"]] == [(64 * MIB, 1), (0, 0)]
    legacy = subprocess.run(
        [str(native_tree / "tests" / "nvml_legacy_check")],
        env=env_with(simgpu_node),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (legacy.returncode, legacy.stdout) == (0, "ok 2\n"), legacy.stderr


def test_compat_header_has_nvidia_abi(
    simgpu_node: Node, native_tree: Path, compat_tree: Path
) -> None:
    compat = compat_tree
    env = env_with(simgpu_node)
    compat_env = dict(env, LD_LIBRARY_PATH=str(compat / "simgpu"))
    own = _api_check(compat, compat_env)
    assert own["real_header"] == 0 and own["count"] == 2
    # A program built on our header runs against the library built on NVIDIA's, and sees the
    # same: the layouts and constants agree.
    cross = _api_check(compat, env)
    real = _api_check(native_tree, env)
    assert own["layout"] == cross["layout"] == real["layout"]
    assert own["devices"] == cross["devices"] == real["devices"]
    legacy = subprocess.run(
        [str(compat / "tests" / "nvml_legacy_check")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert legacy.returncode == 0, legacy.stderr
