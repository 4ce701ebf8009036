/* The tenant side of the shared region: this process's slot, reservations and releases,
 * reclaiming dead processes' slots.
 *
 * Concurrency, in one place (the protocol itself is in region.h's rules):
 * - A process writes only its own slot on the hot path, with atomic read-modify-writes (the
 *   process's threads share the slot). A reservation adds, then sums every slot below
 *   slot_hwm, then backs out if over: sequentially consistent, so of two racing reservations
 *   the later sees both. No lock, no shared line written (but peak, rarely).
 * - The lock word in the file (0 free, else the holder's slot index + 1, taken with a
 *   compare-and-swap, dropped with a store) serialises registration, reclaiming dead slots,
 *   closing, and the retry of a reservation the lock-free attempt refused. The holder's slot
 *   is held by its OFD lock for the process's life, so a waiter that finds the lock held for
 *   long asks the kernel whether the holder lives; a process killed holding it has it taken
 *   over (one compare-and-swap: one taker), and the taker reclaims the dead slots. Reclaiming
 *   is idempotent (zero the dead slot, then FREE), so a taker that dies too leaves nothing
 *   worse behind.
 * - A process killed outside the lock leaves a LIVE slot whose OFD lock the kernel dropped,
 *   its charge still counted; the next registration, refused reservation or
 *   vgpu_region_reap() reclaims it, under the lock word, so exactly once.
 * - commit only moves bytes out of the slot's `pending` (an atomic RMW on our own slot).
 */
#include <errno.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "region_internal.h"

/* Open attachments, for the fork handler: a child must not keep its parent's open file
 * description (it would keep the parent's slot looking alive after the parent dies). */
static struct {
    pthread_mutex_t mu;
    struct vgpu_region *head;
} g_regions = {PTHREAD_MUTEX_INITIALIZER, NULL};
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void) { pthread_mutex_lock(&g_regions.mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_regions.mu); }
static void atfork_child(void) {
    pthread_mutex_init(&g_regions.mu, NULL);
    for (struct vgpu_region *r = g_regions.head; r; r = r->next) {
        /* Closing our copy leaves the parent's lock in place; the child registers a slot of
         * its own on its first call (the mapping is inherited and stays valid). */
        if (r->fd >= 0) close(r->fd);
        r->fd = -1;
        __atomic_store_n(&r->slot, -1, __ATOMIC_RELEASE);
        pthread_mutex_init(&r->mu, NULL);
    }
}
static void install_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

/* --- the lock word ----------------------------------------------------------------------- */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Reclaim slot `s` (its owner is dead, or it is ours and we are leaving). Lock held. The
 * charges go to 0 before the slot is FREE: a FREE slot holds nothing, so sums skip no state. */
static void reclaim_locked(struct vgpu_region_file *f, int s) {
    struct vgpu_region_slot *sl = &f->slots[s];
    for (uint32_t d = 0; d < VGPU_MAX_DEVICES; d++) {
        __atomic_store_n(&sl->dev[d].charged, (uint64_t)0, __ATOMIC_SEQ_CST);
        ST(&sl->dev[d].pending, (uint64_t)0);
    }
    ST(&sl->forced, (uint64_t)0);
    ST(&sl->node_pid, 0);
    ST(&sl->pid, 0);
    ST(&sl->start_time, (uint64_t)0);
    ST(&sl->state, (uint32_t)VGPU_SLOT_FREE);
}

/* Reclaim dead slots: all of them (dev < 0) or those holding a charge on `dev`. Lock held. */
static int reap_locked(struct vgpu_region *r, int dev) {
    struct vgpu_region_file *f = r->file;
    uint32_t hwm = LD_RELAXED(&f->slot_hwm);
    int self = __atomic_load_n(&r->slot, __ATOMIC_RELAXED), n = 0;
    if (r->fd < 0) return 0;
    for (uint32_t s = 0; s < hwm && s < VGPU_MAX_SLOTS; s++) {
        struct vgpu_region_slot *sl = &f->slots[s];
        if ((int)s == self || LD_RELAXED(&sl->state) != VGPU_SLOT_LIVE) continue;
        if (dev >= 0 && LD_RELAXED(&sl->dev[dev].charged) == 0) continue;
        if (!vgpu_slot_dead(r->fd, (int)s)) continue;
        reclaim_locked(f, (int)s);
        n++;
    }
    return n;
}

