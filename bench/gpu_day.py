"""A GPU day in one command: build, the GPU tests and the shim's figures on the real driver.

    python bench/gpu_day.py            # on a machine with an NVIDIA GPU (as root, no network)
    python bench/gpu_day.py --simgpu   # the dry run: every path against the simulator

Steps, each in its own subprocess with its own timeout (a step that fails or hangs prints its
error in its row and the day goes on): the release build (tests/native_build.py), ``pytest -m
gpu tests/gpu``, then measurements through ctypes on ``libcuda.so.1`` with and without the shim
(LD_PRELOAD of libvgpu.so), taking turns in one run: context create+destroy, cuMemAlloc+cuMemFree
and cuLaunchKernel wall-clock (medians of blocks; ctypes' own call cost is in both sides), the
memory limit's accuracy (64 MiB chunks to the refusal, PyTorch's OOM point, NVML's used memory
of the process), compute share at 25 % and 50 % (kernel throughput vs alone), noisy-neighbour
slowdown (a 25 % container's kernel latency beside a saturating container vs alone), how the
driver samples per-process utilisation (its period; whether a time-sliced-out context counts
as running), the NVML process list's cost (the shim's node-pid probe) and whether a late
process of a full container, started through the CUDA runtime (its primary context comes
through the driver's private table), leaves the container's GPU memory at or under its limit
by NVML.

Prints one markdown table; with ``$OUT`` set also writes ``$OUT/gpu_day.md`` and the full log
``$OUT/gpu_day.log``. Under --simgpu the figures mean nothing: it proves the paths run.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30
LIMIT = 4 * GIB
CHUNK = 64 * MIB

# A dependent FMA chain the compiler cannot drop (the result is stored when it is 0, which the
# compiler cannot rule out): work that scales with n, so time-slicing shows in throughput.
PTX = b"""
.version 7.8
.target sm_75
.address_size 64

.visible .entry spin(.param .u64 out, .param .u32 n)
{
    .reg .pred %p<3>;
    .reg .b32 %r<4>;
    .reg .f32 %f<2>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, 0;
    mov.f32 %f1, 0f3F800000;
LOOP:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    fma.rn.f32 %f1, %f1, 0f3F7FFFFF, 0f3A83126F;
    add.u32 %r2, %r2, 1;
    bra LOOP;
DONE:
    setp.eq.f32 %p2, %f1, 0f00000000;
    @%p2 st.global.f32 [%rd1], %f1;
    ret;
}

.visible .entry empty()
{
    ret;
}
\x00"""


# ---------------------------------------------------------------- workers (run in subprocesses)


class Cuda:
    """The driver API through ctypes: only what the measurements need."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        self.dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(self.dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")

    def make_context(self) -> None:
        self.check(self.lib.cuCtxCreate_v2(ctypes.byref(self.ctx), 0, self.dev), "cuCtxCreate")

    def sm_count(self) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), 16, self.dev), "sm count")
        return v.value

    def kernels(self) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        mod, spin, empty = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)), "PTX load")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(spin), mod, b"spin"), "spin")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(empty), mod, b"empty"), "empty")
        return spin, empty

    def alloc(self, size: int) -> tuple[int, int]:
        p = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size))
        return rc, p.value

    def free(self, p: int) -> None:
        self.check(self.lib.cuMemFree_v2(ctypes.c_uint64(p)), "cuMemFree")

    def sync(self) -> None:
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


class Spinner:
    """Launches the spin kernel over the whole GPU (4 blocks of 256 threads per SM)."""

    def __init__(self, cu: Cuda, n: int) -> None:
        self.cu = cu
        self.spin, self.empty = cu.kernels()
        rc, out = cu.alloc(4096)
        cu.check(rc, "cuMemAlloc")
        self.out = ctypes.c_uint64(out)
        self.n = ctypes.c_uint32(n)
        self.params = (ctypes.c_void_p * 2)(
            ctypes.cast(ctypes.byref(self.out), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(self.n), ctypes.c_void_p),
        )
        self.grid = cu.sm_count() * 4

    def launch(self) -> None:
        self.cu.check(
            self.cu.lib.cuLaunchKernel(
                self.spin, self.grid, 1, 1, 256, 1, 1, 0, None, self.params, None
            ),
            "cuLaunchKernel(spin)",
        )

    def launch_empty(self) -> None:
        self.cu.check(
            self.cu.lib.cuLaunchKernel(self.empty, 1, 1, 1, 32, 1, 1, 0, None, None, None),
            "cuLaunchKernel(empty)",
        )


