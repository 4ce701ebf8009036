/* Simulated NVML: device enumeration, handle look-ups and static queries (identity, PCI,
 * topology, capabilities). Values come from the node's fixed GPU configuration. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "nvml_internal.h"

/* --- enumeration -------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = nvml_lib.count; /* a lost GPU still counts: it is still on the PCI bus */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

/* Hand out a handle, refusing a lost GPU as the real look-ups do. */
static nvmlReturn_t give_handle(uint32_t index, nvmlDevice_t *device) {
    nvmlDevice_t d = &nvml_lib.devices[index];
    if (simgpu_gpu_lost(d->phys)) return NVML_ERROR_GPU_IS_LOST;
    *device = d;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    if (!device || index >= nvml_lib.count) return NVML_ERROR_INVALID_ARGUMENT;
    return give_handle(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static const struct simgpu_gpu_config *config_of(uint32_t phys) { return &simgpu_node()->gpus[phys].cfg; }

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    /* Only GPUs of this process's view: a container cannot name a GPU it was not given. */
    for (uint32_t i = 0; i < nvml_lib.count; i++)
        if (strcasecmp(config_of(nvml_lib.devices[i].phys)->uuid, uuid) == 0) return give_handle(i, device);
    return NVML_ERROR_NOT_FOUND;
}

struct pci_addr {
    unsigned domain, bus, device, function;
};

/* "domain:bus:device.function" (domain of 4 or 8 hex digits) or "bus:device.function". */
static int parse_pci(const char *s, struct pci_addr *a) {
    char tail;
    memset(a, 0, sizeof *a);
    if (sscanf(s, "%x:%x:%x.%x%c", &a->domain, &a->bus, &a->device, &a->function, &tail) == 4) return 0;
    a->domain = 0;
    if (sscanf(s, "%x:%x.%x%c", &a->bus, &a->device, &a->function, &tail) == 3) return 0;
    return -1;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    nvmlReturn_t rc = nvml_ready();
    if (rc != NVML_SUCCESS) return rc;
    struct pci_addr want, have;
    if (!pciBusId || !device || parse_pci(pciBusId, &want) != 0) return NVML_ERROR_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < nvml_lib.count; i++) {
        if (parse_pci(config_of(nvml_lib.devices[i].phys)->pci_bus_id, &have) != 0) continue;
        if (memcmp(&want, &have, sizeof want) == 0) return give_handle(i, device);
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* --- identity ----------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    return rc != NVML_SUCCESS ? rc : nvml_put_string(name, length, cfg->name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    return rc != NVML_SUCCESS ? rc : nvml_put_string(uuid, length, cfg->uuid);
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!cfg->serial[0]) return NVML_ERROR_NOT_SUPPORTED; /* boards without a serial number */
    return nvml_put_string(serial, length, cfg->serial);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = cfg->minor_number; /* /dev/nvidiaN: physical, whatever the container's view */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    /* Data-centre boards report the plain NVIDIA brand; only consumer names say otherwise. */
    *type = strstr(cfg->name, "GeForce") ? NVML_BRAND_GEFORCE : NVML_BRAND_NVIDIA;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMultiGpuBoard(nvmlDevice_t device, unsigned int *multiGpuBool) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!multiGpuBool) return NVML_ERROR_INVALID_ARGUMENT;
    *multiGpuBool = 0; /* one GPU per simulated board */
    return NVML_SUCCESS;
}

/* --- PCI ---------------------------------------------------------------------------------- */

/* Sub-system id of the simulated boards: an NVIDIA-made board (vendor 0x10DE). */
#define SIM_PCI_SUBSYSTEM_ID 0x16C110DEu

/* Fill the fields NVML 1's 52-byte struct shares with today's; `full` adds the 32-byte busId
 * that only the _v2/_v3 struct has room for. */
