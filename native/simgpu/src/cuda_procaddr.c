/* cuGetProcAddress (v1) and cuGetProcAddress_v2: a driver symbol by base name, in the variant
 * that the caller's CUDA version expects.
 *
 * Each row: base name, the CUDA version that introduced the variant, the function; per-thread
 * rows add the version of their _ptsz/_ptds form. A lookup takes the newest variant not newer
 * than cudaVersion (CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT when the name only exists in
 * newer ones), and its per-thread form with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM.
 * CU_GET_PROC_ADDRESS_DEFAULT means legacy: a driver cannot see how its caller was compiled.
 * Versions follow NVIDIA's cudaTypedefs.h (PFN_<name>_v<version>); the tests check them
 * against that header where it is installed. */
#include <stdio.h>
#include <string.h>

#include "cuda_internal.h"

#define SIM_PROCS(V, P) \
    V("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess) \
    V("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess) \
    V("cuCtxFromGreenCtx", 12040, cuCtxFromGreenCtx) \
    V("cuDevResourceGenerateDesc", 12040, cuDevResourceGenerateDesc) \
    V("cuDevSmResourceSplitByCount", 12040, cuDevSmResourceSplitByCount) \
    V("cuDeviceGetDevResource", 12040, cuDeviceGetDevResource) \
    V("cuDeviceGetP2PAttribute", 8000, cuDeviceGetP2PAttribute) \
    V("cuFuncGetModule", 11000, cuFuncGetModule) \
    V("cuGreenCtxCreate", 12040, cuGreenCtxCreate) \
    V("cuGreenCtxDestroy", 12040, cuGreenCtxDestroy) \
    V("cuGreenCtxStreamCreate", 12050, cuGreenCtxStreamCreate) \
    V("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle) \
    V("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle) \
    V("cuIpcOpenMemHandle", 4010, cuIpcOpenMemHandle) \
    V("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2) \
    V("cuKernelGetAttribute", 12000, cuKernelGetAttribute) \
    V("cuKernelGetName", 12030, cuKernelGetName) \
    V("cuKernelSetAttribute", 12000, cuKernelSetAttribute) \
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc, 10000, cuLaunchHostFunc_ptsz) \
    V("cuLibraryGetGlobal", 12000, cuLibraryGetGlobal) \
    V("cuLogsRegisterCallback", 12090, cuLogsRegisterCallback) \
    V("cuLogsUnregisterCallback", 12090, cuLogsUnregisterCallback) \
    V("cuMemAdvise", 8000, cuMemAdvise) \
    V("cuMemAdvise", 12020, cuMemAdvise_v2) \
    V("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle) \
    V("cuMemHostRegister", 4000, cuMemHostRegister) \
    V("cuMemHostRegister", 6050, cuMemHostRegister_v2) \
    V("cuMemHostUnregister", 4000, cuMemHostUnregister) \
    V("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle) \
    P("cuMemPrefetchAsync", 8000, cuMemPrefetchAsync, 8000, cuMemPrefetchAsync_ptsz) \
    P("cuMemPrefetchAsync", 12020, cuMemPrefetchAsync_v2, 12020, cuMemPrefetchAsync_v2_ptsz) \
    V("cuMemcpy2D", 2000, cuMemcpy2D) \
    P("cuMemcpy2D", 3020, cuMemcpy2D_v2, 7000, cuMemcpy2D_v2_ptds) \
    V("cuMemcpy2DAsync", 2000, cuMemcpy2DAsync) \
    P("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2, 7000, cuMemcpy2DAsync_v2_ptsz) \
    V("cuMemcpy2DUnaligned", 2000, cuMemcpy2DUnaligned) \
    P("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2, 7000, cuMemcpy2DUnaligned_v2_ptds) \
    V("cuModuleGetGlobal", 2000, cuModuleGetGlobal) \
    V("cuModuleGetGlobal", 3020, cuModuleGetGlobal_v2) \
    V("cuModuleGetLoadingMode", 11070, cuModuleGetLoadingMode) \
    V("cuMulticastAddDevice", 12010, cuMulticastAddDevice) \
    V("cuMulticastBindMem", 12010, cuMulticastBindMem) \
    V("cuMulticastCreate", 12010, cuMulticastCreate) \
    V("cuMulticastUnbind", 12010, cuMulticastUnbind) \
    V("cuOccupancyAvailableDynamicSMemPerBlock", 10020, cuOccupancyAvailableDynamicSMemPerBlock) \
    V("cuOccupancyMaxActiveBlocksPerMultiprocessor", 6050, cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    V("cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", 7000, cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags) \
    V("cuOccupancyMaxActiveClusters", 11070, cuOccupancyMaxActiveClusters) \
    V("cuOccupancyMaxPotentialBlockSize", 6050, cuOccupancyMaxPotentialBlockSize) \
    V("cuOccupancyMaxPotentialBlockSizeWithFlags", 7000, cuOccupancyMaxPotentialBlockSizeWithFlags) \
    V("cuOccupancyMaxPotentialClusterSize", 11070, cuOccupancyMaxPotentialClusterSize) \
    V("cuPointerGetAttributes", 7000, cuPointerGetAttributes) \
    P("cuStreamAddCallback", 5000, cuStreamAddCallback, 7000, cuStreamAddCallback_ptsz) \
    P("cuStreamGetCaptureInfo", 10010, cuStreamGetCaptureInfo, 10010, cuStreamGetCaptureInfo_ptsz) \
    P("cuStreamGetCaptureInfo", 11030, cuStreamGetCaptureInfo_v2, 11030, cuStreamGetCaptureInfo_v2_ptsz) \
    P("cuStreamGetCaptureInfo", 12030, cuStreamGetCaptureInfo_v3, 12030, cuStreamGetCaptureInfo_v3_ptsz) \
    P("cuStreamWriteValue32", 8000, cuStreamWriteValue32, 8000, cuStreamWriteValue32_ptsz) \
    P("cuStreamWriteValue32", 11070, cuStreamWriteValue32_v2, 11070, cuStreamWriteValue32_v2_ptsz) \
    V("cuThreadExchangeStreamCaptureMode", 10010, cuThreadExchangeStreamCaptureMode) \
    V("cuArray3DCreate", 2000, cuArray3DCreate) \
    V("cuArray3DCreate", 3020, cuArray3DCreate_v2) \
    V("cuArrayCreate", 2000, cuArrayCreate) \
    V("cuArrayCreate", 3020, cuArrayCreate_v2) \
    V("cuArrayDestroy", 2000, cuArrayDestroy) \
    V("cuCtxCreate", 2000, cuCtxCreate) \
    V("cuCtxCreate", 3020, cuCtxCreate_v2) \
    V("cuCtxCreate", 11040, cuCtxCreate_v3) \
    V("cuCtxCreate", 12050, cuCtxCreate_v4) \
    V("cuCtxDestroy", 2000, cuCtxDestroy) \
    V("cuCtxDestroy", 4000, cuCtxDestroy_v2) \
    V("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion) \
    V("cuCtxGetCurrent", 4000, cuCtxGetCurrent) \
    V("cuCtxGetDevice", 2000, cuCtxGetDevice) \
    V("cuCtxGetDevice", 13000, cuCtxGetDevice_v2) \
    V("cuCtxGetFlags", 7000, cuCtxGetFlags) \
    V("cuCtxGetId", 12000, cuCtxGetId) \
    V("cuCtxGetLimit", 3010, cuCtxGetLimit) \
    V("cuCtxGetStreamPriorityRange", 5050, cuCtxGetStreamPriorityRange) \
    V("cuCtxPopCurrent", 2000, cuCtxPopCurrent) \
    V("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2) \
    V("cuCtxPushCurrent", 2000, cuCtxPushCurrent) \
    V("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2) \
    V("cuCtxSetCurrent", 4000, cuCtxSetCurrent) \
    V("cuCtxSetFlags", 12010, cuCtxSetFlags) \
    V("cuCtxSetLimit", 3010, cuCtxSetLimit) \
    V("cuCtxSynchronize", 2000, cuCtxSynchronize) \
    V("cuCtxSynchronize", 13000, cuCtxSynchronize_v2) \
    V("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer) \
    V("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability) \
    V("cuDeviceGet", 2000, cuDeviceGet) \
    V("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute) \
    V("cuDeviceGetByPCIBusId", 4010, cuDeviceGetByPCIBusId) \
    V("cuDeviceGetCount", 2000, cuDeviceGetCount) \
    V("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool) \
    V("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute) \
    V("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool) \
    V("cuDeviceGetName", 2000, cuDeviceGetName) \
    V("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId) \
    V("cuDeviceGetUuid", 9020, cuDeviceGetUuid) \
    V("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2) \
    V("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim) \
    V("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState) \
    V("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease) \
    V("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2) \
    V("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset) \
    V("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2) \
    V("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain) \
    V("cuDevicePrimaryCtxSetFlags", 7000, cuDevicePrimaryCtxSetFlags) \
    V("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2) \
    V("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool) \
    V("cuDeviceTotalMem", 2000, cuDeviceTotalMem) \
    V("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2) \
    V("cuDriverGetVersion", 2020, cuDriverGetVersion) \
    V("cuEventCreate", 2000, cuEventCreate) \
    V("cuEventDestroy", 2000, cuEventDestroy) \
    V("cuEventDestroy", 4000, cuEventDestroy_v2) \
    V("cuEventElapsedTime", 2000, cuEventElapsedTime) \
    V("cuEventElapsedTime", 12080, cuEventElapsedTime_v2) \
    V("cuEventQuery", 2000, cuEventQuery) \
    P("cuEventRecord", 2000, cuEventRecord, 7000, cuEventRecord_ptsz) \
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags, 11010, cuEventRecordWithFlags_ptsz) \
    V("cuEventSynchronize", 2000, cuEventSynchronize) \
    V("cuFuncGetAttribute", 2020, cuFuncGetAttribute) \
    V("cuFuncGetName", 12030, cuFuncGetName) \
    V("cuFuncSetAttribute", 9000, cuFuncSetAttribute) \
    V("cuFuncSetCacheConfig", 3000, cuFuncSetCacheConfig) \
    V("cuGetErrorName", 6000, cuGetErrorName) \
    V("cuGetErrorString", 6000, cuGetErrorString) \
    V("cuGetExportTable", 3000, cuGetExportTable) \
    V("cuGetProcAddress", 11030, cuGetProcAddress) \
    V("cuGetProcAddress", 12000, cuGetProcAddress_v2) \
    V("cuGraphAddEmptyNode", 10000, cuGraphAddEmptyNode) \
    V("cuGraphAddMemAllocNode", 11040, cuGraphAddMemAllocNode) \
    V("cuGraphAddMemFreeNode", 11040, cuGraphAddMemFreeNode) \
    V("cuGraphAddKernelNode", 10000, cuGraphAddKernelNode) \
    V("cuGraphAddKernelNode", 12000, cuGraphAddKernelNode_v2) \
    V("cuGraphCreate", 10000, cuGraphCreate) \
    V("cuGraphDestroy", 10000, cuGraphDestroy) \
    V("cuGraphExecDestroy", 10000, cuGraphExecDestroy) \
    V("cuGraphGetNodes", 10000, cuGraphGetNodes) \
    V("cuGraphInstantiate", 10000, cuGraphInstantiate) \
    V("cuGraphInstantiate", 11000, cuGraphInstantiate_v2) \
    V("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags) \
    V("cuGraphInstantiateWithFlags", 11040, cuGraphInstantiateWithFlags) \
    P("cuGraphInstantiateWithParams", 12000, cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams_ptsz) \
    P("cuGraphLaunch", 10000, cuGraphLaunch, 10000, cuGraphLaunch_ptsz) \
    P("cuGraphUpload", 11010, cuGraphUpload, 11010, cuGraphUpload_ptsz) \
    V("cuInit", 2000, cuInit) \
    V("cuKernelGetFunction", 12000, cuKernelGetFunction) \
    P("cuLaunchCooperativeKernel", 9000, cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel_ptsz) \
    P("cuLaunchKernel", 4000, cuLaunchKernel, 7000, cuLaunchKernel_ptsz) \
    P("cuLaunchKernelEx", 11060, cuLaunchKernelEx, 11060, cuLaunchKernelEx_ptsz) \
    V("cuLibraryGetKernel", 12000, cuLibraryGetKernel) \
    V("cuLibraryGetModule", 12000, cuLibraryGetModule) \
    V("cuLibraryLoadData", 12000, cuLibraryLoadData) \
    V("cuLibraryLoadFromFile", 12000, cuLibraryLoadFromFile) \
    V("cuLibraryUnload", 12000, cuLibraryUnload) \
    V("cuMemAddressFree", 10020, cuMemAddressFree) \
    V("cuMemAddressReserve", 10020, cuMemAddressReserve) \
    V("cuMemAlloc", 2000, cuMemAlloc) \
    V("cuMemAlloc", 3020, cuMemAlloc_v2) \
    P("cuMemAllocAsync", 11020, cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz) \
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz) \
    V("cuMemAllocHost", 2000, cuMemAllocHost) \
    V("cuMemAllocHost", 3020, cuMemAllocHost_v2) \
    V("cuMemAllocManaged", 6000, cuMemAllocManaged) \
    V("cuMemAllocPitch", 2000, cuMemAllocPitch) \
    V("cuMemAllocPitch", 3020, cuMemAllocPitch_v2) \
    V("cuMemCreate", 10020, cuMemCreate) \
    V("cuMemFree", 2000, cuMemFree) \
    V("cuMemFree", 3020, cuMemFree_v2) \
    P("cuMemFreeAsync", 11020, cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz) \
    V("cuMemFreeHost", 2000, cuMemFreeHost) \
    V("cuMemGetAccess", 10020, cuMemGetAccess) \
    V("cuMemGetAddressRange", 2000, cuMemGetAddressRange) \
    V("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2) \
    V("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity) \
    V("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle) \
    V("cuMemGetInfo", 2000, cuMemGetInfo) \
    V("cuMemGetInfo", 3020, cuMemGetInfo_v2) \
    V("cuMemHostAlloc", 2020, cuMemHostAlloc) \
    V("cuMemHostGetDevicePointer", 2020, cuMemHostGetDevicePointer) \
    V("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2) \
    V("cuMemMap", 10020, cuMemMap) \
    P("cuMemMapArrayAsync", 11010, cuMemMapArrayAsync, 11010, cuMemMapArrayAsync_ptsz) \
    V("cuMemPoolCreate", 11020, cuMemPoolCreate) \
    V("cuMemPoolDestroy", 11020, cuMemPoolDestroy) \
    V("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute) \
    V("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute) \
    V("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo) \
    V("cuMemRelease", 10020, cuMemRelease) \
    V("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle) \
    V("cuMemSetAccess", 10020, cuMemSetAccess) \
    V("cuMemUnmap", 10020, cuMemUnmap) \
    P("cuMemcpy", 4000, cuMemcpy, 7000, cuMemcpy_ptds) \
    P("cuMemcpyAsync", 4000, cuMemcpyAsync, 7000, cuMemcpyAsync_ptsz) \
    V("cuMemcpyDtoD", 2000, cuMemcpyDtoD) \
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, 7000, cuMemcpyDtoD_v2_ptds) \
    V("cuMemcpyDtoDAsync", 3000, cuMemcpyDtoDAsync) \
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, 7000, cuMemcpyDtoDAsync_v2_ptsz) \
    V("cuMemcpyDtoH", 2000, cuMemcpyDtoH) \
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, 7000, cuMemcpyDtoH_v2_ptds) \
    V("cuMemcpyDtoHAsync", 2000, cuMemcpyDtoHAsync) \
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, 7000, cuMemcpyDtoHAsync_v2_ptsz) \
    V("cuMemcpyHtoD", 2000, cuMemcpyHtoD) \
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, 7000, cuMemcpyHtoD_v2_ptds) \
    V("cuMemcpyHtoDAsync", 2000, cuMemcpyHtoDAsync) \
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, 7000, cuMemcpyHtoDAsync_v2_ptsz) \
    V("cuMemsetD16", 2000, cuMemsetD16) \
    P("cuMemsetD16", 3020, cuMemsetD16_v2, 7000, cuMemsetD16_v2_ptds) \
    P("cuMemsetD16Async", 3020, cuMemsetD16Async, 7000, cuMemsetD16Async_ptsz) \
    V("cuMemsetD32", 2000, cuMemsetD32) \
    P("cuMemsetD32", 3020, cuMemsetD32_v2, 7000, cuMemsetD32_v2_ptds) \
    P("cuMemsetD32Async", 3020, cuMemsetD32Async, 7000, cuMemsetD32Async_ptsz) \
    V("cuMemsetD8", 2000, cuMemsetD8) \
    P("cuMemsetD8", 3020, cuMemsetD8_v2, 7000, cuMemsetD8_v2_ptds) \
    P("cuMemsetD8Async", 3020, cuMemsetD8Async, 7000, cuMemsetD8Async_ptsz) \
    V("cuMipmappedArrayCreate", 5000, cuMipmappedArrayCreate) \
    V("cuMipmappedArrayDestroy", 5000, cuMipmappedArrayDestroy) \
    V("cuMipmappedArrayGetLevel", 5000, cuMipmappedArrayGetLevel) \
    V("cuModuleGetFunction", 2000, cuModuleGetFunction) \
    V("cuModuleLoad", 2000, cuModuleLoad) \
    V("cuModuleLoadData", 2000, cuModuleLoadData) \
    V("cuModuleLoadDataEx", 2010, cuModuleLoadDataEx) \
    V("cuModuleLoadFatBinary", 2000, cuModuleLoadFatBinary) \
    V("cuModuleUnload", 2000, cuModuleUnload) \
    V("cuPointerGetAttribute", 4000, cuPointerGetAttribute) \
    P("cuStreamBeginCapture", 10000, cuStreamBeginCapture, 10000, cuStreamBeginCapture_ptsz) \
    P("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2, 10010, cuStreamBeginCapture_v2_ptsz) \
    V("cuStreamCreate", 2000, cuStreamCreate) \
    V("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority) \
    V("cuStreamDestroy", 2000, cuStreamDestroy) \
    V("cuStreamDestroy", 4000, cuStreamDestroy_v2) \
    P("cuStreamEndCapture", 10000, cuStreamEndCapture, 10000, cuStreamEndCapture_ptsz) \
    P("cuStreamGetCtx", 9020, cuStreamGetCtx, 9020, cuStreamGetCtx_ptsz) \
    P("cuStreamGetCtx", 12050, cuStreamGetCtx_v2, 12050, cuStreamGetCtx_v2_ptsz) \
    P("cuStreamGetDevice", 12080, cuStreamGetDevice, 12080, cuStreamGetDevice_ptsz) \
    P("cuStreamGetFlags", 5050, cuStreamGetFlags, 7000, cuStreamGetFlags_ptsz) \
    P("cuStreamGetId", 12000, cuStreamGetId, 12000, cuStreamGetId_ptsz) \
    P("cuStreamGetPriority", 5050, cuStreamGetPriority, 7000, cuStreamGetPriority_ptsz) \
    P("cuStreamIsCapturing", 10000, cuStreamIsCapturing, 10000, cuStreamIsCapturing_ptsz) \
    P("cuStreamQuery", 2000, cuStreamQuery, 7000, cuStreamQuery_ptsz) \
    P("cuStreamSynchronize", 2000, cuStreamSynchronize, 7000, cuStreamSynchronize_ptsz) \
    P("cuStreamWaitEvent", 3020, cuStreamWaitEvent, 7000, cuStreamWaitEvent_ptsz)

#define DECL_V(name, v, f) extern __typeof__(f) sim_self_##f SIM_HIDDEN;
#define DECL_P(name, v, f, pv, pf) DECL_V(name, v, f) DECL_V(name, pv, pf)
SIM_PROCS(DECL_V, DECL_P)

struct proc {
    const char *name;
    int version;
    void *fn;
    int ptds_version;
    void *ptds_fn;
};

/* Function addresses as data: GCC allows the conversion, and it is what callers receive. */
#define ROW_V(name, v, f) {name, v, (void *)sim_self_##f, 0, NULL},
#define ROW_P(name, v, f, pv, pf) {name, v, (void *)sim_self_##f, pv, (void *)sim_self_##pf},
static const struct proc k_procs[] = {SIM_PROCS(ROW_V, ROW_P)};

static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *status) {
    cuuint64_t known = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if (!symbol || !pfn || (flags & ~known)) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    const struct proc *best = NULL;
    int named = 0;
    for (size_t i = 0; i < sizeof k_procs / sizeof k_procs[0]; i++) {
        const struct proc *p = &k_procs[i];
        if (strcmp(p->name, symbol) != 0) continue;
        named = 1;
        if (p->version <= cudaVersion && (!best || p->version > best->version)) best = p;
    }
    if (!best) {
        if (sim_trace()) fprintf(stderr, "simgpu: cuGetProcAddress(%s, %d): not found\n", symbol, cudaVersion);
        if (status) *status = named ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    *pfn = per_thread && best->ptds_fn && cudaVersion >= best->ptds_version ? best->ptds_fn : best->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

/* Both work before cuInit: that is how runtimes find cuInit. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return lookup(symbol, pfn, cudaVersion, flags, NULL);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

SIM_SELF(cuGetProcAddress)
SIM_SELF(cuGetProcAddress_v2)
