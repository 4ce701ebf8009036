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

/* Create an array (3D descriptor) and print what it charged, destroy it and print what came
 * back; a refused shape prints its error as <name>=<rc> instead. */
static void array3d(const char *name, size_t w, size_t h, size_t d, CUarray_format f, unsigned int ch,
                    unsigned int flags) {
    CUDA_ARRAY3D_DESCRIPTOR a = {.Width = w, .Height = h, .Depth = d, .Format = f, .NumChannels = ch, .Flags = flags};
    CUarray arr;
    mark();
    CUresult rc = cuArray3DCreate(&arr, &a);
    if (rc != CUDA_SUCCESS) {
        printf("%s_refused=%d\n", name, (int)rc);
        return;
    }
    printf("%s=%lld\n", name, taken());
    mark();
    CK(cuArrayDestroy(arr));
    printf("%s_free=%lld\n", name, taken());
}

static CUmipmappedArray mipmap(const char *name, size_t w, size_t h, size_t d, CUarray_format f, unsigned int flags,
                               unsigned int levels) {
    CUDA_ARRAY3D_DESCRIPTOR a = {.Width = w, .Height = h, .Depth = d, .Format = f, .NumChannels = 1, .Flags = flags};
    CUmipmappedArray m;
    mark();
    CK(cuMipmappedArrayCreate(&m, &a, levels));
    printf("%s=%lld\n", name, taken());
    return m;
}

static void mipmap_once(const char *name, size_t w, size_t h, size_t d, CUarray_format f, unsigned int flags,
                        unsigned int levels) {
    CUmipmappedArray m = mipmap(name, w, h, d, f, flags, levels);
    char key[96];
    snprintf(key, sizeof key, "%s_free", name);
    mark();
    CK(cuMipmappedArrayDestroy(m));
    printf("%s=%lld\n", key, taken());
}

/* Layers and cubemap faces count in full; the shapes the driver refuses are refused. */
static void array_shapes(void) {
    array3d("layered1d", 1024, 0, 64, CU_AD_FORMAT_FLOAT, 4, CUDA_ARRAY3D_LAYERED);
    array3d("layered2d", 256, 256, 16, CU_AD_FORMAT_UNSIGNED_INT8, 4, CUDA_ARRAY3D_LAYERED);
    array3d("cubemap", 512, 512, 6, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP);
    array3d("cubemap_layered", 256, 256, 12, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP | CUDA_ARRAY3D_LAYERED);
    array3d("bad_cubemap_square", 512, 256, 6, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP);
    array3d("bad_cubemap_faces", 512, 512, 5, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP);
    array3d("bad_cubemap_layers", 256, 256, 9, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_CUBEMAP | CUDA_ARRAY3D_LAYERED);
    array3d("bad_layered_no_layers", 256, 256, 0, CU_AD_FORMAT_FLOAT, 1, CUDA_ARRAY3D_LAYERED);
    array3d("bad_1d_depth", 256, 0, 4, CU_AD_FORMAT_FLOAT, 1, 0);
}

