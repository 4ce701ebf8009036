/* Graphs: built node by node or captured from a stream, instantiated, launched.
 *
 * Only kernel (and empty) nodes are modelled. Dependencies are accepted and checked but a
 * launch runs the kernels one after another in the order they were added, each taking its
 * turn on the GPU timeline like a launch of its own. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

struct CUgraphNode_st {
    uint32_t magic;
    struct CUgraph_st *graph;
    int kernel;       /* 0: an empty node */
    uint64_t dur_ns;  /* fixed when added: the parameters are copied then, as on the real driver */
    struct sim_graph_alloc alloc; /* a memory allocation node (cuda_graphmem.c); else zero */
};

struct CUgraph_st {
    struct sim_link link; /* first: see cuda_internal.h */
    uint32_t magic;
    size_t n, cap;
    struct CUgraphNode_st **nodes;
};

struct CUgraphExec_st {
    struct sim_link link;
    uint32_t magic;
    size_t n;
    uint64_t *dur_ns; /* the kernels, in order */
    struct sim_graph_alloc mem; /* its allocation nodes' memory, held from its first launch or upload */
};

static CUresult graph_valid(const struct CUgraph_st *g) {
    return g && g->magic == SIM_GRAPH_MAGIC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Both with sim_lock held. */
static struct CUgraph_st *graph_new_locked(void) {
    struct CUgraph_st *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->magic = SIM_GRAPH_MAGIC;
    sim_link_add_locked(&g->link);
    return g;
}

static void graph_free_locked(struct CUgraph_st *g) {
    sim_link_del_locked(&g->link);
    for (size_t i = 0; i < g->n; i++) {
        g->nodes[i]->magic = 0;
        sim_graph_alloc_node_free(&g->nodes[i]->alloc);
        free(g->nodes[i]);
    }
    free(g->nodes);
    g->magic = 0;
    free(g);
}

static struct CUgraphNode_st *node_add(struct CUgraph_st *g, int kernel, uint64_t dur_ns) {
    if (g->n == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 16;
        struct CUgraphNode_st **v = realloc(g->nodes, cap * sizeof *v);
        if (!v) return NULL;
        g->nodes = v;
        g->cap = cap;
    }
    struct CUgraphNode_st *nd = calloc(1, sizeof *nd);
    if (!nd) return NULL;
    *nd = (struct CUgraphNode_st){.magic = SIM_NODE_MAGIC, .graph = g, .kernel = kernel, .dur_ns = dur_ns};
    g->nodes[g->n++] = nd;
    return nd;
}

CUresult sim_capture_kernel_locked(struct CUstream_st *s, struct CUfunc_st *f, uint64_t dur_ns) {
    (void)f;
    if (s->capture_invalid) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return node_add(s->capture, 1, dur_ns) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* --- stream capture ---------------------------------------------------------------------- */

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
        mode != CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && s->kind == SIM_STREAM_LEGACY) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else if (rc == CUDA_SUCCESS && s->capture) rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS) {
        s->capture = graph_new_locked();
        s->capture_invalid = 0;
        if (!s->capture) rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamBeginCapture(CUstream h) { return begin_capture(h, CU_STREAM_CAPTURE_MODE_GLOBAL, 0); }
CUresult cuStreamBeginCapture_ptsz(CUstream h) { return begin_capture(h, CU_STREAM_CAPTURE_MODE_GLOBAL, 1); }
CUresult cuStreamBeginCapture_v2(CUstream h, CUstreamCaptureMode mode) { return begin_capture(h, mode, 0); }
CUresult cuStreamBeginCapture_v2_ptsz(CUstream h, CUstreamCaptureMode mode) { return begin_capture(h, mode, 1); }

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && !s->capture) rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS) {
        struct CUgraph_st *g = s->capture;
        s->capture = NULL;
        if (s->capture_invalid) {
            graph_free_locked(g);
            *phGraph = NULL;
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        } else {
            *phGraph = g;
        }
        s->capture_invalid = 0;
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamEndCapture(CUstream h, CUgraph *phGraph) { return end_capture(h, phGraph, 0); }
CUresult cuStreamEndCapture_ptsz(CUstream h, CUgraph *phGraph) { return end_capture(h, phGraph, 1); }

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *status, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS)
        *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                  : s->capture_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                       : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    sim_unlock();
    return rc;
}

CUresult cuStreamIsCapturing(CUstream h, CUstreamCaptureStatus *s) { return is_capturing(h, s, 0); }
CUresult cuStreamIsCapturing_ptsz(CUstream h, CUstreamCaptureStatus *s) { return is_capturing(h, s, 1); }

