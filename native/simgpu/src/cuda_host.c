/* Host-side services: host functions on streams, registered host memory, and the managed-memory
 * hints (prefetch, advice) that change nothing a simulator models. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

/* --- host functions ----------------------------------------------------------------------- */

/* The function runs once the work queued before it on the stream is done. The simulator runs
 * it in the calling thread after waiting for that work, so later work on the stream is
 * naturally ordered after it; the caller blocks instead of returning at once. */
static CUresult host_func(CUstream h, int ptds, void (*fn)(void *), void *data) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    uint64_t until = 0;
    if (rc == CUDA_SUCCESS && s->capture) {
        s->capture_invalid = 1; /* host nodes are not modelled in graphs */
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (rc == CUDA_SUCCESS) {
        until = s->kind == SIM_STREAM_LEGACY ? sim_stream_deps(c, s) : s->end_ns;
    }
    sim_unlock();
    if (rc != CUDA_SUCCESS) return rc;
    simgpu_sleep_until(until);
    fn(data);
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) { return host_func(hStream, 0, fn, userData); }
CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData) {
    return host_func(hStream, 1, fn, userData);
}

struct callback {
    CUstreamCallback fn;
    CUstream stream;
    void *data;
};

static void run_callback(void *p) {
    struct callback *cb = p;
    cb->fn(cb->stream, CUDA_SUCCESS, cb->data);
}

static CUresult add_callback(CUstream h, int ptds, CUstreamCallback fn, void *data, unsigned int flags) {
    if (!fn || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    struct callback cb = {fn, h, data};
    return host_func(h, ptds, run_callback, &cb);
}

CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData, unsigned int flags) {
    return add_callback(hStream, 0, callback, userData, flags);
}
CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData, unsigned int flags) {
    return add_callback(hStream, 1, callback, userData, flags);
}

/* --- registered host memory: the caller's pages become device-accessible, uncharged -------- */

/* Recorded as page-locked host memory with nothing mapped by us (map_len 0): destroying the
 * record leaves the caller's pages alone. */
static CUresult host_register(void *p, size_t size, unsigned int flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!p || !size) return CUDA_ERROR_INVALID_VALUE;
    (void)flags; /* portable, mapped, I/O, read-only: all the same to host-backed memory */
    struct sim_alloc *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    *a = (struct sim_alloc){.base = (uintptr_t)p, .size = size, .map_len = 0, .phys = c->phys, .kind = SIM_MEM_HOST,
                            .ctx = c};
    sim_lock();
    if (sim_range_find((uintptr_t)p) || sim_range_find((uintptr_t)p + size - 1)) rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    else if (sim_range_insert(a) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    sim_unlock();
    if (rc != CUDA_SUCCESS) free(a);
    return rc;
}

CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) { return host_register(p, bytesize, Flags); }
CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) { return host_register(p, bytesize, Flags); }

CUresult cuMemHostUnregister(void *p) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)p);
    if (!a || a->base != (uintptr_t)p || a->kind != SIM_MEM_HOST || a->map_len != 0) {
        rc = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    } else {
        sim_range_remove(a);
        free(a);
    }
    sim_unlock();
    return rc;
}

/* --- managed-memory hints ------------------------------------------------------------------- */

static CUresult hint(CUdeviceptr p, size_t n, CUstream h, int ptds, int has_stream) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    rc = n ? sim_range_check((uintptr_t)p, n, 0) : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && has_stream) {
        struct CUctx_st *sc;
        struct CUstream_st *s;
        rc = sim_stream_get(h, ptds, &sc, &s);
    }
    sim_unlock();
    return rc;
}

/* Managed memory never migrates here: a prefetch or advice only checks its arguments. */
CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dst, CUstream h) {
    (void)dst;
    return hint(p, n, h, 0, 1);
}
CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dst, CUstream h) {
    (void)dst;
    return hint(p, n, h, 1, 1);
}
CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream h) {
    (void)loc, (void)flags;
    return hint(p, n, h, 0, 1);
}
CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned int flags, CUstream h) {
    (void)loc, (void)flags;
    return hint(p, n, h, 1, 1);
}
CUresult cuMemAdvise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice dev) {
    (void)advice, (void)dev;
    return hint(p, n, NULL, 0, 0);
}
CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise advice, CUmemLocation loc) {
    (void)advice, (void)loc;
    return hint(p, n, NULL, 0, 0);
}

SIM_SELF(cuLaunchHostFunc)
SIM_SELF(cuLaunchHostFunc_ptsz)
SIM_SELF(cuMemAdvise)
SIM_SELF(cuMemAdvise_v2)
SIM_SELF(cuMemHostRegister)
SIM_SELF(cuMemHostRegister_v2)
SIM_SELF(cuMemHostUnregister)
SIM_SELF(cuMemPrefetchAsync)
SIM_SELF(cuMemPrefetchAsync_ptsz)
SIM_SELF(cuMemPrefetchAsync_v2)
SIM_SELF(cuMemPrefetchAsync_v2_ptsz)
SIM_SELF(cuStreamAddCallback)
SIM_SELF(cuStreamAddCallback_ptsz)
