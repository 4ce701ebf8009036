/* What a process sees of GPU memory through the shim: cuMemGetInfo, cuDeviceTotalMem and
 * NVML's memory info, around an allocation and a second context.
 *
 *   shim_views <mode> <ordinal> <alloc-bytes> [ctx] [reset] [hold]
 *   shim_views nvml <count>          NVML only (no CUDA call at all): devices 0..count-1
 *   shim_views nvml-cuda <ordinal> <alloc-bytes> [init]
 *                                    NVML first (before_, NVML index <ordinal>; with init,
 *                                    after the program's own cuInit), then CUDA as in
 *                                    "handle" mode, then NVML again (after_, by CUDA's UUID)
 *
 * The NVML modes print libcuda_mapped (is libcuda.so in /proc/self/maps?) after NVML alone.
 *
 * Prints start_free/start_total (after the primary context), total_mem, then after the
 * allocation free/total and nvml_{total,used,free} (v1) and nvml2_{total,used,free,reserved};
 * with ctx, ctx_free after a second context and ctx_gone_free after destroying it; with hold,
 * "holding" and waits for stdin to close; with reset, releases the primary context (its
 * memory goes with it), retains it again and prints reset_free/reset_total. NVML is reached through dlopen + dlsym, as pynvml
 * does. */
#include <nvml.h>

#include "shim_test.h"

static struct {
    __typeof__(nvmlInit_v2) *init;
    __typeof__(nvmlDeviceGetHandleByUUID) *by_uuid;
    __typeof__(nvmlDeviceGetHandleByIndex_v2) *by_index;
    __typeof__(nvmlDeviceGetMemoryInfo) *info;
    __typeof__(nvmlDeviceGetMemoryInfo_v2) *info2;
    __typeof__(nvmlDeviceGetUUID) *uuid;
} nv;

static int libcuda_mapped(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4096];
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f)) found = strstr(line, "libcuda.so") != NULL;
    if (f) fclose(f);
    return found;
}

static void nvml_load(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen libnvidia-ml.so.1: %s\n", dlerror());
        exit(3);
    }
    nv.init = (__typeof__(nv.init))dlsym(h, "nvmlInit_v2");
    nv.by_uuid = (__typeof__(nv.by_uuid))dlsym(h, "nvmlDeviceGetHandleByUUID");
    nv.by_index = (__typeof__(nv.by_index))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    nv.info = (__typeof__(nv.info))dlsym(h, "nvmlDeviceGetMemoryInfo");
    nv.info2 = (__typeof__(nv.info2))dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
    nv.uuid = (__typeof__(nv.uuid))dlsym(h, "nvmlDeviceGetUUID");
    if (!nv.init || nv.init() != NVML_SUCCESS) exit(3);
}

static void nvml_print(const char *prefix, nvmlDevice_t d) {
    nvmlMemory_t m;
    nvmlMemory_v2_t m2;
    memset(&m2, 0, sizeof m2);
    m2.version = nvmlMemory_v2;
    if (nv.info(d, &m) != NVML_SUCCESS || nv.info2(d, &m2) != NVML_SUCCESS) exit(11);
    printf("%snvml_total=%llu\n%snvml_used=%llu\n%snvml_free=%llu\n", prefix, m.total, prefix, m.used, prefix, m.free);
    printf("%snvml2_total=%llu\n%snvml2_used=%llu\n%snvml2_free=%llu\n%snvml2_reserved=%llu\n", prefix, m2.total,
           prefix, m2.used, prefix, m2.free, prefix, m2.reserved);
}

static void cuda_view(const char *prefix) {
    size_t f, t;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    printf("%sfree=%zu\n%stotal=%zu\n", prefix, f, prefix, t);
}

