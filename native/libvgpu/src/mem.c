/* Memory hooks: every allocation path charges the region before the driver allocates, and
 * every free gives back exactly what its allocation charged.
 *
 * Pattern: charge (atomic check-and-reserve across the container's processes) -> real call ->
 * commit and record, or roll back. Over the limit nothing reaches the driver and the caller
 * gets CUDA_ERROR_OUT_OF_MEMORY. Frees always reach the driver; an unknown pointer is simply
 * forwarded. With no limits at all every hook is a forward after one branch. */
#include <string.h>

#include "shim.h"

#define NEED(fn)                                                                               \
    do {                                                                                       \
        vgpu_ensure();                                                                         \
        if (UNLIKELY(!vgpu.real.fn)) return CUDA_ERROR_NOT_INITIALIZED;                        \
    } while (0)

/* After the real call: commit and record, or roll back. */
static CUresult finish(struct vgpu_dev *d, CUresult rc, int kind, uint64_t key, uint64_t bytes,
                       CUcontext ctx) {
    if (rc != CUDA_SUCCESS) {
        vgpu_rollback(d, bytes);
        return rc;
    }
    vgpu_commit(d, bytes);
    if (d->accounted && vgpu_tab_put(kind, key, d->ordinal, bytes, ctx) != 0)
        VLOG(VGPU_LOG_ERROR, "out of memory recording an allocation: its %llu bytes stay "
             "charged until the process exits", (unsigned long long)bytes);
    return CUDA_SUCCESS;
}

/* Release what the record of (kind, key) charged; it was taken out already. */
static void give_back(const struct vgpu_rec *r) {
    struct vgpu_dev *d = vgpu_dev(r->ordinal);
    if (d) vgpu_uncharge(d, r->bytes);
}

/* --- device memory --------------------------------------------------------------------------- */

/* No device for the call: without a context (ctx NULL) the driver answers, and refuses too;
 * a context whose device the shim cannot resolve is refused while limits are in force. */
#define UNRESOLVED(ctx, call) ((ctx) ? CUDA_ERROR_OUT_OF_MEMORY : (call))

static CUresult alloc_v2(CUdeviceptr *dptr, size_t bytes) {
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, vgpu.real.cuMemAlloc_v2(dptr, bytes));
    CUresult rc = vgpu_charge(d, bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemAlloc_v2(dptr, bytes);
    /* Oversubscribed: within the limit but more than the GPU holds -> host-backed memory. */
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vgpu.cfg.oversubscribe && vgpu.real.cuMemAllocManaged) {
        rc = vgpu.real.cuMemAllocManaged(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
        if (rc == CUDA_SUCCESS)
            VLOG(VGPU_LOG_DEBUG, "%zu bytes on GPU %s fell back to managed memory", bytes, d->uuid);
    }
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytes, ctx);
}

VGPU_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    NEED(cuMemAlloc_v2);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAlloc_v2(dptr, bytesize);
    return alloc_v2(dptr, bytesize);
}

/* The 32-bit ABI of CUDA < 3.2: still exported by drivers, so a way around the limit. */
VGPU_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    NEED(cuMemAlloc);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAlloc(dptr, bytesize);
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, vgpu.real.cuMemAlloc(dptr, bytesize));
    CUresult rc = vgpu_charge(d, bytesize);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemAlloc(dptr, bytesize);
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytesize, ctx);
}

/* Pitch: the driver picks the pitch. Charge a bound first (rows rounded to 512 bytes, as
 * drivers do), then settle on the real pitch x height; usage never passes the limit. */
static CUresult settle_pitch(struct vgpu_dev *d, CUcontext ctx, uint64_t bound, CUresult rc,
                             uint64_t ptr, uint64_t actual) {
    if (rc != CUDA_SUCCESS) {
        vgpu_rollback(d, bound);
        return rc;
    }
    if (actual < bound) {
        vgpu_rollback(d, bound - actual);
    } else if (actual > bound && vgpu_charge(d, actual - bound) != CUDA_SUCCESS) {
        vgpu_rollback(d, bound);
        return CUDA_ERROR_OUT_OF_MEMORY; /* the caller frees what the driver gave */
    }
    return finish(d, CUDA_SUCCESS, VGPU_OBJ_PTR, ptr, actual, ctx);
}

