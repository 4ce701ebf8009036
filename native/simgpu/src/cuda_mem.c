/* Device memory: the process's address table, cuMemAlloc and its pitch/managed/host forms,
 * arrays (plain, layered, cubemap, mipmapped, sparse), cuMemGetInfo, cuPointerGetAttribute.
 *
 * Device memory is real host memory, so copies and memsets really move data: an allocation is
 * an anonymous MAP_NORESERVE mapping (no RAM until touched) whose address is the CUdeviceptr.
 * The node is charged the bytes a real driver would take from the GPU; the table remembers
 * what each allocation charged so its free gives back exactly that. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_internal.h"

/* --- the address table: allocations and VMM mappings, sorted by base ---------------------- */

static struct sim_alloc **g_tab;
static size_t g_n, g_cap;

/* Index of the last entry whose base <= p, or -1. */
static long floor_index(uintptr_t p) {
    long lo = 0, hi = (long)g_n - 1, best = -1;
    while (lo <= hi) {
        long mid = (lo + hi) / 2;
        if (g_tab[mid]->base <= p) {
            best = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return best;
}

int sim_range_insert(struct sim_alloc *a) {
    if (g_n == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 256;
        struct sim_alloc **t = realloc(g_tab, cap * sizeof *t);
        if (!t) return -1;
        g_tab = t;
        g_cap = cap;
    }
    size_t at = (size_t)(floor_index(a->base) + 1);
    memmove(&g_tab[at + 1], &g_tab[at], (g_n - at) * sizeof *g_tab);
    g_tab[at] = a;
    g_n++;
    return 0;
}

void sim_range_remove(struct sim_alloc *a) {
    long i = floor_index(a->base);
    while (i >= 0 && g_tab[i] != a) i--; /* equal bases cannot happen; be safe anyway */
    if (i < 0) return;
    memmove(&g_tab[i], &g_tab[i + 1], (g_n - (size_t)i - 1) * sizeof *g_tab);
    g_n--;
}

struct sim_alloc *sim_range_find(uintptr_t p) {
    long i = floor_index(p);
    if (i < 0) return NULL;
    struct sim_alloc *a = g_tab[i];
    return p < a->base + a->size ? a : NULL;
}

CUresult sim_range_check(uintptr_t p, size_t n, int write) {
    if (n == 0) return CUDA_SUCCESS;
    if (p + n < p) return CUDA_ERROR_INVALID_VALUE;
    /* Walk adjacent entries: a copy may span several VMM mappings of one reserved range. */
    for (uintptr_t cur = p; cur < p + n;) {
        struct sim_alloc *a = sim_range_find(cur);
        if (!a) return CUDA_ERROR_INVALID_VALUE;
        if (a->kind == SIM_MEM_VMM && (!(a->prot & PROT_READ) || (write && !(a->prot & PROT_WRITE))))
            return CUDA_ERROR_INVALID_VALUE;
        cur = a->base + a->size;
    }
    return CUDA_SUCCESS;
}

void *sim_map_anon(size_t len, int low32) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
#ifdef MAP_32BIT
    if (low32) flags |= MAP_32BIT; /* the legacy v1 ABI has 32-bit device pointers */
#else
    if (low32) return NULL;
#endif
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

/* Managed memory lives in host memory: the process's live managed bytes are bounded by the
 * host's RAM, or by SIMGPU_MANAGED_LIMIT (bytes, or a number with k, m, g or t). */
static uint64_t g_managed; /* live managed bytes (sim_lock) */

static uint64_t g_managed_limit;
static pthread_once_t g_managed_once = PTHREAD_ONCE_INIT;

/* "4096", "512m", "2g"... -> bytes; 0 on anything else. */
static uint64_t parse_size(const char *s) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno || *s == '-') return 0;
    unsigned shift = 0;
    switch (*end ? *end | 0x20 : 0) {
    case 0: break;
    case 'k': shift = 10; break;
    case 'm': shift = 20; break;
    case 'g': shift = 30; break;
    case 't': shift = 40; break;
    default: return 0;
    }
    if (*end && end[1]) return 0;
    return v > (UINT64_MAX >> shift) ? 0 : (uint64_t)v << shift;
}