static nvmlReturn_t fill_pci(nvmlDevice_t device, nvmlPciInfo_t *pci, int full) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    struct pci_addr a;
    if (parse_pci(cfg->pci_bus_id, &a) != 0) memset(&a, 0, sizeof a);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", a.domain & 0xffffu, a.bus & 0xffu,
             a.device & 0xffu, a.function & 0xfu);
    pci->domain = a.domain;
    pci->bus = a.bus;
    pci->device = a.device;
    pci->pciDeviceId = cfg->pci_device_id;
    pci->pciSubSystemId = SIM_PCI_SUBSYSTEM_ID;
    if (full)
        snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", a.domain, a.bus & 0xffu, a.device & 0xffu,
                 a.function & 0xfu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) { return fill_pci(device, pci, 1); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return fill_pci(device, pci, 1); }
/* NVML 1 callers pass the old, shorter struct: write nothing past its pciSubSystemId. */
nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return fill_pci(device, pci, 0); }

nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci) {
    if (pci && pci->version != nvmlPciInfoExt_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlPciInfo_t base;
    nvmlReturn_t rc = fill_pci(device, pci ? &base : NULL, 1);
    if (rc != NVML_SUCCESS) return rc;
    pci->domain = base.domain;
    pci->bus = base.bus;
    pci->device = base.device;
    pci->pciDeviceId = base.pciDeviceId;
    pci->pciSubSystemId = base.pciSubSystemId;
    pci->baseClass = 0x03; /* display controller */
    pci->subClass = 0x02;  /* 3D controller: a compute GPU without display outputs */
    memcpy(pci->busId, base.busId, sizeof pci->busId);
    return NVML_SUCCESS;
}

/* --- topology ----------------------------------------------------------------------------- */

/* NVLink: simulated GPUs sit on PCIe only, so every link query answers NVML_ERROR_NOT_SUPPORTED
 * as NVML does on a GPU without NVLink, after the argument checks NVIDIA documents. PyTorch
 * resolves these at start and asserts they exist. */
static nvmlReturn_t no_nvlink(nvmlDevice_t device, unsigned int link, const void *out) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (link >= NVML_NVLINK_MAX_LINKS || !out) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    return no_nvlink(device, link, isActive);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                 nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    return no_nvlink(device, link, pNvLinkDeviceType);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    return no_nvlink(device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    return no_nvlink(device, link, pci);
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!node) return NVML_ERROR_INVALID_ARGUMENT;
    if (cfg->numa_node < 0) return NVML_ERROR_NOT_SUPPORTED; /* a single-node host has no answer */
    *node = (unsigned int)cfg->numa_node;
    return NVML_SUCCESS;
}

static void set_bit(unsigned long *set, unsigned int size, unsigned long bit) {
    const unsigned long per = 8 * sizeof(unsigned long);
    if (bit / per < size) set[bit / per] |= 1UL << (bit % per);
}

/* Sets the bits of a kernel cpu list ("0-7,16-23") in `set`; 0 if at least one was listed. */
static int read_cpulist(const char *path, unsigned long *set, unsigned int size) {
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    char buf[4096];
    int any = 0;
    if (fgets(buf, sizeof buf, f)) {
        for (char *p = buf; *p && *p != '\n';) {
            char *end;
            unsigned long lo = strtoul(p, &end, 10), hi = lo;
            if (end == p) break;
            if (*end == '-') hi = strtoul(end + 1, &end, 10);
            for (unsigned long c = lo; c <= hi && c < 65536; c++) set_bit(set, size, c);
            any = 1;
            p = *end == ',' ? end + 1 : end;
        }
    }
    fclose(f);
    return any ? 0 : -1;
}

/* The CPUs near a GPU: those of its NUMA node where the host has that node, else all online
 * CPUs (a simulated node may claim NUMA nodes the host lacks; every CPU is then "near"). */