static uint64_t pitch_bound(size_t width, size_t height) {
    uint64_t row = ((uint64_t)width + 511) / 512 * 512;
    return height && row > UINT64_MAX / height ? UINT64_MAX : row * height;
}

VGPU_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                     size_t Height, unsigned int ElementSizeBytes) {
    NEED(cuMemAllocPitch_v2);
    if (LIKELY(!vgpu.limited) || !dptr || !pPitch)
        return vgpu.real.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d)
        return UNRESOLVED(ctx, vgpu.real.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height,
                                                            ElementSizeBytes));
    uint64_t bound = pitch_bound(WidthInBytes, Height);
    CUresult rc = vgpu_charge(d, bound);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t actual = rc == CUDA_SUCCESS ? (uint64_t)*pPitch * Height : 0;
    rc = settle_pitch(d, ctx, bound, rc, rc == CUDA_SUCCESS ? *dptr : 0, actual);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && actual) vgpu.real.cuMemFree_v2(*dptr);
    return rc;
}

VGPU_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                  unsigned int Height, unsigned int ElementSizeBytes) {
    NEED(cuMemAllocPitch);
    if (LIKELY(!vgpu.limited) || !dptr || !pPitch)
        return vgpu.real.cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d)
        return UNRESOLVED(ctx, vgpu.real.cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height,
                                                         ElementSizeBytes));
    uint64_t bound = pitch_bound(WidthInBytes, Height);
    CUresult rc = vgpu_charge(d, bound);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t actual = rc == CUDA_SUCCESS ? (uint64_t)*pPitch * Height : 0;
    rc = settle_pitch(d, ctx, bound, rc, rc == CUDA_SUCCESS ? *dptr : 0, actual);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && actual) vgpu.real.cuMemFree(*dptr);
    return rc;
}

/* Managed memory is charged in full to the current device: it may all become resident. */
VGPU_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    NEED(cuMemAllocManaged);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAllocManaged(dptr, bytesize, flags);
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, vgpu.real.cuMemAllocManaged(dptr, bytesize, flags));
    CUresult rc = vgpu_charge(d, bytesize);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemAllocManaged(dptr, bytesize, flags);
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytesize, ctx);
}

/* --- stream-ordered allocation --------------------------------------------------------------
 * Charged to the stream's device (or the pool's); released when the free is enqueued. Pool
 * memory is not owned by a context, so records carry none. */

static struct vgpu_dev *pool_dev(CUmemoryPool pool, CUstream s, int ptsz, CUcontext *ctx) {
    struct vgpu_rec r;
    *ctx = NULL;
    if (pool && vgpu_tab_get(VGPU_OBJ_POOL, (uint64_t)(uintptr_t)pool, &r)) {
        *ctx = (CUcontext)pool; /* only "there is a device", for UNRESOLVED */
        return vgpu_dev(r.ordinal);
    }
    return vgpu_stream_dev(s, ptsz, ctx);
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s, int ptsz) {
    CUresult rc;
#define CALL_REAL()                                                                            \
    (pool ? (ptsz ? vgpu.real.cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, s)                \
                  : vgpu.real.cuMemAllocFromPoolAsync(dptr, bytes, pool, s))                    \
          : (ptsz ? vgpu.real.cuMemAllocAsync_ptsz(dptr, bytes, s)                              \
                  : vgpu.real.cuMemAllocAsync(dptr, bytes, s)))
    CUcontext ctx = NULL;
    struct vgpu_dev *d = dptr ? pool_dev(pool, s, ptsz, &ctx) : NULL;
    if (!d) return UNRESOLVED(ctx, CALL_REAL());
    rc = vgpu_charge(d, bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = CALL_REAL();
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vgpu.cfg.oversubscribe && vgpu.real.cuMemAllocManaged)
        rc = vgpu.real.cuMemAllocManaged(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
#undef CALL_REAL
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytes, NULL);
}

