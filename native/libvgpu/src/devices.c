/* Accounting glue: which limits apply to each CUDA device, and the calls into the shared
 * region (include/vgpu/region.h) that charge and release memory.
 *
 * A CUDA device is resolved once, on first use, by its UUID (cuDeviceGetUuid): limits are
 * keyed by UUID, so a CUDA_VISIBLE_DEVICES that reorders or hides devices cannot mix them
 * up. The region is opened then too (created from the limits when missing); if it cannot be,
 * limited devices fail closed. A GPU seen only through NVML (nvidia-smi, a monitoring agent)
 * is set up by its NVML UUID, without CUDA where the limits name GPUs by UUID. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "shim.h"

void vgpu_format_uuid(const CUuuid *u, char out[VGPU_UUID_SIZE]) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, VGPU_UUID_SIZE,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static void add_limit(struct vgpu_limits *lim, const char *uuid, const struct vgpu_limit *l) {
    if (lim->count >= VGPU_MAX_DEVICES || !uuid[0]) return;
    for (uint32_t i = 0; i < lim->count; i++)
        if (strcasecmp(lim->devices[i].uuid, uuid) == 0) return;
    struct vgpu_device_limit *d = &lim->devices[lim->count++];
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    d->memory_limit = l->bad ? 0 : l->mem;
    d->sm_percent = l->bad ? 0 : (uint32_t)l->sm;
}

/* The container's limits as the region records them: every GPU the limits name, or, when the
 * envs name GPUs by CUDA ordinal, every GPU the driver shows. The driver is asked only where
 * this process has loaded libcuda, and answers only once CUDA is initialised (by ordinal,
 * vgpu_dev_by_uuid makes sure of both first): an NVML-only process records the GPUs the limits
 * name, which, under the NVIDIA container runtime, are all the container has. */
void vgpu_container_limits(struct vgpu_limits *lim) {
    const struct vgpu_config *c = &vgpu.cfg;
    memset(lim, 0, sizeof *lim);
    if (c->mode == VGPU_MODE_FILE || c->by_uuid) {
        for (int i = 0; i < c->count; i++) add_limit(lim, c->dev[i].uuid, &c->dev[i]);
        if (c->mode == VGPU_MODE_FILE) return;
    }
    int n = 0;
    if (!__atomic_load_n(&vgpu.ready, __ATOMIC_ACQUIRE) || !vgpu.real.cuDeviceGetCount ||
        !vgpu.real.cuDeviceGetUuid || vgpu.real.cuDeviceGetCount(&n) != CUDA_SUCCESS)
        return;
    for (int ord = 0; ord < n && ord < VGPU_MAX_ORDINALS; ord++) {
        CUuuid u;
        char uuid[VGPU_UUID_SIZE];
        if (vgpu.real.cuDeviceGetUuid(&u, ord) != CUDA_SUCCESS) continue;
        vgpu_format_uuid(&u, uuid);
        struct vgpu_limit l = vgpu_config_lookup(c, uuid, ord);
        add_limit(lim, uuid, &l);
    }
}

/* 1 when the region is open. vgpu.mu held. */
static int region_open_locked(void) {
    if (vgpu.region_state) return vgpu.region_state > 0;
    struct vgpu_limits lim;
    vgpu_container_limits(&lim);
    char err[VGPU_REGION_ERRLEN] = "no GPU to account";
    int rc = VGPU_REGION_EFAIL;
    if (lim.count > 0) {
        /* The region's directory is a mount in a container; make it elsewhere (tests). */
        char dir[sizeof vgpu.cfg.region_path];
        snprintf(dir, sizeof dir, "%s", vgpu.cfg.region_path);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = 0;
            if (mkdir(dir, 0777) == 0) chmod(dir, 01777);
        }
        rc = vgpu_region_open(vgpu.cfg.region_path, &lim, &vgpu.region, err, sizeof err);
    }
    vgpu.region_state = rc == VGPU_REGION_OK ? 1 : -1;
    if (rc != VGPU_REGION_OK)
        vgpu_log(VGPU_LOG_ERROR, "cannot use the shared region: %s; allocations on limited "
                 "GPUs are refused", err);
    else
        vgpu_driver_limit_check(vgpu.region); /* once per process, off every hot path */
    return vgpu.region_state > 0;
}

/* Envs by CUDA index, in a process that has not initialised CUDA: the region another process
 * of the container made (it knew which GPU index i is), attached for NVML views only. Its
 * limits stay the region's: this process's own, which it cannot map to GPUs yet, go on the
 * attachment it opens when it uses CUDA. 1 attached; vgpu.mu held. */
static int view_region_locked(void) {
    struct stat st;
    if (vgpu.view_state || stat(vgpu.cfg.region_path, &st) != 0) return vgpu.view_state > 0;
    char err[VGPU_REGION_ERRLEN] = "";
    int rc = vgpu_region_open(vgpu.cfg.region_path, NULL, &vgpu.view_region, err, sizeof err);
    vgpu.view_state = rc == VGPU_REGION_OK ? 1 : -1;
    if (rc != VGPU_REGION_OK)
        vgpu_log(VGPU_LOG_ERROR, "cannot use the shared region: %s; NVML shows the GPUs "
                 "unlimited", err);
    return vgpu.view_state > 0;
}

