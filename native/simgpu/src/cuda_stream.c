/* Streams, events and synchronisation over the node's shared GPU timeline.
 *
 * Each stream remembers when its queued work completes (end). Work queued on a stream is
 * ready when the stream's previous work is done, and for the legacy default stream's implicit
 * ordering: the legacy stream waits for every blocking stream of its context, a blocking
 * stream (a user stream without CU_STREAM_NON_BLOCKING, or a per-thread default stream) waits
 * for the legacy stream. A kernel then takes its turn on the GPU's timeline, shared by every
 * process of the node (simgpu_timeline_submit). Synchronising sleeps until the simulated
 * completion time. Time-sliced, a completion is a point of the context's work (struct
 * sim_when) whose time depends on what others queue later: a wait sleeps until its predicted
 * time and looks again. */
#include <stdlib.h>

#include "cuda_internal.h"

static int is_blocking(const struct CUstream_st *s) {
    return s->kind == SIM_STREAM_PER_THREAD || (s->kind == SIM_STREAM_USER && !(s->flags & CU_STREAM_NON_BLOCKING));
}

void sim_stream_init(struct CUstream_st *s, struct CUctx_st *ctx, enum sim_stream_kind kind, unsigned int flags,
                     int priority) {
    *s = (struct CUstream_st){.magic = SIM_STREAM_MAGIC, .kind = kind, .ctx = ctx, .flags = flags,
                              .priority = priority, .id = sim_next_id()};
    s->ring = calloc(SIM_QUEUE_MAX_LAUNCHES, sizeof *s->ring);
}

static void stream_free(struct CUstream_st *s) {
    s->magic = 0;
    free(s->ring);
    free(s);
}

/* --- per-thread default streams: one per (thread, context), freed when the thread exits ---- */

#define SIM_PTDS_MAX 16

struct ptds_table {
    int n;
    struct CUstream_st *s[SIM_PTDS_MAX];
};

static pthread_key_t g_ptds_key;
static pthread_once_t g_ptds_once = PTHREAD_ONCE_INIT;

static void ptds_table_free(void *p) {
    struct ptds_table *t = p;
    for (int i = 0; i < t->n; i++) stream_free(t->s[i]);
    free(t);
}

static void ptds_key_init(void) { pthread_key_create(&g_ptds_key, ptds_table_free); }

static struct CUstream_st *per_thread_stream(struct CUctx_st *ctx) {
    pthread_once(&g_ptds_once, ptds_key_init);
    struct ptds_table *t = pthread_getspecific(g_ptds_key);
    if (!t) {
        t = calloc(1, sizeof *t);
        if (!t || pthread_setspecific(g_ptds_key, t) != 0) {
            free(t);
            return NULL;
        }
    }
    for (int i = 0; i < t->n; i++)
        if (t->s[i]->ctx == ctx) return t->s[i];
    if (t->n == SIM_PTDS_MAX) return NULL;
    struct CUstream_st *s = malloc(sizeof *s);
    if (!s) return NULL;
    sim_stream_init(s, ctx, SIM_STREAM_PER_THREAD, 0, 0);
    if (!s->ring) {
        free(s);
        return NULL;
    }
    t->s[t->n++] = s;
    return s;
}

CUresult sim_stream_get(CUstream h, int ptds, struct CUctx_st **ctx, struct CUstream_st **s) {
    struct CUctx_st *c;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        CUresult rc = sim_current(&c);
        if (rc != CUDA_SUCCESS) return rc;
        int per_thread = h == CU_STREAM_PER_THREAD || (h == NULL && ptds);
        *s = per_thread ? per_thread_stream(c) : &c->legacy;
        *ctx = c;
        return *s ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (h->magic != SIM_STREAM_MAGIC || h->kind != SIM_STREAM_USER) return CUDA_ERROR_INVALID_HANDLE;
    c = h->ctx;
    if (!c->active) return CUDA_ERROR_INVALID_CONTEXT;
    rc = sim_gpu_ok(c->phys);
    if (rc != CUDA_SUCCESS) return rc;
    *ctx = c;
    *s = h;
    return CUDA_SUCCESS;
}

