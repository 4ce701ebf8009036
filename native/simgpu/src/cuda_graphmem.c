/* Graph memory: allocation nodes (cuGraphAddMemAllocNode) and what they hold.
 *
 * As on the real driver, adding an allocation node fixes its address and holds no memory; an
 * executable graph gets its allocation nodes' memory when it is first launched (charged on the
 * node then, CUDA_ERROR_OUT_OF_MEMORY when the GPU cannot hold it) and keeps it until it is
 * destroyed, whatever its free nodes say (the driver keeps it for the graph's next launch).
 * cuDeviceGetGraphMemAttribute reports the process's graph memory per device. The address range
 * is reserved, never accessible: simulated kernels do not touch memory. */
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_internal.h"

static struct {
    uint64_t reserved[SIMGPU_MAX_GPUS]; /* graph memory held, per CUDA ordinal (sim_lock) */
    uint64_t high[SIMGPU_MAX_GPUS];
} g_gmem;

void sim_graph_alloc_add(struct sim_graph_alloc *exec, const struct sim_graph_alloc *node) {
    if (!node->bytes) return;
    exec->dev = node->dev; /* one device per graph: what the tests and frameworks use */
    exec->bytes += node->bytes;
}

void sim_graph_alloc_node_free(struct sim_graph_alloc *node) {
    if (node->va) munmap(node->va, node->va_len);
    node->va = NULL;
}

CUresult sim_graph_alloc_map_locked(struct sim_graph_alloc *x) {
    if (!x->bytes || x->mapped) return CUDA_SUCCESS;
    if (simgpu_mem_charge(sim_proc.phys[x->dev], x->bytes) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    x->mapped = 1;
    g_gmem.reserved[x->dev] += x->bytes;
    g_gmem.high[x->dev] = sim_max64(g_gmem.high[x->dev], g_gmem.reserved[x->dev]);
    return CUDA_SUCCESS;
}

void sim_graph_alloc_unmap_locked(struct sim_graph_alloc *x) {
    if (!x->mapped) return;
    simgpu_mem_uncharge(sim_proc.phys[x->dev], x->bytes);
    g_gmem.reserved[x->dev] -= x->bytes;
    x->mapped = 0;
}

CUresult cuGraphAddMemAllocNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!p || !p->bytesize || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        p->poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_device(p->poolProps.location.id, NULL) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), len = (p->bytesize + pg - 1) / pg * pg;
    void *va = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_graph_alloc a = {.bytes = p->bytesize, .dev = p->poolProps.location.id, .va = va, .va_len = len};
    rc = sim_graph_add_alloc_node(ph, g, deps, ndeps, &a); /* graphs are built unlocked */
    if (rc != CUDA_SUCCESS) munmap(va, len);
    else p->dptr = (CUdeviceptr)(uintptr_t)va;
    return rc;
}

/* The memory stays with the executable graph (see above): a free node orders, holds nothing. */
CUresult cuGraphAddMemFreeNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps, CUdeviceptr dptr) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    static const struct sim_graph_alloc none;
    return sim_graph_add_alloc_node(ph, g, deps, ndeps, &none);
}

CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, CUgraphMem_attribute attr, void *value) {
    CUresult rc = sim_device(dev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    uint64_t v = attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT || attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
                     ? g_gmem.reserved[dev]
                     : g_gmem.high[dev];
    sim_unlock();
    if ((int)attr < 0 || attr > CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH) return CUDA_ERROR_INVALID_VALUE;
    *(cuuint64_t *)value = v;
    return CUDA_SUCCESS;
}

/* What live executable graphs hold stays: there is nothing cached to trim. */
CUresult cuDeviceGraphMemTrim(CUdevice dev) { return sim_device(dev, NULL); }

SIM_SELF(cuDeviceGetGraphMemAttribute)
SIM_SELF(cuDeviceGraphMemTrim)
SIM_SELF(cuGraphAddMemAllocNode)
SIM_SELF(cuGraphAddMemFreeNode)
