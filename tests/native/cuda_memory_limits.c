/* The driver's per-cgroup memory limit, as a C program sees it: NVML sets it
 * (nvmlDeviceSetMemoryLimits_v1, what the toolkit's apply-cuda-memory-limits hook calls) and
 * the CUDA driver holds this process's cgroup to it, contexts included.
 *
 * Usage: cuda_memory_limits HARD_MIB   with SIMGPU_CGROUP=<path> (the simulated cgroup) and
 * no NVIDIA_VISIBLE_DEVICES (NVML device i = CUDA device i = physical GPU i; two GPUs, each
 * with more than 2 x HARD_MIB). Checks NVML's errors itself (exit 1 on a failed check) and
 * prints one JSON object:
 *   {"context": B, "allocated_mib": N, "refused": RC, "used_at_limit": B, "soft": B,
 *    "hard": B, "gpu1_mib": N, "after_clear": RC}
 * NVML is reached through dlopen, as the toolkit's hook reaches the driver's library.
 */
#include <dlfcn.h>
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_test.h"

#define MIB (1ull << 20)
#define CHUNK (64 * MIB)

typedef nvmlReturn_t (*init_fn)(void);
typedef nvmlReturn_t (*handle_fn)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*set_fn)(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *);
typedef nvmlReturn_t (*get_fn)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *);

static set_fn set_limits;
static get_fn get_limits;
static int failures;

#define EXPECT(cond, ...)                                                          \
    do {                                                                           \
        if (!(cond)) {                                                             \
            fprintf(stderr, "cuda_memory_limits: FAIL line %d: ", __LINE__);      \
            fprintf(stderr, __VA_ARGS__);                                          \
            fputc('\n', stderr);                                                   \
            failures++;                                                            \
        }                                                                          \
    } while (0)

static nvmlReturn_t set(nvmlDevice_t dev, const char *ns, unsigned long long soft, unsigned long long hard) {
    nvmlSetMemoryLimits_v1_t l = {ns, soft, hard};
    return set_limits(dev, &l);
}

static nvmlReturn_t get(nvmlDevice_t dev, const char *ns, nvmlGetMemoryLimits_v1_t *out) {
    memset(out, 0, sizeof *out);
    out->nameSpace = ns;
    return get_limits(dev, out);
}

/* Allocates CHUNKs on the current context until refused; returns the count, *rc the refusal. */
static unsigned long long fill(CUresult *rc) {
    unsigned long long n = 0;
    CUdeviceptr p;
    while ((*rc = cuMemAlloc(&p, CHUNK)) == CUDA_SUCCESS) n++;
    return n;
}

