/* Shared by the region test programs: the region API loaded from libvgpu.so (path in
 * $VGPU_SHIM_LIB) as a preloaded shim would be, test limits, small helpers. Header-only:
 * every .c file in tests/native is a program of its own. */
#ifndef VGPU_REGION_TEST_H
#define VGPU_REGION_TEST_H

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../native/libvgpu/include/vgpu/region.h"

struct region_api {
    int (*create)(const char *, const struct vgpu_limits *, char *, size_t);
    int (*open)(const char *, const struct vgpu_limits *, struct vgpu_region **, char *, size_t);
    void (*close)(struct vgpu_region *);
    int (*device_index)(const struct vgpu_region *, const char *);
    uint64_t (*limit)(const struct vgpu_region *, int);
    int (*reserve)(struct vgpu_region *, int, uint64_t);
    void (*commit)(struct vgpu_region *, int, uint64_t);
    void (*rollback)(struct vgpu_region *, int, uint64_t);
    void (*release)(struct vgpu_region *, int, uint64_t);
    uint64_t (*usage)(const struct vgpu_region *, int);
    uint64_t (*own_usage)(const struct vgpu_region *, int);
    int (*reap)(struct vgpu_region *);
    int (*snapshot)(const char *, struct vgpu_region_snapshot *, char *, size_t);
};

static struct region_api R;

static inline void __attribute__((noreturn, format(printf, 1, 2))) die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

#define CHECK(cond, ...)                 \
    do {                                 \
        if (!(cond)) die(__VA_ARGS__);   \
    } while (0)

static inline void *region_sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) die("libvgpu.so does not export %s", name);
    return p;
}

static inline void region_api_load(void) {
    const char *path = getenv("VGPU_SHIM_LIB");
    if (!path) die("set VGPU_SHIM_LIB to the libvgpu.so to test");
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) die("dlopen %s: %s", path, dlerror());
    *(void **)&R.create = region_sym(lib, "vgpu_region_create");
    *(void **)&R.open = region_sym(lib, "vgpu_region_open");
    *(void **)&R.close = region_sym(lib, "vgpu_region_close");
    *(void **)&R.device_index = region_sym(lib, "vgpu_region_device_index");
    *(void **)&R.limit = region_sym(lib, "vgpu_region_limit");
    *(void **)&R.reserve = region_sym(lib, "vgpu_region_reserve");
    *(void **)&R.commit = region_sym(lib, "vgpu_region_commit");
    *(void **)&R.rollback = region_sym(lib, "vgpu_region_rollback");
    *(void **)&R.release = region_sym(lib, "vgpu_region_release");
    *(void **)&R.usage = region_sym(lib, "vgpu_region_usage");
    *(void **)&R.own_usage = region_sym(lib, "vgpu_region_own_usage");
    *(void **)&R.reap = region_sym(lib, "vgpu_region_reap");
    *(void **)&R.snapshot = region_sym(lib, "vgpu_region_snapshot");
}

/* Test GPUs are GPU-00000000-0000-0000-0000-00000000000<d>. */
static inline void test_uuid(char *out, size_t n, int d) {
    snprintf(out, n, "GPU-00000000-0000-0000-0000-%012d", d);
}

/* Limits of `count` devices, each `bytes`. */
static inline struct vgpu_limits test_limits(int count, uint64_t bytes) {
    struct vgpu_limits l;
    memset(&l, 0, sizeof l);
    l.count = (uint32_t)count;
    for (int d = 0; d < count; d++) {
        test_uuid(l.devices[d].uuid, sizeof l.devices[d].uuid, d);
        l.devices[d].memory_limit = bytes;
        l.devices[d].sm_percent = 50;
    }
    return l;
}

static struct vgpu_region *open_region(const char *path, const struct vgpu_limits *limits) {
    char err[VGPU_REGION_ERRLEN];
    struct vgpu_region *r = NULL;
    if (R.open(path, limits, &r, err, sizeof err) != VGPU_REGION_OK) die("open: %s", err);
    return r;
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Sizes: a number with an optional k/m/g suffix (powers of 1024). */
static inline uint64_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    switch (*end) {
    case 'k': return (uint64_t)v << 10;
    case 'm': return (uint64_t)v << 20;
    case 'g': return (uint64_t)v << 30;
    default: return (uint64_t)v;
    }
}

/* A snapshot's books: each device's used is what its live processes hold ... */
static inline void check_sums(const struct vgpu_region_snapshot *s, const char *when) {
    for (uint32_t d = 0; d < s->device_count; d++) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < s->process_count; i++)
            if (s->processes[i].alive) sum += s->processes[i].used[d];
        CHECK(sum == s->devices[d].used, "%s: device %u used %llu, live processes hold %llu", when, d,
              (unsigned long long)s->devices[d].used, (unsigned long long)sum);
    }
}

/* ... and within its limit. */
static inline void check_books(const struct vgpu_region_snapshot *s, const char *when) {
    check_sums(s, when);
    for (uint32_t d = 0; d < s->device_count; d++) {
        CHECK(s->devices[d].used <= s->devices[d].memory_limit,
              "%s: device %u used %llu over its limit %llu", when, d,
              (unsigned long long)s->devices[d].used,
              (unsigned long long)s->devices[d].memory_limit);
    }
}

#endif
