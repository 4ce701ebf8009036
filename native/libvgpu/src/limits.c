/* Limits: the read-only limits file (docs/limits-file.md), else the CUDA_DEVICE_* envs.
 *
 * Precedence: /etc/vgpu/limits when it exists (the plugin mounts it read-only, so a tenant
 * cannot raise its limits by editing its environment); VGPU_LIMITS_FILE only where that file
 * does not exist (tests, development); then the envs; nothing set means pass-through.
 * Anything malformed fails closed: the device it concerns (a bad env value) or every device
 * (a bad limits file) refuses allocations, with one stderr line saying why. */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shim.h"

#define LIMITS_FILE "/etc/vgpu/limits"
#define REGION_DIR "/tmp/vgpu"
#define DEFAULT_REGION REGION_DIR "/vgpu.cache"
#define DEFAULT_LOCK_DIR "/tmp/vgpulock"
#define DEFAULT_PEERS_DIR "/etc/vgpu/peers"

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    vgpu_log(VGPU_LOG_ERROR, "%s", line); /* configuration errors are always reported */
}

/* --- values ------------------------------------------------------------------------------- */

static int parse_u64(const char *s, size_t n, uint64_t *out) {
    uint64_t v = 0;
    if (n == 0) return -1;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

int vgpu_parse_size(const char *s, uint64_t *out) {
    if (!s) return -1;
    size_t n = strlen(s);
    unsigned shift = 0;
    if (n > 0) {
        switch (s[n - 1]) {
        case 'k': case 'K': shift = 10; break;
        case 'm': case 'M': shift = 20; break;
        case 'g': case 'G': shift = 30; break;
        default: break;
        }
    }
    uint64_t v;
    if (parse_u64(s, shift ? n - 1 : n, &v) != 0) return -1;
    if (shift && v > (UINT64_MAX >> shift)) return -1;
    *out = v << shift;
    return 0;
}

static int parse_percent(const char *s, int *out) {
    uint64_t v;
    if (!s || parse_u64(s, strlen(s), &v) != 0 || v > 100) return -1;
    *out = (int)v;
    return 0;
}

/* strlcpy: truncating copy, always terminated. */
static void copy(char *dst, size_t size, const char *src) {
    size_t n = 0;
    while (n < size - 1 && src[n]) n++;
    memcpy(dst, src, n);
    dst[n] = 0;
}

/* --- the limits file ------------------------------------------------------------------------ */

static int safe_id(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '-' || *s == '_' || *s == '.'))
            return 0;
    return 1;
}

/* Split `line` at single spaces into at most `max` fields; -1 on an empty field. */
static int fields(char *line, char **f, int max) {
    int n = 0;
    for (char *p = line;;) {
        if (n == max) return -1;
        f[n++] = p;
        char *sp = strchr(p, ' ');
        if (!sp) break;
        *sp = 0;
        p = sp + 1;
    }
    for (int i = 0; i < n; i++)
        if (!*f[i]) return -1;
    return n;
}

/* 0 parsed, -1 refused (reported). */
static int parse_file(struct vgpu_config *c, const char *path, char *text) {
    int lineno = 0, seen_header = 0;
    for (char *line = text, *next; line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        lineno++;
        if (!seen_header) {
            if (strcmp(line, "vgpu-limits 1") != 0) {
                say("limits file %s: line 1 must be \"vgpu-limits 1\"; allocations are refused",
                    path);
                return -1;
            }
            seen_header = 1;
            continue;
        }
        if (!*line || line[0] == '#') continue;
        char *f[6];
        int n = fields(line, f, 6);
        if (n == 2 && strcmp(f[0], "allocation") == 0 && safe_id(f[1]) &&
            strlen(f[1]) < sizeof c->allocation) {
            copy(c->allocation, sizeof c->allocation, f[1]);
        } else if (n == 2 && strcmp(f[0], "oversubscribe") == 0 &&
                   (strcmp(f[1], "0") == 0 || strcmp(f[1], "1") == 0)) {
            c->oversubscribe = f[1][0] == '1';
        } else if ((n == 4 || n == 5) && strcmp(f[0], "gpu") == 0) {
            struct vgpu_limit l = {.sm = 0};
            /* The 5th field, the guarantee (sharing.compute: guaranteed), is at most the cap. */
            if (strlen(f[1]) >= sizeof l.uuid || c->count >= VGPU_MAX_DEVICES ||
                parse_u64(f[2], strlen(f[2]), &l.mem) != 0 || l.mem == 0 ||
                parse_percent(f[3], &l.sm) != 0 || (n == 5 && parse_percent(f[4], &l.req) != 0) ||
                (l.req > 0 && l.sm > 0 && l.req > l.sm)) {
                say("limits file %s: line %d: bad gpu record (want: gpu <uuid> <bytes> "
                    "<sm-percent> [<sm-request>], request <= percent, at most %d); allocations "
                    "are refused", path, lineno, VGPU_MAX_DEVICES);
                return -1;
            }
            copy(l.uuid, sizeof l.uuid, f[1]);
            for (int i = 0; i < c->count; i++) {
                if (strcasecmp(c->dev[i].uuid, l.uuid) == 0) {
                    say("limits file %s: line %d: GPU %s listed twice; allocations are refused",
                        path, lineno, l.uuid);
                    return -1;
                }
            }
            c->dev[c->count++] = l;
        } else {
            say("limits file %s: line %d: unknown or malformed record \"%s\"; allocations are "
                "refused", path, lineno, f[0] && n > 0 ? f[0] : line);
            return -1;
        }
    }
    if (!seen_header) {
        say("limits file %s is empty; allocations are refused", path);
        return -1;
    }
    return 0;
}

