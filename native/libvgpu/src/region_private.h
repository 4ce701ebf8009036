/* The region's entry points for the shim's own use (hidden: not part of region.h's ABI). */
#ifndef VGPU_REGION_PRIVATE_H
#define VGPU_REGION_PRIVATE_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "vgpu/region.h"

#define VGPU_REGION_HIDDEN __attribute__((visibility("hidden")))

/* Give fd's first `size` bytes their blocks (posix_fallocate), so that a mapping of them
 * never faults for want of space: on a full disk a sparse page's first touch is a SIGBUS, in
 * whichever process touches it, where this returns -1 with errno ENOSPC to the file's maker. */
VGPU_REGION_HIDDEN int vgpu_file_allocate(int fd, off_t size);

/* This process's committed charge on dev (charged, less what is between reserve and commit). */
VGPU_REGION_HIDDEN uint64_t vgpu_region_own_committed(const struct vgpu_region *r, int dev);
/* 1 if a live slot of the region is the process NVML lists as `pid`: its node pid where its
 * shim learned one, else its pid in the container's namespace. */
VGPU_REGION_HIDDEN int vgpu_region_has_pid(const struct vgpu_region *r, int32_t pid);
/* Record in this process's slot the pid NVML lists it by (learned by ctx.c's probe). */
VGPU_REGION_HIDDEN void vgpu_region_set_node_pid(struct vgpu_region *r, int32_t pid);

/* What a context took on dev as a process of the container last measured it (0: unknown),
 * and recording a new measure. */
VGPU_REGION_HIDDEN uint64_t vgpu_region_context_bytes(const struct vgpu_region *r, int dev);
VGPU_REGION_HIDDEN void vgpu_region_set_context_bytes(struct vgpu_region *r, int dev, uint64_t bytes);

enum vgpu_region_counter { VGPU_COUNT_REFUSED, VGPU_COUNT_FALLBACK, VGPU_COUNT_GPU_NS };
/* Add n to one of device dev's counters (atomic, no lock). */
VGPU_REGION_HIDDEN void vgpu_region_count(struct vgpu_region *r, int dev, enum vgpu_region_counter what,
                                          uint64_t n);

/* Charge `bytes` on dev to this process whatever the limit: memory the driver already gave
 * (an executable graph's, known only after its launch). The container is then over its
 * limit, and its allocations are refused until it is back under. */
VGPU_REGION_HIDDEN void vgpu_region_force(struct vgpu_region *r, int dev, uint64_t bytes);

/* The process-local attachment. Fields other than `slot`/`fd` are fixed after open; `slot`
 * and `fd` change only when a forked child registers afresh (under `mu`). */
struct vgpu_region {
    struct vgpu_region_file *file;
    int fd;                      /* our open file description: it carries our slot's lock */
    int slot;                    /* -1: not registered in this process (fresh fork child) */
    int device_count;
    uint64_t limit[VGPU_MAX_DEVICES]; /* min(own, region's) */
    dev_t st_dev;                /* the mapped file, to re-open the same one after fork */
    ino_t st_ino;
    pthread_mutex_t mu;          /* process-private: serialises re-registration */
    int warned_clamp;            /* the release-clamp warning is printed once */
    int warned_broken;
    struct vgpu_region *next;    /* the list the fork handler walks */
    char path[];
};

/* --- the hot path, inline in the shim's hooks ------------------------------------------------
 * The protocol is region.h's; region.c has the rest (registration, the locked retry, reclaim).
 * `dev` is a valid index here (the shim resolved it); the exported functions check it. */

#define VGPU_REGION_LIKELY(x) __builtin_expect(!!(x), 1)
#define VGPU_REGION_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* The container's usage of `dev`: the sum of slots [0, hwm) (a FREE slot holds 0).
 * Sequentially consistent loads, after the caller's add in a reservation. No saturation: only
 * a tenant that wrote its own file can make the sum wrap, and the only container that harms
 * is its own. */
static inline uint64_t vgpu_region_sum_to(const struct vgpu_region_file *f, int dev, uint32_t hwm) {
    if (VGPU_REGION_UNLIKELY(hwm > VGPU_MAX_SLOTS)) hwm = VGPU_MAX_SLOTS;
    uint64_t sum = 0;
    for (const struct vgpu_region_slot *sl = f->slots, *end = sl + hwm; sl < end; sl++)
        sum += __atomic_load_n(&sl->dev[dev].charged, __ATOMIC_SEQ_CST);
    return sum;
}

static inline uint64_t vgpu_region_sum(const struct vgpu_region_file *f, int dev) {
    return vgpu_region_sum_to(f, dev, __atomic_load_n(&f->slot_hwm, __ATOMIC_SEQ_CST));
}

