/* cuInit, device enumeration (NVIDIA_VISIBLE_DEVICES, then CUDA_VISIBLE_DEVICES) and device
 * queries. */
#include <ctype.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cuda_internal.h"

struct sim_process sim_proc = {.mu = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static CUresult g_init_rc = CUDA_ERROR_NOT_INITIALIZED;
static atomic_int g_ready; /* 1 once cuInit succeeded */
static atomic_ullong g_ids;

static struct sim_link g_live = {&g_live, &g_live};

void sim_link_add_locked(struct sim_link *l) {
    l->next = g_live.next;
    l->prev = &g_live;
    g_live.next->prev = l;
    g_live.next = l;
}

void sim_link_del_locked(struct sim_link *l) {
    l->prev->next = l->next;
    l->next->prev = l->prev;
    l->prev = l->next = l;
}

void sim_lock(void) { pthread_mutex_lock(&sim_proc.mu); }
void sim_unlock(void) { pthread_mutex_unlock(&sim_proc.mu); }
unsigned long long sim_next_id(void) { return atomic_fetch_add(&g_ids, 1) + 1; }
uint64_t sim_max64(uint64_t a, uint64_t b) { return a > b ? a : b; }

CUresult sim_ready(void) {
    return atomic_load_explicit(&g_ready, memory_order_acquire) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_device(CUdevice dev, uint32_t *phys) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (dev < 0 || dev >= sim_proc.ndev) return CUDA_ERROR_INVALID_DEVICE;
    if (phys) *phys = sim_proc.phys[dev];
    return CUDA_SUCCESS;
}

int sim_trace(void) {
    static int on = -1; /* racy first reads all compute the same value */
    if (on < 0) {
        const char *e = getenv("SIMGPU_TRACE");
        on = e && *e && strcmp(e, "0") != 0;
    }
    return on;
}

CUresult sim_gpu_ok(uint32_t phys) { return simgpu_gpu_lost(phys) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS; }

/* --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------- */

/* Index in `vis` of the GPU whose UUID starts with `tok` ("GPU-..."), -1 if none or several. */
static int match_uuid(struct simgpu_node *node, const uint32_t *vis, uint32_t n, const char *tok) {
    int found = -1;
    size_t len = strlen(tok);
    for (uint32_t i = 0; i < n; i++) {
        if (strncasecmp(node->gpus[vis[i]].cfg.uuid, tok, len) != 0) continue;
        if (found >= 0) return -1; /* ambiguous prefix */
        found = (int)i;
    }
    return found;
}

/* Apply CUDA_VISIBLE_DEVICES to the GPUs the container exposes, as the driver does: entries are
 * indices into that list or GPU-UUID (prefixes); the list ends at the first entry that is
 * invalid, unknown or repeated. */
static uint32_t cuda_visible(struct simgpu_node *node, const uint32_t *vis, uint32_t n, uint32_t *out) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (!env) {
        memcpy(out, vis, n * sizeof *vis);
        return n;
    }
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", env);
    uint32_t count = 0;
    int used[SIMGPU_MAX_GPUS] = {0};
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok && count < SIMGPU_MAX_GPUS; tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok)) tok++;
        char *end = tok + strlen(tok);
        while (end > tok && isspace((unsigned char)end[-1])) *--end = 0;
        int idx = -1;
        if (*tok && strspn(tok, "0123456789") == strlen(tok)) {
            long v = strtol(tok, NULL, 10);
            idx = v < (long)n ? (int)v : -1;
        } else if (strncasecmp(tok, "GPU-", 4) == 0 && tok[4]) {
            idx = match_uuid(node, vis, n, tok);
        }
        if (idx < 0 || used[idx]) break;
        used[idx] = 1;
        out[count++] = vis[idx];
    }
    return count;
}

static void do_init(void) {
    struct simgpu_node *node = simgpu_node();
    if (!node) {
        g_init_rc = CUDA_ERROR_NO_DEVICE; /* no node attached: like a machine without a GPU */
        return;
    }
    uint32_t vis[SIMGPU_MAX_GPUS];
    uint32_t n = simgpu_visible_gpus(vis);
    sim_proc.ndev = (int)cuda_visible(node, vis, n, sim_proc.phys);
    if (sim_proc.ndev == 0) {
        g_init_rc = CUDA_ERROR_NO_DEVICE;
        return;
    }
    g_init_rc = CUDA_SUCCESS;
    atomic_store_explicit(&g_ready, 1, memory_order_release);
}

CUresult cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_init_once, do_init);
    return g_init_rc;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = SIMGPU_CUDA_VERSION;
    return CUDA_SUCCESS;
}

/* --- devices ----------------------------------------------------------------------------- */

static const struct simgpu_gpu_config *cfg_of(uint32_t phys) { return &simgpu_node()->gpus[phys].cfg; }

