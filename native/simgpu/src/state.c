/* Node-wide state: attach, per-process slots with OFD-lock liveness, memory, timeline, faults. */
#include "state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <linux/futex.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Process-local attachment. One per process by nature (the node is process-wide); reset in a
 * forked child so the child registers as a process of its own. */
static struct {
    pthread_mutex_t mu;
    struct simgpu_node *node;
    int fd;
    int slot;
    pid_t pid;
    int failed;
    char error[256];
} g_att = {PTHREAD_MUTEX_INITIALIZER, NULL, -1, -1, 0, 0, ""};

static _Thread_local char t_error[256];

static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void att_child_reset(void) {
    /* The child shares the parent's open file description (and so its liveness lock): drop
     * our copy and register afresh on next use. The mapping stays valid; we remap anyway. */
    if (g_att.node) munmap(g_att.node, g_att.node->file_size);
    if (g_att.fd >= 0) close(g_att.fd);
    pthread_mutex_init(&g_att.mu, NULL);
    g_att.node = NULL;
    g_att.fd = -1;
    g_att.slot = -1;
    g_att.pid = 0;
    g_att.failed = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, att_child_reset); }

void simgpu_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof t_error, fmt, ap);
    va_end(ap);
}

const char *simgpu_state_error(void) { return t_error[0] ? t_error : g_att.error; }

static int ofd_lock(int fd, uint64_t off, int type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = (short)type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)off;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

static uint64_t proc_start_time(void) {
    /* Field 22 (starttime) of /proc/self/stat; the command name may hold spaces, so parse
     * after the last ')'. */
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    unsigned long long v = 0;
    /* after ')': state(3) ppid(4) ... starttime(22) -> skip 19 fields */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &v) != 1)
        return 0;
    return v;
}

/* The pid NVML reports for this process. A real driver reports pids of the node's initial pid
 * namespace, whatever namespace the process runs in; SIMGPU_HOST_PROC names a procfs of that
 * namespace (the node's /proc bound into the container), where "self" reads as the reader's
 * pid there. Unset or unreadable: the pid as this process sees it. */
static int32_t reported_pid(void) {
    const char *dir = getenv("SIMGPU_HOST_PROC");
    char path[4096], link[32];
    if (dir && *dir && snprintf(path, sizeof path, "%s/self", dir) < (int)sizeof path) {
        ssize_t n = readlink(path, link, sizeof link - 1);
        if (n > 0) {
            link[n] = 0;
            char *end = NULL;
            long v = strtol(link, &end, 10);
            if (end && *end == 0 && v > 0 && v <= INT32_MAX) return (int32_t)v;
        }
        if (getenv("SIMGPU_QUIET") == NULL)
            fprintf(stderr, "[simgpu] SIMGPU_HOST_PROC=%s: cannot read its self link; reporting pid %d\n",
                    dir, (int)getpid());
    }
    return (int32_t)getpid();
}

