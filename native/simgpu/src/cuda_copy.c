/* cuMemcpy* and cuMemset*: real data movement between host and (host-backed) device memory.
 *
 * Copies take no simulated GPU time: they happen when called. Ordering is kept where callers
 * can observe it: a synchronous copy or memset first waits for the work queued before it on
 * the default stream (as the real one does); an async one is issued at once, which gives the
 * same data because simulated kernels never write memory. */
#include <string.h>

#include "cuda_internal.h"

enum side { HOST, DEVICE, EITHER };

/* Device-side pointers must lie in device-accessible memory; EITHER (cuMemcpy's unified
 * addressing) accepts a pointer the table does not know as host memory. */
static CUresult check_side(uintptr_t p, size_t n, enum side side, int write) {
    if (side == HOST) return p || n == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (side == EITHER && !sim_range_find(p)) return p || n == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return sim_range_check(p, n, write);
}

/* Validate the context, pointers and stream; for a synchronous call, wait for prior work. */
static CUresult prepare(uintptr_t dst, enum side dside, uintptr_t src, enum side sside, size_t n, CUstream h, int ptds,
                        int async) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    rc = check_side(dst, n, dside, 1);
    if (rc == CUDA_SUCCESS && src) rc = check_side(src, n, sside, 0);
    if (rc == CUDA_SUCCESS && async) {
        struct CUctx_st *sc;
        struct CUstream_st *s;
        rc = sim_stream_get(h, ptds, &sc, &s);
    }
    sim_unlock();
    if (rc == CUDA_SUCCESS && !async) rc = sim_sync_copy_wait(NULL, ptds);
    return rc;
}

static CUresult copy(uintptr_t dst, enum side dside, uintptr_t src, enum side sside, size_t n, CUstream h, int ptds,
                     int async) {
    if (n && (!dst || !src)) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = prepare(dst, dside, src, sside, n, h, ptds, async);
    if (rc == CUDA_SUCCESS && n) memmove((void *)dst, (const void *)src, n);
    return rc;
}

#define P(x) ((uintptr_t)(x))

/* --- synchronous copies ------------------------------------------------------------------ */

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), EITHER, P(src), EITHER, n, NULL, 0, 0); }
CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), EITHER, P(src), EITHER, n, NULL, 1, 0); }

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return copy(P(dst), DEVICE, P(src), HOST, n, NULL, 0, 0); }
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n) { return copy(P(dst), DEVICE, P(src), HOST, n, NULL, 1, 0); }
CUresult cuMemcpyHtoD(CUdeviceptr_v1 dst, const void *src, unsigned int n) { return copy(P(dst), DEVICE, P(src), HOST, n, NULL, 0, 0); }

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return copy(P(dst), HOST, P(src), DEVICE, n, NULL, 0, 0); }
CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n) { return copy(P(dst), HOST, P(src), DEVICE, n, NULL, 1, 0); }
CUresult cuMemcpyDtoH(void *dst, CUdeviceptr_v1 src, unsigned int n) { return copy(P(dst), HOST, P(src), DEVICE, n, NULL, 0, 0); }

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), DEVICE, P(src), DEVICE, n, NULL, 0, 0); }
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy(P(dst), DEVICE, P(src), DEVICE, n, NULL, 1, 0); }
CUresult cuMemcpyDtoD(CUdeviceptr_v1 dst, CUdeviceptr_v1 src, unsigned int n) { return copy(P(dst), DEVICE, P(src), DEVICE, n, NULL, 0, 0); }

/* --- asynchronous copies ----------------------------------------------------------------- */

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), EITHER, P(src), EITHER, n, h, 0, 1); }
CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), EITHER, P(src), EITHER, n, h, 1, 1); }

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h) { return copy(P(dst), DEVICE, P(src), HOST, n, h, 0, 1); }
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream h) { return copy(P(dst), DEVICE, P(src), HOST, n, h, 1, 1); }
CUresult cuMemcpyHtoDAsync(CUdeviceptr_v1 dst, const void *src, unsigned int n, CUstream h) { return copy(P(dst), DEVICE, P(src), HOST, n, h, 0, 1); }

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), HOST, P(src), DEVICE, n, h, 0, 1); }
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), HOST, P(src), DEVICE, n, h, 1, 1); }
CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr_v1 src, unsigned int n, CUstream h) { return copy(P(dst), HOST, P(src), DEVICE, n, h, 0, 1); }

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), DEVICE, P(src), DEVICE, n, h, 0, 1); }
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) { return copy(P(dst), DEVICE, P(src), DEVICE, n, h, 1, 1); }
CUresult cuMemcpyDtoDAsync(CUdeviceptr_v1 dst, CUdeviceptr_v1 src, unsigned int n, CUstream h) { return copy(P(dst), DEVICE, P(src), DEVICE, n, h, 0, 1); }

