/* The host's view of a region, taken without the region's lock and without mapping it.
 *
 * The host never maps a region. The file lives in the container's writable dir, so its tenant
 * may shrink it at any moment, and a page of a mapping past the new end faults (SIGBUS) and
 * would kill the plugin. The host reads the file with pread(2) into a private buffer laid out
 * as the file (file offset = buffer offset): a shrunk file reads short and is reported, never
 * faulted on.
 *
 * There are no totals in the file (version 3): a device's usage is the sum of the slots, and
 * writers change only their own slot, with no lock and no sequence counter. So the reader
 * (region.h's rules):
 * 1. reads line 0 and 1 (identity, slot_hwm) and the slots below slot_hwm, then the slots
 *    again (read_fence() between the preads orders the loads of one before the next);
 * 2. keeps the copy when the two agree byte for byte. The kernel may copy an 8-byte word in
 *    pieces; a torn word is one being written during the copy, and it would have to be torn
 *    the same way with the same bytes in both copies to pass. An agreeing copy holds, for
 *    each slot, values the slot really had (at most microseconds old): valid, not an
 *    instant's cut;
 * 3. sums each device over the live processes (a dead one's unreclaimed charge is listed but
 *    is not memory anyone holds). A sum over the limit comes from a reservation between its
 *    add and its back-out, or a release and a later reservation seen at different instants:
 *    both pass within microseconds, so the reader reads again, for up to OVER_LIMIT_MS.
 *    Memory forced past the limit (a slot's `forced` bit) is shown at once, and whatever is
 *    still over after that time (a process stopped inside a reservation) is shown as it is;
 * 4. a region whose slots never agree for SNAPSHOT_TIMEOUT_MS is reported busy.
 *
 * What a hostile tenant can still do is write its own file with numbers that look right: its
 * own view is its own. What it cannot do is crash the host, make it block (the file is
 * opened O_NONBLOCK and must be a regular file) or follow a symlink out of the dir.
 */
#include <errno.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "region_internal.h"

enum { SNAPSHOT_TIMEOUT_MS = 200, OVER_LIMIT_MS = 50 };

enum {
    IDENT_LEN = offsetof(struct vgpu_region_file, lock),     /* line 0: magic, sizes, counts */
    LINES_LEN = offsetof(struct vgpu_region_file, reserved2), /* and line 1: slot_hwm */
    HEAD_LEN = offsetof(struct vgpu_region_file, slots)       /* and the counters, devices */
};

struct reader {
    const char *path;
    int fd;
    uint32_t ndev;
    unsigned char ident[IDENT_LEN]; /* line 0 as validated */
    struct vgpu_region_file *c; /* the copy: malloc'd, only this call touches it */
    struct vgpu_region_slot *again; /* the second read of the slots */
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

/* One double read of the slots below slot_hwm. 1: both copies agree (the copy is in r->c),
 * 0: they do not, -1: error. */
static int read_twice(struct reader *r, uint32_t *hwm) {
    if (fetch_at(r, 0, r->c, LINES_LEN) != 0) return -1;
    if (memcmp(r->c, r->ident, IDENT_LEN) != 0) {
        changed(r, "its header was rewritten");
        return -1;
    }
    *hwm = r->c->slot_hwm < VGPU_MAX_SLOTS ? r->c->slot_hwm : VGPU_MAX_SLOTS;
    size_t off = offsetof(struct vgpu_region_file, slots), len = *hwm * sizeof(struct vgpu_region_slot);
    if (!len) return 1;
    read_fence();
    if (fetch_at(r, off, r->c->slots, len) != 0) return -1;
    read_fence();
    if (fetch_at(r, off, r->again, len) != 0) return -1;
    return memcmp(r->c->slots, r->again, len) == 0;
}

/* Fill `out` from an agreeing copy. Returns 1 when a device's live sum passes its limit
 * without memory forced past it there. */
static int build(const struct reader *r, uint32_t hwm, struct vgpu_region_snapshot *out) {
    uint32_t n = 0;
    uint64_t sum[VGPU_MAX_DEVICES] = {0}, forced = 0;
    for (uint32_t s = 0; s < hwm; s++) {
        const struct vgpu_region_slot *sl = &r->c->slots[s];
        if (sl->state != VGPU_SLOT_LIVE) continue;
        struct vgpu_snapshot_process *p = &out->processes[n++];
        p->slot = s;
        p->pid = sl->pid;
        p->start_time = sl->start_time;
        p->alive = !vgpu_slot_dead(r->fd, (int)s);
        if (p->alive) forced |= sl->forced;
        for (uint32_t d = 0; d < r->ndev; d++) {
            p->used[d] = sl->dev[d].charged;
            p->pending[d] = sl->dev[d].pending < p->used[d] ? sl->dev[d].pending : p->used[d];
            if (p->alive) sum[d] = sum[d] + p->used[d] >= sum[d] ? sum[d] + p->used[d] : UINT64_MAX;
        }
    }
    int over = 0;
    for (uint32_t d = 0; d < r->ndev; d++) {
        out->devices[d].used = sum[d];
        if (sum[d] > out->devices[d].memory_limit && !(forced >> d & 1)) over = 1;
    }
    out->process_count = n;
    return over;
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
        syscall(SYS_sched_yield); /* sched_yield: one import fewer */
        return;
    }
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

/* Read until two copies agree and show no sum over a limit (see the top of this file). */
static int take_copy(struct reader *r, struct vgpu_region_snapshot *out) {
    uint64_t start = now_ms();
    for (int attempt = 0;; attempt++) {
        uint32_t hwm = 0;
        int got = read_twice(r, &hwm);
        if (got < 0) return -1;
        out->attempts = (uint32_t)attempt + 1;
        if (got && (!build(r, hwm, out) || now_ms() - start > OVER_LIMIT_MS)) return 0;
        if (!got && now_ms() - start > SNAPSHOT_TIMEOUT_MS) return VGPU_REGION_EBUSY;
        backoff(attempt);
    }
}

/* Open the file, copy and validate its identity and devices, take a consistent copy of the
 * rest, and check that the file is still the region that was opened. */
static int snapshot(struct reader *r, struct vgpu_region_snapshot *out) {
    uint64_t size = 0;
    r->fd = vgpu_region_open_file(r->path, 0, NULL, &size, r->err, r->errlen);
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
     * the file (it validates a mix). */
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
        vgpu_region_seterr(r->err, r->errlen, "region %s is busy: two reads of its slots "
                           "never agreed in %d ms", r->path, SNAPSHOT_TIMEOUT_MS);
        return VGPU_REGION_EBUSY;
    }
    return rc == 0 ? VGPU_REGION_OK : VGPU_REGION_EFAIL;
}

VGPU_EXPORT int vgpu_region_snapshot(const char *path, struct vgpu_region_snapshot *out,
                                     char *err, size_t errlen) {
    if (!path || !out) {
        vgpu_region_seterr(err, errlen, "vgpu_region_snapshot: no path or no output");
        return VGPU_REGION_EINVAL;
    }
    memset(out, 0, sizeof *out);
    struct reader r = {.path = path, .fd = -1, .c = malloc(sizeof(struct vgpu_region_file)),
                       .again = malloc(sizeof r.c->slots), .err = err, .errlen = errlen};
    int rc = VGPU_REGION_EFAIL;
    if (r.c && r.again)
        rc = snapshot(&r, out);
    else
        vgpu_region_seterr(err, errlen, "cannot read region %s: out of memory", path);
    if (r.fd >= 0) close(r.fd);
    free(r.c);
    free(r.again);
    return rc;
}
