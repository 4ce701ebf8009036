/* Memory hooks: every allocation path charges the region before the driver allocates, and
 * every free gives back exactly what its allocation charged.
 *
 * Pattern: charge (atomic check-and-reserve across the container's processes) -> real call ->
 * commit and record, or roll back. Over the limit nothing reaches the driver and the caller
 * gets CUDA_ERROR_OUT_OF_MEMORY. Frees always reach the driver; an unknown pointer is simply
 * forwarded. With no limits at all every hook is a forward after one branch. */
#include <string.h>

#include "ptrtab.h"
#include "shim.h"

#define NEED VGPU_NEED

/* After the real call: commit and record, or roll back. */
static inline __attribute__((always_inline)) CUresult finish(struct vgpu_dev *d, CUresult rc, int kind, uint64_t key, uint64_t bytes,
                       CUcontext ctx) {
    if (rc != CUDA_SUCCESS) {
        vgpu_rollback(d, bytes);
        return rc;
    }
    vgpu_commit(d, bytes);
    if (d->accounted && vgpu_tab_put_inline(kind, key, d->ordinal, bytes, ctx, 1) != 0)
        VLOG(VGPU_LOG_ERROR, "out of memory recording an allocation: its %llu bytes stay "
             "charged until the process exits", (unsigned long long)bytes);
    return CUDA_SUCCESS;
}

/* Release what the record of (kind, key) charged; it was taken out already. The records
 * given back here (pointers, arrays, VMM handles) are made by finish() and pool.c's managed
 * fallback, from a resolved device: its ordinal is in range and the device ready. A release
 * of 0 bytes changes nothing. */
static inline __attribute__((always_inline)) void give_back(const struct vgpu_rec *r) {
    const struct vgpu_dev *d = &vgpu.dev[r->ordinal];
    if (d->accounted) vgpu_region_release_dev(vgpu.region, d->rdev, r->bytes);
}

/* --- device memory --------------------------------------------------------------------------- */

/* No device for the call: without a context (ctx NULL) the driver answers, and refuses too;
 * a context whose device the shim cannot resolve is refused while limits are in force. */

/* The ABIs of an entry point differ only in widths: the legacy (v1) forms of CUDA < 3.2 take
 * and return 32-bit pointers and sizes. Each kind of allocation has one implementation taking
 * `v1`, a constant at every call (inlined, so the v2 path pays nothing for it). */

static inline CUresult real_alloc(int v1, CUdeviceptr *dptr, size_t bytes) {
    if (!v1) return vgpu.real.cuMemAlloc_v2(dptr, bytes);
    CUdeviceptr_v1 p = 0;
    CUresult rc = vgpu.real.cuMemAlloc(&p, (unsigned int)bytes);
    *dptr = p;
    return rc;
}

static CUresult real_pitch_v1(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem);

static inline CUresult real_free(int v1, CUdeviceptr p) {
    return v1 ? vgpu.real.cuMemFree((CUdeviceptr_v1)p) : vgpu.real.cuMemFree_v2(p);
}

/* Oversubscribed (CUDA_OVERSUBSCRIBE=true): an allocation the limit admits but the GPU cannot
 * hold becomes managed (host-backed) memory of the same size. A v1 caller can only take a
 * 32-bit address: a managed pointer above 4 GiB is given back and the allocation refused. */
CUresult vgpu_managed_fallback(struct vgpu_dev *d, int v1, CUdeviceptr *dptr, size_t bytes) {
    if (!vgpu.cfg.oversubscribe || !vgpu.real.cuMemAllocManaged) return CUDA_ERROR_OUT_OF_MEMORY;
    CUdeviceptr p = 0;
    CUresult rc = vgpu.real.cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL);
    if (rc == CUDA_SUCCESS && v1 && p > 0xffffffffull) {
        vgpu.real.cuMemFree_v2(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        *dptr = p;
        vgpu_note_fallback(d);
        VLOG(VGPU_LOG_DEBUG, "%zu bytes on GPU %s fell back to managed memory", bytes, d->uuid);
    }
    return rc;
}

static inline __attribute__((always_inline)) CUresult mem_alloc(int v1, CUdeviceptr *dptr, size_t bytes) {
    VGPU_CODE_SETTLE(); /* cuMemAlloc_v2 comes here, off its hot path, while one is due */
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, real_alloc(v1, dptr, bytes));
    CUresult rc = vgpu_charge(d, bytes);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real_alloc(v1, dptr, bytes);
    if (UNLIKELY(rc == CUDA_ERROR_OUT_OF_MEMORY)) rc = vgpu_managed_fallback(d, v1, dptr, bytes);
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytes, ctx);
}

/* cuMemAlloc_v2's uncommon cases, out of line: the hook's common path then saves fewer
 * registers. `charged`: the lock-free reservation was made and the driver answered rc. */