VGPU_REGION_HIDDEN void vgpu_region_peak_cas(uint64_t *p, uint64_t old, uint64_t used);
VGPU_REGION_HIDDEN int vgpu_region_reserve_slow(struct vgpu_region *r, int dev, uint64_t bytes);
VGPU_REGION_HIDDEN void vgpu_region_release_slow(struct vgpu_region *r, int dev, uint64_t bytes);

/* The lock-free attempt: add to our slot, sum, keep the charge if the sum fits the limit
 * (raising the peak), else take it back out. 1 kept, 0 backed out. */
static inline int vgpu_region_try(struct vgpu_region_file *f, struct vgpu_slot_device *sd, int dev,
                                  uint64_t bytes, uint64_t limit) {
    uint64_t mine = __atomic_add_fetch(&sd->charged, bytes, __ATOMIC_SEQ_CST);
    uint32_t hwm = __atomic_load_n(&f->slot_hwm, __ATOMIC_SEQ_CST);
    /* One slot ever used (a container of one process, the common case): it is ours, and the
     * sum is what our add returned. A newcomer raises slot_hwm before its first add, so the
     * order argument is the loop's. */
    uint64_t used = VGPU_REGION_LIKELY(hwm == 1) ? mine : vgpu_region_sum_to(f, dev, hwm);
    if (VGPU_REGION_LIKELY(used <= limit)) {
        uint64_t *peak = &f->stats[dev].peak, old = __atomic_load_n(peak, __ATOMIC_RELAXED);
        if (VGPU_REGION_UNLIKELY(used > old)) vgpu_region_peak_cas(peak, old, used);
        return 1;
    }
    __atomic_fetch_sub(&sd->charged, bytes, __ATOMIC_SEQ_CST);
    return 0;
}

/* The lock-free reservation alone: our slot's entry for dev, charged and pending, or NULL
 * with nothing charged (no slot yet, over the limit, or a racer in the way: the caller then
 * takes vgpu_region_reserve_slow). The entry stays ours until a fork, and a fork's child has
 * no thread inside an allocation: the caller may keep it for the commit. */
static inline struct vgpu_slot_device *vgpu_region_reserve_fast(struct vgpu_region *r, int dev,
                                                                uint64_t bytes) {
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    uint64_t limit = r->limit[dev];
    if (VGPU_REGION_LIKELY(s >= 0 && bytes <= limit)) {
        struct vgpu_slot_device *sd = &r->file->slots[s].dev[dev];
        if (VGPU_REGION_LIKELY(vgpu_region_try(r->file, sd, dev, bytes, limit))) {
            __atomic_fetch_add(&sd->pending, bytes, __ATOMIC_RELAXED);
            return sd;
        }
    }
    return NULL;
}

/* vgpu_region_reserve for a valid `dev`. */
static inline int vgpu_region_reserve_dev(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (VGPU_REGION_LIKELY(vgpu_region_reserve_fast(r, dev, bytes) != NULL)) return VGPU_REGION_OK;
    return vgpu_region_reserve_slow(r, dev, bytes);
}

/* The commit of a reservation on our slot's entry sd: one RMW on its pending; a commit
 * without its reserve (a forked child finishing its parent's allocation) would go below 0:
 * put the difference back. */
static inline void vgpu_region_commit_sd(struct vgpu_slot_device *sd, uint64_t bytes) {
    uint64_t old = __atomic_fetch_sub(&sd->pending, bytes, __ATOMIC_RELEASE);
    if (VGPU_REGION_UNLIKELY(old < bytes)) __atomic_fetch_add(&sd->pending, bytes - old, __ATOMIC_RELAXED);
}

/* vgpu_region_commit for a valid `dev`. */
static inline void vgpu_region_commit_dev(struct vgpu_region *r, int dev, uint64_t bytes) {
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (VGPU_REGION_UNLIKELY(s < 0)) return;
    vgpu_region_commit_sd(&r->file->slots[s].dev[dev], bytes);
}

/* vgpu_region_release for a valid `dev`: take `bytes` off our slot's charge with one
 * compare-and-swap; more than we hold (clamped, with a warning), a contended swap or no slot
 * yet (a forked child) go the slow way. */
static inline void vgpu_region_release_dev(struct vgpu_region *r, int dev, uint64_t bytes) {
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (VGPU_REGION_LIKELY(s >= 0)) {
        uint64_t *c = &r->file->slots[s].dev[dev].charged;
        uint64_t have = __atomic_load_n(c, __ATOMIC_RELAXED);
        if (VGPU_REGION_LIKELY(bytes <= have) &&
            __atomic_compare_exchange_n(c, &have, have - bytes, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            return;
    }
    vgpu_region_release_slow(r, dev, bytes);
}

#endif
