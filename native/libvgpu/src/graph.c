/* Graph memory: what allocation nodes (cuGraphAddMemAllocNode, or allocations captured from
 * a stream) hold. The driver gives an executable graph its allocations' memory when it is
 * launched and keeps it for its next launches, in the device's graph memory, which it reports
 * per process (cuDeviceGetGraphMemAttribute, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT). So the
 * device's graph memory is charged like a pool's reservation:
 * - an explicit allocation node's size is remembered with its graph, and with each executable
 *   graph instantiated from it; whatever first makes the driver give that executable its
 *   memory (its first launch, cuGraphUpload, or cuGraphInstantiateWithParams with
 *   CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) reserves it in the region first (refused over the
 *   limit, after trimming the container's pools and graph memory: the call then fails with
 *   CUDA_ERROR_OUT_OF_MEMORY and the driver is not called);
 * - after every launch the device's graph memory is read and the charge follows it: growth
 *   the shim could not know beforehand (allocations captured from a stream, on a real driver)
 *   is charged after the fact (if the limit cannot take it, the container goes over by that
 *   much and its next allocations are refused until it is back under);
 * - destroying an executable graph reads it again and gives back what the driver released.
 * Nothing costs a launch until the process has made a graph allocation. */
#include "shim.h"

#define NEED VGPU_NEED

static struct {
    pthread_mutex_t mu;
    uint64_t charged[VGPU_MAX_ORDINALS]; /* the device's graph memory, as last charged */
} g_gm = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int graph_reserved(int ordinal, uint64_t *out) {
    cuuint64_t v = 0;
    if (!vgpu.real.cuDeviceGetGraphMemAttribute ||
        vgpu.real.cuDeviceGetGraphMemAttribute(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *out = v;
    return 0;
}

/* Bring d's graph memory charge to what the driver holds; `pre` bytes were reserved for it
 * beforehand and are settled here too. g_gm.mu held. */
static void settle_locked(struct vgpu_dev *d, uint64_t pre) {
    uint64_t now;
    uint64_t *charged = &g_gm.charged[d->ordinal];
    if (graph_reserved(d->ordinal, &now) != 0) now = *charged + pre; /* cannot tell: keep it */
    if (now <= *charged) {
        vgpu_rollback(d, pre);
        vgpu_uncharge(d, *charged - now);
    } else if (now - *charged <= pre) {
        vgpu_commit(d, now - *charged);
        vgpu_rollback(d, pre - (now - *charged));
    } else {
        vgpu_commit(d, pre);
        uint64_t extra = now - *charged - pre;
        if (vgpu_charge(d, extra) == CUDA_SUCCESS) {
            vgpu_commit(d, extra);
        } else if (d->accounted) {
            VLOG(VGPU_LOG_WARN, "graphs on GPU %s took %llu bytes more than the limit leaves: "
                 "charged, the container is over its limit until they are freed", d->uuid,
                 (unsigned long long)extra);
            vgpu_region_force(vgpu.region, d->rdev, extra);
        }
    }
    *charged = now;
}

void vgpu_graphs_settle(void) {
    if (!__atomic_load_n(&vgpu.graph_mem, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_gm.mu);
    for (int o = 0; o < VGPU_MAX_ORDINALS; o++) {
        struct vgpu_dev *d = g_gm.charged[o] ? vgpu_dev(o) : NULL;
        if (d) settle_locked(d, 0);
    }
    pthread_mutex_unlock(&g_gm.mu);
}

VGPU_API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                         size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    NEED(cuGraphAddMemAllocNode);
    CUresult rc = vgpu.real.cuGraphAddMemAllocNode(phGraphNode, hGraph, dependencies, numDependencies, nodeParams);
    if (rc != CUDA_SUCCESS || !vgpu.limited || !nodeParams ||
        nodeParams->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return rc;
    __atomic_store_n(&vgpu.graph_mem, 1, __ATOMIC_RELEASE);
    struct vgpu_rec r;
    uint64_t key = (uint64_t)(uintptr_t)hGraph;
    uint64_t had = vgpu_tab_take(VGPU_OBJ_GRAPH, key, &r) ? r.bytes : 0;
    vgpu_tab_put(VGPU_OBJ_GRAPH, key, nodeParams->poolProps.location.id, had + nodeParams->bytesize, NULL);
    return rc;
}

/* An executable graph remembers its graph's allocation nodes (refs 0: not launched yet). */
static CUresult instantiated(CUresult rc, CUgraphExec *ph, CUgraph g) {
    struct vgpu_rec r;
    if (rc == CUDA_SUCCESS && vgpu.limited && ph && vgpu_tab_get(VGPU_OBJ_GRAPH, (uint64_t)(uintptr_t)g, &r)) {
        struct vgpu_rec x = {.key = (uint64_t)(uintptr_t)*ph, .bytes = r.bytes, .ordinal = r.ordinal,
                             .kind = VGPU_OBJ_EXEC, .refs = 0};
        vgpu_tab_put_rec(&x);
    }
    return rc;
}

VGPU_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    NEED(cuGraphInstantiateWithFlags);
    return instantiated(vgpu.real.cuGraphInstantiateWithFlags(phGraphExec, hGraph, flags), phGraphExec, hGraph);
}

VGPU_API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                     char *logBuffer, size_t bufferSize) {
    NEED(cuGraphInstantiate);
    return instantiated(vgpu.real.cuGraphInstantiate(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize),
                        phGraphExec, hGraph);
}

VGPU_API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                        char *logBuffer, size_t bufferSize) {
    NEED(cuGraphInstantiate_v2);
    return instantiated(vgpu.real.cuGraphInstantiate_v2(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize),
                        phGraphExec, hGraph);
}