static struct sim_when when_max(struct sim_when a, struct sim_when b) {
    return (struct sim_when){sim_max64(a.t, b.t), sim_max64(a.mark, b.mark)};
}

struct sim_when sim_stream_deps(struct CUctx_st *ctx, struct CUstream_st *s) {
    struct sim_when t = s->end;
    if (s->kind == SIM_STREAM_LEGACY) t = when_max(t, ctx->blocking_end);
    else if (is_blocking(s)) t = when_max(t, ctx->legacy.end);
    return t;
}

int sim_when_reached(uint32_t phys, uint64_t owner, struct sim_when w, uint64_t now, uint64_t *t) {
    uint64_t at = 0;
    int done = w.mark ? simgpu_timeline_when(phys, owner, w.mark, &at) : 1;
    *t = sim_max64(w.t, at);
    return done && *t <= now;
}

void sim_when_wait(uint32_t phys, uint64_t owner, struct sim_when w) {
    for (;;) {
        uint64_t now = simgpu_now_ns(), t;
        if (sim_when_reached(phys, owner, w, now, &t)) return;
        simgpu_sleep_until(t > now ? t : now + 20000);
    }
}

/* Drop the kernels of s's push buffer that completed by now (the context's work done: `done`). */
static void ring_drop_done(struct CUstream_st *s, uint64_t now, uint64_t done) {
    while (s->ring_len && s->ring[s->ring_head].t <= now && s->ring[s->ring_head].mark <= done) {
        s->ring_head = (s->ring_head + 1) % SIM_QUEUE_MAX_LAUNCHES;
        s->ring_len--;
    }
}

/* Record that s has work until t (a kernel's end, or an event it now waits for). */
static void stream_extend(struct CUctx_st *ctx, struct CUstream_st *s, struct sim_when t) {
    s->end = when_max(s->end, t);
    if (is_blocking(s)) ctx->blocking_end = when_max(ctx->blocking_end, t);
    ctx->all_end = when_max(ctx->all_end, t);
}

