/* Every allocation path, with what it charged to the node (the drop of cuMemGetInfo's free
 * bytes, node-wide) and what its free gave back, plus data round trips and misuse errors.
 * Prints "<step>=<bytes charged>" and "<check>=<value>" lines.
 *
 *   cuda_alloc_paths <ordinal>
 */
#include <stdint.h>
#include <string.h>

#include "cuda_test.h"

#define MiB (1ull << 20)

static size_t g_mark;

static void mark(void) { g_mark = free_bytes(); }

/* Bytes taken from the node since mark() (negative: given back). */
static long long taken(void) { return (long long)g_mark - (long long)free_bytes(); }

static void contexts(CUdevice dev) {
    mark();
    CUcontext own;
    CK(cuCtxCreate(&own, NULL, 0, dev));
    printf("ctx_create=%lld\n", taken());
    unsigned long long id = 0;
    CK(cuCtxGetId(own, &id));
    mark();
    CK(cuCtxDestroy(own));
    printf("ctx_destroy=%lld\n", taken());
    CUcontext cur;
    CK(cuCtxGetCurrent(&cur));
    CUcontext primary;
    CK(cuDevicePrimaryCtxRetain(&primary, dev));
    printf("ctx_current_is_primary=%d\n", cur == primary); /* the destroyed one was popped */
    CK(cuDevicePrimaryCtxRelease(dev));
}

static void device_memory(void) {
    CUdeviceptr p;
    mark();
    CK(cuMemAlloc(&p, 64 * MiB));
    printf("alloc=%lld\n", taken());
    mark();
    CK(cuMemFree(p));
    printf("alloc_free=%lld\n", taken());

    size_t pitch = 0;
    mark();
    CK(cuMemAllocPitch(&p, &pitch, 1000, 3000, 4));
    printf("pitch=%zu\npitch_alloc=%lld\n", pitch, taken());
    mark();
    CK(cuMemFree(p));
    printf("pitch_free=%lld\n", taken());

    mark();
    CK(cuMemAllocManaged(&p, 48 * MiB, CU_MEM_ATTACH_GLOBAL));
    printf("managed=%lld\n", taken());
    mark();
    CK(cuMemFree(p));
    printf("managed_free=%lld\n", taken());

    void *h;
    mark();
    CK(cuMemAllocHost(&h, 32 * MiB));
    memset(h, 1, 4096);
    printf("host=%lld\n", taken());
    printf("free_host_with_cuMemFree=%d\n", (int)cuMemFree((CUdeviceptr)(uintptr_t)h));
    CK(cuMemFreeHost(h));
    printf("free_host_twice=%d\n", (int)cuMemFreeHost(h));

    CUDA_ARRAY_DESCRIPTOR ad = {.Width = 1024, .Height = 1024, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CUarray arr;
    mark();
    CK(cuArrayCreate(&arr, &ad));
    printf("array=%lld\n", taken());
    mark();
    CK(cuArrayDestroy(arr));
    printf("array_free=%lld\n", taken());
    CUDA_ARRAY3D_DESCRIPTOR a3 = {.Width = 64, .Height = 64, .Depth = 64, .Format = CU_AD_FORMAT_UNSIGNED_INT16, .NumChannels = 2};
    mark();
    CK(cuArray3DCreate(&arr, &a3));
    printf("array3d=%lld\n", taken());
    mark();
    CK(cuArrayDestroy(arr));
    printf("array3d_free=%lld\n", taken());
}

static void stream_ordered(CUdevice dev) {
    CUstream s;
    CUdeviceptr p;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    mark();
    CK(cuMemAllocAsync(&p, 40 * MiB, s));
    printf("async=%lld\n", taken());
    mark();
    CK(cuMemFreeAsync(p, s));
    printf("async_free_before_sync=%lld\n", taken());
    CK(cuStreamSynchronize(s));
    printf("async_free_after_sync=%lld\n", taken());

    /* A pool that keeps everything it had: its cache stays charged until trimmed. */
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = dev;
    CUmemoryPool pool;
    CK(cuMemPoolCreate(&pool, &props));
    cuuint64_t keep = ~0ull, used = 0, reserved = 0;
    CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep));
    mark();
    CK(cuMemAllocFromPoolAsync(&p, 24 * MiB, pool, s));
    printf("pool=%lld\n", taken());
    CK(cuMemFreeAsync(p, s));
    CK(cuStreamSynchronize(s));
    CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used));
    CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
    printf("pool_after_free_sync=%lld\npool_used=%llu\npool_reserved=%llu\n", taken(), (unsigned long long)used,
           (unsigned long long)reserved);
    mark();
    CK(cuMemAllocFromPoolAsync(&p, 16 * MiB, pool, s)); /* served from the cache */
    printf("pool_reuse=%lld\n", taken());
    CK(cuMemFreeAsync(p, s));
    mark();
    CK(cuMemPoolTrimTo(pool, 0));
    printf("pool_trim=%lld\n", taken());
    CK(cuMemPoolDestroy(pool));
    CK(cuStreamDestroy(s));
}

