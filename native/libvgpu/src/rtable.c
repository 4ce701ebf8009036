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
#include <fcntl.h>
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

/* The protection of the mapping holding addr (PROT_*), or -1. /proc/self/maps is read with
 * read(2) and each line's "lo-hi perms" parsed as it streams by (lines of any length): no
 * stdio, whose imports would each cost every process a relocation at load. */
static int protection_of(uintptr_t addr) {
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    enum { LO, HI, PERMS, REST } field = LO;
    uintptr_t bound[2] = {0, 0};
    int prot = -1, perm = 0, nperm = 0;
    char buf[1024];
    ssize_t n;
    while (prot < 0 && (n = read(fd, buf, sizeof buf)) != 0) {
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (ssize_t i = 0; i < n && prot < 0; i++) {
            char c = buf[i];
            if (c == '\n') { /* the next line */
                field = LO;
                bound[0] = bound[1] = 0;
                perm = nperm = 0;
            } else if (field == LO || field == HI) {
                int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
                if (v >= 0) bound[field] = bound[field] << 4 | (uintptr_t)v;
                else field = field == LO && c == '-' ? HI : field == HI && c == ' ' ? PERMS : REST;
            } else if (field == PERMS && c != ' ') {
                static const char flag[3] = {'r', 'w', 'x'};
                static const int bit[3] = {PROT_READ, PROT_WRITE, PROT_EXEC};
                if (nperm < 3 && c == flag[nperm]) perm |= bit[nperm];
                nperm++;
            } else if (field == PERMS) {
                field = REST;
                if (nperm == 4 && addr >= bound[0] && addr < bound[1]) prot = perm;
            }
        }
    }
    close(fd);
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