static void managed_limit_init(void) {
    const char *env = getenv("SIMGPU_MANAGED_LIMIT");
    if (env && *env) {
        g_managed_limit = parse_size(env);
        if (g_managed_limit) return;
        fprintf(stderr, "[simgpu] SIMGPU_MANAGED_LIMIT=%s is not a size (bytes, or a number with k, m, g or t): "
                "bounding managed memory by the host's memory\n", env);
    }
    long pages = sysconf(_SC_PHYS_PAGES), pg = sysconf(_SC_PAGESIZE);
    g_managed_limit = pages > 0 && pg > 0 ? (uint64_t)pages * (uint64_t)pg : UINT64_MAX;
}

static uint64_t managed_limit(void) {
    pthread_once(&g_managed_once, managed_limit_init);
    return g_managed_limit;
}

void sim_alloc_destroy_locked(struct sim_alloc *a) {
    if (a->kind == SIM_MEM_MANAGED) g_managed -= a->size;
    sim_range_remove(a);
    munmap((void *)a->base, a->map_len);
    if (a->kind == SIM_MEM_ASYNC) sim_pool_return_locked(a->pool, a->size);
    else if (a->charged) simgpu_mem_uncharge(a->phys, a->charged);
    free(a);
}

/* Map `size` bytes for ctx, charged `charge` (already taken by the caller), and record it. */
static CUresult record_alloc(struct CUctx_st *ctx, uint32_t phys, size_t size, uint64_t charge, enum sim_mem_kind kind,
                             int low32, void **out) {
    size_t len = page_round(size);
    void *p = sim_map_anon(len, low32);
    struct sim_alloc *a = p ? calloc(1, sizeof *a) : NULL;
    if (!a) {
        if (p) munmap(p, len);
        if (charge) simgpu_mem_uncharge(phys, charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *a = (struct sim_alloc){.base = (uintptr_t)p, .size = size, .map_len = len, .charged = charge, .phys = phys,
                            .kind = kind, .ctx = ctx};
    sim_lock();
    int rc = sim_range_insert(a);
    sim_unlock();
    if (rc != 0) {
        munmap(p, len);
        if (charge) simgpu_mem_uncharge(phys, charge);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = p;
    return CUDA_SUCCESS;
}

static CUresult device_alloc(size_t size, uint64_t charge, enum sim_mem_kind kind, int low32, CUdeviceptr *dptr) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (simgpu_mem_charge(c->phys, charge) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = NULL;
    rc = record_alloc(c, c->phys, size, charge, kind, low32, &p);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr)(uintptr_t)p;
    return rc;
}

/* --- SIMGPU_STALL: a test's hand on a call in flight ------------------------------------------
 * SIMGPU_STALL=<gate file>: while the gate file exists and holds the name of the call
 * (cuMemAlloc_v2 or cuMemFree_v2), that call stalls half-way (an allocation before it takes
 * the memory, a free after it gave it back): it creates <gate>.stalled and waits until the gate
 * is removed (30 s at most). A test then sees the driver's state with the call in flight, as a
 * neighbouring thread would, whatever the machine's load. Unset: one load per call. */
static const char *g_stall_gate;
static pthread_once_t g_stall_once = PTHREAD_ONCE_INIT;

static void stall_init(void) {
    const char *e = getenv("SIMGPU_STALL");
    g_stall_gate = e && *e ? e : NULL;
}

static void stall(const char *call) {
    pthread_once(&g_stall_once, stall_init);
    if (!g_stall_gate) return;
    char named[64] = {0};
    FILE *f = fopen(g_stall_gate, "r");
    if (!f) return;
    size_t n = fread(named, 1, sizeof named - 1, f);
    fclose(f);
    while (n && (named[n - 1] == '\n' || named[n - 1] == ' ')) named[--n] = 0;
    if (strcmp(named, call) != 0) return;
    char mark[4096];
    snprintf(mark, sizeof mark, "%s.stalled", g_stall_gate);
    FILE *m = fopen(mark, "w");
    if (m) fclose(m);
    for (int ms = 0; ms < 30000 && access(g_stall_gate, F_OK) == 0; ms++) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    unlink(mark);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    stall("cuMemAlloc_v2");
    return device_alloc(bytesize, bytesize, SIM_MEM_DEVICE, 0, dptr);
}

CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    CUdeviceptr p = 0;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = device_alloc(bytesize, bytesize, SIM_MEM_DEVICE, 1, &p);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr_v1)p;
    return rc;
}

