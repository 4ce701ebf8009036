/* Per-cgroup GPU memory limits: what nvmlDeviceSetMemoryLimits_v1 asks of the driver, held in
 * the node's table (state.h) and enforced on every charge (simgpu_mem_charge).
 *
 * A process's cgroup is read once, when it registers on the node, into its slot; the usage of a
 * cgroup on a GPU is the sum over the live slots in it or below it (cgroups nest: a limit on a
 * cgroup holds its descendants too), so it dies with the processes, as their memory does.
 *
 * The driver knows a cgroup by its directory, not by the string that named it: the toolkit's
 * hook names a container's cgroup by its host path, while a process inside the container (own
 * cgroup namespace: /proc/self/cgroup says "0::/", /sys/fs/cgroup is its own cgroup) names the
 * same directory "/sys/fs/cgroup/". So a limit whose directory exists is keyed by its
 * (st_dev, st_ino), and a process carries those of its cgroup and ancestors. A limit on a path
 * that does not exist (the tests' simulated cgroups, SIMGPU_CGROUP) is keyed by the path. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* The directory that stands for /sys/fs/cgroup in this process's view. */
static const char *sysfs_root(void) {
    const char *knob = getenv("SIMGPU_SYSFS_CGROUP");
    return knob && knob[0] == '/' ? knob : SYSFS_CGROUP;
}

/* The directory of canonical cgroup path `path` in this process's view; {0, 0} if none. */
static struct simgpu_cgroup_dir dir_of(const char *path) {
    char full[SIMGPU_CGROUP_PATH * 2];
    struct stat st;
    int n = snprintf(full, sizeof full, "%s%s", sysfs_root(), strcmp(path, "/") == 0 ? "" : path);
    if (n < 0 || (size_t)n >= sizeof full || stat(full, &st) != 0 || !S_ISDIR(st.st_mode))
        return (struct simgpu_cgroup_dir){0, 0};
    return (struct simgpu_cgroup_dir){(uint64_t)st.st_dev, (uint64_t)st.st_ino};
}

static int dir_known(struct simgpu_cgroup_dir d) { return d.dev != 0 || d.ino != 0; }

uint32_t simgpu_cgroup_self(char out[SIMGPU_CGROUP_PATH], struct simgpu_cgroup_dir dirs[SIMGPU_CGROUP_DEPTH]) {
    out[0] = 0;
    const char *knob = getenv("SIMGPU_CGROUP");
    if (knob && *knob) {
        if (knob[0] != '/' || canonical(knob, out) != 0) out[0] = 0;
    } else {
        /* cgroup v2: the one line "0::<path>" (a v1 or hybrid host has others before it). */
        char buf[8192];
        int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
        ssize_t len = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
        if (fd >= 0) close(fd);
        if (len <= 0) return 0;
        buf[len] = 0;
        char *save = NULL;
        for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            if (strncmp(line, "0::", 3) == 0 && line[3] == '/') {
                if (canonical(line + 3, out) != 0) out[0] = 0;
                break;
            }
        }
    }
    if (!out[0]) return 0;
    /* The leaf, then each parent by its path: where the leaf is not in this process's view
     * (a path from another namespace) nothing is, and only the path identifies it. */
    char walk[SIMGPU_CGROUP_PATH];
    memcpy(walk, out, SIMGPU_CGROUP_PATH);
    uint32_t n = 0;
    while (n < SIMGPU_CGROUP_DEPTH) {
        struct simgpu_cgroup_dir d = dir_of(walk);
        if (!dir_known(d)) break;
        dirs[n++] = d;
        if (strcmp(walk, "/") == 0) break;
        char *slash = strrchr(walk, '/');
        if (slash == walk) slash[1] = 0;
        else *slash = 0;
    }
    return n;
}

int simgpu_cgroup_of_namespace(const char *name_space, struct simgpu_cgroup_id *out) {
    size_t k = strlen(SYSFS_CGROUP);
    if (!name_space || strncmp(name_space, SYSFS_CGROUP, k) != 0) return -1;
    if (name_space[k] != 0 && name_space[k] != '/') return -1; /* "/sys/fs/cgroupX" */
    if (canonical(name_space + k, out->path) != 0) return -1;
    out->dir = dir_of(out->path);
    return 0;
}

/* Whether cgroup `inner` is `outer` or lies below it. */
static int within(const char *inner, const char *outer) {
    if (strcmp(outer, "/") == 0) return inner[0] == '/';
    size_t n = strlen(outer);
    return strncmp(inner, outer, n) == 0 && (inner[n] == 0 || inner[n] == '/');
}

