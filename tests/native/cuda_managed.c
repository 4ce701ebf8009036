/* Managed memory's bound: cuMemAllocManaged of each size given (MiB) in turn, keeping what it
 * got; prints alloc.<i>=<rc>, then after freeing everything again=<rc> for the first size. */
#include <stdlib.h>

#include "cuda_test.h"

int main(int argc, char **argv) {
    CK(cuInit(0));
    CUcontext ctx = use_primary(0);
    CUdeviceptr held[16] = {0};
    int n = argc - 1 < 16 ? argc - 1 : 16;
    for (int i = 0; i < n; i++) {
        CUresult rc = cuMemAllocManaged(&held[i], (size_t)atoll(argv[i + 1]) << 20, CU_MEM_ATTACH_GLOBAL);
        printf("alloc.%d=%d\n", i, (int)rc);
        if (rc != CUDA_SUCCESS) held[i] = 0;
    }
    for (int i = 0; i < n; i++)
        if (held[i]) CK(cuMemFree(held[i]));
    CUdeviceptr again = 0;
    if (n) {
        CUresult rc = cuMemAllocManaged(&again, (size_t)atoll(argv[1]) << 20, CU_MEM_ATTACH_GLOBAL);
        printf("again=%d\n", (int)rc);
        if (rc == CUDA_SUCCESS) CK(cuMemFree(again));
    }
    (void)ctx;
    CK(cuDevicePrimaryCtxRelease(0));
    return 0;
}
