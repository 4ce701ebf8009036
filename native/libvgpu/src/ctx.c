/* Contexts: which device each context is on, and the memory each context takes.
 *
 * A context costs GPU memory (hundreds of MiB on a real GPU) that no CUDA call reports. The
 * driver does account it, per process: NVML's process list (nvmlDeviceGetComputeRunningProcesses)
 * gives each process's used memory, contexts included. So a context is charged the growth of
 * this process's own usage across its creation, less what the shim itself charged this process
 * meanwhile (another thread's allocation): a neighbour's allocation or free, in this container
 * or another, cannot move the measure. Creations and measures of one process are serialised by
 * a process-private mutex (g_ctx.measure_mu); nothing node-wide is taken.
 *
 * A real driver lists processes by their pids in the node's pid namespace, so a process in a
 * container with its own does not find its getpid() there. It then learns its entry by a probe
 * (probe_node_pid) with one of its contexts in hand: the one entry of NVML's list that grows by
 * exactly P bytes while the process allocates P with the driver, and falls back by P when it
 * frees them, for two sizes in a row, is this process. Sound because usedGpuMemory is the
 * driver's own per-process accounting: a neighbour growing by exactly P at that instant makes
 * two candidates, which is ambiguity (tried again with another size), and a neighbour matching
 * once while our own threads' allocations hide our entry cannot match the next size too. The
 * probe goes to the driver, not through the region, and is freed before any measure: nothing of
 * it is charged.
 *
 * Where the probe cannot tell either (no two sizes in a row agree within four, usedGpuMemory not
 * available, no NVML), the device's free-memory drop is measured instead, under the GPU's
 * node-wide flock (<lock dir>/<GPU-UUID>.lock) so that creations on the GPU do not overlap: the
 * first creation of a process on a device takes the lock and learns which measure works; a
 * context made out of the shim's sight is then charged nothing.
 *
 * Each context is charged once, whatever created it, and before the driver makes it where the
 * shim sees it coming (below: "reserved before the driver makes a context"): cuCtxCreate*, the
 * retain that activates a primary context, the runtime table's slot (rtable.c); or, for a
 * context the shim did not see created (a runtime table it could not wrap), the first time the
 * shim meets it (cuCtxSetCurrent, an allocation, a view): then it is charged
 * what NVML says this process holds beyond what the shim has charged it. cuCtxSetLimit's growth
 * (heap, stack, printf FIFO) is charged to the context the same way. The charge goes to the
 * region like any allocation (refused over the limit: a new context is undone) and is given
 * back when the context goes, together with every allocation the context owned. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#define MAX_CONTEXT_CHARGE (8ull << 30) /* a delta above this was not our context alone */
#define GPU_LOCK_WAIT_MS 2000            /* longest wait for another creator's measurement */

/* --- context -> device ---------------------------------------------------------------------
 * Learned once per context (creation hooks, or a lookup), kept in a small table; a thread
 * caches its last answer, checked against a generation bumped whenever a context goes. */

/* Bumped whenever a context goes: what a thread cached (vgpu_ctx_last) is then asked again. */
uint64_t vgpu_ctx_gen;

static struct {
    pthread_mutex_t mu;
    unsigned next, hwm; /* known[hwm..] are empty: lookups stop there */
    struct { CUcontext ctx; int ordinal; } known[64];
    CUcontext primary[VGPU_MAX_ORDINALS];
    pthread_mutex_t measure_mu; /* creations and measures of this process, one at a time */
} g_ctx = {.mu = PTHREAD_MUTEX_INITIALIZER, .measure_mu = PTHREAD_MUTEX_INITIALIZER};

_Thread_local struct vgpu_ctx_last vgpu_ctx_last VGPU_TLS;
#define t_last vgpu_ctx_last

static void remember(CUcontext ctx, int ordinal) {
    pthread_mutex_lock(&g_ctx.mu);
    unsigned i = 0, empty = 64;
    while (i < g_ctx.hwm && g_ctx.known[i].ctx != ctx) {
        if (!g_ctx.known[i].ctx && empty == 64) empty = i;
        i++;
    }
    if (i == g_ctx.hwm) i = empty < 64 ? empty : g_ctx.hwm < 64 ? g_ctx.hwm++ : g_ctx.next++ % 64;
    g_ctx.known[i].ctx = ctx;
    g_ctx.known[i].ordinal = ordinal;
    pthread_mutex_unlock(&g_ctx.mu);
}

static int known_ordinal(CUcontext ctx) {
    int ord = -1;
    pthread_mutex_lock(&g_ctx.mu);
    for (unsigned i = 0; i < g_ctx.hwm && ord < 0; i++)
        if (g_ctx.known[i].ctx == ctx) ord = g_ctx.known[i].ordinal;
    pthread_mutex_unlock(&g_ctx.mu);
    return ord;
}

static int ctx_charged(CUcontext ctx);
static int charge_found(CUcontext ctx, struct vgpu_dev *d);

static int __attribute__((noinline)) lookup_ordinal(CUcontext ctx, int is_current) {
    int ord = known_ordinal(ctx);
    if (ord >= 0) return ord;
    CUdevice dev;
    CUresult rc;
    if (is_current) {
        rc = vgpu.real.cuCtxGetDevice(&dev);
    } else {
        /* Another thread's or a pushed-away context: ask with it current, briefly. */
        CUcontext popped;
        rc = vgpu.real.cuCtxPushCurrent_v2(ctx);
        if (rc == CUDA_SUCCESS) {
            rc = vgpu.real.cuCtxGetDevice(&dev);
            vgpu.real.cuCtxPopCurrent_v2(&popped);
        }
    }
    if (rc != CUDA_SUCCESS) return -1;
    /* Never seen: made where the shim could not see it (the runtime activates the primary
     * context through its own path), or seen so long ago that it left the table. */
    struct vgpu_dev *d = vgpu.limited && !ctx_charged(ctx) ? vgpu_dev((int)dev) : NULL;
    if (d && charge_found(ctx, d) != 0) return -1; /* refused, and asked again next time */
    remember(ctx, (int)dev);
    return (int)dev;
}

