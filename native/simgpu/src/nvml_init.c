/* Simulated NVML: library init/shutdown, error strings, system versions, shared checks. */
#include <stdio.h>
#include <string.h>

#include "nvml_internal.h"

struct nvml_lib nvml_lib = {.mu = PTHREAD_MUTEX_INITIALIZER};

nvmlReturn_t nvml_ready(void) {
    return atomic_load_explicit(&nvml_lib.refs, memory_order_acquire) ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

nvmlReturn_t nvml_device_any(nvmlDevice_t device) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    /* Compare addresses, never dereference first: a stale or foreign pointer is refused. */
    uintptr_t p = (uintptr_t)device, lo = (uintptr_t)&nvml_lib.devices[0];
    uintptr_t hi = (uintptr_t)&nvml_lib.devices[nvml_lib.count];
    if (!device || p < lo || p >= hi || (p - lo) % sizeof(struct nvmlDevice_st) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvml_device(nvmlDevice_t device, const struct simgpu_gpu_config **cfg) {
    nvmlReturn_t rc = nvml_device_any(device);
    if (rc != NVML_SUCCESS) return rc;
    if (simgpu_gpu_lost(device->phys)) return NVML_ERROR_GPU_IS_LOST;
    if (cfg) *cfg = &simgpu_node()->gpus[device->phys].cfg;
    return NVML_SUCCESS;
}

nvmlReturn_t nvml_put_string(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (n + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* --- init / shutdown ---------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    /* NO_GPUS: we initialize with zero visible GPUs anyway (as a container given "none" does);
     * NO_ATTACH: handles cost nothing here. Both are accepted and change nothing. */
    (void)flags;
    if (!simgpu_node()) return NVML_ERROR_DRIVER_NOT_LOADED; /* no node: as if no driver */
    pthread_mutex_lock(&nvml_lib.mu);
    if (atomic_load(&nvml_lib.refs) == 0) {
        /* The view is fixed at the first init, like the real library's device list: the
         * runtime's NVIDIA_VISIBLE_DEVICES decides which GPUs exist for this process.
         * CUDA_VISIBLE_DEVICES is the CUDA driver's business, ignored here as NVML does. */
        uint32_t map[SIMGPU_MAX_GPUS];
        uint32_t n = simgpu_visible_gpus(map);
        for (uint32_t i = 0; i < n; i++) {
            nvml_lib.devices[i].index = i;
            nvml_lib.devices[i].phys = map[i];
        }
        nvml_lib.count = n;
    }
    atomic_fetch_add_explicit(&nvml_lib.refs, 1, memory_order_release);
    pthread_mutex_unlock(&nvml_lib.mu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

/* The NVML 1 entry point: it attached every GPU eagerly; for us the same as _v2. */
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&nvml_lib.mu);
    nvmlReturn_t rc = NVML_ERROR_UNINITIALIZED;
    if (atomic_load(&nvml_lib.refs) > 0) {
        atomic_fetch_sub(&nvml_lib.refs, 1);
        rc = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&nvml_lib.mu);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "vGPU operation not supported while ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* --- system ------------------------------------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = nvml_ready();
    return rc != NVML_SUCCESS ? rc : nvml_put_string(version, length, SIMGPU_DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    /* NVML's own version: "<CUDA major>.<driver version>", e.g. "13.580.95.05". */
    char buf[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    snprintf(buf, sizeof buf, "%d.%s", SIMGPU_CUDA_VERSION / 1000, SIMGPU_DRIVER_VERSION);
    return nvml_put_string(version, length, buf);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = SIMGPU_CUDA_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}