VGPU_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    NEED(cuMemAllocAsync);
    if (LIKELY(!vgpu.limited)) return vgpu.real.cuMemAllocAsync(dptr, bytesize, hStream);
    return alloc_async(dptr, bytesize, NULL, hStream, 0);
}

VGPU_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    NEED(cuMemAllocAsync_ptsz);
    if (LIKELY(!vgpu.limited)) return vgpu.real.cuMemAllocAsync_ptsz(dptr, bytesize, hStream);
    return alloc_async(dptr, bytesize, NULL, hStream, 1);
}

VGPU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream) {
    NEED(cuMemAllocFromPoolAsync);
    if (LIKELY(!vgpu.limited) || !pool) return vgpu.real.cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
    return alloc_async(dptr, bytesize, pool, hStream, 0);
}

VGPU_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                               CUstream hStream) {
    NEED(cuMemAllocFromPoolAsync_ptsz);
    if (LIKELY(!vgpu.limited) || !pool)
        return vgpu.real.cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, hStream);
    return alloc_async(dptr, bytesize, pool, hStream, 1);
}

/* Pools remember their device, so allocations from them are charged there. */
VGPU_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    NEED(cuMemPoolCreate);
    CUresult rc = vgpu.real.cuMemPoolCreate(pool, poolProps);
    if (rc == CUDA_SUCCESS && vgpu.limited && poolProps &&
        poolProps->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        vgpu_tab_put(VGPU_OBJ_POOL, (uint64_t)(uintptr_t)*pool, poolProps->location.id, 0, NULL);
    return rc;
}

VGPU_API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    NEED(cuMemPoolDestroy);
    CUresult rc = vgpu.real.cuMemPoolDestroy(pool);
    struct vgpu_rec r;
    if (rc == CUDA_SUCCESS && vgpu.limited) vgpu_tab_take(VGPU_OBJ_POOL, (uint64_t)(uintptr_t)pool, &r);
    return rc;
}

/* --- frees: take the record first (the address may be reused the moment the driver frees
 * it), put it back if the driver refuses. */

#define FREE_BODY(KIND, KEY, CALL)                                                             \
    do {                                                                                       \
        struct vgpu_rec r_;                                                                    \
        if (LIKELY(!vgpu.limited)) return (CALL);                                              \
        int had_ = vgpu_tab_take((KIND), (KEY), &r_);                                          \
        CUresult rc_ = (CALL);                                                                 \
        if (had_) {                                                                            \
            if (rc_ == CUDA_SUCCESS) give_back(&r_);                                           \
            else vgpu_tab_put(r_.kind, r_.key, r_.ordinal, r_.bytes, r_.ctx);                  \
        }                                                                                      \
        return rc_;                                                                            \
    } while (0)

VGPU_API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    NEED(cuMemFree_v2);
    FREE_BODY(VGPU_OBJ_PTR, dptr, vgpu.real.cuMemFree_v2(dptr));
}

VGPU_API CUresult cuMemFree(CUdeviceptr_v1 dptr) {
    NEED(cuMemFree);
    FREE_BODY(VGPU_OBJ_PTR, dptr, vgpu.real.cuMemFree(dptr));
}

VGPU_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    NEED(cuMemFreeAsync);
    FREE_BODY(VGPU_OBJ_PTR, dptr, vgpu.real.cuMemFreeAsync(dptr, hStream));
}

VGPU_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    NEED(cuMemFreeAsync_ptsz);
    FREE_BODY(VGPU_OBJ_PTR, dptr, vgpu.real.cuMemFreeAsync_ptsz(dptr, hStream));
}

/* --- virtual memory management: the physical handle carries the charge ----------------------- */

