/* The runtime's private table: NVIDIA's runtime (libcudart) makes its primary context through
 * slot 2 of the driver's runtime-interface table (cuGetExportTable 6bd5fb6c-...), not through
 * any exported entry point, so no hook would see it before the driver made it. The shim hooks
 * cuGetExportTable and wraps that slot (ctx.c's vgpu_primary_get: reserved before, refused
 * without being made over the limit).
 *
 * The slot is replaced in the driver's own table, not in a copy: the runtime's integrity check
 * (the d4082055-... table) hashes the address of the table it was given, so a copy would fail
 * it. The table's page is made writable for that one store and its protection put back. A
 * table that does not look like one (no size in slot 0) or a page that cannot be written is
 * left alone, with one warning: its context is then charged when the shim first meets it. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shim.h"

static const uint8_t k_runtime_table[16] = {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a,
                                            0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9};
enum { PRIMARY_SLOT = 2, MAX_SLOTS = 1024 };

typedef CUresult (*primary_get_fn)(CUcontext *, CUdevice);

static struct {
    pthread_mutex_t mu;
    primary_get_fn real; /* the driver's slot, once wrapped */
    int failed;          /* could not wrap: not tried again */
} g_rt = {.mu = PTHREAD_MUTEX_INITIALIZER};

static CUresult wrapped_primary_get(CUcontext *pctx, CUdevice dev) {
    return vgpu_primary_get(pctx, dev, g_rt.real, 0);
}

/* The protection of the mapping holding addr (PROT_*), or -1. */
static int protection_of(uintptr_t addr) {
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return -1;
    char line[512];
    int prot = -1;
    while (prot < 0 && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || addr < lo || addr >= hi) continue;
        prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
               (perms[2] == 'x' ? PROT_EXEC : 0);
    }
    fclose(f);
    return prot;
}

/* Store fn into *slot, whatever the page's protection; 0 or -1. */
static int store_slot(void **slot, void *fn) {
    int prot = protection_of((uintptr_t)slot);
    if (prot < 0) return -1;
    if (prot & PROT_WRITE) {
        __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
        return 0;
    }
    long pagesize = sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)slot & ~((uintptr_t)pagesize - 1));
    if (mprotect(page, (size_t)pagesize, prot | PROT_WRITE) != 0) return -1;
    __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    mprotect(page, (size_t)pagesize, prot);
    return 0;
}

static void wrap(void **table) {
    pthread_mutex_lock(&g_rt.mu);
    uintptr_t size = (uintptr_t)table[0];
    void *cur = table[PRIMARY_SLOT];
    if (cur == (void *)wrapped_primary_get || g_rt.failed) {
        /* wrapped already (or given up) */
    } else if (size % sizeof(void *) || size / sizeof(void *) <= PRIMARY_SLOT ||
               size / sizeof(void *) > MAX_SLOTS || !cur) {
        g_rt.failed = 1;
        VLOG(VGPU_LOG_WARN, "the driver's runtime table does not start with its size: its primary "
             "contexts are charged when first met, not before they are made");
    } else {
        g_rt.real = (primary_get_fn)cur;
        if (store_slot(&table[PRIMARY_SLOT], (void *)wrapped_primary_get) != 0) {
            g_rt.failed = 1;
            VLOG(VGPU_LOG_WARN, "cannot wrap the driver's runtime table (%s): its primary contexts "
                 "are charged when first met, not before they are made", strerror(errno));
        }
    }
    pthread_mutex_unlock(&g_rt.mu);
}

VGPU_API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    VGPU_NEED(cuGetExportTable);
    CUresult rc = vgpu.real.cuGetExportTable(ppExportTable, pExportTableId);
    if (rc == CUDA_SUCCESS && vgpu.limited && ppExportTable && *ppExportTable && pExportTableId &&
        memcmp(pExportTableId->bytes, k_runtime_table, sizeof k_runtime_table) == 0)
        wrap((void **)(uintptr_t)*ppExportTable);
    return rc;
}