/* Rows are padded to SIM_PITCH_ALIGN; the whole pitch x height is what the GPU gives. */
static CUresult pitch_alloc(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem, int low32) {
    if (!pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + SIM_PITCH_ALIGN - 1) / SIM_PITCH_ALIGN * SIM_PITCH_ALIGN;
    if (height > SIZE_MAX / p) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = device_alloc(p * height, (uint64_t)p * height, SIM_MEM_PITCH, low32, dptr);
    if (rc == CUDA_SUCCESS) *pitch = p;
    return rc;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes) {
    return pitch_alloc(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, 0);
}

CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes, unsigned int Height,
                         unsigned int ElementSizeBytes) {
    CUdeviceptr p = 0;
    size_t pitch = 0;
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = pitch_alloc(&p, &pitch, WidthInBytes, Height, ElementSizeBytes, 1);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
}

/* Managed memory migrates on demand and never fails for want of GPU memory: it is charged as
 * resident for what the GPU can hold when it is allocated, the rest stays in host memory. */
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t limit = managed_limit();
    sim_lock();
    int fits = bytesize <= limit - g_managed && g_managed <= limit;
    if (fits) g_managed += bytesize; /* reserved now, so two threads cannot both take the last bytes */
    sim_unlock();
    if (!fits) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t charge = bytesize;
    if (simgpu_mem_charge(c->phys, charge) != 0) {
        uint64_t free_b, total;
        simgpu_mem_info(c->phys, &free_b, &total);
        charge = free_b < bytesize ? free_b : bytesize;
        if (charge && simgpu_mem_charge(c->phys, charge) != 0) charge = 0;
    }
    void *p = NULL;
    rc = record_alloc(c, c->phys, bytesize, charge, SIM_MEM_MANAGED, 0, &p);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr)(uintptr_t)p;
    } else {
        sim_lock();
        g_managed -= bytesize;
        sim_unlock();
    }
    return rc;
}

static CUresult mem_free(CUdeviceptr dptr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (dptr == 0) return CUDA_SUCCESS;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)dptr);
    if (!a || a->base != (uintptr_t)dptr || a->kind == SIM_MEM_HOST || a->kind == SIM_MEM_VMM || a->kind == SIM_MEM_MODULE)
        rc = CUDA_ERROR_INVALID_VALUE; /* not the start of a device allocation */
    else
        sim_alloc_destroy_locked(a);
    sim_unlock();
    return rc;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult rc = mem_free(dptr);
    if (rc == CUDA_SUCCESS) stall("cuMemFree_v2");
    return rc;
}
CUresult cuMemFree(CUdeviceptr_v1 dptr) { return mem_free(dptr); }

/* --- page-locked host memory: the caller's RAM, never charged to the GPU ------------------ */

static CUresult host_alloc(void **pp, size_t size) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pp || size == 0) return CUDA_ERROR_INVALID_VALUE;
    return record_alloc(c, c->phys, size, 0, SIM_MEM_HOST, 0, pp);
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(pp, bytesize); }
CUresult cuMemAllocHost(void **pp, unsigned int bytesize) { return host_alloc(pp, bytesize); }

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    if (Flags & ~(unsigned int)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    return host_alloc(pp, bytesize);
}

CUresult cuMemFreeHost(void *p) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!p) return CUDA_SUCCESS; /* free(NULL) semantics, as the real driver */
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)p);
    if (!a || a->base != (uintptr_t)p || a->kind != SIM_MEM_HOST) rc = CUDA_ERROR_INVALID_VALUE;
    else sim_alloc_destroy_locked(a);
    sim_unlock();
    return rc;
}

static CUresult host_device_pointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pdptr || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)p);
    rc = a && a->kind == SIM_MEM_HOST ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    if (rc == CUDA_SUCCESS) *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing */
    return rc;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    return host_device_pointer(pdptr, p, Flags);
}

CUresult cuMemHostGetDevicePointer(CUdeviceptr_v1 *pdptr, void *p, unsigned int Flags) {
    CUdeviceptr d = 0;
    if (!pdptr) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = host_device_pointer(&d, p, Flags);
    if (rc == CUDA_SUCCESS && d > 0xffffffffu) rc = CUDA_ERROR_INVALID_VALUE; /* no 32-bit form */
    if (rc == CUDA_SUCCESS) *pdptr = (CUdeviceptr_v1)d;
    return rc;
}

