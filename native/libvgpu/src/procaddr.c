/* cuGetProcAddress: the runtime (cudart) and frameworks find driver entry points through it,
 * by base name, CUDA version and per-thread-stream flag. The real driver answers first, with
 * the variant of the right ABI; the pointer it returns is then swapped for the hook of that
 * same variant (compared against the real address of every hooked versioned, _ptsz and _ptds
 * entry point). Anything not hooked, and the status out-param, pass through untouched. */
#include "shim.h"

static void map(void **pfn) {
    void *hook = *pfn ? vgpu_hook_for_real(*pfn) : NULL;
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