static CUresult __attribute__((noinline)) mem_alloc_v2_rest(struct vgpu_dev *d, CUcontext ctx, CUdeviceptr *dptr,
                                                            size_t bytes, int charged, CUresult rc) {
    if (!d) return UNRESOLVED(ctx, real_alloc(0, dptr, bytes));
    if (!charged) { /* vgpu_charge, less the lock-free attempt made already */
        if (d->accounted) {
            int st = vgpu_region_reserve_slow(vgpu.region, d->rdev, bytes);
            if (st != VGPU_REGION_OK && vgpu_charge_denied(d, bytes, st) != CUDA_SUCCESS)
                return CUDA_ERROR_OUT_OF_MEMORY;
        } else if (d->fail_closed) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        rc = real_alloc(0, dptr, bytes);
    }
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) rc = vgpu_managed_fallback(d, 0, dptr, bytes);
    return finish(d, rc, VGPU_OBJ_PTR, rc == CUDA_SUCCESS ? *dptr : 0, bytes, ctx);
}

/* The common case of a limited process, all inline: the device of the thread's cached
 * context is accounted, the lock-free reservation fits, the driver allocates; our slot's
 * entry is kept across the driver's call for the commit. */
static inline __attribute__((always_inline)) CUresult mem_alloc_v2_hot(CUdeviceptr *dptr, size_t bytes) {
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev_current(&ctx);
    struct vgpu_slot_device *sd;
    if (UNLIKELY(!d || !d->accounted || !(sd = vgpu_region_reserve_fast(vgpu.region, d->rdev, bytes))))
        return mem_alloc_v2_rest(d, ctx, dptr, bytes, 0, CUDA_SUCCESS);
    CUresult rc = vgpu.real.cuMemAlloc_v2(dptr, bytes);
    if (UNLIKELY(rc != CUDA_SUCCESS)) return mem_alloc_v2_rest(d, ctx, dptr, bytes, 1, rc);
    vgpu_region_commit_sd(sd, bytes);
    if (UNLIKELY(vgpu_tab_put_inline(VGPU_OBJ_PTR, *dptr, d->ordinal, bytes, ctx, 1) != 0))
        VLOG(VGPU_LOG_ERROR, "out of memory recording an allocation: its %llu bytes stay "
             "charged until the process exits", (unsigned long long)bytes);
    return CUDA_SUCCESS;
}

VGPU_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (UNLIKELY(!__atomic_load_n(&vgpu.mem_hot, __ATOMIC_ACQUIRE) || !dptr)) {
        NEED(cuMemAlloc_v2);
        if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAlloc_v2(dptr, bytesize);
        return mem_alloc(0, dptr, bytesize);
    }
    return mem_alloc_v2_hot(dptr, bytesize);
}

/* The 32-bit ABI of CUDA < 3.2: still exported by drivers, so a way around the limit. */
VGPU_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    NEED(cuMemAlloc);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAlloc(dptr, bytesize);
    CUdeviceptr p = 0;
    CUresult rc = mem_alloc(1, &p, bytesize);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr_v1)p;
    return rc;
}

/* Pitch: the driver picks the pitch. Charge a bound first (rows rounded to 512 bytes, as
 * drivers do), then settle on the real pitch x height; usage never passes the limit.
 * Oversubscribed, a pitch the GPU cannot hold becomes managed memory with the bound's pitch. */
static uint64_t pitch_row(size_t width) { return ((uint64_t)width + 511) / 512 * 512; }

static uint64_t pitch_bound(size_t width, size_t height) {
    uint64_t row = pitch_row(width);
    return height && row > UINT64_MAX / height ? UINT64_MAX : row * height;
}

static CUresult mem_alloc_pitch(int v1, CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                unsigned int elem) {
    VGPU_CODE_SETTLE();
#define REAL_PITCH()                                                                           \
    (v1 ? real_pitch_v1(dptr, pitch, width, height, elem)                                      \
        : vgpu.real.cuMemAllocPitch_v2(dptr, pitch, width, height, elem))
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, &ctx);
    if (!d) return UNRESOLVED(ctx, REAL_PITCH());
    uint64_t bound = pitch_bound(width, height);
    CUresult rc = vgpu_charge(d, bound);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL_PITCH();
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && bound != UINT64_MAX &&
        vgpu_managed_fallback(d, v1, dptr, (size_t)bound) == CUDA_SUCCESS) {
        *pitch = (size_t)pitch_row(width);
        return finish(d, CUDA_SUCCESS, VGPU_OBJ_PTR, *dptr, bound, ctx);
    }