static void vmm(CUdevice dev) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    printf("granularity=%zu\n", gran);
    CUmemGenericAllocationHandle h;
    printf("vmm_unaligned=%d\n", (int)cuMemCreate(&h, gran + 1, &prop, 0));
    mark();
    CK(cuMemCreate(&h, 4 * gran, &prop, 0));
    printf("vmm_create=%lld\n", taken());
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, 8 * gran, 0, 0, 0));
    CK(cuMemMap(va, 4 * gran, 0, h, 0));
    CK(cuMemMap(va + 4 * gran, 4 * gran, 0, h, 0)); /* the same memory, twice */
    unsigned int word = 0x5eed;
    printf("vmm_copy_before_access=%d\n", (int)cuMemcpyHtoD(va, &word, sizeof word));
    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CK(cuMemSetAccess(va, 8 * gran, &access, 1));
    CK(cuMemsetD32(va, 0xabcdef01u, 4 * gran / 4));
    unsigned int back = 0;
    CK(cuMemcpyDtoH(&back, va + 4 * gran + 64, sizeof back)); /* the alias sees the memset */
    printf("vmm_alias_ok=%d\n", back == 0xabcdef01u);
    CK(cuMemcpyDtoD(va + 4 * gran - 8, va, 16)); /* a copy across two mappings */
    mark();
    CK(cuMemRelease(h));
    printf("vmm_release_mapped=%lld\n", taken());
    CK(cuMemUnmap(va, 4 * gran));
    printf("vmm_unmap_one=%lld\n", taken());
    CK(cuMemUnmap(va + 4 * gran, 4 * gran));
    printf("vmm_unmap_all=%lld\n", taken());
    CK(cuMemAddressFree(va, 8 * gran));
    printf("vmm_release_twice=%d\n", (int)cuMemRelease(h));
}

static void data(void) {
    enum { N = 1 << 20 };
    static unsigned char src[N], dst[N];
    for (int i = 0; i < N; i++) src[i] = (unsigned char)(i * 7 + 3);
    CUdeviceptr a, b;
    CK(cuMemAlloc(&a, N));
    CK(cuMemAlloc(&b, N));
    CK(cuMemcpyHtoD(a, src, N));
    CK(cuMemcpyDtoD(b, a, N));
    CK(cuMemcpyDtoH(dst, b, N));
    printf("roundtrip_ok=%d\n", memcmp(src, dst, N) == 0);
    CUstream s;
    CK(cuStreamCreate(&s, 0));
    CK(cuMemsetD8Async(a, 0x5a, N, s));
    CK(cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, a, N, s));
    CK(cuStreamSynchronize(s));
    int all = 1;
    for (int i = 0; i < N; i++) all &= dst[i] == 0x5a;
    printf("memset8_ok=%d\n", all);
    CK(cuMemsetD32(b + 4, 0x01020304u, 2));
    unsigned int w[4] = {0};
    CK(cuMemcpyDtoH(w, b, sizeof w));
    printf("memset32_ok=%d\n", w[1] == 0x01020304u && w[2] == 0x01020304u && w[3] != 0x01020304u);
    printf("memset32_misaligned=%d\n", (int)cuMemsetD32(b + 2, 0, 1));
    printf("copy_past_end=%d\n", (int)cuMemcpyHtoD(a + N - 4, src, 8));
    printf("copy_to_host_pointer=%d\n", (int)cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, 8));
    CK(cuMemFree(a));
    printf("free_twice=%d\n", (int)cuMemFree(a));
    printf("free_null=%d\nfree_host_null=%d\n", (int)cuMemFree(0), (int)cuMemFreeHost(NULL));
    printf("free_unknown=%d\n", (int)cuMemFree((CUdeviceptr)(uintptr_t)src));
    printf("free_interior=%d\n", (int)cuMemFree(b + 16));
    CK(cuMemFree(b));
    CK(cuStreamDestroy(s));
}

int main(int argc, char **argv) {
    int ordinal = argc > 1 ? atoi(argv[1]) : 0;
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, ordinal));
    use_primary(ordinal);
    contexts(dev);
    device_memory();
    stream_ordered(dev);
    vmm(dev);
    data();
    printf("done=1\n");
    return 0;
}