/* --- queries ----------------------------------------------------------------------------- */

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    uint64_t f, t;
    simgpu_mem_info(c->phys, &f, &t); /* node-wide: every process's memory counts */
    *free_bytes = (size_t)f;
    *total = (size_t)t;
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) {
    size_t f, t;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t f64, t64;
    simgpu_mem_info(c->phys, &f64, &t64);
    f = f64 > 0xffffffffu ? 0xffffffffu : (size_t)f64;
    t = t64 > 0xffffffffu ? 0xffffffffu : (size_t)t64;
    *free_bytes = (unsigned int)f;
    *total = (unsigned int)t;
    return CUDA_SUCCESS;
}

static CUresult address_range(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)dptr);
    if (a && a->kind != SIM_MEM_HOST) {
        if (pbase) *pbase = a->base;
        if (psize) *psize = a->size;
    } else {
        rc = CUDA_ERROR_NOT_FOUND;
    }
    sim_unlock();
    return rc;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    return address_range(pbase, psize, dptr);
}

CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr) {
    CUdeviceptr b = 0;
    size_t n = 0;
    CUresult rc = address_range(&b, &n, dptr);
    if (rc == CUDA_SUCCESS && pbase) *pbase = (CUdeviceptr_v1)b;
    if (rc == CUDA_SUCCESS && psize) *psize = (unsigned int)n;
    return rc;
}

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    return sim_pointer_attribute(data, attribute, ptr);
}

CUresult sim_pointer_attribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)ptr);
    struct sim_alloc copy;
    if (a) copy = *a;
    sim_unlock();
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    int dev = 0;
    for (int i = 0; i < sim_proc.ndev; i++)
        if (sim_proc.phys[i] == copy.phys) dev = i;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = copy.ctx; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data = copy.kind == SIM_MEM_HOST ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (copy.kind != SIM_MEM_HOST && copy.kind != SIM_MEM_MANAGED) return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = (void *)(uintptr_t)ptr;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = copy.kind == SIM_MEM_MANAGED; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = dev; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = copy.base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = copy.size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(CUmemoryPool *)data = copy.pool; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* --- arrays: opaque, charged by their byte size ------------------------------------------
 *
 * Width x height x depth elements, where a layered array's depth is its layer count and a
 * cubemap's its faces (6, or a multiple of 6 when layered). A mipmapped array is charged the
 * sum of its levels; level l has max(1, extent >> l) elements in each spatial dimension
 * (layers and faces do not shrink). Its levels are arrays it owns: cuArrayDestroy refuses
 * them, they go with it. Sparse and deferred-mapping arrays hold no memory of their own:
 * cuMemMapArrayAsync binds pieces of cuMemCreate handles into them, and a binding keeps its
 * handle's memory alive as a mapping does. */

#define SIM_ARRAY3D_FLAGS                                                                                          \
    (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_SURFACE_LDST | CUDA_ARRAY3D_CUBEMAP | CUDA_ARRAY3D_TEXTURE_GATHER |        \
     CUDA_ARRAY3D_DEPTH_TEXTURE | CUDA_ARRAY3D_COLOR_ATTACHMENT | CUDA_ARRAY3D_SPARSE |                            \
     CUDA_ARRAY3D_DEFERRED_MAPPING | CUDA_ARRAY3D_VIDEO_ENCODE_DECODE)
#define SIM_ARRAY_UNBACKED (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING)

/* Memory bound into a sparse or deferred-mapping array, and the part of it that it backs. */
struct sim_bind {
    struct sim_bind *next;
    struct sim_phys *mem;
    CUarraySparseSubresourceType type;
    unsigned int level, layer;
    unsigned long long where[6]; /* offsets and extents of a level, or a mip tail's offset and size */
};

struct CUarray_st {
    uint32_t magic;
    uint32_t phys;
    uint64_t charged;
    unsigned int flags;
    struct CUctx_st *ctx;
    struct sim_bind *binds;
    struct CUarray_st *next;
};

struct CUmipmappedArray_st {
    uint32_t magic;
    uint32_t phys;
    uint64_t charged;
    unsigned int flags;
    unsigned int nlevels;
    struct CUctx_st *ctx;
    struct sim_bind *binds;
    struct CUarray_st *levels; /* nlevels, owned; not in g_arrays */
    struct CUmipmappedArray_st *next;
};

