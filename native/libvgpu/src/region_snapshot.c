/* The host's view of a region: a consistent copy, taken without the region's lock.
 *
 * The host never maps a region. The file lives in the container's writable dir, so its tenant
 * may shrink it at any moment, and a page of a mapping past the new end faults (SIGBUS) and
 * would kill the plugin. The host reads the file with pread(2) into a private buffer laid out
 * as the file (file offset = buffer offset) and runs the seqlock on that copy: a shrunk file
 * reads short and is reported, never faulted on.
 *
 * 1. Seqlock read of the live state: the generation word is read by a pread of its own before
 *    and after the preads of the data; the copy is good when both are the same even value.
 *    Those two preads also read line 0 (magic, sizes) and the lock word: a file that stopped
 *    being the region that was opened is reported as changed, a short read as truncated.
 * 2. A reader that keeps losing to busy writers posts a ticket in snap_request (a pwrite); the
 *    next writer, which holds the mutex anyway, copies the state into `published` (a few KB,
 *    once per request) and the reader takes that copy under its own seqlock, provided it was
 *    made after the reader started (its source generation is newer than the one seen then).
 * 3. A generation stuck odd with the lock word naming a dead holder (its slot's OFD lock is
 *    free) means the last writer died mid-update and no tenant has come by to repair: the reader builds the view the repair
 *    would produce (live slots only, totals summed from them) and says so (`recovered`).
 * 4. A generation stuck odd with a live holder (a stopped process) is reported as busy after
 *    a while: there is no consistent view to give, and the reader never waits on the lock.
 *
 * Why the seqlock holds across preads. Writers make the generation odd, store the data with
 * release stores, then make it even (region.c); readers need their loads of the data ordered
 * after the first load of the generation and before the second. Each pread is a syscall whose
 * copy runs on this thread; read_fence() between them orders the loads of one before those of
 * the next (lfence on x86, whose loads are in order anyway; dmb ishld on arm64). Within one
 * pread the order does not matter: the generation words are never in a data read. The kernel
 * may copy an 8-byte word in pieces: a torn piece of a data word fails the generation check
 * like any concurrent store; a torn generation (a counter that only grows by one) is odd, or
 * even and at least 256 below the value being written: it cannot equal a later read, and an
 * earlier one only if over a hundred updates went by within one copy of microseconds while
 * the kernel split that very word. The one word that changes outside the seqlock, a slot's
 * `pending` (commit is a lone RMW), is informational and clamped to the slot's charge.
 *
 * What a hostile tenant can still do is write its own file with numbers that look consistent:
 * its own view is its own. What it cannot do is crash the host, make it block (the file is
 * opened O_NONBLOCK and must be a regular file) or follow a symlink out of the dir.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "region_internal.h"

enum { SNAPSHOT_TIMEOUT_MS = 200 };

/* --- the writers' half --------------------------------------------------------------------- */

/* Field-wise atomic copy of a slot's dynamic fields. */
static void copy_slot(struct vgpu_region_slot *dst, const struct vgpu_region_slot *src,
                      uint32_t ndev) {
    ST(&dst->state, LD(&src->state));
    ST(&dst->pid, LD(&src->pid));
    ST(&dst->start_time, LD(&src->start_time));
    for (uint32_t d = 0; d < ndev; d++) {
        ST(&dst->dev[d].charged, LD(&src->dev[d].charged));
        ST(&dst->dev[d].pending, LD(&src->dev[d].pending));
    }
}

void vgpu_region_publish_locked(struct vgpu_region_file *f) {
    struct vgpu_region_published *p = &f->published;
    uint64_t request = LD(&f->snap_request);
    uint64_t g = LD_RELAXED(&p->generation) | 1; /* already odd if a publisher died here */
    __atomic_store_n(&p->generation, g, __ATOMIC_RELAXED);
    uint32_t hwm = LD_RELAXED(&f->slot_hwm);
    ST(&p->slot_hwm, hwm);
    ST(&p->source_generation, LD_RELAXED(&f->generation) + 1);
    uint32_t ndev = vgpu_region_ndev(f);
    for (uint32_t d = 0; d < ndev; d++) ST(&p->used[d], LD_RELAXED(&f->used[d]));
    for (uint32_t s = 0; s < hwm && s < VGPU_MAX_SLOTS; s++)
        copy_slot(&p->slots[s], &f->slots[s], ndev);
    ST(&p->generation, g + 1);
    ST(&p->served, request);
}

/* --- the host's private copy --------------------------------------------------------------- */

