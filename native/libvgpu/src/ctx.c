/* Contexts: which device each context is on, and the memory each context takes.
 *
 * A context costs GPU memory the driver never reports per context. It is measured as the
 * device's free-memory delta across the creation, read through NVML (the only reading
 * possible before the first context exists), while holding the GPU's node-wide flock
 * (<lock dir>/<GPU-UUID>.lock), so that other measured creations on the GPU do not overlap;
 * the kernel drops the lock of a process that dies. The charge goes to the region like any
 * allocation (refused over the limit: the context is undone) and is given back when the
 * context goes, together with every allocation the context owned. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
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

static struct {
    pthread_mutex_t mu;
    uint64_t gen;
    unsigned next;
    struct { CUcontext ctx; int ordinal; } known[64];
    CUcontext primary[VGPU_MAX_ORDINALS];
} g_ctx = {.mu = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local struct {
    CUcontext ctx;
    int ordinal;
    uint64_t gen;
} t_last VGPU_TLS;

static void remember(CUcontext ctx, int ordinal) {
    pthread_mutex_lock(&g_ctx.mu);
    int i = 0;
    while (i < 64 && g_ctx.known[i].ctx != ctx) i++;
    if (i == 64) i = (int)(g_ctx.next++ % 64);
    g_ctx.known[i].ctx = ctx;
    g_ctx.known[i].ordinal = ordinal;
    pthread_mutex_unlock(&g_ctx.mu);
}

static int known_ordinal(CUcontext ctx) {
    int ord = -1;
    pthread_mutex_lock(&g_ctx.mu);
    for (int i = 0; i < 64 && ord < 0; i++)
        if (g_ctx.known[i].ctx == ctx) ord = g_ctx.known[i].ordinal;
    pthread_mutex_unlock(&g_ctx.mu);
    return ord;
}

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
    remember(ctx, (int)dev);
    return (int)dev;
}

struct vgpu_dev *vgpu_ctx_dev(CUcontext ctx, CUcontext *ctx_out) {
    int is_current = ctx == NULL;
    if (is_current && (!vgpu.real.cuCtxGetCurrent || vgpu.real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS))
        ctx = NULL;
    *ctx_out = ctx;
    if (!ctx) return NULL;
    uint64_t gen = __atomic_load_n(&g_ctx.gen, __ATOMIC_ACQUIRE);
    if (LIKELY(t_last.ctx == ctx && t_last.gen == gen)) return vgpu_dev(t_last.ordinal);
    int ord = lookup_ordinal(ctx, is_current);
    if (ord < 0) return NULL;
    t_last.ctx = ctx;
    t_last.ordinal = ord;
    t_last.gen = gen;
    return vgpu_dev(ord);
}

struct vgpu_dev *vgpu_stream_dev(CUstream s, int ptsz, CUcontext *ctx_out) {
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return vgpu_ctx_dev(NULL, ctx_out);
    CUcontext ctx = NULL;
    __typeof__(cuStreamGetCtx) *get = ptsz ? vgpu.real.cuStreamGetCtx_ptsz : vgpu.real.cuStreamGetCtx;
    if (!get || get(s, &ctx) != CUDA_SUCCESS || !ctx) return vgpu_ctx_dev(NULL, ctx_out);
    return vgpu_ctx_dev(ctx, ctx_out);
}

/* A context went (destroyed, or a primary context's last release or reset): what it owned
 * is freed by the driver, so its charges are given back. */
static void gone(CUcontext ctx) {
    if (!ctx) return;
    vgpu_launch_forget_ctx(ctx, 0);
    vgpu_tab_drop_ctx(ctx);
    pthread_mutex_lock(&g_ctx.mu);
    for (int i = 0; i < 64; i++)
        if (g_ctx.known[i].ctx == ctx) g_ctx.known[i].ctx = NULL;
    pthread_mutex_unlock(&g_ctx.mu);
    __atomic_add_fetch(&g_ctx.gen, 1, __ATOMIC_RELEASE);
}

/* --- measuring a context's memory ------------------------------------------------------------ */