/* Whether limit `l` holds process `p`: `p`'s cgroup is the limit's directory or below it, or,
 * for a limit known by its path only, its path is the limit's or below it. */
static int holds(const struct simgpu_cgroup_limit *l, const struct simgpu_proc_shared *p) {
    if (dir_known(l->dir)) {
        uint32_t n = p->cgroup_ndirs < SIMGPU_CGROUP_DEPTH ? p->cgroup_ndirs : SIMGPU_CGROUP_DEPTH;
        for (uint32_t i = 0; i < n; i++)
            if (p->cgroup_dirs[i].dev == l->dir.dev && p->cgroup_dirs[i].ino == l->dir.ino) return 1;
    }
    return p->cgroup[0] && within(p->cgroup, l->cgroup);
}

/* Bytes the live slots that `l` holds have on its GPU; node lock held. */
static uint64_t used_within_locked(const struct simgpu_node *node, const struct simgpu_cgroup_limit *l) {
    uint64_t sum = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        const struct simgpu_proc_shared *p = &node->procs[i];
        if (atomic_load(&p->state) == SIMGPU_SLOT_LIVE && holds(l, p)) sum += p->used[l->gpu];
    }
    return sum;
}

/* The limit of `id` on `gpu`: by directory where it has one, else by path. */
static struct simgpu_cgroup_limit *find_locked(struct simgpu_node *node, uint32_t gpu,
                                               const struct simgpu_cgroup_id *id) {
    for (int i = 0; i < SIMGPU_CGROUP_LIMITS; i++) {
        struct simgpu_cgroup_limit *l = &node->cgroup_limits[i];
        if (!l->in_use || l->gpu != gpu) continue;
        if (dir_known(id->dir) ? l->dir.dev == id->dir.dev && l->dir.ino == id->dir.ino
                               : !dir_known(l->dir) && strcmp(l->cgroup, id->path) == 0)
            return l;
    }
    return NULL;
}

int simgpu_cgroup_limit_set(uint32_t gpu, const struct simgpu_cgroup_id *cgroup, uint64_t soft, uint64_t hard) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return SIMGPU_LIMIT_NO_NODE;
    if (!cgroup || cgroup->path[0] != '/') return SIMGPU_LIMIT_INVALID;
    int clear = soft == 0 && hard == SIMGPU_LIMIT_MAX;
    if (!clear && (soft > hard || hard > node->gpus[gpu].cfg.total_memory)) return SIMGPU_LIMIT_INVALID;
    int rc = SIMGPU_LIMIT_OK;
    simgpu_lock(node);
    struct simgpu_cgroup_limit *l = find_locked(node, gpu, cgroup);
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
            l->dir = cgroup->dir;
            memcpy(l->cgroup, cgroup->path, sizeof l->cgroup);
            l->in_use = 1;
        }
    }
    simgpu_unlock(node);
    return rc;
}

int simgpu_cgroup_limit_get(uint32_t gpu, const struct simgpu_cgroup_id *cgroup, uint64_t *soft, uint64_t *hard,
                            uint64_t *used) {
    struct simgpu_node *node = simgpu_node();
    if (!node || gpu >= node->gpu_count) return SIMGPU_LIMIT_NO_NODE;
    if (!cgroup || cgroup->path[0] != '/') return SIMGPU_LIMIT_NONE;
    uint64_t free_b, total_b;
    simgpu_mem_info(gpu, &free_b, &total_b); /* reaps dead processes: their memory is free */
    int rc = SIMGPU_LIMIT_NONE;
    simgpu_lock(node);
    const struct simgpu_cgroup_limit *l = find_locked(node, gpu, cgroup);
    if (l) {
        *soft = l->soft;
        *hard = l->hard;
        *used = used_within_locked(node, l);
        rc = SIMGPU_LIMIT_OK;
    }
    simgpu_unlock(node);
    return rc;
}

int simgpu_cgroup_admits_locked(const struct simgpu_node *node, int slot, uint32_t gpu, uint64_t bytes) {
    const struct simgpu_proc_shared *me = &node->procs[slot];
    for (int i = 0; i < SIMGPU_CGROUP_LIMITS; i++) {
        const struct simgpu_cgroup_limit *l = &node->cgroup_limits[i];
        if (!l->in_use || l->gpu != gpu || !holds(l, me)) continue;
        uint64_t used = used_within_locked(node, l);
        if (used > l->hard || l->hard - used < bytes) return 0;
    }
    return 1;
}