#undef REAL_PITCH
    if (rc != CUDA_SUCCESS) {
        vgpu_rollback(d, bound);
        return rc;
    }
    uint64_t actual = (uint64_t)*pitch * height;
    if (actual < bound) {
        vgpu_rollback(d, bound - actual);
    } else if (actual > bound && vgpu_charge(d, actual - bound) != CUDA_SUCCESS) {
        vgpu_rollback(d, bound);
        real_free(v1, *dptr); /* a pitch past the bound that the limit cannot take */
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return finish(d, CUDA_SUCCESS, VGPU_OBJ_PTR, *dptr, actual, ctx);
}

static CUresult real_pitch_v1(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem) {
    CUdeviceptr_v1 p = 0;
    unsigned int pt = 0;
    CUresult rc = vgpu.real.cuMemAllocPitch(&p, &pt, (unsigned int)width, (unsigned int)height, elem);
    *dptr = p;
    *pitch = pt;
    return rc;
}

VGPU_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                     size_t Height, unsigned int ElementSizeBytes) {
    NEED(cuMemAllocPitch_v2);
    if (LIKELY(!vgpu.limited) || !dptr || !pPitch)
        return vgpu.real.cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    return mem_alloc_pitch(0, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}

VGPU_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                  unsigned int Height, unsigned int ElementSizeBytes) {
    NEED(cuMemAllocPitch);
    if (LIKELY(!vgpu.limited) || !dptr || !pPitch)
        return vgpu.real.cuMemAllocPitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUresult rc = mem_alloc_pitch(1, &p, &pitch, WidthInBytes, Height, ElementSizeBytes);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
}

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

/* Stream-ordered allocation and pools: pool.c. */

/* --- frees: take the record first (the address may be reused the moment the driver frees
 * it), put it back if the driver refuses. One implementation for every free of a pointer,
 * array or mipmapped array; `which` names the real entry point. */

enum real_free_fn { FREE_V2, FREE_V1, FREE_ARRAY, FREE_MIPMAP };

static inline CUresult real_free_any(enum real_free_fn which, uint64_t key) {
    switch (which) {
    case FREE_V2: return vgpu.real.cuMemFree_v2((CUdeviceptr)key);
    case FREE_V1: return vgpu.real.cuMemFree((CUdeviceptr_v1)key);
    case FREE_ARRAY: return vgpu.real.cuArrayDestroy((CUarray)(uintptr_t)key);
    default: return vgpu.real.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)key);
    }
}

/* A free in a limited process. */
static inline __attribute__((always_inline)) CUresult mem_free_limited(enum real_free_fn which, int kind,
                                                                       uint64_t key) {
    struct vgpu_rec r;
    int had = vgpu_tab_take_inline(kind, key, &r);
    /* cuMemFree also frees stream-ordered memory (the driver synchronises first). */
    int pooled = !had && kind == VGPU_OBJ_PTR && vgpu_tab_take(VGPU_OBJ_POOLPTR, key, &r);
    if (!had && !pooled) return real_free_any(which, key);
    vgpu_release_begin();
    CUresult rc = real_free_any(which, key);
    if (rc != CUDA_SUCCESS) vgpu_tab_restore(&r);
    else if (pooled) vgpu_pool_freed(&r);
    else give_back(&r);
    vgpu_release_end();
    return rc;
}

static inline __attribute__((always_inline)) CUresult mem_free(enum real_free_fn which, int kind, uint64_t key) {
    if (LIKELY(!vgpu.limited)) return real_free_any(which, key);
    return mem_free_limited(which, kind, key);
}

VGPU_API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (UNLIKELY(!__atomic_load_n(&vgpu.mem_hot, __ATOMIC_ACQUIRE))) {
        NEED(cuMemFree_v2);
        if (LIKELY(!vgpu.limited)) return vgpu.real.cuMemFree_v2(dptr);
    }
    return mem_free_limited(FREE_V2, VGPU_OBJ_PTR, dptr);
}

VGPU_API CUresult cuMemFree(CUdeviceptr_v1 dptr) {
    NEED(cuMemFree);
    return mem_free(FREE_V1, VGPU_OBJ_PTR, dptr);
}

/* --- virtual memory management: the physical handle carries the charge ----------------------- */

VGPU_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                              const CUmemAllocationProp *prop, unsigned long long flags) {
    NEED(cuMemCreate);
    if (LIKELY(!vgpu.limited) || !handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return vgpu.real.cuMemCreate(handle, size, prop, flags); /* host memory: not the GPU's */
    VGPU_CODE_SETTLE();
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
    if (refs == 0) vgpu_release_begin();
    CUresult rc = vgpu.real.cuMemRelease(handle);
    if (refs == 0) {
        if (rc == CUDA_SUCCESS) give_back(&r);
        else vgpu_tab_restore(&r);
        vgpu_release_end();
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
    return mem_free(FREE_ARRAY, VGPU_OBJ_ARRAY, (uint64_t)(uintptr_t)hArray);
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
    return mem_free(FREE_MIPMAP, VGPU_OBJ_MIPMAP, (uint64_t)(uintptr_t)hMipmappedArray);
}
