/* Per-cgroup GPU memory limits: what nvmlDeviceSetMemoryLimits_v1 asks of the driver, held in
 * the node's table (state.h) and enforced on every charge (simgpu_mem_charge).
 *
 * A process's cgroup is read once, when it registers on the node, into its slot; the usage of a
 * cgroup on a GPU is the sum over the live slots in it or below it (cgroups nest: a limit on a
 * cgroup holds its descendants too), so it dies with the processes, as their memory does. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "state.h"

#define SYSFS_CGROUP "/sys/fs/cgroup"

/* "/" or "/a/b": a leading '/', no trailing one, no empty component. -1 if too long. */
static int canonical(const char *path, char out[SIMGPU_CGROUP_PATH]) {
    size_t n = 0;
    out[n++] = '/';
    for (const char *p = path; *p;) {
        while (*p == '/') p++;
        if (!*p) break;
        if (n > 1) {
            if (n + 1 >= SIMGPU_CGROUP_PATH) return -1;
            out[n++] = '/';
        }
        while (*p && *p != '/') {
            if (n + 1 >= SIMGPU_CGROUP_PATH) return -1;
            out[n++] = *p++;
        }
    }
    out[n] = 0;
    return 0;
}

void simgpu_cgroup_self(char out[SIMGPU_CGROUP_PATH]) {
    out[0] = 0;
    const char *knob = getenv("SIMGPU_CGROUP");
    if (knob && *knob) {
        if (knob[0] != '/' || canonical(knob, out) != 0) out[0] = 0;
        return;
    }
    /* cgroup v2: the one line "0::<path>" (a v1 or hybrid host has others before it). */
    char buf[8192];
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return;
    buf[len] = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "0::", 3) == 0 && line[3] == '/') {
            if (canonical(line + 3, out) != 0) out[0] = 0;
            return;
        }
    }
}

int simgpu_cgroup_of_namespace(const char *name_space, char out[SIMGPU_CGROUP_PATH]) {
    size_t k = strlen(SYSFS_CGROUP);
    if (!name_space || strncmp(name_space, SYSFS_CGROUP, k) != 0) return -1;
    if (name_space[k] != 0 && name_space[k] != '/') return -1; /* "/sys/fs/cgroupX" */
    return canonical(name_space + k, out);
}

/* Whether cgroup `inner` is `outer` or lies below it. */
static int within(const char *inner, const char *outer) {
    if (strcmp(outer, "/") == 0) return inner[0] == '/';
    size_t n = strlen(outer);
    return strncmp(inner, outer, n) == 0 && (inner[n] == 0 || inner[n] == '/');
}

/* Bytes the live slots in `cgroup` or below hold on `gpu`; node lock held. */
static uint64_t used_within_locked(const struct simgpu_node *node, uint32_t gpu, const char *cgroup) {
    uint64_t sum = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        const struct simgpu_proc_shared *p = &node->procs[i];
        if (atomic_load(&p->state) == SIMGPU_SLOT_LIVE && p->cgroup[0] && within(p->cgroup, cgroup))
            sum += p->used[gpu];
    }
    return sum;
}

static struct simgpu_cgroup_limit *find_locked(struct simgpu_node *node, uint32_t gpu, const char *cgroup) {
    for (int i = 0; i < SIMGPU_CGROUP_LIMITS; i++) {
        struct simgpu_cgroup_limit *l = &node->cgroup_limits[i];
        if (l->in_use && l->gpu == gpu && strcmp(l->cgroup, cgroup) == 0) return l;
    }
    return NULL;
}

int simgpu_cgroup_limit_set(uint32_t gpu, const char *cgroup, uint64_t soft, uint64_t hard) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return SIMGPU_LIMIT_NO_NODE;
    char key[SIMGPU_CGROUP_PATH];
    if (!cgroup || canonical(cgroup, key) != 0) return SIMGPU_LIMIT_INVALID;
    int clear = soft == 0 && hard == SIMGPU_LIMIT_MAX;
    if (!clear && (soft > hard || hard > node->gpus[gpu].cfg.total_memory)) return SIMGPU_LIMIT_INVALID;
    int rc = SIMGPU_LIMIT_OK;
    simgpu_lock(node);
    struct simgpu_cgroup_limit *l = find_locked(node, gpu, key);
    if (clear) {
        if (l) memset(l, 0, sizeof *l);
    } else {
        for (int i = 0; !l && i < SIMGPU_CGROUP_LIMITS; i++)
            if (!node->cgroup_limits[i].in_use) l = &node->cgroup_limits[i];
        if (!l) {
            rc = SIMGPU_LIMIT_FULL;
        } else {
            /* Limits first, in_use last: the table is read under the lock anyway. */
            l->gpu = gpu;
            l->soft = soft;
            l->hard = hard;
            memcpy(l->cgroup, key, sizeof key);
            l->in_use = 1;
        }
    }
    simgpu_unlock(node);
    return rc;
}

int simgpu_cgroup_limit_get(uint32_t gpu, const char *cgroup, uint64_t *soft, uint64_t *hard, uint64_t *used) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return SIMGPU_LIMIT_NO_NODE;
    char key[SIMGPU_CGROUP_PATH];
    if (!cgroup || canonical(cgroup, key) != 0) return SIMGPU_LIMIT_NONE;
    uint64_t free_b, total_b;
    simgpu_mem_info(gpu, &free_b, &total_b); /* reaps dead processes: their memory is free */
    int rc = SIMGPU_LIMIT_NONE;
    simgpu_lock(node);
    const struct simgpu_cgroup_limit *l = find_locked(node, gpu, key);
    if (l) {
        *soft = l->soft;
        *hard = l->hard;
        *used = used_within_locked(node, gpu, key);
        rc = SIMGPU_LIMIT_OK;
    }
    simgpu_unlock(node);
    return rc;
}

int simgpu_cgroup_admits_locked(const struct simgpu_node *node, int slot, uint32_t gpu, uint64_t bytes) {
    const char *mine = node->procs[slot].cgroup;
    if (!mine[0]) return 1; /* cgroup unknown: nothing to hold it to */
    for (int i = 0; i < SIMGPU_CGROUP_LIMITS; i++) {
        const struct simgpu_cgroup_limit *l = &node->cgroup_limits[i];
        if (!l->in_use || l->gpu != gpu || !within(mine, l->cgroup)) continue;
        uint64_t used = used_within_locked(node, gpu, l->cgroup);
        if (used > l->hard || l->hard - used < bytes) return 0;
    }
    return 1;
}