def _emit(tag: str, data: dict[str, Any]) -> None:
    print(tag, json.dumps(data), flush=True)


def _hold() -> None:
    """Keeps the process (and its context) alive until the parent closes stdin."""
    sys.stdin.read()


def _blocks(
    fn: Callable[[], None], per_block: int, blocks: int, after: Callable[[], None]
) -> float:
    """Median ns per call over blocks of calls (``after`` runs untimed after each block)."""
    times = []
    for _ in range(blocks):
        t = time.perf_counter_ns()
        for _ in range(per_block):
            fn()
        times.append((time.perf_counter_ns() - t) / per_block)
        after()
    return statistics.median(times)


def w_ctx(n: str) -> None:
    cu = Cuda()
    ctx = ctypes.c_void_p()
    times = []
    for _ in range(int(n)):
        t = time.perf_counter_ns()
        cu.check(cu.lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, cu.dev), "cuCtxCreate")
        cu.check(cu.lib.cuCtxDestroy_v2(ctx), "cuCtxDestroy")
        times.append(time.perf_counter_ns() - t)
    _emit("RESULT", {"ns": statistics.median(times[1:] or times)})


def w_alloc() -> None:
    cu = Cuda()
    cu.make_context()

    def pair() -> None:
        rc, p = cu.alloc(MIB)
        cu.check(rc, "cuMemAlloc")
        cu.free(p)

    _emit("RESULT", {"ns": _blocks(pair, 200, 25, lambda: None)})


def w_launch() -> None:
    cu = Cuda()
    cu.make_context()
    s = Spinner(cu, 1)
    s.launch_empty()
    cu.sync()
    _emit("RESULT", {"ns": _blocks(s.launch_empty, 200, 25, cu.sync)})


def w_oom(hold: str) -> None:
    """Allocates 64 MiB chunks until refused; reports what it got, then holds if asked."""
    cu = Cuda()
    cu.make_context()
    got, rc = 0, 0
    while got < 4096 * CHUNK:
        rc, _ = cu.alloc(CHUNK)
        if rc != 0:
            break
        got += CHUNK
    _emit("READY", {"allocated": got, "refusal": rc, "pid": os.getpid()})
    if hold == "1":
        _hold()


def w_calibrate(target_ms: str) -> None:
    """The spin count whose kernel takes about target_ms alone (without the shim)."""
    cu = Cuda()
    cu.make_context()
    n = 4096
    s = Spinner(cu, n)
    s.launch()  # the first launch may load the kernel's code (lazy loading): not timed
    cu.sync()
    while True:
        s.n.value = n
        t = time.perf_counter()
        s.launch()
        cu.sync()
        ms = (time.perf_counter() - t) * 1e3
        if ms >= float(target_ms) / 4 or n >= 1 << 28:
            break
        n *= 2
    n = max(1, int(n * float(target_ms) / max(ms, 1e-3)))
    # At most 2^28 FMAs per thread: under a second on any GPU the driver still supports.
    _emit("RESULT", {"n": min(n, 1 << 28), "ms_at_n": ms})


def w_spin(n: str, seconds: str, hold: str) -> None:
    """Kernel throughput and per-kernel latency (launch to sync) over a window."""
    cu = Cuda()
    cu.make_context()
    s = Spinner(cu, int(n))
    for _ in range(3):
        s.launch()
    cu.sync()
    stop = threading.Event()
    if hold == "1":  # a neighbour: spins until the parent closes stdin (seconds caps it)

        def wait_stdin() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=wait_stdin, daemon=True).start()
        print("READY {}", flush=True)
    lat: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < float(seconds) and not stop.is_set():
        t = time.perf_counter()
        s.launch()
        cu.sync()
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    _emit("RESULT", {"rate": len(lat) / wall, "median_ms": statistics.median(lat) * 1e3})