struct vgpu_dev *vgpu_ctx_dev_slow(CUcontext ctx, int is_current, CUcontext *ctx_out) {
    if (is_current && !ctx && (!vgpu.real.cuCtxGetCurrent || vgpu.real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS))
        ctx = NULL;
    *ctx_out = ctx;
    if (!ctx) return NULL;
    uint64_t gen = __atomic_load_n(&vgpu_ctx_gen, __ATOMIC_ACQUIRE);
    if (LIKELY(t_last.ctx == ctx && t_last.gen == gen)) return t_last.dev;
    int ord = lookup_ordinal(ctx, is_current);
    struct vgpu_dev *d = ord < 0 ? NULL : vgpu_dev(ord);
    if (!d) return NULL; /* not cached: asked again next time */
    t_last.ctx = ctx;
    t_last.dev = d; /* a resolved device stays resolved */
    t_last.gen = gen;
    return d;
}

struct vgpu_dev *vgpu_stream_dev(CUstream s, int ptsz, CUcontext *ctx_out) {
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return vgpu_ctx_dev(NULL, ctx_out);
    CUcontext ctx = NULL;
    __typeof__(cuStreamGetCtx) *get = ptsz ? vgpu.real.cuStreamGetCtx_ptsz : vgpu.real.cuStreamGetCtx;
    if (!get || get(s, &ctx) != CUDA_SUCCESS || !ctx) return vgpu_ctx_dev(NULL, ctx_out);
    return vgpu_ctx_dev(ctx, ctx_out);
}

/* --- each context's own charge ---------------------------------------------------------------
 * What a context itself was charged (its size, and its growth by cuCtxSetLimit), kept in a
 * short list of this process's contexts, apart from the allocations' table: a context's going
 * gives it back with one look here, and the table is scanned only where it holds allocations.
 * g_ctx.mu held. */
static struct charged {
    CUcontext ctx;
    int ordinal;
    uint64_t bytes;
    uint64_t settled; /* of which its growth and loaded code: settles may give it back */
} *g_charged;
static size_t g_ncharged, g_capcharged;

static long charged_at(CUcontext ctx) {
    for (size_t i = 0; i < g_ncharged; i++)
        if (g_charged[i].ctx == ctx) return (long)i;
    return -1;
}

/* Add bytes to ctx's own charge (listed if new); `settled`: a settle may give them back
 * (growth and loaded code, not a context's own size). */
static void charged_add(CUcontext ctx, int ordinal, uint64_t bytes, int settled) {
    pthread_mutex_lock(&g_ctx.mu);
    long i = charged_at(ctx);
    if (i < 0 && g_ncharged == g_capcharged) {
        size_t cap = g_capcharged ? g_capcharged * 2 : 8;
        struct charged *grown = realloc(g_charged, cap * sizeof *grown);
        if (grown) {
            g_charged = grown;
            g_capcharged = cap;
        }
    }
    if (i < 0 && g_ncharged < g_capcharged) {
        i = (long)g_ncharged++;
        g_charged[i] = (struct charged){.ctx = ctx, .ordinal = ordinal};
    }
    if (i >= 0) {
        g_charged[i].bytes += bytes;
        if (settled) g_charged[i].settled += bytes;
    }
    pthread_mutex_unlock(&g_ctx.mu);
    /* Out of memory for the list: the charge stays for the process's life (the safe side). */
    if (i < 0) VLOG(VGPU_LOG_WARN, "no memory to list context %p: its charge is kept", (void *)ctx);
}

/* Take up to `bytes` of what settles charged to this process's contexts on ordinal o off
 * their charges: what was taken (for the caller to give back to the region). */
static uint64_t settled_take(int o, uint64_t bytes) {
    uint64_t taken = 0;
    pthread_mutex_lock(&g_ctx.mu);
    for (size_t i = 0; i < g_ncharged && taken < bytes; i++) {
        if (g_charged[i].ordinal != o) continue;
        uint64_t t = g_charged[i].settled < bytes - taken ? g_charged[i].settled : bytes - taken;
        g_charged[i].settled -= t;
        g_charged[i].bytes -= t;
        taken += t;
    }
    pthread_mutex_unlock(&g_ctx.mu);
    return taken;
}

/* A context went (destroyed, or a primary context's last release or reset): what it owned
 * is freed by the driver, so its charges are given back. */
static void gone(CUcontext ctx) {
    if (!ctx) return;
    vgpu_launch_forget_ctx(ctx, 0);
    struct charged own = {0};
    pthread_mutex_lock(&g_ctx.mu);
    long at = charged_at(ctx);
    if (at >= 0) {
        own = g_charged[at];
        g_charged[at] = g_charged[--g_ncharged];
    }
    for (unsigned i = 0; i < g_ctx.hwm; i++)
        if (g_ctx.known[i].ctx == ctx) g_ctx.known[i].ctx = NULL;
    while (g_ctx.hwm && !g_ctx.known[g_ctx.hwm - 1].ctx) g_ctx.hwm--;
    pthread_mutex_unlock(&g_ctx.mu);
    struct vgpu_dev *d = own.bytes ? vgpu_dev(own.ordinal) : NULL;
    if (d) vgpu_uncharge(d, own.bytes);
    vgpu_tab_drop_ctx(ctx);
    __atomic_add_fetch(&vgpu_ctx_gen, 1, __ATOMIC_RELEASE);
}

/* --- measuring a context's memory ------------------------------------------------------------ */

/* The lock file is shared by every container of the node, so nothing a tenant does to it may
 * stall or deny another's start-up:
 * - O_NONBLOCK: a tenant that replaced the file with its own and holds a lease on it
 *   (F_SETLEASE) would block every opener for fs.lease-break-time (45 s); a FIFO in its place
 *   would block forever. Non-blocking, such an open fails at once (EWOULDBLOCK), or opens
 *   something that is not a regular file, and is refused;
 * - O_NOFOLLOW: a symlink planted in its place is not followed;
 * - read-only: flock needs no write access, so a file whose mode a root container's umask
 *   made 0644 still locks; and whoever creates it makes it 0666 (fchmod: the umask is the
 *   tenant's), so no later process is denied it.
 * Whatever fails, the context is measured without the lock (the bound: GPU_LOCK_WAIT_MS). */
static int open_lock(const char *path) {
    int flags = O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    int fd = open(path, flags, 0666);
    if (fd < 0 && errno == ENOENT && mkdir(vgpu.cfg.lock_dir, 0777) == 0) {
        chmod(vgpu.cfg.lock_dir, 01777);
        fd = open(path, flags, 0666);
    }
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        errno = EINVAL;
        return -1;
    }
    if (st.st_uid == geteuid() && (st.st_mode & 0777) != 0666) fchmod(fd, 0666);
    return fd;
}

