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

/* Time-slicing (SIMGPU_TIMESLICE, README "Time-slicing"): each context has a lane, the time
 * its queued work on this GPU ends. A kernel runs after its context's earlier work, and while
 * other contexts have work queued the GPU turns between them round-robin: the context runs
 * one slice (a kernel queued right behind the previous one goes on in the same slice), then
 * each of the busy others one slice (or what is left of its work), and so on; once the
 * others' work is done it runs to its end. The others' completion times were handed out when
 * they queued, so their work is not moved back; what this kernel ran in their turns is added
 * to each of their lanes instead (each of them waited that long), and their next work starts
 * that much later. So the
 * GPU does one GPU's work over a few kernels, and a kernel's duration stretches by what its
 * neighbours run meanwhile, as on a time-sliced GPU. (node lock) */
static uint64_t sliced_submit_locked(struct simgpu_gpu_shared *g, int32_t pid, uint64_t owner, uint64_t ready,
                                     uint64_t dur, uint64_t slice, uint64_t now) {
    struct simgpu_lane *own = NULL, *spare = NULL;
    for (int i = 0; i < SIMGPU_LANES; i++) {
        struct simgpu_lane *l = &g->lanes[i];
        if (l->owner == owner) own = l;
        else if (!spare || l->end_ns < spare->end_ns) spare = l; /* idle (or least busy) lane */
    }
    if (!own) {
        own = spare; /* every lane busy: the least busy one's context is forgotten */
        *own = (struct simgpu_lane){.owner = owner};
    }
    uint64_t push[SIMGPU_LANES] = {0};
    uint64_t t = ready > own->end_ns ? ready : own->end_ns, left = dur;
    uint64_t budget = slice; /* of the context's current slice */
    if (t == own->end_ns && own->slice_left) budget = own->slice_left; /* right behind: same slice */
    else if (t < own->next_ns) t = own->next_ns;                        /* after the others' turn */
    uint64_t next = 0;
    for (;;) {
        unsigned char busy[SIMGPU_LANES];
        uint64_t nbusy = 0;
        for (int i = 0; i < SIMGPU_LANES; i++) {
            const struct simgpu_lane *l = &g->lanes[i];
            busy[i] = l != own && l->owner && l->end_ns + push[i] > t;
            nbusy += busy[i];
        }
        if (nbusy == 0) { /* nobody else: to its end */
            busy_add_locked(g, pid, now, t, t + left);
            t += left;
            budget = 0;
            next = t;
            break;
        }
        uint64_t run = left < budget ? left : budget;
        busy_add_locked(g, pid, now, t, t + run);
        t += run;
        left -= run;
        budget -= run;
        /* Its slice delayed every busy other's work by all of it, not by a share: split
         * among them, three busy contexts did 119 % of a GPU's work and four 134 %. */
        for (int i = 0; i < SIMGPU_LANES; i++)
            if (busy[i]) push[i] += run;
        if (budget > 0) { /* done within its slice */
            next = t;
            break;
        }
        uint64_t turn = t; /* then each of the busy others runs a slice */
        for (int i = 0; i < SIMGPU_LANES; i++) {
            uint64_t end = g->lanes[i].end_ns + push[i];
            if (busy[i] && end > turn) turn += end - turn < slice ? end - turn : slice;
        }
        if (left == 0) { /* done at its slice's end: its next work waits for their turn */
            next = turn;
            break;
        }
        t = turn;
        budget = slice;
    }
    own->end_ns = t;
    own->next_ns = next;
    own->slice_left = budget;
    uint64_t latest = t;
    for (int i = 0; i < SIMGPU_LANES; i++) {
        struct simgpu_lane *l = &g->lanes[i];
        if (push[i] && l->end_ns > now) l->end_ns += push[i];
        if (l->owner && l->end_ns > latest) latest = l->end_ns;
    }
    if (latest > g->timeline_end_ns) g->timeline_end_ns = latest;
    return t;
}

uint64_t simgpu_timeline_submit(uint32_t gpu, uint64_t owner, uint64_t ready_ns, uint64_t duration_ns) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return ready_ns;
    uint64_t slice = simgpu_timeslice_ns();
    simgpu_lock(node);
    struct simgpu_gpu_shared *g = &node->gpus[gpu];
    int32_t pid = node->procs[g_att.slot].pid; /* as NVML reports it */
    if (slice) {
        uint64_t end = sliced_submit_locked(g, pid, owner, ready_ns, duration_ns, slice, simgpu_now_ns());
        simgpu_unlock(node);
        return end;
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
    busy_add_locked(g, pid, simgpu_now_ns(), start, end);
    simgpu_unlock(node);
    return end;
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

uint32_t simgpu_busy_percent_locked(const struct simgpu_gpu_shared *g, uint64_t now, uint64_t window_ns) {
    if (window_ns == 0) return 0;
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
    const struct simgpu_gpu_shared *g = &node->gpus[gpu];
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
