/* Stream-ordered allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync): a pool
 * holds GPU memory in its own name, and keeps what its allocations free cached, up to its
 * release threshold (PyTorch's and CuPy's async allocators set it to the maximum). So what is
 * charged is the pool's *reservation*, never its allocations:
 *
 * - an allocation first reserves the request (rounded up to the 2 MiB a pool grows by) in the
 *   region, calls the driver, reads the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT and keeps
 *   the growth since the pool's last reading; the rest of the reservation is given back (a
 *   growth above it is charged on top, and refused like any allocation);
 * - a free keeps the charge while the pool keeps the memory; what the pool has released since
 *   (a synchronisation brought it down to its threshold, cuMemPoolTrimTo) is given back at its
 *   next call from this process, or at a view (cuMemGetInfo);
 * - before any allocation of the container is refused, this process's pools on the device are
 *   trimmed to nothing (vgpu_pools_trim) and the reservation retried: cached memory never
 *   stands between the container and its limit.
 * Each pool's reading and adjustment happen under the pool's (process-private) mutex, so
 * concurrent allocations from one pool settle in order. */
#include <string.h>

#include "shim.h"

#define NEED VGPU_NEED

enum { MAX_POOLS = 64 };
#define POOL_GRANULE (2ull << 20) /* a pool grows by at least this much */

struct pool {
    CUmemoryPool h; /* NULL: a free entry */
    int ordinal;
    int destroyed;
    uint64_t charged; /* bytes charged for it: its reservation at its last reading */
    uint64_t live;    /* bytes of its allocations not freed yet */
    pthread_mutex_t mu;
};

static struct {
    pthread_mutex_t mu; /* entries come and go under it */
    int any;            /* some pool was ever used: synchronisations look at them */
    struct pool p[MAX_POOLS];
} g_pools = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The entry of pool h, made (on `ordinal`) if new; NULL when the table is full. */
static struct pool *pool_entry(CUmemoryPool h, int ordinal) {
    struct pool *hit = NULL, *free_e = NULL;
    pthread_mutex_lock(&g_pools.mu);
    for (int i = 0; i < MAX_POOLS && !hit; i++) {
        struct pool *p = &g_pools.p[i];
        if (p->h == h && !p->destroyed) hit = p;
        else if (!free_e && (!p->h || (p->destroyed && !p->live && !p->charged))) free_e = p;
    }
    if (!hit && free_e) {
        pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        *free_e = (struct pool){.ordinal = ordinal, .mu = mu};
        __atomic_store_n(&free_e->h, h, __ATOMIC_RELEASE); /* for_pools_on looks without g_pools.mu */
        __atomic_store_n(&g_pools.any, 1, __ATOMIC_RELEASE);
        hit = free_e;
    }
    pthread_mutex_unlock(&g_pools.mu);
    return hit;
}

