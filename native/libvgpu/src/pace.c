/* The compute budget: one token bucket per container and GPU, shared by all the container's
 * processes through a small file beside the region (<name>.pace in the region's directory).
 *
 * Tokens are nanoseconds of GPU time. They accrue at `percent` of wall time (the refill is
 * claimed by whoever moves `last_ns` forward with a compare-and-swap, so exactly one process
 * adds each interval), launches take their estimated cost, and launch.c corrects each
 * estimate with the time the GPU really spent (events). A launch waits while the bucket is in
 * debt. The bucket holds at most CAP_NS x percent, so an idle container cannot save up a
 * burst that would skew a one-second window by more than a few points, yet a launcher the
 * scheduler starved for a few tens of milliseconds catches up.
 *
 * Crash safety: there is no lock. Every update is one atomic instruction on the shared file;
 * a process killed between two of them loses at most one refill interval of credit. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#define PACE_MAGIC "VGPUPAC"
#define PACE_VERSION 1u
#define CAP_NS 40000000ll          /* 40 ms of wall time's worth of credit at most */
#define MIN_SLEEP_NS 20000ll
#define MAX_SLEEP_NS 20000000ll

struct vgpu_pace_dev {
    char uuid[VGPU_UUID_SIZE];
    uint32_t percent;  /* as the creator of the file wrote it */
    uint32_t reserved0;
    uint64_t reserved1[5];
    /* its own cache line: what every launch touches */
    int64_t tokens;    /* ns of GPU time available; negative: debt */
    uint64_t last_ns;  /* CLOCK_MONOTONIC of the last refill; 0: not started */
    uint64_t reserved2[6];
};

struct pace_file {
    char magic[8];
    uint32_t version;
    uint32_t count;
    uint64_t size;
    uint64_t reserved[5];
    struct vgpu_pace_dev dev[VGPU_MAX_DEVICES];
};

_Static_assert(sizeof(struct vgpu_pace_dev) == 192, "pace device records are three cache lines");
_Static_assert(offsetof(struct vgpu_pace_dev, tokens) % 64 == 0, "the bucket starts a line");
_Static_assert(offsetof(struct pace_file, dev) == 64, "the header is one line");

/* The mapping, made once under vgpu.mu (this file's part of the process state). */
static struct pace_file *g_file;
static int g_file_state; /* 0 not tried, 1 mapped, -1 unusable */

static int init_file(int fd, const struct vgpu_limits *lim) {
    if (ftruncate(fd, sizeof(struct pace_file)) != 0) return -1;
    struct pace_file *f = mmap(NULL, sizeof *f, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) return -1;
    memcpy(f->magic, PACE_MAGIC, sizeof f->magic);
    f->version = PACE_VERSION;
    f->size = sizeof *f;
    for (uint32_t i = 0; i < lim->count; i++) {
        memcpy(f->dev[i].uuid, lim->devices[i].uuid, sizeof f->dev[i].uuid);
        f->dev[i].percent = lim->devices[i].sm_percent;
    }
    f->count = lim->count;
    munmap(f, sizeof *f);
    return 0;
}

/* Build the file under a temporary name and link it into place: nobody sees it half made. */
static void create_file(const char *path) {
    struct vgpu_limits lim;
    vgpu_container_limits(&lim);
    if (lim.count == 0) return;
    char tmp[sizeof vgpu.cfg.pace_path + 8];
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) return;
    if (fchmod(fd, 0666) == 0 && init_file(fd, &lim) == 0 && link(tmp, path) != 0 && errno != EEXIST)
        VLOG(VGPU_LOG_WARN, "cannot create the compute budget %s: %s", path, strerror(errno));
    unlink(tmp);
    close(fd);
}

static struct pace_file *map_file(const char *path) {
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT) {
        create_file(path);
        fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    }
    if (fd < 0) return NULL;
    struct stat st;
    struct pace_file *f = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size == sizeof *f) {
        f = mmap(NULL, sizeof *f, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (f == MAP_FAILED) f = NULL;
    }
    close(fd);
    if (f && (memcmp(f->magic, PACE_MAGIC, sizeof f->magic) != 0 || f->version != PACE_VERSION ||
              f->size != sizeof *f || f->count > VGPU_MAX_DEVICES)) {
        munmap(f, sizeof *f);
        f = NULL;
    }
    return f;
}

struct vgpu_pace_dev *vgpu_pace_attach(const char *uuid, int *percent) {
    if (g_file_state == 0) {
        g_file = map_file(vgpu.cfg.pace_path);
        g_file_state = g_file ? 1 : -1;
    }
    for (uint32_t i = 0; g_file && i < g_file->count; i++) {
        struct vgpu_pace_dev *p = &g_file->dev[i];
        if (strcasecmp(p->uuid, uuid) != 0) continue;
        /* The file's share was written by the first process: nobody gets more than it. */
        if (p->percent > 0 && p->percent < (uint32_t)*percent) *percent = (int)p->percent;
        return p;
    }
    /* No shared budget: pace this process alone rather than not at all. */
    VLOG(VGPU_LOG_WARN, "no shared compute budget for GPU %s in %s: this process is "
             "paced on its own", uuid, vgpu.cfg.pace_path);
    struct vgpu_pace_dev *own = calloc(1, sizeof *own);
    if (own) snprintf(own->uuid, sizeof own->uuid, "%s", uuid);
    return own;
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void refill(struct vgpu_pace_dev *p, int percent, uint64_t now) {
    uint64_t last = __atomic_load_n(&p->last_ns, __ATOMIC_ACQUIRE);
    if (UNLIKELY(last == 0)) {
        /* The first launch starts the clock; the bucket starts empty. */
        __atomic_compare_exchange_n(&p->last_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        return;
    }
    if (now <= last ||
        !__atomic_compare_exchange_n(&p->last_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return; /* nothing elapsed, or another launcher claimed this interval */
    uint64_t dt = now - last;
    int64_t cap = CAP_NS * percent / 100;
    int64_t add = dt > 1000000000ull ? cap : (int64_t)(dt * (uint64_t)percent / 100);
    int64_t t = __atomic_add_fetch(&p->tokens, add, __ATOMIC_ACQ_REL);
    while (t > cap && !__atomic_compare_exchange_n(&p->tokens, &t, cap, 0, __ATOMIC_ACQ_REL,
                                                   __ATOMIC_ACQUIRE)) {
    }
}

void vgpu_pace_wait(struct vgpu_pace_dev *p, int percent) {
    for (;;) {
        refill(p, percent, now_ns());
        int64_t t = __atomic_load_n(&p->tokens, __ATOMIC_ACQUIRE);
        if (t >= 0) return;
        /* Sleep until the debt would be repaid at our rate (others may repay it sooner). */
        int64_t ns = -t * 100 / percent;
        ns = ns < MIN_SLEEP_NS ? MIN_SLEEP_NS : ns > MAX_SLEEP_NS ? MAX_SLEEP_NS : ns;
        struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

void vgpu_pace_add(struct vgpu_pace_dev *p, int64_t ns) {
    if (ns) __atomic_add_fetch(&p->tokens, ns, __ATOMIC_ACQ_REL);
}
