/* Virtual memory management: physical handles (cuMemCreate), reserved address ranges, mappings
 * and access.
 *
 * A physical handle is a memfd of its size, charged to the node when created and uncharged
 * when its last reference and last mapping are gone (as on the real driver, releasing a mapped
 * handle keeps its memory until it is unmapped). A reserved range is PROT_NONE address space;
 * cuMemMap puts the memfd there (MAP_FIXED|MAP_SHARED, still inaccessible) and cuMemSetAccess
 * opens it, so an access before that faults like an unmapped GPU address would. */
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_internal.h"

struct sim_phys {
    struct sim_phys *next;
    int fd;
    uint64_t size;
    uint32_t phys;
    unsigned int refs; /* cuMemCreate and each cuMemRetainAllocationHandle, minus releases */
    unsigned int maps; /* live mappings, and bindings into sparse arrays (cuda_mem.c) */
    CUmemAllocationProp prop;
};

struct sim_resv {
    struct sim_resv *next;
    uintptr_t base;
    size_t size;
};

static struct sim_phys *g_phys;
static struct sim_resv *g_resv;

static struct sim_phys *phys_find_locked(CUmemGenericAllocationHandle h) {
    for (struct sim_phys *p = g_phys; p; p = p->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)p == h) return p;
    return NULL;
}

static void phys_maybe_destroy_locked(struct sim_phys *p) {
    if (p->refs || p->maps) return;
    struct sim_phys **link = &g_phys;
    while (*link != p) link = &(*link)->next;
    *link = p->next;
    close(p->fd);
    simgpu_mem_uncharge(p->phys, p->size);
    free(p);
}

struct sim_phys *sim_phys_live_locked(CUmemGenericAllocationHandle h) {
    struct sim_phys *p = phys_find_locked(h);
    return p && p->refs ? p : NULL;
}

void sim_phys_describe(const struct sim_phys *p, uint32_t *gpu, uint64_t *size, unsigned short *usage) {
    *gpu = p->phys;
    *size = p->size;
    *usage = p->prop.allocFlags.usage;
}

void sim_phys_bind_locked(struct sim_phys *p) { p->maps++; }

void sim_phys_unbind_locked(struct sim_phys *p) {
    p->maps--;
    phys_maybe_destroy_locked(p);
}

static int aligned(uint64_t v) { return v % SIM_GRANULARITY == 0; }

/* The ordinal a location names, or -1. */
static int location_device(const CUmemLocation *loc) {
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE || sim_device(loc->id, NULL) != CUDA_SUCCESS) return -1;
    return loc->id;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!granularity || !prop || location_device(&prop->location) < 0 ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = SIM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!handle || !prop || flags != 0 || size == 0 || !aligned(size) || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->requestedHandleTypes & ~(unsigned int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    int dev = location_device(&prop->location);
    if (dev < 0) return CUDA_ERROR_INVALID_DEVICE;
    uint32_t gpu = sim_proc.phys[dev];
    rc = sim_gpu_ok(gpu);
    if (rc != CUDA_SUCCESS) return rc;
    if (simgpu_mem_charge(gpu, size) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_phys *p = calloc(1, sizeof *p);
    int fd = p ? memfd_create("simgpu-vmm", MFD_CLOEXEC) : -1;
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        free(p);
        simgpu_mem_uncharge(gpu, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *p = (struct sim_phys){.fd = fd, .size = size, .phys = gpu, .refs = 1, .prop = *prop};
    sim_lock();
    p->next = g_phys;
    g_phys = p;
    sim_unlock();
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_phys *p = phys_find_locked(handle);
    if (!p || p->refs == 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        p->refs--;
        phys_maybe_destroy_locked(p);
    }
    sim_unlock();
    return rc;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)addr);
    if (a && a->kind == SIM_MEM_VMM) {
        a->vmm->refs++;
        *handle = (CUmemGenericAllocationHandle)(uintptr_t)a->vmm;
    } else {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    sim_unlock();
    return rc;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct sim_phys *p = phys_find_locked(handle);
    if (p) *prop = p->prop;
    else rc = CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    return rc;
}

/* --- address ranges ---------------------------------------------------------------------- */

static void *reserve(size_t size, size_t align, uintptr_t hint) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (hint && hint % align == 0) {
        void *p = mmap((void *)hint, size, PROT_NONE, flags | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED) return p; /* the requested address is only a hint */
    }
    size_t len = size + align;
    char *raw = mmap(NULL, len, PROT_NONE, flags, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uintptr_t start = ((uintptr_t)raw + align - 1) / align * align;
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    uintptr_t tail = start + size, end = (uintptr_t)raw + len;
    if (end > tail) munmap((void *)tail, end - tail);
    return (void *)start;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ptr || size == 0 || !aligned(size) || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (alignment == 0) alignment = SIM_GRANULARITY;
    if ((alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
    if (alignment < SIM_GRANULARITY) alignment = SIM_GRANULARITY;
    struct sim_resv *r = calloc(1, sizeof *r);
    void *p = r ? reserve(size, alignment, (uintptr_t)addr) : NULL;
    if (!p) {
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = (uintptr_t)p;
    r->size = size;
    sim_lock();
    r->next = g_resv;
    g_resv = r;
    sim_unlock();
    *ptr = (CUdeviceptr)r->base;
    return CUDA_SUCCESS;
}

static int in_reservation_locked(uintptr_t p, size_t size) {
    for (struct sim_resv *r = g_resv; r; r = r->next)
        if (p >= r->base && p + size <= r->base + r->size) return 1;
    return 0;
}

/* Put a mapping's range back to reserved address space and drop its reference. */
static void unmap_one_locked(struct sim_alloc *a) {
    mmap((void *)a->base, a->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    sim_range_remove(a);
    a->vmm->maps--;
    phys_maybe_destroy_locked(a->vmm);
    free(a);
}

/* Mappings left in a freed range are unmapped with it, so their memory is not held forever. */
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_resv **link = &g_resv;
    while (*link && ((*link)->base != (uintptr_t)ptr || (*link)->size != size)) link = &(*link)->next;
    if (!*link) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct sim_resv *r = *link;
    *link = r->next;
    for (uintptr_t cur = r->base; cur < r->base + r->size; cur += SIM_GRANULARITY) {
        struct sim_alloc *a = sim_range_find(cur);
        if (a && a->kind == SIM_MEM_VMM) unmap_one_locked(a);
    }
    munmap((void *)r->base, r->size);
    sim_unlock();
    free(r);
    return CUDA_SUCCESS;
}

/* --- mappings ---------------------------------------------------------------------------- */

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (flags != 0 || size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset)) return CUDA_ERROR_INVALID_VALUE;
    struct sim_alloc *a = calloc(1, sizeof *a);
    if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
    sim_lock();
    struct sim_phys *p = phys_find_locked(handle);
    if (!p || p->refs == 0 || offset + size > p->size || !in_reservation_locked((uintptr_t)ptr, size))
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) rc = sim_gpu_ok(p->phys);
    for (uintptr_t cur = (uintptr_t)ptr; rc == CUDA_SUCCESS && cur < (uintptr_t)ptr + size; cur += SIM_GRANULARITY)
        if (sim_range_find(cur)) rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    if (rc == CUDA_SUCCESS &&
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, (off_t)offset) == MAP_FAILED)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        *a = (struct sim_alloc){.base = (uintptr_t)ptr, .size = size, .map_len = size, .phys = p->phys,
                                .kind = SIM_MEM_VMM, .vmm = p, .prot = PROT_NONE};
        if (sim_range_insert(a) != 0) {
            mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            p->maps++;
            a = NULL;
        }
    }
    sim_unlock();
    free(a);
    return rc;
}