static int reserved_of(CUmemoryPool h, uint64_t *out) {
    cuuint64_t v = 0;
    if (!vgpu.real.cuMemPoolGetAttribute ||
        vgpu.real.cuMemPoolGetAttribute(h, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *out = v;
    return 0;
}

/* Give back what the pool released since its last reading. p->mu held. */
static uint64_t reconcile_locked(struct pool *p, struct vgpu_dev *d) {
    uint64_t r;
    if (p->destroyed || reserved_of(p->h, &r) != 0 || r >= p->charged) return 0;
    uint64_t gone = p->charged - r;
    p->charged = r;
    vgpu_uncharge(d, gone);
    return gone;
}

/* d NULL: every device's pools that hold more than their live allocations. */
static void for_pools_on(struct vgpu_dev *d, int trim, uint64_t *released) {
    for (int i = 0; i < MAX_POOLS; i++) {
        struct pool *p = &g_pools.p[i];
        if (!__atomic_load_n(&p->h, __ATOMIC_ACQUIRE) || (d && p->ordinal != d->ordinal)) continue;
        struct vgpu_dev *pd = d ? d : vgpu_dev(p->ordinal);
        if (!pd) continue;
        /* A pool whose own allocation is refusing right now is skipped (its mutex is ours). */
        if (pthread_mutex_trylock(&p->mu) != 0) continue;
        if (!p->destroyed && p->h && (d || p->charged > p->live)) {
            if (trim && vgpu.real.cuMemPoolTrimTo) vgpu.real.cuMemPoolTrimTo(p->h, 0);
            *released += reconcile_locked(p, pd);
        }
        pthread_mutex_unlock(&p->mu);
    }
}

uint64_t vgpu_pools_trim(struct vgpu_dev *d) {
    uint64_t released = 0;
    for_pools_on(d, 1, &released);
    if (released)
        VLOG(VGPU_LOG_INFO, "trimmed this process's pools on GPU %s: %llu bytes released", d->uuid,
             (unsigned long long)released);
    return released;
}

void vgpu_pools_reconcile(struct vgpu_dev *d) {
    uint64_t released = 0;
    /* A process that never made a pool (most, and every view) looks at no pool entry. */
    if (__atomic_load_n(&g_pools.any, __ATOMIC_ACQUIRE)) for_pools_on(d, 0, &released);
}

void vgpu_pools_settle(void) {
    uint64_t released = 0;
    if (__atomic_load_n(&g_pools.any, __ATOMIC_ACQUIRE)) for_pools_on(NULL, 0, &released);
    vgpu_graphs_settle();
}

void vgpu_pool_freed(const struct vgpu_rec *r) {
    if (!r->refs || r->refs > MAX_POOLS) return;
    struct pool *p = &g_pools.p[r->refs - 1];
    struct vgpu_dev *d = vgpu_dev(r->ordinal);
    pthread_mutex_lock(&p->mu);
    p->live = p->live > r->bytes ? p->live - r->bytes : 0;
    if (d && p->destroyed) {
        /* Its cache went with it: what stays charged is its live allocations. */
        uint64_t gone = p->charged > p->live ? p->charged - p->live : 0;
        p->charged -= gone;
        vgpu_uncharge(d, gone);
    } else if (d) {
        reconcile_locked(p, d);
    }
    pthread_mutex_unlock(&p->mu);
}

/* --- allocation ------------------------------------------------------------------------------ */

static inline CUresult real_alloc_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s,
                                        int explicit_pool, int ptsz) {
    if (explicit_pool)
        return ptsz ? vgpu.real.cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, s)
                    : vgpu.real.cuMemAllocFromPoolAsync(dptr, bytes, pool, s);
    return ptsz ? vgpu.real.cuMemAllocAsync_ptsz(dptr, bytes, s) : vgpu.real.cuMemAllocAsync(dptr, bytes, s);
}