/* Fill d from the limits of GPU `uuid`. vgpu.mu held. */
static void setup_locked(struct vgpu_dev *d, const char *uuid, int ordinal) {
    struct vgpu_limit l = vgpu_config_lookup(&vgpu.cfg, uuid, ordinal);
    /* Envs by CUDA index and a GPU seen through NVML only: its index, hence its limits, are
     * unknown here; the region, made by a process that knew them, decides. */
    int view_only = ordinal < 0 && vgpu.cfg.mode == VGPU_MODE_ENV && !vgpu.cfg.by_uuid;
    if (view_only) l = (struct vgpu_limit){.mem = UINT64_MAX};
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    d->ordinal = ordinal;
    d->rdev = -1;
    d->limit = l.bad ? 0 : l.mem;
    d->fail_closed = vgpu.limited && l.bad;
    d->sm = !l.bad && l.sm > 0 && l.sm < 100 ? l.sm : 0;
    /* A guarantee is never above the cap (an env pair may say otherwise: the cap wins). */
    d->req = l.bad || l.req <= 0 ? 0 : d->sm && l.req > d->sm ? d->sm : l.req > 100 ? 100 : l.req;
    /* With any limit set, every allocation is counted (the host reports usage), even on a
     * GPU whose memory is not limited. */
    d->accounted = vgpu.limited && !d->fail_closed;
    if (d->accounted) {
        struct vgpu_region *r = NULL;
        if (view_only ? view_region_locked() : region_open_locked())
            r = view_only ? vgpu.view_region : vgpu.region;
        if (!r) {
            d->accounted = 0;
            d->fail_closed = 1;
        } else if ((d->rdev = vgpu_region_device_index(r, uuid)) < 0) {
            /* Only a CUDA device has allocations to refuse; an NVML view just passes through. */
            if (ordinal >= 0)
                vgpu_log(VGPU_LOG_ERROR, "the shared region %s has no record of GPU %s: "
                         "allocations there are refused", vgpu.cfg.region_path, uuid);
            else
                VLOG(VGPU_LOG_INFO, "the shared region %s has no record of GPU %s: NVML "
                     "shows it unlimited", vgpu.cfg.region_path, uuid);
            d->accounted = 0;
            d->fail_closed = 1;
        } else {
            d->region = r;
            uint64_t rl = vgpu_region_limit(r, d->rdev); /* min(ours, region's) */
            if (rl < d->limit) d->limit = rl;
        }
    }
    if ((d->sm || d->req) && ordinal >= 0) {
        d->pace = vgpu_pace_attach(uuid, &d->sm, d->req);
        if (d->req && d->pace) d->own = vgpu_pace_private();
        if (!d->pace) d->sm = d->req = 0; /* out of memory for even a private bucket */
        d->rate = d->req ? d->req : d->sm;
    }
    VLOG(VGPU_LOG_DEBUG, "GPU %s (ordinal %d): memory limit %llu, SM %d%%, guaranteed %d%%%s",
         uuid, ordinal, (unsigned long long)d->limit, d->sm, d->req,
         d->fail_closed ? ", failing closed" : "");
}