def w_nvml_probe() -> None:
    """What one NVML compute-process list costs (with this process's context on the GPU)."""
    import pynvml

    cu = Cuda()
    cu.make_context()
    rc, _ = cu.alloc(MIB)
    cu.check(rc, "cuMemAlloc")
    t0 = time.perf_counter_ns()
    pynvml.nvmlInit()
    init_ns = time.perf_counter_ns() - t0
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    times = []
    seen = 0
    for _ in range(200):
        t = time.perf_counter_ns()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        times.append(time.perf_counter_ns() - t)
        seen = len(procs)
    _emit("RESULT", {"us": statistics.median(times) / 1e3, "init_us": init_ns / 1e3, "procs": seen})


def w_nvml_samples(n: str, seconds: str) -> None:
    """How the driver samples per-process utilisation (the shim's settle and the node agent's
    measure read it): spins for ``seconds`` and asks every 20 ms for the samples newer than
    the newest seen. The period is the step between distinct stamps; beside a busy neighbour
    the two processes' smUtil per stamp add up to ~100 if a time-sliced-out context does not
    count as running, ~200 if it does."""
    import pynvml

    cu = Cuda()
    cu.make_context()
    s = Spinner(cu, int(n))
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    me = os.getpid()
    newest, polls, empty = 0, 0, 0
    cost: list[float] = []
    per_stamp: dict[int, dict[int, int]] = {}
    start = last = time.monotonic()
    while time.monotonic() - start < float(seconds):
        s.launch()
        cu.sync()
        if time.monotonic() - last < 0.02:
            continue
        last = time.monotonic()
        t = time.perf_counter_ns()
        try:
            got = pynvml.nvmlDeviceGetProcessUtilization(h, newest)
        except pynvml.NVMLError_NotFound:
            got = []
        cost.append((time.perf_counter_ns() - t) / 1e3)
        polls += 1
        fresh = [x for x in got if x.timeStamp > newest]
        empty += not fresh
        for x in fresh:
            per_stamp.setdefault(int(x.timeStamp), {})[int(x.pid)] = int(x.smUtil)
        newest = max([newest, *(int(x.timeStamp) for x in fresh)])
    stamps = sorted(per_stamp)
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    own = [v.get(me, 0) for v in per_stamp.values()]
    total = [sum(v.values()) for v in per_stamp.values()]
    _emit(
        "RESULT",
        {
            "period_ms": statistics.median(steps) / 1e3 if steps else 0.0,
            "stamps": len(stamps),
            "polls": polls,
            "empty": empty,
            "own": statistics.median(own) if own else 0,
            "total": statistics.median(total) if total else 0,
            "pids": statistics.median([len(v) for v in per_stamp.values()]) if stamps else 0,
            "cost_us": statistics.median(cost) if cost else 0.0,
        },
    )


def w_nvml_used(*pids: str) -> None:
    """NVML's used GPU memory of the given pids (and of the whole device)."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    want = {int(p) for p in pids}
    used = {
        str(p.pid): int(p.usedGpuMemory or 0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        if p.pid in want
    }
    info = pynvml.nvmlDeviceGetMemoryInfo(h)
    _emit("RESULT", {"used": used, "device_used": int(info.used), "device_total": int(info.total)})


TORCH_OOM = """
import json, os, sys, torch
free, total = torch.cuda.mem_get_info()
blocks, err = [], ""
try:
    while True:
        blocks.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError as e:
    err = str(e).splitlines()[0][:160]
print("READY", json.dumps({"held": len(blocks) * CHUNK, "total": total, "pid": os.getpid(),
      "error": err}), flush=True)
sys.stdin.read()
""".replace("CHUNK", str(CHUNK))

# A late process of a full container starting through the CUDA runtime: its primary context
# comes through the driver's private table (cuGetExportTable), not through cuCtxCreate.
LATE_TORCH = """
import json, os, sys, torch
err = ""
try:
    torch.zeros(1, device="cuda")
except Exception as e:
    err = type(e).__name__ + ": " + str(e).splitlines()[0][:160]
print("READY", json.dumps({"pid": os.getpid(), "error": err, "via": "torch"}), flush=True)
sys.stdin.read()
"""
LATE_CUPY = """
import json, os, sys, cupy
err = ""
try:
    cupy.zeros(1)