static void cpus_near(const struct simgpu_gpu_config *cfg, unsigned long *set, unsigned int size) {
    char path[96];
    memset(set, 0, size * sizeof *set);
    if (cfg->numa_node >= 0) {
        snprintf(path, sizeof path, "/sys/devices/system/node/node%d/cpulist", cfg->numa_node);
        if (read_cpulist(path, set, size) == 0) return;
    }
    if (read_cpulist("/sys/devices/system/cpu/online", set, size) == 0) return;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (long c = 0; c < (n > 0 ? n : 1); c++) set_bit(set, size, (unsigned long)c);
}

nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                 unsigned long *cpuSet, nvmlAffinityScope_t scope) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!cpuSet || cpuSetSize == 0 || scope > NVML_AFFINITY_SCOPE_SOCKET) return NVML_ERROR_INVALID_ARGUMENT;
    cpus_near(cfg, cpuSet, cpuSetSize); /* one socket per NUMA node: both scopes agree */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet) {
    return nvmlDeviceGetCpuAffinityWithinScope(device, cpuSetSize, cpuSet, NVML_AFFINITY_SCOPE_NODE);
}

nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize, unsigned long *nodeSet,
                                         nvmlAffinityScope_t scope) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!nodeSet || nodeSetSize == 0 || scope > NVML_AFFINITY_SCOPE_SOCKET) return NVML_ERROR_INVALID_ARGUMENT;
    if (cfg->numa_node < 0) return NVML_ERROR_NOT_SUPPORTED;
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    set_bit(nodeSet, nodeSetSize, (unsigned long)cfg->numa_node);
    return NVML_SUCCESS;
}

/* --- capabilities and modes --------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = cfg->cc_major;
    *minor = cfg->cc_minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch) {
    const struct simgpu_gpu_config *cfg;
    nvmlReturn_t rc = nvml_device(device, &cfg);
    if (rc != NVML_SUCCESS) return rc;
    if (!arch) return NVML_ERROR_INVALID_ARGUMENT;
    int cc = cfg->cc_major * 10 + cfg->cc_minor;
    *arch = cc >= 100 ? NVML_DEVICE_ARCH_BLACKWELL
          : cc >= 90  ? NVML_DEVICE_ARCH_HOPPER
          : cc == 89  ? NVML_DEVICE_ARCH_ADA
          : cc >= 80  ? NVML_DEVICE_ARCH_AMPERE
          : cc == 75  ? NVML_DEVICE_ARCH_TURING
          : cc >= 70  ? NVML_DEVICE_ARCH_VOLTA
          : cc >= 60  ? NVML_DEVICE_ARCH_PASCAL
                      : NVML_DEVICE_ARCH_UNKNOWN;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = NVML_COMPUTEMODE_DEFAULT; /* sharing a GPU between processes is the point */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode) {
    nvmlReturn_t rc = nvml_device(device, NULL);
    if (rc != NVML_SUCCESS) return rc;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = NVML_FEATURE_ENABLED; /* the node state outlives every process, like a persisted GPU */
    return NVML_SUCCESS;
}

/* Queries tools make while probing a GPU that the simulation has no model for: a clean
 * "not supported" (as a board without the sensor answers) rather than a missing symbol. */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    (void)currentMode;
    (void)pendingMode;
    nvmlReturn_t rc = nvml_device(device, NULL);
    return rc != NVML_SUCCESS ? rc : NVML_ERROR_NOT_SUPPORTED; /* no MIG: whole GPUs only */
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock) {
    (void)type;
    (void)clock;
    nvmlReturn_t rc = nvml_device(device, NULL);
    return rc != NVML_SUCCESS ? rc : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed) {
    (void)speed;
    nvmlReturn_t rc = nvml_device(device, NULL);
    return rc != NVML_SUCCESS ? rc : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    (void)power;
    nvmlReturn_t rc = nvml_device(device, NULL);
    return rc != NVML_SUCCESS ? rc : NVML_ERROR_NOT_SUPPORTED;
}
