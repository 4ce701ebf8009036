/* Control API (simgpu/control.h): create nodes, read their status, inject faults. Works on a
 * state dir given by the caller, without registering the caller as a GPU process. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "state.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT const char *simgpu_last_error(void) { return simgpu_state_error(); }

static int mkdir_p(const char *dir) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return (mkdir(buf, 0755) != 0 && errno != EEXIST) ? -1 : 0;
}

EXPORT int simgpu_node_create(const char *state_dir, const struct simgpu_gpu_config *gpus, uint32_t count) {
    if (!state_dir || !gpus || count == 0 || count > SIMGPU_MAX_GPUS) {
        simgpu_set_error("a node needs 1..%d GPUs, got %u", SIMGPU_MAX_GPUS, count);
        return -1;
    }
    for (uint32_t i = 0; i < count; i++) {
        if (gpus[i].total_memory == 0 || gpus[i].sm_count == 0 || gpus[i].uuid[0] == 0) {
            simgpu_set_error("GPU %u: memory, SM count and UUID must be set", i);
            return -1;
        }
        if (gpus[i].context_overhead >= gpus[i].total_memory) {
            simgpu_set_error("GPU %u: context overhead must be below its memory", i);
            return -1;
        }
    }
    if (mkdir_p(state_dir) != 0) {
        simgpu_set_error("cannot create state dir %s: %s", state_dir, strerror(errno));
        return -1;
    }
    char tmp[4200], path[4200];
    snprintf(path, sizeof path, "%s/%s", state_dir, SIMGPU_STATE_FILE);
    snprintf(tmp, sizeof tmp, "%s/.%s.%d", state_dir, SIMGPU_STATE_FILE, (int)getpid());
    long page = sysconf(_SC_PAGESIZE);
    uint64_t lock_base = sizeof(struct simgpu_node);
    uint64_t size = (lock_base + SIMGPU_MAX_PROCS + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    /* Allocated, not just sized: on a full disk a sparse file's first touch is a SIGBUS. */
    int err = fd < 0 ? errno : posix_fallocate(fd, 0, (off_t)size);
    if (err != 0) {
        simgpu_set_error("cannot write %s: %s", tmp, strerror(err));
        if (fd >= 0) {
            close(fd);
            unlink(tmp);
        }
        return -1;
    }
    fchmod(fd, 0666); /* containers of other users attach to the same node */
    struct simgpu_node *node = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (node == MAP_FAILED) {
        simgpu_set_error("cannot map %s: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        return -1;
    }
    memset(node, 0, sizeof *node);
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&node->lock, &ma);
    pthread_mutexattr_destroy(&ma);
    node->gpu_count = count;
    node->file_size = size;
    node->lock_base = lock_base;
    for (uint32_t i = 0; i < count; i++) node->gpus[i].cfg = gpus[i];
    node->version = SIMGPU_STATE_VERSION;
    node->magic = SIMGPU_STATE_MAGIC; /* last: a reader never sees a half-made node as valid */
    msync(node, size, MS_SYNC);
    munmap(node, size);
    close(fd);
    if (rename(tmp, path) != 0) {
        simgpu_set_error("cannot install %s: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Run `fn` on the mapped node of state_dir. */
static int with_node(const char *state_dir, int (*fn)(struct simgpu_node *, int fd, void *), void *arg) {
    int fd = -1;
    struct simgpu_node *node = simgpu_map(state_dir, &fd);
    if (!node) return -1;
    int rc = fn(node, fd, arg);
    munmap(node, node->file_size);
    close(fd);
    return rc;
}

static int count_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)fd;
    (void)arg;
    return (int)node->gpu_count;
}

EXPORT int simgpu_node_gpu_count(const char *state_dir) { return with_node(state_dir, count_fn, NULL); }

struct gpu_query {
    uint32_t gpu;
    struct simgpu_gpu_config *cfg;
    struct simgpu_gpu_status *status;
    uint64_t xid;
    int32_t lost;
};

static int check_gpu(struct simgpu_node *node, uint32_t gpu) {
    if (gpu >= node->gpu_count) {
        simgpu_set_error("GPU %u does not exist (the node has %u)", gpu, node->gpu_count);
        return -1;
    }
    return 0;
}

static int gpu_fn(struct simgpu_node *node, int fd, void *arg) {
    struct gpu_query *q = arg;
    if (check_gpu(node, q->gpu) != 0) return -1;
    struct simgpu_gpu_shared *g = &node->gpus[q->gpu];
    if (q->cfg) *q->cfg = g->cfg;
    if (q->status) {
        memset(q->status, 0, sizeof *q->status);
        simgpu_lock(node);
        simgpu_reap_locked(node, fd, -1);
        q->status->used_memory = g->used;
        q->status->timeline_end_ns = g->timeline_end_ns;
        for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
            const struct simgpu_proc_shared *p = &node->procs[i];
            if (atomic_load(&p->state) == SIMGPU_SLOT_LIVE && (p->used[q->gpu] || p->contexts[q->gpu]))
                q->status->live_processes++;
        }
        q->status->utilization = simgpu_busy_percent_locked(g, simgpu_now_ns(), 1000000000ull);
        simgpu_unlock(node);
        q->status->xid_count = atomic_load(&g->xid_count);
        q->status->lost = atomic_load(&g->lost);
    }
    return 0;
}

EXPORT int simgpu_node_gpu(const char *state_dir, uint32_t gpu, struct simgpu_gpu_config *cfg,
                           struct simgpu_gpu_status *status) {
    struct gpu_query q = {gpu, cfg, status, 0, 0};
    return with_node(state_dir, gpu_fn, &q);
}

