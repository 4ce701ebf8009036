/* Launch hooks and the measurement behind the compute limit.
 *
 * Without a compute limit a launch hook is one predictable branch and a jump to the driver.
 * On a paced GPU each launch (kernel, Ex, cooperative, graph; legacy and per-thread stream
 * forms alike) first waits while the container's budget (pace.c) is in debt, takes its
 * estimated cost, and is bracketed by two timing events on its own stream. When the events
 * have completed (checked, oldest first, at later launches) the estimate is replaced by the
 * GPU time the launch really took.
 *
 * What a bracket measures: a GPU writes an event's timestamp when it reaches the record in the
 * stream *while this context holds the GPU* (contexts time-share it; simgpu models that), so
 * the start event is written when the GPU turns to our work, not when we queued it: time spent
 * behind other containers' work is not in the bracket. What can be in it is this process's own
 * work on other streams of the context, which a GPU runs concurrently: brackets that overlap
 * would count the same wall time twice, so each bracket is charged only for the part of it
 * that the previous one (the one ending latest so far, per context) does not cover. A bracket
 * is charged as measured (a kernel's run time may vary from one launch to the next, and no
 * per-kernel guess can tell a slow launch from waiting), except that a kernel longer than a
 * time slice also holds the slices other contexts ran meanwhile: with a guarantee, while
 * peers have work queued, it is charged its share of the GPU, never less than the least it
 * was measured at (pace.c, vgpu_pace_gpu_time). The per-kernel estimate (same function or
 * graph, same grid and block; a running mean) is only the cost taken up front. */
#include <string.h>

#include "shim.h"

enum { RING = 64, POOL = 128, EST = 512, PREV = 8 };

struct pending {
    CUevent start, end;
    CUcontext ctx;
    struct vgpu_dev *d;
    int64_t charged; /* the estimate taken at launch */
    uint64_t key;
};

/* This process's launches in flight and its estimates (this file's part of the process
 * state), under one mutex taken only on paced launches. */