static int lock_gpu(const char *uuid) {
    char path[sizeof vgpu.cfg.lock_dir + VGPU_UUID_SIZE + 8];
    snprintf(path, sizeof path, "%s/%s.lock", vgpu.cfg.lock_dir, uuid);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0 && errno == ENOENT && mkdir(vgpu.cfg.lock_dir, 0777) == 0) {
        chmod(vgpu.cfg.lock_dir, 01777);
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0666);
    }
    if (fd < 0) {
        VLOG(VGPU_LOG_WARN, "cannot open the GPU lock %s: %s; measuring without it", path,
             strerror(errno));
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

struct measure {
    int fd, ok;
    uint64_t before;
};

static void measure_begin(struct measure *m, const struct vgpu_dev *d) {
    m->fd = lock_gpu(d->uuid);
    m->before = gpu_free(d, &m->ok);
}

/* Charge the delta to ctx; 0, or -1 when the limit refuses it (the caller undoes ctx). */
static int measure_end(struct measure *m, struct vgpu_dev *d, CUcontext ctx) {
    int ok2 = 0;
    uint64_t after = m->ok ? gpu_free(d, &ok2) : 0;
    uint64_t delta = m->ok && ok2 && m->before > after ? m->before - after : 0;
    if (delta > MAX_CONTEXT_CHARGE) delta = 0;
    int rc = 0;
    if (vgpu_charge(d, delta) != CUDA_SUCCESS) {
        VLOG(VGPU_LOG_WARN, "a new context on GPU %s takes %llu bytes, over the container's "
                 "memory limit: refused", d->uuid, (unsigned long long)delta);
        rc = -1;
    } else {
        vgpu_commit(d, delta);
        if (d->accounted) vgpu_tab_put(VGPU_OBJ_CTX, (uint64_t)(uintptr_t)ctx, d->ordinal, delta, ctx);
        VLOG(VGPU_LOG_DEBUG, "context %p on GPU %s charged %llu bytes", (void *)ctx, d->uuid,
             (unsigned long long)delta);
    }
    unlock_gpu(m->fd);
    return rc;
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

#define CREATE_BODY(dev, call)                                                                 \
    do {                                                                                       \
        int refuse_;                                                                           \
        struct vgpu_dev *d_ = creating_on((dev), &refuse_);                                    \
        if (refuse_) return CUDA_ERROR_OUT_OF_MEMORY;                                          \
        if (!d_) return (call);                                                                \
        struct measure m_;                                                                     \
        measure_begin(&m_, d_);                                                                \
        CUresult rc_ = (call);                                                                 \
        if (rc_ == CUDA_SUCCESS) {                                                             \
            remember(*pctx, d_->ordinal);                                                      \
            if (measure_end(&m_, d_, *pctx) != 0) {                                            \
                vgpu.real.cuCtxDestroy_v2(*pctx);                                              \
                gone(*pctx);                                                                   \
                *pctx = NULL;                                                                  \
                rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                \
            }                                                                                  \
        } else {                                                                               \
            unlock_gpu(m_.fd);                                                                 \
        }                                                                                      \
        return rc_;                                                                            \
    } while (0)

VGPU_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate);
    if (!pctx) return vgpu.real.cuCtxCreate(pctx, flags, dev);
    CREATE_BODY(dev, vgpu.real.cuCtxCreate(pctx, flags, dev));
}

VGPU_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v2);
    if (!pctx) return vgpu.real.cuCtxCreate_v2(pctx, flags, dev);
    CREATE_BODY(dev, vgpu.real.cuCtxCreate_v2(pctx, flags, dev));
}

VGPU_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                 unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v3);
    if (!pctx) return vgpu.real.cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev);
    CREATE_BODY(dev, vgpu.real.cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev));
}

VGPU_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                                 unsigned int flags, CUdevice dev) {
    NEED(cuCtxCreate_v4);
    if (!pctx) return vgpu.real.cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev);
    CREATE_BODY(dev, vgpu.real.cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev));
}

static CUresult destroy(CUcontext ctx, __typeof__(cuCtxDestroy_v2) *real) {
    /* Our timing events live in the context: destroy them while it still exists. */
    if (vgpu.limited) vgpu_launch_forget_ctx(ctx, 1);
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS && vgpu.limited) gone(ctx);
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

VGPU_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    NEED(cuDevicePrimaryCtxRetain);
    int refuse;
    struct vgpu_dev *d = pctx ? creating_on(dev, &refuse) : NULL;
    if (pctx && refuse) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!d || primary_active(dev) == 1) {
        CUresult rc = vgpu.real.cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS && d) {
            remember(*pctx, d->ordinal);
            g_ctx.primary[d->ordinal] = *pctx;
        }
        return rc;
    }
    struct measure m;
    measure_begin(&m, d);
    int was_active = primary_active(dev) == 1; /* another thread may have won the lock */
    CUresult rc = vgpu.real.cuDevicePrimaryCtxRetain(pctx, dev);
    if (rc != CUDA_SUCCESS || was_active) {
        unlock_gpu(m.fd);
        return rc;
    }
    remember(*pctx, d->ordinal);
    g_ctx.primary[d->ordinal] = *pctx;
    if (measure_end(&m, d, *pctx) != 0) {
        vgpu.real.cuDevicePrimaryCtxRelease_v2(dev);
        gone(*pctx);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return rc;
}

static void primary_maybe_gone(CUdevice dev) {
    if ((unsigned)dev < VGPU_MAX_ORDINALS && primary_active(dev) == 0) gone(g_ctx.primary[dev]);
}

VGPU_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    NEED(cuDevicePrimaryCtxRelease_v2);
    CUresult rc = vgpu.real.cuDevicePrimaryCtxRelease_v2(dev);
    if (rc == CUDA_SUCCESS && vgpu.limited) primary_maybe_gone(dev);
    return rc;
}

VGPU_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    NEED(cuDevicePrimaryCtxRelease);
    CUresult rc = vgpu.real.cuDevicePrimaryCtxRelease(dev);
    if (rc == CUDA_SUCCESS && vgpu.limited) primary_maybe_gone(dev);
    return rc;
}

VGPU_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    NEED(cuDevicePrimaryCtxReset_v2);
    CUresult rc = vgpu.real.cuDevicePrimaryCtxReset_v2(dev);
    if (rc == CUDA_SUCCESS && vgpu.limited) primary_maybe_gone(dev);
    return rc;
}

VGPU_API CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    NEED(cuDevicePrimaryCtxReset);
    CUresult rc = vgpu.real.cuDevicePrimaryCtxReset(dev);
    if (rc == CUDA_SUCCESS && vgpu.limited) primary_maybe_gone(dev);
    return rc;
}