CUresult sim_submit_kernel_locked(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns) {
    uint64_t now;
    struct sim_when deps;
    int sliced = simgpu_timeslice_ns() != 0;
    /* A real driver's push buffer is finite: the launching thread waits while its stream has
     * too many launches pending or is too far ahead, so no process queues unboundedly. */
    for (;;) {
        uint64_t done = 0, queued = 0, wait = 0;
        if (sliced) simgpu_timeline_progress(ctx->phys, ctx->owner, &done, &queued);
        now = simgpu_now_ns();
        ring_drop_done(s, now, done);
        deps = sim_stream_deps(ctx, s);
        if (s->ring_len >= SIM_QUEUE_MAX_LAUNCHES) {
            if (!sim_when_reached(ctx->phys, ctx->owner, s->ring[s->ring_head], now, &wait) && wait <= now)
                wait = now + 20000;
        } else if (sliced ? queued - done > SIM_QUEUE_MAX_NS : deps.t > now + SIM_QUEUE_MAX_NS) {
            /* time-sliced, its own work alone takes that long to run */
            wait = sliced ? now + (queued - done - SIM_QUEUE_MAX_NS) : deps.t - SIM_QUEUE_MAX_NS;
        }
        if (wait <= now) break;
        sim_unlock();
        simgpu_sleep_until(wait);
        sim_lock();
        if (s->magic != SIM_STREAM_MAGIC || !ctx->active) return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t mark, end = simgpu_timeline_submit(ctx->phys, ctx->owner, sim_max64(now, deps.t), dur_ns, &mark);
    struct sim_when w = {mark ? 0 : end, mark};
    s->ring[(s->ring_head + s->ring_len) % SIM_QUEUE_MAX_LAUNCHES] = w;
    s->ring_len++;
    stream_extend(ctx, s, w);
    return CUDA_SUCCESS;
}

void sim_stream_free_ctx_locked(struct CUctx_st *ctx) {
    while (ctx->streams) {
        struct CUstream_st *s = ctx->streams;
        ctx->streams = s->next;
        stream_free(s);
    }
}

/* Sleep until the point w of context `owner`'s work on `phys`, then let pools release memory
 * above their threshold (a sync point). */
static CUresult wait_until(uint32_t phys, uint64_t owner, struct sim_when w) {
    sim_when_wait(phys, owner, w);
    sim_lock();
    sim_pools_trim_locked();
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult sim_sync_copy_wait(CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    struct sim_when t = rc == CUDA_SUCCESS ? sim_stream_deps(c, s) : (struct sim_when){0, 0};
    sim_unlock();
    if (rc == CUDA_SUCCESS) sim_when_wait(c->phys, c->owner, t);
    return rc;
}

CUresult sim_ctx_synchronize(struct CUctx_st *ctx) {
    sim_lock();
    struct sim_when t = ctx->all_end;
    sim_unlock();
    return wait_until(ctx->phys, ctx->owner, t);
}

/* --- streams ----------------------------------------------------------------------------- */

static CUresult stream_create(CUstream *ph, unsigned int flags, int priority) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!ph || (flags & ~(unsigned int)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    /* Priorities outside [greatest, least] = [-5, 0] are clamped, as documented. */
    priority = priority > 0 ? 0 : priority < -5 ? -5 : priority;
    struct CUstream_st *s = malloc(sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    sim_stream_init(s, c, SIM_STREAM_USER, flags, priority);
    if (!s->ring) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_lock();
    s->next = c->streams;
    c->streams = s;
    sim_unlock();
    *ph = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) { return stream_create(phStream, Flags, 0); }
CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    return stream_create(phStream, flags, priority);
}

/* Queued work still completes on the timeline; only the handle goes. */
static CUresult stream_destroy(CUstream h) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!h || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD || h->magic != SIM_STREAM_MAGIC ||
        h->kind != SIM_STREAM_USER)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_lock();
    struct CUstream_st **link = &h->ctx->streams;
    while (*link && *link != h) link = &(*link)->next;
    if (*link) {
        *link = h->next;
        stream_free(h);
    } else {
        rc = CUDA_ERROR_INVALID_HANDLE;
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamDestroy(CUstream hStream) { return stream_destroy(hStream); }
CUresult cuStreamDestroy_v2(CUstream hStream) { return stream_destroy(hStream); }

/* What synchronising with s waits for: its own work; for the legacy stream also the blocking
 * streams' work, which anything queued on it now would wait for. */
static struct sim_when pending_until(struct CUctx_st *ctx, struct CUstream_st *s) {
    return s->kind == SIM_STREAM_LEGACY ? sim_stream_deps(ctx, s) : s->end;
}

static CUresult stream_sync(CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    struct sim_when t = {0, 0};
    if (rc == CUDA_SUCCESS && s->capture) {
        s->capture_invalid = 1; /* a sync breaks the capture, as on the real driver */
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (rc == CUDA_SUCCESS) {
        t = pending_until(c, s);
    }
    sim_unlock();
    return rc == CUDA_SUCCESS ? wait_until(c->phys, c->owner, t) : rc;
}

CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    uint64_t t;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && s->capture) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else if (rc == CUDA_SUCCESS && !sim_when_reached(c->phys, c->owner, pending_until(c, s), simgpu_now_ns(), &t))
        rc = CUDA_ERROR_NOT_READY;
    sim_unlock();
    return rc;
}

CUresult cuStreamQuery(CUstream hStream) { return stream_query(hStream, 0); }
CUresult cuStreamQuery_ptsz(CUstream hStream) { return stream_query(hStream, 1); }

static CUresult event_check(CUevent e) {
    return e && e->magic == SIM_EVENT_MAGIC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult stream_wait_event(CUstream h, CUevent e, unsigned int flags, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (flags & ~(unsigned int)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS) rc = event_check(e);
    /* Work queued after this waits for the event's point (an unrecorded event: nothing); on
     * another context's, for the time that point is reached as far as known now (a later
     * delay of the other context's work does not hold this one back: not modelled). */
    if (rc == CUDA_SUCCESS && e->recorded && !s->capture) {
        struct sim_when w = e->at;
        if (e->owner != c->owner || e->phys != c->phys) {
            uint64_t t;
            sim_when_reached(e->phys, e->owner, w, simgpu_now_ns(), &t);
            w = (struct sim_when){t, 0};
        }
        stream_extend(c, s, w);
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 0);
}
CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

/* Getters: what = 0 priority, 1 flags, 2 context, 3 id, 4 device. */
static CUresult stream_get(CUstream h, int ptds, int what, void *out) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS) {
        switch (what) {
        case 0: *(int *)out = s->priority; break;
        case 1: *(unsigned int *)out = s->flags; break;
        case 2: *(CUcontext *)out = c; break;
        case 3: *(unsigned long long *)out = s->id; break;
        default: *(CUdevice *)out = c->dev; break;
        }
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamGetPriority(CUstream h, int *priority) { return stream_get(h, 0, 0, priority); }
CUresult cuStreamGetPriority_ptsz(CUstream h, int *priority) { return stream_get(h, 1, 0, priority); }
CUresult cuStreamGetFlags(CUstream h, unsigned int *flags) { return stream_get(h, 0, 1, flags); }
CUresult cuStreamGetFlags_ptsz(CUstream h, unsigned int *flags) { return stream_get(h, 1, 1, flags); }
CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx) { return stream_get(h, 0, 2, pctx); }
CUresult cuStreamGetCtx_ptsz(CUstream h, CUcontext *pctx) { return stream_get(h, 1, 2, pctx); }
/* No green contexts in the simulator: the green context is always NULL. */
static CUresult stream_get_ctx_v2(CUstream h, CUcontext *pctx, CUgreenCtx *green, int ptds) {
    if (!green) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = stream_get(h, ptds, 2, pctx);
    if (rc == CUDA_SUCCESS) *green = NULL;
    return rc;
}

CUresult cuStreamGetCtx_v2(CUstream h, CUcontext *pctx, CUgreenCtx *green) { return stream_get_ctx_v2(h, pctx, green, 0); }
CUresult cuStreamGetCtx_v2_ptsz(CUstream h, CUcontext *pctx, CUgreenCtx *green) {
    return stream_get_ctx_v2(h, pctx, green, 1);
}
CUresult cuStreamGetId(CUstream h, unsigned long long *id) { return stream_get(h, 0, 3, id); }
CUresult cuStreamGetId_ptsz(CUstream h, unsigned long long *id) { return stream_get(h, 1, 3, id); }
CUresult cuStreamGetDevice(CUstream h, CUdevice *dev) { return stream_get(h, 0, 4, dev); }
CUresult cuStreamGetDevice_ptsz(CUstream h, CUdevice *dev) { return stream_get(h, 1, 4, dev); }

/* --- events ------------------------------------------------------------------------------ */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    unsigned int known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~known) || ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = SIM_EVENT_MAGIC;
    e->flags = Flags;
    sim_lock();
    sim_link_add_locked(&e->link);
    sim_unlock();
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream h, unsigned int flags, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (flags & ~(unsigned int)CU_EVENT_RECORD_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS) rc = event_check(e);
    if (rc == CUDA_SUCCESS && !s->capture) { /* recorded in a capture: not modelled */
        /* The GPU reaches the record once everything before it on the stream is done and the
         * context has the GPU: contexts time-share it, and a context's commands, timestamps
         * included, run only while it holds it. Here that is after the work other contexts
         * queued before the record (kernels run in submission order); the context's own other
         * streams do not delay it (a GPU runs them concurrently). Time-sliced, the context
         * gets the GPU within a round of slices whatever the others queued: the record is
         * reached when its stream's work is done (simgpu_timeline_submit). */
        struct sim_when w = sim_stream_deps(c, s);
        w.t = sim_max64(w.t, simgpu_now_ns());
        if (!simgpu_timeslice_ns()) w.t = sim_max64(w.t, simgpu_timeline_others_end(c->phys, c->owner));
        e->at = w;
        e->phys = c->phys;
        e->owner = c->owner;
        e->recorded = 1;
    }
    sim_unlock();
    return rc;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0, 0); }
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { return event_record(hEvent, hStream, 0, 1); }
CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
    return event_record(hEvent, hStream, flags, 0);
}
CUresult cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream, unsigned int flags) {
    return event_record(hEvent, hStream, flags, 1);
}