static struct CUarray_st *g_arrays;
static struct CUmipmappedArray_st *g_mipmaps;

static size_t format_bytes(CUarray_format f) {
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT8X2: case CU_AD_FORMAT_SNORM_INT8X2: case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT:
    case CU_AD_FORMAT_UNORM_INT8X4: case CU_AD_FORMAT_SNORM_INT8X4: case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2: return 4;
    case CU_AD_FORMAT_UNORM_INT16X4: case CU_AD_FORMAT_SNORM_INT16X4: return 8;
    default: return 0;
    }
}

static uint64_t max1(uint64_t v) { return v ? v : 1; }

/* The shapes cuArray3DCreate documents: 1D {w,0,0}, 2D {w,h,0}, 3D {w,h,d}, 1D layered
 * {w,0,layers}, 2D layered {w,h,layers}, cubemap {w,w,6}, cubemap layered {w,w,6n}. */
static int shape_ok(size_t w, size_t h, size_t d, unsigned int flags) {
    if (w == 0 || (flags & ~(unsigned int)SIM_ARRAY3D_FLAGS)) return 0;
    int layered = (flags & CUDA_ARRAY3D_LAYERED) != 0;
    if (flags & CUDA_ARRAY3D_CUBEMAP) return w == h && d && (layered ? d % 6 == 0 : d == 6);
    if (layered) return d != 0;
    return h != 0 || d == 0;
}

/* At most 1 + floor(log2(max(w, h, d))) levels (cudaMallocMipmappedArray clamps to that). */
static unsigned int max_levels(size_t w, size_t h, size_t d) {
    uint64_t m = w > h ? w : h;
    if (d > m) m = d;
    unsigned int n = 1;
    while (m >>= 1) n++;
    return n;
}

/* Bytes of levels [0, nlevels): *bytes, or 0 if the size does not fit in 64 bits. */
static int levels_bytes(size_t w, size_t h, size_t d, unsigned int flags, unsigned int nlevels, uint64_t elem,
                        uint64_t *bytes) {
    int keep_depth = (flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    uint64_t sum = 0;
    for (unsigned int l = 0; l < nlevels; l++) {
        uint64_t dims[4] = {max1(w >> l), h ? max1(h >> l) : 1, !d ? 1 : keep_depth ? d : max1(d >> l), elem};
        uint64_t n = 1;
        for (int i = 0; i < 4; i++)
            if (__builtin_mul_overflow(n, dims[i], &n)) return 0;
        if (__builtin_add_overflow(sum, n, &sum)) return 0;
    }
    *bytes = sum;
    return 1;
}

static CUresult array_create(CUarray *pHandle, size_t w, size_t h, size_t d, CUarray_format fmt, unsigned int ch,
                             unsigned int flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    size_t elem = format_bytes(fmt);
    uint64_t bytes;
    if (!pHandle || elem == 0 || (ch != 1 && ch != 2 && ch != 4) || !shape_ok(w, h, d, flags) ||
        !levels_bytes(w, h, d, flags, 1, (uint64_t)elem * ch, &bytes))
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & SIM_ARRAY_UNBACKED) bytes = 0;
    struct CUarray_st *arr = calloc(1, sizeof *arr);
    if (!arr) return CUDA_ERROR_OUT_OF_MEMORY;
    if (bytes && simgpu_mem_charge(c->phys, bytes) != 0) {
        free(arr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *arr = (struct CUarray_st){.magic = SIM_ARRAY_MAGIC, .phys = c->phys, .charged = bytes, .flags = flags, .ctx = c};
    sim_lock();
    arr->next = g_arrays;
    g_arrays = arr;
    sim_unlock();
    *pHandle = arr;
    return CUDA_SUCCESS;
}

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, d->Width, d->Height, 0, d->Format, d->NumChannels, 0);
}

CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, d->Width, d->Height, 0, d->Format, d->NumChannels, 0);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags);
}

CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags);
}

static void unbind_all_locked(struct sim_bind **binds) {
    while (*binds) {
        struct sim_bind *b = *binds;
        *binds = b->next;
        sim_phys_unbind_locked(b->mem);
        free(b);
    }
}

static void array_unlink_locked(struct CUarray_st **link) {
    struct CUarray_st *arr = *link;
    *link = arr->next;
    unbind_all_locked(&arr->binds);
    if (arr->charged) simgpu_mem_uncharge(arr->phys, arr->charged);
    free(arr);
}