static int lock_gpu(const char *uuid) {
    char path[sizeof vgpu.cfg.lock_dir + VGPU_UUID_SIZE + 8];
    snprintf(path, sizeof path, "%s/%s.lock", vgpu.cfg.lock_dir, uuid);
    int fd = open_lock(path);
    if (fd < 0) {
        VLOG(VGPU_LOG_WARN, "cannot open the GPU lock %s: %s; measuring without it", path,
             errno == EINVAL ? "not a regular file" : strerror(errno));
        return -1;
    }
    /* Bounded wait: the lock dir is shared by every container on the node, so a tenant
     * that holds a GPU's lock forever must not stall everyone else's CUDA start-up. Past
     * the deadline we measure unlocked; an overlap can only misattribute a context's
     * memory between the overlapping creators, and MAX_CONTEXT_CHARGE bounds it. */
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    /* Short naps: a measurement takes well under a millisecond, and many processes of a
     * starting job may queue here; longer naps would add their length to everyone's start. */
    long pause_ns = 50000; /* 50 us, doubling up to 1 ms */
    while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long waited_ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited_ms >= GPU_LOCK_WAIT_MS) {
            VLOG(VGPU_LOG_WARN, "the GPU lock %s is held for over %d ms; measuring without it",
                 path, GPU_LOCK_WAIT_MS);
            close(fd);
            return -1;
        }
        struct timespec ts = {0, pause_ns};
        nanosleep(&ts, NULL);
        if (pause_ns < 1000000) pause_ns *= 2;
    }
    return fd;
}

static void unlock_gpu(int fd) {
    if (fd >= 0) close(fd); /* closing drops the flock */
}

/* Free bytes of the GPU as NVML sees them; 0 when unknown (*ok = 0). */
static uint64_t gpu_free(const struct vgpu_dev *d, int *ok) {
    nvmlDevice_t h;
    nvmlMemory_t m;
    *ok = vgpu_nvml_ready() && vgpu.real.nvmlDeviceGetHandleByUUID(d->uuid, &h) == NVML_SUCCESS &&
          vgpu.real.nvmlDeviceGetMemoryInfo(h, &m) == NVML_SUCCESS;
    return *ok ? m.free : 0;
}

/* --- this process's pid as NVML lists it ----------------------------------------------------
 * A real driver lists processes by their pids in the node's initial pid namespace; a container
 * with its own sees other pids, so getpid() is not found there (or names someone else). Then
 * this process's entry is told by a probe: with one of its contexts current, list the device's
 * processes, allocate P bytes with the driver (not through the shim: never charged), list them
 * again, free, list a third time. The one entry that grew by exactly P and fell back by exactly
 * P is this process, once two sizes in a row name it; two entries that grew by P (a neighbour
 * allocating P at that instant) is ambiguity, tried again with another P (four sizes in all),
 * then given up: the device's free-memory drop is measured instead, as without the probe. All
 * under g_ctx.measure_mu. */

enum { MAX_LISTED = 256, PROBE_TRIES = 4 }; /* sizes tried; two in a row must agree */

static struct {
    pid_t self;            /* getpid() the fields below belong to: a forked child starts over */
    unsigned int node_pid; /* learned by a probe; 0: not known, getpid() is asked for */
    int told;              /* the probe's failure was logged */
} g_pid;

/* Per device: does NVML list this process (1), not (-1), unknown yet (0). measure_mu held. */
static int g_listed[VGPU_MAX_ORDINALS];

/* measure_mu held: what a forked child inherited about its parent's pid is dropped. */
static void pid_check_fork(void) {
    pid_t self = getpid();
    if (g_pid.self == self) return;
    __atomic_store_n(&g_pid.self, self, __ATOMIC_RELAXED);
    __atomic_store_n(&g_pid.node_pid, 0, __ATOMIC_RELAXED);
    memset(g_listed, 0, sizeof g_listed);
}

static int list_procs(const struct vgpu_dev *d, nvmlProcessInfo_v2_t *infos, unsigned int *n) {
    nvmlDevice_t h;
    nvmlReturn_t rc = NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!vgpu_nvml_ready() || vgpu.real.nvmlDeviceGetHandleByUUID(d->uuid, &h) != NVML_SUCCESS) return -1;
    if (vgpu.real.nvmlDeviceGetComputeRunningProcesses_v3)
        rc = vgpu.real.nvmlDeviceGetComputeRunningProcesses_v3(h, n, (nvmlProcessInfo_t *)infos);
    else if (vgpu.real.nvmlDeviceGetComputeRunningProcesses_v2)
        rc = vgpu.real.nvmlDeviceGetComputeRunningProcesses_v2(h, n, infos);
    if (rc != NVML_SUCCESS) return -1;
    if (*n > MAX_LISTED) *n = MAX_LISTED;
    return 0;
}

/* pid's used memory in a list: 1 (in *out), 0 not listed, -1 listed twice or not available. */
static int used_of(const nvmlProcessInfo_v2_t *infos, unsigned int n, unsigned int pid, uint64_t *out) {
    int found = 0, unknown = 0;
    for (unsigned int i = 0; i < n; i++) {
        if (infos[i].pid != pid) continue;
        if (infos[i].usedGpuMemory == (unsigned long long)NVML_VALUE_NOT_AVAILABLE) unknown = 1;
        *out = infos[i].usedGpuMemory;
        found++;
    }
    return found > 1 || unknown ? -1 : found;
}

/* This process's used memory on d as the driver accounts it: 1 (in *out), 0 when NVML lists
 * no such process (none yet, or its pid is another namespace's), -1 when NVML cannot say.
 * measure_mu held. */
static int proc_used(const struct vgpu_dev *d, uint64_t *out) {
    static nvmlProcessInfo_v2_t infos[MAX_LISTED]; /* measure_mu serialises its users */
    unsigned int n = MAX_LISTED;
    pid_check_fork();
    if (list_procs(d, infos, &n) != 0) return -1;
    /* Our pid twice: processes of other pid namespaces (containers' pid 1s, say) listed by
     * theirs; which one is us cannot be told, so neither is used. */
    return used_of(infos, n, g_pid.node_pid ? g_pid.node_pid : (unsigned int)getpid(), out);
}