/* Map and validate the node file. Returns the mapping or NULL (error set). */
struct simgpu_node *simgpu_map(const char *dir, int *fd_out) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, SIMGPU_STATE_FILE) >= (int)sizeof path) {
        simgpu_set_error("state dir path too long: %s", dir);
        return NULL;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        simgpu_set_error("cannot open %s: %s (create a node with `python -m vgpu_plugin.simgpu create`)",
                  path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < sizeof(struct simgpu_node)) {
        simgpu_set_error("%s is not a simgpu node: %lld bytes, expected at least %zu", path,
                  (long long)st.st_size, sizeof(struct simgpu_node));
        close(fd);
        return NULL;
    }
    struct simgpu_node *node = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (node == MAP_FAILED) {
        simgpu_set_error("cannot map %s: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (node->magic != SIMGPU_STATE_MAGIC || node->version != SIMGPU_STATE_VERSION ||
        node->file_size != (uint64_t)st.st_size || node->gpu_count > SIMGPU_MAX_GPUS) {
        simgpu_set_error("%s is not a simgpu node of layout version %u (magic/version/size mismatch)", path,
                  SIMGPU_STATE_VERSION);
        munmap(node, (size_t)st.st_size);
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    return node;
}

void simgpu_lock(struct simgpu_node *node) {
    int rc = pthread_mutex_lock(&node->lock);
    if (rc == EOWNERDEAD) {
        /* A process died inside a critical section. Every section leaves the state usable at
         * each store, so carrying on is safe; mark the mutex consistent again. */
        pthread_mutex_consistent(&node->lock);
    }
}

void simgpu_unlock(struct simgpu_node *node) { pthread_mutex_unlock(&node->lock); }

int simgpu_reap_locked(struct simgpu_node *node, int fd, int self_slot) {
    int freed = 0;
    if (fd < 0) return 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        struct simgpu_proc_shared *p = &node->procs[i];
        if (atomic_load(&p->state) != SIMGPU_SLOT_LIVE || i == self_slot) continue;
        /* A live process holds a write lock on its byte through its own open file description;
         * if ours gets it, the owner is gone. */
        if (ofd_lock(fd, node->lock_base + (uint64_t)i, F_WRLCK) != 0) continue;
        for (uint32_t g = 0; g < node->gpu_count; g++) {
            uint64_t u = p->used[g];
            node->gpus[g].used = node->gpus[g].used >= u ? node->gpus[g].used - u : 0;
            p->used[g] = 0;
            p->contexts[g] = 0;
        }
        p->pid = 0;
        p->start_time = 0;
        p->cgroup[0] = 0;
        p->cgroup_ndirs = 0;
        atomic_store(&p->state, SIMGPU_SLOT_FREE);
        ofd_lock(fd, node->lock_base + (uint64_t)i, F_UNLCK);
        freed++;
    }
    return freed;
}

static int register_self(struct simgpu_node *node, int fd) {
    simgpu_lock(node);
    simgpu_reap_locked(node, g_att.fd, g_att.slot);
    int slot = -1;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        uint32_t expect = SIMGPU_SLOT_FREE;
        if (atomic_compare_exchange_strong(&node->procs[i].state, &expect, SIMGPU_SLOT_CLAIMED)) {
            slot = i;
            break;
        }
    }
    if (slot < 0) {
        simgpu_unlock(node);
        simgpu_set_error("all %d process slots of the simulated node are in use", SIMGPU_MAX_PROCS);
        return -1;
    }
    if (ofd_lock(fd, node->lock_base + (uint64_t)slot, F_WRLCK) != 0) {
        atomic_store(&node->procs[slot].state, SIMGPU_SLOT_FREE);
        simgpu_unlock(node);
        simgpu_set_error("cannot lock process slot %d: %s", slot, strerror(errno));
        return -1;
    }
    struct simgpu_proc_shared *p = &node->procs[slot];
    memset(p->used, 0, sizeof p->used);
    memset(p->contexts, 0, sizeof p->contexts);
    p->pid = reported_pid();
    p->start_time = proc_start_time();
    p->cgroup_ndirs = simgpu_cgroup_self(p->cgroup, p->cgroup_dirs);
    atomic_store(&p->state, SIMGPU_SLOT_LIVE);
    simgpu_unlock(node);
    return slot;
}

