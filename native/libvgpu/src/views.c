/* Views: what the container sees of a GPU's memory. total = min(limit, physical), used = the
 * container's charge (all its processes, contexts included), free = what it may still take
 * and the GPU still has. Clamped, never negative, and never an error the driver did not
 * give: on any problem on the shim's side the real answer passes through. */
#include <string.h>

#include "shim.h"

static void clamp(struct vgpu_dev *d, uint64_t *free_b, uint64_t *total) {
    VGPU_CODE_SETTLE(); /* what launches loaded is in the container's use */
    if (d->ordinal >= 0) vgpu_pools_reconcile(d); /* what pools released is free again */
    uint64_t limit = d->limit, used = vgpu_used(d);
    uint64_t room = used < limit ? limit - used : 0;
    if (*total > limit) *total = limit;
    if (*free_b > room) *free_b = room;
    if (*free_b > *total) *free_b = *total;
}

static struct vgpu_dev *viewed(void) {
    CUcontext ctx;
    struct vgpu_dev *d = vgpu.limited ? vgpu_ctx_dev(NULL, &ctx) : NULL;
    return d && d->accounted ? d : NULL;
}

/* One implementation for both ABIs of each view (v1: 32-bit sizes). */
static CUresult mem_info(int v1, void *free_bytes, void *total) {
    vgpu_ensure();
    if (UNLIKELY(v1 ? !vgpu.real.cuMemGetInfo : !vgpu.real.cuMemGetInfo_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = v1 ? vgpu.real.cuMemGetInfo(free_bytes, total) : vgpu.real.cuMemGetInfo_v2(free_bytes, total);
    struct vgpu_dev *d = rc == CUDA_SUCCESS && free_bytes && total ? viewed() : NULL;
    if (!d) return rc;
    uint64_t f = v1 ? *(unsigned int *)free_bytes : *(size_t *)free_bytes;
    uint64_t t = v1 ? *(unsigned int *)total : *(size_t *)total;
    clamp(d, &f, &t);
    if (v1) {
        *(unsigned int *)free_bytes = (unsigned int)f;
        *(unsigned int *)total = (unsigned int)t;
    } else {
        *(size_t *)free_bytes = (size_t)f;
        *(size_t *)total = (size_t)t;
    }
    return rc;
}

VGPU_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) { return mem_info(0, free_bytes, total); }

VGPU_API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total) { return mem_info(1, free_bytes, total); }

static struct vgpu_dev *viewed_device(CUdevice dev) {
    struct vgpu_dev *d = vgpu.limited ? vgpu_dev((int)dev) : NULL;
    return d && d->accounted ? d : NULL;
}

static CUresult total_mem(int v1, void *bytes, CUdevice dev) {
    vgpu_ensure();
    if (UNLIKELY(v1 ? !vgpu.real.cuDeviceTotalMem : !vgpu.real.cuDeviceTotalMem_v2)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = v1 ? vgpu.real.cuDeviceTotalMem(bytes, dev) : vgpu.real.cuDeviceTotalMem_v2(bytes, dev);
    struct vgpu_dev *d = rc == CUDA_SUCCESS && bytes ? viewed_device(dev) : NULL;
    if (!d) return rc;
    if (v1 && *(unsigned int *)bytes > d->limit) *(unsigned int *)bytes = (unsigned int)d->limit;
    if (!v1 && *(size_t *)bytes > d->limit) *(size_t *)bytes = (size_t)d->limit;
    return rc;
}

VGPU_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) { return total_mem(0, bytes, dev); }

VGPU_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) { return total_mem(1, bytes, dev); }

/* --- NVML: the GPU by its UUID ------------------------------------------------------------- */

static struct vgpu_dev *nvml_viewed(nvmlDevice_t device) {
    char uuid[VGPU_UUID_SIZE];
    vgpu_ensure_limits(); /* not libcuda: nvidia-smi and monitoring agents use NVML alone */
    if (!vgpu.limited || !vgpu.real.nvmlDeviceGetUUID ||
        vgpu.real.nvmlDeviceGetUUID(device, uuid, sizeof uuid) != NVML_SUCCESS)
        return NULL;
    struct vgpu_dev *d = vgpu_dev_by_uuid(uuid);
    return d && d->accounted ? d : NULL;
}