/* The pool an allocation comes from: the one named, or the device's current pool. */
static struct pool *pool_of(CUmemoryPool named, struct vgpu_dev *d) {
    CUmemoryPool h = named;
    if (!h && (!vgpu.real.cuDeviceGetMemPool || vgpu.real.cuDeviceGetMemPool(&h, d->ordinal) != CUDA_SUCCESS))
        return NULL;
    return h ? pool_entry(h, d->ordinal) : NULL;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool named, CUstream s, int ptsz) {
    VGPU_CODE_SETTLE();
    int explicit_pool = named != NULL;
    CUcontext ctx = NULL;
    struct vgpu_dev *d = vgpu_stream_dev(s, ptsz, &ctx);
    struct pool *p = d ? pool_of(named, d) : NULL;
    if (p && p->ordinal != d->ordinal) d = vgpu_dev(p->ordinal); /* a pool of another GPU */
    if (!d || !p) return UNRESOLVED(ctx, real_alloc_async(dptr, bytes, named, s, explicit_pool, ptsz));
    /* Captured into a graph: the driver gives it memory when the graph runs (graph.c). */
    CUstreamCaptureStatus cap = CU_STREAM_CAPTURE_STATUS_NONE;
    __typeof__(cuStreamIsCapturing) *is_cap = ptsz ? vgpu.real.cuStreamIsCapturing_ptsz : vgpu.real.cuStreamIsCapturing;
    if (is_cap && is_cap(s, &cap) == CUDA_SUCCESS && cap != CU_STREAM_CAPTURE_STATUS_NONE)
        __atomic_store_n(&vgpu.graph_mem, 1, __ATOMIC_RELEASE);
    uint64_t pre = bytes > UINT64_MAX - POOL_GRANULE ? UINT64_MAX : ((uint64_t)bytes + POOL_GRANULE - 1) & ~(POOL_GRANULE - 1);
    CUresult rc = vgpu_charge(d, pre);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&p->mu);
    rc = real_alloc_async(dptr, bytes, p->h, s, explicit_pool, ptsz);
    if (rc == CUDA_SUCCESS) {
        uint64_t r, grew = bytes; /* the request, if the driver does not say */
        if (reserved_of(p->h, &r) == 0) {
            grew = r > p->charged ? r - p->charged : 0;
            if (r < p->charged) { /* released meanwhile: give that back too */
                vgpu_uncharge(d, p->charged - r);
                p->charged = r;
            }
        }
        if (grew <= pre) {
            vgpu_commit(d, grew);
            vgpu_rollback(d, pre - grew);
        } else if (vgpu_commit(d, pre), vgpu_charge(d, grew - pre) == CUDA_SUCCESS) {
            vgpu_commit(d, grew - pre);
        } else {
            /* The pool grew past what the limit leaves: undo the allocation and its growth. */
            CUdeviceptr gone = *dptr;
            (ptsz ? vgpu.real.cuMemFreeAsync_ptsz : vgpu.real.cuMemFreeAsync)(gone, s);
            (ptsz ? vgpu.real.cuStreamSynchronize_ptsz : vgpu.real.cuStreamSynchronize)(s);
            vgpu.real.cuMemPoolTrimTo(p->h, 0);
            p->charged += pre;
            reconcile_locked(p, d);
            pthread_mutex_unlock(&p->mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        p->charged += grew;
        p->live += bytes;
        struct vgpu_rec rec = {.key = *dptr, .bytes = bytes, .ordinal = (int16_t)d->ordinal,
                               .kind = VGPU_OBJ_POOLPTR, .refs = (uint32_t)(p - g_pools.p) + 1};
        pthread_mutex_unlock(&p->mu);
        if (vgpu_tab_put_rec(&rec) != 0)
            VLOG(VGPU_LOG_ERROR, "out of memory recording a pool allocation");
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&p->mu);
    /* Oversubscribed: the GPU cannot hold it, the limit can: managed memory, charged itself. */
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && vgpu_managed_fallback(d, 0, dptr, bytes) == CUDA_SUCCESS) {
        vgpu_commit(d, bytes);
        vgpu_rollback(d, pre - bytes);
        if (vgpu_tab_put(VGPU_OBJ_PTR, *dptr, d->ordinal, bytes, NULL) != 0)
            VLOG(VGPU_LOG_ERROR, "out of memory recording an allocation");
        return CUDA_SUCCESS;
    }
    vgpu_rollback(d, pre);
    return rc;
}

VGPU_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    NEED(cuMemAllocAsync);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAllocAsync(dptr, bytesize, hStream);
    return alloc_async(dptr, bytesize, NULL, hStream, 0);
}

VGPU_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    NEED(cuMemAllocAsync_ptsz);
    if (LIKELY(!vgpu.limited) || !dptr) return vgpu.real.cuMemAllocAsync_ptsz(dptr, bytesize, hStream);
    return alloc_async(dptr, bytesize, NULL, hStream, 1);
}

VGPU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                          CUstream hStream) {
    NEED(cuMemAllocFromPoolAsync);
    if (LIKELY(!vgpu.limited) || !pool || !dptr)
        return vgpu.real.cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
    return alloc_async(dptr, bytesize, pool, hStream, 0);
}

VGPU_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                               CUstream hStream) {
    NEED(cuMemAllocFromPoolAsync_ptsz);
    if (LIKELY(!vgpu.limited) || !pool || !dptr)
        return vgpu.real.cuMemAllocFromPoolAsync_ptsz(dptr, bytesize, pool, hStream);
    return alloc_async(dptr, bytesize, pool, hStream, 1);
}

/* --- frees ----------------------------------------------------------------------------------- */

