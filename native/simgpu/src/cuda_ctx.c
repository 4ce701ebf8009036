/* Contexts: primary (retain/release) and explicit (create/destroy), and each thread's stack of
 * current contexts. An active context holds its GPU's configured overhead on the node. */
#include <stdlib.h>

#include "cuda_internal.h"

#define SIM_CTX_STACK 64

static _Thread_local struct {
    struct CUctx_st *stack[SIM_CTX_STACK];
    int depth;
} t_ctx;

static size_t g_limits[CU_LIMIT_MAX] = {
    [CU_LIMIT_STACK_SIZE] = 1024,
    [CU_LIMIT_PRINTF_FIFO_SIZE] = 1 << 20,
    [CU_LIMIT_MALLOC_HEAP_SIZE] = 8 << 20,
    [CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT] = 2048,
    [CU_LIMIT_MAX_L2_FETCH_GRANULARITY] = 64,
};

static int is_active(const struct CUctx_st *c) { return __atomic_load_n(&c->active, __ATOMIC_ACQUIRE); }

struct CUctx_st *sim_ctx_top(void) { return t_ctx.depth ? t_ctx.stack[t_ctx.depth - 1] : NULL; }

CUresult sim_current(struct CUctx_st **out) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    /* The stack only holds handles this library made, and those are never freed: reading one
     * is safe even after another thread destroyed it. */
    struct CUctx_st *c = sim_ctx_top();
    if (!c || !is_active(c)) return CUDA_ERROR_INVALID_CONTEXT;
    rc = sim_gpu_ok(c->phys);
    if (rc != CUDA_SUCCESS) return rc;
    *out = c;
    return CUDA_SUCCESS;
}

CUresult sim_ctx_valid(CUcontext ctx) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
    /* A handle from the caller may be anything: look it up instead of dereferencing it. */
    sim_lock();
    struct CUctx_st *c = sim_proc.contexts;
    while (c && c != ctx) c = c->next;
    sim_unlock();
    return c && is_active(c) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static struct CUctx_st *ctx_new_locked(CUdevice dev, unsigned int flags, int primary) {
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->magic = SIM_CTX_MAGIC;
    c->dev = dev;
    c->phys = sim_proc.phys[dev];
    c->primary = primary;
    c->flags = flags;
    c->id = sim_next_id();
    c->owner = simgpu_timeline_owner(); /* the timeline tells contexts apart node-wide */
    sim_stream_init(&c->legacy, c, SIM_STREAM_LEGACY, 0, 0);
    if (!c->legacy.ring) {
        free(c);
        return NULL;
    }
    c->next = sim_proc.contexts;
    sim_proc.contexts = c;
    return c;
}

static CUresult ctx_activate_locked(struct CUctx_st *c) {
    if (simgpu_context_add(c->phys) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    __atomic_store_n(&c->active, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

/* What a context owns goes with it: memory, streams, modules, and its overhead. */
static void ctx_deactivate_locked(struct CUctx_st *c) {
    if (!is_active(c)) return;
    __atomic_store_n(&c->active, 0, __ATOMIC_RELEASE);
    sim_mem_free_ctx_locked(c);
    sim_stream_free_ctx_locked(c);
    sim_module_free_ctx_locked(c);
    simgpu_context_remove(c->phys);
    if (c->grown) simgpu_mem_uncharge(c->phys, c->grown);
    c->grown = 0;
}

static CUresult check_flags(unsigned int flags) {
    return (flags & ~(unsigned int)CU_CTX_FLAGS_MASK) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* --- primary contexts -------------------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    rc = sim_gpu_ok(phys);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    if (!c) c = sim_proc.primary[dev] = ctx_new_locked(dev, 0, 1);
    if (!c) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (!is_active(c)) rc = ctx_activate_locked(c);
    if (rc == CUDA_SUCCESS) {
        c->refs++;
        *pctx = c;
    }
    sim_unlock();
    return rc;
}

/* The real driver's behaviour as ZLUDA documents it (dark_api, "primary_ctx_get"): the runtime
 * gets the handle; an inactive context is activated holding one reference, which is the
 * runtime's (cudaDeviceReset gives it back through cuDevicePrimaryCtxReset); an active one is
 * returned without a new reference. */
CUresult sim_primary_ctx_get(CUcontext *pctx, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    rc = sim_gpu_ok(phys);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    if (!c) c = sim_proc.primary[dev] = ctx_new_locked(dev, 0, 1);
    if (!c) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (!is_active(c)) {
        rc = ctx_activate_locked(c);
        if (rc == CUDA_SUCCESS) c->refs = 1;
    }
    if (rc == CUDA_SUCCESS) *pctx = c;
    sim_unlock();
    return rc;
}

static CUresult primary_release(CUdevice dev) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUctx_st *last = sim_proc.primary[dev];
    int going = last && last->refs == 1;
    sim_unlock();
    if (going) sim_cls_destroy(last); /* the runtime's state goes while the context lives */
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    if (!c || c->refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--c->refs == 0) {
        ctx_deactivate_locked(c);
    }
    sim_unlock();
    return rc;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release(dev); }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release(dev); }

static CUresult primary_reset(CUdevice dev) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUctx_st *p = sim_proc.primary[dev];
    sim_unlock();
    if (p) sim_cls_destroy(p);
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    if (c) {
        ctx_deactivate_locked(c);
        c->refs = 0;
        c->flags = 0;
    }
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_reset(dev); }
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return primary_reset(dev); }

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    *flags = c ? c->flags : 0;
    *active = c ? is_active(c) : 0;
    sim_unlock();
    return CUDA_SUCCESS;
}

