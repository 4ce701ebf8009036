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
 * a process killed between two of them loses at most one refill interval of credit.
 *
 * Guarantees (sharing.compute: guaranteed, docs/compute.md): a container with a guarantee
 * publishes it in its record (`request`) and, as it launches, until when it is busy
 * (`active_ns`: now, plus the work it has queued as long as that takes at its guarantee).
 * Its rate is worked out from its peers' records, read through the host's read-only mount of
 * every container's directory (peers_dir): the rest of the GPU once the busy peers' guarantees
 * are set aside, never below its own guarantee, never above its cap. Nothing a container
 * writes can lower a peer's rate below that peer's guarantee (a peer's rate comes from its
 * own read-only limits and records only others can write), and its own records only bear on
 * what it lends (security.md).
 *
 * The private budget holds one process, not the container: a tenant that keeps its shared
 * file full gets its rate once per process. So the node agent measures each container's GPU
 * time with the driver (per-process utilisation, attributed by the container's mounts) and
 * publishes it read-only beside the peers (<peers_dir>/<allocation>.gputime, node/observe/
 * gputime.py); each process scales its private rate by what that measure says the container
 * took beyond its rate (gputime_scale). Absent or stale: the private rate is the whole rate. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#define PACE_MAGIC "VGPUPAC"
#define PACE_VERSION 1u
#define CAP_NS 40000000ll          /* 40 ms of wall time's worth of credit at most */
#define MIN_SLEEP_NS 20000ll
#define MAX_SLEEP_NS 20000000ll
#define BUSY_NS 40000000ull        /* a peer that has not launched for one window is idle */
#define RATE_NS 2000000ull         /* a guaranteed rate is worked out again after 2 ms */
#define RESCAN_NS 40000000ull      /* the peers' files are looked for again each window */
#define PEER_MAX 128               /* pacing files read (containers of the node, on any GPU) */
#define PEER_TOP_ENTRIES 4096      /* entries of peers_dir looked at */
#define PEER_DIR_ENTRIES 64        /* entries of one container's directory looked at */
#define SCALE_ONE 1000             /* the private rate's scale: per mille */
#define SCALE_MIN 4                /* 0.4 % of the rate at least: a process always progresses,
                                    * and up to 250 forging processes are still held (region.h's
                                    * 256 slots) */
#define SCALE_DEADBAND 10          /* per mille of the GPU over the rate that is not acted on */
#define GPUTIME_MAGIC "VGPUGPT"
#define GPUTIME_VERSION 1u
#define GPUTIME_READ_NS 40000000ull /* the node agent's record is read once per window at most */
#define GPUTIME_STALE_NS 5000000000ull /* older than this: the agent is gone, today's pacing */
#define CAL_NS 20000000ull         /* the driver's measure of this process: read every 20 ms at most */
#define CAL_MAX_NS 1500000000ull   /* a longer period starts over: NVML keeps about a second
                                    * of samples, taken every 1/6 s to 1 s by product */
#define CAL_GAP_NS 80000000ull     /* no read for this long (peers busy: every 20 ms at most):
                                    * the settles start over (calibrate) */
#define CAL_STAMPS 32             /* the periods' ends one read looks at (1.5 s of 1/6 s) */
#define CAL_SCALE_MIN 100          /* per mille: a stretched kernel charged 10x what ran at most */
#define CAL_SCALE_MAX 4000         /* and a quarter of it at least */
#define CAL_SAMPLES 512            /* NVML's per-process samples asked for: every process of the
                                    * GPU, ~6 a second each, since the last read (with fewer
                                    * room NVML answers INSUFFICIENT_SIZE and nothing is settled) */

struct vgpu_pace_dev {
    char uuid[VGPU_UUID_SIZE];
    uint32_t percent;  /* as the creator of the file wrote it */
    uint32_t request;  /* the container's guarantee in percent, 0 none (its peers read it) */
    uint64_t active_ns; /* CLOCK_MONOTONIC until which it is busy here (see above) */
    uint64_t held_ns;  /* how long its launches waited in all (metrics) */
    uint64_t gpu_until; /* CLOCK_MONOTONIC until which the work it queued here would run, as
                         * time-slicing with its busy peers stretches it (peers read it) */
    uint64_t reserved1[2];
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
_Static_assert(offsetof(struct vgpu_pace_dev, request) == 84 && offsetof(struct vgpu_pace_dev, active_ns) == 88 &&
                   offsetof(struct vgpu_pace_dev, held_ns) == 96 && offsetof(struct vgpu_pace_dev, gpu_until) == 104,
               "the record's layout is a contract (docs/contracts.md)");
_Static_assert(offsetof(struct pace_file, dev) == 64, "the header is one line");

/* The mapping, made once under vgpu.mu (this file's part of the process state). */
static struct pace_file *g_file;
static int g_file_state; /* 0 not tried, 1 mapped, -1 unusable */

static int init_file(int fd, const struct vgpu_limits *lim) {
    if (vgpu_file_allocate(fd, sizeof(struct pace_file)) != 0) return -1; /* never a SIGBUS */
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
    if (fchmod(fd, 0666) != 0 || init_file(fd, &lim) != 0 || (link(tmp, path) != 0 && errno != EEXIST))
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

struct vgpu_pace_dev *vgpu_pace_attach(const char *uuid, int *percent, int req) {
    if (g_file_state == 0) {
        g_file = map_file(vgpu.cfg.pace_path);
        g_file_state = g_file ? 1 : -1;
    }
    for (uint32_t i = 0; g_file && i < g_file->count; i++) {
        struct vgpu_pace_dev *p = &g_file->dev[i];
        if (strcasecmp(p->uuid, uuid) != 0) continue;
        /* The file's share was written by the first process: nobody gets more than it. */
        if (*percent > 0 && p->percent > 0 && p->percent < (uint32_t)*percent) *percent = (int)p->percent;
        __atomic_store_n(&p->request, (uint32_t)req, __ATOMIC_RELAXED);
        return p;
    }
    /* No shared budget: pace this process alone rather than not at all. */
    VLOG(VGPU_LOG_WARN, "no shared compute budget for GPU %s in %s: this process is "
             "paced on its own", uuid, vgpu.cfg.pace_path);
    struct vgpu_pace_dev *own = calloc(1, sizeof *own);
    if (own) snprintf(own->uuid, sizeof own->uuid, "%s", uuid);
    return own;
}

/* A process's private bucket and the scale of its rate (per mille) that the driver's measure
 * of its container set (gputime_scale); d->own points at `b`, its first member. */
struct own_budget {
    struct vgpu_pace_dev b;
    int scale;           /* per mille of the rate this process may use (relaxed) */
    uint64_t applied_ns; /* when the scale last changed: windows that began before are not used */
};

struct vgpu_pace_dev *vgpu_pace_private(void) {
    struct own_budget *o = calloc(1, sizeof *o);
    if (!o) return NULL;
    o->scale = SCALE_ONE;
    return &o->b;
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

/* --- the GPU's other containers (guarantees) -------------------------------------------------
 * Their pacing files, open read-only (never mapped: a peer that truncated its file would make
 * our reads fault), found under peers_dir: <peers_dir>/<container>/<name>.pace. Bounded
 * everywhere a peer could make us work (entries looked at, files kept). */
static struct {
    pthread_mutex_t mu;
    int fd[PEER_MAX];
    int n;
    uint64_t scanned_ns;
} g_peers = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int is_pace_name(const char *n) {
    size_t l = strlen(n);
    return n[0] != '.' && l > 5 && strcmp(n + l - 5, ".pace") == 0;
}

static void peer_add(int dirfd, const char *name, const struct stat *own) {
    if (g_peers.n >= PEER_MAX) return;
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != sizeof(struct pace_file) ||
        (own && st.st_dev == own->st_dev && st.st_ino == own->st_ino)) {
        close(fd); /* not a pacing file, or our own container's (seen through the mount) */
        return;
    }
    g_peers.fd[g_peers.n++] = fd;
}

/* The kernel's directory record (getdents64): read with the system call rather than
 * fdopendir, which libc has only since GLIBC_2.4 (libc_versions.h: one version need). */
struct vgpu_dirent64 {
    uint64_t ino;
    int64_t off;
    unsigned short reclen;
    unsigned char type;
    char name[];
};

/* Pacing files in directory `fd` (taken over), and one level of subdirectories below. */
static void scan_dir(int fd, int depth, const struct stat *own) {
    _Alignas(8) char buf[2048];
    int budget = depth ? PEER_DIR_ENTRIES : PEER_TOP_ENTRIES;
    while (budget > 0) {
        long got = syscall(SYS_getdents64, fd, buf, sizeof buf);
        if (got <= 0) break;
        for (long at = 0; at < got && budget-- > 0;) {
            const struct vgpu_dirent64 *e = (const struct vgpu_dirent64 *)(buf + at);
            at += e->reclen;
            if (e->name[0] == '.') continue;
            if (is_pace_name(e->name)) {
                peer_add(fd, e->name, own);
            } else if (depth == 0 && (e->type == DT_DIR || e->type == DT_UNKNOWN)) {
                int sub = openat(fd, e->name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
                if (sub >= 0) scan_dir(sub, 1, own);
            }
        }
    }
    close(fd);
}

static void __attribute__((noinline)) rescan(uint64_t now) {
    for (int i = 0; i < g_peers.n; i++) close(g_peers.fd[i]);
    g_peers.n = 0;
    g_peers.scanned_ns = now;
    struct stat own;
    int have_own = stat(vgpu.cfg.pace_path, &own) == 0;
    int fd = open(vgpu.cfg.peers_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) scan_dir(fd, 0, have_own ? &own : NULL);
}

/* The sum of the guarantees of the peers busy on GPU `uuid` (g_peers.mu held), and in d's
 * cache until when the work each of them queued runs (time-slicing, vgpu_pace_gpu_time). A
 * peer's record is the peer's to write: a value out of range counts as none, and one that
 * claims more only lowers what is lent to us, never our guarantee. */
static int __attribute__((noinline)) busy_peers_percent(struct vgpu_dev *d, const char *uuid, uint64_t now) {
    static struct pace_file f; /* g_peers.mu held: one buffer, off the stack */
    uint64_t until[VGPU_PEER_UNTIL];
    int sum = 0, nuntil = 0;
    for (int i = 0; i < g_peers.n && sum < 100; i++) {
        if (pread(g_peers.fd[i], &f, sizeof f, 0) != (ssize_t)sizeof f) continue;
        if (memcmp(f.magic, PACE_MAGIC, sizeof f.magic) != 0 || f.version != PACE_VERSION) continue;
        uint32_t n = f.count < VGPU_MAX_DEVICES ? f.count : VGPU_MAX_DEVICES;
        for (uint32_t k = 0; k < n; k++) {
            struct vgpu_pace_dev *p = &f.dev[k];
            p->uuid[sizeof p->uuid - 1] = 0;
            if (strcasecmp(p->uuid, uuid) != 0) continue;
            if (p->request > 0 && p->request <= 100 && p->active_ns + BUSY_NS > now) {
                sum += (int)p->request;
                if (p->gpu_until > now && nuntil < VGPU_PEER_UNTIL) until[nuntil++] = p->gpu_until;
            }
            break;
        }
    }
    for (int i = 0; i < nuntil; i++) __atomic_store_n(&d->peer_until[i], until[i], __ATOMIC_RELAXED);
    __atomic_store_n(&d->npeer_until, nuntil, __ATOMIC_RELEASE);
    return sum < 100 ? sum : 100;
}

/* Time-slicing: while other contexts have work on the GPU, it turns between them every few
 * milliseconds, and a kernel's measured duration stretches by what they ran meanwhile. The
 * GPU time a kernel of `ns` measured (settled now) stands for: as measured when no peer
 * had work queued during it; else what its share of the GPU gives (ns / (1 + such peers)),
 * never less than `solo`, the least this kernel was measured at (or more: launch.c holds it
 * while its charges are scaled, calibrate). A peer's record can make our kernels cheaper
 * only down to that floor, the time they take when nobody runs beside them (security.md); a
 * GPU that runs kernels of contexts one after another (so nothing stretched them) is never
 * taken for time-slicing (the measure is the floor). */
int64_t vgpu_pace_gpu_time(struct vgpu_dev *d, int64_t ns, int64_t solo) {
    int n = __atomic_load_n(&d->npeer_until, __ATOMIC_ACQUIRE);
    if (LIKELY(n == 0) || ns <= solo) return ns;
    uint64_t now = now_ns();
    uint64_t from = now > (uint64_t)ns ? now - (uint64_t)ns : 0;
    int k = 0;
    for (int i = 0; i < n; i++) k += __atomic_load_n(&d->peer_until[i], __ATOMIC_RELAXED) > from;
    int64_t share = ns / (1 + k);
    return share > solo ? share : solo;
}

/* --- the driver's measure of this process (time-slicing) ------------------------------------
 * A kernel's charge above is a guess wherever it is stretched: a container that turned busy
 * beside busy ones has only seen its kernels stretched, so their floor is the stretched
 * duration, and it would be charged its neighbours' slices until it happened to see one run
 * alone (0.5 s to over 2 s on simgpu). The driver knows how long this process's work ran:
 * NVML's per-process utilisation, which the tenant cannot write. So while peers have work
 * queued, as often as the driver has a new sample period (looked for every CAL_NS at most),
 * the budget is settled against it: what the launches settled since the last settle were
 * charged, less the GPU time the driver measured the process running in the periods since,
 * is credited back (or, when the charges fell short, taken). A kernel still running at a
 * read is in the measure and not yet in the charges: it is in the next settle's, and the
 * settles add up to the driver's measure. Without a measure (no NVML, our pid not listed, no
 * sample yet) nothing is settled and the charges stand. */

static unsigned long long realtime_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000ull;
}

/* This process's GPU time (ns) in the driver's samples of d's GPU stamped after `*seen_us`,
 * and the span (ns) they cover; `*seen_us` moves to the newest stamp. A sample is a process's
 * share of the period that ended at its stamp: a real driver's periods are 1/6 s to 1 s long
 * (the product's), and a process that did not run in one has no sample for it. The period
 * began at the GPU's stamp before (peers are busy here, so their samples mark each period),
 * or at `*seen_us` for the oldest. 0 when nothing is newer (or NVML cannot say); 1 else, our
 * GPU time 0 when only peers ran. g_peers.mu held. */
static int own_gpu_time(const struct vgpu_dev *d, unsigned long long *seen_us, int64_t *used_ns,
                        int64_t *span_ns, unsigned long long *period_us) {
    static nvmlProcessUtilizationSample_t s[CAL_SAMPLES];
    unsigned long long stamps[CAL_STAMPS];
    nvmlDevice_t h;
    unsigned int n = CAL_SAMPLES, pid = vgpu_nvml_pid(), m = 0;
    if (!vgpu.real.nvmlDeviceGetProcessUtilization || !vgpu_nvml_ready() ||
        vgpu.real.nvmlDeviceGetHandleByUUID(d->uuid, &h) != NVML_SUCCESS ||
        vgpu.real.nvmlDeviceGetProcessUtilization(h, s, &n, *seen_us) != NVML_SUCCESS)
        return 0;
    for (unsigned int i = 0; i < n && i < CAL_SAMPLES; i++) { /* the periods' ends, in order */
        unsigned long long t = s[i].timeStamp;
        unsigned int j = 0;
        if (t <= *seen_us) continue;
        while (j < m && stamps[j] < t) j++;
        if ((j < m && stamps[j] == t) || m == CAL_STAMPS) continue;
        memmove(&stamps[j + 1], &stamps[j], (m - j) * sizeof stamps[0]);
        stamps[j] = t;
        m++;
    }
    if (m == 0) return 0;
    int64_t used = 0;
    for (unsigned int i = 0; i < n && i < CAL_SAMPLES; i++) {
        if (s[i].pid != pid || s[i].timeStamp <= *seen_us) continue;
        unsigned int j = 0;
        while (j < m && stamps[j] < s[i].timeStamp) j++;
        unsigned long long from = j ? stamps[j - 1] : *seen_us;
        used += (int64_t)(s[i].timeStamp - from) * 1000 * (s[i].smUtil > 100 ? 100 : s[i].smUtil) / 100;
    }
    *span_ns = (int64_t)(stamps[m - 1] - *seen_us) * 1000;
    *seen_us = stamps[m - 1];
    *period_us = m > 1 ? stamps[m - 1] - stamps[m - 2] : (unsigned long long)*span_ns / 1000;
    *used_ns = used;
    return 1;
}

/* g_peers.mu held; d's peers have work queued; tried every CAL_NS at most (cal_read_ns). What
 * was charged since the last settle is settled against the driver's samples since its newest
 * stamp then (cal_seen_us, CPU microseconds). */
static void __attribute__((noinline)) calibrate(struct vgpu_dev *d, uint64_t now) {
    /* Reads that paused (the peers were idle a while, or this process was) start over: the
     * process ran at another pace meanwhile, charged as measured, and one settle over all
     * of it took the charges made since the driver's last period too: a container whose
     * peers came back after a second was credited up to 86 ms beyond its bucket, ran 122 ms
     * of the next 167 and then paid it back at 0 % for 400 ms (test_shim_guarantee.py). */
    if (now - d->cal_read_ns > CAL_GAP_NS) d->cal_seen_us = 0;
    d->cal_read_ns = now;
    vgpu_launch_settle();
    unsigned long long now_us = realtime_us();
    int64_t used, span;
    if (d->cal_seen_us == 0 || now_us <= d->cal_seen_us || now_us - d->cal_seen_us > CAL_MAX_NS / 1000) {
        /* Start over from the newest sample the driver has (what was charged before stands):
         * settles then begin at a period's end, so the first covers whole periods. */
        unsigned long long seen = now_us - CAL_MAX_NS / 1000;
        unsigned long long period;
        if (own_gpu_time(d, &seen, &used, &span, &period) == 0) return;
        d->cal_seen_us = seen;
        /* A process that ran before (a lender whose peers turned busy, or came back) ran in
         * the period under way too, at another pace and charged before now: its settles
         * begin at the end of that period. A newcomer's GPU time in it is all from now on. */
        d->cal_busy_before = __atomic_exchange_n(&d->cal_charged, 0, __ATOMIC_RELAXED) > 0;
        return;
    }
    unsigned long long period;
    if (own_gpu_time(d, &d->cal_seen_us, &used, &span, &period) == 0) return; /* no new period yet */
    d->cal_next_us = d->cal_seen_us + period;
    if (d->cal_busy_before) {
        d->cal_busy_before = 0;
        __atomic_store_n(&d->cal_charged, 0, __ATOMIC_RELAXED);
        return;
    }
    int64_t charged = __atomic_exchange_n(&d->cal_charged, 0, __ATOMIC_RELAXED);
    /* Bounded both ways by what ran: `used` by the periods, the charges by the (overlap-
     * trimmed) brackets settled since the last settle. */
    vgpu_pace_add(d, charged - used);
    /* A real driver's samples come every 1/6 s to 1 s: a settle that late is more than the
     * bucket holds (its credit capped at CAP_NS's worth), so the stretched charges are
     * scaled by what the settles found, and each settle is left only the residue. Learnt
     * from periods in which the process ran a twentieth of the time at least, damped (the
     * samples are whole percent, of periods a read's delay off the charges'). The first
     * learns half the way only: a newcomer's first period is one in which its neighbours
     * still ran at what they had been lent and stretched its kernels more than from then on
     * (found 0.44 - 0.49 of its charges, 0.68 after). Learnt 3/4 of the way, the next period
     * was undercharged: it ran ahead at 33 - 40 % of the GPU, on that and the first settle's
     * credit, then paid the debt at 8 - 21 % (test_shim_guarantee.py failed 3 of 120 runs).
     * Half way it errs high, a little under its share until the next settle credits it. */
    if (used > 0 && charged > span / 20) {
        int64_t k = __atomic_load_n(&d->cal_scale, __ATOMIC_RELAXED);
        int first = k == 0;
        k = k ? k : 1000;
        int64_t want = k * used / charged;
        k = first ? (k + want) / 2 : (k + 3 * want) / 4;
        k = k < CAL_SCALE_MIN ? CAL_SCALE_MIN : k > CAL_SCALE_MAX ? CAL_SCALE_MAX : k;
        __atomic_store_n(&d->cal_scale, (int)k, __ATOMIC_RELAXED);
    }
}

/* A charge of a kernel stretched by busy peers (vgpu_pace_gpu_time), as the driver's measure
 * found such charges to be (calibrate). */
int64_t vgpu_pace_scaled(const struct vgpu_dev *d, int64_t ns) {
    int s = __atomic_load_n(&d->cal_scale, __ATOMIC_RELAXED);
    return s ? ns * s / 1000 : ns;
}

/* --- the driver's measure of this container (node/observe/gputime.py) -----------------------
 * One GPU of the record: the container's share of the GPU (per mille) in the window
 * [start_ns, end_ns] of CLOCK_MONOTONIC, as the driver's per-process utilisation gave it. */
struct gputime_dev {
    char uuid[VGPU_UUID_SIZE];
    uint32_t share;
    uint32_t reserved;
    uint64_t start_ns;
    uint64_t end_ns;
};

struct gputime_file {
    char magic[8];
    uint32_t version;
    uint32_t count;
    uint64_t size;
    uint64_t reserved;
    struct gputime_dev dev[VGPU_MAX_DEVICES];
};

_Static_assert(sizeof(struct gputime_dev) == 104 && offsetof(struct gputime_file, dev) == 32,
               "the record's layout is a contract (docs/contracts.md)");
_Static_assert(offsetof(struct own_budget, b) == 0, "d->own is the budget's first member");

/* The last record read (g_peers.mu held), and when it was read. */
static struct gputime_file g_gt;
static int g_gt_ok;
static uint64_t g_gt_read_ns;

/* Re-opened each read: the agent replaces the file whole (rename). Its path is the host's
 * read-only mount and the allocation of the read-only limits file, which the tenant cannot
 * redirect (limits.c); never mapped, size-checked, one pread. */
static void __attribute__((noinline)) gputime_read(uint64_t now) {
    if (g_gt_read_ns && now - g_gt_read_ns < GPUTIME_READ_NS) return;
    g_gt_read_ns = now;
    g_gt_ok = 0;
    if (!vgpu.cfg.allocation[0]) return;
    char path[sizeof vgpu.cfg.peers_dir + sizeof vgpu.cfg.allocation + 16];
    snprintf(path, sizeof path, "%s/%s.gputime", vgpu.cfg.peers_dir, vgpu.cfg.allocation);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size == sizeof g_gt &&
        pread(fd, &g_gt, sizeof g_gt, 0) == (ssize_t)sizeof g_gt)
        g_gt_ok = memcmp(g_gt.magic, GPUTIME_MAGIC, sizeof g_gt.magic) == 0 &&
                  g_gt.version == GPUTIME_VERSION && g_gt.size == sizeof g_gt &&
                  g_gt.count <= VGPU_MAX_DEVICES;
    close(fd);
}

/* The private rate's scale from the container's measured share (g_peers.mu held): over the
 * rate, the scale shrinks in proportion (n processes of a forged shared budget: to 1/n in one
 * step); under it, it grows by at most a quarter a window, up to the whole rate. Only a window
 * that began after the last change is used, so each step sees the effect of the one before
 * (no overshoot from a measure of the old scale). */
static void gputime_scale(struct vgpu_dev *d, uint64_t now, int rate) {
    struct own_budget *o = (struct own_budget *)d->own;
    if (!o) return;
    gputime_read(now);
    const struct gputime_dev *r = NULL;
    for (uint32_t i = 0; g_gt_ok && i < g_gt.count; i++) {
        g_gt.dev[i].uuid[sizeof g_gt.dev[i].uuid - 1] = 0; /* our copy */
        if (strcasecmp(g_gt.dev[i].uuid, d->uuid) == 0) {
            r = &g_gt.dev[i];
            break;
        }
    }
    if (!r || r->end_ns > now || now - r->end_ns > GPUTIME_STALE_NS || r->start_ns >= r->end_ns) {
        __atomic_store_n(&o->scale, SCALE_ONE, __ATOMIC_RELAXED); /* no measure: today's pacing */
        return;
    }
    if (r->start_ns < o->applied_ns) return; /* measured (partly) at the scale before */
    int64_t share = r->share > SCALE_ONE ? SCALE_ONE : r->share, target = (int64_t)rate * 10;
    int64_t s = __atomic_load_n(&o->scale, __ATOMIC_RELAXED), was = s;
    if (share > target + SCALE_DEADBAND) s = s * target / share;
    else if (share < target) s = share * 5 < target * 4 ? s * 5 / 4 : s * target / (share ? share : 1);
    s = s < SCALE_MIN ? SCALE_MIN : s > SCALE_ONE ? SCALE_ONE : s;
    if (s != was) {
        __atomic_store_n(&o->scale, (int)s, __ATOMIC_RELAXED);
        o->applied_ns = now;
    }
}

/* How long after the last read the driver's measure is read again (g_peers.mu held, peers
 * busy): CAL_NS, and RATE_NS for CAL_NS from when its next period is due to end: launches
 * settled between that end and the read are charges of the next period's GPU time, and up
 * to 20 ms of them made B's and C's settles swing period by period
 * (tests/libvgpu/test_shim_guarantee.py, 167 ms samples). */
static uint64_t cal_every(const struct vgpu_dev *d) {
    if (!d->cal_next_us) return CAL_NS;
    unsigned long long t = realtime_us();
    return t >= d->cal_next_us && t < d->cal_next_us + CAL_NS / 1000 ? RATE_NS : CAL_NS;
}

/* A guaranteed container's rate now: what its busy peers' guarantees leave, within
 * [guarantee, cap]; worked out again at most every RATE_NS (by one thread at a time). */
static int guaranteed_rate(struct vgpu_dev *d, uint64_t now, uint64_t queued_ns) {
    int rate = __atomic_load_n(&d->rate, __ATOMIC_RELAXED);
    if (LIKELY(now - __atomic_load_n(&d->rate_ns, __ATOMIC_RELAXED) < RATE_NS)) return rate;
    /* Launching, or waiting to, is being busy, and so is having work queued: told here, at
     * most every RATE_NS, as the time until which that work would run at our guarantee
     * (peers take us for idle one window after it). */
    uint64_t until = now + queued_ns * 100 / (uint64_t)d->req;
    __atomic_store_n(&d->pace->active_ns, until, __ATOMIC_RELAXED);
    /* The queued work itself, as long as time-slicing with the peers that have work queued
     * (last seen) makes it: how long we stretch their kernels. */
    uint64_t sharing = 1 + (uint64_t)__atomic_load_n(&d->npeer_until, __ATOMIC_RELAXED);
    __atomic_store_n(&d->pace->gpu_until, now + queued_ns * sharing, __ATOMIC_RELAXED);
    if (pthread_mutex_trylock(&g_peers.mu) != 0) return rate;
    if (g_peers.scanned_ns == 0 || now - g_peers.scanned_ns >= RESCAN_NS) rescan(now);
    int left = 100 - busy_peers_percent(d, d->uuid, now);
    if (__atomic_load_n(&d->npeer_until, __ATOMIC_RELAXED) && now - d->cal_read_ns >= cal_every(d))
        calibrate(d, now);
    int cap = d->sm ? d->sm : 100;
    rate = left > d->req ? left : d->req;
    rate = rate < cap ? rate : cap;
    gputime_scale(d, now, rate);
    pthread_mutex_unlock(&g_peers.mu);
    __atomic_store_n(&d->rate, rate, __ATOMIC_RELAXED);
    __atomic_store_n(&d->rate_ns, now, __ATOMIC_RELAXED);
    return rate;
}

/* refill() for a process's private bucket: no other process refills it, so plain (relaxed)
 * moves do; two of its threads refilling at once may add one interval twice, which only
 * this process can cause and which the shared bucket still bounds across processes.
 * `rate`: percent x the scale (per mille), so in units of 1/100000 of the GPU. */
static void refill_own(struct vgpu_pace_dev *p, int64_t rate, uint64_t now) {
    uint64_t last = __atomic_load_n(&p->last_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&p->last_ns, now, __ATOMIC_RELAXED);
    if (UNLIKELY(last == 0) || now <= last) return;
    uint64_t dt = now - last;
    int64_t cap = CAP_NS * rate / 100000;
    int64_t add = dt > 1000000000ull ? cap : (int64_t)(dt * (uint64_t)rate / 100000);
    int64_t t = __atomic_add_fetch(&p->tokens, add, __ATOMIC_RELAXED);
    if (t > cap) __atomic_store_n(&p->tokens, cap, __ATOMIC_RELAXED);
}

void vgpu_pace_wait(struct vgpu_dev *d, uint64_t queued_ns) {
    struct vgpu_pace_dev *p = d->pace, *own = d->own;
    uint64_t waited = 0;
    for (;;) {
        uint64_t now = now_ns();
        int percent = d->sm;
        int64_t rate = 0; /* the bucket in debt's rate, in 1/100000 of the GPU */
        if (d->req) percent = guaranteed_rate(d, now, queued_ns);
        refill(p, percent, now);
        int64_t t = __atomic_load_n(&p->tokens, __ATOMIC_ACQUIRE);
        if (own) {
            /* The shared bucket is in a file the tenant can write: the private one holds
             * this process to the rate whatever is written there. It is refilled only when
             * it reads empty: the same credit, later, off the common path. */
            int64_t o = __atomic_load_n(&own->tokens, __ATOMIC_RELAXED);
            if (o < 0) {
                rate = (int64_t)percent * __atomic_load_n(&((struct own_budget *)own)->scale, __ATOMIC_RELAXED);
                refill_own(own, rate, now);
                o = __atomic_load_n(&own->tokens, __ATOMIC_RELAXED);
            }
            if (o >= t) rate = 0;
            t = o < t ? o : t;
        }
        if (t >= 0) break;
        /* Sleep until the debt would be repaid at our rate (others may repay it sooner). */
        int64_t ns = rate > 0 ? -t * 100000 / rate : -t * 100 / percent;
        ns = ns < MIN_SLEEP_NS ? MIN_SLEEP_NS : ns > MAX_SLEEP_NS ? MAX_SLEEP_NS : ns;
        struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        waited += (uint64_t)ns;
    }
    if (UNLIKELY(waited)) __atomic_add_fetch(&p->held_ns, waited, __ATOMIC_RELAXED);
}

void vgpu_pace_add(struct vgpu_dev *d, int64_t ns) {
    if (!ns) return;
    __atomic_add_fetch(&d->pace->tokens, ns, __ATOMIC_ACQ_REL);
    if (d->own) __atomic_add_fetch(&d->own->tokens, ns, __ATOMIC_ACQ_REL);
}
