/* Stream-ordered allocation (cuMemAllocAsync, cuMemFreeAsync) and memory pools.
 *
 * A pool holds node memory in its own name: `reserved` bytes are charged, `used` of them are
 * in live allocations, the rest is cached for the pool's next allocations. A free returns
 * bytes to the cache; the cache above the release threshold (default 0) goes back to the node
 * at the next stream, event or context synchronisation, or with cuMemPoolTrimTo, as on the real
 * driver. Each allocation still gets its own mapping: only the accounting is pooled. */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_internal.h"

static struct CUmemPoolHandle_st *pool_new_locked(int dev, int is_default) {
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->magic = SIM_POOL_MAGIC;
    p->dev = dev;
    p->phys = sim_proc.phys[dev];
    p->is_default = is_default;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
    p->next = sim_proc.pools;
    sim_proc.pools = p;
    return p;
}

static struct CUmemPoolHandle_st *default_pool_locked(int dev) {
    for (struct CUmemPoolHandle_st *p = sim_proc.pools; p; p = p->next)
        if (p->is_default && p->dev == dev) return p;
    return pool_new_locked(dev, 1);
}

static struct CUmemPoolHandle_st *current_pool_locked(int dev) {
    if (!sim_proc.cur_pool[dev]) sim_proc.cur_pool[dev] = default_pool_locked(dev);
    return sim_proc.cur_pool[dev];
}

/* A live pool of this process (handles from callers are looked up, not trusted). */
static int pool_known_locked(const struct CUmemPoolHandle_st *pool) {
    for (struct CUmemPoolHandle_st *p = sim_proc.pools; p; p = p->next)
        if (p == pool) return !p->destroyed;
    return 0;
}

static void release_locked(struct CUmemPoolHandle_st *p, uint64_t keep) {
    if (p->reserved <= keep) return;
    uint64_t cached = p->reserved - p->used;
    uint64_t rel = p->reserved - keep < cached ? p->reserved - keep : cached;
    if (!rel) return;
    simgpu_mem_uncharge(p->phys, rel);
    p->reserved -= rel;
}

void sim_pool_return_locked(struct CUmemPoolHandle_st *pool, uint64_t bytes) {
    pool->used = pool->used >= bytes ? pool->used - bytes : 0;
    if (pool->destroyed) release_locked(pool, 0);
}

void sim_pools_trim_locked(void) {
    for (struct CUmemPoolHandle_st *p = sim_proc.pools; p; p = p->next) release_locked(p, p->destroyed ? 0 : p->threshold);
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = (size + pg - 1) / pg * pg;
    struct sim_alloc *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    struct CUmemPoolHandle_st *p = NULL;
    if (rc == CUDA_SUCCESS) {
        p = pool ? pool : current_pool_locked(c->dev);
        if (!p) rc = CUDA_ERROR_OUT_OF_MEMORY;
        else if (pool && !pool_known_locked(pool)) rc = CUDA_ERROR_INVALID_VALUE;
    }
    uint64_t need = 0;
    if (rc == CUDA_SUCCESS) {
        uint64_t cached = p->reserved - p->used;
        need = size > cached ? size - cached : 0;
        if (need && simgpu_mem_charge(p->phys, need) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *m = rc == CUDA_SUCCESS ? sim_map_anon(len, 0) : NULL;
    if (rc == CUDA_SUCCESS && m) {
        *a = (struct sim_alloc){.base = (uintptr_t)m, .size = size, .map_len = len, .phys = p->phys,
                                .kind = SIM_MEM_ASYNC, .pool = p};
        if (sim_range_insert(a) != 0) {
            munmap(m, len);
            m = NULL;
        }
    }
    if (rc == CUDA_SUCCESS && !m) {
        if (need) simgpu_mem_uncharge(p->phys, need);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        p->reserved += need;
        p->used += size;
        p->reserved_high = sim_max64(p->reserved_high, p->reserved);
        p->used_high = sim_max64(p->used_high, p->used);
        *dptr = (CUdeviceptr)a->base;
    }
    sim_unlock();
    if (rc != CUDA_SUCCESS) free(a);
    return rc;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, NULL, hStream, 0);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, NULL, hStream, 1);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return pool ? alloc_async(dptr, bytesize, pool, hStream, 0) : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return pool ? alloc_async(dptr, bytesize, pool, hStream, 1) : CUDA_ERROR_INVALID_VALUE;
}