/* --- memset ------------------------------------------------------------------------------ */

static CUresult set(uintptr_t dst, uint32_t value, unsigned int width, size_t count, CUstream h, int ptds, int async) {
    if (dst % width) return CUDA_ERROR_INVALID_VALUE; /* D16/D32 need aligned destinations */
    if (count > SIZE_MAX / width) return CUDA_ERROR_INVALID_VALUE;
    size_t n = count * width;
    CUresult rc = prepare(dst, DEVICE, 0, HOST, n, h, ptds, async);
    if (rc != CUDA_SUCCESS || n == 0) return rc;
    if (width == 1) {
        memset((void *)dst, (int)(value & 0xff), n);
    } else if (width == 2) {
        uint16_t *p = (uint16_t *)dst;
        for (size_t i = 0; i < count; i++) p[i] = (uint16_t)value;
    } else {
        uint32_t *p = (uint32_t *)dst;
        for (size_t i = 0; i < count; i++) p[i] = value;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return set(P(d), v, 1, n, NULL, 0, 0); }
CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) { return set(P(d), v, 1, n, NULL, 1, 0); }
CUresult cuMemsetD8(CUdeviceptr_v1 d, unsigned char v, unsigned int n) { return set(P(d), v, 1, n, NULL, 0, 0); }
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return set(P(d), v, 2, n, NULL, 0, 0); }
CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n) { return set(P(d), v, 2, n, NULL, 1, 0); }
CUresult cuMemsetD16(CUdeviceptr_v1 d, unsigned short v, unsigned int n) { return set(P(d), v, 2, n, NULL, 0, 0); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return set(P(d), v, 4, n, NULL, 0, 0); }
CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n) { return set(P(d), v, 4, n, NULL, 1, 0); }
CUresult cuMemsetD32(CUdeviceptr_v1 d, unsigned int v, unsigned int n) { return set(P(d), v, 4, n, NULL, 0, 0); }

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { return set(P(d), v, 1, n, h, 0, 1); }
CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { return set(P(d), v, 1, n, h, 1, 1); }
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { return set(P(d), v, 2, n, h, 0, 1); }
CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { return set(P(d), v, 2, n, h, 1, 1); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { return set(P(d), v, 4, n, h, 0, 1); }
CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { return set(P(d), v, 4, n, h, 1, 1); }

/* --- 2D copies (pitched rows between host and device memory; arrays are not modelled) ---- */

static CUresult side_of(CUmemorytype t, uintptr_t host, CUdeviceptr dev, CUarray arr, uintptr_t *base, enum side *side) {
    (void)arr;
    switch (t) {
    case CU_MEMORYTYPE_HOST: *base = host, *side = HOST; return CUDA_SUCCESS;
    case CU_MEMORYTYPE_DEVICE: *base = P(dev), *side = DEVICE; return CUDA_SUCCESS;
    case CU_MEMORYTYPE_UNIFIED: *base = P(dev), *side = EITHER; return CUDA_SUCCESS;
    case CU_MEMORYTYPE_ARRAY: return CUDA_ERROR_NOT_SUPPORTED; /* arrays hold no data here */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult copy2d(const CUDA_MEMCPY2D *c, CUstream h, int ptds, int async) {
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t sb, db;
    enum side ss, ds;
    CUresult rc = side_of(c->srcMemoryType, P(c->srcHost), c->srcDevice, c->srcArray, &sb, &ss);
    if (rc == CUDA_SUCCESS) rc = side_of(c->dstMemoryType, P(c->dstHost), c->dstDevice, c->dstArray, &db, &ds);
    if (rc != CUDA_SUCCESS) return rc;
    size_t w = c->WidthInBytes, hgt = c->Height;
    if (!w || !hgt) return CUDA_SUCCESS;
    if (c->srcPitch < w && hgt > 1) return CUDA_ERROR_INVALID_VALUE;
    if (c->dstPitch < w && hgt > 1) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t src = sb + c->srcY * c->srcPitch + c->srcXInBytes;
    uintptr_t dst = db + c->dstY * c->dstPitch + c->dstXInBytes;
    size_t src_span = (hgt - 1) * c->srcPitch + w, dst_span = (hgt - 1) * c->dstPitch + w;
    /* Each side's whole span, checked as one range; the wait, as for a 1D copy. */
    rc = prepare(dst, ds, 0, ss, dst_span, h, ptds, async);
    if (rc == CUDA_SUCCESS) {
        sim_lock();
        rc = check_side(src, src_span, ss, 0);
        sim_unlock();
    }
    for (size_t y = 0; rc == CUDA_SUCCESS && y < hgt; y++)
        memmove((void *)(dst + y * c->dstPitch), (const void *)(src + y * c->srcPitch), w);
    return rc;
}

/* The CUDA 2.x forms: 32-bit fields, widened. */
static CUDA_MEMCPY2D widen(const CUDA_MEMCPY2D_v1 *p) {
    return (CUDA_MEMCPY2D){.srcXInBytes = p->srcXInBytes, .srcY = p->srcY, .srcMemoryType = p->srcMemoryType,
                           .srcHost = p->srcHost, .srcDevice = p->srcDevice, .srcArray = p->srcArray,
                           .srcPitch = p->srcPitch, .dstXInBytes = p->dstXInBytes, .dstY = p->dstY,
                           .dstMemoryType = p->dstMemoryType, .dstHost = p->dstHost, .dstDevice = p->dstDevice,
                           .dstArray = p->dstArray, .dstPitch = p->dstPitch, .WidthInBytes = p->WidthInBytes,
                           .Height = p->Height};
}

static CUresult copy2d_v1(const CUDA_MEMCPY2D_v1 *p, CUstream h, int async) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUDA_MEMCPY2D c = widen(p);
    return copy2d(&c, h, 0, async);
}

CUresult cuMemcpy2D(const CUDA_MEMCPY2D_v1 *p) { return copy2d_v1(p, NULL, 0); }
CUresult cuMemcpy2DUnaligned(const CUDA_MEMCPY2D_v1 *p) { return copy2d_v1(p, NULL, 0); }
CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D_v1 *p, CUstream h) { return copy2d_v1(p, h, 1); }
CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *p) { return copy2d(p, NULL, 0, 0); }
CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *p) { return copy2d(p, NULL, 1, 0); }
CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *p) { return copy2d(p, NULL, 0, 0); }
CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *p) { return copy2d(p, NULL, 1, 0); }
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream h) { return copy2d(p, h, 0, 1); }
CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *p, CUstream h) { return copy2d(p, h, 1, 1); }

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuMemcpy2D)
SIM_SELF(cuMemcpy2DAsync)
SIM_SELF(cuMemcpy2DUnaligned)
SIM_SELF(cuMemcpy2D_v2)
SIM_SELF(cuMemcpy2D_v2_ptds)
SIM_SELF(cuMemcpy2DUnaligned_v2)
SIM_SELF(cuMemcpy2DUnaligned_v2_ptds)
SIM_SELF(cuMemcpy2DAsync_v2)
SIM_SELF(cuMemcpy2DAsync_v2_ptsz)
SIM_SELF(cuMemcpy)
SIM_SELF(cuMemcpyAsync)
SIM_SELF(cuMemcpyAsync_ptsz)
SIM_SELF(cuMemcpyDtoD)
SIM_SELF(cuMemcpyDtoDAsync)
SIM_SELF(cuMemcpyDtoDAsync_v2)
SIM_SELF(cuMemcpyDtoDAsync_v2_ptsz)
SIM_SELF(cuMemcpyDtoD_v2)
SIM_SELF(cuMemcpyDtoD_v2_ptds)
SIM_SELF(cuMemcpyDtoH)
SIM_SELF(cuMemcpyDtoHAsync)
SIM_SELF(cuMemcpyDtoHAsync_v2)
SIM_SELF(cuMemcpyDtoHAsync_v2_ptsz)
SIM_SELF(cuMemcpyDtoH_v2)
SIM_SELF(cuMemcpyDtoH_v2_ptds)
SIM_SELF(cuMemcpyHtoD)
SIM_SELF(cuMemcpyHtoDAsync)
SIM_SELF(cuMemcpyHtoDAsync_v2)
SIM_SELF(cuMemcpyHtoDAsync_v2_ptsz)
SIM_SELF(cuMemcpyHtoD_v2)
SIM_SELF(cuMemcpyHtoD_v2_ptds)
SIM_SELF(cuMemcpy_ptds)
SIM_SELF(cuMemsetD16)
SIM_SELF(cuMemsetD16Async)
SIM_SELF(cuMemsetD16Async_ptsz)
SIM_SELF(cuMemsetD16_v2)
SIM_SELF(cuMemsetD16_v2_ptds)
SIM_SELF(cuMemsetD32)
SIM_SELF(cuMemsetD32Async)
SIM_SELF(cuMemsetD32Async_ptsz)
SIM_SELF(cuMemsetD32_v2)
SIM_SELF(cuMemsetD32_v2_ptds)
SIM_SELF(cuMemsetD8)
SIM_SELF(cuMemsetD8Async)
SIM_SELF(cuMemsetD8Async_ptsz)
SIM_SELF(cuMemsetD8_v2)
SIM_SELF(cuMemsetD8_v2_ptds)
