"""A real CUDA client run by the tests of this tier, one scenario per process.

    python client_prog.py cudart <libcudart path> <scenario> [args]
    python client_prog.py cupy <scenario> [args]
    python client_prog.py torch <scenario> [args]

It prints ``key=value`` lines (read back by the tests) and, for ``hold``, prints ``ready`` and
waits for a line on stdin so the test can look at the node while it runs. Exit status 0 unless
something unexpected failed; the values say what happened.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
CUDA_SUCCESS = 0
H2D, D2H = 1, 2  # cudaMemcpyKind
TOTAL_GLOBAL_MEM_OFFSET = 288  # cudaDeviceProp: name[256], uuid[16], luid[8], mask, pad


def out(key: str, value: object) -> None:
    print(f"{key}={value}", flush=True)


def hold() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


# --- NVIDIA's runtime through ctypes ------------------------------------------------------------


class Runtime:
    def __init__(self, path: str) -> None:
        self.rt = ctypes.CDLL(path)

    def check(self, what: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise SystemExit(f"{what}: cudaError {rc}")

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(
            "cudaMemGetInfo", self.rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        )
        return free.value, total.value

    def malloc(self, size: int) -> tuple[int, int]:
        p = ctypes.c_void_p()
        rc = self.rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(size))
        return rc, p.value or 0

    def free(self, ptr: int) -> None:
        self.check("cudaFree", self.rt.cudaFree(ctypes.c_void_p(ptr)))

    def total_global_mem(self) -> int:
        prop = ctypes.create_string_buffer(4096)  # larger than cudaDeviceProp in 12.x and 13.x
        self.check("cudaGetDeviceProperties", self.rt.cudaGetDeviceProperties(prop, 0))
        return ctypes.c_size_t.from_buffer(prop, TOTAL_GLOBAL_MEM_OFFSET).value


def cudart(path: str, scenario: str, args: list[str]) -> None:
    rt = Runtime(path)
    version = ctypes.c_int()
    rt.check("cudaRuntimeGetVersion", rt.rt.cudaRuntimeGetVersion(ctypes.byref(version)))
    out("runtime", version.value)
    rt.check("cudaFree(0)", rt.rt.cudaFree(None))  # initialises the primary context
    free, total = rt.mem_info()
    out("free", free)
    out("total", total)
    out("total_global_mem", rt.total_global_mem())
    if scenario == "hold":
        hold()
    elif scenario == "fill":
        fill_cudart(rt, int(args[0]))
    elif scenario == "roundtrip":
        roundtrip_cudart(rt, int(args[0]))
    elif scenario == "graphs":
        graphs_cudart(rt, int(args[0]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def fill_cudart(rt: Runtime, chunk: int) -> None:
    """Allocate until refused, free everything, and see the memory come back."""
    ptrs: list[int] = []
    while True:
        rc, p = rt.malloc(chunk)
        if rc != CUDA_SUCCESS:
            out("refusal", rc)
            break
        ptrs.append(p)
    out("allocated", len(ptrs) * chunk)
    out("full_free", rt.mem_info()[0])
    for p in ptrs:
        rt.free(p)
    out("after_free", rt.mem_info()[0])


def roundtrip_cudart(rt: Runtime, size: int) -> None:
    data = os.urandom(size)
    src = ctypes.create_string_buffer(data, size)
    dst = ctypes.create_string_buffer(size)
    rc, p = rt.malloc(size)
    rt.check("cudaMalloc", rc)
    rt.check("H2D", rt.rt.cudaMemcpy(ctypes.c_void_p(p), src, ctypes.c_size_t(size), H2D))
    rt.check("D2H", rt.rt.cudaMemcpy(dst, ctypes.c_void_p(p), ctypes.c_size_t(size), D2H))
    rt.free(p)
    out("roundtrip_exact", int(dst.raw == data))


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _PoolProps(ctypes.Structure):  # cudaMemPoolProps: 88 bytes in 12.x and 13.x
    _fields_ = [
        ("allocType", ctypes.c_int),
        ("handleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32SecurityAttributes", ctypes.c_void_p),
        ("reserved", ctypes.c_ubyte * 64),
    ]


class _AllocNodeParams(ctypes.Structure):  # cudaMemAllocNodeParams
    _fields_ = [
        ("poolProps", _PoolProps),
        ("accessDescs", ctypes.c_void_p),
        ("accessDescCount", ctypes.c_size_t),
        ("bytesize", ctypes.c_size_t),
        ("dptr", ctypes.c_void_p),
    ]


class _InstantiateParams(ctypes.Structure):  # cudaGraphInstantiateParams
    _fields_ = [
        ("flags", ctypes.c_ulonglong),
        ("uploadStream", ctypes.c_void_p),
        ("errNode_out", ctypes.c_void_p),
        ("result_out", ctypes.c_int),
    ]


def graphs_cudart(rt: Runtime, size: int) -> None:
    """A graph holding one allocation node of `size` bytes (never freed in the graph, so its
    memory stays with each executable): uploaded with cudaGraphUpload and launched, then a
    second executable uploaded by cudaGraphInstantiateWithParams, then a third by
    cudaGraphUpload. Each call's result and what cudaMemGetInfo says after it."""
    stream = ctypes.c_void_p()
    rt.check("cudaStreamCreate", rt.rt.cudaStreamCreate(ctypes.byref(stream)))
    graph, node = ctypes.c_void_p(), ctypes.c_void_p()
    rt.check("cudaGraphCreate", rt.rt.cudaGraphCreate(ctypes.byref(graph), 0))
    params = _AllocNodeParams(bytesize=size)
    params.poolProps.allocType = 1  # cudaMemAllocationTypePinned
    params.poolProps.location.type = 1  # cudaMemLocationTypeDevice, device 0
    rc = rt.rt.cudaGraphAddMemAllocNode(
        ctypes.byref(node), graph, None, ctypes.c_size_t(0), ctypes.byref(params)
    )
    rt.check("cudaGraphAddMemAllocNode", rc)
    first = ctypes.c_void_p()
    rc = rt.rt.cudaGraphInstantiateWithFlags(ctypes.byref(first), graph, ctypes.c_ulonglong(0))
    rt.check("cudaGraphInstantiateWithFlags", rc)
    out("upload", rt.rt.cudaGraphUpload(first, stream))
    out("upload_free", rt.mem_info()[0])
    out("launch", rt.rt.cudaGraphLaunch(first, stream))
    rt.check("cudaStreamSynchronize", rt.rt.cudaStreamSynchronize(stream))
    out("launch_free", rt.mem_info()[0])
    second = ctypes.c_void_p()
    inst = _InstantiateParams(flags=2, uploadStream=stream)  # cudaGraphInstantiateFlagUpload
    rc = rt.rt.cudaGraphInstantiateWithParams(ctypes.byref(second), graph, ctypes.byref(inst))
    out("with_params", rc)
    out("with_params_result", inst.result_out)
    out("with_params_free", rt.mem_info()[0])
    third = ctypes.c_void_p()
    rc = rt.rt.cudaGraphInstantiateWithFlags(ctypes.byref(third), graph, ctypes.c_ulonglong(0))
    rt.check("cudaGraphInstantiateWithFlags", rc)
    out("upload3", rt.rt.cudaGraphUpload(third, stream))
    out("upload3_free", rt.mem_info()[0])


