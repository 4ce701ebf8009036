/* Context-local storage for NVIDIA's runtime (export table c693336e-...): the runtime keeps its
 * per-context state under a key in each context, and registers a destructor the driver calls
 * when the context goes (cuCtxDestroy, cuDevicePrimaryCtxReset, the last primary release). */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_internal.h"

struct sim_cls {
    void *key, *value;
    sim_cls_dtor dtor;
    struct sim_cls *next;
};

/* NULL means the calling thread's current context. */
static CUresult resolve(CUcontext ctx, struct CUctx_st **out) {
    if (!ctx) return sim_current(out);
    CUresult rc = sim_ctx_valid(ctx);
    if (rc == CUDA_SUCCESS) *out = ctx;
    return rc;
}

CUresult sim_cls_put(CUcontext ctx, void *key, void *value, sim_cls_dtor dtor) {
    struct CUctx_st *c;
    CUresult rc = resolve(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_cls *e = c->cls;
    while (e && e->key != key) e = e->next;
    if (!e && (e = calloc(1, sizeof *e)) != NULL) {
        e->key = key;
        e->next = c->cls;
        c->cls = e;
    }
    if (e) {
        e->value = value;
        e->dtor = dtor;
    }
    sim_unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult sim_cls_delete(CUcontext ctx, void *key) {
    struct CUctx_st *c;
    CUresult rc = resolve(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_cls **link = &c->cls;
    while (*link && (*link)->key != key) link = &(*link)->next;
    struct sim_cls *e = *link;
    if (e) *link = e->next;
    sim_unlock();
    free(e);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_cls_get(void **value, CUcontext ctx, void *key) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = resolve(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct sim_cls *e = c->cls;
    while (e && e->key != key) e = e->next;
    if (e) *value = e->value;
    sim_unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* The caller holds no lock: destructors call back into the driver. */
void sim_cls_destroy(struct CUctx_st *ctx) {
    sim_lock();
    struct sim_cls *list = ctx->cls;
    ctx->cls = NULL;
    sim_unlock();
    while (list) {
        struct sim_cls *e = list;
        list = e->next;
        if (e->dtor) e->dtor(ctx, e->key, e->value);
        free(e);
    }
}