static CUresult primary_set_flags(CUdevice dev, unsigned int flags, int v1) {
    CUresult rc = sim_device(dev, NULL);
    if (rc == CUDA_SUCCESS) rc = check_flags(flags);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUctx_st *c = sim_proc.primary[dev];
    if (!c) c = sim_proc.primary[dev] = ctx_new_locked(dev, 0, 1);
    if (!c) rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (v1 && is_active(c)) rc = CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE; /* v1 refused that */
    else c->flags = flags;
    sim_unlock();
    return rc;
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) { return primary_set_flags(dev, flags, 1); }
CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) { return primary_set_flags(dev, flags, 0); }

/* --- explicit contexts ------------------------------------------------------------------- */

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    rc = check_flags(flags);
    if (rc == CUDA_SUCCESS) rc = sim_gpu_ok(phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (t_ctx.depth >= SIM_CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    sim_lock();
    struct CUctx_st *c = ctx_new_locked(dev, flags, 0);
    rc = c ? ctx_activate_locked(c) : CUDA_ERROR_OUT_OF_MEMORY;
    sim_unlock();
    if (rc != CUDA_SUCCESS) return rc;
    t_ctx.stack[t_ctx.depth++] = c; /* a new context becomes current, pushed */
    *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) { return ctx_create(pctx, flags, dev); }

/* Execution affinity (SM limits) is accepted and not modelled: every context sees all SMs. */
CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags, CUdevice dev) {
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < numParams; i++)
        if (paramsArray[i].type != CU_EXEC_AFFINITY_TYPE_SM_COUNT) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
    return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev) {
    if (ctxCreateParams) {
        if (ctxCreateParams->cigParams) return CUDA_ERROR_NOT_SUPPORTED; /* no graphics interop */
        int n = ctxCreateParams->numExecAffinityParams;
        if (n < 0 || (n > 0 && !ctxCreateParams->execAffinityParams)) return CUDA_ERROR_INVALID_VALUE;
    }
    return ctx_create(pctx, flags, dev);
}