struct simgpu_node *simgpu_node(void) {
    pthread_once(&g_atfork_once, register_atfork);
    struct simgpu_node *n = __atomic_load_n(&g_att.node, __ATOMIC_ACQUIRE);
    if (n) return n;
    pthread_mutex_lock(&g_att.mu);
    if (!g_att.node && !g_att.failed) {
        const char *dir = getenv("SIMGPU_STATE");
        int fd = -1;
        struct simgpu_node *node = NULL;
        if (!dir || !*dir) {
            simgpu_set_error("SIMGPU_STATE is not set: no simulated node to attach to");
        } else {
            node = simgpu_map(dir, &fd);
        }
        if (node) {
            g_att.fd = fd;
            int slot = register_self(node, fd);
            if (slot < 0) {
                munmap(node, node->file_size);
                close(fd);
                g_att.fd = -1;
                node = NULL;
            } else {
                g_att.slot = slot;
                g_att.pid = getpid();
                __atomic_store_n(&g_att.node, node, __ATOMIC_RELEASE);
            }
        }
        if (!node) {
            g_att.failed = 1;
            snprintf(g_att.error, sizeof g_att.error, "%s", t_error);
            if (getenv("SIMGPU_QUIET") == NULL) fprintf(stderr, "[simgpu] %s\n", g_att.error);
        }
    }
    n = g_att.node;
    pthread_mutex_unlock(&g_att.mu);
    return n;
}

int simgpu_self_slot(void) { return simgpu_node() ? g_att.slot : -1; }

/* --- memory ------------------------------------------------------------------------------ */

/* The GPU's physical memory can hold `bytes` more, and so can the hard limit of this process's
 * cgroup there (nvmlDeviceSetMemoryLimits_v1), if it has one. */
static int charge_fits_locked(const struct simgpu_node *node, uint32_t gpu, uint64_t bytes) {
    const struct simgpu_gpu_shared *g = &node->gpus[gpu];
    return g->used <= g->cfg.total_memory && g->cfg.total_memory - g->used >= bytes &&
           simgpu_cgroup_admits_locked(node, g_att.slot, gpu, bytes);
}

int simgpu_mem_charge(uint32_t gpu, uint64_t bytes) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return -1;
    simgpu_lock(node);
    if (!charge_fits_locked(node, gpu, bytes)) {
        simgpu_reap_locked(node, g_att.fd, g_att.slot);
    }
    int rc = -1;
    if (charge_fits_locked(node, gpu, bytes)) {
        struct simgpu_gpu_shared *g = &node->gpus[gpu];
        g->used += bytes;
        node->procs[g_att.slot].used[gpu] += bytes;
        rc = 0;
    }
    simgpu_unlock(node);
    return rc;
}

void simgpu_mem_uncharge(uint32_t gpu, uint64_t bytes) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return;
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    uint64_t *mine = &node->procs[g_att.slot].used[gpu];
    uint64_t b = bytes <= *mine ? bytes : *mine;
    *mine -= b;
    g->used = g->used >= b ? g->used - b : 0;
    simgpu_unlock(node);
}

int simgpu_context_add(uint32_t gpu) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return -1;
    if (simgpu_mem_charge(gpu, node->gpus[gpu].cfg.context_overhead) != 0) return -1;
    simgpu_lock(node);
    node->procs[g_att.slot].contexts[gpu]++;
    simgpu_unlock(node);
    return 0;
}

void simgpu_context_remove(uint32_t gpu) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return;
    simgpu_lock(node);
    if (node->procs[g_att.slot].contexts[gpu] > 0) node->procs[g_att.slot].contexts[gpu]--;
    simgpu_unlock(node);
    simgpu_mem_uncharge(gpu, node->gpus[gpu].cfg.context_overhead);
}

void simgpu_mem_info(uint32_t gpu, uint64_t *free_bytes, uint64_t *total_bytes) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) {
        *free_bytes = *total_bytes = 0;
        return;
    }
    simgpu_lock(node);
    simgpu_reap_locked(node, g_att.fd, g_att.slot);
    uint64_t total = node->gpus[gpu].cfg.total_memory, used = node->gpus[gpu].used;
    simgpu_unlock(node);
    *total_bytes = total;
    *free_bytes = used < total ? total - used : 0;
}

/* --- timeline ---------------------------------------------------------------------------- */