VGPU_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                              const CUmemAllocationProp *prop, unsigned long long flags) {
    NEED(cuMemCreate);
    if (LIKELY(!vgpu.limited) || !handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return vgpu.real.cuMemCreate(handle, size, prop, flags); /* host memory: not the GPU's */
    struct vgpu_dev *d = vgpu_dev(prop->location.id);
    if (!d) return vgpu.real.cuMemCreate(handle, size, prop, flags); /* no such device */
    CUresult rc = vgpu_charge(d, size);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMemCreate(handle, size, prop, flags);
    return finish(d, rc, VGPU_OBJ_VMM, rc == CUDA_SUCCESS ? *handle : 0, size, NULL);
}

/* A retained handle must be released as often as it was retained (and created) before its
 * memory goes: count, so that release-after-retain cannot shed the charge early. */
VGPU_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    NEED(cuMemRetainAllocationHandle);
    CUresult rc = vgpu.real.cuMemRetainAllocationHandle(handle, addr);
    struct vgpu_rec r;
    if (rc == CUDA_SUCCESS && vgpu.limited) vgpu_tab_unref(VGPU_OBJ_VMM, *handle, +1, &r);
    return rc;
}

VGPU_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    NEED(cuMemRelease);
    if (LIKELY(!vgpu.limited)) return vgpu.real.cuMemRelease(handle);
    struct vgpu_rec r;
    int refs = vgpu_tab_unref(VGPU_OBJ_VMM, handle, -1, &r);
    CUresult rc = vgpu.real.cuMemRelease(handle);
    if (refs == 0) {
        if (rc == CUDA_SUCCESS) give_back(&r);
        else vgpu_tab_put(r.kind, r.key, r.ordinal, r.bytes, r.ctx);
    } else if (refs > 0 && rc != CUDA_SUCCESS) {
        vgpu_tab_unref(VGPU_OBJ_VMM, handle, +1, &r);
    }
    return rc;
}

/* --- arrays: charged by their byte size ------------------------------------------------------
 * Width x height x depth x element size, depth being a layered array's layers or a cubemap's
 * faces; a mipmapped array is charged the sum of its levels. Sparse and deferred-mapping arrays
 * have no memory of their own: what cuMemMapArrayAsync binds into them comes from cuMemCreate
 * handles, charged there; they pass through uncharged. */

#define UNBACKED(flags) ((flags) & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING))

static uint64_t format_bytes(CUarray_format f) {
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    case CU_AD_FORMAT_UNORM_INT8X1: case CU_AD_FORMAT_SNORM_INT8X1: return 1;
    case CU_AD_FORMAT_UNORM_INT8X2: case CU_AD_FORMAT_SNORM_INT8X2: case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1: return 2;
    case CU_AD_FORMAT_UNORM_INT8X4: case CU_AD_FORMAT_SNORM_INT8X4: case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2: return 4;
    case CU_AD_FORMAT_UNORM_INT16X4: case CU_AD_FORMAT_SNORM_INT16X4: return 8;
    default: return 16; /* formats we do not size: charge generously rather than let them by */
    }
}

static uint64_t sat_mul(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t max1(uint64_t v) { return v ? v : 1; }

/* Levels [0, levels) of an array (1 level unless mipmapped): level l has max(1, extent >> l)
 * elements in each spatial dimension, as NVIDIA documents mip levels; layers and cubemap
 * faces do not shrink. Saturates: a size past 64 bits is refused, not wrapped. */
static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, unsigned int flags, unsigned int levels,
                            CUarray_format f, uint64_t ch) {
    int keep_depth = (flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    uint64_t elem = format_bytes(f) * (ch ? ch : 1), sum = 0;
    for (unsigned int l = 0; l < levels && l < 64; l++) {
        uint64_t n = sat_mul(elem, max1(w >> l));
        n = sat_mul(n, h ? max1(h >> l) : 1);
        n = sat_mul(n, !d ? 1 : keep_depth ? d : max1(d >> l));
        sum = n > UINT64_MAX - sum ? UINT64_MAX : sum + n;
    }
    return sum;
}

/* The levels a mipmapped array gets: clamped to [1, 1 + floor(log2(max(w, h, d)))], as
 * cudaMallocMipmappedArray documents (a level past that would be no smaller than the last). */
static unsigned int mip_levels(unsigned int n, uint64_t w, uint64_t h, uint64_t d) {
    uint64_t m = w > h ? w : h;
    if (d > m) m = d;
    unsigned int top = 1;
    while (m >>= 1) top++;
    return n < 1 ? 1 : n > top ? top : n;
}

static CUresult array_create(CUarray *pHandle, uint64_t bytes, CUresult (*call)(CUarray *, const void *),
                             const void *desc) {
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, call(pHandle, desc));
    CUresult rc = vgpu_charge(d, bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = call(pHandle, desc);
    return finish(d, rc, VGPU_OBJ_ARRAY, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, bytes, ctx);
}

static CUresult call_array_v2(CUarray *h, const void *d) { return vgpu.real.cuArrayCreate_v2(h, d); }
static CUresult call_array_v1(CUarray *h, const void *d) { return vgpu.real.cuArrayCreate(h, d); }
static CUresult call_array3d_v2(CUarray *h, const void *d) { return vgpu.real.cuArray3DCreate_v2(h, d); }
static CUresult call_array3d_v1(CUarray *h, const void *d) { return vgpu.real.cuArray3DCreate(h, d); }

VGPU_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    NEED(cuArrayCreate_v2);
    if (LIKELY(!vgpu.limited) || !pHandle || !d) return vgpu.real.cuArrayCreate_v2(pHandle, d);
    return array_create(pHandle, array_bytes(d->Width, d->Height, 0, 0, 1, d->Format, d->NumChannels),
                        call_array_v2, d);
}