static CUresult ctx_destroy(CUcontext ctx) {
    CUresult rc = sim_ctx_valid(ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (ctx->primary) return CUDA_ERROR_INVALID_CONTEXT; /* primary contexts go by release */
    sim_cls_destroy(ctx);
    sim_lock();
    ctx_deactivate_locked(ctx);
    sim_unlock();
    if (sim_ctx_top() == ctx) t_ctx.depth--;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy(CUcontext ctx) { return ctx_destroy(ctx); }
CUresult cuCtxDestroy_v2(CUcontext ctx) { return ctx_destroy(ctx); }

/* --- the current context ----------------------------------------------------------------- */

CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ctx) {
        if (t_ctx.depth > 0) t_ctx.depth--; /* NULL unbinds: pops the top */
        return CUDA_SUCCESS;
    }
    rc = sim_ctx_valid(ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (t_ctx.depth == 0) t_ctx.depth = 1;
    t_ctx.stack[t_ctx.depth - 1] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = sim_ctx_top();
    return CUDA_SUCCESS;
}

static CUresult ctx_push(CUcontext ctx) {
    CUresult rc = sim_ctx_valid(ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (t_ctx.depth >= SIM_CTX_STACK) return CUDA_ERROR_OUT_OF_MEMORY;
    t_ctx.stack[t_ctx.depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) { return ctx_push(ctx); }
CUresult cuCtxPushCurrent_v2(CUcontext ctx) { return ctx_push(ctx); }

static CUresult ctx_pop(CUcontext *pctx) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (t_ctx.depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_ctx.stack[--t_ctx.depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext *pctx) { return ctx_pop(pctx); }
CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { return ctx_pop(pctx); }

CUresult cuCtxGetDevice(CUdevice *device) {
    struct CUctx_st *c;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *device = c->dev;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    return rc != CUDA_SUCCESS ? rc : sim_ctx_synchronize(c);
}

/* CUDA 13: the context is an argument; NULL means the current one. */
CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    struct CUctx_st *c = ctx;
    CUresult rc = ctx ? sim_ctx_valid(ctx) : sim_current(&c);
    if (rc == CUDA_SUCCESS) rc = sim_gpu_ok(c->phys);
    return rc != CUDA_SUCCESS ? rc : sim_ctx_synchronize(c);
}

CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
    struct CUctx_st *c = ctx;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = ctx ? sim_ctx_valid(ctx) : sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *device = c->dev;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = ctx;
    CUresult rc = ctx ? sim_ctx_valid(ctx) : sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *version = 3020; /* every context since CUDA 3.2 reports this */
    return CUDA_SUCCESS;
}

CUresult cuCtxGetFlags(unsigned int *flags) {
    struct CUctx_st *c;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    *flags = c->flags;
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult cuCtxSetFlags(unsigned int flags) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc == CUDA_SUCCESS) rc = check_flags(flags);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    c->flags = flags;
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId) {
    if (!ctxId) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = ctx;
    CUresult rc = ctx ? sim_ctx_valid(ctx) : sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *ctxId = c->id;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (leastPriority) *leastPriority = 0;
    if (greatestPriority) *greatestPriority = -5;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pvalue) return CUDA_ERROR_INVALID_VALUE;
    if ((int)limit < 0 || limit >= CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    sim_lock();
    *pvalue = g_limits[limit];
    sim_unlock();
    return CUDA_SUCCESS;
}

/* A context's device heap and printf FIFO are GPU memory: what they take beyond their
 * defaults is charged to the current context (CUDA_ERROR_OUT_OF_MEMORY when the GPU cannot
 * hold it, the old size kept) and goes with it. The limits themselves are the process's. */
static uint64_t beyond_default(CUlimit limit, size_t value) {
    static const size_t dflt[CU_LIMIT_MAX] = {[CU_LIMIT_PRINTF_FIFO_SIZE] = 1 << 20,
                                              [CU_LIMIT_MALLOC_HEAP_SIZE] = 8 << 20};
    if (limit != CU_LIMIT_PRINTF_FIFO_SIZE && limit != CU_LIMIT_MALLOC_HEAP_SIZE) return 0;
    return value > dflt[limit] ? value - dflt[limit] : 0;
}

CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)limit < 0 || limit >= CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    sim_lock();
    uint64_t before = beyond_default(limit, g_limits[limit]), after = beyond_default(limit, value);
    if (after > before && simgpu_mem_charge(c->phys, after - before) != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        uint64_t back = after < before ? before - after : 0;
        if (back > c->grown) back = c->grown; /* another context grew it: that one holds it */
        if (back) simgpu_mem_uncharge(c->phys, back);
        c->grown = c->grown - back + (after > before ? after - before : 0);
        g_limits[limit] = value;
    }
    sim_unlock();
    return rc;
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuCtxCreate)
SIM_SELF(cuCtxCreate_v2)
SIM_SELF(cuCtxCreate_v3)
SIM_SELF(cuCtxCreate_v4)
SIM_SELF(cuCtxDestroy)
SIM_SELF(cuCtxDestroy_v2)
SIM_SELF(cuCtxGetApiVersion)
SIM_SELF(cuCtxGetCurrent)
SIM_SELF(cuCtxGetDevice)
SIM_SELF(cuCtxGetDevice_v2)
SIM_SELF(cuCtxGetFlags)
SIM_SELF(cuCtxGetId)
SIM_SELF(cuCtxGetLimit)
SIM_SELF(cuCtxGetStreamPriorityRange)
SIM_SELF(cuCtxPopCurrent)
SIM_SELF(cuCtxPopCurrent_v2)
SIM_SELF(cuCtxPushCurrent)
SIM_SELF(cuCtxPushCurrent_v2)
SIM_SELF(cuCtxSetCurrent)
SIM_SELF(cuCtxSetFlags)
SIM_SELF(cuCtxSetLimit)
SIM_SELF(cuCtxSynchronize)
SIM_SELF(cuCtxSynchronize_v2)
SIM_SELF(cuDevicePrimaryCtxGetState)
SIM_SELF(cuDevicePrimaryCtxRelease)
SIM_SELF(cuDevicePrimaryCtxRelease_v2)
SIM_SELF(cuDevicePrimaryCtxReset)
SIM_SELF(cuDevicePrimaryCtxReset_v2)
SIM_SELF(cuDevicePrimaryCtxRetain)
SIM_SELF(cuDevicePrimaryCtxSetFlags)
SIM_SELF(cuDevicePrimaryCtxSetFlags_v2)
