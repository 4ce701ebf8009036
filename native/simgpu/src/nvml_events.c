/* Simulated NVML: event sets. XIDs injected into the node (simgpu_inject_xid) reach every set
 * registered for XID events on that GPU, each once per set, in order.
 *
 * A set is process-local: for each device it keeps the event types wanted and a cursor into
 * the GPU's node-wide XID ring, so XIDs injected before registration are never delivered and
 * two sets see the same XIDs independently. Waiting sleeps on the node's event count (a futex
 * in the shared file, bumped by each injection) as the driver's wait sleeps in the kernel: a
 * plugin's health thread costs nothing while nothing happens, where looking every 2 ms cost it
 * 8 ms of CPU a second (bench/RESULTS.md). No threads in the library, no file descriptors.
 */
#include <stdlib.h>

#include "nvml_internal.h"

#define SET_MAGIC 0x45564e54u /* "EVNT" */
#define SHUTDOWN_NS 100000000ull /* a wait looks whether NVML was shut down this often */

struct nvmlEventSet_st {
    uint32_t magic;
    pthread_mutex_t mu; /* registration and delivery may come from different threads */
    uint32_t next_dev;  /* device to look at first: one busy GPU cannot starve the others */
    struct {
        unsigned long long types; /* 0: not registered */
        uint64_t next_xid;        /* sequence number of the next XID to deliver */
    } dev[SIMGPU_MAX_GPUS];       /* by NVML index */
};

static nvmlReturn_t check_set(nvmlEventSet_t set) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    return set && set->magic == SET_MAGIC ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    pthread_mutex_init(&s->mu, NULL);
    s->magic = SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = check_set(set);
    if (rc != NVML_SUCCESS) return rc;
    set->magic = 0;
    pthread_mutex_destroy(&set->mu);
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = NVML_SIM_EVENT_TYPES;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if ((rc = check_set(set)) != NVML_SUCCESS) return rc;
    /* Like the real library: asking for a type the GPU cannot report fails the whole call. */
    if (eventTypes & ~NVML_SIM_EVENT_TYPES) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&set->mu);
    if (!set->dev[device->index].types) set->dev[device->index].next_xid = simgpu_xid_count(device->phys);
    set->dev[device->index].types |= eventTypes;
    pthread_mutex_unlock(&set->mu);
    return NVML_SUCCESS;
}

/* Take the oldest undelivered XID of a registered device, if any; set lock held. */
static int take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    for (uint32_t k = 0; k < nvml_lib.count; k++) {
        uint32_t i = (set->next_dev + k) % nvml_lib.count;
        if (!(set->dev[i].types & nvmlEventTypeXidCriticalError)) continue;
        uint32_t phys = nvml_lib.devices[i].phys;
        struct simgpu_xid_record rec;
        for (;;) {
            uint64_t count = simgpu_xid_count(phys), next = set->dev[i].next_xid;
            if (next >= count) break;
            /* Overrun: the oldest ones left the ring; the real driver drops them too. */
            if (count - next > SIMGPU_XID_RING) next = count - SIMGPU_XID_RING;
            if (simgpu_xid_get(phys, next, &rec) != 0) { /* overwritten meanwhile: look again */
                set->dev[i].next_xid = next + 1;
                continue;
            }
            set->dev[i].next_xid = next + 1;
            set->next_dev = (i + 1) % nvml_lib.count;
            data->device = &nvml_lib.devices[i];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = rec.xid;
            data->gpuInstanceId = 0xFFFFFFFFu; /* whole GPU: no MIG instance */
            data->computeInstanceId = 0xFFFFFFFFu;
            return 1;
        }
    }
    return 0;
}

static int any_lost(nvmlEventSet_t set) {
    for (uint32_t i = 0; i < nvml_lib.count; i++)
        if (set->dev[i].types && simgpu_gpu_lost(nvml_lib.devices[i].phys)) return 1;
    return 0;
}

/* Pending XIDs come first (an XID 79 injected before the GPU is marked lost still reaches its
 * handler); then a lost registered GPU ends the wait at once with NVML_ERROR_GPU_IS_LOST, as the
 * real wait does while a GPU is off the bus, rather than sleeping out the timeout. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    nvmlReturn_t rc = check_set(set);
    if (rc != NVML_SUCCESS) return rc;
    if (!data) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = simgpu_now_ns() + (uint64_t)timeoutms * 1000000ull;
    struct simgpu_node *node = simgpu_node(); /* attached: NVML is initialised (check_set) */
    for (;;) {
        /* Read before looking: an injection after the look moves it, and the wait returns. */
        uint32_t seen = atomic_load_explicit(&node->events, memory_order_acquire);
        pthread_mutex_lock(&set->mu);
        int got = take_event(set, data);
        int lost = !got && any_lost(set);
        pthread_mutex_unlock(&set->mu);
        if (got) return NVML_SUCCESS;
        if (lost) return NVML_ERROR_GPU_IS_LOST;
        uint64_t now = simgpu_now_ns();
        if (now >= deadline) return NVML_ERROR_TIMEOUT;
        if (nvml_ready() != NVML_SUCCESS) return NVML_ERROR_UNINITIALIZED; /* shut down meanwhile */
        simgpu_events_wait(node, seen, deadline - now < SHUTDOWN_NS ? deadline : now + SHUTDOWN_NS);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