except Exception as e:
    err = type(e).__name__ + ": " + str(e).splitlines()[0][:160]
print("READY", json.dumps({"pid": os.getpid(), "error": err, "via": "cupy"}), flush=True)
sys.stdin.read()
"""

WORKERS: dict[str, Callable[..., None]] = {
    "ctx": w_ctx,
    "alloc": w_alloc,
    "launch": w_launch,
    "oom": w_oom,
    "calibrate": w_calibrate,
    "spin": w_spin,
    "nvml_probe": w_nvml_probe,
    "nvml_used": w_nvml_used,
    "nvml_samples": w_nvml_samples,
}


# ---------------------------------------------------------------- the driver of the day


class StepError(Exception):
    pass


class Day:
    def __init__(self, simgpu: bool, tmp: Path, log: Any) -> None:
        self.simgpu = simgpu
        self.tmp = tmp
        self.log = log
        self.rows: list[tuple[str, str, str]] = []
        self.tree: Path | None = None
        self.base: dict[str, str] = {}
        drop = ("CUDA_", "SIMGPU_", "VGPU_", "LIBVGPU_", "LD_PRELOAD")
        self.clean = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        if not simgpu:
            self.clean.pop("LD_LIBRARY_PATH", None)
        self.clean["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.procs: list[subprocess.Popen[str]] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def row(self, what: str, figure: str, how: str) -> None:
        self.rows.append((what, figure, how))
        self.say(f"| {what} | {figure} | {how} |")

    def step(self, what: str, how: str, fn: Callable[[], str]) -> None:
        self.say(f"== {what}")
        t = time.monotonic()
        try:
            figure = fn()
        except Exception as e:  # a failed step reports itself and the day goes on
            figure = f"FAILED: {type(e).__name__}: {str(e).strip()[-300:]}".replace("\n", " / ")
        finally:
            for p in self.procs:
                self._stop(p)
            self.procs.clear()
        self.row(what, figure, f"{how} ({time.monotonic() - t:.0f} s)")

    # -- environments

    def container(self, name: str, **extra: str) -> dict[str, str]:
        assert self.tree is not None
        env = dict(self.base)
        # The shim makes the region file, not its directory (the kubelet mounts that in a pod).
        (self.tmp / name / "vgpu").mkdir(parents=True, exist_ok=True)
        (self.tmp / "lock").mkdir(exist_ok=True)
        env.update(
            LD_PRELOAD=str(self.tree / "lib" / "libvgpu.so"),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=str(self.tmp / name / "vgpu" / "r.cache"),
            VGPU_LOCK_DIR=str(self.tmp / "lock"),
            VGPU_LIMITS_FILE=str(self.tmp / "no-limits-file"),
        )
        env.update(extra)
        return env

    # -- subprocesses

    def run(self, args: Sequence[str], env: dict[str, str], timeout: float) -> str:
        self.log.write(f"$ {' '.join(args)}\n")
        try:
            r = subprocess.run(
                list(args), env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
            )
        except subprocess.TimeoutExpired as e:
            raise StepError(f"timed out after {timeout:.0f} s: {' '.join(args)}") from e
        self.log.write(r.stdout + r.stderr + f"[rc {r.returncode}]\n")
        self.log.flush()
        if r.returncode != 0:
            raise StepError(f"rc {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
        return r.stdout

    def worker(self, env: dict[str, str], name: str, *args: str, timeout: float = 60) -> Any:
        out = self.run([sys.executable, __file__, "--worker", name, *args], env, timeout)
        return _tagged(out, "RESULT")

    def start(self, env: dict[str, str], args: Sequence[str], timeout: float = 120) -> Any:
        """Starts a holding process and waits for its READY line."""
        self.log.write(f"$ (held) {' '.join(args)}\n")
        p = subprocess.Popen(
            list(args),
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise StepError(f"no READY within {timeout:.0f} s: {' '.join(args)}") from None
            if line is None:
                err = p.stderr.read() if p.stderr else ""
                raise StepError(f"exited {p.wait()} before READY: {err.strip()[-300:]}")
            self.log.write(line)
            if line.startswith("READY"):
                return json.loads(line.split(" ", 1)[1])

    def _stop(self, p: subprocess.Popen[str]) -> None:
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=20)
        except (subprocess.TimeoutExpired, OSError):
            p.kill()
            p.wait()
        if p.stderr:
            self.log.write(p.stderr.read()[-4000:])

    def worker_args(self, name: str, *args: str) -> list[str]:
        return [sys.executable, __file__, "--worker", name, *args]


def _tagged(out: str, tag: str) -> Any:
    for line in out.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line.split(" ", 1)[1])
    raise StepError(f"no {tag} line in: {out.strip()[-300:]}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


# ---------------------------------------------------------------- the steps


def build(day: Day) -> str:
    day.run([sys.executable, "tests/native_build.py", "release"], day.clean, 420)
    day.tree = ROOT / os.environ.get("VGPU_TEST_BUILD_ROOT", "build") / "native-release"
    if not (day.tree / "lib" / "libvgpu.so").exists():
        day.tree = Path(os.environ.get("VGPU_TEST_BUILD_ROOT", ROOT / "build")) / "native-release"
    os.environ["VGPU_NATIVE_DIR"] = str(day.tree)
    day.clean["VGPU_NATIVE_DIR"] = str(day.tree)
    if day.simgpu:
        sys.path.insert(0, str(ROOT / "src"))
        from vgpu_plugin.sim.simgpu import GpuSpec, Node

        node = Node.create(day.tmp / "node", [GpuSpec(memory=80 << 30)], seed="gpu-day")
        day.base = node.env(day.clean)
        day.base["VGPU_NATIVE_DIR"] = str(day.tree)
        # The dry run's driver as close to a real one as simgpu goes: contexts time-sliced,
        # per-process utilisation sampled in the H200's periods (native/simgpu/README.md).
        day.base["SIMGPU_TIMESLICE"] = "2ms"
        day.base["SIMGPU_UTIL_PERIOD_MS"] = "167"
    else:
        day.base = dict(day.clean)
    return f"built: {day.tree}"


def gpu_tests(day: Day) -> str:
    env = dict(day.clean, VGPU_NATIVE_DIR=str(day.tree))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests/gpu",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",  # one process: the suite's -n needs pytest-xdist, and the tests share a GPU
    ]
    try:
        out = day.run([*cmd, "--timeout=240"], env, 300)
    except StepError as e:
        tail = str(e)
        raise StepError(tail) from None
    return out.strip().splitlines()[-1] if out.strip() else "no output"


def _pairs(day: Day, name: str, *args: str, rounds: int = 3, timeout: float = 60) -> str:
    plain: list[float] = []
    shim: list[float] = []
    env = day.container("bench", CUDA_DEVICE_MEMORY_LIMIT="64g")
    day.worker(env, name, *args, timeout=timeout)  # the region exists in every measured run
    for _ in range(rounds):
        plain.append(day.worker(day.base, name, *args, timeout=timeout)["ns"])
        shim.append(day.worker(env, name, *args, timeout=timeout)["ns"])
    p, s = statistics.median(plain), statistics.median(shim)
    return f"{p / 1e3:.2f} us plain, {s / 1e3:.2f} us shim: +{(s - p) / 1e3:.2f} us, {_ratio(s, p)}"


def memory_limit(day: Day) -> str:
    env = day.container("oom", CUDA_DEVICE_MEMORY_LIMIT="4g")
    got = day.start(env, day.worker_args("oom", "1"))
    used = day.worker(day.base, "nvml_used", str(got["pid"]))
    nv = used["used"].get(str(got["pid"]))
    nv_txt = f"{nv / MIB:.0f} MiB ({nv / LIMIT:.3f} of limit)" if nv is not None else "not listed"
    return (
        f"allocated {got['allocated'] / MIB:.0f} MiB = {got['allocated'] / LIMIT:.3f} of limit, "
        f"refusal CUresult {got['refusal']}; NVML used by the process: {nv_txt}"
    )


def torch_limit(day: Day) -> str:
    env = day.container("torch", CUDA_DEVICE_MEMORY_LIMIT="4g")
    got = day.start(env, [sys.executable, "-c", TORCH_OOM], timeout=180)
    used = day.worker(day.base, "nvml_used", str(got["pid"]))
    nv = used["used"].get(str(got["pid"]))
    nv_txt = f"{nv / MIB:.0f} MiB ({nv / LIMIT:.3f} of limit)" if nv is not None else "not listed"
    return (
        f"torch total {got['total'] / MIB:.0f} MiB; OOM after {got['held'] / MIB:.0f} MiB = "
        f"{got['held'] / LIMIT:.3f} of limit; NVML used by the process: {nv_txt}"
    )


class Spin:
    n = "1000000"  # about 2-4 ms on a recent GPU, should calibration fail


def calibrate(day: Day) -> str:
    r = day.worker(day.base, "calibrate", "5", timeout=90)
    Spin.n = str(r["n"])
    return f"spin n={r['n']} (~5 ms/kernel alone; {r['ms_at_n']:.2f} ms at calibration)"


def compute_share(day: Day) -> str:
    alone = day.worker(day.container("share0"), "spin", Spin.n, "4", "0", timeout=90)
    parts = [f"alone {alone['rate']:.1f} kernels/s"]
    for pct in ("25", "50"):
        r = day.worker(
            day.container("share" + pct, CUDA_DEVICE_SM_LIMIT=pct), "spin", Spin.n, "4", "0"
        )
        parts.append(f"{pct} %: {r['rate']:.1f}/s = {r['rate'] / alone['rate']:.3f} of alone")
    return "; ".join(parts)


def several_processes(day: Day) -> str:
    """Two processes of one container capped at 50 % spinning at once: their rate together
    over one unlimited process's alone is the container's share of the GPU. Each process's
    measure of a kernel also holds the other's time slices (docs/compute.md, Several processes
    in a container: four processes of a 90 % cap got 66 - 81 % on simgpu time-sliced)."""
    alone = day.worker(day.container("multi0"), "spin", Spin.n, "4", "0", timeout=90)
    env = day.container("multi50", CUDA_DEVICE_SM_LIMIT="50")
    got: list[Any] = [None, None]

    def one(i: int) -> None:
        got[i] = day.worker(env, "spin", Spin.n, "4", "0", timeout=90)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in got):
        raise StepError("a process of the container failed (see the log)")
    both = sum(r["rate"] for r in got)
    share = both / alone["rate"] if alone["rate"] else 0.0
    return (
        f"two processes of a 50 % container together {both:.1f} kernels/s = {share * 100:.1f} % "
        f"of one unlimited process alone ({alone['rate']:.1f}/s; each "
        f"{got[0]['rate']:.1f} and {got[1]['rate']:.1f}/s, their 4 s windows overlapping)"
    )


def noisy_neighbour(day: Day) -> str:
    victim = day.container("victim", CUDA_DEVICE_SM_LIMIT="25")
    alone = day.worker(victim, "spin", Spin.n, "4", "0", timeout=90)
    day.start(day.container("busy"), day.worker_args("spin", Spin.n, "30", "1"))
    beside = day.worker(victim, "spin", Spin.n, "4", "0", timeout=90)
    slow = beside["median_ms"] / alone["median_ms"] - 1
    return (
        f"25 % container's kernel latency {alone['median_ms']:.2f} ms alone, "
        f"{beside['median_ms']:.2f} ms beside a saturating container: {slow * 100:+.1f} % "
        f"(throughput {alone['rate']:.1f} -> {beside['rate']:.1f} kernels/s)"
    )


def guaranteed(day: Day, name: str, request: str, cap: str) -> dict[str, str]:
    """A container in the guarantee scheme: its region in the peers' directory, which every
    guaranteed container reads (production: the host's read-only mount at /etc/vgpu/peers)."""
    peers = day.tmp / "peers"
    (peers / name).mkdir(parents=True, exist_ok=True)
    return day.container(
        name,
        CUDA_DEVICE_SM_REQUEST=request,
        CUDA_DEVICE_SM_LIMIT=cap,
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(peers / name / "r.cache"),
        VGPU_COMPUTE_PEERS=str(peers),
    )


def noisy_neighbour_guaranteed(day: Day) -> str:
    lender = day.worker(guaranteed(day, "lend", "25", "100"), "spin", Spin.n, "4", "0", timeout=90)
    victim = guaranteed(day, "gvictim", "25", "25")
    alone = day.worker(victim, "spin", Spin.n, "4", "0", timeout=90)
    day.start(guaranteed(day, "gbusy", "75", "100"), day.worker_args("spin", Spin.n, "30", "1"))
    beside = day.worker(victim, "spin", Spin.n, "4", "0", timeout=90)
    slow = beside["median_ms"] / alone["median_ms"] - 1
    # The lender alone has the whole GPU: the victim's rate beside B over it is its share of
    # the GPU, which its guarantee says is 25 % (15 % before kernels were charged their share
    # of a time-sliced GPU, docs/compute.md).
    share = beside["rate"] / lender["rate"] if lender["rate"] else 0.0
    return (
        f"25 % guaranteed (cap 25) container's kernel latency {alone['median_ms']:.2f} ms alone, "
        f"{beside['median_ms']:.2f} ms beside a busy 75 %-guaranteed one: {slow * 100:+.1f} % "
        f"(throughput {alone['rate']:.1f} -> {beside['rate']:.1f} kernels/s: {share * 100:.1f} % "
        f"of the GPU, guaranteed 25 %); lending: a 25 % guarantee with no cap, alone, ran "
        f"{lender['rate']:.1f} kernels/s"
    )


def nvml_samples(day: Day) -> str:
    def line(r: Any) -> str:
        return (
            f"period {r['period_ms']:.0f} ms ({r['stamps']} stamps, {r['empty']} of "
            f"{r['polls']} reads nothing new), own smUtil {r['own']}, all pids {r['total']} "
            f"({r['pids']} listed); a read {r['cost_us']:.0f} us"
        )

    alone = day.worker(day.base, "nvml_samples", Spin.n, "3", timeout=90)
    day.start(day.container("sampled"), day.worker_args("spin", Spin.n, "30", "1"))
    beside = day.worker(day.base, "nvml_samples", Spin.n, "3", timeout=90)
    return f"alone: {line(alone)}; beside a spinning context: {line(beside)}"


def nvml_probe(day: Day) -> str:
    r = day.worker(day.base, "nvml_probe", timeout=60)
    return (
        f"nvmlDeviceGetComputeRunningProcesses {r['us']:.1f} us median ({r['procs']} listed); "
        f"nvmlInit {r['init_us']:.0f} us"
    )


def late_process(day: Day) -> str:
    env = day.container("late", CUDA_DEVICE_MEMORY_LIMIT="4g")
    a = day.start(env, day.worker_args("oom", "1"))
    code, note = LATE_TORCH, ""
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=day.base, check=False)
    if probe.returncode != 0:
        code, note = LATE_CUPY, " (no torch here: CuPy)"
    b = day.start(env, [sys.executable, "-c", code], timeout=180)
    used = day.worker(day.base, "nvml_used", str(a["pid"]), str(b["pid"]))
    total = sum(used["used"].values())
    listed = {k: f"{v / MIB:.0f}" for k, v in used["used"].items()}
    verdict = "<= limit" if total <= LIMIT else "OVER the limit"
    return (
        f"{total / MIB:.0f} MiB by NVML for the 4096 MiB container: {verdict} "
        f"(MiB per pid {listed}; A allocated {a['allocated'] / MIB:.0f} MiB; late {b['via']}"
        f"{note}: {b['error'] or 'no error'})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simgpu", action="store_true", help="dry run against the simulator")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--skip-tests", action="store_true", help="leave out pytest -m gpu")
    ap.add_argument(
        "--budget", type=float, default=420, help="start no step after this many seconds"
    )
    a = ap.parse_args(argv)
    if a.worker:
        WORKERS[a.worker[0]](*a.worker[1:])
        return 0
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    tmp = Path(tempfile.mkdtemp(prefix="gpu-day-"))
    log_path = (out or tmp) / "gpu_day.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        day = Day(a.simgpu, tmp, log)
        day.say(f"GPU day ({'simgpu dry run' if a.simgpu else 'real driver'}); log {log_path}")
        day.step("native build", "tests/native_build.py release", lambda: build(day))
        if day.tree is None:
            day.say("no native build: nothing else can run")
        else:
            plan: list[tuple[str, str, Callable[[], str]]] = (
                [
                    (
                        "NVIDIA GPU",
                        "nvidia-smi -L",
                        lambda: day.run(["nvidia-smi", "-L"], day.base, 30).strip(),
                    ),
                ]
                if not a.simgpu
                else []
            )
            if not a.skip_tests:
                plan.append(("GPU tests", "pytest -m gpu tests/gpu", lambda: gpu_tests(day)))
            plan += [
                (
                    "context create+destroy",
                    "cuCtxCreate+cuCtxDestroy x30 per process, median; "
                    "3 processes per side, median",
                    lambda: _pairs(day, "ctx", "30", timeout=120),
                ),
                (
                    "cuMemAlloc+cuMemFree (1 MiB)",
                    "25 blocks of 200 pairs, median; limit 64g; 3 processes per side",
                    lambda: _pairs(day, "alloc"),
                ),
                (
                    "cuLaunchKernel (empty kernel)",
                    "25 blocks of 200 launches (sync between "
                    "blocks, untimed), median; 3 processes per side",
                    lambda: _pairs(day, "launch"),
                ),
                (
                    "memory limit 4 GiB, driver API",
                    "cuMemAlloc 64 MiB until refused; NVML process used memory",
                    lambda: memory_limit(day),
                ),
                (
                    "memory limit 4 GiB, PyTorch",
                    "torch.empty 64 MiB until OutOfMemoryError; NVML process used memory",
                    lambda: torch_limit(day),
                ),
                (
                    "late process in a full container",
                    "A holds the 4 GiB container full; B "
                    "starts through the CUDA runtime (private-table primary context); NVML used "
                    "by A+B",
                    lambda: late_process(day),
                ),
                (
                    "spin kernel calibration",
                    "PTX JIT (cuModuleLoadData), 4x256 threads per SM",
                    lambda: calibrate(day),
                ),
                (
                    "compute share 25 % / 50 %",
                    "spin kernels for 4 s, launch+sync each, CUDA_DEVICE_SM_LIMIT vs alone",
                    lambda: compute_share(day),
                ),
                (
                    "several processes, one 50 % cap",
                    "two spinning processes of one container at once (launch+sync each, 4 s), "
                    "their rate together vs one unlimited process alone",
                    lambda: several_processes(day),
                ),
                (
                    "noisy neighbour",
                    "25 % container's median kernel latency, alone vs beside "
                    "an unlimited container spinning",
                    lambda: noisy_neighbour(day),
                ),
                (
                    "noisy neighbour, guaranteed mode",
                    "sharing.compute: guaranteed (CUDA_DEVICE_SM_REQUEST, peers' pacing files): "
                    "25 % guaranteed and capped, alone vs beside a busy 75 %-guaranteed container; "
                    "and a 25 % guarantee without cap alone (idle time lent)",
                    lambda: noisy_neighbour_guaranteed(day),
                ),
                (
                    "NVML per-process samples",
                    "nvmlDeviceGetProcessUtilization every 20 ms while spinning, alone and "
                    "beside a spinning context: the driver's period, smUtil of the two",
                    lambda: nvml_samples(day),
                ),
                (
                    "node-pid probe (NVML process list)",
                    "200 calls with a context on the GPU, median",
                    lambda: nvml_probe(day),
                ),
            ]
            for what, how, fn in plan:
                if time.monotonic() - started > a.budget:  # the GPU's time is lent: stop in it
                    day.row(what, f"NOT RUN: past the {a.budget:.0f} s budget", how)
                    continue
                day.step(what, how, fn)
        table = _table(day, a.simgpu, time.monotonic() - started)
        day.say("\n" + table)
    if out:
        (out / "gpu_day.md").write_text(table)
    return 0


def _table(day: Day, simgpu: bool, seconds: float) -> str:
    head = (
        f"GPU day on {'simgpu (dry run: figures meaningless)' if simgpu else 'the real driver'}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s\n\n"
        "| What | Figure | Measured how |\n|---|---|---|\n"
    )
    return head + "".join(
        f"| {w} | {f.replace('|', '/')} | {h.replace('|', '/')} |\n" for w, f, h in day.rows
    )


if __name__ == "__main__":
    sys.exit(main())
