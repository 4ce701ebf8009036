/* Entry points for what the simulator does not model, so that clients which resolve them at
 * start-up (PyTorch's driver table, NVIDIA's runtime) find them. Each answers as a driver
 * without the feature would: CUDA_ERROR_NOT_SUPPORTED, or, for peers, "no peer access". */
#include "cuda_internal.h"

#define ABSENT CUDA_ERROR_NOT_SUPPORTED

/* --- peers: no GPU of the node can map another's memory (cuDeviceCanAccessPeer says 0) ----- */

CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
    CUresult rc = sim_ctx_valid(peerContext);
    if (rc != CUDA_SUCCESS) return rc;
    return Flags ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
}

CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
    CUresult rc = sim_ctx_valid(peerContext);
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
}

CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice src, CUdevice dst) {
    (void)attrib;
    CUresult rc = sim_device(src, NULL);
    if (rc == CUDA_SUCCESS) rc = sim_device(dst, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!value || src == dst) return CUDA_ERROR_INVALID_DEVICE;
    *value = 0;
    return CUDA_SUCCESS;
}

/* --- sharing memory between processes: device memory is private anonymous memory here ------ */

CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) { (void)pHandle, (void)dptr; return ABSENT; }
CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    (void)pdptr, (void)handle, (void)Flags;
    return ABSENT;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    (void)pdptr, (void)handle, (void)Flags;
    return ABSENT;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) { (void)dptr; return ABSENT; }
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType, unsigned long long flags) {
    (void)shareableHandle, (void)handle, (void)handleType, (void)flags;
    return ABSENT;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType) {
    (void)handle, (void)osHandle, (void)shHandleType;
    return ABSENT;
}

/* --- stream memory operations ---------------------------------------------------------------- */

CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s, (void)a, (void)v, (void)f; return ABSENT; }
CUresult cuStreamWriteValue32_v2_ptsz(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s, (void)a, (void)v, (void)f; return ABSENT; }
CUresult cuStreamWriteValue32(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s, (void)a, (void)v, (void)f; return ABSENT; }
CUresult cuStreamWriteValue32_ptsz(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s, (void)a, (void)v, (void)f; return ABSENT; }

/* --- multicast objects (NVLink switches) ------------------------------------------------------ */

CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop) {
    (void)mcHandle, (void)prop;
    return ABSENT;
}
CUresult cuMulticastAddDevice(CUmemGenericAllocationHandle mcHandle, CUdevice dev) { (void)mcHandle, (void)dev; return ABSENT; }
CUresult cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset, CUmemGenericAllocationHandle memHandle,
                            size_t memOffset, size_t size, unsigned long long flags) {
    (void)mcHandle, (void)mcOffset, (void)memHandle, (void)memOffset, (void)size, (void)flags;
    return ABSENT;
}
CUresult cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev, size_t mcOffset, size_t size) {
    (void)mcHandle, (void)dev, (void)mcOffset, (void)size;
    return ABSENT;
}

/* --- green contexts and device resources -------------------------------------------------- */

CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx) { (void)pContext, (void)hCtx; return ABSENT; }
CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
    (void)phCtx, (void)desc, (void)dev, (void)flags;
    return ABSENT;
}
CUresult cuGreenCtxDestroy(CUgreenCtx hCtx) { (void)hCtx; return ABSENT; }
CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority) {
    (void)phStream, (void)greenCtx, (void)flags, (void)priority;
    return ABSENT;
}
CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, CUdevResourceType type) {
    (void)device, (void)resource, (void)type;
    return ABSENT;
}
CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources, unsigned int nbResources) {
    (void)phDesc, (void)resources, (void)nbResources;
    return ABSENT;
}
CUresult cuDevSmResourceSplitByCount(CUdevResource *result, unsigned int *nbGroups, const CUdevResource *input,
                                     CUdevResource *remainder, unsigned int flags, unsigned int minCount) {
    (void)result, (void)nbGroups, (void)input, (void)remainder, (void)flags, (void)minCount;
    return ABSENT;
}

/* --- what cuBLASLt resolves with dlsym at start-up (it refuses a driver without them) ------- */

CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int f) { (void)s, (void)a, (void)v, (void)f; return ABSENT; }
CUresult cuStreamBatchMemOp(CUstream s, unsigned int n, CUstreamBatchMemOpParams_v1 *p, unsigned int f) {
    (void)s, (void)n, (void)p, (void)f;
    return ABSENT;
}
CUresult cuGraphKernelNodeGetParams(CUgraphNode h, CUDA_KERNEL_NODE_PARAMS_v1 *p) { (void)h, (void)p; return ABSENT; }
CUresult cuGraphExecKernelNodeSetParams(CUgraphExec e, CUgraphNode h, const CUDA_KERNEL_NODE_PARAMS_v1 *p) {
    (void)e, (void)h, (void)p;
    return ABSENT;
}
CUresult cuGraphNodeGetType(CUgraphNode h, CUgraphNodeType *t) { (void)h, (void)t; return ABSENT; }
/* Linking device code is JIT work a simulator has no use for. cuDNN's runtime-compiled engines
 * (fused attention) also resolve the v1 names with dlsym and refuse every engine without them,
 * yet never call them: they compile with NVRTC and load the PTX with cuModuleLoadData. */
CUresult cuLinkCreate_v2(unsigned int n, CUjit_option *o, void **v, CUlinkState *st) { (void)n, (void)o, (void)v, (void)st; return ABSENT; }
CUresult cuLinkAddData_v2(CUlinkState st, CUjitInputType t, void *d, size_t size, const char *name, unsigned int n,
                          CUjit_option *o, void **v) {
    (void)st, (void)t, (void)d, (void)size, (void)name, (void)n, (void)o, (void)v;
    return ABSENT;
}
CUresult cuLinkCreate(unsigned int n, CUjit_option *o, void **v, CUlinkState *st) { (void)n, (void)o, (void)v, (void)st; return ABSENT; }
CUresult cuLinkAddData(CUlinkState st, CUjitInputType t, void *d, size_t size, const char *name, unsigned int n,
                       CUjit_option *o, void **v) {
    (void)st, (void)t, (void)d, (void)size, (void)name, (void)n, (void)o, (void)v;
    return ABSENT;
}
CUresult cuLinkComplete(CUlinkState st, void **cubin, size_t *size) { (void)st, (void)cubin, (void)size; return ABSENT; }
CUresult cuLinkDestroy(CUlinkState st) { (void)st; return ABSENT; }

/* --- driver logs ------------------------------------------------------------------------------ */

CUresult cuLogsRegisterCallback(CUlogsCallback callbackFunc, void *userData, CUlogsCallbackHandle *callback_out) {
    (void)callbackFunc, (void)userData, (void)callback_out;
    return ABSENT;
}
CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle callback) { (void)callback; return ABSENT; }

SIM_SELF(cuCtxDisablePeerAccess)
SIM_SELF(cuCtxEnablePeerAccess)
SIM_SELF(cuCtxFromGreenCtx)
SIM_SELF(cuDevResourceGenerateDesc)
SIM_SELF(cuDevSmResourceSplitByCount)
SIM_SELF(cuDeviceGetDevResource)
SIM_SELF(cuDeviceGetP2PAttribute)
SIM_SELF(cuGreenCtxCreate)
SIM_SELF(cuGreenCtxDestroy)
SIM_SELF(cuGreenCtxStreamCreate)
SIM_SELF(cuIpcCloseMemHandle)
SIM_SELF(cuIpcGetMemHandle)
SIM_SELF(cuIpcOpenMemHandle)
SIM_SELF(cuIpcOpenMemHandle_v2)
SIM_SELF(cuLogsRegisterCallback)
SIM_SELF(cuLogsUnregisterCallback)
SIM_SELF(cuMemExportToShareableHandle)
SIM_SELF(cuMemImportFromShareableHandle)
SIM_SELF(cuMulticastAddDevice)
SIM_SELF(cuMulticastBindMem)
SIM_SELF(cuMulticastCreate)
SIM_SELF(cuMulticastUnbind)
SIM_SELF(cuStreamWriteValue32)
SIM_SELF(cuStreamWriteValue32_ptsz)
SIM_SELF(cuStreamWriteValue32_v2)
SIM_SELF(cuStreamWriteValue32_v2_ptsz)