CUresult cuEventQuery(CUevent hEvent) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = event_check(hEvent);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    uint64_t t;
    int pending = hEvent->recorded && !sim_when_reached(hEvent->phys, hEvent->owner, hEvent->at, simgpu_now_ns(), &t);
    sim_unlock();
    return pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = event_check(hEvent);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    int recorded = hEvent->recorded;
    struct sim_when w = hEvent->at;
    uint32_t phys = hEvent->phys;
    uint64_t owner = hEvent->owner;
    sim_unlock();
    return wait_until(phys, owner, recorded ? w : (struct sim_when){0, 0});
}

static CUresult elapsed(float *ms, CUevent a, CUevent b) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (event_check(a) != CUDA_SUCCESS || event_check(b) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_HANDLE;
    sim_lock();
    if (!a->recorded || !b->recorded || ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING)) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        uint64_t now = simgpu_now_ns(), ta, tb;
        if (!sim_when_reached(a->phys, a->owner, a->at, now, &ta) || !sim_when_reached(b->phys, b->owner, b->at, now, &tb))
            rc = CUDA_ERROR_NOT_READY;
        else
            *ms = (float)(((double)tb - (double)ta) / 1e6);
    }
    sim_unlock();
    return rc;
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return elapsed(pMilliseconds, hStart, hEnd);
}
CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return elapsed(pMilliseconds, hStart, hEnd);
}