static struct {
    pthread_mutex_t mu;
    struct pending ring[RING];
    unsigned head, len;
    struct { CUevent e; CUcontext ctx; } pool[POOL];
    int npool;
    struct { uint64_t key; int64_t ns, solo; } est[EST]; /* solo: the least it measured */
    int64_t last_ns; /* the last settled charge: the estimate of a kernel never seen */
    int settled;     /* some launch was settled: last_ns means something */
    /* Per context, the settled bracket that ends latest: its start event (held out of the
     * pool) and length. Only times within a bracket's reach are compared, so the float
     * milliseconds of cuEventElapsedTime stay precise. */
    struct { CUcontext ctx; CUevent start; float ms; } prev[PREV];
    unsigned prev_next; /* the slot to reuse when all are taken */
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t key_of(const void *fn, uint64_t grid, uint64_t block) {
    uint64_t k = (uint64_t)(uintptr_t)fn * 0x9E3779B97F4A7C15ull;
    k ^= grid * 0xC2B2AE3D27D4EB4Full + block;
    return k ? k : 1;
}

/* --- events ------------------------------------------------------------------------------- */

static CUevent event_get(CUcontext ctx) {
    for (int i = g.npool - 1; i >= 0; i--) {
        if (g.pool[i].ctx == ctx) {
            CUevent e = g.pool[i].e;
            g.pool[i] = g.pool[--g.npool];
            return e;
        }
    }
    CUevent e = NULL;
    return vgpu.real.cuEventCreate(&e, CU_EVENT_DEFAULT) == CUDA_SUCCESS ? e : NULL;
}

static void event_put(CUevent e, CUcontext ctx) {
    if (!e) return;
    if (g.npool < POOL) g.pool[g.npool++] = (__typeof__(g.pool[0])){e, ctx};
    else vgpu.real.cuEventDestroy_v2(e);
}

/* --- settling ------------------------------------------------------------------------------ */

/* The GPU time to charge for a completed bracket of `ms` milliseconds: the part of it that
 * the context's previous bracket does not cover. Keeps the bracket as the new previous one
 * when it ends later. 1 if `start` is now held by g.prev (not to be pooled). g.mu held. */
static int overlap_trim(CUcontext ctx, CUevent start, float *ms) {
    __typeof__(g.prev[0]) *pv = NULL;
    for (int i = 0; i < PREV && !pv; i++)
        if (g.prev[i].ctx == ctx) pv = &g.prev[i];
    float a = 0, len = *ms;
    if (pv && pv->start && vgpu.real.cuEventElapsedTime(&a, pv->start, start) == CUDA_SUCCESS) {
        float b = a + *ms; /* this bracket is [a, b] on the previous one's clock, [0, pv->ms] */
        float overlap = (b < pv->ms ? b : pv->ms) - (a > 0 ? a : 0);
        if (overlap > 0) *ms -= overlap;
        if (b <= pv->ms) return 0; /* the previous one reaches further: it stays */
    }
    if (!pv) {
        pv = &g.prev[g.prev_next++ % PREV];
        event_put(pv->start, pv->ctx);
    } else {
        event_put(pv->start, ctx);
    }
    *pv = (__typeof__(*pv)){ctx, start, len};
    return 1;
}

/* Settle a launch of device d measured at `ns`: its charge is the GPU time that stands for
 * (ns itself unless contexts are time-sliced, vgpu_pace_gpu_time); the estimate follows it. */
static int64_t settle_charge(struct vgpu_dev *d, uint64_t key, int64_t ns) {
    __typeof__(g.est[0]) *e = &g.est[key % EST];
    if (e->key != key) {
        e->key = key;
        e->ns = e->solo = ns; /* its first measure: its floor, and charged whole */
    } else {
        /* Once the driver's measure has scaled the charges (pace.c, calibrate), the floor
         * stays put: the scale is learnt for the floors as they stand, and a kernel now and
         * then seen shorter (beside fewer slices, or alone) would be charged that much less
         * until later settles learnt the scale again. A newcomer's floor fell 8 -> 6 -> 4 ms
         * in its first second and it ran 70 ms of a 167 ms period on 39 ms of charges
         * (tests/libvgpu/test_shim_guarantee.py). */
        if (ns < e->solo && !__atomic_load_n(&d->cal_scale, __ATOMIC_RELAXED)) {
            e->solo = ns;
        } else if (UNLIKELY(__atomic_load_n(&d->npeer_until, __ATOMIC_RELAXED))) {
            /* Peers with work queued (guaranteed devices only know them): the floor drifts up
             * slowly, so a kernel that really got slower is followed, and the charge is its
             * share of the GPU, never under the floor. */
            if (ns > e->solo) e->solo += (ns - e->solo) / 1024;
            else ns = e->solo;
            ns = vgpu_pace_scaled(d, vgpu_pace_gpu_time(d, ns, e->solo));
        }
        e->ns += (ns - e->ns) / 4;
    }
    g.last_ns = ns;
    g.settled = 1;
    return ns;
}

/* Before any launch of the process was measured, a kernel is taken to cost FIRST_NS: a
 * process that starts with a queue of launches charged nothing would run them all ahead of
 * its share and then pay the debt back, well below its share, for a while (a newcomer beside
 * busy neighbours: tests/libvgpu/test_shim_guarantee.py). */
enum { FIRST_NS = 1000000 };
static int64_t estimate(uint64_t key) {
    const __typeof__(g.est[0]) *e = &g.est[key % EST];
    return e->key == key ? e->ns : LIKELY(g.settled) ? g.last_ns : FIRST_NS;
}

/* Settle the oldest pending launches whose events completed; with `wait`, wait for the oldest.
 * g.mu held. */
static void reap(int wait) {
    while (g.len) {
        struct pending *p = &g.ring[g.head];
        CUresult q = wait ? vgpu.real.cuEventSynchronize(p->end) : vgpu.real.cuEventQuery(p->end);
        if (q == CUDA_ERROR_NOT_READY) return;
        float ms = 0;
        int held = 0;
        if (q == CUDA_SUCCESS && vgpu.real.cuEventElapsedTime(&ms, p->start, p->end) == CUDA_SUCCESS) {
            if (ms < 0) ms = 0;
            held = overlap_trim(p->ctx, p->start, &ms);
            int64_t measured = ms > 0 ? (int64_t)((double)ms * 1e6) : 0;
            int64_t used = settle_charge(p->d, p->key, measured);
            vgpu_pace_add(p->d, p->charged - used);
            /* What the driver's measure settles it against (pace.c, calibrate; read only
             * with a guarantee, added up without a test) */
            __atomic_add_fetch(&p->d->cal_charged, used, __ATOMIC_RELAXED);
            vgpu_note_gpu_time(p->d, (uint64_t)used);
        }
        if (!held) event_put(p->start, p->ctx);
        event_put(p->end, p->ctx);
        g.head = (g.head + 1) % RING;
        g.len--;
        wait = 0;
    }
}

/* Settle what has completed (pace.c, before it reads the driver's measure): a process that
 * waits for its budget settles nothing until its next launch, and work the driver saw run
 * must be in the charges it is compared with. */
void vgpu_launch_settle(void) {
    pthread_mutex_lock(&g.mu);
    reap(0);
    pthread_mutex_unlock(&g.mu);
}

void vgpu_launch_forget_ctx(CUcontext ctx, int destroy_events) {
    if (!vgpu.pace_any) return; /* timings are taken only where launches are paced */
    pthread_mutex_lock(&g.mu);
    struct pending keep[RING];
    unsigned n = 0;
    for (unsigned i = 0; i < g.len; i++) {
        struct pending *p = &g.ring[(g.head + i) % RING];
        if (p->ctx != ctx) {
            keep[n++] = *p;
        } else if (destroy_events) {
            vgpu.real.cuEventDestroy_v2(p->start);
            vgpu.real.cuEventDestroy_v2(p->end);
        }
    }
    memcpy(g.ring, keep, n * sizeof keep[0]);
    g.head = 0;
    g.len = n;
    for (int i = 0; i < PREV; i++) {
        if (g.prev[i].ctx != ctx) continue;
        if (destroy_events && g.prev[i].start) vgpu.real.cuEventDestroy_v2(g.prev[i].start);
        g.prev[i] = (__typeof__(g.prev[0])){0};
    }
    for (int i = g.npool - 1; i >= 0; i--) {
        if (g.pool[i].ctx != ctx) continue;
        if (destroy_events) vgpu.real.cuEventDestroy_v2(g.pool[i].e);
        g.pool[i] = g.pool[--g.npool];
    }
    pthread_mutex_unlock(&g.mu);
}

/* --- one paced launch ----------------------------------------------------------------------- */

struct paced {
    struct vgpu_dev *d;
    CUstream stream;
    int ptsz;
    CUcontext ctx;
    CUevent start;
    int64_t charged;
    uint64_t key;
};

static CUresult record(CUevent e, CUstream s, int ptsz) {
    return ptsz ? vgpu.real.cuEventRecord_ptsz(e, s) : vgpu.real.cuEventRecord(e, s);
}

/* Before the real launch: 1 when the launch is paced (pc filled), 0 to just launch. */
static int __attribute__((noinline)) pace_begin(struct paced *pc, CUstream s, int ptsz, uint64_t key) {
    CUcontext sctx;
    struct vgpu_dev *d = vgpu_stream_dev(s, ptsz, &sctx);
    if (!d || !(d->sm || d->req) || !d->pace) return 0;
    /* Work captured into a graph does not run now: its graph is paced when launched. */
    CUstreamCaptureStatus cap = CU_STREAM_CAPTURE_STATUS_NONE;
    __typeof__(cuStreamIsCapturing) *is_cap = ptsz ? vgpu.real.cuStreamIsCapturing_ptsz : vgpu.real.cuStreamIsCapturing;
    if (!is_cap || is_cap(s, &cap) != CUDA_SUCCESS || cap != CU_STREAM_CAPTURE_STATUS_NONE) return 0;
    if (vgpu.real.cuCtxGetCurrent(&pc->ctx) != CUDA_SUCCESS || !pc->ctx) return 0;
    pthread_mutex_lock(&g.mu);
    reap(0);
    if (g.len == RING) reap(1);
    int64_t est = estimate(key);
    /* The GPU work this process has queued, launches in flight and this one: the container
     * stays busy for its peers until that has run, even while its thread is not scheduled. */
    uint64_t queued = (uint64_t)(g.len + 1) * (uint64_t)(est > 0 ? est : 0);
    pc->start = event_get(pc->ctx);
    pthread_mutex_unlock(&g.mu);
    vgpu_pace_wait(d, queued);
    vgpu_pace_add(d, -est);
    pc->d = d;
    pc->stream = s;
    pc->ptsz = ptsz;
    pc->charged = est;
    pc->key = key;
    if (pc->start && record(pc->start, s, ptsz) != CUDA_SUCCESS) {
        pthread_mutex_lock(&g.mu);
        event_put(pc->start, pc->ctx);
        pthread_mutex_unlock(&g.mu);
        pc->start = NULL; /* not measurable: the estimate stands */
    }
    return 1;
}

static void pace_end(struct paced *pc, CUresult rc) {
    pthread_mutex_lock(&g.mu);
    CUevent end = rc == CUDA_SUCCESS && pc->start ? event_get(pc->ctx) : NULL;
    if (end && record(end, pc->stream, pc->ptsz) == CUDA_SUCCESS && g.len < RING) {
        g.ring[(g.head + g.len) % RING] = (struct pending){pc->start, end, pc->ctx, pc->d, pc->charged, pc->key};
        g.len++;
    } else {
        if (rc != CUDA_SUCCESS) vgpu_pace_add(pc->d, pc->charged); /* nothing ran */
        event_put(pc->start, pc->ctx);
        event_put(end, pc->ctx);
    }
    pthread_mutex_unlock(&g.mu);
}

/* --- the hooks ---------------------------------------------------------------------------- */

/* Everything but the common case, out of line so that the common case (loaded, unpaced) is
 * a plain tail call: load the shim if needed, then pace if the GPU has a compute limit. */
#define PACED_FN(name, params, args, stream, ptsz, key)                                        \
    VGPU_HIDDEN CUresult __attribute__((noinline, used)) slow_##name params {                   \
        vgpu_ensure();                                                                         \
        if (UNLIKELY(!vgpu.real.name)) return CUDA_ERROR_NOT_INITIALIZED;                      \
        if (UNLIKELY(__atomic_load_n(&vgpu.code_watch, __ATOMIC_RELAXED))) vgpu_code_seen();   \
        struct paced pc;                                                                       \
        if (!vgpu.pace_any || !pace_begin(&pc, (stream), (ptsz), (key)))                        \
            return vgpu.real.name args;                                                        \
        CUresult rc = vgpu.real.name args;                                                     \
        pace_end(&pc, rc);                                                                     \
        return rc;                                                                             \
    }

