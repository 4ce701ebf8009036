/* cuGetProcAddress: the runtime (cudart) and frameworks find driver entry points through it,
 * by base name, CUDA version and per-thread-stream flag. The real driver answers first, with
 * the variant of the right ABI; the pointer it returns is then swapped for the hook of that
 * same variant. Anything not hooked, and the status out-param, pass through untouched.
 *
 * The pointer is compared with the real address of every hooked versioned, _ptsz and _ptds
 * entry point. In case a driver hands out other addresses through cuGetProcAddress than
 * through its exported symbols, the first lookup also asks the driver for each hooked variant
 * by the (base name, version, flag) under which NVIDIA's cudaTypedefs.h names it
 * (PFN_<base>_v<version>[_ptsz]), and remembers those addresses too. */
#include "shim.h"

/* Names held inline, not as pointers: a table of pointers is relocated at load time in
 * every process, and most processes never ask. */
struct variant {
    char base[32];
    int version;
    int ptds;
    char name[40]; /* the hooked entry point the driver returns for that query */
};

/* From cudaTypedefs.h; tests/libvgpu/test_shim_loading.py checks them against it. */
static const struct variant k_variants[] = {
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress"},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc"},
    {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2"},
    {"cuMemAllocPitch", 2000, 0, "cuMemAllocPitch"},
    {"cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2"},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged"},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync"},
    {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync_ptsz"},
    {"cuMemAllocFromPoolAsync", 11020, 0, "cuMemAllocFromPoolAsync"},
    {"cuMemAllocFromPoolAsync", 11020, 1, "cuMemAllocFromPoolAsync_ptsz"},
    {"cuMemFree", 2000, 0, "cuMemFree"},
    {"cuMemFree", 3020, 0, "cuMemFree_v2"},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync"},
    {"cuMemFreeAsync", 11020, 1, "cuMemFreeAsync_ptsz"},
    {"cuMemCreate", 10020, 0, "cuMemCreate"},
    {"cuMemRelease", 10020, 0, "cuMemRelease"},
    {"cuMemRetainAllocationHandle", 11000, 0, "cuMemRetainAllocationHandle"},
    {"cuMemPoolCreate", 11020, 0, "cuMemPoolCreate"},
    {"cuMemPoolDestroy", 11020, 0, "cuMemPoolDestroy"},
    {"cuArrayCreate", 2000, 0, "cuArrayCreate"},
    {"cuArrayCreate", 3020, 0, "cuArrayCreate_v2"},
    {"cuArray3DCreate", 2000, 0, "cuArray3DCreate"},
    {"cuArray3DCreate", 3020, 0, "cuArray3DCreate_v2"},
    {"cuArrayDestroy", 2000, 0, "cuArrayDestroy"},
    {"cuMipmappedArrayCreate", 5000, 0, "cuMipmappedArrayCreate"},
    {"cuMipmappedArrayDestroy", 5000, 0, "cuMipmappedArrayDestroy"},
    {"cuCtxCreate", 2000, 0, "cuCtxCreate"},
    {"cuCtxCreate", 3020, 0, "cuCtxCreate_v2"},
    {"cuCtxCreate", 11040, 0, "cuCtxCreate_v3"},
    {"cuCtxCreate", 12050, 0, "cuCtxCreate_v4"},
    {"cuCtxDestroy", 2000, 0, "cuCtxDestroy"},
    {"cuCtxDestroy", 4000, 0, "cuCtxDestroy_v2"},
    {"cuDevicePrimaryCtxRetain", 7000, 0, "cuDevicePrimaryCtxRetain"},
    {"cuCtxSetCurrent", 4000, 0, "cuCtxSetCurrent"},
    {"cuCtxSetLimit", 3010, 0, "cuCtxSetLimit"},
    {"cuModuleLoad", 2000, 0, "cuModuleLoad"},
    {"cuModuleLoadData", 2000, 0, "cuModuleLoadData"},
    {"cuModuleLoadDataEx", 2010, 0, "cuModuleLoadDataEx"},
    {"cuModuleLoadFatBinary", 2000, 0, "cuModuleLoadFatBinary"},
    {"cuModuleGetFunction", 2000, 0, "cuModuleGetFunction"},
    {"cuLibraryLoadData", 12000, 0, "cuLibraryLoadData"},
    {"cuLibraryLoadFromFile", 12000, 0, "cuLibraryLoadFromFile"},
    {"cuLibraryGetModule", 12000, 0, "cuLibraryGetModule"},
    {"cuKernelGetFunction", 12000, 0, "cuKernelGetFunction"},
    {"cuLibraryGetGlobal", 12000, 0, "cuLibraryGetGlobal"},
    {"cuModuleUnload", 2000, 0, "cuModuleUnload"},
    {"cuLibraryUnload", 12000, 0, "cuLibraryUnload"},
    {"cuCtxSynchronize", 2000, 0, "cuCtxSynchronize"},
    {"cuGraphAddMemAllocNode", 11040, 0, "cuGraphAddMemAllocNode"},
    {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"},
    {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"},
    {"cuGraphInstantiateWithFlags", 11040, 0, "cuGraphInstantiateWithFlags"},
    {"cuGraphInstantiateWithParams", 12000, 0, "cuGraphInstantiateWithParams"},
    {"cuGraphInstantiateWithParams", 12000, 1, "cuGraphInstantiateWithParams_ptsz"},
    {"cuGraphUpload", 11010, 0, "cuGraphUpload"},
    {"cuGraphUpload", 11010, 1, "cuGraphUpload_ptsz"},
    {"cuGraphExecDestroy", 10000, 0, "cuGraphExecDestroy"},
    {"cuStreamSynchronize", 2000, 0, "cuStreamSynchronize"},
    {"cuStreamSynchronize", 7000, 1, "cuStreamSynchronize_ptsz"},
    {"cuDevicePrimaryCtxRelease", 7000, 0, "cuDevicePrimaryCtxRelease"},
    {"cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"},
    {"cuDevicePrimaryCtxReset", 7000, 0, "cuDevicePrimaryCtxReset"},
    {"cuDevicePrimaryCtxReset", 11000, 0, "cuDevicePrimaryCtxReset_v2"},
    {"cuMemGetInfo", 2000, 0, "cuMemGetInfo"},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2"},
    {"cuDeviceTotalMem", 2000, 0, "cuDeviceTotalMem"},
    {"cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"},
    {"cuLaunchKernel", 4000, 0, "cuLaunchKernel"},
    {"cuLaunchKernel", 7000, 1, "cuLaunchKernel_ptsz"},
    {"cuLaunchKernelEx", 11060, 0, "cuLaunchKernelEx"},
    {"cuLaunchKernelEx", 11060, 1, "cuLaunchKernelEx_ptsz"},
    {"cuLaunchCooperativeKernel", 9000, 0, "cuLaunchCooperativeKernel"},
    {"cuLaunchCooperativeKernel", 9000, 1, "cuLaunchCooperativeKernel_ptsz"},
    {"cuGraphLaunch", 10000, 0, "cuGraphLaunch"},
    {"cuGraphLaunch", 10000, 1, "cuGraphLaunch_ptsz"},
    {"cuGetExportTable", 3000, 0, "cuGetExportTable"},
};
enum { N_VARIANTS = sizeof k_variants / sizeof k_variants[0] };

/* Addresses the driver hands out through cuGetProcAddress that differ from its exported
 * symbols', with their hooks (this file's part of the process state, written once). */
static struct {
    void *real, *hook;
} g_alias[N_VARIANTS];
static int g_nalias;
static pthread_once_t g_alias_once = PTHREAD_ONCE_INIT;

static void learn(void) {
    for (int i = 0; i < N_VARIANTS; i++) {
        const struct variant *v = &k_variants[i];
        const struct vgpu_hook *h = vgpu_hook_by_name(v->name);
        cuuint64_t flags = v->ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                   : CU_GET_PROC_ADDRESS_DEFAULT;
        void *p = NULL;
        CUdriverProcAddressQueryResult st;
        CUresult rc = vgpu.real.cuGetProcAddress_v2
                          ? vgpu.real.cuGetProcAddress_v2(v->base, &p, v->version, flags, &st)
                          : vgpu.real.cuGetProcAddress(v->base, &p, v->version, flags);
        if (h && rc == CUDA_SUCCESS && p && p != *h->real && !vgpu_hook_for_real(p)) {
            g_alias[g_nalias].real = p;
            g_alias[g_nalias].hook = h->hook;
            g_nalias++;
        }
    }
    if (g_nalias)
        VLOG(VGPU_LOG_DEBUG, "cuGetProcAddress hands out %d address(es) of its own", g_nalias);
}

static void map(void **pfn) {
    void *p = *pfn;
    if (!p) return;
    void *hook = vgpu_hook_for_real(p);
    if (!hook) {
        pthread_once(&g_alias_once, learn);
        for (int i = 0; i < g_nalias && !hook; i++)
            if (g_alias[i].real == p) hook = g_alias[i].hook;
    }
    if (hook) *pfn = hook;
}

VGPU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
    vgpu_ensure();
    if (UNLIKELY(!vgpu.real.cuGetProcAddress_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = vgpu.real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn) map(pfn);
    return rc;
}

VGPU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    vgpu_ensure();
    if (UNLIKELY(!vgpu.real.cuGetProcAddress)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = vgpu.real.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn) map(pfn);
    return rc;
}