static CUresult event_destroy(CUevent e) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = event_check(e);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    e->magic = 0;
    sim_link_del_locked(&e->link);
    sim_unlock();
    free(e);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent hEvent) { return event_destroy(hEvent); }
CUresult cuEventDestroy_v2(CUevent hEvent) { return event_destroy(hEvent); }

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuEventCreate)
SIM_SELF(cuEventDestroy)
SIM_SELF(cuEventDestroy_v2)
SIM_SELF(cuEventElapsedTime)
SIM_SELF(cuEventElapsedTime_v2)
SIM_SELF(cuEventQuery)
SIM_SELF(cuEventRecord)
SIM_SELF(cuEventRecordWithFlags)
SIM_SELF(cuEventRecordWithFlags_ptsz)
SIM_SELF(cuEventRecord_ptsz)
SIM_SELF(cuEventSynchronize)
SIM_SELF(cuStreamCreate)
SIM_SELF(cuStreamCreateWithPriority)
SIM_SELF(cuStreamDestroy)
SIM_SELF(cuStreamDestroy_v2)
SIM_SELF(cuStreamGetCtx)
SIM_SELF(cuStreamGetCtx_ptsz)
SIM_SELF(cuStreamGetCtx_v2)
SIM_SELF(cuStreamGetCtx_v2_ptsz)
SIM_SELF(cuStreamGetDevice)
SIM_SELF(cuStreamGetDevice_ptsz)
SIM_SELF(cuStreamGetFlags)
SIM_SELF(cuStreamGetFlags_ptsz)
SIM_SELF(cuStreamGetId)
SIM_SELF(cuStreamGetId_ptsz)
SIM_SELF(cuStreamGetPriority)
SIM_SELF(cuStreamGetPriority_ptsz)
SIM_SELF(cuStreamQuery)
SIM_SELF(cuStreamQuery_ptsz)
SIM_SELF(cuStreamSynchronize)
SIM_SELF(cuStreamSynchronize_ptsz)
SIM_SELF(cuStreamWaitEvent)
SIM_SELF(cuStreamWaitEvent_ptsz)