/* Read without measure_mu (pace.c): a forked child's inherited node pid is not its own. */
unsigned int vgpu_nvml_pid(void) {
    pid_t self = getpid();
    unsigned int pid = __atomic_load_n(&g_pid.node_pid, __ATOMIC_RELAXED);
    return pid && __atomic_load_n(&g_pid.self, __ATOMIC_RELAXED) == self ? pid : (unsigned int)self;
}

/* The one pid that grew by exactly p and fell back by exactly p across the probe, else 0. */
static unsigned int probed_pid(const nvmlProcessInfo_v2_t *before, unsigned int nb,
                               const nvmlProcessInfo_v2_t *grown, unsigned int ng,
                               const nvmlProcessInfo_v2_t *after, unsigned int na, uint64_t p) {
    unsigned int pid = 0, grew = 0;
    for (unsigned int i = 0; i < ng; i++) {
        uint64_t b = 0, a = 0, g = grown[i].usedGpuMemory;
        if (g == (uint64_t)NVML_VALUE_NOT_AVAILABLE || used_of(before, nb, grown[i].pid, &b) < 0 ||
            g - b != p)
            continue;
        grew++; /* a neighbour that grew by p too makes it ambiguous */
        if (used_of(after, na, grown[i].pid, &a) == 1 && a + p == g) pid = grown[i].pid;
    }
    return grew == 1 ? pid : 0;
}

/* Learn this process's pid in NVML's lists with ctx (a context of d, made current for the
 * probe if it is not): 0 learned, -1 not (logged once). measure_mu held. */
static int __attribute__((noinline)) probe_node_pid(const struct vgpu_dev *d, CUcontext ctx) {
    static nvmlProcessInfo_v2_t before[MAX_LISTED], grown[MAX_LISTED], after[MAX_LISTED];
    pid_check_fork();
    if (g_pid.node_pid) return 0;
    CUcontext cur = NULL, popped;
    if (!ctx || !vgpu.real.cuMemAlloc_v2 || !vgpu.real.cuMemFree_v2 || !vgpu.real.cuCtxGetCurrent ||
        vgpu.real.cuCtxGetCurrent(&cur) != CUDA_SUCCESS)
        return -1;
    int pushed = cur != ctx;
    if (pushed && vgpu.real.cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS) return -1;
    /* Sizes differ per try and per process, so two processes probing at once part ways. */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned int base = ((unsigned int)ts.tv_nsec ^ (unsigned int)g_pid.self * 2654435761u) >> 7;
    unsigned int pid = 0, seen = 0;
    for (int k = 0; k < PROBE_TRIES && !pid; k++) {
        uint64_t p = (uint64_t)((base + 5u * (unsigned int)k) % 16u + 1u) << 21; /* 2..32 MiB */
        unsigned int nb = MAX_LISTED, ng = MAX_LISTED, na = MAX_LISTED;
        CUdeviceptr ptr;
        if (list_procs(d, before, &nb) != 0) break;
        if (vgpu.real.cuMemAlloc_v2(&ptr, (size_t)p) != CUDA_SUCCESS) continue;
        int listed = list_procs(d, grown, &ng) == 0;
        vgpu.real.cuMemFree_v2(ptr);
        if (!listed || list_procs(d, after, &na) != 0) break;
        /* Two sizes in a row must name the same entry: our own entry spoilt by another of our
         * threads while a neighbour happened to move by exactly p once cannot name it twice. */
        unsigned int got = probed_pid(before, nb, grown, ng, after, na, p);
        if (got && got == seen) pid = got;
        seen = got;
    }
    if (pushed) vgpu.real.cuCtxPopCurrent_v2(&popped);
    if (!pid) {
        if (!g_pid.told)
            VLOG(VGPU_LOG_INFO, "NVML does not list this process by its pid %d and a probe on GPU %s "
                 "could not tell its entry: contexts are measured by the GPU's free memory",
                 (int)g_pid.self, d->uuid);
        g_pid.told = 1;
        return -1;
    }
    __atomic_store_n(&g_pid.node_pid, pid, __ATOMIC_RELAXED);
    /* In the slot too: NVML's process lists in the container (views.c) show it by this pid. */
    vgpu_region_set_node_pid(vgpu.region, (int32_t)pid);
    memset(g_listed, 0, sizeof g_listed); /* learned anew under the right pid */
    VLOG(VGPU_LOG_DEBUG, "NVML lists this process (pid %d here) as pid %u", (int)g_pid.self, pid);
    return 0;
}

/* proc_used, first probing for this process's node pid (with ctx, one of its contexts on d)
 * where NVML does not list getpid() and the pid is not known yet. measure_mu held. */
static int proc_used_probed(const struct vgpu_dev *d, CUcontext ctx, uint64_t *out) {
    int st = proc_used(d, out);
    if (st != 1 && !g_pid.node_pid && probe_node_pid(d, ctx) == 0) st = proc_used(d, out);
    return st;
}

static int64_t own_committed(const struct vgpu_dev *d) {
    return d->accounted ? (int64_t)vgpu_region_own_committed(vgpu.region, d->rdev) : 0;
}

enum { BY_NONE, BY_PROCESS, BY_DEVICE };

struct measure {
    int fd, how, have_free;
    uint64_t proc_before, free_before;
    int64_t own_before;
    uint64_t held; /* reserved for the context being made: in own_committed, not yet held */
    uint64_t known; /* the context's size as known beforehand: nothing measured */
    int exact;      /* measure_end read this process's own usage (not the device's drop) */
};

/* g_ctx.measure_mu held. held: what was reserved for a context about to be made (0 else). */
static void measure_begin(struct measure *m, const struct vgpu_dev *d, uint64_t held) {
    int listed = g_listed[d->ordinal];
    uint64_t before = 0;
    int st = listed >= 0 ? proc_used(d, &before) : -1;
    if (listed == 0 && st == 1 && before > 0 && own_committed(d) == 0 && !g_pid.node_pid) {
        /* Listed as holding memory before this process's first context here, when the shim
         * has charged it nothing: another namespace's process under our pid. */
        g_listed[d->ordinal] = -1;
        listed = -1;
        st = -1;
    }
    *m = (struct measure){.fd = -1, .how = st >= 0 ? BY_PROCESS : BY_NONE, .proc_before = before,
                          .own_before = own_committed(d), .held = held};
    if (listed != 1) { /* the device's drop, in case this process turns out not to be listed */
        m->fd = lock_gpu(d->uuid);
        m->free_before = gpu_free(d, &m->have_free);
    }
}

