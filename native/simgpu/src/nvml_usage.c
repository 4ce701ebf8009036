/* Simulated NVML: what the GPUs are doing now — memory, utilization, running processes.
 * Everything is node-wide (all processes of the node, whatever container they run in), as the
 * real NVML reports the physical GPU; the shim narrows the memory view per container. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml_internal.h"

/* Utilization is averaged over the last second, the longest sample period NVML documents. */
#define UTIL_WINDOW_NS 1000000000ull

/* Used and total bytes of a GPU: all processes' allocations, their contexts included. */
static void memory_of(nvmlDevice_t device, unsigned long long *total, unsigned long long *used) {
    uint64_t free_b, total_b;
    simgpu_mem_info(device->phys, &free_b, &total_b); /* reaps dead processes first */
    *total = total_b;
    *used = total_b - free_b;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    memory_of(device, &memory->total, &memory->used);
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory_of(device, &memory->total, &memory->used);
    memory->reserved = 0; /* the simulated driver sets nothing aside */
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = simgpu_utilization(device->phys, UTIL_WINDOW_NS);
    utilization->memory = 0; /* memory traffic is not modelled */
    return NVML_SUCCESS;
}

/* --- running processes -------------------------------------------------------------------- */

/* The processes on `device`, in any of NVML's process-info layouts: `put` writes entry i.
 * Follows NVML's two-call protocol: a count too small (or infos NULL) answers
 * NVML_ERROR_INSUFFICIENT_SIZE with the count needed; no process answers SUCCESS and 0. */
static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                                   void (*put)(void *infos, unsigned int i, const struct simgpu_proc_usage *u)) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!infoCount || (!infos && *infoCount)) return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_proc_usage procs[SIMGPU_MAX_PROCS]; /* 8 KiB: every slot of the node */
    uint32_t n = simgpu_gpu_processes(device->phys, procs, SIMGPU_MAX_PROCS);
    if (n > *infoCount || (n && !infos)) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (uint32_t i = 0; i < n; i++) put(infos, i, &procs[i]);
    *infoCount = n;
    return NVML_SUCCESS;
}

/* No MIG: NVML marks the instance ids of a whole-GPU process with all ones. */
#define NO_INSTANCE 0xFFFFFFFFu

static void put_v1(void *infos, unsigned int i, const struct simgpu_proc_usage *u) {
    nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
    p->pid = (unsigned int)u->pid;
    p->usedGpuMemory = u->used;
}

static void put_v2(void *infos, unsigned int i, const struct simgpu_proc_usage *u) {
    nvmlProcessInfo_v2_t *p = (nvmlProcessInfo_v2_t *)infos + i;
    p->pid = (unsigned int)u->pid;
    p->usedGpuMemory = u->used;
    p->gpuInstanceId = NO_INSTANCE;
    p->computeInstanceId = NO_INSTANCE;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    return list_processes(device, infoCount, infos, put_v2);
}

/* v2 and v3 share the layout; v3 exists for the meaning of usedGpuMemory under MIG. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v2_t *infos) {
    return list_processes(device, infoCount, infos, put_v2);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos) {
    return list_processes(device, infoCount, infos, put_v1);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    (void)infos;
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = 0; /* a compute-only simulator: no graphics contexts */
    return NVML_SUCCESS;
}

/* --- per-process utilization -------------------------------------------------------------- */

static unsigned long long realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

/* The driver's sample period for per-process utilisation, SIMGPU_UTIL_PERIOD_MS: a real
 * driver samples every 1/6 s to 1 s depending on the product and keeps about a second of
 * samples, one per process per period it ran in, stamped with the period's end, in whole
 * percent; a caller between two samples gets nothing new. 0 or unset: one sample per process
 * of the caller's own window (the last second, or since lastSeenTimeStamp), exact to the
 * call. Set it alike for every process of a node: periods end at multiples of it on the
 * shared monotonic clock. */