/* 1: the file decided the limits (mode FILE, maybe all_bad); 0: there is no file. */
static int load_file(struct vgpu_config *c) {
    const char *path = LIMITS_FILE;
    struct stat st;
    int production = stat(LIMITS_FILE, &st) == 0;
    const char *over = getenv("VGPU_LIMITS_FILE");
    if (!production && over && *over) path = over;
    else if (!production) return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT && !production) return 0;
    c->mode = VGPU_MODE_FILE;
    if (fd < 0) {
        say("cannot read the limits file %s: %s; allocations are refused", path, strerror(errno));
        c->all_bad = 1;
        return 1;
    }
    char buf[65536];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0 || n == (ssize_t)sizeof buf - 1) {
        say("cannot read the limits file %s: %s; allocations are refused", path,
            n < 0 ? strerror(errno) : "larger than 64 KiB");
        c->all_bad = 1;
        return 1;
    }
    buf[n] = 0;
    if (parse_file(c, path, buf) != 0) {
        c->all_bad = 1;
        c->count = 0;
        return 1;
    }
    /* Where the GPU's other containers are seen is the host's mount, whatever the envs say:
     * a process pointed at an empty directory would think its neighbours idle. */
    if (production) copy(c->peers_dir, sizeof c->peers_dir, DEFAULT_PEERS_DIR);
    /* The region of a mounted limits file is the allocation's, whatever the envs say: a
     * process pointed at a private region would escape the container's shared count. */
    if (production && c->allocation[0])
        snprintf(c->region_path, sizeof c->region_path, "%s/%s.cache", REGION_DIR, c->allocation);
    return 1;
}

/* --- the envs ------------------------------------------------------------------------------- */

struct env_val {
    int set, bad;
    uint64_t mem;
    int sm;
};

enum { ENV_MEM, ENV_SM, ENV_REQ };

/* NAME or NAME_<i>: -1 for NAME, i, or -2 when it is neither. */
static int env_index(const char *entry, const char *name, const char **value) {
    size_t n = strlen(name);
    if (strncmp(entry, name, n) != 0) return -2;
    const char *p = entry + n;
    if (*p == '=') {
        *value = p + 1;
        return -1;
    }
    if (*p != '_' || p[1] < '0' || p[1] > '9') return -2;
    const char *eq = strchr(p, '=');
    uint64_t i;
    if (!eq || parse_u64(p + 1, (size_t)(eq - p - 1), &i) != 0 || i > 1000000) return -2;
    *value = eq + 1;
    return (int)i;
}