/* The previous holder died holding the lock word: whatever it was doing (registering,
 * reclaiming) is idempotent or reclaimed with its slot. Reclaim every dead slot. */
static void repair_locked(struct vgpu_region *r) {
    int reaped = reap_locked(r, -1);
    vgpu_region_warn("a process died holding the region's lock: %d dead slot(s) reclaimed",
                     reaped);
}

/* The lock is held for tens of nanoseconds, so a waiter first watches the lock word (reads
 * only, no writes to bounce the line) for a few pauses, then yields its CPU a few times (on
 * a busy node the holder may be waiting for a CPU, possibly ours), then naps, asking the
 * kernel at each nap whether the holder still lives (its slot's OFD lock). Tuned with
 * bench/bench_region.py. */
enum { LOCK_SPINS = 4, LOCK_YIELDS = 32 };

static int __attribute__((noinline)) lock_contended(struct vgpu_region *r, uint32_t me, int registering) {
    uint32_t *w = &r->file->lock;
    long nap_ns = 20000; /* 20 us, doubling up to 1 ms */
    for (int i = 0;; i++) {
        uint32_t cur = __atomic_load_n(w, __ATOMIC_RELAXED);
        if (cur == 0) {
            if (__atomic_compare_exchange_n(w, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return 0;
            continue;
        }
        if (cur == me && registering) {
            /* We hold this slot's byte now, so whoever held the region's lock as this slot
             * died holding it (no thread of ours can: we have no slot yet). */
            if (__atomic_compare_exchange_n(w, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return 1;
        } else if (i < LOCK_SPINS) {
            cpu_relax();
        } else if (i < LOCK_SPINS + LOCK_YIELDS) {
            syscall(SYS_sched_yield); /* sched_yield: one import fewer */
        } else if (cur != me && r->fd >= 0 && vgpu_region_holder_dead(r->fd, cur)) {
            /* Its holder died inside a critical section: whoever swaps the word repairs. (Our
             * own slot is never asked about: it is another thread of ours, and our own OFD
             * lock does not conflict with us, so it would look dead.) */
            if (__atomic_compare_exchange_n(w, &cur, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return 1;
        } else {
            struct timespec ts = {0, nap_ns};
            nanosleep(&ts, NULL);
            if (nap_ns < 1000000) nap_ns *= 2;
        }
    }
}

static void repair_locked(struct vgpu_region *r);

/* Take the region's lock as slot `slot` (ours, or the one a registration holds). */
static inline int region_lock_as(struct vgpu_region *r, int slot, int registering) {
    uint32_t me = (uint32_t)slot + 1, zero = 0;
    if (VGPU_LIKELY(__atomic_compare_exchange_n(&r->file->lock, &zero, me, 0, __ATOMIC_ACQUIRE,
                                                __ATOMIC_RELAXED)))
        return 0;
    if (lock_contended(r, me, registering)) repair_locked(r);
    return 0;
}

static inline int region_lock(struct vgpu_region *r) {
    int s = __atomic_load_n(&r->slot, __ATOMIC_RELAXED);
    if (VGPU_UNLIKELY(s < 0)) {
        if (!__atomic_exchange_n(&r->warned_broken, 1, __ATOMIC_RELAXED))
            vgpu_region_warn("cannot lock the region %s: this process has no slot; allocations "
                             "are refused", r->path);
        return -1;
    }
    return region_lock_as(r, s, 0);
}

static inline void region_unlock(struct vgpu_region *r) {
    __atomic_store_n(&r->file->lock, 0u, __ATOMIC_RELEASE);
}

/* --- slots -------------------------------------------------------------------------------- */

static int register_slot(struct vgpu_region *r, char *err, size_t errlen) {
    struct vgpu_region_file *f = r->file;
    uint64_t start = vgpu_proc_start_time();
    int32_t pid = (int32_t)getpid();
    /* The slot first: its OFD lock is this process's identity as the region lock's holder.
     * A slot whose byte is locked is a live process's (or one between leaving and closing
     * its file); a LIVE slot whose byte we could lock is a dead process's, reclaimed below. */
    int slot = -1;
    for (int s = 0; s < VGPU_MAX_SLOTS && slot < 0; s++)
        if (vgpu_slot_lock(r->fd, s, F_WRLCK) == 0) slot = s;
    if (slot >= 0) {
        region_lock_as(r, slot, 1);
        reap_locked(r, -1); /* our slot too, if a dead process left it LIVE */
        struct vgpu_region_slot *sl = &f->slots[slot];
        for (uint32_t d = 0; d < VGPU_MAX_DEVICES; d++) {
            __atomic_store_n(&sl->dev[d].charged, (uint64_t)0, __ATOMIC_SEQ_CST);
            ST(&sl->dev[d].pending, (uint64_t)0);
        }
        ST(&sl->forced, (uint64_t)0);
        ST(&sl->node_pid, 0);
        ST(&sl->pid, pid);
        ST(&sl->start_time, start);
        ST(&sl->state, (uint32_t)VGPU_SLOT_LIVE);
        /* Sequentially consistent, before our first reservation: a reservation racing ours
         * loads slot_hwm after its add, so it sums our slot whenever ours came first. */
        if ((uint32_t)slot >= LD_RELAXED(&f->slot_hwm))
            __atomic_store_n(&f->slot_hwm, (uint32_t)slot + 1, __ATOMIC_SEQ_CST);
        region_unlock(r);
    }
    if (slot < 0) {
        vgpu_region_seterr(err, errlen, "region %s: all %d process slots are in use", r->path,
                           VGPU_MAX_SLOTS);
        return -1;
    }
    __atomic_store_n(&r->slot, slot, __ATOMIC_RELEASE);
    return slot;
}

/* A description of the region file of our own, to carry our slot's lock. It is never the
 * one the mapping was made from: a mapping holds its file description, so a forked child's
 * inherited mapping would keep the parent's lock alive after the parent's death. */
static int open_lock_fd(const struct vgpu_region *r) {
    struct stat st;
    int fd = open(r->path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0 && (fstat(fd, &st) != 0 || st.st_dev != r->st_dev || st.st_ino != r->st_ino)) {
        close(fd);
        errno = ESTALE;
        fd = -1;
    }
    return fd;
}

/* A forked child's first call: open its own description of the file, take a slot. */
static int __attribute__((noinline)) reregister(struct vgpu_region *r) {
    char err[VGPU_REGION_ERRLEN];
    pthread_mutex_lock(&r->mu);
    int slot = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (slot < 0) {
        int fd = open_lock_fd(r);
        if (fd >= 0) {
            r->fd = fd;
            slot = register_slot(r, err, sizeof err);
        } else {
            snprintf(err, sizeof err, "cannot reopen %s: %s", r->path, strerror(errno));
        }
        if (slot < 0 && !__atomic_exchange_n(&r->warned_broken, 1, __ATOMIC_RELAXED))
            vgpu_region_warn("forked child cannot register in the region: %s; allocations "
                             "are refused", err);
    }
    pthread_mutex_unlock(&r->mu);
    return slot;
}

static inline int ensure_slot(struct vgpu_region *r) {
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    return VGPU_LIKELY(s >= 0) ? s : reregister(r);
}

/* --- open and close ----------------------------------------------------------------------- */

static void set_limits(struct vgpu_region *r, const struct vgpu_limits *own) {
    const struct vgpu_region_file *f = r->file;
    for (int d = 0; d < r->device_count; d++) {
        const struct vgpu_region_device *dv = &f->devices[d];
        r->limit[d] = dv->memory_limit;
        for (uint32_t i = 0; own && i < own->count && i < VGPU_MAX_DEVICES; i++) {
            const struct vgpu_device_limit *o = &own->devices[i];
            if (strncmp(o->uuid, dv->uuid, sizeof o->uuid) != 0) continue;
            if (o->memory_limit != dv->memory_limit)
                vgpu_region_warn("%s: the region limits %.80s to %llu bytes, this process's "
                                 "limits say %llu: the lower applies", r->path, dv->uuid,
                                 (unsigned long long)dv->memory_limit,
                                 (unsigned long long)o->memory_limit);
            if (o->memory_limit < r->limit[d]) r->limit[d] = o->memory_limit;
        }
    }
    for (uint32_t i = 0; own && i < own->count && i < VGPU_MAX_DEVICES; i++) {
        if (vgpu_region_device_index(r, own->devices[i].uuid) < 0)
            vgpu_region_warn("%s has no record of GPU %.80s: allocations there cannot be "
                             "accounted", r->path, own->devices[i].uuid);
    }
}

VGPU_EXPORT int vgpu_region_open(const char *path, const struct vgpu_limits *limits,
                                 struct vgpu_region **out, char *err, size_t errlen) {
    if (!out || !path) {
        vgpu_region_seterr(err, errlen, "vgpu_region_open: no path or no out pointer");
        return VGPU_REGION_EINVAL;
    }
    *out = NULL;
    pthread_once(&g_atfork_once, install_atfork);
    if (limits && vgpu_region_create(path, limits, err, errlen) < 0) return VGPU_REGION_EFAIL;
    int fd = -1;
    struct vgpu_region_file *f = vgpu_region_map(path, 1, &fd, NULL, err, errlen);
    if (!f) return VGPU_REGION_EFAIL;
    size_t plen = strlen(path) + 1;
    struct vgpu_region *r = calloc(1, sizeof *r + plen);
    struct stat st;
    if (!r || fstat(fd, &st) != 0) {
        vgpu_region_seterr(err, errlen, "cannot attach to region %s: %s", path,
                           strerror(errno));
        free(r);
        vgpu_region_unmap(f, fd);
        return VGPU_REGION_EFAIL;
    }
    close(fd); /* the mapping keeps the file; our lock goes on a description of its own */
    memcpy(r->path, path, plen);
    r->file = f;
    r->device_count = (int)vgpu_region_ndev(f);
    r->st_dev = st.st_dev;
    r->st_ino = st.st_ino;
    r->fd = open_lock_fd(r);
    r->slot = -1;
    pthread_mutex_init(&r->mu, NULL);
    set_limits(r, limits);
    if (r->fd < 0) {
        vgpu_region_seterr(err, errlen, "cannot reopen region %s: %s", path, strerror(errno));
    }
    if (r->fd < 0 || register_slot(r, err, errlen) < 0) {
        pthread_mutex_destroy(&r->mu);
        vgpu_region_unmap(f, r->fd);
        free(r);
        return VGPU_REGION_EFAIL;
    }
    pthread_mutex_lock(&g_regions.mu);
    r->next = g_regions.head;
    g_regions.head = r;
    pthread_mutex_unlock(&g_regions.mu);
    *out = r;
    return VGPU_REGION_OK;
}

VGPU_EXPORT void vgpu_region_close(struct vgpu_region *r) {
    if (!r) return;
    pthread_mutex_lock(&g_regions.mu);
    for (struct vgpu_region **p = &g_regions.head; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_regions.mu);
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (s >= 0 && region_lock(r) == 0) {
        reclaim_locked(r->file, s);
        region_unlock(r);
    }
    /* Closing the description drops the slot's lock, after the slot is FREE. */
    vgpu_region_unmap(r->file, r->fd);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* --- queries ------------------------------------------------------------------------------ */

VGPU_EXPORT int vgpu_region_device_index(const struct vgpu_region *r, const char *uuid) {
    if (!r || !uuid) return -1;
    for (int d = 0; d < r->device_count; d++) {
        if (strncmp(r->file->devices[d].uuid, uuid, VGPU_UUID_SIZE) == 0) return d;
    }
    return -1;
}

VGPU_EXPORT int vgpu_region_device_count(const struct vgpu_region *r) {
    return r ? r->device_count : 0;
}

static inline int bad_dev(const struct vgpu_region *r, int dev) {
    return !r || (unsigned)dev >= (unsigned)r->device_count;
}

VGPU_EXPORT uint64_t vgpu_region_limit(const struct vgpu_region *r, int dev) {
    return bad_dev(r, dev) ? 0 : r->limit[dev];
}

VGPU_EXPORT uint64_t vgpu_region_usage(const struct vgpu_region *r, int dev) {
    return bad_dev(r, dev) ? 0 : vgpu_region_sum(r->file, dev);
}

VGPU_EXPORT uint64_t vgpu_region_own_usage(const struct vgpu_region *r, int dev) {
    if (bad_dev(r, dev)) return 0;
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    return s < 0 ? 0 : LD(&r->file->slots[s].dev[dev].charged);
}

uint64_t vgpu_region_own_committed(const struct vgpu_region *r, int dev) {
    if (bad_dev(r, dev)) return 0;
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (s < 0) return 0;
    const struct vgpu_slot_device *sd = &r->file->slots[s].dev[dev];
    uint64_t charged = LD(&sd->charged), pending = LD(&sd->pending);
    return charged > pending ? charged - pending : 0;
}

void vgpu_region_count(struct vgpu_region *r, int dev, enum vgpu_region_counter what, uint64_t n) {
    if (bad_dev(r, dev)) return;
    struct vgpu_region_device_stats *st = &r->file->stats[dev];
    uint64_t *c = what == VGPU_COUNT_REFUSED ? &st->refused : what == VGPU_COUNT_FALLBACK ? &st->fallbacks : &st->gpu_ns;
    __atomic_fetch_add(c, n, __ATOMIC_RELAXED);
}

uint64_t vgpu_region_context_bytes(const struct vgpu_region *r, int dev) {
    return bad_dev(r, dev) ? 0 : __atomic_load_n(&r->file->stats[dev].context_bytes, __ATOMIC_RELAXED);
}

void vgpu_region_set_context_bytes(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (!bad_dev(r, dev)) __atomic_store_n(&r->file->stats[dev].context_bytes, bytes, __ATOMIC_RELAXED);
}

int vgpu_region_has_pid(const struct vgpu_region *r, int32_t pid) {
    if (!r) return 0;
    const struct vgpu_region_file *f = r->file;
    uint32_t hwm = LD_RELAXED(&f->slot_hwm);
    for (uint32_t s = 0; s < hwm && s < VGPU_MAX_SLOTS; s++) {
        if (LD_RELAXED(&f->slots[s].state) != VGPU_SLOT_LIVE) continue;
        /* A slot whose node pid is known is matched by it alone: its pid here may be another
         * container's process's pid on the node. */
        int32_t node = LD_RELAXED(&f->slots[s].node_pid);
        if ((node ? node : LD_RELAXED(&f->slots[s].pid)) == pid) return 1;
    }
    return 0;
}

void vgpu_region_set_node_pid(struct vgpu_region *r, int32_t pid) {
    int s = r ? __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE) : -1;
    if (s >= 0) ST(&r->file->slots[s].node_pid, pid);
}

/* --- reserve, commit, rollback, release ---------------------------------------------------- */

static inline int fits(uint64_t used, uint64_t bytes, uint64_t limit) {
    return used <= limit && bytes <= limit - used;
}

/* Raise a peak to `used` if it is higher (a compare-and-swap: peak only rises). Out of line:
 * the hot path only compares. */
void vgpu_region_peak_cas(uint64_t *p, uint64_t old, uint64_t used) {
    while (used > old && !__atomic_compare_exchange_n(p, &old, used, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Under the lock word: reclaim dead slots holding a charge on dev, then try again. Only
 * lock-free racers can add beside us here, and one that backs out comes to this lock after
 * us; while the sum without us shows room (a racer's add seen, then withdrawn), try again,
 * a bounded number of times. */
enum { LOCKED_TRIES = 8 };

static int __attribute__((noinline)) reserve_locked(struct vgpu_region *r, int s, int dev, uint64_t bytes) {
    struct vgpu_region_file *f = r->file;
    struct vgpu_slot_device *sd = &f->slots[s].dev[dev];
    uint64_t limit = r->limit[dev];
    if (bytes > limit) return VGPU_REGION_DENIED; /* and the add could wrap */
    if (region_lock(r) != 0) return VGPU_REGION_EFAIL;
    int ok = 0, reaped = 0;
    for (int i = 0; i < LOCKED_TRIES && !ok; i++) {
        ok = vgpu_region_try(f, sd, dev, bytes, limit);
        if (ok) break;
        if (!reaped) {
            reaped = 1;
            if (reap_locked(r, dev) > 0) continue;
        }
        if (!fits(vgpu_region_sum(f, dev), bytes, limit)) break;
        syscall(SYS_sched_yield); /* the racer whose add we saw may be waiting for a CPU */
    }
    if (ok) __atomic_fetch_add(&sd->pending, bytes, __ATOMIC_RELAXED);
    region_unlock(r);
    return ok ? VGPU_REGION_OK : VGPU_REGION_DENIED;
}

/* Everything but the lock-free attempt on a registered process's slot: a forked child's
 * first call, a request past the limit itself, the locked retry. */
int vgpu_region_reserve_slow(struct vgpu_region *r, int dev, uint64_t bytes) {
    int s = ensure_slot(r);
    if (s < 0) {
        (void)region_lock(r); /* says why, once */
        return VGPU_REGION_EFAIL;
    }
    return reserve_locked(r, s, dev, bytes);
}

VGPU_EXPORT int vgpu_region_reserve(struct vgpu_region *r, int dev, uint64_t bytes) {
    return VGPU_UNLIKELY(bad_dev(r, dev)) ? VGPU_REGION_EINVAL : vgpu_region_reserve_dev(r, dev, bytes);
}

void vgpu_region_force(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (bad_dev(r, dev)) return;
    int s = ensure_slot(r);
    if (s < 0) return;
    struct vgpu_region_slot *sl = &r->file->slots[s];
    __atomic_fetch_or(&sl->forced, (uint64_t)1 << dev, __ATOMIC_RELAXED);
    __atomic_fetch_add(&sl->dev[dev].charged, bytes, __ATOMIC_SEQ_CST);
    uint64_t *peak = &r->file->stats[dev].peak;
    vgpu_region_peak_cas(peak, LD_RELAXED(peak), vgpu_region_sum(r->file, dev));
}

/* pending -= bytes, never below 0 (our other threads commit beside us). */
static void pending_sub(uint64_t *p, uint64_t bytes) {
    uint64_t old = LD_RELAXED(p), next;
    do {
        next = old >= bytes ? old - bytes : 0;
    } while (!__atomic_compare_exchange_n(p, &old, next, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED));
}

VGPU_EXPORT void vgpu_region_commit(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (VGPU_LIKELY(!bad_dev(r, dev))) vgpu_region_commit_dev(r, dev, bytes);
}

/* Take up to `bytes` off our slot's charge (a compare-and-swap: never below 0, even
 * with our other threads at it). */
static void clamp_warn(struct vgpu_region *r, int dev, uint64_t bytes, uint64_t have);
static void uncharge(struct vgpu_region *r, int s, int dev, uint64_t bytes) {
    uint64_t *c = &r->file->slots[s].dev[dev].charged;
    uint64_t have = LD_RELAXED(c);
    for (;;) {
        uint64_t take = bytes;
        if (VGPU_UNLIKELY(take > have)) {
            clamp_warn(r, dev, bytes, have);
            take = have;
        }
        if (__atomic_compare_exchange_n(c, &have, have - take, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            return;
    }
}

static void __attribute__((noinline, cold)) clamp_warn(struct vgpu_region *r, int dev, uint64_t bytes,
                                                       uint64_t have) {
    if (r->warned_clamp) return;
    r->warned_clamp = 1;
    vgpu_region_warn("release of %llu bytes on device %d exceeds the %llu this process "
                     "holds there: clamped (warned once)", (unsigned long long)bytes, dev,
                     (unsigned long long)have);
}

VGPU_EXPORT void vgpu_region_rollback(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (bad_dev(r, dev)) return;
    int s = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (s < 0) return;
    pending_sub(&r->file->slots[s].dev[dev].pending, bytes);
    uncharge(r, s, dev, bytes);
}

/* A release the inline path did not finish: a forked child freeing what its parent
 * allocated (it holds nothing here), more than we hold, or a swap lost to our other threads. */
void vgpu_region_release_slow(struct vgpu_region *r, int dev, uint64_t bytes) {
    int s = ensure_slot(r);
    if (s >= 0) uncharge(r, s, dev, bytes);
}

VGPU_EXPORT void vgpu_region_release(struct vgpu_region *r, int dev, uint64_t bytes) {
    if (VGPU_LIKELY(!bad_dev(r, dev))) vgpu_region_release_dev(r, dev, bytes);
}

VGPU_EXPORT int vgpu_region_reap(struct vgpu_region *r) {
    if (!r || ensure_slot(r) < 0 || region_lock(r) != 0) return -1;
    int n = reap_locked(r, -1);
    region_unlock(r);
    return n;
}