enum {
    IDENT_LEN = offsetof(struct vgpu_region_file, lock), /* line 0: magic, sizes, counts */
    HEAD_LEN = offsetof(struct vgpu_region_file, slots)  /* and the totals and the devices */
};

struct reader {
    const char *path;
    int fd, writable;
    uint32_t ndev;
    unsigned char ident[IDENT_LEN]; /* line 0 as validated */
    struct vgpu_region_file *c; /* the copy: malloc'd, only this call touches it */
    char *err;
    size_t errlen;
};

/* Orders the loads of the pread before this call before the loads of the pread after it. */
static inline void read_fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("lfence" ::: "memory");
#elif defined(__aarch64__)
    __asm__ __volatile__("dmb ishld" ::: "memory");
#else
    __sync_synchronize();
#endif
}

static void changed(struct reader *r, const char *how) {
    struct stat st;
    long long size = fstat(r->fd, &st) == 0 ? (long long)st.st_size : -1;
    vgpu_region_seterr(r->err, r->errlen, "%s changed while being read: %s (now %lld bytes, "
                       "a region has %zu)", r->path, how, size, sizeof *r->c);
}

/* Read the file's bytes [off, off + len) into `dst`. 0, or -1 with err set: a file that
 * reads short was truncated under us. */
static int fetch_at(struct reader *r, size_t off, void *dst, size_t len) {
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(r->fd, (char *)dst + done, len - done, (off_t)(off + done));
        if (n > 0) {
            done += (size_t)n;
        } else if (n == 0) {
            changed(r, "truncated");
            return -1;
        } else if (errno != EINTR) {
            vgpu_region_seterr(r->err, r->errlen, "cannot read region %s: %s", r->path,
                               strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* Read the file's bytes at [from, to) of the copy into the same place of the copy. */
static int fetch(struct reader *r, const void *from, const void *to) {
    size_t off = (size_t)((const char *)from - (const char *)r->c);
    return fetch_at(r, off, (char *)r->c + off, (size_t)((const char *)to - (const char *)from));
}

/* --- one seqlock read ---------------------------------------------------------------------- */

/* Where a copy is read from: the live state or the published one (pointers into the copy). */
struct view {
    const uint64_t *generation;
    const void *gen_from;              /* read with the generation: line 0, for live */
    const uint64_t *source_generation; /* NULL: the generation itself */
    const uint32_t *slot_hwm;
    const uint64_t *used;
    const void *meta_from, *meta_to;   /* one read: used, slot_hwm, requests */
    const struct vgpu_region_slot *slots;
};

struct attempt {
    uint64_t g1, g2;
    uint32_t lock1, lock2; /* the lock word around the copy (live view only) */
    uint32_t hwm;
    uint8_t dead[VGPU_MAX_SLOTS]; /* the recovered view's dead slots */
    int holder_dead;              /* the lock's holder died (generation odd) */
};

/* Read view `v`'s generation (and, for the live view, line 0 and the lock word with it: a
 * file emptied and rewritten around the copy shows there, at the instants that bound it). */
static int read_gen(struct reader *r, const struct view *v, uint64_t *g, uint32_t *lock) {
    if (fetch(r, v->gen_from, v->generation + 1) != 0) return -1;
    *g = *v->generation;
    *lock = 0;
    if (v->gen_from == (const void *)r->c) {
        if (memcmp(r->c, r->ident, IDENT_LEN) != 0) {
            changed(r, "its header was rewritten");
            return -1;
        }
        *lock = vgpu_region_lock_word(r->c);
    }
    return 0;
}

/* Copy view `v` into the copy between two reads of its generation. `stale_at`: stop after
 * the totals, before the slots, unless the source generation is above it. 1 read (compare
 * the generations), 0 stale, -1 error. */
static int read_once(struct reader *r, const struct view *v, uint64_t stale_at,
                     struct attempt *a) {
    if (read_gen(r, v, &a->g1, &a->lock1) != 0) return -1;
    read_fence();
    if (fetch(r, v->meta_from, v->meta_to) != 0) return -1;
    a->hwm = *v->slot_hwm < VGPU_MAX_SLOTS ? *v->slot_hwm : VGPU_MAX_SLOTS;
    if (v->source_generation && *v->source_generation <= stale_at) return 0;
    if (a->hwm && fetch(r, v->slots, v->slots + a->hwm) != 0) return -1;
    /* A writer died mid-update: which slots' owners are gone, seen inside the window. */
    a->holder_dead = (a->g1 & 1) && vgpu_region_holder_dead(r->fd, a->lock1);
    if (a->holder_dead) {
        for (uint32_t s = 0; s < a->hwm; s++)
            a->dead[s] = v->slots[s].state == VGPU_SLOT_LIVE && vgpu_slot_dead(r->fd, (int)s);
    }
    read_fence();
    return read_gen(r, v, &a->g2, &a->lock2) == 0 ? 1 : -1;
}

/* Fill `out` from a copy that held still. `recovered`: dead slots left out, totals summed. */
static void build(const struct reader *r, const struct view *v, const struct attempt *a,
                  int recovered, struct vgpu_region_snapshot *out) {
    uint32_t n = 0;
    uint64_t sum[VGPU_MAX_DEVICES] = {0};
    for (uint32_t s = 0; s < a->hwm; s++) {
        const struct vgpu_region_slot *sl = &v->slots[s];
        if (sl->state != VGPU_SLOT_LIVE || (recovered && a->dead[s])) continue;
        struct vgpu_snapshot_process *p = &out->processes[n++];
        p->slot = s;
        p->pid = sl->pid;
        p->start_time = sl->start_time;
        p->alive = recovered;
        for (uint32_t d = 0; d < r->ndev; d++) {
            p->used[d] = sl->dev[d].charged;
            p->pending[d] = sl->dev[d].pending < p->used[d] ? sl->dev[d].pending : p->used[d];
            sum[d] += p->used[d];
        }
    }
    for (uint32_t d = 0; d < r->ndev; d++) out->devices[d].used = recovered ? sum[d] : v->used[d];
    out->process_count = n;
    out->generation = v->source_generation ? *v->source_generation : a->g1;
    out->recovered = recovered;
}

/* --- the snapshot -------------------------------------------------------------------------- */

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void backoff(int attempt) {
    if (attempt < 8) return;
    if (attempt < 64) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

/* Ask the writers for a published copy: snap_request moves to a value `published.served`
 * does not hold. A plain write, not an atomic add: only readers write the word, writers
 * compare it with !=, and freshness is judged by the copy's source generation, so a lost or
 * torn update costs at most another request. (Into a file the tenant just shrank, the write
 * extends it again with zeros: the tenant's own file, refused on the next read.) */
static int post_ticket(struct reader *r) {
    uint64_t t = r->c->snap_request + 1;
    if (pwrite(r->fd, &t, sizeof t, (off_t)offsetof(struct vgpu_region_file, snap_request)) !=
        (ssize_t)sizeof t) {
        r->writable = 0; /* refused (EFBIG, ENOSPC...): go on without tickets */
        return -1;
    }
    r->c->snap_request = t; /* what is pending now, as far as we know */
    return 0;
}

/* Take a consistent copy of the dynamic state into `out`. 0, -1 (err set) or EBUSY. */
static int take_copy(struct reader *r, struct vgpu_region_snapshot *out) {
    struct vgpu_region_file *c = r->c;
    struct vgpu_region_published *pb = &c->published;
    const struct view live = {&c->generation, c, NULL, &c->slot_hwm, c->used,
                              c->used, &c->reserved2, c->slots};
    const struct view published = {&pb->generation, &pb->generation, &pb->source_generation,
                                   &pb->slot_hwm, pb->used, &pb->served, pb->slots, pb->slots};
    struct attempt a;
    uint64_t deadline = now_ms() + SNAPSHOT_TIMEOUT_MS, seen_at_ticket = 0;
    int asked = 0, answered = 0;
    for (int attempt = 0;; attempt++) {
        if (read_once(r, &live, 0, &a) < 0) return -1;
        if (a.g1 == a.g2 && !(a.g1 & 1)) {
            build(r, &live, &a, 0, out);
            return 0;
        }
        if (a.g1 == a.g2 && a.lock1 == a.lock2 && a.holder_dead) {
            /* Nobody took the lock meanwhile: a repairer swaps the word first. */
            build(r, &live, &a, 1, out);
            return 0;
        }
        /* A request when none is pending: the first, or again after a writer answered with
         * a copy we could not use (rewritten as we read it, or older than our call). */
        if (r->writable && attempt >= 2 && (!asked || answered)) {
            if (!asked) seen_at_ticket = a.g1;
            asked = post_ticket(r) == 0;
            answered = 0;
        }
        if (asked) {
            int got = read_once(r, &published, seen_at_ticket, &a);
            if (got < 0) return -1;
            if (got && a.g1 == a.g2 && !(a.g1 & 1)) {
                build(r, &published, &a, 0, out);
                out->published = 1;
                return 0;
            }
            answered = pb->served == c->snap_request;
        }
        if (now_ms() > deadline) return VGPU_REGION_EBUSY;
        backoff(attempt);
    }
}

/* Open the file, copy and validate its identity and devices, take a consistent copy of the
 * rest, and check that the file is still the region that was opened. */
static int snapshot(struct reader *r, struct vgpu_region_snapshot *out) {
    uint64_t size = 0;
    /* Read-write only to post tickets; a host that may not write still gets a view when
     * the writers leave it a gap. */
    r->fd = vgpu_region_open_file(r->path, -1, &r->writable, &size, r->err, r->errlen);
    if (r->fd < 0) return VGPU_REGION_EFAIL;
    if (fetch_at(r, 0, r->c, HEAD_LEN) != 0 ||
        vgpu_region_validate(r->c, size, r->path, r->err, r->errlen) != 0)
        return VGPU_REGION_EFAIL;
    memcpy(r->ident, r->c, IDENT_LEN);
    r->ndev = r->c->device_count; /* validated: 1..VGPU_MAX_DEVICES */
    out->device_count = r->ndev;
    for (uint32_t d = 0; d < r->ndev; d++) {
        const struct vgpu_region_device *dv = &r->c->devices[d];
        memcpy(out->devices[d].uuid, dv->uuid, sizeof out->devices[d].uuid - 1);
        out->devices[d].memory_limit = dv->memory_limit;
        out->devices[d].sm_percent = dv->sm_percent;
        const struct vgpu_region_device_stats *st = &r->c->stats[d];
        out->devices[d].refused = st->refused;
        out->devices[d].fallbacks = st->fallbacks;
        out->devices[d].peak = st->peak;
        out->devices[d].gpu_ns = st->gpu_ns;
        out->devices[d].driver_limit = st->driver_limit;
        out->devices[d].driver_limit_state = st->driver_limit_state;
    }
    int rc = take_copy(r, out);
    /* The identity and the devices again: the first read of them may have raced a rewrite of
     * the file (it validates a mix), and a published copy was not bounded by line 0 reads. */
    unsigned char head[HEAD_LEN];
    const size_t devs = offsetof(struct vgpu_region_file, devices);
    if (rc == 0 && fetch_at(r, 0, head, HEAD_LEN) != 0) rc = -1;
    if (rc == 0 && (memcmp(head, r->ident, IDENT_LEN) != 0 ||
                    memcmp(head + devs, (const char *)r->c + devs, HEAD_LEN - devs) != 0)) {
        changed(r, "its header was rewritten");
        rc = -1;
    }
    struct stat st;
    if (rc == 0 && (fstat(r->fd, &st) != 0 || (uint64_t)st.st_size != size)) {
        changed(r, "its size changed");
        rc = -1;
    }
    if (rc == VGPU_REGION_EBUSY) {
        vgpu_region_seterr(r->err, r->errlen, "region %s is busy: a process of the container "
                           "has been stopped inside an update for over %d ms", r->path,
                           SNAPSHOT_TIMEOUT_MS);
        return VGPU_REGION_EBUSY;
    }
    if (rc != 0) return VGPU_REGION_EFAIL;
    if (out->recovered) return VGPU_REGION_OK;
    /* A consistent copy whose slots do not add up was written by something other than this
     * code: refuse it rather than report wrong numbers. */
    for (uint32_t d = 0; d < r->ndev; d++) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < out->process_count; i++) sum += out->processes[i].used[d];
        if (sum != out->devices[d].used) {
            vgpu_region_seterr(r->err, r->errlen, "%s is corrupt: device %u has %llu bytes "
                               "charged but its processes hold %llu", r->path, d,
                               (unsigned long long)out->devices[d].used,
                               (unsigned long long)sum);
            return VGPU_REGION_EFAIL;
        }
    }
    for (uint32_t i = 0; i < out->process_count; i++)
        out->processes[i].alive = !vgpu_slot_dead(r->fd, (int)out->processes[i].slot);
    return VGPU_REGION_OK;
}

VGPU_EXPORT int vgpu_region_snapshot(const char *path, struct vgpu_region_snapshot *out,
                                     char *err, size_t errlen) {
    if (!path || !out) {
        vgpu_region_seterr(err, errlen, "vgpu_region_snapshot: no path or no output");
        return VGPU_REGION_EINVAL;
    }
    memset(out, 0, sizeof *out);
    struct reader r = {.path = path, .fd = -1, .c = malloc(sizeof(struct vgpu_region_file)),
                       .err = err, .errlen = errlen};
    int rc = VGPU_REGION_EFAIL;
    if (r.c)
        rc = snapshot(&r, out);
    else
        vgpu_region_seterr(err, errlen, "cannot read region %s: out of memory", path);
    if (r.fd >= 0) close(r.fd);
    free(r.c);
    return rc;
}