CUresult cuDeviceGetCount(int *count) {
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    *count = sim_proc.ndev;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device(ordinal, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", cfg_of(phys)->name);
    return CUDA_SUCCESS;
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    /* "GPU-xxxxxxxx-xxxx-..." -> 16 bytes, dashes skipped. */
    const char *s = cfg_of(phys)->uuid;
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    for (int i = 0; i < 16 && *s;) {
        if (*s == '-') {
            s++;
            continue;
        }
        unsigned int byte = 0;
        if (sscanf(s, "%2x", &byte) != 1) break;
        uuid->bytes[i++] = (char)byte;
        s += 2;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return get_uuid(uuid, dev); }
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return get_uuid(uuid, dev); }

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)cfg_of(phys)->total_memory;
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    uint64_t t = cfg_of(phys)->total_memory;
    *bytes = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t; /* the 32-bit ABI clamps */
    return CUDA_SUCCESS;
}

/* Domain, bus and device of the node's "DDDDDDDD:BB:DD.F" bus id. */
static void pci_parts(uint32_t phys, unsigned int *domain, unsigned int *bus, unsigned int *device) {
    *domain = *bus = *device = 0;
    sscanf(cfg_of(phys)->pci_bus_id, "%x:%x:%x", domain, bus, device);
}

/* Values an H100-class part reports; what matters to callers are the ones taken from the node. */
static int attribute(uint32_t phys, CUdevice_attribute a, int *out) {
    const struct simgpu_gpu_config *c = cfg_of(phys);
    unsigned int domain, bus, device;
    pci_parts(phys, &domain, &bus, &device);
    switch ((int)a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *out = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: *out = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *out = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *out = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *out = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: *out = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *out = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *out = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *out = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *out = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *out = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *out = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *out = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: *out = 512; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *out = (int)c->sm_count; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *out = (int)bus; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *out = (int)device; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *out = (int)domain; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *out = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *out = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *out = 52428800; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *out = 2048; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *out = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: *out = 32; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *out = c->cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *out = c->cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *out = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: *out = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *out = 232448; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: *out = 32; break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: *out = 1024; break; /* as occupancy assumes */
    case CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH: *out = c->cc_major >= 9; break; /* thread block clusters: sm_90 on */
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *out = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: *out = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; break;
    case CU_DEVICE_ATTRIBUTE_NUMA_ID: *out = c->numa_node; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *out = c->numa_node; break;
    case CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID: *out = (int)c->pci_device_id; break;
    default:
        if ((int)a <= 0 || (int)a >= CU_DEVICE_ATTRIBUTE_MAX) return -1;
        *out = 0; /* a feature the simulator does not offer */
    }
    return 0;
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    return attribute(phys, attrib, pi) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    *major = cfg_of(phys)->cc_major;
    *minor = cfg_of(phys)->cc_minor;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    uint32_t phys;
    CUresult rc = sim_device(dev, &phys);
    if (rc != CUDA_SUCCESS) return rc;
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    unsigned int domain, bus, device;
    pci_parts(phys, &domain, &bus, &device);
    /* The driver's short form, "0000:17:00.0" (NVML's has an 8-digit domain). */
    snprintf(pciBusId, (size_t)len, "%04x:%02x:%02x.0", domain, bus, device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    unsigned int d = 0, b = 0, v = 0, f = 0;
    /* [domain]:bus:device.function, hex, any case. */
    if (sscanf(pciBusId, "%x:%x:%x.%x", &d, &b, &v, &f) != 4) {
        d = 0;
        if (sscanf(pciBusId, "%x:%x.%x", &b, &v, &f) != 3) return CUDA_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < sim_proc.ndev; i++) {
        unsigned int dd, bb, vv;
        pci_parts(sim_proc.phys[i], &dd, &bb, &vv);
        if (dd == d && bb == b && vv == v && f == 0) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    CUresult rc = sim_device(dev, NULL);
    if (rc == CUDA_SUCCESS) rc = sim_device(peerDev, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    *canAccessPeer = 0; /* no peer mappings in the simulator */
    return CUDA_SUCCESS;
}

void sim_device_hash_info(int dev, uint8_t uuid[16], int32_t *domain, int32_t *bus, int32_t *device) {
    CUuuid u;
    memset(&u, 0, sizeof u);
    get_uuid(&u, dev);
    memcpy(uuid, u.bytes, 16);
    unsigned int d, b, v;
    pci_parts(sim_proc.phys[dev], &d, &b, &v);
    *domain = (int32_t)d;
    *bus = (int32_t)b;
    *device = (int32_t)v;
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuDeviceCanAccessPeer)
SIM_SELF(cuDeviceComputeCapability)
SIM_SELF(cuDeviceGet)
SIM_SELF(cuDeviceGetAttribute)
SIM_SELF(cuDeviceGetByPCIBusId)
SIM_SELF(cuDeviceGetCount)
SIM_SELF(cuDeviceGetName)
SIM_SELF(cuDeviceGetPCIBusId)
SIM_SELF(cuDeviceGetUuid)
SIM_SELF(cuDeviceGetUuid_v2)
SIM_SELF(cuDeviceTotalMem)
SIM_SELF(cuDeviceTotalMem_v2)
SIM_SELF(cuDriverGetVersion)
SIM_SELF(cuInit)
