/* The host's view of a region: a consistent copy, taken without the region's lock.
 *
 * 1. Seqlock read of the live state: generation even and unchanged around the copy.
 * 2. A reader that keeps losing to busy writers posts a ticket in snap_request; the next
 *    writer, which holds the mutex anyway, copies the state into `published` (a few KB, once
 *    per request) and the reader takes that copy under its own seqlock.
 * 3. A generation stuck odd with OWNER_DIED in the lock word means the last writer died
 *    mid-update and no tenant has come by to repair: the reader builds the view the repair
 *    would produce (live slots only, totals summed from them) and says so (`recovered`).
 * 4. A generation stuck odd with a live holder (a stopped process) is reported as busy after
 *    a while: there is no consistent view to give, and the reader never waits on the lock.
 */
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "region_internal.h"

enum { SNAPSHOT_TIMEOUT_MS = 200 };

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

/* Where a copy is read from: the live state or the published one. */
struct view {
    const uint64_t *generation;
    const uint64_t *source_generation; /* NULL: the generation itself */
    const uint32_t *slot_hwm;
    const uint64_t *used;
    const struct vgpu_region_slot *slots;
};

/* Copy `v` into `out` (devices' used, LIVE slots). 1 if the copy is consistent. */
static int read_view(const struct view *v, uint32_t ndev, struct vgpu_region_snapshot *out) {
    uint64_t g1 = LD(v->generation);
    if (g1 & 1) return 0;
    uint64_t gen = v->source_generation ? LD(v->source_generation) : g1;
    for (uint32_t d = 0; d < ndev; d++) out->devices[d].used = LD(&v->used[d]);
    uint32_t hwm = LD(v->slot_hwm), n = 0;
    for (uint32_t s = 0; s < hwm && s < VGPU_MAX_SLOTS; s++) {
        const struct vgpu_region_slot *sl = &v->slots[s];
        if (LD(&sl->state) != VGPU_SLOT_LIVE) continue;
        struct vgpu_snapshot_process *p = &out->processes[n++];
        p->slot = s;
        p->pid = LD(&sl->pid);
        p->start_time = LD(&sl->start_time);
        for (uint32_t d = 0; d < ndev; d++) {
            p->used[d] = LD(&sl->dev[d].charged);
            p->pending[d] = LD(&sl->dev[d].pending);
        }
    }
    /* Ordered after the acquire loads above: a writer's store seen there means its odd
     * generation is seen here. */
    if (LD_RELAXED(v->generation) != g1) return 0;
    out->process_count = n;
    out->generation = gen;
    return 1;
}

/* The view a repair would produce after a writer died mid-update. 1 if it held still. */
static int read_recovered(const struct vgpu_region_file *f, int fd, uint32_t ndev,
                          struct vgpu_region_snapshot *out) {
    uint64_t g1 = LD(&f->generation);
    if (!(g1 & 1) || !(vgpu_region_lock_word(f) & VGPU_FUTEX_OWNER_DIED)) return 0;
    uint32_t hwm = LD(&f->slot_hwm), n = 0;
    uint64_t sum[VGPU_MAX_DEVICES] = {0};
    for (uint32_t s = 0; s < hwm && s < VGPU_MAX_SLOTS; s++) {
        const struct vgpu_region_slot *sl = &f->slots[s];
        if (LD(&sl->state) != VGPU_SLOT_LIVE || vgpu_slot_dead(fd, (int)s)) continue;
        struct vgpu_snapshot_process *p = &out->processes[n++];
        p->slot = s;
        p->pid = LD(&sl->pid);
        p->start_time = LD(&sl->start_time);
        p->alive = 1;
        for (uint32_t d = 0; d < ndev; d++) {
            p->used[d] = LD(&sl->dev[d].charged);
            p->pending[d] = LD(&sl->dev[d].pending);
            sum[d] += p->used[d];
        }
    }
    /* Nobody may have taken the lock meanwhile: a repairer clears OWNER_DIED first. */
    if (LD_RELAXED(&f->generation) != g1 ||
        !(vgpu_region_lock_word(f) & VGPU_FUTEX_OWNER_DIED))
        return 0;
    for (uint32_t d = 0; d < ndev; d++) out->devices[d].used = sum[d];
    out->process_count = n;
    out->generation = g1;
    out->recovered = 1;
    return 1;
}

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