static void format_uuid(const CUuuid *u, char out[96]) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 96, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* A device seen through NVML before the process uses CUDA, then through both. */
static int nvml_then_cuda(int argc, char **argv) {
    int ordinal = atoi(argv[2]);
    if (argc > 4 && !strcmp(argv[4], "init")) {
        /* The program's own cuInit, through no hooked name: the shim is not told. */
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        CUresult (*init)(unsigned) = h ? (CUresult(*)(unsigned))dlsym(h, "cuInit") : NULL;
        if (!init || init(0) != CUDA_SUCCESS) return 3;
    }
    nvml_load();
    nvmlDevice_t nd;
    char uuid[96];
    if (nv.by_index((unsigned)ordinal, &nd) != NVML_SUCCESS || nv.uuid(nd, uuid, sizeof uuid) != NVML_SUCCESS)
        return 12;
    nvml_print("before_", nd);
    printf("before_uuid=%s\nlibcuda_mapped=%d\n", uuid, libcuda_mapped());
    CUdevice dev = shim_start("handle", ordinal);
    size_t bytes = strtoull(argv[3], NULL, 0);
    CUdeviceptr p = 0;
    if (bytes) CK(C(alloc, cuMemAlloc)(&p, bytes));
    cuda_view("");
    CUuuid u;
    CK(C(device_uuid, cuDeviceGetUuid)(&u, dev));
    format_uuid(&u, uuid);
    printf("cuda_uuid=%s\n", uuid);
    if (nv.by_uuid(uuid, &nd) != NVML_SUCCESS) return 12;
    nvml_print("after_", nd);
    if (p) CK(C(free, cuMemFree)(p));
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "nvml")) {
        nvml_load();
        for (unsigned i = 0; i < (unsigned)atoi(argv[2]); i++) {
            nvmlDevice_t d;
            char prefix[16];
            if (nv.by_index(i, &d) != NVML_SUCCESS) return 12;
            snprintf(prefix, sizeof prefix, "gpu%u_", i);
            nvml_print(prefix, d);
        }
        printf("libcuda_mapped=%d\n", libcuda_mapped());
        return 0;
    }
    if (argc >= 4 && !strcmp(argv[1], "nvml-cuda")) return nvml_then_cuda(argc, argv);
    if (argc < 4) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <alloc-bytes> [ctx] [hold]\n", argv[0]);
        return 2;
    }
    CUdevice dev = shim_start(argv[1], atoi(argv[2]));
    int ctx = 0, hold = 0, reset = 0;
    for (int i = 4; i < argc; i++) {
        ctx |= !strcmp(argv[i], "ctx");
        hold |= !strcmp(argv[i], "hold");
        reset |= !strcmp(argv[i], "reset");
    }
    cuda_view("start_");
    size_t total = 0;
    CK(C(total_mem, cuDeviceTotalMem)(&total, dev));
    printf("total_mem=%zu\n", total);
    size_t bytes = strtoull(argv[3], NULL, 0);
    CUdeviceptr p = 0;
    if (bytes) CK(C(alloc, cuMemAlloc)(&p, bytes));
    cuda_view("");
    CUuuid u;
    CK(C(device_uuid, cuDeviceGetUuid)(&u, dev));
    char uuid[96];
    format_uuid(&u, uuid);
    nvml_load();
    nvmlDevice_t nd;
    if (nv.by_uuid(uuid, &nd) != NVML_SUCCESS) return 12;
    nvml_print("", nd);
    if (ctx) {
        CUcontext c2;
        CK(C(ctx_create, cuCtxCreate_v4)(&c2, NULL, 0, dev));
        cuda_view("ctx_");
        CK(C(ctx_destroy, cuCtxDestroy)(c2));
        cuda_view("ctx_gone_");
    }
    fflush(stdout);
    if (hold) {
        printf("holding\n");
        fflush(stdout);
        while (getchar() != EOF) {
        }
    }
    if (reset) {
        CUcontext primary;
        CK(C(release, cuDevicePrimaryCtxRelease)(dev)); /* the last reference: p goes too */
        CK(C(retain, cuDevicePrimaryCtxRetain)(&primary, dev));
        CK(C(set_current, cuCtxSetCurrent)(primary));
        cuda_view("reset_");
        p = 0;
    }
    if (p) CK(C(free, cuMemFree)(p));
    return 0;
}