/* used is the container's; free is what it may still take (NVML's own free counts reserved
 * memory out, so the v2 form keeps total = reserved + used + free). */
static void nvml_clamp(struct vgpu_dev *d, unsigned long long *total, unsigned long long *used,
                       unsigned long long *free_b, unsigned long long reserved) {
    uint64_t t = *total, f = *free_b;
    clamp(d, &f, &t);
    uint64_t u = vgpu_used(d);
    if (u > t) u = t;
    if (reserved > t - u) reserved = t - u;
    if (f > t - u - reserved) f = t - u - reserved;
    *total = t;
    *used = u;
    *free_b = f;
}

VGPU_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    vgpu_nvml_load();
    if (UNLIKELY(!vgpu.real.nvmlDeviceGetMemoryInfo)) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = vgpu.real.nvmlDeviceGetMemoryInfo(device, memory);
    struct vgpu_dev *d = rc == NVML_SUCCESS && memory ? nvml_viewed(device) : NULL;
    if (d) nvml_clamp(d, &memory->total, &memory->used, &memory->free, 0);
    return rc;
}

VGPU_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    vgpu_nvml_load();
    if (UNLIKELY(!vgpu.real.nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = vgpu.real.nvmlDeviceGetMemoryInfo_v2(device, memory);
    struct vgpu_dev *d = rc == NVML_SUCCESS && memory ? nvml_viewed(device) : NULL;
    if (d) {
        unsigned long long reserved = memory->reserved;
        nvml_clamp(d, &memory->total, &memory->used, &memory->free, reserved);
        memory->reserved = reserved > memory->total - memory->used ? memory->total - memory->used : reserved;
    }
    return rc;
}

/* --- NVML: the processes on a GPU ------------------------------------------------------------
 * Inside a container, nvidia-smi and monitoring agents list the GPU's processes: only the
 * container's own are shown (those with a live slot in its region), each with the memory the
 * driver says it holds. The driver's count of a too-small buffer is kept (an upper bound: the
 * caller's second call gets fewer). A driver lists processes by their pids on the node: a
 * process whose shim learned its node pid (ctx.c's probe) is matched by it, others by their pid
 * in the container. */

static nvmlReturn_t only_ours(nvmlDevice_t device, nvmlReturn_t rc, unsigned int *count, void *infos,
                              size_t stride) {
    if (rc != NVML_SUCCESS || !count || !infos) return rc;
    struct vgpu_dev *d = nvml_viewed(device);
    if (!d) return rc;
    unsigned int kept = 0;
    for (unsigned int i = 0; i < *count; i++) {
        char *e = (char *)infos + (size_t)i * stride;
        unsigned int pid;
        memcpy(&pid, e, sizeof pid); /* pid leads every nvmlProcessInfo layout */
        if (!vgpu_region_has_pid(d->region, (int32_t)pid)) continue;
        if (kept != i) memmove((char *)infos + (size_t)kept * stride, e, stride);
        kept++;
    }
    *count = kept;
    return rc;
}

VGPU_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                           nvmlProcessInfo_v1_t *infos) {
    vgpu_nvml_load();
    if (UNLIKELY(!vgpu.real.nvmlDeviceGetComputeRunningProcesses)) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = vgpu.real.nvmlDeviceGetComputeRunningProcesses(device, infoCount, infos);
    return only_ours(device, rc, infoCount, infos, sizeof *infos);
}

VGPU_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v2_t *infos) {
    vgpu_nvml_load();
    if (UNLIKELY(!vgpu.real.nvmlDeviceGetComputeRunningProcesses_v2)) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = vgpu.real.nvmlDeviceGetComputeRunningProcesses_v2(device, infoCount, infos);
    return only_ours(device, rc, infoCount, infos, sizeof *infos);
}

VGPU_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    vgpu_nvml_load();
    if (UNLIKELY(!vgpu.real.nvmlDeviceGetComputeRunningProcesses_v3)) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = vgpu.real.nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
    return only_ours(device, rc, infoCount, infos, sizeof *infos);
}