static uint64_t util_period_ns(void) {
    static uint64_t period = UINT64_MAX;
    uint64_t p = __atomic_load_n(&period, __ATOMIC_RELAXED);
    if (p == UINT64_MAX) {
        const char *e = getenv("SIMGPU_UTIL_PERIOD_MS");
        unsigned long ms = e ? strtoul(e, NULL, 10) : 0;
        p = ms > 10000 ? 10000000000ull : (uint64_t)ms * 1000000ull;
        __atomic_store_n(&period, p, __ATOMIC_RELAXED);
    }
    return p;
}

static unsigned int percent_of(uint64_t busy_ns, uint64_t window_ns) {
    uint64_t pct = (busy_ns * 100 + window_ns / 2) / window_ns;
    return pct > 100 ? 100 : (unsigned int)pct;
}

/* Adds the samples of the periods that ended in (lastSeen, now] within the kept second to
 * `out` (up to `max`); returns how many there are. CPU time of a monotonic instant: the
 * clocks' offset rounded to the millisecond, so one period reads with one stamp every call. */
static unsigned int sampled(uint32_t phys, uint64_t period, unsigned long long now_us, uint64_t now,
                            unsigned long long last_seen, nvmlProcessUtilizationSample_t *out,
                            unsigned int max) {
    long long offset_us = ((long long)now_us - (long long)(now / 1000) + 500) / 1000 * 1000;
    uint64_t keep = period > UTIL_WINDOW_NS ? period : UTIL_WINDOW_NS;
    uint64_t end = now - now % period;
    uint64_t first = end > keep ? end - keep + period : period;
    first -= first % period;
    unsigned int n = 0;
    for (uint64_t e = first; e <= end; e += period) {
        unsigned long long stamp = (unsigned long long)((long long)(e / 1000) + offset_us);
        if (stamp <= last_seen) continue;
        struct simgpu_proc_busy busy[SIMGPU_MAX_PROCS]; /* 8 KiB */
        uint32_t k = simgpu_process_busy(phys, e - period, e, busy, SIMGPU_MAX_PROCS);
        for (uint32_t i = 0; i < k; i++, n++)
            if (out && n < max)
                out[n] = (nvmlProcessUtilizationSample_t){
                    .pid = (unsigned int)busy[i].pid,
                    .timeStamp = stamp,
                    .smUtil = percent_of(busy[i].busy_ns, period),
                };
    }
    return n;
}

/* One sample per process whose kernels ran during the sample period (see util_period_ns).
 * smUtil is that process's share of the period; no memory/encoder/decoder traffic is modelled.
 * Buffer protocol as pynvml uses it: too small (or NULL) answers NVML_ERROR_INSUFFICIENT_SIZE
 * with the count needed; no process ran: NVML_ERROR_NOT_FOUND. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long now_us = realtime_us();
    uint64_t now = simgpu_now_ns();
    uint64_t period = util_period_ns();
    if (lastSeenTimeStamp >= now_us) return NVML_ERROR_NOT_FOUND;
    if (period) {
        unsigned int have = utilization ? *processSamplesCount : 0;
        unsigned int n = sampled(device->phys, period, now_us, now, lastSeenTimeStamp, utilization, have);
        if (n == 0) return NVML_ERROR_NOT_FOUND;
        *processSamplesCount = n;
        return n > have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    uint64_t window = UTIL_WINDOW_NS;
    if ((now_us - lastSeenTimeStamp) * 1000ull < window) window = (now_us - lastSeenTimeStamp) * 1000ull;
    struct simgpu_proc_busy busy[SIMGPU_MAX_PROCS]; /* 8 KiB */
    uint32_t n = simgpu_process_busy(device->phys, now > window ? now - window : 0, now, busy,
                                     SIMGPU_MAX_PROCS);
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (!utilization || *processSamplesCount < n) {
        *processSamplesCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (uint32_t i = 0; i < n; i++)
        utilization[i] = (nvmlProcessUtilizationSample_t){
            .pid = (unsigned int)busy[i].pid,
            .timeStamp = now_us,
            .smUtil = percent_of(busy[i].busy_ns, window),
        };
    *processSamplesCount = n;
    return NVML_SUCCESS;
}