/* --- building graphs --------------------------------------------------------------------- */

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!phGraph || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    *phGraph = graph_new_locked();
    sim_unlock();
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuGraphDestroy(CUgraph hGraph) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = graph_valid(hGraph);
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    graph_free_locked(hGraph);
    sim_unlock();
    return CUDA_SUCCESS;
}

static CUresult add_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps, struct CUfunc_st *f,
                         const unsigned int *grid, const unsigned int *block, void **params, void **extra) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = graph_valid(g);
    if (rc != CUDA_SUCCESS) return rc;
    if (!ph || (ndeps && !deps)) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < ndeps; i++)
        if (!deps[i] || deps[i]->magic != SIM_NODE_MAGIC || deps[i]->graph != g) return CUDA_ERROR_INVALID_VALUE;
    uint64_t dur = 0;
    if (f) {
        if (f->magic != SIM_FUNC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
        for (int i = 0; i < 3; i++)
            if (!grid[i] || !block[i]) return CUDA_ERROR_INVALID_VALUE;
        rc = sim_launch_duration(f, params, extra, &dur);
        if (rc != CUDA_SUCCESS) return rc;
    }
    struct CUgraphNode_st *nd = node_add(g, f != NULL, dur);
    if (!nd) return CUDA_ERROR_OUT_OF_MEMORY;
    *ph = nd;
    return CUDA_SUCCESS;
}

CUresult cuGraphAddKernelNode_v2(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                 const CUDA_KERNEL_NODE_PARAMS *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    struct CUfunc_st *f = p->func ? p->func : (struct CUfunc_st *)(void *)p->kern;
    if (!f) return CUDA_ERROR_INVALID_VALUE;
    unsigned int grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ};
    unsigned int block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
    return add_node(ph, g, deps, ndeps, f, grid, block, p->kernelParams, p->extra);
}

CUresult cuGraphAddKernelNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                              const CUDA_KERNEL_NODE_PARAMS_v1 *p) {
    if (!p || !p->func) return CUDA_ERROR_INVALID_VALUE;
    unsigned int grid[3] = {p->gridDimX, p->gridDimY, p->gridDimZ};
    unsigned int block[3] = {p->blockDimX, p->blockDimY, p->blockDimZ};
    return add_node(ph, g, deps, ndeps, p->func, grid, block, p->kernelParams, p->extra);
}

CUresult cuGraphAddEmptyNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps) {
    return add_node(ph, g, deps, ndeps, NULL, NULL, NULL, NULL, NULL);
}

/* An empty node that carries an allocation (cuda_graphmem.c fills it in). */
CUresult sim_graph_add_alloc_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                  const struct sim_graph_alloc *alloc) {
    CUresult rc = add_node(ph, g, deps, ndeps, NULL, NULL, NULL, NULL, NULL);
    if (rc == CUDA_SUCCESS) (*ph)->alloc = *alloc;
    return rc;
}

CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = graph_valid(hGraph);
    if (rc != CUDA_SUCCESS) return rc;
    if (!numNodes) return CUDA_ERROR_INVALID_VALUE;
    if (nodes) {
        for (size_t i = 0; i < *numNodes; i++) nodes[i] = i < hGraph->n ? hGraph->nodes[i] : NULL;
        if (*numNodes > hGraph->n) *numNodes = hGraph->n;
    } else {
        *numNodes = hGraph->n;
    }
    return CUDA_SUCCESS;
}

/* --- executable graphs ------------------------------------------------------------------- */

