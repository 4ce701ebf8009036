/* A context made one of the ways a CUDA program makes it, then memory through the shim until
 * refused, held until stdin closes: the test compares what the simulated GPU says the process
 * holds (allocations and the context) with the container's limit.
 *
 *   shim_ctx_fill <mode> <how> <chunk-bytes>
 *
 * how: runtime  the primary context retained and made current through the driver's own entry
 *               points, past the shim, as the CUDA runtime does (its private export table):
 *               the shim first meets the context at the first allocation
 *      create   cuCtxCreate through the shim
 *      retain   the primary context retained and made current through the shim
 * Prints allocated=<bytes> count=<n> refusal=<CUresult> view_free=<cuMemGetInfo's free>, then
 * "holding" and waits for stdin to close. A failed call exits 10. */
#include <unistd.h>

#include "shim_test.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s <mode> runtime|create|retain <chunk-bytes>\n", argv[0]);
        return 2;
    }
    shim_load(argv[1]);
    const char *how = argv[2];
    size_t chunk = strtoull(argv[3], NULL, 0);
    CUdevice dev;
    CUcontext ctx;
    CK(C(init, cuInit)(0));
    CK(C(device_get, cuDeviceGet)(&dev, 0));
    if (!strcmp(how, "runtime")) {
        CK(((__typeof__(cuDevicePrimaryCtxRetain) *)real_sym("cuDevicePrimaryCtxRetain"))(&ctx, dev));
        CK(((__typeof__(cuCtxSetCurrent) *)real_sym("cuCtxSetCurrent"))(ctx));
    } else if (!strcmp(how, "create")) {
        CK(C(ctx_create, cuCtxCreate_v4)(&ctx, NULL, 0, dev));
    } else if (!strcmp(how, "retain")) {
        CK(C(retain, cuDevicePrimaryCtxRetain)(&ctx, dev));
        CK(C(set_current, cuCtxSetCurrent)(ctx));
    } else {
        return 2;
    }
    size_t count = 0;
    CUresult refusal = CUDA_SUCCESS;
    while (count < 100000) {
        CUdeviceptr p;
        refusal = C(alloc, cuMemAlloc)(&p, chunk);
        if (refusal != CUDA_SUCCESS) break;
        count++;
    }
    size_t free_b = 0, total_b = 0;
    CK(C(mem_info, cuMemGetInfo)(&free_b, &total_b));
    printf("allocated=%zu\ncount=%zu\nrefusal=%d\nview_free=%zu\nholding\n", count * chunk, count,
           (int)refusal, free_b);
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    return 0;
}
