/* An ordinary NVML program (unversioned names, as NVIDIA's header maps them) run against the
 * simulated libnvidia-ml.so.1 on a node. It checks NVML's calling protocol itself (errors,
 * buffer sizes, reference counting, the two-call process list) and prints what it read as one
 * JSON object for the test to compare with the node's configuration:
 *   {"driver": ..., "devices": [...], "layout": {...}}
 * "layout" holds the sizes, offsets and constants of the ABI, so a build against NVIDIA's
 * nvml.h and one against our compat header can be compared.
 *
 * Usage: nvml_api_check [CHARGE_MIB]  — with CHARGE_MIB, this process also charges that much
 * memory on NVML device 0 (physical GPU 0: run it without NVIDIA_VISIBLE_DEVICES) and checks
 * that memory info and the process list see exactly it.
 */
#include <nvml.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../native/simgpu/src/state.h"

#ifdef VGPU_REAL_NVML_H
#define REAL_HEADER 1 /* built against NVIDIA's nvml.h */
#else
#define REAL_HEADER 0
#endif

static int failures;

#define EXPECT(cond, ...)                                    \
    do {                                                     \
        if (!(cond)) {                                       \
            fprintf(stderr, "nvml_api_check: FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                    \
            fputc('\n', stderr);                             \
            failures++;                                      \
        }                                                    \
    } while (0)

#define CALL(expr, want) \
    do {                 \
        nvmlReturn_t rc_ = (expr); \
        EXPECT(rc_ == (want), "%s -> %d (%s), expected %d", #expr, rc_, nvmlErrorString(rc_), (int)(want)); \
    } while (0)

static void print_layout(void) {
#define SZ(t) printf("\"sizeof %s\": %zu, ", #t, sizeof(t))
#define OFF(t, f) printf("\"%s.%s\": %zu, ", #t, #f, offsetof(t, f))
#define VAL(v) printf("\"%s\": %lld, ", #v, (long long)(v))
    printf("\"layout\": {");
    SZ(nvmlPciInfo_t);
    OFF(nvmlPciInfo_t, domain);
    OFF(nvmlPciInfo_t, pciDeviceId);
    OFF(nvmlPciInfo_t, pciSubSystemId);
    OFF(nvmlPciInfo_t, busId);
    SZ(nvmlPciInfoExt_t);
    OFF(nvmlPciInfoExt_t, baseClass);
    OFF(nvmlPciInfoExt_t, busId);
    SZ(nvmlMemory_t);
    OFF(nvmlMemory_t, free);
    OFF(nvmlMemory_t, used);
    SZ(nvmlMemory_v2_t);
    OFF(nvmlMemory_v2_t, total);
    OFF(nvmlMemory_v2_t, reserved);
    OFF(nvmlMemory_v2_t, used);
    SZ(nvmlUtilization_t);
    SZ(nvmlProcessInfo_v1_t);
    OFF(nvmlProcessInfo_v1_t, usedGpuMemory);
    SZ(nvmlProcessInfo_t);
    OFF(nvmlProcessInfo_t, gpuInstanceId);
    OFF(nvmlProcessInfo_t, computeInstanceId);
    SZ(nvmlEventData_t);
    OFF(nvmlEventData_t, eventType);
    OFF(nvmlEventData_t, eventData);
    OFF(nvmlEventData_t, gpuInstanceId);
    SZ(nvmlSetMemoryLimits_v1_t);
    OFF(nvmlSetMemoryLimits_v1_t, softLimit);
    OFF(nvmlSetMemoryLimits_v1_t, hardLimit);
    SZ(nvmlGetMemoryLimits_v1_t);
    OFF(nvmlGetMemoryLimits_v1_t, hardLimit);
    OFF(nvmlGetMemoryLimits_v1_t, currentUsed);
    VAL(NVML_DEVICE_MEMORY_LIMIT_MAX);
    SZ(nvmlProcessUtilizationSample_t);
    OFF(nvmlProcessUtilizationSample_t, timeStamp);
    OFF(nvmlProcessUtilizationSample_t, smUtil);
    OFF(nvmlProcessUtilizationSample_t, decUtil);
    SZ(nvmlIntNvLinkDeviceType_t);
    VAL(NVML_NVLINK_DEVICE_TYPE_SWITCH);
    VAL(NVML_NVLINK_DEVICE_TYPE_UNKNOWN);
    VAL(NVML_NVLINK_MAX_LINKS);
    VAL(nvmlMemory_v2);
    VAL(nvmlPciInfoExt_v1);
    VAL(NVML_ERROR_DRIVER_NOT_LOADED);
    VAL(NVML_ERROR_TIMEOUT);
    VAL(NVML_ERROR_GPU_IS_LOST);
    VAL(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    VAL(NVML_ERROR_RESET_TYPE_NOT_SUPPORTED);
    VAL(NVML_ERROR_UNKNOWN);
    VAL(NVML_BRAND_NVIDIA);
    VAL(NVML_BRAND_NVIDIA_NPU);
    VAL(NVML_DEVICE_ARCH_HOPPER);
    VAL(NVML_DEVICE_ARCH_BLACKWELL);
    VAL(NVML_COMPUTEMODE_EXCLUSIVE_PROCESS);
    VAL(NVML_CLOCK_VIDEO);
    VAL(NVML_AFFINITY_SCOPE_SOCKET);
    VAL(NVML_INIT_FLAG_FORCE_INIT);
    VAL(nvmlEventTypeXidCriticalError);
    VAL(nvmlEventTypeDoubleBitEccError);
    VAL(nvmlEventTypeClock);
    VAL(NVML_DEVICE_UUID_V2_BUFFER_SIZE);
    VAL(NVML_DEVICE_NAME_V2_BUFFER_SIZE);
    VAL(NVML_DEVICE_SERIAL_BUFFER_SIZE);
    VAL(NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE);
    VAL(NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE);
    printf("\"end\": 0}");
#undef SZ
#undef OFF
#undef VAL
}

static void check_device(unsigned int i, unsigned long long charged) {
    nvmlDevice_t dev, again;
    CALL(nvmlDeviceGetHandleByIndex(i, &dev), NVML_SUCCESS);
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE], uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE], tiny[4];
    CALL(nvmlDeviceGetName(dev, name, sizeof name), NVML_SUCCESS);
    CALL(nvmlDeviceGetName(dev, tiny, sizeof tiny), NVML_ERROR_INSUFFICIENT_SIZE);
    CALL(nvmlDeviceGetUUID(dev, uuid, sizeof uuid), NVML_SUCCESS);
    CALL(nvmlDeviceGetSerial(dev, serial, sizeof serial), NVML_SUCCESS);
    unsigned int minor = 0, index = 99, numa = 99, multi = 9;
    CALL(nvmlDeviceGetMinorNumber(dev, &minor), NVML_SUCCESS);
    CALL(nvmlDeviceGetIndex(dev, &index), NVML_SUCCESS);
    EXPECT(index == i, "index %u of device %u", index, i);
    CALL(nvmlDeviceGetNumaNodeId(dev, &numa), NVML_SUCCESS);
    CALL(nvmlDeviceGetMultiGpuBoard(dev, &multi), NVML_SUCCESS);
    int major = 0, minor_cc = 0;
    CALL(nvmlDeviceGetCudaComputeCapability(dev, &major, &minor_cc), NVML_SUCCESS);
    nvmlBrandType_t brand = NVML_BRAND_UNKNOWN;
    CALL(nvmlDeviceGetBrand(dev, &brand), NVML_SUCCESS);

    nvmlPciInfo_t pci;
    CALL(nvmlDeviceGetPciInfo(dev, &pci), NVML_SUCCESS); /* _v3 through the header's macro */
    CALL(nvmlDeviceGetHandleByUUID(uuid, &again), NVML_SUCCESS);
    EXPECT(again == dev, "handle by UUID differs from handle by index");
    again = NULL;
    CALL(nvmlDeviceGetHandleByPciBusId(pci.busId, &again), NVML_SUCCESS);
    EXPECT(again == dev, "handle by PCI bus id differs");
    again = NULL;
    CALL(nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy, &again), NVML_SUCCESS);
    EXPECT(again == dev, "handle by legacy PCI bus id differs");

    nvmlMemory_t mem;
    nvmlMemory_v2_t mem2;
    CALL(nvmlDeviceGetMemoryInfo(dev, &mem), NVML_SUCCESS);
    EXPECT(mem.total == mem.free + mem.used, "v1: total != free + used");
    memset(&mem2, 0, sizeof mem2);
    CALL(nvmlDeviceGetMemoryInfo_v2(dev, &mem2), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    mem2.version = nvmlMemory_v2;
    CALL(nvmlDeviceGetMemoryInfo_v2(dev, &mem2), NVML_SUCCESS);
    EXPECT(mem2.total == mem.total && mem2.used == mem.used && mem2.reserved == 0, "v2 disagrees with v1");

    /* The two-call protocol: ask for the count, then fetch. */
    unsigned int count = 0;
    nvmlReturn_t rc = nvmlDeviceGetComputeRunningProcesses(dev, &count, NULL);
    EXPECT(rc == NVML_SUCCESS || rc == NVML_ERROR_INSUFFICIENT_SIZE, "process count -> %d", rc);
    nvmlProcessInfo_t procs[64];
    count = 64;
    CALL(nvmlDeviceGetComputeRunningProcesses(dev, &count, procs), NVML_SUCCESS);
    unsigned long long mine = 0;
    for (unsigned int k = 0; k < count; k++) {
        EXPECT(procs[k].gpuInstanceId == 0xFFFFFFFFu, "process without MIG has an instance id");
        if (procs[k].pid == (unsigned int)getpid()) mine = procs[k].usedGpuMemory;
    }
    if (i == 0 && charged) {
        EXPECT(mine == charged, "own process shows %llu bytes, charged %llu", mine, charged);
        EXPECT(mem.used >= charged, "memory used %llu below own charge %llu", mem.used, charged);
        unsigned int none = 0;
        CALL(nvmlDeviceGetComputeRunningProcesses(dev, &none, NULL), NVML_ERROR_INSUFFICIENT_SIZE);
        EXPECT(none >= 1, "needed count %u", none);
    }

    nvmlUtilization_t util;
    CALL(nvmlDeviceGetUtilizationRates(dev, &util), NVML_SUCCESS);
    unsigned long cpus[4] = {0};
    CALL(nvmlDeviceGetCpuAffinity(dev, 4, cpus), NVML_SUCCESS);
    EXPECT(cpus[0] | cpus[1] | cpus[2] | cpus[3], "empty CPU affinity");
    unsigned long long types = 0;
    CALL(nvmlDeviceGetSupportedEventTypes(dev, &types), NVML_SUCCESS);
    EXPECT(types & nvmlEventTypeXidCriticalError, "XID events unsupported");

    printf("%s{\"index\": %u, \"name\": \"%s\", \"uuid\": \"%s\", \"serial\": \"%s\", \"minor\": %u, "
           "\"numa\": %u, \"cc\": [%d, %d], \"brand\": %d, \"multi_gpu_board\": %u, \"bus_id\": \"%s\", "
           "\"bus_id_legacy\": \"%s\", \"pci_device_id\": %u, \"total\": %llu, \"used\": %llu, "
           "\"util\": %u, \"processes\": %u}",
           i ? ", " : "", i, name, uuid, serial, minor, numa, major, minor_cc, (int)brand, multi, pci.busId,
           pci.busIdLegacy, pci.pciDeviceId, mem.total, mem.used, util.gpu, count);
}

static void check_events(unsigned int n) {
    nvmlEventSet_t set;
    nvmlEventData_t data;
    CALL(nvmlEventSetCreate(&set), NVML_SUCCESS);
    for (unsigned int i = 0; i < n; i++) {
        nvmlDevice_t dev;
        CALL(nvmlDeviceGetHandleByIndex(i, &dev), NVML_SUCCESS);
        CALL(nvmlDeviceRegisterEvents(dev, nvmlEventTypePState, set), NVML_ERROR_NOT_SUPPORTED);
        CALL(nvmlDeviceRegisterEvents(dev, nvmlEventTypeXidCriticalError, set), NVML_SUCCESS);
    }
    CALL(nvmlEventSetWait(set, &data, 0), NVML_ERROR_TIMEOUT);
    CALL(nvmlEventSetWait(set, NULL, 0), NVML_ERROR_INVALID_ARGUMENT);
    CALL(nvmlEventSetFree(set), NVML_SUCCESS);
}

int main(int argc, char **argv) {
    unsigned long long charge = argc > 1 ? strtoull(argv[1], NULL, 10) << 20 : 0;
    unsigned int n = 0;
    CALL(nvmlDeviceGetCount(&n), NVML_ERROR_UNINITIALIZED);
    CALL(nvmlInit(), NVML_SUCCESS);
    CALL(nvmlInit(), NVML_SUCCESS); /* reference counted: needs two shutdowns */
    CALL(nvmlDeviceGetCount(&n), NVML_SUCCESS);
    if (charge) EXPECT(simgpu_mem_charge(0, charge) == 0, "cannot charge %llu bytes on GPU 0", charge);

    char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE], nvml[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda = 0;
    CALL(nvmlSystemGetDriverVersion(driver, sizeof driver), NVML_SUCCESS);
    CALL(nvmlSystemGetNVMLVersion(nvml, sizeof nvml), NVML_SUCCESS);
    CALL(nvmlSystemGetCudaDriverVersion(&cuda), NVML_SUCCESS);
    EXPECT(strcmp(nvmlErrorString(NVML_ERROR_GPU_IS_LOST), "GPU is lost") == 0, "error string");

    nvmlDevice_t bogus = (nvmlDevice_t)&n;
    char buf[96];
    CALL(nvmlDeviceGetName(bogus, buf, sizeof buf), NVML_ERROR_INVALID_ARGUMENT);
    nvmlDevice_t none;
    CALL(nvmlDeviceGetHandleByIndex(n, &none), NVML_ERROR_INVALID_ARGUMENT);
    CALL(nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000", &none), NVML_ERROR_NOT_FOUND);
    CALL(nvmlDeviceGetHandleByPciBusId("not a bus id", &none), NVML_ERROR_INVALID_ARGUMENT);

    printf("{\"real_header\": %d, \"driver\": \"%s\", \"nvml\": \"%s\", \"cuda\": %d, \"count\": %u, "
           "\"devices\": [",
           REAL_HEADER, driver, nvml, cuda, n);
    for (unsigned int i = 0; i < n; i++) check_device(i, charge);
    printf("], ");
    check_events(n);
    print_layout();
    printf("}\n");

    CALL(nvmlShutdown(), NVML_SUCCESS);
    CALL(nvmlDeviceGetCount(&n), NVML_SUCCESS); /* one init still in effect */
    CALL(nvmlShutdown(), NVML_SUCCESS);
    CALL(nvmlDeviceGetCount(&n), NVML_ERROR_UNINITIALIZED);
    CALL(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
    if (failures) fprintf(stderr, "nvml_api_check: %d failure(s)\n", failures);
    return failures ? 1 : 0;
}