static CUresult free_async(CUdeviceptr dptr, CUstream s, int ptsz) {
#define REAL_FREE() (ptsz ? vgpu.real.cuMemFreeAsync_ptsz(dptr, s) : vgpu.real.cuMemFreeAsync(dptr, s))
    if (LIKELY(!vgpu.limited)) return REAL_FREE();
    struct vgpu_rec r;
    int pooled = vgpu_tab_take(VGPU_OBJ_POOLPTR, dptr, &r);
    int plain = !pooled && vgpu_tab_take(VGPU_OBJ_PTR, dptr, &r); /* cuMemAlloc'ed, or managed */
    CUresult rc = REAL_FREE();
#undef REAL_FREE
    if (!pooled && !plain) return rc;
    if (rc != CUDA_SUCCESS) {
        vgpu_tab_restore(&r);
    } else if (pooled) {
        vgpu_pool_freed(&r);
    } else {
        struct vgpu_dev *d = vgpu_dev(r.ordinal);
        if (d) vgpu_uncharge(d, r.bytes); /* given back when the free is enqueued */
    }
    return rc;
}

VGPU_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    NEED(cuMemFreeAsync);
    return free_async(dptr, hStream, 0);
}

VGPU_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    NEED(cuMemFreeAsync_ptsz);
    return free_async(dptr, hStream, 1);
}

/* --- pools ------------------------------------------------------------------------------------ */

/* A pool made on a GPU is known from the start, so allocations from it are charged there. */
VGPU_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    NEED(cuMemPoolCreate);
    CUresult rc = vgpu.real.cuMemPoolCreate(pool, poolProps);
    if (rc == CUDA_SUCCESS && vgpu.limited && poolProps &&
        poolProps->location.type == CU_MEM_LOCATION_TYPE_DEVICE && !pool_entry(*pool, poolProps->location.id))
        VLOG(VGPU_LOG_WARN, "more than %d pools: allocations from pool %p are charged to their stream's GPU",
             MAX_POOLS, (void *)*pool);
    return rc;
}

/* Its cache goes with it; its live allocations stay charged until freed. */
VGPU_API CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    NEED(cuMemPoolDestroy);
    CUresult rc = vgpu.real.cuMemPoolDestroy(pool);
    if (rc != CUDA_SUCCESS || !vgpu.limited) return rc;
    pthread_mutex_lock(&g_pools.mu);
    struct pool *p = NULL;
    for (int i = 0; i < MAX_POOLS && !p; i++)
        if (g_pools.p[i].h == pool && !g_pools.p[i].destroyed) p = &g_pools.p[i];
    pthread_mutex_unlock(&g_pools.mu);
    if (!p) return rc;
    struct vgpu_dev *d = vgpu_dev(p->ordinal);
    pthread_mutex_lock(&p->mu);
    p->destroyed = 1;
    uint64_t gone = p->charged > p->live ? p->charged - p->live : 0;
    p->charged -= gone;
    if (d) vgpu_uncharge(d, gone);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* --- synchronisations: where the driver brings pools down to their release threshold, so
 * where what they released is given back; and where what launches loaded is settled when a
 * settle is due (ctx.c): a program that only launches and waits for its results, allocating
 * nothing, has its code charged there. */

VGPU_API CUresult cuCtxSynchronize(void) {
    NEED(cuCtxSynchronize);
    CUresult rc = vgpu.real.cuCtxSynchronize();
    if (vgpu.limited) {
        vgpu_pools_settle();
        VGPU_CODE_SETTLE();
    }
    return rc;
}

VGPU_API CUresult cuStreamSynchronize(CUstream hStream) {
    NEED(cuStreamSynchronize);
    CUresult rc = vgpu.real.cuStreamSynchronize(hStream);
    if (vgpu.limited) {
        vgpu_pools_settle();
        VGPU_CODE_SETTLE();
    }
    return rc;
}

VGPU_API CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    NEED(cuStreamSynchronize_ptsz);
    CUresult rc = vgpu.real.cuStreamSynchronize_ptsz(hStream);
    if (vgpu.limited) {
        vgpu_pools_settle();
        VGPU_CODE_SETTLE();
    }
    return rc;
}