static struct vgpu_dev *__attribute__((noinline)) resolve(int ordinal) {
    struct vgpu_dev *d = &vgpu.dev[ordinal];
    CUuuid u;
    char uuid[VGPU_UUID_SIZE];
    if (!vgpu.real.cuDeviceGetUuid || vgpu.real.cuDeviceGetUuid(&u, ordinal) != CUDA_SUCCESS)
        return NULL;
    vgpu_format_uuid(&u, uuid);
    pthread_mutex_lock(&vgpu.mu);
    if (!d->ready) {
        setup_locked(d, uuid, ordinal);
        __atomic_store_n(&d->ready, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&vgpu.mu);
    return d;
}

struct vgpu_dev *vgpu_dev_resolve(int ordinal) { return resolve(ordinal); }

struct vgpu_dev *vgpu_current_dev(void) {
    CUdevice dev;
    if (!vgpu.real.cuCtxGetDevice || vgpu.real.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return NULL;
    return vgpu_dev((int)dev);
}

static struct vgpu_dev *ready_with_uuid(struct vgpu_dev *devs, int n, const char *uuid) {
    for (int i = 0; i < n; i++)
        if (__atomic_load_n(&devs[i].ready, __ATOMIC_ACQUIRE) && strcasecmp(devs[i].uuid, uuid) == 0)
            return &devs[i];
    return NULL;
}

/* The CUDA device with this UUID (CUDA initialised), or NULL when CUDA does not show it. */
static struct vgpu_dev *cuda_dev_with_uuid(const char *uuid) {
    int n = 0;
    if (vgpu.real.cuDeviceGetCount(&n) != CUDA_SUCCESS || !vgpu.real.cuDeviceGetUuid) return NULL;
    for (int ord = 0; ord < n && ord < VGPU_MAX_ORDINALS; ord++) {
        CUuuid u;
        char s[VGPU_UUID_SIZE];
        if (vgpu.real.cuDeviceGetUuid(&u, ord) != CUDA_SUCCESS) continue;
        vgpu_format_uuid(&u, s);
        if (strcasecmp(s, uuid) == 0) return vgpu_dev(ord);
    }
    return NULL;
}

struct vgpu_dev *vgpu_dev_by_uuid(const char *uuid) {
    if (!vgpu.limited || !uuid || !uuid[0]) return NULL;
    struct vgpu_dev *found = ready_with_uuid(vgpu.dev, VGPU_MAX_ORDINALS, uuid);
    if (!found) found = ready_with_uuid(vgpu.by_uuid, VGPU_MAX_DEVICES, uuid);
    if (found) return found;
    int by_index = vgpu.cfg.mode == VGPU_MODE_ENV && !vgpu.cfg.by_uuid;
    if (vgpu.cfg.mode == VGPU_MODE_ENV) {
        /* Envs: if this process has initialised CUDA, the driver's GPUs go into the region
         * too (vgpu_container_limits), and by index CUDA says which GPU index i is. Asked
         * before vgpu.mu: loading libcuda's entry points may run its constructors. */
        int cuda = vgpu_cuda_initialised();
        if (cuda && by_index) return cuda_dev_with_uuid(uuid);
    }
    /* A GPU this process has not used through CUDA (an NVML-only tool): by UUID alone. */
    pthread_mutex_lock(&vgpu.mu);
    if (by_index) {
        /* The shim does not initialise CUDA for an NVML query: a process that forks after
         * cuInit leaves its children unable to use CUDA (CUDA_ERROR_NOT_INITIALIZED), which
         * is why frameworks query NVML, not CUDA, before forking workers. A region another
         * process made holds the index -> GPU mapping; without one, say so once. */
        if (!view_region_locked()) {
            static int told;
            int none = vgpu.view_state == 0;
            pthread_mutex_unlock(&vgpu.mu);
            if (none && !__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
                vgpu_log(VGPU_LOG_WARN, "NVML memory info is not limited (GPU %s): the limits "
                         "name no GPU by UUID (NVIDIA_VISIBLE_DEVICES lists none), so only CUDA "
                         "can tell which GPUs they cover, and no process of the container has "
                         "used a GPU through CUDA yet (the shim does not initialise CUDA for "
                         "NVML: processes forked afterwards could not use it); list the GPUs' "
                         "UUIDs in NVIDIA_VISIBLE_DEVICES to limit NVML from the start", uuid);
            return NULL;
        }
    }
    for (int i = 0; i < VGPU_MAX_DEVICES && !found; i++) {
        struct vgpu_dev *d = &vgpu.by_uuid[i];
        if (d->ready && strcasecmp(d->uuid, uuid) == 0) found = d;
        else if (!d->ready) {
            setup_locked(d, uuid, -1);
            __atomic_store_n(&d->ready, 1, __ATOMIC_RELEASE);
            found = d;
        }
    }
    pthread_mutex_unlock(&vgpu.mu);
    return found;
}

/* --- charging ------------------------------------------------------------------------------ */

/* Refused: before saying so, what this process's pools keep cached goes back to the GPU (and
 * its charge to the container), then the reservation is tried once more. */
CUresult vgpu_charge_denied(struct vgpu_dev *d, uint64_t bytes, int rc) {
    if (rc == VGPU_REGION_DENIED && vgpu_pools_trim(d) > 0 &&
        vgpu_region_reserve(vgpu.region, d->rdev, bytes) == VGPU_REGION_OK)
        return CUDA_SUCCESS;
    if (rc == VGPU_REGION_DENIED) vgpu_region_count(vgpu.region, d->rdev, VGPU_COUNT_REFUSED, 1);
    VLOG(VGPU_LOG_INFO, "allocation of %llu bytes on GPU %s refused: %llu of %llu bytes in use",
         (unsigned long long)bytes, d->uuid, (unsigned long long)vgpu_used(d),
         (unsigned long long)vgpu_region_limit(vgpu.region, d->rdev));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

void vgpu_note_fallback(struct vgpu_dev *d) {
    if (d->accounted) vgpu_region_count(vgpu.region, d->rdev, VGPU_COUNT_FALLBACK, 1);
}

void vgpu_note_gpu_time(struct vgpu_dev *d, uint64_t ns) {
    if (d->accounted && ns) vgpu_region_count(vgpu.region, d->rdev, VGPU_COUNT_GPU_NS, ns);
}

uint64_t vgpu_used(struct vgpu_dev *d) {
    return d->accounted ? vgpu_region_usage(d->region, d->rdev) : 0;
}