VGPU_API CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d) {
    NEED(cuArrayCreate);
    if (LIKELY(!vgpu.limited) || !pHandle || !d) return vgpu.real.cuArrayCreate(pHandle, d);
    return array_create(pHandle, array_bytes(d->Width, d->Height, 0, 0, 1, d->Format, d->NumChannels),
                        call_array_v1, d);
}

VGPU_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    NEED(cuArray3DCreate_v2);
    if (LIKELY(!vgpu.limited) || !pHandle || !d || UNBACKED(d->Flags))
        return vgpu.real.cuArray3DCreate_v2(pHandle, d);
    return array_create(pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Flags, 1, d->Format, d->NumChannels),
                        call_array3d_v2, d);
}

VGPU_API CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d) {
    NEED(cuArray3DCreate);
    if (LIKELY(!vgpu.limited) || !pHandle || !d || UNBACKED(d->Flags))
        return vgpu.real.cuArray3DCreate(pHandle, d);
    return array_create(pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Flags, 1, d->Format, d->NumChannels),
                        call_array3d_v1, d);
}

VGPU_API CUresult cuArrayDestroy(CUarray hArray) {
    NEED(cuArrayDestroy);
    FREE_BODY(VGPU_OBJ_ARRAY, (uint64_t)(uintptr_t)hArray, vgpu.real.cuArrayDestroy(hArray));
}

/* Its levels (cuMipmappedArrayGetLevel) belong to it: they are neither charged nor freed apart. */
VGPU_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                         unsigned int numMipmapLevels) {
    NEED(cuMipmappedArrayCreate);
    if (LIKELY(!vgpu.limited) || !pHandle || !d || UNBACKED(d->Flags))
        return vgpu.real.cuMipmappedArrayCreate(pHandle, d, numMipmapLevels);
    CUcontext ctx;
    struct vgpu_dev *dev = vgpu_ctx_dev(NULL, &ctx);
    if (!dev) return UNRESOLVED(ctx, vgpu.real.cuMipmappedArrayCreate(pHandle, d, numMipmapLevels));
    uint64_t bytes = array_bytes(d->Width, d->Height, d->Depth, d->Flags,
                                 mip_levels(numMipmapLevels, d->Width, d->Height, d->Depth), d->Format,
                                 d->NumChannels);
    CUresult rc = vgpu_charge(dev, bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = vgpu.real.cuMipmappedArrayCreate(pHandle, d, numMipmapLevels);
    return finish(dev, rc, VGPU_OBJ_MIPMAP, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, bytes, ctx);
}

VGPU_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    NEED(cuMipmappedArrayDestroy);
    FREE_BODY(VGPU_OBJ_MIPMAP, (uint64_t)(uintptr_t)hMipmappedArray,
              vgpu.real.cuMipmappedArrayDestroy(hMipmappedArray));
}