/* The mappings exactly covering [ptr, ptr+size), or 0 if the range cuts one or has holes. */
static int whole_mappings_locked(uintptr_t ptr, size_t size) {
    for (uintptr_t cur = ptr; cur < ptr + size;) {
        struct sim_alloc *a = sim_range_find(cur);
        if (!a || a->kind != SIM_MEM_VMM || a->base != cur || a->base + a->size > ptr + size) return 0;
        cur += a->size;
    }
    return 1;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    if (!whole_mappings_locked((uintptr_t)ptr, size)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (uintptr_t cur = (uintptr_t)ptr; cur < (uintptr_t)ptr + size;) {
            struct sim_alloc *a = sim_range_find(cur);
            cur += a->size;
            unmap_one_locked(a);
        }
    }
    sim_unlock();
    return rc;
}

/* One host mapping serves every device: the most any listed device is granted applies. */
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!desc || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (location_device(&desc[i].location) < 0) return CUDA_ERROR_INVALID_DEVICE;
        switch (desc[i].flags) {
        case CU_MEM_ACCESS_FLAGS_PROT_NONE: break;
        case CU_MEM_ACCESS_FLAGS_PROT_READ: prot |= PROT_READ; break;
        case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot |= PROT_READ | PROT_WRITE; break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    sim_lock();
    for (uintptr_t cur = (uintptr_t)ptr; rc == CUDA_SUCCESS && cur < (uintptr_t)ptr + size;) {
        struct sim_alloc *a = sim_range_find(cur);
        if (!a || a->kind != SIM_MEM_VMM) rc = CUDA_ERROR_INVALID_VALUE; /* the range must be mapped */
        else cur = a->base + a->size;
    }
    if (rc == CUDA_SUCCESS && mprotect((void *)(uintptr_t)ptr, size, prot) != 0) rc = CUDA_ERROR_INVALID_VALUE;
    for (uintptr_t cur = (uintptr_t)ptr; rc == CUDA_SUCCESS && cur < (uintptr_t)ptr + size;) {
        struct sim_alloc *a = sim_range_find(cur);
        a->prot = prot;
        cur = a->base + a->size;
    }
    sim_unlock();
    return rc;
}

CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!flags || !location || location_device(location) < 0) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct sim_alloc *a = sim_range_find((uintptr_t)ptr);
    if (!a || a->kind != SIM_MEM_VMM) rc = CUDA_ERROR_INVALID_VALUE;
    else if (a->prot & PROT_WRITE) *flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    else if (a->prot & PROT_READ) *flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    else *flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    sim_unlock();
    return rc;
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuMemAddressFree)
SIM_SELF(cuMemAddressReserve)
SIM_SELF(cuMemCreate)
SIM_SELF(cuMemGetAccess)
SIM_SELF(cuMemGetAllocationGranularity)
SIM_SELF(cuMemGetAllocationPropertiesFromHandle)
SIM_SELF(cuMemMap)
SIM_SELF(cuMemRelease)
SIM_SELF(cuMemRetainAllocationHandle)
SIM_SELF(cuMemSetAccess)
SIM_SELF(cuMemUnmap)
