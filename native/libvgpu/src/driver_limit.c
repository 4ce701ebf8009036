/* Whether the driver itself holds this container to a memory limit (docs/contracts.md, "Driver
 * memory limit"): the NVIDIA toolkit's apply-cuda-memory-limits hook asks the driver
 * (nvmlDeviceSetMemoryLimits_v1) to hold the container's cgroup; only a process inside the
 * container can tell whether that happened, since the plugin never learns the container's
 * cgroup. So the first process that attaches to the region asks NVML, once per container, for
 * each GPU of the region, and writes the answer into the region's per-device stats for the
 * node to report.
 *
 * The cgroup is named as the process sees it: "/sys/fs/cgroup" + the "0::" path of
 * /proc/self/cgroup. Under a cgroup namespace that is "/sys/fs/cgroup/", the container's own
 * cgroup, which the driver knows by its directory whatever the path. The hook sets the limit
 * on the container's cgroup, and a process may sit in a child of it: NOT_FOUND walks up to the
 * parent, as far as the namespace shows. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "region_internal.h"
#include "shim.h"

#define SYSFS_CGROUP "/sys/fs/cgroup"

typedef nvmlReturn_t (*get_limits_fn)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *);

/* This process's cgroup v2 path ("/" or "/a/b") into out; 0, or -1 when it has none. */
static int own_cgroup(char *out, size_t outlen) {
    char buf[4096];
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return -1;
    buf[len] = 0;
    for (char *line = buf; line && *line;) {
        char *end = strchr(line, '\n');
        if (end) *end = 0;
        if (strncmp(line, "0::/", 4) == 0) {
            size_t n = strlen(line + 3);
            while (n > 1 && line[3 + n - 1] == '/') n--; /* "/a/" is "/a" */
            if (n + 1 > outlen) return -1;
            memcpy(out, line + 3, n);
            out[n] = 0;
            return 0;
        }
        line = end ? end + 1 : NULL;
    }
    return -1;
}

/* What the driver holds `dev` to for `cgroup` or its nearest ancestor with a limit: a state
 * (enum vgpu_driver_limit_state), the hard limit (FOUND) or NVML's code (ERROR) in *out. */
static uint64_t ask(get_limits_fn get, nvmlDevice_t dev, const char *cgroup, uint64_t *out) {
    char ns[sizeof SYSFS_CGROUP + 4096];
    size_t k = strlen(SYSFS_CGROUP);
    memcpy(ns, SYSFS_CGROUP, k);
    snprintf(ns + k, sizeof ns - k, "%s", strcmp(cgroup, "/") == 0 ? "" : cgroup);
    for (;;) {
        nvmlGetMemoryLimits_v1_t q;
        memset(&q, 0, sizeof q);
        q.nameSpace = ns;
        nvmlReturn_t rc = get(dev, &q);
        /* NVML documents soft 0 with hard MAX as "no limit". */
        if (rc == NVML_SUCCESS && !(q.softLimit == 0 && q.hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX)) {
            *out = q.hardLimit;
            return VGPU_DRIVER_LIMIT_FOUND;
        }
        if (rc == NVML_ERROR_NOT_SUPPORTED || rc == NVML_ERROR_FUNCTION_NOT_FOUND)
            return VGPU_DRIVER_LIMIT_UNSUPPORTED;
        /* NOT_FOUND: none on this cgroup. A path this process's view lacks (a cgroup path from
         * outside its namespace) fails to open: its parents may still be there. */
        if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_FOUND && rc != NVML_ERROR_OPERATING_SYSTEM) {
            *out = (uint64_t)rc;
            return VGPU_DRIVER_LIMIT_ERROR;
        }
        if (strlen(ns) == k) return VGPU_DRIVER_LIMIT_NONE;
        *strrchr(ns, '/') = 0; /* the parent; "/sys/fs/cgroup" itself last */
    }
}

static void record(struct vgpu_region_device_stats *st, uint64_t state, uint64_t value) {
    /* The value before the state: the host reads the state as the value's validity. */
    __atomic_store_n(&st->driver_limit, value, __ATOMIC_RELAXED);
    __atomic_store_n(&st->driver_limit_state, state, __ATOMIC_RELEASE);
}

void vgpu_driver_limit_check(struct vgpu_region *r) {
    struct vgpu_region_file *f = r->file;
    int n = r->device_count;
    int todo = 0;
    for (int d = 0; d < n; d++)
        todo |= __atomic_load_n(&f->stats[d].driver_limit_state, __ATOMIC_ACQUIRE) ==
                VGPU_DRIVER_LIMIT_UNCHECKED;
    if (!todo) return; /* another process of the container has looked */
    char cgroup[4096];
    uint64_t all = 0;
    get_limits_fn get = NULL;
    /* The process's own NVML session, which context measurement (ctx.c) opens anyway: the
     * check adds no nvmlInit of its own. */
    if (own_cgroup(cgroup, sizeof cgroup) != 0) {
        all = VGPU_DRIVER_LIMIT_NO_CGROUP;
    } else if (!vgpu_nvml_ready_locked()) {
        all = VGPU_DRIVER_LIMIT_UNSUPPORTED; /* no NVML at all */
    } else {
        get = (get_limits_fn)vgpu_real_dlsym(vgpu.nvml, "nvmlDeviceGetMemoryLimits_v1");
        if (!get) all = VGPU_DRIVER_LIMIT_UNSUPPORTED; /* a driver older than NVML 13.4 */
    }
    for (int d = 0; d < n; d++) {
        struct vgpu_region_device_stats *st = &f->stats[d];
        if (__atomic_load_n(&st->driver_limit_state, __ATOMIC_ACQUIRE) != VGPU_DRIVER_LIMIT_UNCHECKED)
            continue;
        if (all) {
            record(st, all, 0);
            continue;
        }
        char uuid[VGPU_UUID_SIZE];
        memcpy(uuid, f->devices[d].uuid, sizeof uuid);
        uuid[sizeof uuid - 1] = 0; /* the tenant's file: bounded whatever it holds */
        nvmlDevice_t h = NULL;
        nvmlReturn_t rc = vgpu.real.nvmlDeviceGetHandleByUUID(uuid, &h);
        uint64_t value = (uint64_t)rc;
        uint64_t state = rc == NVML_SUCCESS ? ask(get, h, cgroup, &value) : VGPU_DRIVER_LIMIT_ERROR;
        record(st, state, state == VGPU_DRIVER_LIMIT_NONE ? 0 : value);
        VLOG(VGPU_LOG_DEBUG, "driver memory limit of %s for cgroup %s: state %llu, %llu", uuid,
             cgroup, (unsigned long long)state, (unsigned long long)value);
    }
}