/* Reserve `bytes` of graph memory on d before the driver gives them; trims what the graphs
 * and pools of this process no longer use before refusing. */
static CUresult reserve(struct vgpu_dev *d, uint64_t bytes) {
    if (vgpu_charge(d, bytes) == CUDA_SUCCESS) return CUDA_SUCCESS;
    if (vgpu.real.cuDeviceGraphMemTrim) vgpu.real.cuDeviceGraphMemTrim(d->ordinal);
    vgpu_graphs_settle();
    return vgpu_charge(d, bytes);
}

static void settle(struct vgpu_dev *d, uint64_t pre) {
    pthread_mutex_lock(&g_gm.mu);
    settle_locked(d, pre);
    pthread_mutex_unlock(&g_gm.mu);
}

/* The driver gave executable x its memory (launched or uploaded): its record says so (refs 1),
 * so that nothing reserves it again; the memory is the device's graph memory now. */
static void given(CUgraphExec x) {
    struct vgpu_rec r;
    if (vgpu_tab_take(VGPU_OBJ_EXEC, (uint64_t)(uintptr_t)x, &r)) {
        r.refs = 1;
        vgpu_tab_restore(&r);
    }
}

/* Instantiated with its memory given (uploaded), marked so at once. */
static CUresult instantiate_uploaded(CUgraphExec *ph, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p, int ptsz,
                                     __typeof__(cuGraphInstantiateWithParams) *real) {
    struct vgpu_rec r;
    CUcontext ctx;
    uint64_t pre = 0;
    int known = vgpu_tab_get(VGPU_OBJ_GRAPH, (uint64_t)(uintptr_t)g, &r) && r.bytes;
    /* Without known allocations, the upload stream's device: what it gives is charged after. */
    struct vgpu_dev *d = known ? vgpu_dev(r.ordinal) : vgpu_stream_dev(p->hUploadStream, ptsz, &ctx);
    if (!d) return instantiated(real(ph, g, p), ph, g);
    if (known) {
        if (reserve(d, r.bytes) != CUDA_SUCCESS) {
            p->hErrNode_out = NULL;
            p->result_out = CUDA_GRAPH_INSTANTIATE_ERROR; /* the reason is the return value */
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        pre = r.bytes;
    }
    CUresult rc = instantiated(real(ph, g, p), ph, g);
    if (rc == CUDA_SUCCESS) given(*ph);
    settle(d, pre);
    return rc;
}

static CUresult instantiate_params(CUgraphExec *ph, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p, int ptsz,
                                   __typeof__(cuGraphInstantiateWithParams) *real) {
    if (p && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) && ph &&
        __atomic_load_n(&vgpu.graph_mem, __ATOMIC_ACQUIRE))
        return instantiate_uploaded(ph, g, p, ptsz, real);
    return instantiated(real(ph, g, p), ph, g);
}

VGPU_API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                               CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    NEED(cuGraphInstantiateWithParams);
    return instantiate_params(phGraphExec, hGraph, instantiateParams, 0, vgpu.real.cuGraphInstantiateWithParams);
}

VGPU_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                    CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    NEED(cuGraphInstantiateWithParams_ptsz);
    return instantiate_params(phGraphExec, hGraph, instantiateParams, 1,
                              vgpu.real.cuGraphInstantiateWithParams_ptsz);
}

/* An upload gives the executable its memory as a first launch does, and runs nothing. */
VGPU_API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    NEED(cuGraphUpload);
    if (!__atomic_load_n(&vgpu.graph_mem, __ATOMIC_ACQUIRE)) return vgpu.real.cuGraphUpload(hGraphExec, hStream);
    return vgpu_graph_launch(hGraphExec, hStream, 0, vgpu.real.cuGraphUpload);
}

VGPU_API CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    NEED(cuGraphUpload_ptsz);
    if (!__atomic_load_n(&vgpu.graph_mem, __ATOMIC_ACQUIRE))
        return vgpu.real.cuGraphUpload_ptsz(hGraphExec, hStream);
    return vgpu_graph_launch(hGraphExec, hStream, 1, vgpu.real.cuGraphUpload_ptsz);
}

VGPU_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec) {
    NEED(cuGraphExecDestroy);
    CUresult rc = vgpu.real.cuGraphExecDestroy(hGraphExec);
    struct vgpu_rec r;
    if (rc == CUDA_SUCCESS && vgpu.limited) {
        vgpu_tab_take(VGPU_OBJ_EXEC, (uint64_t)(uintptr_t)hGraphExec, &r);
        vgpu_graphs_settle();
    }
    return rc;
}

/* A launch, or an upload (`launch` is then the driver's cuGraphUpload): the same charge. */
CUresult vgpu_graph_launch(CUgraphExec x, CUstream s, int ptsz, CUresult (*launch)(CUgraphExec, CUstream)) {
    struct vgpu_rec r;
    CUcontext ctx;
    uint64_t key = (uint64_t)(uintptr_t)x, pre = 0;
    int first = vgpu_tab_get(VGPU_OBJ_EXEC, key, &r) && !r.refs && r.bytes;
    struct vgpu_dev *d = first ? vgpu_dev(r.ordinal) : vgpu_stream_dev(s, ptsz, &ctx);
    if (!d) return launch(x, s);
    if (first) {
        if (reserve(d, r.bytes) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
        pre = r.bytes;
    }
    CUresult rc = launch(x, s);
    if (rc == CUDA_SUCCESS && first) given(x);
    settle(d, pre);
    return rc;
}