CUresult cuArrayDestroy(CUarray hArray) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUarray_st **link = &g_arrays;
    while (*link && *link != hArray) link = &(*link)->next;
    if (*link) array_unlink_locked(link);
    else rc = CUDA_ERROR_INVALID_HANDLE; /* unknown, or a mipmapped array's level */
    sim_unlock();
    return rc;
}

/* --- mipmapped arrays ---------------------------------------------------------------------- */

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                unsigned int numMipmapLevels) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pHandle || !d) return CUDA_ERROR_INVALID_VALUE;
    size_t elem = format_bytes(d->Format);
    unsigned int ch = d->NumChannels, top = max_levels(d->Width, d->Height, d->Depth);
    unsigned int n = numMipmapLevels < 1 ? 1 : numMipmapLevels > top ? top : numMipmapLevels;
    uint64_t bytes;
    if (elem == 0 || (ch != 1 && ch != 2 && ch != 4) || !shape_ok(d->Width, d->Height, d->Depth, d->Flags) ||
        !levels_bytes(d->Width, d->Height, d->Depth, d->Flags, n, (uint64_t)elem * ch, &bytes))
        return CUDA_ERROR_INVALID_VALUE;
    if (d->Flags & SIM_ARRAY_UNBACKED) bytes = 0;
    struct CUmipmappedArray_st *m = calloc(1, sizeof *m);
    struct CUarray_st *levels = m ? calloc(n, sizeof *levels) : NULL;
    if (!levels) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (bytes && simgpu_mem_charge(c->phys, bytes) != 0) {
        free(levels);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (unsigned int l = 0; l < n; l++)
        levels[l] = (struct CUarray_st){.magic = SIM_ARRAY_MAGIC, .phys = c->phys, .flags = d->Flags, .ctx = c};
    *m = (struct CUmipmappedArray_st){.magic = SIM_MIPMAP_MAGIC, .phys = c->phys, .charged = bytes, .flags = d->Flags,
                                      .nlevels = n, .ctx = c, .levels = levels};
    sim_lock();
    m->next = g_mipmaps;
    g_mipmaps = m;
    sim_unlock();
    *pHandle = m;
    return CUDA_SUCCESS;
}

static struct CUmipmappedArray_st **mipmap_link_locked(CUmipmappedArray h) {
    struct CUmipmappedArray_st **link = &g_mipmaps;
    while (*link && *link != h) link = &(*link)->next;
    return link;
}

CUresult cuMipmappedArrayGetLevel(CUarray *pLevelArray, CUmipmappedArray hMipmappedArray, unsigned int level) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!pLevelArray) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct CUmipmappedArray_st *m = *mipmap_link_locked(hMipmappedArray);
    if (!m) rc = CUDA_ERROR_INVALID_HANDLE;
    else if (level >= m->nlevels) rc = CUDA_ERROR_INVALID_VALUE;
    else *pLevelArray = &m->levels[level];
    sim_unlock();
    return rc;
}

static void mipmap_unlink_locked(struct CUmipmappedArray_st **link) {
    struct CUmipmappedArray_st *m = *link;
    *link = m->next;
    unbind_all_locked(&m->binds);
    if (m->charged) simgpu_mem_uncharge(m->phys, m->charged);
    free(m->levels);
    free(m);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUmipmappedArray_st **link = mipmap_link_locked(hMipmappedArray);
    if (*link) mipmap_unlink_locked(link);
    else rc = CUDA_ERROR_INVALID_HANDLE;
    sim_unlock();
    return rc;
}

/* --- binding memory into sparse and deferred-mapping arrays -------------------------------- */

/* What one entry names: its array's binding list and, from its flags and levels, whether
 * the entry is valid for it. */
struct map_target {
    struct sim_bind **binds;
    uint32_t phys;
    unsigned int flags, nlevels;
    int dev;
};