#define GRID(x, y, z) ((uint64_t)(x) * (y) * (z))
#define KARGS CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, \
              unsigned int by, unsigned int bz, unsigned int sh, CUstream st, void **p
#define KKEY key_of(f, GRID(gx, gy, gz), GRID(bx, by, bz))
#define EXKEY key_of(f, GRID(c->gridDimX, c->gridDimY, c->gridDimZ), \
                     GRID(c->blockDimX, c->blockDimY, c->blockDimZ))

#define KCALL (f, gx, gy, gz, bx, by, bz, sh, st, p, x)
#define CCALL (f, gx, gy, gz, bx, by, bz, sh, st, p)
#define EXARGS (const CUlaunchConfig *c, CUfunction f, void **p, void **x)

PACED_FN(cuLaunchKernel, (KARGS, void **x), KCALL, st, 0, KKEY)
PACED_FN(cuLaunchKernel_ptsz, (KARGS, void **x), KCALL, st, 1, KKEY)
PACED_FN(cuLaunchCooperativeKernel, (KARGS), CCALL, st, 0, KKEY)
PACED_FN(cuLaunchCooperativeKernel_ptsz, (KARGS), CCALL, st, 1, KKEY)
PACED_FN(cuLaunchKernelEx, EXARGS, (c, f, p, x), c ? c->hStream : NULL, 0, c ? EXKEY : 0)
PACED_FN(cuLaunchKernelEx_ptsz, EXARGS, (c, f, p, x), c ? c->hStream : NULL, 1, c ? EXKEY : 0)
PACED_FN(cuGraphLaunch, (CUgraphExec g, CUstream st), (g, st), st, 0, key_of(g, 0, 0))
PACED_FN(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream st), (g, st), st, 1, key_of(g, 0, 0))

