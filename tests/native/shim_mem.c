/* Memory through the shim: allocate on one path until refused, optionally hold the memory
 * until stdin closes, then free everything.
 *
 *   shim_mem <mode> <ordinal> <path> <chunk-bytes> <max-count> [hold] [gate]
 *
 * path: alloc alloc_v1 pitch managed async async_ptsz pool pool_ptsz vmm array array3d mipmapped
 * (alloc_v1: the 32-bit cuMemAlloc of CUDA < 3.2, found by name; mipmapped: levels whose sum
 * is the chunk, a multiple of 1 MiB)
 * With gate: print "ready" once the context exists and wait for a line on stdin first, so
 * that several processes allocate at once.
 * Prints allocated=<bytes> count=<n> refusal=<CUresult of the refused call, 0 if none>,
 * view_free/view_total (cuMemGetInfo) while holding, then freed=<n> and the view after. */
#include "shim_test.h"

struct obj {
    CUdeviceptr p;
    CUarray a;
    CUmipmappedArray m;
    CUmemGenericAllocationHandle h;
};

static CUmemoryPool g_pool;
static CUstream g_stream;

static CUresult alloc_one(const char *path, int ordinal, size_t bytes, struct obj *o) {
    memset(o, 0, sizeof *o);
    if (!strcmp(path, "alloc")) return C(alloc, cuMemAlloc)(&o->p, bytes);
    if (!strcmp(path, "alloc_v1")) {
        CUresult (*v1)(unsigned int *, unsigned int) =
            (CUresult(*)(unsigned int *, unsigned int))dlsym(g_lib, "cuMemAlloc");
        unsigned int p32 = 0;
        CUresult rc = v1 ? v1(&p32, (unsigned int)bytes) : CUDA_ERROR_NOT_FOUND;
        o->p = p32;
        return rc;
    }
    if (!strcmp(path, "pitch")) {
        size_t pitch = 0;
        return C(alloc_pitch, cuMemAllocPitch)(&o->p, &pitch, bytes / 16, 16, 4);
    }
    if (!strcmp(path, "managed")) return C(alloc_managed, cuMemAllocManaged)(&o->p, bytes, CU_MEM_ATTACH_GLOBAL);
    if (!strcmp(path, "async")) return C(alloc_async, cuMemAllocAsync)(&o->p, bytes, g_stream);
    if (!strcmp(path, "async_ptsz")) return C(alloc_async_ptsz, cuMemAllocAsync)(&o->p, bytes, NULL);
    if (!strcmp(path, "pool") || !strcmp(path, "pool_ptsz")) {
        if (!g_pool) {
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = ordinal;
            CK(C(pool_create, cuMemPoolCreate)(&g_pool, &props));
        }
        return !strcmp(path, "pool") ? C(alloc_pool, cuMemAllocFromPoolAsync)(&o->p, bytes, g_pool, g_stream)
                                     : C(alloc_pool_ptsz, cuMemAllocFromPoolAsync)(&o->p, bytes, g_pool, NULL);
    }
    if (!strcmp(path, "vmm")) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal;
        return C(mem_create, cuMemCreate)(&o->h, bytes, &prop, 0);
    }
    if (!strcmp(path, "array")) {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = bytes / 64, .Height = 16, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        return C(array_create, cuArrayCreate)(&o->a, &d);
    }
    if (!strcmp(path, "array3d")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = bytes / 128, .Height = 8, .Depth = 4,
                                     .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 4};
        return C(array3d_create, cuArray3DCreate)(&o->a, &d);
    }
    if (!strcmp(path, "mipmapped")) {
        /* 2D layered, 4 levels of 256 x 193, 128 x 96, 64 x 48, 32 x 24: 65536 elements per
         * layer (layers do not shrink), 16 bytes each: 1 MiB per layer. */
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 256, .Height = 193, .Depth = bytes >> 20,
                                     .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4, .Flags = CUDA_ARRAY3D_LAYERED};
        return C(mip_create, cuMipmappedArrayCreate)(&o->m, &d, 4);
    }
    fprintf(stderr, "unknown path %s\n", path);
    exit(2);
}

static void free_one(const char *path, struct obj *o) {
    if (o->a) CK(C(array_destroy, cuArrayDestroy)(o->a));
    else if (o->m) CK(C(mip_destroy, cuMipmappedArrayDestroy)(o->m));
    else if (!strcmp(path, "vmm")) CK(C(mem_release, cuMemRelease)(o->h));
    else if (!strcmp(path, "async") || !strcmp(path, "pool")) CK(C(free_async, cuMemFreeAsync)(o->p, g_stream));
    else if (!strcmp(path, "async_ptsz") || !strcmp(path, "pool_ptsz")) CK(C(free_async_ptsz, cuMemFreeAsync)(o->p, NULL));
    else if (!strcmp(path, "alloc_v1")) {
        CUresult (*v1)(unsigned int) = (CUresult(*)(unsigned int))dlsym(g_lib, "cuMemFree");
        CK(v1((unsigned int)o->p));
    } else CK(C(free, cuMemFree)(o->p));
}

static void view(const char *when) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    printf("%sview_free=%zu\n%sview_total=%zu\n", when, f, when, t);
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <path> <chunk> <max-count> [hold]\n", argv[0]);
        return 2;
    }
    int ordinal = atoi(argv[2]);
    const char *path = argv[3];
    size_t chunk = strtoull(argv[4], NULL, 0);
    long max = atol(argv[5]);
    int hold = 0, gate = 0;
    for (int i = 6; i < argc; i++) {
        hold |= !strcmp(argv[i], "hold");
        gate |= !strcmp(argv[i], "gate");
    }
    shim_start(argv[1], ordinal);
    CK(C(stream_create, cuStreamCreate)(&g_stream, CU_STREAM_NON_BLOCKING));
    if (gate) {
        printf("ready\n");
        fflush(stdout);
        while (getchar() != '\n') {
        }
    }
    struct obj *objs = calloc((size_t)max + 1, sizeof *objs);
    long n = 0;
    CUresult refusal = CUDA_SUCCESS;
    while (n < max) {
        refusal = alloc_one(path, ordinal, chunk, &objs[n]);
        if (refusal != CUDA_SUCCESS) break;
        n++;
    }
    printf("allocated=%llu\ncount=%ld\nrefusal=%d\n", (unsigned long long)chunk * (unsigned long long)n, n,
           (int)refusal);
    view("");
    fflush(stdout);
    if (hold) {
        printf("holding\n");
        fflush(stdout);
        while (getchar() != EOF) {
        }
    }
    for (long i = 0; i < n; i++) free_one(path, &objs[i]);
    CK(C(sync, cuCtxSynchronize)());
    free(objs);
    printf("freed=%ld\n", n);
    view("after_");
    return 0;
}