static int xid_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)fd;
    struct gpu_query *q = arg;
    if (check_gpu(node, q->gpu) != 0) return -1;
    struct simgpu_gpu_shared *g = &node->gpus[q->gpu];
    simgpu_lock(node); /* one writer at a time: the ring slot, then the count */
    uint64_t n = atomic_load(&g->xid_count);
    g->xid_ring[n % SIMGPU_XID_RING].xid = q->xid;
    g->xid_ring[n % SIMGPU_XID_RING].time_ns = simgpu_now_ns();
    atomic_store_explicit(&g->xid_count, n + 1, memory_order_release);
    simgpu_unlock(node);
    simgpu_events_notify(node);
    return 0;
}

/* How many spans g's busy ring holds, and from when on its record is complete (node lock): a
 * ring that never wrapped holds everything; else the oldest span it keeps bounds it. */
static uint64_t busy_kept_locked(const struct simgpu_gpu_shared *g, uint64_t *covered_ns) {
    *covered_ns = g->busy_count <= SIMGPU_BUSY_RING ? 0 : g->busy[g->busy_count % SIMGPU_BUSY_RING].start_ns;
    return g->busy_count < SIMGPU_BUSY_RING ? g->busy_count : SIMGPU_BUSY_RING;
}

struct busy_query {
    uint32_t gpu;
    uint64_t from_ns, to_ns;
    struct simgpu_pid_busy *out;
    uint32_t max, found;
    uint64_t covered_ns;
};

static int busy_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)fd;
    struct busy_query *q = arg;
    if (check_gpu(node, q->gpu) != 0) return -1;
    const struct simgpu_gpu_shared *g = &node->gpus[q->gpu];
    simgpu_lock(node);
    uint64_t n = busy_kept_locked(g, &q->covered_ns);
    for (uint64_t k = 0; k < n; k++) {
        const struct simgpu_busy_span *sp = &g->busy[(g->busy_count - 1 - k) % SIMGPU_BUSY_RING];
        if (sp->end_ns <= q->from_ns) continue; /* time-sliced, spans end out of record order */
        uint64_t a = sp->start_ns > q->from_ns ? sp->start_ns : q->from_ns;
        uint64_t b = sp->end_ns < q->to_ns ? sp->end_ns : q->to_ns;
        if (b <= a) continue;
        uint32_t i = 0;
        while (i < q->found && q->out[i].pid != sp->pid) i++;
        if (i < q->found) q->out[i].busy_ns += b - a;
        else if (q->found < q->max) q->out[q->found++] = (struct simgpu_pid_busy){sp->pid, 0, b - a};
    }
    simgpu_unlock(node);
    return 0;
}

EXPORT int simgpu_node_busy(const char *state_dir, uint32_t gpu, uint64_t from_ns, uint64_t to_ns,
                            struct simgpu_pid_busy *out, uint32_t max, uint64_t *covered_ns) {
    struct busy_query q = {gpu, from_ns, to_ns, out, max, 0, 0};
    if (with_node(state_dir, busy_fn, &q) < 0) return -1;
    if (covered_ns) *covered_ns = q.covered_ns;
    return (int)q.found;
}

struct spans_query {
    uint32_t gpu;
    uint64_t from_ns, to_ns;
    struct simgpu_span *out;
    uint32_t max, found;
    uint64_t covered_ns;
};

static int spans_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)fd;
    struct spans_query *q = arg;
    if (check_gpu(node, q->gpu) != 0) return -1;
    const struct simgpu_gpu_shared *g = &node->gpus[q->gpu];
    simgpu_lock(node);
    uint64_t n = busy_kept_locked(g, &q->covered_ns);
    for (uint64_t k = n; k > 0 && q->found < q->max; k--) {
        const struct simgpu_busy_span *sp = &g->busy[(g->busy_count - k) % SIMGPU_BUSY_RING];
        if (sp->end_ns <= q->from_ns || sp->queued_ns >= q->to_ns) continue;
        q->out[q->found++] = (struct simgpu_span){sp->queued_ns, sp->start_ns, sp->end_ns, sp->pid, 0};
    }
    simgpu_unlock(node);
    return 0;
}

EXPORT int simgpu_node_spans(const char *state_dir, uint32_t gpu, uint64_t from_ns, uint64_t to_ns,
                             struct simgpu_span *out, uint32_t max, uint64_t *covered_ns) {
    struct spans_query q = {gpu, from_ns, to_ns, out, max, 0, 0};
    if (with_node(state_dir, spans_fn, &q) < 0) return -1;
    if (covered_ns) *covered_ns = q.covered_ns;
    return (int)q.found;
}

EXPORT int simgpu_inject_xid(const char *state_dir, uint32_t gpu, uint64_t xid) {
    struct gpu_query q = {gpu, NULL, NULL, xid, 0};
    return with_node(state_dir, xid_fn, &q);
}

static int lost_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)fd;
    struct gpu_query *q = arg;
    if (check_gpu(node, q->gpu) != 0) return -1;
    atomic_store(&node->gpus[q->gpu].lost, q->lost ? 1 : 0);
    simgpu_events_notify(node);
    return 0;
}

EXPORT int simgpu_set_lost(const char *state_dir, uint32_t gpu, int32_t lost) {
    struct gpu_query q = {gpu, NULL, NULL, 0, lost};
    return with_node(state_dir, lost_fn, &q);
}

static int reap_fn(struct simgpu_node *node, int fd, void *arg) {
    (void)arg;
    simgpu_lock(node);
    int n = simgpu_reap_locked(node, fd, -1);
    simgpu_unlock(node);
    return n;
}

EXPORT int simgpu_reap(const char *state_dir) { return with_node(state_dir, reap_fn, NULL); }