static void load_env(struct vgpu_config *c) {
    struct env_val mem[VGPU_MAX_DEVICES + 1] = {{0}}, sm[VGPU_MAX_DEVICES + 1] = {{0}},
                   req[VGPU_MAX_DEVICES + 1] = {{0}};
    int any = 0, max_index = -1;
    for (char **e = vgpu_environ(); e && *e; e++) {
        const char *v = NULL;
        int kind = ENV_MEM, i = env_index(*e, "CUDA_DEVICE_MEMORY_LIMIT", &v);
        if (i == -2) {
            kind = ENV_SM;
            i = env_index(*e, "CUDA_DEVICE_SM_LIMIT", &v);
        }
        if (i == -2) {
            kind = ENV_REQ;
            i = env_index(*e, "CUDA_DEVICE_SM_REQUEST", &v);
        }
        if (i == -2) continue;
        int is_mem = kind == ENV_MEM;
        any = 1;
        const char *eq = strchr(*e, '=');
        int namelen = (int)(eq - *e);
        if (i >= VGPU_MAX_DEVICES) {
            say("%.*s: at most %d devices are supported; ignored", namelen, *e, VGPU_MAX_DEVICES);
            continue;
        }
        struct env_val *slot = is_mem ? &mem[i + 1] : kind == ENV_SM ? &sm[i + 1] : &req[i + 1];
        slot->set = 1;
        int ok = is_mem ? vgpu_parse_size(v, &slot->mem) == 0 : parse_percent(v, &slot->sm) == 0;
        if (!ok) {
            slot->bad = 1;
            say("%.*s=%s is not %s; allocations on %s are refused", namelen, *e, v,
                is_mem ? "a size (an integer with an optional k, m or g suffix)"
                       : "a percentage (an integer 0..100)",
                i < 0 ? "every device without its own value" : "that device");
        }
        if (i > max_index) max_index = i;
    }
    if (!any) return;
    c->mode = VGPU_MODE_ENV;
    /* NVIDIA_VISIBLE_DEVICES lists the container's GPUs by UUID in physical order: index i
     * of the envs is the i-th of them. Otherwise index i is CUDA ordinal i. */
    const char *vis = getenv("NVIDIA_VISIBLE_DEVICES");
    char names[VGPU_MAX_DEVICES][VGPU_UUID_SIZE];
    int nnames = 0, all_uuid = vis && *vis;
    if (all_uuid) {
        char buf[4096];
        copy(buf, sizeof buf, vis);
        for (char *t = buf, *next; t; t = next) { /* comma-separated */
            next = strchr(t, ',');
            if (next) *next++ = 0;
            if (!*t) continue; /* as strtok_r: empty fields are skipped */
            while (*t == ' ') t++;
            if (strncmp(t, "GPU-", 4) != 0 && strncmp(t, "MIG-", 4) != 0) all_uuid = 0;
            if (nnames < VGPU_MAX_DEVICES) copy(names[nnames++], VGPU_UUID_SIZE, t);
        }
    }
    c->by_uuid = all_uuid && nnames > 0;
    c->count = c->by_uuid ? nnames : max_index + 1;
    c->dflt.mem = mem[0].set && !mem[0].bad ? mem[0].mem : UINT64_MAX;
    c->dflt.sm = sm[0].set && !sm[0].bad ? sm[0].sm : 0;
    c->dflt.req = req[0].set && !req[0].bad ? req[0].sm : 0;
    c->dflt.bad = mem[0].bad || sm[0].bad || req[0].bad;
    for (int i = 0; i < c->count; i++) {
        struct vgpu_limit *l = &c->dev[i];
        const struct env_val *m = &mem[i + 1], *s = &sm[i + 1], *r = &req[i + 1];
        if (c->by_uuid) copy(l->uuid, sizeof l->uuid, names[i]);
        l->mem = m->set ? (m->bad ? 0 : m->mem) : c->dflt.mem;
        l->sm = s->set ? (s->bad ? 0 : s->sm) : c->dflt.sm;
        l->req = r->set ? (r->bad ? 0 : r->sm) : c->dflt.req;
        l->bad = (m->set ? m->bad : mem[0].bad) || (s->set ? s->bad : sm[0].bad) ||
                 (r->set ? r->bad : req[0].bad);
    }
    const char *os = getenv("CUDA_OVERSUBSCRIBE");
    if (os && *os) {
        if (strcasecmp(os, "true") == 0 || strcmp(os, "1") == 0) c->oversubscribe = 1;
        else if (strcasecmp(os, "false") != 0 && strcmp(os, "0") != 0)
            say("CUDA_OVERSUBSCRIBE=%s is not true or false; taken as false", os);
    }
}

void vgpu_config_load(struct vgpu_config *c) {
    memset(c, 0, sizeof *c);
    const char *cache = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    copy(c->region_path, sizeof c->region_path, cache && *cache ? cache : DEFAULT_REGION);
    const char *lock = getenv("VGPU_LOCK_DIR");
    copy(c->lock_dir, sizeof c->lock_dir, lock && *lock ? lock : DEFAULT_LOCK_DIR);
    const char *peers = getenv("VGPU_COMPUTE_PEERS");
    copy(c->peers_dir, sizeof c->peers_dir, peers && *peers ? peers : DEFAULT_PEERS_DIR);
    if (!load_file(c)) load_env(c);
    /* The pacing file lives beside the region: <name>.cache -> <name>.pace. */
    size_t n = strlen(c->region_path);
    int cut = n > 6 && strcmp(c->region_path + n - 6, ".cache") == 0 ? 6 : 0;
    snprintf(c->pace_path, sizeof c->pace_path, "%.*s.pace", (int)(n - (size_t)cut), c->region_path);
}

struct vgpu_limit vgpu_config_lookup(const struct vgpu_config *c, const char *uuid, int ordinal) {
    struct vgpu_limit none = {.mem = UINT64_MAX};
    if (c->mode == VGPU_MODE_NONE) return none;
    if (c->mode == VGPU_MODE_FILE) {
        struct vgpu_limit closed = {.mem = 0, .bad = 1};
        if (c->all_bad) return closed;
        for (int i = 0; i < c->count; i++)
            if (uuid && strcasecmp(c->dev[i].uuid, uuid) == 0) return c->dev[i];
        /* A GPU the allocation does not name: not ours to use. */
        return closed;
    }
    if (c->by_uuid) {
        for (int i = 0; i < c->count; i++)
            if (uuid && strcasecmp(c->dev[i].uuid, uuid) == 0) return c->dev[i];
    } else if (ordinal >= 0 && ordinal < c->count) {
        return c->dev[ordinal];
    }
    struct vgpu_limit d = c->dflt;
    if (uuid) copy(d.uuid, sizeof d.uuid, uuid);
    return d;
}