/* What the measured call took on d (0 when it cannot be told). Drops the GPU lock. ctx: the
 * context measured (NULL: the call failed), with which this process's pid can be probed. */
static uint64_t measure_end(struct measure *m, const struct vgpu_dev *d, CUcontext ctx) {
    uint64_t after = 0, delta = 0;
    int st = m->how == BY_PROCESS ? proc_used(d, &after) : -1;
    m->exact = st == 1;
    if (st == 1) {
        g_listed[d->ordinal] = 1;
        int64_t grew = (int64_t)(after - m->proc_before) - (own_committed(d) - m->own_before);
        delta = grew > 0 ? (uint64_t)grew : 0;
    } else if (ctx && !g_pid.node_pid && probe_node_pid(d, ctx) == 0 && proc_used(d, &after) == 1) {
        /* Not listed under getpid(), now found by the probe: what we had before this call is not
         * known, so the charge is what the driver says we hold beyond what the shim charged. */
        g_listed[d->ordinal] = 1;
        m->exact = 1;
        int64_t extra = (int64_t)after - (own_committed(d) - (int64_t)m->held);
        delta = extra > 0 ? (uint64_t)extra : 0;
    } else {
        if (st == 0) g_listed[d->ordinal] = -1; /* a new context, yet not listed: another pid */
        int ok = 0;
        uint64_t free_after = m->have_free ? gpu_free(d, &ok) : 0;
        delta = ok && m->free_before > free_after ? m->free_before - free_after : 0;
        if (delta > MAX_CONTEXT_CHARGE) delta = 0; /* not our context alone */
    }
    unlock_gpu(m->fd);
    m->fd = -1;
    return delta;
}

/* Charge `bytes` to ctx's record on d (made if new), `held` of them reserved already (and
 * given back if the rest is refused): 0, or -1 when the limit refuses it. */
static int charge_ctx(struct vgpu_dev *d, CUcontext ctx, uint64_t bytes, uint64_t held, int settled,
                      const char *what) {
    if (bytes > held && vgpu_charge(d, bytes - held) != CUDA_SUCCESS) {
        vgpu_uncharge(d, held);
        VLOG(VGPU_LOG_WARN, "%s on GPU %s takes %llu bytes, over the container's memory limit of "
             "%llu bytes: refused", what, d->uuid, (unsigned long long)bytes,
             (unsigned long long)vgpu_region_limit(vgpu.region, d->rdev));
        return -1;
    }
    if (bytes > held) vgpu_commit(d, bytes - held);
    else vgpu_uncharge(d, held - bytes);
    if (d->accounted) charged_add(ctx, d->ordinal, bytes, settled);
    VLOG(VGPU_LOG_DEBUG, "%s %p on GPU %s charged %llu bytes", what, (void *)ctx, d->uuid,
         (unsigned long long)bytes);
    return 0;
}

static int ctx_charged(CUcontext ctx) {
    if (!ctx) return 1;
    pthread_mutex_lock(&g_ctx.mu);
    int found = charged_at(ctx) >= 0;
    pthread_mutex_unlock(&g_ctx.mu);
    return found;
}

/* A context the shim meets for the first time, already made (the runtime's own path): charge
 * it what NVML says this process holds on d beyond what the shim has charged it. 0, or -1
 * refused (the caller's allocation is then refused too, until the context fits). */
static int __attribute__((noinline)) charge_found(CUcontext ctx, struct vgpu_dev *d) {
    if (!d->accounted || !vgpu.limited) return 0;
    int rc = 0;
    pthread_mutex_lock(&g_ctx.measure_mu);
    uint64_t used = 0;
    if (!ctx_charged(ctx)) {
        int st = proc_used_probed(d, ctx, &used);
        int64_t extra = st == 1 ? (int64_t)used - own_committed(d) : 0;
        if (st != 1)
            VLOG(VGPU_LOG_INFO, "context %p on GPU %s was made out of the shim's sight and NVML does "
                 "not list this process: charged nothing", (void *)ctx, d->uuid);
        rc = charge_ctx(d, ctx, extra > 0 ? (uint64_t)extra : 0, 0, 0, "a context made by the runtime");
    }
    pthread_mutex_unlock(&g_ctx.measure_mu);
    return rc;
}

/* --- reserved before the driver makes a context -------------------------------------------
 * A context's size is known only once it is made, yet one made in a full container and then
 * undone has the GPU hold more than the limit meanwhile (and the runtime's private path makes
 * it where nothing can undo it). So before the driver is asked, the shim reserves what a context
 * of this GPU last took in the container (the region's context_bytes; 1 byte before any process
 * measured one): where that does not fit the context is refused without being made. The
 * reservation is then settled to what the context was measured to take. */

/* Per device: what a new context of this process took, measured exactly from its own usage
 * (0: not yet). A context's size is the driver's per-context overhead, the same for each of a
 * process's contexts on a GPU, so once known it is charged as is: no NVML process list and
 * no GPU lock per creation. measure_mu held. */
static uint64_t g_ctx_bytes[VGPU_MAX_ORDINALS];

static uint64_t expected_ctx_bytes(const struct vgpu_dev *d) {
    uint64_t e = vgpu_region_context_bytes(vgpu.region, d->rdev);
    return e ? e : 1;
}

/* Reserve (and commit, so that measures see it as before) a new context's size on d, known
 * or expected: the bytes held, or 0 when refused (logged, naming the limit). */
static uint64_t reserve_ctx(struct vgpu_dev *d) {
    uint64_t e = g_ctx_bytes[d->ordinal] ? g_ctx_bytes[d->ordinal] : expected_ctx_bytes(d);
    if (vgpu_charge(d, e) != CUDA_SUCCESS) {
        VLOG(VGPU_LOG_WARN, "a new context on GPU %s takes about %llu bytes, over the container's "
             "memory limit of %llu bytes (%llu in use): refused, not made", d->uuid,
             (unsigned long long)e, (unsigned long long)vgpu_region_limit(vgpu.region, d->rdev),
             (unsigned long long)vgpu_used(d));
        return 0;
    }
    vgpu_commit(d, e);
    return e;
}

