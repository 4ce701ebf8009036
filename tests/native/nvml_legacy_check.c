/* A program built the old way (NVML_NO_UNVERSIONED_FUNC_DEFS: the unversioned names are the
 * NVML 1 entry points) must link against the simulated library and get the old behaviour:
 * notably the short NVML 1 PCI struct, which the library must not write past.
 * Prints "ok <count>" and exits 0, or says what failed and exits 1. */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int failures;

static void expect(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "nvml_legacy_check: FAIL %s\n", what);
        failures++;
    }
}

int main(void) {
    unsigned int n = 0;
    expect(nvmlInit() == NVML_SUCCESS, "nvmlInit");
    expect(nvmlDeviceGetCount(&n) == NVML_SUCCESS && n > 0, "nvmlDeviceGetCount");
    nvmlDevice_t dev = NULL, again = NULL;
    expect(nvmlDeviceGetHandleByIndex(0, &dev) == NVML_SUCCESS, "nvmlDeviceGetHandleByIndex");
    if (failures) return 1; /* nothing to look at */

    /* NVML 1's struct ended with reserved words where busId now begins: untouched bytes there. */
    nvmlPciInfo_t pci;
    memset(&pci, 0xAB, sizeof pci);
    expect(nvmlDeviceGetPciInfo(dev, &pci) == NVML_SUCCESS, "nvmlDeviceGetPciInfo");
    expect((unsigned char)pci.busId[0] == 0xAB, "v1 PCI info wrote past the NVML 1 struct");
    expect(strlen(pci.busIdLegacy) == 12, "v1 PCI legacy bus id");
    expect(nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy, &again) == NVML_SUCCESS && again == dev,
           "nvmlDeviceGetHandleByPciBusId");
    expect(nvmlDeviceGetPciInfo_v2(dev, &pci) == NVML_SUCCESS && strlen(pci.busId) == 16, "nvmlDeviceGetPciInfo_v2");

    unsigned int count = 8;
    nvmlProcessInfo_v1_t v1[8];
    nvmlProcessInfo_v2_t v2[8];
    expect(nvmlDeviceGetComputeRunningProcesses(dev, &count, v1) == NVML_SUCCESS, "processes v1");
    count = 8;
    expect(nvmlDeviceGetComputeRunningProcesses_v2(dev, &count, v2) == NVML_SUCCESS, "processes v2");

    nvmlEventSet_t set;
    nvmlEventData_t data;
    expect(nvmlEventSetCreate(&set) == NVML_SUCCESS, "nvmlEventSetCreate");
    expect(nvmlEventSetWait(set, &data, 1) == NVML_ERROR_TIMEOUT, "nvmlEventSetWait");
    expect(nvmlEventSetFree(set) == NVML_SUCCESS, "nvmlEventSetFree");
    expect(nvmlShutdown() == NVML_SUCCESS, "nvmlShutdown");
    if (!failures) printf("ok %u\n", n);
    return failures ? 1 : 0;
}