/* Also frees ordinary cuMemAlloc memory, which the real driver allows. */
static CUresult free_async(CUdeviceptr dptr, CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS) {
        struct sim_alloc *a = sim_range_find((uintptr_t)dptr);
        if (!a || a->base != (uintptr_t)dptr || a->kind == SIM_MEM_HOST || a->kind == SIM_MEM_VMM)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            sim_alloc_destroy_locked(a);
    }
    sim_unlock();
    return rc;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 0); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 1); }

/* --- pools ------------------------------------------------------------------------------- */

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (poolProps->handleTypes & ~(unsigned int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int dev = poolProps->location.id;
    if (sim_device(dev, NULL) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct CUmemPoolHandle_st *p = pool_new_locked(dev, 0);
    sim_unlock();
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

/* Outstanding allocations keep their charge until freed; the cache goes now. */
CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    if (!pool_known_locked(pool) || pool->is_default) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        pool->destroyed = 1;
        if (sim_proc.cur_pool[pool->dev] == pool) sim_proc.cur_pool[pool->dev] = NULL;
        release_locked(pool, 0);
    }
    sim_unlock();
    return rc;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    if (pool_known_locked(pool)) release_locked(pool, minBytesToKeep);
    else rc = CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    return rc;
}

static CUresult pool_attr(CUmemoryPool pool, CUmemPool_attribute attr, void *value, int set) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    if (!pool_known_locked(pool)) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    cuuint64_t *v64 = value;
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        if (set) pool->reuse[attr - 1] = *(int *)value != 0;
        else *(int *)value = pool->reuse[attr - 1];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        if (set) pool->threshold = *v64;
        else *v64 = pool->threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        if (set) rc = CUDA_ERROR_INVALID_VALUE;
        else *v64 = attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT ? pool->used : pool->reserved;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: {
        uint64_t *high = attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH ? &pool->used_high : &pool->reserved_high;
        uint64_t cur = attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH ? pool->used : pool->reserved;
        if (set && *v64 != 0) rc = CUDA_ERROR_INVALID_VALUE; /* only a reset to 0 is allowed */
        else if (set) *high = cur;
        else *v64 = *high;
        break;
    }
    default:
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    sim_unlock();
    return rc;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attr(pool, attr, value, 1);
}
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attr(pool, attr, value, 0);
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    *pool_out = default_pool_locked(dev);
    sim_unlock();
    return *pool_out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    *pool = current_pool_locked(dev);
    sim_unlock();
    return *pool ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    if (!pool_known_locked(pool) || pool->dev != dev) rc = CUDA_ERROR_INVALID_VALUE;
    else sim_proc.cur_pool[dev] = pool;
    sim_unlock();
    return rc;
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuDeviceGetDefaultMemPool)
SIM_SELF(cuDeviceGetMemPool)
SIM_SELF(cuDeviceSetMemPool)
SIM_SELF(cuMemAllocAsync)
SIM_SELF(cuMemAllocAsync_ptsz)
SIM_SELF(cuMemAllocFromPoolAsync)
SIM_SELF(cuMemAllocFromPoolAsync_ptsz)
SIM_SELF(cuMemFreeAsync)
SIM_SELF(cuMemFreeAsync_ptsz)
SIM_SELF(cuMemPoolCreate)
SIM_SELF(cuMemPoolDestroy)
SIM_SELF(cuMemPoolGetAttribute)
SIM_SELF(cuMemPoolSetAttribute)
SIM_SELF(cuMemPoolTrimTo)