# --- CuPy -------------------------------------------------------------------------------------


def cupy_client(scenario: str, args: list[str]) -> None:
    import cupy as cp
    import numpy as np

    free, total = cp.cuda.runtime.memGetInfo()
    out("free", free)
    out("total", total)
    out("total_global_mem", cp.cuda.runtime.getDeviceProperties(0)["totalGlobalMem"])
    if scenario == "hold":
        hold()
    elif scenario == "fill":
        fill_cupy(cp, int(args[0]))
    elif scenario == "compute":
        host = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
        dev = cp.asarray(host)
        out("roundtrip_exact", int(bool((cp.asnumpy(dev) == host).all())))
        y = dev * 2 + 1  # an elementwise kernel: NVRTC compiles it, simgpu runs it for 5 us
        cp.cuda.runtime.deviceSynchronize()
        out("elementwise_shape", y.shape[0])
        out("elementwise_dtype", y.dtype)
    elif scenario == "matmul":
        matmul_cupy(cp)
    elif scenario == "pace":
        pace_cupy(cp, np, args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def fill_cupy(cp: Any, chunk: int) -> None:
    pool = cp.get_default_memory_pool()
    held = []
    try:
        while True:
            held.append(cp.empty(chunk, dtype=cp.uint8))
    except cp.cuda.memory.OutOfMemoryError:
        out("oom", 1)
    out("allocated", len(held) * chunk)
    del held
    pool.free_all_blocks()  # CuPy caches freed blocks; this gives them back to the driver
    out("after_free", cp.cuda.runtime.memGetInfo()[0])


def preload_cublas12() -> None:
    """Load nvidia-cublas-cu12's libcublas.so.12 first: with torch's CUDA 13 wheels beside it,
    cuda-pathfinder (which CuPy asks for cuBLAS) picks libcublas.so.13 and CuPy's cuda12x
    module then finds no libcublas.so.12."""
    from pathlib import Path

    import nvidia  # type: ignore[import-not-found]

    for base in nvidia.__path__:
        for lib in sorted(Path(base).glob("cublas/lib/libcublas.so.12")):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return


def matmul_cupy(cp: Any) -> None:
    """A matrix product through cuBLAS (nvidia-cublas-cu12): its handle, its libraries' kernels
    and module variables on simgpu; then hold, for the GPU's use to be read."""
    preload_cublas12()
    a = cp.ones((64, 64), dtype=cp.float32)
    c = a @ a
    cp.cuda.runtime.deviceSynchronize()
    out("matmul_shape", "x".join(map(str, c.shape)))
    out("matmul_dtype", c.dtype)
    out("matmul_free", cp.cuda.runtime.memGetInfo()[0])
    hold()


def pace_cupy(cp: Any, np: Any, module_path: str, seconds: float) -> None:
    """1 ms kernels (simgpu's built-in simgpu_sleep, loaded through CuPy's RawModule) launched
    as fast as allowed for a warm-up second and ``seconds`` more; the share of wall-clock time
    they filled after the warm-up, and the pid whose work simgpu's record holds."""
    out("pid", os.getpid())
    kernel = cp.RawModule(path=module_path).get_function("simgpu_sleep")
    ns = np.uint64(1_000_000)

    def burst() -> int:
        for _ in range(4):
            kernel((1,), (1,), (ns,))
        cp.cuda.runtime.deviceSynchronize()
        return 4

    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        burst()
    start, done = time.monotonic(), 0
    while time.monotonic() < start + seconds:
        done += burst()
    out("share", 100.0 * done * 1e-3 / (time.monotonic() - start))


# --- PyTorch ------------------------------------------------------------------------------------


def torch_client(scenario: str, args: list[str]) -> None:
    """PyTorch's CUDA build; the allocator backend comes from PYTORCH_CUDA_ALLOC_CONF."""
    import torch

    out("torch", torch.__version__)
    out("available", int(torch.cuda.is_available()))
    torch.cuda.init()
    out("devices", torch.cuda.device_count())
    out("backend", torch.cuda.memory.get_allocator_backend())
    free, total = torch.cuda.mem_get_info(0)
    out("free", free)
    out("total", total)
    out("total_global_mem", torch.cuda.get_device_properties(0).total_memory)
    if scenario == "hold":
        hold()
    elif scenario == "fill":
        fill_torch(torch, int(args[0]))
    elif scenario == "compute":
        host = torch.randn(1 << 16, dtype=torch.float32)
        dev = host.to("cuda")
        out("roundtrip_exact", int(torch.equal(dev.cpu(), host)))
        # Elementwise kernels from torch's own fatbins: they launch and run as opaque kernels
        # (5 us each on the simulated timeline) and compute nothing.
        y = dev * 2 + 1
        z = torch.sin(y).add_(dev)
        torch.cuda.synchronize()
        out("elementwise_shape", z.shape[0])
        out("elementwise_dtype", str(z.dtype).removeprefix("torch."))
        out("elementwise_device", z.device.type)
    elif scenario in MODELS:
        train_step_torch(torch, scenario)
    elif scenario == "attention":
        attention_torch(torch)
    elif scenario == "serve":
        serve_torch(float(args[0]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    # Everything is printed and measured: skip the interpreter's finalization. After a backward
    # pass an autograd device thread may drop its last Python reference while the interpreter
    # finalizes, and CPython ends that thread inside a C++ destructor: "terminate called without
    # an active exception", SIGABRT (PyTorch's known shutdown race, pytorch/pytorch#38228; seen
    # here in 5 of 8 "attention" runs, four at once, on 2.15.0: take_gil from ~ThreadLocalState).
    sys.stdout.flush()
    os._exit(0)


MODELS = ("linear", "linear-fp16", "linear-bf16", "conv", "conv-nocudnn", "transformer")


def train_step_torch(torch: Any, model: str) -> None:
    """One forward and backward pass of a model built in code (random weights): an nn.Linear,
    a Conv2d, or a two-layer TransformerEncoder; then hold, for the GPU's use to be read.
    cuBLAS's and cuDNN's handles, workspaces and kernels, attention and the autograd buffers
    are all real."""
    if model.startswith("linear"):
        # fp16 and bf16 take cuBLASLt's half-precision heuristics (a driver export table of
        # their own).
        dtype = {"linear-fp16": torch.float16, "linear-bf16": torch.bfloat16}.get(
            model, torch.float32
        )
        net = torch.nn.Linear(512, 256, device="cuda", dtype=dtype)
        x = torch.randn(64, 512, device="cuda", dtype=dtype)
    elif model.startswith("conv"):
        # With cuDNN off PyTorch convolves with its own kernels and cuBLAS (im2col + GEMM).
        torch.backends.cudnn.enabled = model == "conv"
        net = torch.nn.Conv2d(3, 16, 3, padding=1, device="cuda")
        x = torch.randn(4, 3, 32, 32, device="cuda")
    else:
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
        net = torch.nn.TransformerEncoder(layer, num_layers=2).cuda()
        x = torch.randn(8, 64, 256, device="cuda")
    y = net(x)
    y.sum().backward()
    torch.cuda.synchronize()
    grads = [p.grad for p in net.parameters()]
    out("output_shape", "x".join(map(str, y.shape)))
    out("grads", sum(g is not None and g.device.type == "cuda" for g in grads))
    out("params", len(grads))
    out("model_free", torch.cuda.mem_get_info(0)[0])
    # libcudnn.so.9 is linked into torch and loads its engines only when a cuDNN op runs.
    out("cudnn_engines", int("libcudnn_engines" in Path("/proc/self/maps").read_text()))
    hold()


def attention_torch(torch: Any) -> None:
    """cuDNN's fused attention, forward and backward (scaled_dot_product_attention in fp16 with
    only the cuDNN backend allowed): cuDNN builds these kernels at run time, compiling them with
    NVRTC and loading the PTX as a module; then hold, for the GPU's use to be read."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # no fallback: cuDNN runs it or this raises
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        y.sum().backward()
    torch.cuda.synchronize()
    maps = Path("/proc/self/maps").read_text()
    out("output_shape", "x".join(map(str, y.shape)))
    out("grad_shape", "x".join(map(str, q.grad.shape)))
    out("runtime_compiled", int("libcudnn_engines_runtime_compiled" in maps and "nvrtc" in maps))
    out("model_free", torch.cuda.mem_get_info(0)[0])
    hold()


def serve_torch(utilization: float) -> None:
    """The demo's inference server (vgpu_plugin.sim.inference), small: sizes its KV cache from
    torch.cuda.mem_get_info() as vLLM's gpu_memory_utilization does, serves requests, holds."""
    import json

    from vgpu_plugin.sim import inference

    args = inference.parser().parse_args(
        ["--tiny", "--utilization", str(utilization), "--requests", "3"]
    )
    for key, value in inference.run(args).items():
        out(key, json.dumps(value))
    hold()


def fill_torch(torch: Any, chunk: int) -> None:
    held = []
    try:
        while True:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        out("oom", 1)
    out("allocated", len(held) * chunk)
    del held
    torch.cuda.empty_cache()  # the caching allocators keep freed blocks until asked
    torch.cuda.synchronize()  # cudaMallocAsync's pool gives memory back at a synchronisation
    out("after_free", torch.cuda.mem_get_info(0)[0])


def main() -> None:
    client, rest = sys.argv[1], sys.argv[2:]
    if client == "cudart":
        cudart(rest[0], rest[1], rest[2:])
    elif client == "cupy":
        cupy_client(rest[0], rest[1:])
    elif client == "torch":
        torch_client(rest[0], rest[1:])
    else:
        raise SystemExit(f"unknown client {client}")


if __name__ == "__main__":
    main()
