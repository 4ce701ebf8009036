/* Streams, events and synchronisation over the node's shared GPU timeline.
 *
 * Each stream remembers when its queued work completes (end_ns). Work queued on a stream is
 * ready when the stream's previous work is done, and for the legacy default stream's implicit
 * ordering: the legacy stream waits for every blocking stream of its context, a blocking
 * stream (a user stream without CU_STREAM_NON_BLOCKING, or a per-thread default stream) waits
 * for the legacy stream. A kernel then takes its turn on the GPU's timeline, shared by every
 * process of the node (simgpu_timeline_submit). Synchronising sleeps until the simulated
 * completion time. */
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

uint64_t sim_stream_deps(struct CUctx_st *ctx, struct CUstream_st *s) {
    uint64_t t = s->end_ns;
    if (s->kind == SIM_STREAM_LEGACY) t = sim_max64(t, ctx->blocking_end);
    else if (is_blocking(s)) t = sim_max64(t, ctx->legacy.end_ns);
    return t;
}

static void ring_drop_done(struct CUstream_st *s, uint64_t now) {
    while (s->ring_len && s->ring[s->ring_head] <= now) {
        s->ring_head = (s->ring_head + 1) % SIM_QUEUE_MAX_LAUNCHES;
        s->ring_len--;
    }
}

/* Record that s has work until t (a kernel's end, or an event it now waits for). */
static void stream_extend(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t t) {
    s->end_ns = sim_max64(s->end_ns, t);
    if (is_blocking(s)) ctx->blocking_end = sim_max64(ctx->blocking_end, t);
    ctx->all_end = sim_max64(ctx->all_end, t);
}

CUresult sim_submit_kernel_locked(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns) {
    uint64_t now, deps;
    /* A real driver's push buffer is finite: the launching thread waits while its stream has
     * too many launches pending or is too far ahead, so no process queues unboundedly. */
    for (;;) {
        now = simgpu_now_ns();
        ring_drop_done(s, now);
        deps = sim_stream_deps(ctx, s);
        uint64_t wait = 0;
        if (s->ring_len >= SIM_QUEUE_MAX_LAUNCHES) wait = s->ring[s->ring_head];
        else if (deps > now + SIM_QUEUE_MAX_NS) wait = deps - SIM_QUEUE_MAX_NS;
        if (!wait) break;
        sim_unlock();
        simgpu_sleep_until(wait);
        sim_lock();
        if (s->magic != SIM_STREAM_MAGIC || !ctx->active) return CUDA_ERROR_INVALID_HANDLE;
    }
    uint64_t end = simgpu_timeline_submit(ctx->phys, ctx->owner, sim_max64(now, deps), dur_ns);
    s->ring[(s->ring_head + s->ring_len) % SIM_QUEUE_MAX_LAUNCHES] = end;
    s->ring_len++;
    stream_extend(ctx, s, end);
    return CUDA_SUCCESS;
}

void sim_stream_free_ctx_locked(struct CUctx_st *ctx) {
    while (ctx->streams) {
        struct CUstream_st *s = ctx->streams;
        ctx->streams = s->next;
        stream_free(s);
    }
}

/* Sleep until t, then let pools release memory above their threshold (a sync point). */
static CUresult wait_until(uint64_t t) {
    simgpu_sleep_until(t);
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
    uint64_t t = rc == CUDA_SUCCESS ? sim_stream_deps(c, s) : 0;
    sim_unlock();
    if (rc == CUDA_SUCCESS) simgpu_sleep_until(t);
    return rc;
}

CUresult sim_ctx_synchronize(struct CUctx_st *ctx) {
    sim_lock();
    uint64_t t = ctx->all_end;
    sim_unlock();
    return wait_until(t);
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
static uint64_t pending_until(struct CUctx_st *ctx, struct CUstream_st *s) {
    return s->kind == SIM_STREAM_LEGACY ? sim_stream_deps(ctx, s) : s->end_ns;
}

static CUresult stream_sync(CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    uint64_t t = 0;
    if (rc == CUDA_SUCCESS && s->capture) {
        s->capture_invalid = 1; /* a sync breaks the capture, as on the real driver */
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (rc == CUDA_SUCCESS) {
        t = pending_until(c, s);
    }
    sim_unlock();
    return rc == CUDA_SUCCESS ? wait_until(t) : rc;
}

CUresult cuStreamSynchronize(CUstream hStream) { return stream_sync(hStream, 0); }
CUresult cuStreamSynchronize_ptsz(CUstream hStream) { return stream_sync(hStream, 1); }

static CUresult stream_query(CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && s->capture) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else if (rc == CUDA_SUCCESS && simgpu_now_ns() < pending_until(c, s)) rc = CUDA_ERROR_NOT_READY;
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
    /* Work queued after this waits for the event's point (an unrecorded event: nothing). */
    if (rc == CUDA_SUCCESS && e->recorded && !s->capture) stream_extend(c, s, e->t_ns);
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
        uint64_t t = sim_max64(simgpu_now_ns(), sim_stream_deps(c, s));
        e->t_ns = simgpu_timeslice_ns() ? t : sim_max64(t, simgpu_timeline_others_end(c->phys, c->owner));
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
    int pending = hEvent->recorded && simgpu_now_ns() < hEvent->t_ns;
    sim_unlock();
    return pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = event_check(hEvent);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    uint64_t t = hEvent->recorded ? hEvent->t_ns : 0;
    sim_unlock();
    return wait_until(t);
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
        uint64_t now = simgpu_now_ns();
        if (now < a->t_ns || now < b->t_ns) rc = CUDA_ERROR_NOT_READY;
        else *ms = (float)(((double)b->t_ns - (double)a->t_ns) / 1e6);
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