uint64_t simgpu_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Not FUTEX_PRIVATE: the word is in a file other processes map (the injector's, the
 * waiters'), and the kernel keys a shared futex by the file's page. */
void simgpu_events_notify(struct simgpu_node *node) {
    atomic_fetch_add_explicit(&node->events, 1, memory_order_release);
    syscall(SYS_futex, (uint32_t *)&node->events, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

static struct timespec timespec_of(uint64_t ns) {
    return (struct timespec){(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
}

void simgpu_events_wait(struct simgpu_node *node, uint32_t seen, uint64_t until_ns) {
    /* WAIT_BITSET takes an absolute CLOCK_MONOTONIC time, as simgpu_sleep_until does.
     * EAGAIN (it moved already), EINTR, ETIMEDOUT: the caller looks again either way. */
    struct timespec ts = timespec_of(until_ns);
    syscall(SYS_futex, (uint32_t *)&node->events, FUTEX_WAIT_BITSET, seen, &ts, NULL,
            FUTEX_BITSET_MATCH_ANY);
}

void simgpu_sleep_until(uint64_t t_ns) {
    struct timespec ts = timespec_of(t_ns);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Note that `pid`'s work, queued at `queued`, ran on g during [start, end] (node lock). */
static void busy_add_locked(struct simgpu_gpu_shared *g, int32_t pid, uint64_t queued, uint64_t start,
                            uint64_t end) {
    if (end <= start) return;
    if (queued > start) queued = start;
    struct simgpu_busy_span *last = g->busy_count ? &g->busy[(g->busy_count - 1) % SIMGPU_BUSY_RING] : NULL;
    if (last && last->end_ns == start && last->pid == pid) {
        last->end_ns = end; /* back-to-back work: one span keeps the ring short */
        if (queued < last->queued_ns) last->queued_ns = queued;
        return;
    }
    struct simgpu_busy_span *s = &g->busy[g->busy_count % SIMGPU_BUSY_RING];
    s->start_ns = start;
    s->end_ns = end;
    s->queued_ns = queued;
    s->pid = pid;
    s->reserved = 0;
    g->busy_count++;
}

uint64_t simgpu_timeslice_ns(void) {
    static int64_t slice = -1;
    int64_t v = __atomic_load_n(&slice, __ATOMIC_RELAXED);
    if (v >= 0) return (uint64_t)v;
    const char *e = getenv("SIMGPU_TIMESLICE");
    v = 0;
    if (e && *e) {
        char *end = NULL;
        double x = strtod(e, &end);
        double scale = !end || end == e ? -1 : *end == 0 || strcmp(end, "us") == 0 ? 1e3
                       : strcmp(end, "ns") == 0 ? 1 : strcmp(end, "ms") == 0 ? 1e6 : -1;
        if (scale < 0 || x < 0 || x * scale > 1e10) {
            if (getenv("SIMGPU_QUIET") == NULL)
                fprintf(stderr, "[simgpu] SIMGPU_TIMESLICE=%s is not a duration (e.g. 2ms, 500us, 0): "
                                "not time-sliced\n", e);
        } else {
            v = (int64_t)(x * scale);
        }
    }
    __atomic_store_n(&slice, v, __ATOMIC_RELAXED);
    return (uint64_t)v;
}

/* --- time-slicing (SIMGPU_TIMESLICE, README "Time-slicing") -------------------------------
 * Each context's work on a GPU is a lane, FIFO (its streams share it). While several lanes
 * have work ready the GPU turns between them round-robin, one slice each (a lane whose work
 * ends within its slice hands the GPU on at once); a lane alone runs on, and work another
 * context queues meanwhile gets the GPU at once. When a point of a
 * lane's work is reached depends on the work others queue later, as on a GPU, so the schedule
 * is worked out when someone asks (a launch, a query, a synchronisation, a reader of the busy
 * record), up to the time of asking; a wait looks ahead, assuming nobody queues more, and
 * looks again when it wakes. */

/* The lane of `sl` that `i` round-robin would turn to after `from` (-1: from the start), among
 * those marked ready. */
static int next_ready(const unsigned char *ready, int from) {
    for (int j = 1; j <= SIMGPU_LANES; j++) {
        int i = (from + j + SIMGPU_LANES) % SIMGPU_LANES;
        if (ready[i]) return i;
    }
    return -1;
}

/* Record that lane i ran `run` ns from t (node lock). */
static void lane_ran_locked(struct simgpu_gpu_shared *g, int i, uint64_t t, uint64_t run) {
    struct simgpu_lane *l = &g->sl.lanes[i];
    busy_add_locked(g, l->pid, l->seg[l->seg_head].queued_ns, t, t + run);
    struct simgpu_lane_run *last = l->hist_count ? &g->hist[i][(l->hist_count - 1) % SIMGPU_LANE_HIST] : NULL;
    if (last && last->end_ns == t && last->w_start + (last->end_ns - last->start_ns) == l->done) {
        last->end_ns = t + run;
        return;
    }
    g->hist[i][l->hist_count % SIMGPU_LANE_HIST] = (struct simgpu_lane_run){t, t + run, l->done};
    l->hist_count++;
}

/* Run the schedule `sl` on from its adv_ns to `until`. g: commit it (record what ran), else a
 * look ahead on a copy. want >= 0: stop where lane `want` reaches work `want_w`, returning
 * that time (0: not before `until`). */
static uint64_t slicer_run(struct simgpu_slicer *sl, struct simgpu_gpu_shared *g, uint64_t until, int want,
                           uint64_t want_w) {
    uint64_t slice = sl->slice_ns ? sl->slice_ns : 1;
    while (sl->adv_ns < until) {
        uint64_t t = sl->adv_ns, later = UINT64_MAX;
        unsigned char ready[SIMGPU_LANES];
        int nready = 0;
        for (int i = 0; i < SIMGPU_LANES; i++) {
            const struct simgpu_lane *l = &sl->lanes[i];
            uint64_t r = l->nseg ? l->seg[l->seg_head].ready_ns : UINT64_MAX;
            ready[i] = r <= t;
            nready += ready[i];
            if (r > t && r < later) later = r;
        }
        if (nready == 0) { /* idle until someone's work is ready */
            sl->adv_ns = later < until ? later : until;
            sl->left_ns = 0;
            continue;
        }
        int c = sl->cur;
        if (c < 0 || !ready[c] || sl->left_ns == 0) { /* its slice is over, or its work */
            c = next_ready(ready, c);
            sl->cur = c;
            sl->left_ns = slice;
        }
        struct simgpu_lane *l = &sl->lanes[c];
        const struct simgpu_lane_seg *sg = &l->seg[l->seg_head];
        uint64_t run = sg->w_end - l->done;
        if (nready == 1) { /* alone: on to its end, or until another's work is ready */
            if (later - t < run) run = later - t;
        } else if (run > sl->left_ns) {
            run = sl->left_ns;
        }
        if (run > until - t) run = until - t;
        if (want == c && want_w <= l->done + run) return t + (want_w - l->done);
        if (g) lane_ran_locked(g, c, t, run);
        l->done += run;
        sl->adv_ns = t + run;
        /* Alone, it has had its slice: work another context queues gets the GPU at once. */
        sl->left_ns = nready > 1 ? sl->left_ns - run : 0;
        if (l->done >= sg->w_end) {
            l->seg_head = (l->seg_head + 1) % SIMGPU_LANE_SEGS;
            l->nseg--;
        }
    }
    return 0;
}

void simgpu_advance_locked(struct simgpu_gpu_shared *g, uint64_t now) {
    if (g->sl.adv_ns < now) slicer_run(&g->sl, g, now, -1, 0);
}

static int lane_of(const struct simgpu_slicer *sl, uint64_t owner) {
    for (int i = 0; i < SIMGPU_LANES; i++)
        if (sl->lanes[i].owner == owner) return i;
    return -1;
}

/* Context `owner`'s lane, taken when it has none: a free one, else the one idle longest, else
 * (every lane has work queued) the one with the least, whose work is forgotten. */
static int lane_take(struct simgpu_gpu_shared *g, uint64_t owner, int32_t pid) {
    struct simgpu_slicer *sl = &g->sl;
    int i = lane_of(sl, owner);
    if (i >= 0) return i;
    uint64_t best = UINT64_MAX;
    for (int k = 0; k < SIMGPU_LANES && best; k++) {
        const struct simgpu_lane *l = &sl->lanes[k];
        /* 0: free; then idle ones by when they last had work; then the least work queued */
        uint64_t score = !l->owner ? 0 : !l->nseg ? 1 + l->last_ns / 2 : UINT64_MAX / 2 + (l->queued - l->done) / 2;
        if (score < best || i < 0) {
            best = score;
            i = k;
        }
    }
    sl->lanes[i] = (struct simgpu_lane){.owner = owner, .pid = pid};
    if (sl->cur == i) sl->left_ns = 0;
    return i;
}

/* Queue work on owner's lane (node lock, the schedule worked out to now). Returns its mark. */
static uint64_t sliced_submit_locked(struct simgpu_gpu_shared *g, int32_t pid, uint64_t owner, uint64_t ready,
                                     uint64_t dur, uint64_t now) {
    struct simgpu_lane *l = &g->sl.lanes[lane_take(g, owner, pid)];
    l->pid = pid;
    if (dur == 0) return l->queued;
    uint64_t r = ready > now ? ready : now;
    struct simgpu_lane_seg *last = l->nseg ? &l->seg[(l->seg_head + l->nseg - 1) % SIMGPU_LANE_SEGS] : NULL;
    /* Behind work already queued it cannot start earlier anyway: one stretch. */
    if (last && (r <= now || r <= last->ready_ns || l->nseg == SIMGPU_LANE_SEGS)) {
        last->w_end += dur; /* a full lane: what it waits for is taken as ready (not modelled) */
    } else {
        l->seg[(l->seg_head + l->nseg) % SIMGPU_LANE_SEGS] = (struct simgpu_lane_seg){r, l->queued + dur, now};
        l->nseg++;
    }
    l->queued += dur;
    l->last_ns = now;
    uint64_t end = g->sl.adv_ns;
    for (int i = 0; i < SIMGPU_LANES; i++) end += g->sl.lanes[i].queued - g->sl.lanes[i].done;
    if (end > g->timeline_end_ns) g->timeline_end_ns = end; /* all of it, if nobody idles */
    return l->queued;
}

uint64_t simgpu_timeline_submit(uint32_t gpu, uint64_t owner, uint64_t ready_ns, uint64_t duration_ns,
                                uint64_t *mark) {
    *mark = 0;
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return ready_ns;
    uint64_t slice = simgpu_timeslice_ns();
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    int32_t pid = node->procs[g_att.slot].pid; /* as NVML reports it */
    uint64_t now = simgpu_now_ns();
    if (slice) {
        g->sl.slice_ns = slice;
        simgpu_advance_locked(g, now);
        *mark = sliced_submit_locked(g, pid, owner, ready_ns, duration_ns, now);
        simgpu_unlock(node);
        return 0;
    }
    uint64_t start = ready_ns > g->timeline_end_ns ? ready_ns : g->timeline_end_ns;
    uint64_t end = start + duration_ns;
    /* Work ends in submission order, so the latest work of "anyone but the last owner" is the
     * previous owner's latest once the owner changes. */
    if (owner != g->last_owner) {
        g->others_end_ns = g->timeline_end_ns;
        g->last_owner = owner;
    }
    g->timeline_end_ns = end;
    busy_add_locked(g, pid, now, start, end);
    simgpu_unlock(node);
    return end;
}

/* When lane i's work reached w (done): from its runs; 0 when no run that old is remembered. */
static uint64_t lane_time_locked(const struct simgpu_gpu_shared *g, int i, uint64_t w) {
    const struct simgpu_lane *l = &g->sl.lanes[i];
    uint64_t n = l->hist_count < SIMGPU_LANE_HIST ? l->hist_count : SIMGPU_LANE_HIST;
    for (uint64_t k = 1; k <= n; k++) {
        const struct simgpu_lane_run *r = &g->hist[i][(l->hist_count - k) % SIMGPU_LANE_HIST];
        if (w > r->w_start) return w - r->w_start <= r->end_ns - r->start_ns ? r->start_ns + (w - r->w_start) : 0;
    }
    return 0;
}

int simgpu_timeline_when(uint32_t gpu, uint64_t owner, uint64_t mark, uint64_t *t) {
    *t = 0;
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count || mark == 0) return 1;
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    simgpu_advance_locked(g, simgpu_now_ns());
    int i = lane_of(&g->sl, owner), done = 1;
    if (i < 0) {
        /* forgotten (32 contexts queued work since): done, when no longer known */
    } else if (mark <= g->sl.lanes[i].done) {
        *t = lane_time_locked(g, i, mark);
    } else {
        struct simgpu_slicer ahead = g->sl; /* a copy: looking ahead records nothing */
        if (mark > ahead.lanes[i].queued) mark = ahead.lanes[i].queued;
        *t = slicer_run(&ahead, NULL, UINT64_MAX, i, mark);
        done = 0;
    }
    simgpu_unlock(node);
    return done;
}

void simgpu_timeline_progress(uint32_t gpu, uint64_t owner, uint64_t *done, uint64_t *queued) {
    *done = *queued = 0;
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return;
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    simgpu_advance_locked(g, simgpu_now_ns());
    int i = lane_of(&g->sl, owner);
    if (i >= 0) {
        *done = g->sl.lanes[i].done;
        *queued = g->sl.lanes[i].queued;
    }
    simgpu_unlock(node);
}

uint64_t simgpu_timeline_owner(void) {
    struct simgpu_node *node = simgpu_node();
    if (!node) return 1;
    simgpu_lock(node);
    uint64_t id = ++node->owners;
    simgpu_unlock(node);
    return id;
}

uint64_t simgpu_timeline_others_end(uint32_t gpu, uint64_t owner) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    simgpu_lock(node);
    const struct simgpu_gpu_shared *g = &node->gpus[gpu];
    uint64_t t = owner == g->last_owner ? g->others_end_ns : g->timeline_end_ns;
    simgpu_unlock(node);
    return t;
}

uint32_t simgpu_busy_percent_locked(struct simgpu_gpu_shared *g, uint64_t now, uint64_t window_ns) {
    if (window_ns == 0) return 0;
    simgpu_advance_locked(g, now);
    uint64_t from = now > window_ns ? now - window_ns : 0;
    uint64_t busy = 0;
    uint64_t n = g->busy_count < SIMGPU_BUSY_RING ? g->busy_count : SIMGPU_BUSY_RING;
    for (uint64_t k = 0; k < n; k++) {
        const struct simgpu_busy_span *s = &g->busy[(g->busy_count - 1 - k) % SIMGPU_BUSY_RING];
        if (s->end_ns <= from) continue; /* time-sliced, spans end out of record order */
        uint64_t a = s->start_ns > from ? s->start_ns : from;
        uint64_t b = s->end_ns < now ? s->end_ns : now;
        if (b > a) busy += b - a;
    }
    uint64_t pct = (busy * 100 + window_ns / 2) / window_ns;
    return pct > 100 ? 100 : (uint32_t)pct;
}

uint32_t simgpu_process_busy(uint32_t gpu, uint64_t from_ns, uint64_t now_ns,
                             struct simgpu_proc_busy *out, uint32_t max) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    uint32_t found = 0;
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    simgpu_advance_locked(g, simgpu_now_ns());
    uint64_t n = g->busy_count < SIMGPU_BUSY_RING ? g->busy_count : SIMGPU_BUSY_RING;
    for (uint64_t k = 0; k < n; k++) {
        const struct simgpu_busy_span *s = &g->busy[(g->busy_count - 1 - k) % SIMGPU_BUSY_RING];
        if (s->end_ns <= from_ns) continue; /* time-sliced, spans end out of record order */
        uint64_t a = s->start_ns > from_ns ? s->start_ns : from_ns;
        uint64_t b = s->end_ns < now_ns ? s->end_ns : now_ns;
        if (b <= a) continue; /* queued work that has not started yet */
        uint32_t i = 0;
        while (i < found && out[i].pid != s->pid) i++;
        if (i < found)
            out[i].busy_ns += b - a;
        else if (found < max)
            out[found++] = (struct simgpu_proc_busy){s->pid, b - a};
    }
    simgpu_unlock(node);
    return found;
}

uint32_t simgpu_utilization(uint32_t gpu, uint64_t window_ns) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    simgpu_lock(node);
    uint32_t pct = simgpu_busy_percent_locked(&node->gpus[gpu], simgpu_now_ns(), window_ns);
    simgpu_unlock(node);
    return pct;
}

/* --- faults ------------------------------------------------------------------------------ */

int simgpu_gpu_lost(uint32_t gpu) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    return atomic_load(&node->gpus[gpu].lost) != 0;
}

uint64_t simgpu_xid_count(uint32_t gpu) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    return atomic_load_explicit(&node->gpus[gpu].xid_count, memory_order_acquire);
}

