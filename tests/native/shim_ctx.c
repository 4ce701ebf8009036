/* Contexts through the shim, each way one can be made; after each, the container's view of
 * the GPU (cuMemGetInfo) shows what was charged.
 *
 *   shim_ctx <mode> create <n>     n contexts by cuCtxCreate: free_<i> after the i-th; then
 *                                  all destroyed: end_free
 *   shim_ctx <mode> runtime        the primary context retained through the driver's own entry
 *                                  point (as the runtime does, past the shim), made current
 *                                  through the shim: free; then a 64 MiB cuMemAlloc: free2
 *   shim_ctx <mode> runtime_alloc  retained and made current past the shim; the first the shim
 *                                  sees of it is a 64 MiB cuMemAlloc: free
 *   shim_ctx <mode> late           every route to a new context, each tried once in a container
 *                                  that may be full: create=<rc> (cuCtxCreate_v4), retain=<rc>
 *                                  (cuDevicePrimaryCtxRetain), table=<rc> (slot 2 of the runtime's
 *                                  private table, as NVIDIA's runtime makes its context), then
 *                                  "ready" and a wait for a line on stdin
 *   shim_ctx <mode> limit <bytes>  the primary context's device heap grown to <bytes>:
 *                                  set=<rc>, heap=<the limit after>, free; then destroyed with
 *                                  the context (a reset): end_free
 * Results are key=value lines; a failed call exits 10. */
#include "shim_test.h"

static size_t view_free(void) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    return f;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <mode> create <n> | runtime | runtime_alloc\n", argv[0]);
        return 2;
    }
    shim_load(argv[1]);
    const char *how = argv[2];
    CUdevice dev;
    CK(C(init, cuInit)(0));
    CK(C(device_get, cuDeviceGet)(&dev, 0));
    if (!strcmp(how, "create")) {
        int n = argc > 3 ? atoi(argv[3]) : 1;
        CUcontext ctx[64];
        for (int i = 0; i < n && i < 64; i++) {
            CK(C(ctx_create, cuCtxCreate_v4)(&ctx[i], NULL, 0, dev));
            printf("free_%d=%zu\n", i + 1, view_free());
            fflush(stdout);
        }
        for (int i = 0; i < n && i < 64; i++) CK(C(ctx_destroy, cuCtxDestroy)(ctx[i]));
        CUcontext pctx;
        CK(C(retain, cuDevicePrimaryCtxRetain)(&pctx, dev));
        CK(C(set_current, cuCtxSetCurrent)(pctx));
        printf("end_free=%zu\n", view_free());
        return 0;
    }
    if (!strcmp(how, "late")) {
        static const CUuuid runtime_table = {{0x6b, (char)0xd5, (char)0xfb, 0x6c, 0x5b, (char)0xf4, (char)0xe7, 0x4a,
                                              (char)0x89, (char)0x87, (char)0xd9, 0x39, 0x12, (char)0xfd, (char)0x9d, (char)0xf9}};
        CUcontext ctx = NULL, pctx = NULL;
        CUresult rc = C(ctx_create, cuCtxCreate_v4)(&ctx, NULL, 0, dev);
        printf("create=%d\n", (int)rc);
        rc = C(retain, cuDevicePrimaryCtxRetain)(&pctx, dev);
        printf("retain=%d\n", (int)rc);
        if (rc == CUDA_SUCCESS) CK(C(release, cuDevicePrimaryCtxRelease_v2)(dev));
        void *const *table = NULL;
        CK(C(export_table, cuGetExportTable)((const void **)&table, &runtime_table));
        CUresult (*get)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))table[2];
        printf("table=%d\nready\n", (int)get(&pctx, dev));
        fflush(stdout);
        while (getchar() != '\n' && !feof(stdin)) {
        }
        return 0;
    }
    if (!strcmp(how, "limit")) {
        CUcontext pctx;
        CK(C(retain, cuDevicePrimaryCtxRetain)(&pctx, dev));
        CK(C(set_current, cuCtxSetCurrent)(pctx));
        __typeof__(cuCtxSetLimit) *set_limit = (__typeof__(cuCtxSetLimit) *)dlsym(g_lib, "cuCtxSetLimit");
        __typeof__(cuCtxGetLimit) *get_limit = (__typeof__(cuCtxGetLimit) *)dlsym(g_lib, "cuCtxGetLimit");
        __typeof__(cuDevicePrimaryCtxReset_v2) *reset = (__typeof__(cuDevicePrimaryCtxReset_v2) *)dlsym(g_lib, "cuDevicePrimaryCtxReset_v2");
        if (!set_limit || !get_limit || !reset) return 3;
        printf("set=%d\n", (int)set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, strtoull(argv[3], NULL, 0)));
        size_t heap = 0;
        CK(get_limit(&heap, CU_LIMIT_MALLOC_HEAP_SIZE));
        printf("heap=%zu\nfree=%zu\n", heap, view_free());
        CK(reset(dev));
        CK(C(retain, cuDevicePrimaryCtxRetain)(&pctx, dev));
        CK(C(set_current, cuCtxSetCurrent)(pctx));
        printf("end_free=%zu\n", view_free());
        return 0;
    }
    __typeof__(cuDevicePrimaryCtxRetain) *retain = (__typeof__(cuDevicePrimaryCtxRetain) *)real_sym("cuDevicePrimaryCtxRetain");
    __typeof__(cuCtxSetCurrent) *set_current = (__typeof__(cuCtxSetCurrent) *)real_sym("cuCtxSetCurrent");
    CUcontext pctx;
    CK(retain(&pctx, dev));
    CUdeviceptr p;
    if (!strcmp(how, "runtime")) {
        CK(C(set_current, cuCtxSetCurrent)(pctx));
        printf("free=%zu\n", view_free());
        CK(C(alloc, cuMemAlloc)(&p, 64 << 20));
        printf("free2=%zu\n", view_free());
    } else if (!strcmp(how, "runtime_alloc")) {
        CK(set_current(pctx));
        CK(C(alloc, cuMemAlloc)(&p, 64 << 20));
        printf("free=%zu\n", view_free());
    } else {
        return 2;
    }
    return 0;
}