/* The kernel launches' common case: loaded, no compute limit anywhere -> straight to the
 * driver. Where the launch has arguments on the stack (cuLaunchKernel has 11), a C hook's
 * tail call copies them in place again (GCC: about 20 instructions for nothing), so on x86-64
 * each hook is 3 instructions of assembly: the driver's entry point from vgpu_launch_fast (set
 * once with the load, NULL while not loaded or when launches are paced), else a jump to its
 * slow_ function, which has the driver's prototype (checked below) and the arguments intact. */
#define VGPU_FAST_LAUNCHES(X)                                                                  \
    X(0, cuLaunchKernel) X(1, cuLaunchKernel_ptsz) X(2, cuLaunchCooperativeKernel)             \
    X(3, cuLaunchCooperativeKernel_ptsz) X(4, cuLaunchKernelEx) X(5, cuLaunchKernelEx_ptsz)

VGPU_HIDDEN void *vgpu_launch_fast[6];

#define VGPU_FAST_SET(i, name) \
    __atomic_store_n(&vgpu_launch_fast[i], on ? (void *)vgpu.real.name : NULL, __ATOMIC_RELEASE);
void vgpu_launch_fast_set(int on) {
    on = on && !vgpu.pace_any;
    VGPU_FAST_LAUNCHES(VGPU_FAST_SET)
}