int simgpu_xid_get(uint32_t gpu, uint64_t seq, struct simgpu_xid_record *out) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return -1;
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    uint64_t count = atomic_load_explicit(&g->xid_count, memory_order_acquire);
    if (seq >= count || count - seq > SIMGPU_XID_RING) return -1;
    *out = g->xid_ring[seq % SIMGPU_XID_RING];
    return 0;
}

/* --- visibility -------------------------------------------------------------------------- */

uint32_t simgpu_visible_gpus(uint32_t map[SIMGPU_MAX_GPUS]) {
    struct simgpu_node *node = simgpu_node();
    if (!node) return 0;
    const char *env = getenv("NVIDIA_VISIBLE_DEVICES");
    uint32_t n = 0;
    if (!env || !*env || strcmp(env, "all") == 0) {
        for (uint32_t g = 0; g < node->gpu_count; g++) map[n++] = g;
        return n;
    }
    if (strcmp(env, "none") == 0 || strcmp(env, "void") == 0) return 0;
    /* The runtime exposes the listed GPUs; inside the container they enumerate in physical
     * order, whatever order the list used. */
    int want[SIMGPU_MAX_GPUS] = {0};
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        char *endp = NULL;
        unsigned long idx = strtoul(tok, &endp, 10);
        if (endp != tok && *endp == 0) {
            if (idx < node->gpu_count) want[idx] = 1;
            continue;
        }
        for (uint32_t g = 0; g < node->gpu_count; g++)
            if (strcmp(node->gpus[g].cfg.uuid, tok) == 0) want[g] = 1;
    }
    for (uint32_t g = 0; g < node->gpu_count; g++)
        if (want[g]) map[n++] = g;
    return n;
}

/* --- process view ------------------------------------------------------------------------ */

uint32_t simgpu_gpu_processes(uint32_t gpu, struct simgpu_proc_usage *out, uint32_t max) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return 0;
    uint32_t n = 0;
    simgpu_lock(node);
    /* A SIGKILLed holder left its slot behind: reap first so it does not show as running. */
    simgpu_reap_locked(node, g_att.fd, g_att.slot);
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        const struct simgpu_proc_shared *p = &node->procs[i];
        if (atomic_load(&p->state) != SIMGPU_SLOT_LIVE || (!p->used[gpu] && !p->contexts[gpu])) continue;
        if (n < max) {
            out[n].pid = p->pid;
            out[n].contexts = p->contexts[gpu];
            out[n].used = p->used[gpu];
        }
        n++;
    }
    simgpu_unlock(node);
    return n;
}