/* Level l of a mipmapped array: max(1, extent >> l) per spatial dimension. */
static void mipmaps(CUdevice dev) {
    char name[64];
    for (unsigned int n = 0; n <= 12; n++) { /* 1024 x 256: 11 levels at most */
        snprintf(name, sizeof name, "mip2d_%u", n);
        mipmap_once(name, 1024, 256, 0, CU_AD_FORMAT_FLOAT, 0, n);
    }
    mipmap_once("mip3d", 64, 32, 16, CU_AD_FORMAT_UNSIGNED_INT8, 0, 99);
    mipmap_once("mip1d", 1000, 0, 0, CU_AD_FORMAT_UNSIGNED_INT16, 0, 4);
    mipmap_once("mip_cubemap", 256, 256, 6, CU_AD_FORMAT_FLOAT, CUDA_ARRAY3D_CUBEMAP, 3);
    mipmap_once("mip_layered", 128, 128, 10, CU_AD_FORMAT_FLOAT, CUDA_ARRAY3D_LAYERED, 4);

    /* Levels are the mipmapped array's: the same handle each time, not destroyable apart. */
    CUmipmappedArray m = mipmap("mip_levels", 64, 64, 0, CU_AD_FORMAT_FLOAT, 0, 3);
    CUarray l0, l0_again, l2;
    CK(cuMipmappedArrayGetLevel(&l0, m, 0));
    CK(cuMipmappedArrayGetLevel(&l0_again, m, 0));
    CK(cuMipmappedArrayGetLevel(&l2, m, 2));
    printf("mip_level_same=%d\nmip_level_distinct=%d\n", l0 == l0_again, l0 != l2);
    printf("mip_level_past_last=%d\n", (int)cuMipmappedArrayGetLevel(&l2, m, 3));
    mark();
    printf("mip_level_destroy=%d\n", (int)cuArrayDestroy(l0));
    printf("mip_level_destroy_freed=%lld\n", taken());
    mark();
    CK(cuMipmappedArrayDestroy(m));
    printf("mip_levels_free=%lld\n", taken());
    printf("mip_destroy_twice=%d\n", (int)cuMipmappedArrayDestroy(m));

    /* A context's destruction frees its mipmapped arrays with the rest of its memory. */
    CUcontext own;
    mark();
    CK(cuCtxCreate(&own, NULL, 0, dev));
    CUDA_ARRAY3D_DESCRIPTOR a = {.Width = 512, .Height = 512, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CK(cuMipmappedArrayCreate(&m, &a, 10));
    printf("mip_ctx=%lld\n", taken());
    CK(cuCtxDestroy(own));
    printf("mip_ctx_destroyed=%lld\n", taken());
}

/* Sparse and deferred-mapping arrays have no memory of their own; cuMemCreate tile pools
 * bound into them with cuMemMapArrayAsync do, charged when created. */
static void sparse(CUdevice dev) {
    CUDA_ARRAY3D_DESCRIPTOR big = {.Width = 4096, .Height = 4096, .Depth = 64, .Format = CU_AD_FORMAT_FLOAT,
                                   .NumChannels = 4, .Flags = CUDA_ARRAY3D_SPARSE}; /* 16 GiB */
    CUarray sp, deferred, dense;
    CUmipmappedArray spm;
    mark();
    CK(cuArray3DCreate(&sp, &big));
    printf("sparse=%lld\n", taken());
    big.Flags = CUDA_ARRAY3D_DEFERRED_MAPPING;
    CK(cuArray3DCreate(&deferred, &big));
    printf("deferred=%lld\n", taken());
    CUDA_ARRAY3D_DESCRIPTOR mip = {.Width = 8192, .Height = 8192, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4,
                                   .Flags = CUDA_ARRAY3D_SPARSE};
    CK(cuMipmappedArrayCreate(&spm, &mip, 14));
    printf("sparse_mipmapped=%lld\n", taken());
    CUDA_ARRAY3D_DESCRIPTOR small = {.Width = 64, .Height = 64, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CK(cuArray3DCreate(&dense, &small));

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    CUmemGenericAllocationHandle plain, tiles, tiles2;
    CK(cuMemCreate(&plain, 2 * MiB, &prop, 0));
    prop.allocFlags.usage = CU_MEM_CREATE_USAGE_TILE_POOL;
    mark();
    CK(cuMemCreate(&tiles, 8 * MiB, &prop, 0));
    CK(cuMemCreate(&tiles2, 4 * MiB, &prop, 0));
    printf("tile_pools=%lld\n", taken());

    CUarrayMapInfo info;
    memset(&info, 0, sizeof info);
    info.resourceType = CU_RESOURCE_TYPE_ARRAY;
    info.resource.array = sp;
    info.subresourceType = CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL;
    info.subresource.sparseLevel.extentWidth = info.subresource.sparseLevel.extentHeight = 64;
    info.subresource.sparseLevel.extentDepth = 1;
    info.memOperationType = CU_MEM_OPERATION_TYPE_MAP;
    info.memHandleType = CU_MEM_HANDLE_TYPE_GENERIC;
    info.memHandle.memHandle = tiles;
    info.deviceBitMask = 1u << dev;
    CUarrayMapInfo bad = info;
    bad.resource.array = dense;
    printf("map_dense=%d\n", (int)cuMemMapArrayAsync(&bad, 1, NULL));
    bad = info;
    bad.memHandle.memHandle = plain;
    printf("map_not_tile_pool=%d\n", (int)cuMemMapArrayAsync(&bad, 1, NULL));
    bad = info;
    bad.deviceBitMask = 1u << (dev + 1);
    printf("map_other_device=%d\n", (int)cuMemMapArrayAsync(&bad, 1, NULL));
    bad = info;
    bad.resourceType = CU_RESOURCE_TYPE_MIPMAPPED_ARRAY;
    bad.resource.mipmap = spm;
    bad.subresource.sparseLevel.level = 14;
    printf("map_past_last_level=%d\n", (int)cuMemMapArrayAsync(&bad, 1, NULL));
    CUarrayMapInfo both[2] = {info, info};
    both[1].resource.array = deferred;
    both[1].memHandle.memHandle = tiles2;
    mark();
    CK(cuMemMapArrayAsync(both, 2, NULL));
    printf("map=%lld\n", taken());

    /* Bound memory outlives its handle's release until unbound or its array goes. */
    CK(cuMemRelease(tiles));
    CK(cuMemRelease(tiles2));
    printf("bound_release=%lld\n", taken());
    mark();
    CUarrayMapInfo unmap = both[1];
    unmap.memOperationType = CU_MEM_OPERATION_TYPE_UNMAP;
    unmap.memHandle.memHandle = 0;
    CK(cuMemMapArrayAsync(&unmap, 1, NULL));
    printf("unmap=%lld\n", taken());
    mark();
    CK(cuArrayDestroy(sp));
    printf("bound_array_destroy=%lld\n", taken());
    mark();
    CK(cuArrayDestroy(deferred));
    CK(cuMipmappedArrayDestroy(spm));
    CK(cuArrayDestroy(dense));
    CK(cuMemRelease(plain));
    printf("sparse_rest_free=%lld\n", taken());
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
    array_shapes();
    mipmaps(dev);
    sparse(dev);
    stream_ordered(dev);
    vmm(dev);
    data();
    printf("done=1\n");
    return 0;
}
