/* Simulated NVML: the driver's per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 and
 * nvmlDeviceGetMemoryLimits_v1, NVML 13.4+). What the NVIDIA container toolkit's
 * apply-cuda-memory-limits hook calls for a container's cgroup; the node holds the limits
 * (cgroup_limits.c) and refuses, with CUDA_ERROR_OUT_OF_MEMORY, a charge (allocation or
 * context) that would take the cgroup's usage on the GPU over its hard limit. */
#include <stdlib.h>

#include "nvml_internal.h"

/* SIMGPU_NO_MEMORY_LIMITS=1: a node whose driver has the entry points but not the feature
 * (NVML answers NOT_SUPPORTED), so the "unsupported" paths of the hook and the shim are
 * testable. */
static int limits_unsupported(void) {
    const char *knob = getenv("SIMGPU_NO_MEMORY_LIMITS");
    return knob && knob[0] == '1';
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (limits_unsupported()) return NVML_ERROR_NOT_SUPPORTED;
    if (!limits || !limits->nameSpace) return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_cgroup_id cgroup;
    /* The real driver opens the path; ours takes the directory where there is one, else the
     * path under /sys/fs/cgroup (simulated cgroups need not exist). */
    if (simgpu_cgroup_of_namespace(limits->nameSpace, &cgroup) != 0) return NVML_ERROR_OPERATING_SYSTEM;
    switch (simgpu_cgroup_limit_set(device->phys, &cgroup, limits->softLimit, limits->hardLimit)) {
    case SIMGPU_LIMIT_OK:
        return NVML_SUCCESS;
    case SIMGPU_LIMIT_INVALID:
        return NVML_ERROR_INVALID_ARGUMENT; /* soft > hard, or above the GPU's memory */
    case SIMGPU_LIMIT_FULL:
        return NVML_ERROR_INSUFFICIENT_RESOURCES;
    default:
        return NVML_ERROR_UNKNOWN;
    }
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (limits_unsupported()) return NVML_ERROR_NOT_SUPPORTED;
    if (!limits || !limits->nameSpace) return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_cgroup_id cgroup;
    if (simgpu_cgroup_of_namespace(limits->nameSpace, &cgroup) != 0) return NVML_ERROR_OPERATING_SYSTEM;
    uint64_t soft = 0, hard = 0, used = 0;
    switch (simgpu_cgroup_limit_get(device->phys, &cgroup, &soft, &hard, &used)) {
    case SIMGPU_LIMIT_OK:
        limits->softLimit = soft;
        limits->hardLimit = hard;
        limits->currentUsed = used;
        return NVML_SUCCESS;
    case SIMGPU_LIMIT_NONE:
        return NVML_ERROR_NOT_FOUND;
    default:
        return NVML_ERROR_UNKNOWN;
    }
}
