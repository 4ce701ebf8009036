/* A stream-ordered pool that keeps everything it frees (release threshold at the maximum, as
 * PyTorch's and CuPy's async allocators set it), then another allocation path, through the
 * shim; the test reads the GPU's physical usage at each hold.
 *
 *   shim_pool <mode> <ordinal> <chunk-bytes> [graph]
 *
 * 1. cuMemAllocAsync chunks from the device's default pool until refused; free them all and
 *    synchronise: the pool keeps them cached. Prints async_count, view_free; "hold" and waits
 *    for a line on stdin.
 * 2. cuMemAlloc chunks until refused. Prints alloc_count, view_free; "hold", waits.
 * 3. Frees everything, prints "done". */
#include <stdint.h>

#include "shim_test.h"

enum { MAX_CHUNKS = 1024 };

static void hold(void) {
    printf("hold\n");
    fflush(stdout);
    int c;
    while ((c = getchar()) != '\n' && c != EOF) {
    }
}

static void view(void) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    printf("view_free=%zu\n", f);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <chunk>\n", argv[0]);
        return 2;
    }
    CUdevice dev = shim_start(argv[1], atoi(argv[2]));
    size_t chunk = strtoull(argv[3], NULL, 0);
    __typeof__(cuMemPoolSetAttribute) *set_attr = (__typeof__(cuMemPoolSetAttribute) *)dlsym(g_lib, "cuMemPoolSetAttribute");
    if (!set_attr) return 3;
    CUmemoryPool pool;
    CK(C(pool_default, cuDeviceGetDefaultMemPool)(&pool, dev));
    cuuint64_t keep_all = UINT64_MAX;
    CK(set_attr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all));
    CUstream s;
    CK(C(stream_create, cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING));
    static CUdeviceptr p[MAX_CHUNKS];
    int n = 0;
    while (n < MAX_CHUNKS && C(alloc_async, cuMemAllocAsync)(&p[n], chunk, s) == CUDA_SUCCESS) n++;
    for (int i = 0; i < n; i++) CK(C(free_async, cuMemFreeAsync)(p[i], s));
    CK(C(stream_sync, cuStreamSynchronize)(s));
    printf("async_count=%d\n", n);
    view();
    hold();
    int m = 0;
    while (m < MAX_CHUNKS && C(alloc, cuMemAlloc)(&p[m], chunk) == CUDA_SUCCESS) m++;
    printf("alloc_count=%d\n", m);
    view();
    hold();
    for (int i = 0; i < m; i++) CK(C(free, cuMemFree)(p[i]));
    printf("done\n");
    return 0;
}