static CUresult instantiate(CUgraphExec *ph, CUgraph g, unsigned long long flags) {
    CUresult rc = sim_ready();
    if (rc == CUDA_SUCCESS) rc = graph_valid(g);
    if (rc != CUDA_SUCCESS) return rc;
    unsigned long long known = CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD |
                               CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
    if (!ph || (flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
    struct CUgraphExec_st *x = calloc(1, sizeof *x);
    uint64_t *d = calloc(g->n ? g->n : 1, sizeof *d);
    if (!x || !d) {
        free(x);
        free(d);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    x->magic = SIM_EXEC_MAGIC;
    x->dur_ns = d;
    sim_lock();
    sim_link_add_locked(&x->link);
    sim_unlock();
    for (size_t i = 0; i < g->n; i++) {
        if (g->nodes[i]->kernel) x->dur_ns[x->n++] = g->nodes[i]->dur_ns;
        sim_graph_alloc_add(&x->mem, &g->nodes[i]->alloc);
    }
    *ph = x;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    return instantiate(phGraphExec, hGraph, flags);
}

static CUresult instantiate_legacy(CUgraphExec *ph, CUgraph g, CUgraphNode *err, char *log, size_t size) {
    if (err) *err = NULL;
    if (log && size) log[0] = 0;
    return instantiate(ph, g, 0);
}

CUresult cuGraphInstantiate(CUgraphExec *ph, CUgraph g, CUgraphNode *err, char *log, size_t size) {
    return instantiate_legacy(ph, g, err, log, size);
}
CUresult cuGraphInstantiate_v2(CUgraphExec *ph, CUgraph g, CUgraphNode *err, char *log, size_t size) {
    return instantiate_legacy(ph, g, err, log, size);
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!hGraphExec || hGraphExec->magic != SIM_EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    hGraphExec->magic = 0;
    sim_link_del_locked(&hGraphExec->link);
    sim_graph_alloc_unmap_locked(&hGraphExec->mem);
    sim_unlock();
    free(hGraphExec->dur_ns);
    free(hGraphExec);
    return CUDA_SUCCESS;
}

/* An upload makes the executable's allocations resident as its first launch would, and runs
 * nothing: a later launch finds them there. A stream being captured is refused (simgpu's
 * choice: an upload is not a capturable operation). */
static CUresult upload_locked(CUgraphExec x, CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && s->capture) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (rc == CUDA_SUCCESS) rc = sim_graph_alloc_map_locked(&x->mem);
    return rc;
}

static CUresult graph_upload(CUgraphExec x, CUstream h, int ptds) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!x || x->magic != SIM_EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    rc = upload_locked(x, h, ptds);
    sim_unlock();
    return rc;
}

CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) { return graph_upload(hGraphExec, hStream, 0); }
CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream) { return graph_upload(hGraphExec, hStream, 1); }

/* With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the new executable is uploaded into hUploadStream;
 * when that fails (out of memory, like a launch) nothing is instantiated and result_out says
 * CUDA_GRAPH_INSTANTIATE_ERROR: the reason is the return value. */
static CUresult instantiate_params(CUgraphExec *ph, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p, int ptds) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    p->hErrNode_out = NULL;
    CUgraphExec x = NULL;
    CUresult rc = instantiate(&x, g, p->flags);
    if (rc == CUDA_SUCCESS && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) {
        sim_lock();
        rc = upload_locked(x, p->hUploadStream, ptds);
        sim_unlock();
        if (rc != CUDA_SUCCESS) cuGraphExecDestroy(x);
    }
    p->result_out = rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    if (rc == CUDA_SUCCESS) *ph = x;
    return rc;
}

CUresult cuGraphInstantiateWithParams(CUgraphExec *ph, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    return instantiate_params(ph, g, p, 0);
}
CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *ph, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p) {
    return instantiate_params(ph, g, p, 1);
}

static CUresult graph_launch(CUgraphExec x, CUstream h, int ptds) {
    struct CUctx_st *c;
    struct CUstream_st *s;
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!x || x->magic != SIM_EXEC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && !s->capture) rc = sim_graph_alloc_map_locked(&x->mem);
    for (size_t i = 0; rc == CUDA_SUCCESS && i < x->n; i++)
        rc = s->capture ? sim_capture_kernel_locked(s, NULL, x->dur_ns[i]) : sim_submit_kernel_locked(c, s, x->dur_ns[i]);
    sim_unlock();
    return rc;
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) { return graph_launch(hGraphExec, hStream, 0); }
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) { return graph_launch(hGraphExec, hStream, 1); }

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuGraphAddEmptyNode)
SIM_SELF(cuGraphAddKernelNode)
SIM_SELF(cuGraphAddKernelNode_v2)
SIM_SELF(cuGraphCreate)
SIM_SELF(cuGraphDestroy)
SIM_SELF(cuGraphExecDestroy)
SIM_SELF(cuGraphGetNodes)
SIM_SELF(cuGraphInstantiate)
SIM_SELF(cuGraphInstantiateWithFlags)
SIM_SELF(cuGraphInstantiateWithParams)
SIM_SELF(cuGraphInstantiateWithParams_ptsz)
SIM_SELF(cuGraphInstantiate_v2)
SIM_SELF(cuGraphLaunch)
SIM_SELF(cuGraphLaunch_ptsz)
SIM_SELF(cuGraphUpload)
SIM_SELF(cuGraphUpload_ptsz)
SIM_SELF(cuStreamBeginCapture)
SIM_SELF(cuStreamBeginCapture_ptsz)
SIM_SELF(cuStreamBeginCapture_v2)
SIM_SELF(cuStreamBeginCapture_v2_ptsz)
SIM_SELF(cuStreamEndCapture)
SIM_SELF(cuStreamEndCapture_ptsz)
SIM_SELF(cuStreamIsCapturing)
SIM_SELF(cuStreamIsCapturing_ptsz)
