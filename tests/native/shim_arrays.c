/* Arrays through the shim: what each kind is charged against the limit and gives back.
 *
 *   shim_arrays <mode> <ordinal>
 *
 * Prints "<step>=<bytes charged>" (the drop of the container's free memory as cuMemGetInfo
 * reports it through the shim; negative: given back) and "<step>_rc=<CUresult>" where a call
 * may be refused: layered and cubemap arrays, a mipmapped array and its levels, one in a
 * context that is then destroyed, one over the limit, and sparse and deferred-mapping arrays
 * with a cuMemCreate tile pool bound into them. */
#include "shim_test.h"

#define MiB (1ull << 20)

static long long g_mark;

static long long used(void) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    return (long long)t - (long long)f;
}

static void mark(void) { g_mark = used(); }
static long long taken(void) { return used() - g_mark; }

static CUresult array3d(CUarray *a, size_t w, size_t h, size_t d, unsigned int flags) {
    CUDA_ARRAY3D_DESCRIPTOR desc = {.Width = w, .Height = h, .Depth = d, .Format = CU_AD_FORMAT_FLOAT,
                                    .NumChannels = 4, .Flags = flags};
    return C(array3d_create, cuArray3DCreate)(a, &desc);
}

static CUresult mipmapped(CUmipmappedArray *m, size_t w, size_t h, size_t d, unsigned int flags, unsigned int n) {
    CUDA_ARRAY3D_DESCRIPTOR desc = {.Width = w, .Height = h, .Depth = d, .Format = CU_AD_FORMAT_FLOAT,
                                    .NumChannels = 4, .Flags = flags};
    return C(mip_create, cuMipmappedArrayCreate)(m, &desc, n);
}

/* Depth counts in full for layers and cubemap faces. */
static void shape(const char *name, size_t w, size_t h, size_t d, unsigned int flags) {
    CUarray a;
    mark();
    CK(array3d(&a, w, h, d, flags));
    printf("%s=%lld\n", name, taken());
    mark();
    CK(C(array_destroy, cuArrayDestroy)(a));
    printf("%s_free=%lld\n", name, taken());
}

static void mipmaps(CUdevice dev) {
    CUmipmappedArray m;
    CUarray level;
    mark();
    CK(mipmapped(&m, 256, 256, 6, CUDA_ARRAY3D_CUBEMAP, 3));
    printf("mip_cubemap=%lld\n", taken());
    CK(C(mip_level, cuMipmappedArrayGetLevel)(&level, m, 1));
    mark();
    printf("mip_level_destroy_rc=%d\n", (int)C(array_destroy, cuArrayDestroy)(level)); /* not its to free */
    printf("mip_level_destroy=%lld\n", taken());
    CK(C(mip_destroy, cuMipmappedArrayDestroy)(m));
    printf("mip_cubemap_free=%lld\n", taken());
    printf("mip_destroy_twice_rc=%d\n", (int)C(mip_destroy, cuMipmappedArrayDestroy)(m));

    /* Level 0 (640 MiB) fits in what is left of a 1 GiB limit, the two levels do not. */
    mark();
    printf("mip_over_rc=%d\n", (int)mipmapped(&m, 2048, 2048, 10, CUDA_ARRAY3D_LAYERED, 2));
    printf("mip_over=%lld\n", taken());

    CUcontext own;
    CK(C(ctx_create, cuCtxCreate)(&own, NULL, 0, dev));
    mark();
    CK(mipmapped(&m, 512, 512, 0, 0, 10));
    printf("mip_in_ctx=%lld\n", taken());
    mark();
    CK(C(ctx_destroy, cuCtxDestroy)(own)); /* its mipmapped array goes with it; the primary is current again */
    printf("mip_ctx_destroyed=%lld\n", taken());
}

/* Sparse and deferred-mapping arrays have no memory of their own; the tile pool bound into
 * them is charged, by cuMemCreate. */
static void sparse(CUdevice dev) {
    CUarray sp, deferred;
    CUmipmappedArray spm;
    mark();
    printf("sparse_rc=%d\n", (int)array3d(&sp, 4096, 4096, 64, CUDA_ARRAY3D_SPARSE)); /* 16 GiB */
    printf("deferred_rc=%d\n", (int)array3d(&deferred, 16384, 16384, 0, CUDA_ARRAY3D_DEFERRED_MAPPING));
    printf("sparse_mip_rc=%d\n", (int)mipmapped(&spm, 8192, 8192, 0, CUDA_ARRAY3D_SPARSE, 14));
    printf("sparse=%lld\n", taken());

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.allocFlags.usage = CU_MEM_CREATE_USAGE_TILE_POOL;
    CUmemGenericAllocationHandle tiles, more;
    mark();
    CK(C(mem_create, cuMemCreate)(&tiles, 64 * MiB, &prop, 0));
    printf("tile_pool=%lld\n", taken());
    CUarrayMapInfo info[2];
    memset(info, 0, sizeof info);
    for (int i = 0; i < 2; i++) {
        info[i].resourceType = CU_RESOURCE_TYPE_ARRAY;
        info[i].subresource.sparseLevel.extentWidth = info[i].subresource.sparseLevel.extentHeight = 64;
        info[i].subresource.sparseLevel.extentDepth = 1;
        info[i].memOperationType = CU_MEM_OPERATION_TYPE_MAP;
        info[i].memHandleType = CU_MEM_HANDLE_TYPE_GENERIC;
        info[i].memHandle.memHandle = tiles;
        info[i].deviceBitMask = 1u << dev;
    }
    info[0].resource.array = sp;
    info[1].resource.array = deferred;
    mark();
    CK(C(map_array, cuMemMapArrayAsync)(info, 2, NULL));
    printf("map=%lld\n", taken());
    /* The memory bound into sparse arrays still counts: 2 MiB more than the rest is refused. */
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    printf("tile_pool_over_rc=%d\n", (int)C(mem_create, cuMemCreate)(&more, f + 2 * MiB, &prop, 0));
    for (int i = 0; i < 2; i++) {
        info[i].memOperationType = CU_MEM_OPERATION_TYPE_UNMAP;
        info[i].memHandle.memHandle = 0;
    }
    CK(C(map_array, cuMemMapArrayAsync)(info, 2, NULL));
    mark();
    CK(C(mem_release, cuMemRelease)(tiles));
    printf("tile_pool_free=%lld\n", taken());
    mark();
    CK(C(array_destroy, cuArrayDestroy)(sp));
    CK(C(array_destroy, cuArrayDestroy)(deferred));
    CK(C(mip_destroy, cuMipmappedArrayDestroy)(spm));
    printf("sparse_free=%lld\n", taken());
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s <mode> <ordinal>\n", argv[0]);
        return 2;
    }
    CUdevice dev = shim_start(argv[1], atoi(argv[2]));
    long long start = used();
    shape("layered1d", 1024, 0, 64, CUDA_ARRAY3D_LAYERED);
    shape("layered2d", 256, 256, 16, CUDA_ARRAY3D_LAYERED);
    shape("cubemap", 512, 512, 6, CUDA_ARRAY3D_CUBEMAP);
    shape("cubemap_layered", 256, 256, 12, CUDA_ARRAY3D_CUBEMAP | CUDA_ARRAY3D_LAYERED);
    mipmaps(dev);
    sparse(dev);
    printf("end=%lld\n", used() - start);
    return 0;
}