void vgpu_launch_loaded(void) { vgpu_launch_fast_set(1); }

#define VGPU_FAST_CHECK(i, name)                                                               \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&name), __typeof__(&slow_##name)),   \
                   #name " has the driver's prototype");
VGPU_FAST_LAUNCHES(VGPU_FAST_CHECK)

#if defined(__x86_64__)
#if defined(__CET__)
#define VGPU_LAUNCH_ENDBR "endbr64\n"
#else
#define VGPU_LAUNCH_ENDBR ""
#endif
#define VGPU_FAST_ASM(i, name)                                                                 \
    __asm__(".text\n"                                                                          \
            ".globl " #name "\n"                                                               \
            ".type " #name ", @function\n"                                                     \
            ".p2align 4\n" #name ":\n"                                                         \
            ".cfi_startproc\n" VGPU_LAUNCH_ENDBR                                               \
            "movq vgpu_launch_fast+8*" #i "(%rip), %rax\n"                                      \
            "testq %rax, %rax\n"                                                               \
            "jz slow_" #name "\n"                                                              \
            "jmp *%rax\n"                                                                      \
            ".cfi_endproc\n"                                                                   \
            ".size " #name ", .-" #name "\n");
VGPU_FAST_LAUNCHES(VGPU_FAST_ASM)
#else
#define HOOK_BODY(i, name, args)                                                               \
    do {                                                                                       \
        __typeof__(name) *real_ = (__typeof__(name) *)__atomic_load_n(&vgpu_launch_fast[i], __ATOMIC_ACQUIRE); \
        return real_ ? real_ args : slow_##name args;                                          \
    } while (0)

VGPU_API CUresult cuLaunchKernel(KARGS, void **x) { HOOK_BODY(0, cuLaunchKernel, KCALL); }
VGPU_API CUresult cuLaunchKernel_ptsz(KARGS, void **x) { HOOK_BODY(1, cuLaunchKernel_ptsz, KCALL); }
VGPU_API CUresult cuLaunchCooperativeKernel(KARGS) { HOOK_BODY(2, cuLaunchCooperativeKernel, CCALL); }
VGPU_API CUresult cuLaunchCooperativeKernel_ptsz(KARGS) {
    HOOK_BODY(3, cuLaunchCooperativeKernel_ptsz, CCALL);
}

VGPU_API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                   void **extra) {
    HOOK_BODY(4, cuLaunchKernelEx, (config, f, kernelParams, extra));
}

VGPU_API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                        void **extra) {
    HOOK_BODY(5, cuLaunchKernelEx_ptsz, (config, f, kernelParams, extra));
}
#endif

/* Graph launches (two arguments, in registers: a C tail call is clean). */
#define GRAPH_BODY(name, args)                                                                 \
    do {                                                                                       \
        __typeof__(name) *real_ = vgpu.real.name;                                              \
        if (LIKELY(__atomic_load_n(&vgpu.ready, __ATOMIC_ACQUIRE) && !vgpu.pace_any && real_ && \
                   !__atomic_load_n(&vgpu.code_watch, __ATOMIC_RELAXED)))                      \
            return real_ args;                                                                 \
        return slow_##name args;                                                               \
    } while (0)

/* Once the process has made graph allocations, a graph launch also settles their memory. */
VGPU_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    if (UNLIKELY(__atomic_load_n(&vgpu.graph_mem, __ATOMIC_RELAXED)))
        return vgpu_graph_launch(hGraphExec, hStream, 0, slow_cuGraphLaunch);
    GRAPH_BODY(cuGraphLaunch, (hGraphExec, hStream));
}

VGPU_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    if (UNLIKELY(__atomic_load_n(&vgpu.graph_mem, __ATOMIC_RELAXED)))
        return vgpu_graph_launch(hGraphExec, hStream, 1, slow_cuGraphLaunch_ptsz);
    GRAPH_BODY(cuGraphLaunch_ptsz, (hGraphExec, hStream));
}