int main(int argc, char **argv) {
    const char *cgroup = getenv("SIMGPU_CGROUP");
    if (argc != 2 || !cgroup) {
        fprintf(stderr, "usage: SIMGPU_CGROUP=<path> cuda_memory_limits HARD_MIB\n");
        return 2;
    }
    unsigned long long hard = strtoull(argv[1], NULL, 10) * MIB, soft = hard / 2;
    char ns[1024];
    snprintf(ns, sizeof ns, "/sys/fs/cgroup%s", cgroup);

    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) {
        fprintf(stderr, "cuda_memory_limits: %s\n", dlerror());
        return 2;
    }
    init_fn init = (init_fn)dlsym(nvml, "nvmlInit_v2");
    handle_fn handle = (handle_fn)dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    set_limits = (set_fn)dlsym(nvml, "nvmlDeviceSetMemoryLimits_v1");
    get_limits = (get_fn)dlsym(nvml, "nvmlDeviceGetMemoryLimits_v1");
    if (!init || !handle || !set_limits || !get_limits) {
        fprintf(stderr, "cuda_memory_limits: NVML lacks the memory-limit entry points\n");
        return 2;
    }
    nvmlDevice_t dev0, dev1;
    EXPECT(init() == NVML_SUCCESS, "nvmlInit");
    EXPECT(handle(0, &dev0) == NVML_SUCCESS && handle(1, &dev1) == NVML_SUCCESS, "two GPUs");

    /* NVML's answers, as its header documents them. */
    nvmlGetMemoryLimits_v1_t got;
    EXPECT(get(dev0, ns, &got) == NVML_ERROR_NOT_FOUND, "no limit yet: NOT_FOUND");
    EXPECT(set_limits(dev0, NULL) == NVML_ERROR_INVALID_ARGUMENT, "NULL limits");
    EXPECT(set(dev0, NULL, soft, hard) == NVML_ERROR_INVALID_ARGUMENT, "NULL nameSpace");
    EXPECT(set(dev0, "/tmp/not-a-cgroup", soft, hard) == NVML_ERROR_OPERATING_SYSTEM, "not a cgroup");
    EXPECT(set(dev0, ns, hard + 1, hard) == NVML_ERROR_INVALID_ARGUMENT, "soft above hard");
    EXPECT(set(dev0, ns, 0, NVML_DEVICE_MEMORY_LIMIT_MAX - 1) == NVML_ERROR_INVALID_ARGUMENT,
           "hard above the GPU's memory");
    EXPECT(set(NULL, ns, soft, hard) == NVML_ERROR_INVALID_ARGUMENT, "NULL device");
    EXPECT(get(dev0, ns, &got) == NVML_ERROR_NOT_FOUND, "refused sets set nothing");

    EXPECT(set(dev0, ns, soft, hard) == NVML_SUCCESS, "set");
    EXPECT(get(dev0, ns, &got) == NVML_SUCCESS, "get");
    EXPECT(got.softLimit == soft && got.hardLimit == hard && got.currentUsed == 0,
           "get: soft %llu hard %llu used %llu", got.softLimit, got.hardLimit, got.currentUsed);
    EXPECT(get(dev1, ns, &got) == NVML_ERROR_NOT_FOUND, "the limit is per GPU");

    /* CUDA under the limit: the context counts, then allocations until refused. */
    CK(cuInit(0));
    CUdevice d0, d1;
    CUcontext c0, c1;
    CK(cuDeviceGet(&d0, 0));
    CK(cuDeviceGet(&d1, 1));
    CK(cuCtxCreate(&c0, NULL, 0, d0));
    EXPECT(get(dev0, ns, &got) == NVML_SUCCESS, "get after the context");
    unsigned long long context = got.currentUsed;
    CUresult refused = CUDA_SUCCESS;
    unsigned long long chunks = fill(&refused);
    EXPECT(get(dev0, ns, &got) == NVML_SUCCESS, "get at the limit");
    unsigned long long at_limit = got.currentUsed;

    /* GPU 1 has no limit for this cgroup. */
    CK(cuCtxCreate(&c1, NULL, 0, d1));
    unsigned long long gpu1 = 0;
    CUdeviceptr p;
    while (gpu1 * CHUNK < 2 * hard && cuMemAlloc(&p, CHUNK) == CUDA_SUCCESS) gpu1++;

    /* Cleared (soft 0, hard MAX), the limit is gone and the driver allocates again. */
    CK(cuCtxSetCurrent(c0));
    EXPECT(set(dev0, ns, 0, NVML_DEVICE_MEMORY_LIMIT_MAX) == NVML_SUCCESS, "clear");
    EXPECT(get(dev0, ns, &got) == NVML_ERROR_NOT_FOUND, "cleared: NOT_FOUND");
    CUresult after_clear = cuMemAlloc(&p, CHUNK);

    printf("{\"context\": %llu, \"allocated_mib\": %llu, \"refused\": %d, \"used_at_limit\": %llu,"
           " \"soft\": %llu, \"hard\": %llu, \"gpu1_mib\": %llu, \"after_clear\": %d}\n",
           context, chunks * (CHUNK / MIB), (int)refused, at_limit, soft, hard, gpu1 * (CHUNK / MIB),
           (int)after_clear);
    return failures ? 1 : 0;
}
