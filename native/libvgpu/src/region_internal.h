/* Internals of the shared region shared by region.c (the tenant side: slots, reserve,
 * release, repair), region_file.c (create, map, validate) and region_snapshot.c (the host's
 * lock-free read). The layout itself is in include/vgpu/region.h. */
#ifndef VGPU_REGION_INTERNAL_H
#define VGPU_REGION_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/types.h>

#include "log.h"
#include "region_private.h"
#include "vgpu/region.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_LIKELY(x) __builtin_expect(!!(x), 1)
#define VGPU_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* Every field another process may read concurrently is accessed atomically (through these,
 * or sequentially consistent where region.c says why), so ThreadSanitizer and the C11 model
 * agree with the protocol. On x86 all of these are plain moves. */
#define LD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define LD_RELAXED(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* --- region_file.c ------------------------------------------------------------------------ */

/* printf into err (may be NULL or 0 long). */
void vgpu_region_seterr(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A "[vgpu] warn: region: ..." line through the shim's one logger (log.h). */
#define vgpu_region_warn(...) VGPU_LOGF(VGPU_LOG_WARN, "region: " __VA_ARGS__)

/* Open the region file at `path` without following a symlink or blocking (the directory is
 * the tenant's), and refuse anything but a regular file of at least a region's size.
 * `writable`: 1 read-write, 0 read-only, -1 read-write if permitted else read-only. Returns
 * the descriptor and sets *writable_out and *size_out (either may be NULL); -1 with err set. */
int vgpu_region_open_file(const char *path, int writable, int *writable_out,
                          uint64_t *size_out, char *err, size_t errlen);
/* Check a region's identity and tables (`size`: the file's size on disk). 0, or -1 with err
 * set. `f` is a mapping (tenants) or the host's private copy of the file's first bytes. */
int vgpu_region_validate(const struct vgpu_region_file *f, uint64_t size, const char *path,
                         char *err, size_t errlen);
/* Open (as above), map and validate the region file at `path`: the tenants' attachment; the
 * host never maps a region (a tenant could shrink the file under the mapping: SIGBUS). On
 * success returns the mapping, sets *fd_out and *writable_out. NULL with err set. */
struct vgpu_region_file *vgpu_region_map(const char *path, int writable, int *fd_out,
                                         int *writable_out, char *err, size_t errlen);
void vgpu_region_unmap(struct vgpu_region_file *f, int fd);

/* Field 22 of /proc/self/stat (start time in clock ticks), 0 if unreadable. */
uint64_t vgpu_proc_start_time(void);

/* 1 if the OFD lock byte of slot `slot` is free as seen through `fd` (its owner is gone),
 * 0 if held or unknown. */
int vgpu_slot_dead(int fd, int slot);
/* Take (F_WRLCK) or drop (F_UNLCK) this description's lock on the byte of slot `slot`. */
int vgpu_slot_lock(int fd, int slot, int type);


/* The device count, bounded: the file is writable by the tenant, so a count changed after
 * validation must still keep every loop inside the arrays. */
static inline uint32_t vgpu_region_ndev(const struct vgpu_region_file *f) {
    uint32_t n = __atomic_load_n(&f->device_count, __ATOMIC_RELAXED);
    return n <= VGPU_MAX_DEVICES ? n : VGPU_MAX_DEVICES;
}

/* The lock word: 0 free, else the holder's slot index + 1. */
static inline uint32_t vgpu_region_lock_word(const struct vgpu_region_file *f) {
    return __atomic_load_n(&f->lock, __ATOMIC_ACQUIRE);
}
/* 1 when lock word `w` names a holder whose slot lock is free, seen through `fd` (not the
 * holder's own description): the holder died holding the region's lock. */
static inline int vgpu_region_holder_dead(int fd, uint32_t w) {
    return w != 0 && w <= VGPU_MAX_SLOTS && vgpu_slot_dead(fd, (int)w - 1);
}

#endif