/* Take a consistent copy of the dynamic state. 0, or VGPU_REGION_EBUSY. */
static int take_copy(struct vgpu_region_file *f, int fd, int writable, uint32_t ndev,
                     struct vgpu_region_snapshot *out) {
    const struct view live = {&f->generation, NULL, &f->slot_hwm, f->used, f->slots};
    const struct vgpu_region_published *pb = &f->published;
    const struct view published = {&pb->generation, &pb->source_generation, &pb->slot_hwm,
                                   pb->used, pb->slots};
    uint64_t ticket = 0, deadline = now_ms() + SNAPSHOT_TIMEOUT_MS;
    for (int attempt = 0;; attempt++) {
        if (read_view(&live, ndev, out)) return 0;
        if (writable && !ticket && attempt >= 2)
            ticket = __atomic_add_fetch(&f->snap_request, 1, __ATOMIC_ACQ_REL);
        if (ticket && LD(&pb->served) >= ticket && read_view(&published, ndev, out)) {
            out->published = 1;
            return 0;
        }
        if (read_recovered(f, fd, ndev, out)) return 0;
        if (now_ms() > deadline) return VGPU_REGION_EBUSY;
        backoff(attempt);
    }
}

VGPU_EXPORT int vgpu_region_snapshot(const char *path, struct vgpu_region_snapshot *out,
                                     char *err, size_t errlen) {
    if (!path || !out) {
        vgpu_region_seterr(err, errlen, "vgpu_region_snapshot: no path or no output");
        return VGPU_REGION_EINVAL;
    }
    memset(out, 0, sizeof *out);
    int fd = -1, writable = 0;
    /* Read-write only to post tickets; a host that may not write still gets a view when
     * the writers leave it a gap. */
    struct vgpu_region_file *f = vgpu_region_map(path, -1, &fd, &writable, err, errlen);
    if (!f) return VGPU_REGION_EFAIL;
    uint32_t ndev = vgpu_region_ndev(f); /* read once: everything below keeps to it */
    out->device_count = ndev;
    for (uint32_t d = 0; d < ndev; d++) {
        memcpy(out->devices[d].uuid, f->devices[d].uuid, sizeof out->devices[d].uuid - 1);
        out->devices[d].memory_limit = f->devices[d].memory_limit;
        out->devices[d].sm_percent = f->devices[d].sm_percent;
    }
    int rc = take_copy(f, fd, writable, ndev, out);
    if (rc == VGPU_REGION_EBUSY) {
        vgpu_region_seterr(err, errlen, "region %s is busy: a process of the container has "
                           "been stopped inside an update for over %d ms", path,
                           SNAPSHOT_TIMEOUT_MS);
    } else if (!out->recovered) {
        /* A consistent copy whose slots do not add up was written by something other than
         * this code: refuse it rather than report wrong numbers. */
        for (uint32_t d = 0; d < ndev && rc == 0; d++) {
            uint64_t sum = 0;
            for (uint32_t i = 0; i < out->process_count; i++) sum += out->processes[i].used[d];
            if (sum != out->devices[d].used) {
                vgpu_region_seterr(err, errlen, "%s is corrupt: device %u has %llu bytes "
                                   "charged but its processes hold %llu", path, d,
                                   (unsigned long long)out->devices[d].used,
                                   (unsigned long long)sum);
                rc = VGPU_REGION_EFAIL;
            }
        }
        for (uint32_t i = 0; i < out->process_count && rc == 0; i++)
            out->processes[i].alive = !vgpu_slot_dead(fd, (int)out->processes[i].slot);
    }
    vgpu_region_unmap(f, fd);
    return rc;
}