/* Before the driver makes a context on d: reserve its size and, unless known, start
 * measuring it. The bytes held, or 0 when refused. measure_mu held. */
static uint64_t making_begin(struct measure *m, struct vgpu_dev *d) {
    uint64_t held = reserve_ctx(d);
    if (!held) return 0;
    if (g_ctx_bytes[d->ordinal]) *m = (struct measure){.fd = -1, .known = g_ctx_bytes[d->ordinal]};
    else measure_begin(m, d, held);
    return held;
}

/* After it: what the context takes (0 when it cannot be told; ctx NULL: the call failed). */
static uint64_t making_end(struct measure *m, struct vgpu_dev *d, CUcontext ctx) {
    if (m->known) return m->known;
    uint64_t bytes = measure_end(m, d, ctx);
    /* Only an exact measure is remembered, here and for the container's next contexts: a
     * device's free-memory drop may include a neighbour's allocation. */
    if (ctx && m->exact && bytes && bytes <= MAX_CONTEXT_CHARGE) {
        g_ctx_bytes[d->ordinal] = bytes;
        if (bytes != vgpu_region_context_bytes(vgpu.region, d->rdev))
            vgpu_region_set_context_bytes(vgpu.region, d->rdev, bytes);
    }
    return bytes;
}

/* A new context measured: settle its reservation `held` to `bytes`. 0, or -1 refused (the
 * reservation given back). */
static int settle_ctx(struct vgpu_dev *d, CUcontext ctx, uint64_t bytes, uint64_t held) {
    return charge_ctx(d, ctx, bytes, held, 0, "a new context");
}

/* --- creation and destruction hooks ---------------------------------------------------------- */

#define NEED VGPU_NEED

/* The device a new context goes on: NULL to create it unmeasured. *refuse: fail closed. */
static struct vgpu_dev *creating_on(CUdevice dev, int *refuse) {
    *refuse = 0;
    if (LIKELY(!vgpu.limited)) return NULL;
    struct vgpu_dev *d = vgpu_dev((int)dev);
    if (d && d->fail_closed) *refuse = 1;
    return d && d->accounted ? d : NULL;
}

/* The four ABIs of cuCtxCreate, one implementation. */
struct create_args {
    int version; /* 1..4 */
    unsigned int flags;
    CUdevice dev;
    CUexecAffinityParam *affinity;
    int naffinity;
    CUctxCreateParams *params;
};

static CUresult real_create(CUcontext *pctx, const struct create_args *a) {
    switch (a->version) {
    case 1: return vgpu.real.cuCtxCreate(pctx, a->flags, a->dev);
    case 2: return vgpu.real.cuCtxCreate_v2(pctx, a->flags, a->dev);
    case 3: return vgpu.real.cuCtxCreate_v3(pctx, a->affinity, a->naffinity, a->flags, a->dev);
    default: return vgpu.real.cuCtxCreate_v4(pctx, a->params, a->flags, a->dev);
    }
}

static CUresult create_ctx(CUcontext *pctx, const struct create_args *a) {
    int refuse;
    struct vgpu_dev *d = pctx ? creating_on(a->dev, &refuse) : NULL;
    if (pctx && refuse) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!d) return real_create(pctx, a);
    struct measure m;
    pthread_mutex_lock(&g_ctx.measure_mu);
    uint64_t held = making_begin(&m, d);
    if (!held) {
        pthread_mutex_unlock(&g_ctx.measure_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = real_create(pctx, a);
    uint64_t bytes = making_end(&m, d, rc == CUDA_SUCCESS ? *pctx : NULL);
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(d, held);
    } else {
        remember(*pctx, d->ordinal);
        if (settle_ctx(d, *pctx, bytes, held) != 0) {
            vgpu.real.cuCtxDestroy_v2(*pctx);
            gone(*pctx);
            *pctx = NULL;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&g_ctx.measure_mu);
    return rc;
}

VGPU_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate);
    return create_ctx(pctx, &(struct create_args){.version = 1, .flags = flags, .dev = dev});
}

VGPU_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v2);
    return create_ctx(pctx, &(struct create_args){.version = 2, .flags = flags, .dev = dev});
}

VGPU_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                 unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v3);
    return create_ctx(pctx, &(struct create_args){.version = 3, .flags = flags, .dev = dev,
                                                  .affinity = paramsArray, .naffinity = numParams});
}

VGPU_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                                 unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v4);
    return create_ctx(pctx, &(struct create_args){.version = 4, .flags = flags, .dev = dev,
                                                  .params = ctxCreateParams});
}

static CUresult destroy(CUcontext ctx, __typeof__(cuCtxDestroy_v2) *real) {
    /* Our timing events live in the context: destroy them while it still exists. */
    if (!vgpu.limited) return real(ctx);
    vgpu_launch_forget_ctx(ctx, 1);
    vgpu_release_begin();
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS) gone(ctx);
    vgpu_release_end();
    return rc;
}

VGPU_API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    NEED(cuCtxDestroy_v2);
    return destroy(ctx, vgpu.real.cuCtxDestroy_v2);
}

VGPU_API CUresult cuCtxDestroy(CUcontext ctx) {
    NEED(cuCtxDestroy);
    return destroy(ctx, vgpu.real.cuCtxDestroy);
}

/* --- primary contexts: measured when a retain activates one ------------------------------- */

static int primary_active(CUdevice dev) {
    unsigned int flags;
    int active = 0;
    return vgpu.real.cuDevicePrimaryCtxGetState &&
                   vgpu.real.cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS
               ? active
               : -1;
}

/* A primary context got by `get`: the driver's retain (retain 1: it takes a reference), or
 * the runtime table's slot (rtable.c; retain 0: it activates an inactive context holding one
 * reference, and returns an active one without a new one). Activating one is reserved before,
 * measured across and settled after; over the limit it is refused without being made. */