static CUresult map_target_locked(const CUarrayMapInfo *e, struct map_target *t) {
    if (e->resourceType == CU_RESOURCE_TYPE_ARRAY) {
        struct CUarray_st *a = g_arrays;
        while (a && a != e->resource.array) a = a->next;
        if (!a) return CUDA_ERROR_INVALID_HANDLE;
        *t = (struct map_target){&a->binds, a->phys, a->flags, 1, a->ctx->dev};
    } else if (e->resourceType == CU_RESOURCE_TYPE_MIPMAPPED_ARRAY) {
        struct CUmipmappedArray_st *m = *mipmap_link_locked(e->resource.mipmap);
        if (!m) return CUDA_ERROR_INVALID_HANDLE;
        *t = (struct map_target){&m->binds, m->phys, m->flags, m->nlevels, m->ctx->dev};
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* The part of its array an entry names (the whole array for a deferred-mapping one). */
static struct sim_bind place_of(const CUarrayMapInfo *e, unsigned int flags) {
    struct sim_bind b = {0};
    if (flags & CUDA_ARRAY3D_DEFERRED_MAPPING) return b;
    b.type = e->subresourceType;
    if (b.type == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL) {
        b.layer = e->subresource.miptail.layer;
        b.where[0] = e->subresource.miptail.offset;
        b.where[1] = e->subresource.miptail.size;
    } else {
        const __typeof__(e->subresource.sparseLevel) *s = &e->subresource.sparseLevel;
        b.level = s->level;
        b.layer = s->layer;
        unsigned long long w[6] = {s->offsetX, s->offsetY, s->offsetZ, s->extentWidth, s->extentHeight, s->extentDepth};
        memcpy(b.where, w, sizeof w);
    }
    return b;
}

static int same_place(const struct sim_bind *a, const struct sim_bind *b) {
    return a->type == b->type && a->level == b->level && a->layer == b->layer &&
           memcmp(a->where, b->where, sizeof a->where) == 0;
}

static CUresult map_check_locked(const CUarrayMapInfo *e, const struct CUctx_st *sc) {
    struct map_target t;
    CUresult rc = map_target_locked(e, &t);
    if (rc != CUDA_SUCCESS) return rc;
    if (!(t.flags & SIM_ARRAY_UNBACKED) || e->flags || e->reserved[0] || e->reserved[1])
        return CUDA_ERROR_INVALID_VALUE; /* only arrays without memory of their own take it */
    /* One device, the stream's and the array's. */
    if (t.phys != sc->phys || e->deviceBitMask != 1u << sc->dev) return CUDA_ERROR_INVALID_VALUE;
    if (!(t.flags & CUDA_ARRAY3D_DEFERRED_MAPPING)) {
        if (e->subresourceType != CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL &&
            e->subresourceType != CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL)
            return CUDA_ERROR_INVALID_VALUE;
        if (e->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL &&
            e->subresource.sparseLevel.level >= t.nlevels)
            return CUDA_ERROR_INVALID_VALUE;
    }
    if (e->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP)
        return e->memHandle.memHandle ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (e->memOperationType != CU_MEM_OPERATION_TYPE_MAP || e->memHandleType != CU_MEM_HANDLE_TYPE_GENERIC)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_phys *p = sim_phys_live_locked(e->memHandle.memHandle);
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    uint32_t gpu;
    uint64_t size;
    unsigned short usage;
    sim_phys_describe(p, &gpu, &size, &usage);
    /* Only a tile pool (CU_MEM_CREATE_USAGE_TILE_POOL) backs arrays, on their own GPU. */
    if (!(usage & CU_MEM_CREATE_USAGE_TILE_POOL) || gpu != t.phys || e->offset >= size) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* Map or unmap one (checked) entry: what was bound at its place is unbound first. */
static CUresult map_apply_locked(const CUarrayMapInfo *e) {
    struct map_target t;
    map_target_locked(e, &t);
    struct sim_bind place = place_of(e, t.flags);
    for (struct sim_bind **link = t.binds; *link; link = &(*link)->next) {
        if (same_place(*link, &place)) {
            struct sim_bind *old = *link;
            *link = old->next;
            sim_phys_unbind_locked(old->mem);
            free(old);
            break;
        }
    }
    if (e->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP) return CUDA_SUCCESS;
    struct sim_bind *b = malloc(sizeof *b);
    if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
    *b = place;
    b->mem = sim_phys_live_locked(e->memHandle.memHandle);
    sim_phys_bind_locked(b->mem);
    b->next = *t.binds;
    *t.binds = b;
    return CUDA_SUCCESS;
}

/* Done when called, as copies are: every entry is checked before any is applied. */
static CUresult map_array(CUarrayMapInfo *list, unsigned int count, CUstream h, int ptsz) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!list || count == 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *sc;
    struct CUstream_st *s;
    sim_lock();
    rc = sim_stream_get(h, ptsz, &sc, &s);
    for (unsigned int i = 0; rc == CUDA_SUCCESS && i < count; i++) rc = map_check_locked(&list[i], sc);
    for (unsigned int i = 0; rc == CUDA_SUCCESS && i < count; i++) rc = map_apply_locked(&list[i]);
    sim_unlock();
    return rc;
}

CUresult cuMemMapArrayAsync(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream) {
    return map_array(mapInfoList, count, hStream, 0);
}

CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream) {
    return map_array(mapInfoList, count, hStream, 1);
}

/* Module memory: mapped and recorded like an allocation, never freed by cuMemFree; its module
 * (cuda_exec.c) frees it. */
CUresult sim_module_mem_locked(struct CUctx_st *ctx, size_t size, const void *init, uint64_t charge,
                               struct sim_alloc **out) {
    if (charge && simgpu_mem_charge(ctx->phys, charge) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t len = page_round(size ? size : 1);
    void *p = sim_map_anon(len, 0);
    struct sim_alloc *a = p ? calloc(1, sizeof *a) : NULL;
    if (a) {
        *a = (struct sim_alloc){.base = (uintptr_t)p, .size = size ? size : 1, .map_len = len, .charged = charge,
                                .phys = ctx->phys, .kind = SIM_MEM_MODULE, .ctx = ctx};
        if (sim_range_insert(a) == 0) {
            /* Only the pages with contents: zero-filled variables cost no RAM until touched. */
            size_t pg = (size_t)sysconf(_SC_PAGESIZE);
            for (size_t off = 0; off < size; off += pg) {
                size_t n = size - off < pg ? size - off : pg;
                const unsigned char *src = (const unsigned char *)init + off;
                if (src[0] || memcmp(src, src + 1, n - 1)) memcpy((char *)p + off, src, n);
            }
            *out = a;
            return CUDA_SUCCESS;
        }
    }
    if (p) munmap(p, len);
    free(a);
    if (charge) simgpu_mem_uncharge(ctx->phys, charge);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void sim_mem_free_ctx_locked(struct CUctx_st *ctx) {
    for (size_t i = g_n; i-- > 0;) /* module memory goes with its module (sim_module_free_ctx_locked) */
        if (g_tab[i]->ctx == ctx && g_tab[i]->kind != SIM_MEM_MODULE) sim_alloc_destroy_locked(g_tab[i]);
    for (struct CUarray_st **link = &g_arrays; *link;) {
        if ((*link)->ctx == ctx) array_unlink_locked(link);
        else link = &(*link)->next;
    }
    for (struct CUmipmappedArray_st **link = &g_mipmaps; *link;) {
        if ((*link)->ctx == ctx) mipmap_unlink_locked(link);
        else link = &(*link)->next;
    }
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuArray3DCreate)
SIM_SELF(cuArray3DCreate_v2)
SIM_SELF(cuArrayCreate)
SIM_SELF(cuArrayCreate_v2)
SIM_SELF(cuArrayDestroy)
SIM_SELF(cuMemAlloc)
SIM_SELF(cuMemAllocHost)
SIM_SELF(cuMemAllocHost_v2)
SIM_SELF(cuMemAllocManaged)
SIM_SELF(cuMemAllocPitch)
SIM_SELF(cuMemAllocPitch_v2)
SIM_SELF(cuMemAlloc_v2)
SIM_SELF(cuMemFree)
SIM_SELF(cuMemFreeHost)
SIM_SELF(cuMemFree_v2)
SIM_SELF(cuMemGetAddressRange)
SIM_SELF(cuMemGetAddressRange_v2)
SIM_SELF(cuMemGetInfo)
SIM_SELF(cuMemGetInfo_v2)
SIM_SELF(cuMemHostAlloc)
SIM_SELF(cuMemHostGetDevicePointer)
SIM_SELF(cuMemHostGetDevicePointer_v2)
SIM_SELF(cuMemMapArrayAsync)
SIM_SELF(cuMemMapArrayAsync_ptsz)
SIM_SELF(cuMipmappedArrayCreate)
SIM_SELF(cuMipmappedArrayDestroy)
SIM_SELF(cuMipmappedArrayGetLevel)
SIM_SELF(cuPointerGetAttribute)
