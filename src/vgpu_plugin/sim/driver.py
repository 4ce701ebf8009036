"""A small ctypes client of the CUDA driver API, for the demo's workloads.

It loads ``libcuda.so.1`` the way any CUDA program does, so inside a container the shim (from
``/etc/ld.so.preload``) sees every call; on a simulated node the library is simgpu's.
"""

from __future__ import annotations

import ctypes
from ctypes import byref, c_int, c_size_t, c_uint, c_uint64, c_void_p

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2

# A simgpu module: the built-in simgpu_sleep kernel runs for its first parameter (ns).
SLEEP_MODULE = b"simgpu-module 1\n"


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


class Driver:
    """One process's view of the driver: init, a primary context on device 0."""

    def __init__(self, device: int = 0) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", self.lib.cuInit(0))
        self.dev = c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(byref(self.dev), device))
        self.ctx = c_void_p()
        self.check(
            "cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(byref(self.ctx), self.dev)
        )
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, byref(name))
        return name.value.decode() if name.value else str(code)

    def check(self, call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(call, code, self.error_name(code))

    def device_count(self) -> int:
        n = c_int()
        self.check("cuDeviceGetCount", self.lib.cuDeviceGetCount(byref(n)))
        return n.value

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self.check("cuMemGetInfo_v2", self.lib.cuMemGetInfo_v2(byref(free), byref(total)))
        return free.value, total.value

    def total_mem(self, device: int | None = None) -> int:
        total = c_size_t()
        dev = self.dev if device is None else c_int(device)
        self.check("cuDeviceTotalMem_v2", self.lib.cuDeviceTotalMem_v2(byref(total), dev))
        return total.value

    def uuid(self, device: int) -> str:
        raw = (ctypes.c_ubyte * 16)()
        self.check("cuDeviceGetUuid", self.lib.cuDeviceGetUuid(raw, c_int(device)))
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def alloc(self, size: int) -> int | None:
        """A device pointer, or None when the driver (or the shim) says out of memory."""
        ptr = c_uint64()
        code = self.lib.cuMemAlloc_v2(byref(ptr), c_size_t(size))
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            return None
        self.check("cuMemAlloc_v2", code)
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check("cuMemFree_v2", self.lib.cuMemFree_v2(c_uint64(ptr)))

    def sleep_kernel(self) -> c_void_p:
        module, func = c_void_p(), c_void_p()
        self.check("cuModuleLoadData", self.lib.cuModuleLoadData(byref(module), SLEEP_MODULE))
        self.check(
            "cuModuleGetFunction",
            self.lib.cuModuleGetFunction(byref(func), module, b"simgpu_sleep"),
        )
        return func

    def launch_sleep(self, func: c_void_p, ns: int) -> None:
        duration = c_uint64(ns)
        params = (c_void_p * 1)(ctypes.cast(byref(duration), c_void_p))
        self.check(
            "cuLaunchKernel",
            self.lib.cuLaunchKernel(
                func, c_uint(1), c_uint(1), c_uint(1), c_uint(1), c_uint(1), c_uint(1),
                c_uint(0), c_void_p(0), params, c_void_p(0),
            ),
        )  # fmt: skip

    def synchronize(self) -> None:
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())
