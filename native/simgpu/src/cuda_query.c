/* Queries runtimes make and the simulator answers from what it knows: pointer attributes in
 * bulk, occupancy, kernel attributes, the module loading mode, stream-capture state. */
#include <string.h>

#include "cuda_internal.h"

/* --- pointers ---------------------------------------------------------------------------- */

/* Unlike cuPointerGetAttribute, memory the driver does not know is no error: its attributes
 * read as empty (memory type 0, NULL context, ...), as the driver documents. */
CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                CUdeviceptr ptr) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!numAttributes || !attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    int known = sim_range_find((uintptr_t)ptr) != NULL;
    sim_unlock();
    for (unsigned int i = 0; i < numAttributes; i++) {
        if (!data[i]) return CUDA_ERROR_INVALID_VALUE;
        if (known && sim_pointer_attribute(data[i], attributes[i], ptr) == CUDA_SUCCESS) continue;
        switch (attributes[i]) {
        case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data[i] = NULL; break;
        case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_HOST_POINTER: *(void **)data[i] = NULL; break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data[i] = -2; break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data[i] = 0; break;
        case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *(CUmemoryPool *)data[i] = NULL; break;
        default: *(int *)data[i] = 0; /* flags and booleans */
        }
    }
    return CUDA_SUCCESS;
}

/* --- occupancy: an H100-class SM (2048 threads, 32 blocks, 228 KiB shared memory) ---------- */

static CUresult func_ok(CUfunction f) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    return f && f->magic == SIM_FUNC_MAGIC ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static int blocks_per_sm(int block_size, size_t smem) {
    if (block_size <= 0 || block_size > 1024) return 0;
    int warps = (block_size + 31) / 32;
    int n = 64 / warps; /* 64 resident warps */
    if (n > 32) n = 32;
    if (smem) {
        size_t by_smem = 233472 / (smem + 1024); /* 1 KiB reserved per block */
        if ((size_t)n > by_smem) n = (int)by_smem;
    }
    return n;
}

static CUresult max_active(int *numBlocks, CUfunction func, int blockSize, size_t smem) {
    CUresult rc = func_ok(func);
    if (rc != CUDA_SUCCESS) return rc;
    if (!numBlocks || blockSize <= 0) return CUDA_ERROR_INVALID_VALUE;
    *numBlocks = blocks_per_sm(blockSize, smem);
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func, int blockSize,
                                                     size_t dynamicSMemSize) {
    return max_active(numBlocks, func, blockSize, dynamicSMemSize);
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction func, int blockSize,
                                                              size_t dynamicSMemSize, unsigned int flags) {
    (void)flags;
    return max_active(numBlocks, func, blockSize, dynamicSMemSize);
}

static CUresult potential_block(int *minGrid, int *blockSize, CUfunction func, CUoccupancyB2DSize b2d, size_t smem,
                                int limit) {
    CUresult rc = func_ok(func);
    if (rc != CUDA_SUCCESS) return rc;
    if (!minGrid || !blockSize) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    int best = 0, best_threads = 0;
    for (int bs = 32; bs <= 1024 && (limit <= 0 || bs <= limit); bs += 32) {
        int n = blocks_per_sm(bs, b2d ? b2d(bs) : smem);
        if (n * bs > best_threads) best_threads = n * bs, best = bs;
    }
    if (!best) return CUDA_ERROR_INVALID_VALUE;
    *blockSize = best;
    *minGrid = blocks_per_sm(best, b2d ? b2d(best) : smem) * (int)simgpu_node()->gpus[c->phys].cfg.sm_count;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction func,
                                          CUoccupancyB2DSize blockSizeToDynamicSMemSize, size_t dynamicSMemSize,
                                          int blockSizeLimit) {
    return potential_block(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit);
}

CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction func,
                                                   CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                   size_t dynamicSMemSize, int blockSizeLimit, unsigned int flags) {
    (void)flags;
    return potential_block(minGridSize, blockSize, func, blockSizeToDynamicSMemSize, dynamicSMemSize, blockSizeLimit);
}

CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction func, int numBlocks,
                                                 int blockSize) {
    CUresult rc = func_ok(func);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dynamicSmemSize || numBlocks <= 0 || blockSize <= 0 || blocks_per_sm(blockSize, 0) < numBlocks)
        return CUDA_ERROR_INVALID_VALUE;
    size_t per = 233472 / (size_t)numBlocks - 1024;
    *dynamicSmemSize = per > 232448 ? 232448 : per;
    return CUDA_SUCCESS;
}

/* Clusters: up to 8 blocks, the portable limit (16 with the non-portable attribute). */
CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction func, const CUlaunchConfig *config) {
    CUresult rc = func_ok(func);
    if (rc != CUDA_SUCCESS) return rc;
    if (!clusterSize || !config) return CUDA_ERROR_INVALID_VALUE;
    *clusterSize = 8;
    return CUDA_SUCCESS;
}

/* Clusters live inside one GPC (graphics processing cluster): an H100-like layout of GPCs of
 * SIM_GPC_SMS SMs (the last one smaller). How many clusters of the launch's size fit at once,
 * each block taking its SM's share by the launch's block size and shared memory; none above 16
 * blocks (the non-portable limit). Libraries probe sizes 1..N to
 * learn the GPCs (cuBLAS does, at cublasCreate) and need the count to fall with the size. */
#define SIM_GPC_SMS 16u
#define SIM_CLUSTER_MAX 16u

CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config) {
    CUresult rc = func_ok(func);
    if (rc != CUDA_SUCCESS) return rc;
    if (!numClusters || !config || (config->numAttrs && !config->attrs)) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    rc = sim_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t size = 1;
    for (unsigned int i = 0; i < config->numAttrs; i++)
        if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) {
            const CUlaunchAttributeValue *v = &config->attrs[i].value;
            size = (uint64_t)v->clusterDim.x * v->clusterDim.y * v->clusterDim.z;
        }
    if (size == 0) return CUDA_ERROR_INVALID_CLUSTER_SIZE;
    if (size > SIM_CLUSTER_MAX) { /* none can run: no GPC holds it */
        *numClusters = 0;
        return CUDA_SUCCESS;
    }
    int per_sm = blocks_per_sm((int)(config->blockDimX * config->blockDimY * config->blockDimZ), config->sharedMemBytes);
    unsigned int sms = simgpu_node()->gpus[c->phys].cfg.sm_count;
    uint64_t n = 0;
    for (unsigned int done = 0; done < sms; done += SIM_GPC_SMS) {
        unsigned int in_gpc = sms - done < SIM_GPC_SMS ? sms - done : SIM_GPC_SMS;
        n += (uint64_t)in_gpc * (uint64_t)per_sm / size;
    }
    *numClusters = n > INT32_MAX ? INT32_MAX : (int)n;
    return CUDA_SUCCESS;
}

/* --- kernels and modules ------------------------------------------------------------------ */

/* The hidden alias (cuda_internal.h, SIM_SELF): an interposer's cuFuncGetAttribute is not ours. */
extern __typeof__(cuFuncGetAttribute) sim_self_cuFuncGetAttribute SIM_HIDDEN;

/* A CUkernel is the same object as a CUfunction here (cuda_exec.c); every device answers alike. */
CUresult cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev) {
    CUresult rc = sim_device(dev, NULL);
    return rc != CUDA_SUCCESS ? rc : sim_self_cuFuncGetAttribute(pi, attrib, (CUfunction)(void *)kernel);
}

CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev) {
    (void)val;
    CUresult rc = sim_device(dev, NULL);
    if (rc == CUDA_SUCCESS) rc = func_ok((CUfunction)(void *)kernel);
    if (rc != CUDA_SUCCESS) return rc;
    return (int)attrib < 0 || attrib >= CU_FUNC_ATTRIBUTE_MAX ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuKernelGetName(const char **name, CUkernel hfunc) {
    CUfunction f = (CUfunction)(void *)hfunc;
    CUresult rc = func_ok(f);
    if (rc != CUDA_SUCCESS) return rc;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    *name = f->name;
    return CUDA_SUCCESS;
}

CUresult cuFuncGetModule(CUmodule *hmod, CUfunction hfunc) {
    CUresult rc = func_ok(hfunc);
    if (rc != CUDA_SUCCESS) return rc;
    if (!hmod) return CUDA_ERROR_INVALID_VALUE;
    *hmod = hfunc->mod;
    return CUDA_SUCCESS;
}

/* Lazy (kernels' code loads at their first launch, cuda_exec.c) unless CUDA_MODULE_LOADING=EAGER,
 * as the driver does since CUDA 12.2. */
CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = sim_module_loading_eager() ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

/* --- stream capture ------------------------------------------------------------------------ */

static _Thread_local CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

/* The mode is recorded, not enforced: the simulator never refuses a call during a capture. */
CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    if (!mode || (int)*mode < 0 || *mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* A capture's id is its graph's address; graphs here have no dependency sets to report. */
static CUresult capture_info(CUstream h, int ptds, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    CUresult rc = sim_stream_get(h, ptds, &c, &s);
    if (rc == CUDA_SUCCESS) {
        *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                  : s->capture_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                       : CU_STREAM_CAPTURE_STATUS_ACTIVE;
        if (s->capture) {
            if (id) *id = (cuuint64_t)(uintptr_t)s->capture;
            if (graph) *graph = s->capture;
            if (deps) *deps = NULL;
            if (edges) *edges = NULL;
            if (ndeps) *ndeps = 0;
        }
    }
    sim_unlock();
    return rc;
}

CUresult cuStreamGetCaptureInfo(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id) {
    return capture_info(h, 0, st, id, NULL, NULL, NULL, NULL);
}
CUresult cuStreamGetCaptureInfo_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id) {
    return capture_info(h, 1, st, id, NULL, NULL, NULL, NULL);
}
CUresult cuStreamGetCaptureInfo_v2(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                   const CUgraphNode **deps, size_t *n) {
    return capture_info(h, 0, st, id, g, deps, NULL, n);
}
CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                        const CUgraphNode **deps, size_t *n) {
    return capture_info(h, 1, st, id, g, deps, NULL, n);
}
CUresult cuStreamGetCaptureInfo_v3(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                   const CUgraphNode **deps, const CUgraphEdgeData **e, size_t *n) {
    return capture_info(h, 0, st, id, g, deps, e, n);
}
CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream h, CUstreamCaptureStatus *st, cuuint64_t *id, CUgraph *g,
                                        const CUgraphNode **deps, const CUgraphEdgeData **e, size_t *n) {
    return capture_info(h, 1, st, id, g, deps, e, n);
}

SIM_SELF(cuFuncGetModule)
SIM_SELF(cuKernelGetAttribute)
SIM_SELF(cuKernelGetName)
SIM_SELF(cuKernelSetAttribute)
SIM_SELF(cuModuleGetLoadingMode)
SIM_SELF(cuOccupancyAvailableDynamicSMemPerBlock)
SIM_SELF(cuOccupancyMaxActiveBlocksPerMultiprocessor)
SIM_SELF(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
SIM_SELF(cuOccupancyMaxActiveClusters)
SIM_SELF(cuOccupancyMaxPotentialBlockSize)
SIM_SELF(cuOccupancyMaxPotentialBlockSizeWithFlags)
SIM_SELF(cuOccupancyMaxPotentialClusterSize)
SIM_SELF(cuPointerGetAttributes)
SIM_SELF(cuStreamGetCaptureInfo)
SIM_SELF(cuStreamGetCaptureInfo_ptsz)
SIM_SELF(cuStreamGetCaptureInfo_v2)
SIM_SELF(cuStreamGetCaptureInfo_v2_ptsz)
SIM_SELF(cuStreamGetCaptureInfo_v3)
SIM_SELF(cuStreamGetCaptureInfo_v3_ptsz)
SIM_SELF(cuThreadExchangeStreamCaptureMode)