CUresult vgpu_primary_get(CUcontext *pctx, CUdevice dev, CUresult (*get)(CUcontext *, CUdevice), int retain) {
    int refuse;
    struct vgpu_dev *d = pctx ? creating_on(dev, &refuse) : NULL;
    if (pctx && refuse) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!d) return get(pctx, dev);
    struct measure m;
    uint64_t held = 0;
    pthread_mutex_lock(&g_ctx.measure_mu);
    int was_active = primary_active(dev) == 1;
    if (!was_active) {
        held = making_begin(&m, d);
        if (!held) {
            pthread_mutex_unlock(&g_ctx.measure_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    CUresult rc = get(pctx, dev);
    uint64_t bytes = was_active ? 0 : making_end(&m, d, rc == CUDA_SUCCESS ? *pctx : NULL);
    if (rc != CUDA_SUCCESS) {
        vgpu_uncharge(d, held);
    } else {
        CUcontext ctx = *pctx;
        g_ctx.primary[d->ordinal] = ctx;
        if (!was_active) {
            remember(ctx, d->ordinal);
            if (settle_ctx(d, ctx, bytes, held) != 0) {
                vgpu.real.cuDevicePrimaryCtxRelease_v2(dev); /* the one reference it holds */
                gone(ctx);
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
    }
    pthread_mutex_unlock(&g_ctx.measure_mu);
    /* Already active, maybe by a path out of sight: charged now if it never was. */
    if (rc == CUDA_SUCCESS && was_active) {
        if (!ctx_charged(*pctx) && charge_found(*pctx, d) != 0) {
            if (retain) vgpu.real.cuDevicePrimaryCtxRelease_v2(dev);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        remember(*pctx, d->ordinal);
    }
    return rc;
}

VGPU_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    NEED(cuDevicePrimaryCtxRetain);
    return vgpu_primary_get(pctx, dev, vgpu.real.cuDevicePrimaryCtxRetain, 1);
}

/* The runtime makes the primary context current after activating it through its own path:
 * the first time the shim sees a context, it is charged (vgpu_ctx_dev -> charge_found). */
VGPU_API CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED(cuCtxSetCurrent);
    CUresult rc = vgpu.real.cuCtxSetCurrent(ctx);
    CUcontext cur;
    if (rc == CUDA_SUCCESS && ctx && vgpu.limited) (void)vgpu_ctx_dev(NULL, &cur);
    return rc;
}

/* --- growth of a made context: its limits, its modules ---------------------------------------
 * A call that makes the driver take memory for the current context (cuCtxSetLimit's growth, a
 * module's code and variables) is measured across as a context is, under measure_mu, and the
 * growth charged to the context (given back when it goes). One call measured at a time: the
 * measure is kept here between begin and end. */
static struct measure g_growth;

struct vgpu_dev *vgpu_growth_begin(CUcontext *ctx) {
    struct vgpu_dev *d = vgpu_ctx_dev(NULL, ctx);
    if (!d || !d->accounted) return NULL;
    pthread_mutex_lock(&g_ctx.measure_mu);
    measure_begin(&g_growth, d, 0);
    return d;
}

int vgpu_growth_end(struct vgpu_dev *d, CUcontext ctx, CUresult rc, const char *what) {
    uint64_t grew = measure_end(&g_growth, d, ctx);
    /* Growth may go back by a settle (a module unloaded, a limit lowered). */
    int refused = rc == CUDA_SUCCESS && grew && charge_ctx(d, ctx, grew, 0, 1, what) != 0;
    pthread_mutex_unlock(&g_ctx.measure_mu);
    return refused ? -1 : 0;
}

/* --- what launches load: settled off the launch path -----------------------------------------
 * With lazy loading (the default) the driver loads a kernel's code at its first launch in a
 * context, and a library's module at its first use there by a launch; a launch may also grow
 * the context's local memory. None of it passes through an allocation the shim sees, and
 * measuring launches would put an NVML process list on the hot path. Instead the first launch
 * after each settle is watched (the launch hooks take their slow path once: no cost on the
 * common path), and the next allocation, memory view or synchronisation, at least
 * VGPU_CODE_SETTLE_NS after the last settle, charges what the driver holds for this process on each GPU beyond what the
 * shim has charged it (the same measure as a context made out of the shim's sight). The code
 * is already on the GPU: past the limit the charge is forced (one warning line), so further
 * allocations are refused until memory is freed. What is charged is given back with the
 * context. Between a launch and the settle the container may hold up to the code just loaded
 * over its limit (docs/contracts.md, "Module memory"). */
struct vgpu_releases vgpu_releases;
static pthread_mutex_t g_watch_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_code_settled_ns; /* CLOCK_MONOTONIC of the last settle; 0: at once (atomic) */

void vgpu_code_watch(void) {
    pthread_mutex_lock(&g_watch_mu);
    __atomic_store_n(&vgpu.code_watch, 1, __ATOMIC_RELEASE);
    vgpu_launch_fast_set(0);
    pthread_mutex_unlock(&g_watch_mu);
}

void vgpu_code_due(int at_once) {
    if (at_once) __atomic_store_n(&g_code_settled_ns, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&vgpu.code_due, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&vgpu.mem_hot, 0, __ATOMIC_RELEASE);
}

/* A watched launch (its slow path): the next allocation, view or sync settles; launches are fast
 * again until then. */
void vgpu_code_seen(void) {
    pthread_mutex_lock(&g_watch_mu);
    if (__atomic_load_n(&vgpu.code_watch, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&vgpu.code_watch, 0, __ATOMIC_RELEASE);
        vgpu_code_due(0); /* cuMemAlloc_v2 leaves its hot path until the settle */
        vgpu_launch_fast_set(1);
    }
    pthread_mutex_unlock(&g_watch_mu);
}

/* A context of this process on ordinal o (the calling thread's current one if it is there),
 * or NULL. g_ctx.mu not held. */
static CUcontext ctx_on(int o, CUcontext current) {
    CUcontext found = NULL;
    pthread_mutex_lock(&g_ctx.mu);
    for (size_t i = 0; i < g_ncharged && found != current; i++)
        if (g_charged[i].ordinal == o && (!found || g_charged[i].ctx == current)) found = g_charged[i].ctx;
    pthread_mutex_unlock(&g_ctx.mu);
    return found;
}

/* measure_mu held. 1: settle again at the next allocation, view or sync, because a release was in
 * flight (nothing compared) or the charge changed (a settle that misread some other path's
 * call in flight, e.g. a stream-ordered free given back when enqueued, is put right there). */
static int settle_code_on(struct vgpu_dev *d, CUcontext current) {
    CUcontext ctx = ctx_on(d->ordinal, current);
    uint64_t used = 0;
    if (!ctx || g_listed[d->ordinal] < 0) return 0;
    uint64_t begun = __atomic_load_n(&vgpu_releases.begun, __ATOMIC_SEQ_CST);
    uint64_t ended = __atomic_load_n(&vgpu_releases.ended, __ATOMIC_SEQ_CST);
    /* Read before the driver's usage: what is committed meanwhile only reads as more held. */
    uint64_t committed = (uint64_t)own_committed(d);
    /* NVML cannot tell this process apart: nothing to settle by */
    if (proc_used_probed(d, ctx, &used) != 1) return 0;
    /* Everything charged, reservations not yet made by the driver included, read after the
     * driver's usage: a neighbouring thread's allocation in flight is never taken for code. */
    uint64_t own = vgpu_region_own_usage(vgpu.region, d->rdev);
    if (begun != ended || __atomic_load_n(&vgpu_releases.begun, __ATOMIC_SEQ_CST) != begun)
        return 1; /* a free or a context's end overlapped: the driver may read as holding less */
    /* Against what is committed, not what is reserved: a reservation the driver has not made
     * yet is no memory it let go of. */
    if (used < committed) { /* a module unloaded, a limit lowered: what growth charged goes back */
        uint64_t back = settled_take(d->ordinal, committed - used);
        vgpu_uncharge(d, back);
        if (back)
            VLOG(VGPU_LOG_DEBUG, "GPU %s: %llu bytes of module memory the driver let go of given back", d->uuid,
                 (unsigned long long)back);
        return back != 0;
    }
    if (used <= own) return 0;
    uint64_t extra = used - own;
    if (vgpu_charge(d, extra) == CUDA_SUCCESS) {
        vgpu_commit(d, extra);
    } else {
        VLOG(VGPU_LOG_WARN, "launches on GPU %s loaded %llu bytes of code the container's memory "
             "limit of %llu bytes leaves no room for: charged, the container is over its limit "
             "and its allocations are refused until memory is freed", d->uuid,
             (unsigned long long)extra, (unsigned long long)vgpu_region_limit(vgpu.region, d->rdev));
        vgpu_region_force(vgpu.region, d->rdev, extra);
    }
    charged_add(ctx, d->ordinal, extra, 1);
    VLOG(VGPU_LOG_DEBUG, "launches on GPU %s loaded %llu bytes: charged to context %p", d->uuid,
         (unsigned long long)extra, (void *)ctx);
    return 1;
}

void vgpu_code_settle(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    if (now - __atomic_load_n(&g_code_settled_ns, __ATOMIC_RELAXED) < VGPU_CODE_SETTLE_NS) return;
    vgpu_graphs_settle(); /* graph memory has its own settle: not to be taken for code */
    /* Never waits: a thread already measuring (this one, inside a charge) settles later. */
    if (pthread_mutex_trylock(&g_ctx.measure_mu) != 0) return;
    if (__atomic_load_n(&vgpu.code_due, __ATOMIC_ACQUIRE)) {
        __atomic_store_n(&g_code_settled_ns, now, __ATOMIC_RELAXED);
        __atomic_store_n(&vgpu.code_due, 0, __ATOMIC_RELEASE);
        CUcontext current = NULL;
        if (vgpu.real.cuCtxGetCurrent) vgpu.real.cuCtxGetCurrent(&current);
        int again = 0;
        for (int o = 0; o < VGPU_MAX_ORDINALS; o++) {
            struct vgpu_dev *d = &vgpu.dev[o];
            if (__atomic_load_n(&d->ready, __ATOMIC_ACQUIRE) && d->accounted) again |= settle_code_on(d, current);
        }
        if (again) vgpu_code_due(0); /* the next allocation, view or sync, VGPU_CODE_SETTLE_NS on */
        else __atomic_store_n(&vgpu.mem_hot, vgpu.mem_hot_on, __ATOMIC_RELEASE);
        vgpu_code_watch();
    }
    pthread_mutex_unlock(&g_ctx.measure_mu);
}

/* Growing a context's heap, stack or printf FIFO takes GPU memory: charged to the context
 * (refused, and the old size put back, over the limit). */
VGPU_API CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    NEED(cuCtxSetLimit);
    if (LIKELY(!vgpu.limited)) return vgpu.real.cuCtxSetLimit(limit, value);
    size_t old = 0;
    int have_old = vgpu.real.cuCtxGetLimit && vgpu.real.cuCtxGetLimit(&old, limit) == CUDA_SUCCESS;
    CUcontext ctx;
    struct vgpu_dev *d = vgpu_growth_begin(&ctx);
    if (!d) return vgpu_ctx_dev(NULL, &ctx) ? vgpu.real.cuCtxSetLimit(limit, value) : UNRESOLVED(ctx, vgpu.real.cuCtxSetLimit(limit, value));
    CUresult rc = vgpu.real.cuCtxSetLimit(limit, value);
    if (vgpu_growth_end(d, ctx, rc, "a context's new limit") != 0) {
        if (have_old) vgpu.real.cuCtxSetLimit(limit, old);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

static void primary_maybe_gone(CUdevice dev) {
    if ((unsigned)dev < VGPU_MAX_ORDINALS && primary_active(dev) == 0) gone(g_ctx.primary[dev]);
}

/* Release and reset, each ABI: the same bookkeeping after the driver's call. */
static CUresult primary_call(CUdevice dev, CUresult (*real)(CUdevice)) {
    if (!vgpu.limited) return real(dev);
    vgpu_release_begin();
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS) primary_maybe_gone(dev);
    vgpu_release_end();
    return rc;
}

VGPU_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NEED(cuDevicePrimaryCtxRelease_v2);
    return primary_call(dev, vgpu.real.cuDevicePrimaryCtxRelease_v2);
}

VGPU_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    NEED(cuDevicePrimaryCtxRelease);
    return primary_call(dev, vgpu.real.cuDevicePrimaryCtxRelease);
}

VGPU_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    NEED(cuDevicePrimaryCtxReset_v2);
    return primary_call(dev, vgpu.real.cuDevicePrimaryCtxReset_v2);
}

VGPU_API CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    NEED(cuDevicePrimaryCtxReset);
    return primary_call(dev, vgpu.real.cuDevicePrimaryCtxReset);
}
