/* The shared region: one file per container that accounts its GPU memory.
 *
 * Every CUDA-using process of the container maps the file (/tmp/vgpu/<allocation-id>.cache)
 * and owns one slot in it; the host plugin reads the same file (with pread, never a mapping
 * that a tenant could shrink under it) to report usage.
 * This header is the one definition of the file's layout: C includes it, and Python binds it
 * with cffi (src/vgpu_plugin/node/observe/region.py), which feeds it to ffi.cdef() after dropping comments
 * and preprocessor lines. Keep it plain declarations: constants in enums, literal array
 * sizes, no macros, no attributes.
 *
 * Rules of the file (the implementation is native/libvgpu/src/region*.c):
 * - Identity first: magic "VGPUREG", layout version, total size. Readers refuse anything else.
 * - Limits per device are written once, by whoever creates the file (the plugin on the host,
 *   or the first process), and never change. A process enforces min(its own limits, the
 *   region's): rewriting the region cannot raise anybody's limit.
 * - Slots are the truth, and there is no other: a slot holds a process's charge per device,
 *   the container's usage of a device is the sum of its slots below `slot_hwm`. A FREE slot
 *   holds 0 everywhere, so a sum need not look at `state`.
 * - A reservation takes no lock: the process adds the bytes to its own slot's `charged`
 *   (an atomic read-modify-write, sequentially consistent), then sums the slots (sequentially
 *   consistent loads) and takes the bytes back out if the sum passes its limit. Of two
 *   racing reservations the later one in that single order sees both charges, so the limit
 *   is never exceeded by reservations that stay. The price is that both may see each other
 *   and back out while one would fit: a process that backs out then retries under the lock
 *   word (below), where only lock-free racers can still interfere, and such a racer that
 *   backs out comes to the lock after it; so of two racers at the limit one always gets
 *   through when one fits. A newcomer raises `slot_hwm` (sequentially consistent) before
 *   its first add, so a racer's sum covers its slot whenever its add came first; while
 *   `slot_hwm` is 1 the only slot is the reserving process's own, and its add's result is
 *   the sum. A release subtracts from the own slot (a compare-and-swap that clamps at 0).
 *   `peak` is raised by a compare-and-swap when a reservation passes it.
 * - The lock word (0 free, else the holder's slot index + 1) serialises what is rare:
 *   registering a slot, reclaiming dead slots, closing, and the retry of a refused
 *   reservation. Its holder's death is found through the holder's slot's OFD lock, and the
 *   next taker just reclaims dead slots: there is no total to recompute.
 * - Liveness is a kernel lock: the owner of slot i holds an OFD write lock on the first byte
 *   of slots[i] for its lifetime. A slot whose byte can be locked belongs to a dead process;
 *   its charge is reclaimed once, under the lock word. No pid is ever compared, so pid
 *   namespaces and pid reuse do not matter; (pid, start time) are recorded for people. A
 *   process killed between its add and its back-out leaves the bytes in its dead slot: they
 *   count against the container (conservatively) until that reclaim.
 * - The host reads without any lock: it copies the slots twice (pread) and keeps a copy only
 *   when both agree and no device's sum over live processes passes its limit (else it reads
 *   again, briefly: a sum over the limit is a reservation between its add and its back-out,
 *   or a release and a reservation read at different instants). Each word is a real value
 *   of its slot, so a kept copy is a valid, at most microseconds stale, view that never
 *   shows more than the limit; only memory forced past it (a graph's, `forced` below) or a
 *   process stopped inside a reservation is shown over it, after the retries.
 */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <stddef.h>
#include <stdint.h>

enum {
    VGPU_REGION_VERSION = 3,  /* 2: per-device counters (stats); 3: no shared totals, lock-free
                                 reservations on the own slot */
    VGPU_MAX_DEVICES = 16,
    VGPU_MAX_SLOTS = 256,
    VGPU_UUID_SIZE = 80,   /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" and NUL, with room */
    VGPU_REGION_ERRLEN = 320 /* a good size for the err buffers below */
};

/* What the region calls return. */
enum vgpu_region_status {
    VGPU_REGION_OK = 0,
    VGPU_REGION_DENIED = 1,   /* reserve: the charge would exceed this process's limit */
    VGPU_REGION_EINVAL = 2,   /* no such device index, or a bad argument */
    VGPU_REGION_EFAIL = 3,    /* the region is unusable (file refused, slot lost); see err */
    VGPU_REGION_EBUSY = 4     /* snapshot: the slots kept changing for the whole read */
};

enum { VGPU_SLOT_FREE = 0, VGPU_SLOT_LIVE = 1 };

/* --- limits: what a container may use, per physical GPU ------------------------------------ */

struct vgpu_device_limit {
    char uuid[80];           /* NUL-terminated GPU UUID */
    uint64_t memory_limit;   /* bytes */
    uint32_t sm_percent;     /* 0..100, 0 = not limited; recorded for the host */
    uint32_t reserved;
};

struct vgpu_limits {
    uint32_t count;          /* 1..VGPU_MAX_DEVICES */
    uint32_t reserved;
    struct vgpu_device_limit devices[16];
};

/* --- the file -------------------------------------------------------------------------------
 * Sizes are multiples of 64 so every hot field group starts a cache line of its own. */

struct vgpu_region_device {
    char uuid[80];
    uint64_t memory_limit;   /* bytes, set at creation, never written again */
    uint32_t sm_percent;
    uint32_t reserved;
};

/* What the node can see of a device besides its usage: counters only ever grow (atomic adds
 * by the container's processes), `peak` only rises (compare-and-swap). */
struct vgpu_region_device_stats {
    uint64_t refused;        /* allocations (and contexts) refused at the limit */
    uint64_t fallbacks;      /* allocations that fell back to managed memory (CUDA_OVERSUBSCRIBE) */
    uint64_t peak;           /* the highest usage charged, bytes */
    uint64_t gpu_ns;         /* GPU time of the container's measured (paced) launches, ns */
    /* What the driver holds the container to on this GPU, as NVML told a process of it
     * (nvmlDeviceGetMemoryLimits_v1 for its own cgroup, walking up to the first with a
     * limit); written once per container by the first process that attaches, state last.
     * Reported by the tenant: the host may show it, never trust it. */
    uint64_t driver_limit;       /* _FOUND: the hard limit, bytes; _ERROR: the nvmlReturn_t */
    uint64_t driver_limit_state; /* enum vgpu_driver_limit_state */
    /* What a context took on this GPU, as a process of the container last measured it (0:
     * none yet): a process reserves this much before the driver makes a context, so that
     * one that cannot fit is refused without being made. Written by the tenant. */
    uint64_t context_bytes;
    uint64_t reserved[1];
};

enum vgpu_driver_limit_state {
    VGPU_DRIVER_LIMIT_UNCHECKED = 0,   /* no process has looked yet */
    VGPU_DRIVER_LIMIT_FOUND = 1,       /* a hard limit is set for the process's cgroup or above */
    VGPU_DRIVER_LIMIT_NONE = 2,        /* none on its cgroup or any ancestor */
    VGPU_DRIVER_LIMIT_UNSUPPORTED = 3, /* no NVML, or a driver without the call */
    VGPU_DRIVER_LIMIT_NO_CGROUP = 4,   /* the process is in no cgroup v2 (a v1 host) */
    VGPU_DRIVER_LIMIT_ERROR = 5        /* NVML failed otherwise: driver_limit holds its code */
};

struct vgpu_slot_device {
    uint64_t charged;        /* bytes charged to this process (includes pending) */
    uint64_t pending;        /* of which reserved but not yet committed (informational) */
};

struct vgpu_region_slot {
    uint32_t state;          /* VGPU_SLOT_FREE / VGPU_SLOT_LIVE; the OFD lock says if alive */
    int32_t pid;             /* in the container's pid namespace */
    uint64_t start_time;     /* field 22 of /proc/<pid>/stat, clock ticks since boot */
    struct vgpu_slot_device dev[16];
    uint64_t forced;         /* bit d: this process charged memory on device d past the limit
                                (vgpu_region_force); the host then shows the sum as it is */
    int32_t node_pid;        /* the pid the driver's NVML lists this process by (the node's pid
                                namespace), once its shim learned it (ctx.c); 0: not known */
    uint32_t reserved_pid;
    uint64_t reserved[4];
};

struct vgpu_region_file {
    /* line 0: identity, written before the file is published and never again */
    char magic[8];           /* "VGPUREG" and NUL */
    uint32_t version;        /* VGPU_REGION_VERSION */
    uint32_t device_count;   /* 1..VGPU_MAX_DEVICES */
    uint64_t file_size;      /* sizeof(struct vgpu_region_file) */
    uint32_t slot_count;     /* VGPU_MAX_SLOTS */
    uint32_t reserved0;
    uint64_t reserved1[4];
    /* line 1: what only rare updates under the lock word touch */
    uint32_t lock;           /* 0: free; else the holder's slot index + 1 (its slot's OFD lock
                                says whether it lives: a dead holder's lock is taken over) */
    uint32_t slot_hwm;       /* slots at or above this index have never been used */
    uint64_t reserved_line1[7];
    /* lines 2-3: unused since version 3 (the totals and the seqlock of versions 1-2) */
    uint64_t reserved2[24];
    /* from byte 320: counters, before the devices (which the host compares across reads) */
    struct vgpu_region_device_stats stats[16];
    struct vgpu_region_device devices[16];
    struct vgpu_region_slot slots[256];
};

/* --- what the host reads ------------------------------------------------------------------- */

struct vgpu_snapshot_device {
    char uuid[80];
    uint64_t memory_limit;   /* as the region's creator wrote it */
    uint64_t used;           /* bytes charged on the device: the sum of the live processes
                                below (a dead one's unreclaimed charge is listed, not added) */
    uint32_t sm_percent;
    uint32_t reserved;
    uint64_t refused;        /* the device's counters (struct vgpu_region_device_stats) */
    uint64_t fallbacks;
    uint64_t peak;
    uint64_t gpu_ns;
    uint64_t driver_limit;   /* the driver limit a process of the container found (above) */
    uint64_t driver_limit_state;
};

struct vgpu_snapshot_process {
    uint32_t slot;
    int32_t pid;
    uint64_t start_time;
    int32_t alive;           /* 1: its owner holds the slot's lock; 0: dead, not reclaimed yet */
    uint32_t reserved;
    uint64_t used[16];       /* bytes charged per device */
    uint64_t pending[16];    /* of which still between reserve and commit */
};

struct vgpu_region_snapshot {
    uint32_t device_count;
    uint32_t process_count;
    uint32_t attempts;       /* how many double reads the view took (1 on a quiet region) */
    uint32_t reserved;
    struct vgpu_snapshot_device devices[16];
    struct vgpu_snapshot_process processes[256];
};

/* --- the API (exported from libvgpu.so) ----------------------------------------------------
 * Functions taking `err` write a one-line reason naming the file there (errlen bytes,
 * truncated, always NUL-terminated when errlen > 0). */

struct vgpu_region; /* this process's attachment: opaque */

/* Create the region file at `path` with `limits` unless a file is already there. The file
 * is built under a temporary name and linked into place complete, mode 0666, so nobody
 * sees a half-initialised region. Returns 1 created, 0 already present (not validated
 * here), -1 error. */
int vgpu_region_create(const char *path, const struct vgpu_limits *limits, char *err,
                       size_t errlen);

/* Attach to the region at `path` (creating it from `limits` if it is missing and `limits`
 * is not NULL), validate it, and register this process's slot. `limits` are this process's
 * own limits (from the read-only limits file): each device's limit is min(own, region's); a
 * region device the limits do not name keeps the region's limit. Thread-safe; a forked
 * child registers a slot of its own on its first call. Returns VGPU_REGION_OK or
 * VGPU_REGION_EFAIL. */
int vgpu_region_open(const char *path, const struct vgpu_limits *limits,
                     struct vgpu_region **out, char *err, size_t errlen);
/* Return this process's charges and free its slot, then detach. */
void vgpu_region_close(struct vgpu_region *r);

/* The region's device index of GPU `uuid`, or -1. */
int vgpu_region_device_index(const struct vgpu_region *r, const char *uuid);
int vgpu_region_device_count(const struct vgpu_region *r);
/* This process's limit on device `dev`: min(own, region's); 0 for a bad index. */
uint64_t vgpu_region_limit(const struct vgpu_region *r, int dev);

/* Charge `bytes` on `dev` to this process if the container's usage stays within this
 * process's limit, whatever other processes do at the same time (dead processes' charges
 * are reclaimed first when that makes room). Then call the driver, and commit on success or
 * roll back on failure. Returns VGPU_REGION_OK, _DENIED, _EINVAL or _EFAIL. No lock and no
 * syscall unless the limit is reached. */
int vgpu_region_reserve(struct vgpu_region *r, int dev, uint64_t bytes);
void vgpu_region_commit(struct vgpu_region *r, int dev, uint64_t bytes);
void vgpu_region_rollback(struct vgpu_region *r, int dev, uint64_t bytes);
/* Return `bytes` of committed charge on `dev` (a free). More than this process holds is
 * clamped to what it holds, with one warning per process: counters never wrap. */
void vgpu_region_release(struct vgpu_region *r, int dev, uint64_t bytes);

/* Bytes charged on `dev` by the whole container / by this process. */
uint64_t vgpu_region_usage(const struct vgpu_region *r, int dev);
uint64_t vgpu_region_own_usage(const struct vgpu_region *r, int dev);

/* Reclaim the slots of dead processes now. Returns how many, or -1. */
int vgpu_region_reap(struct vgpu_region *r);

/* Host side: validate the file at `path` and copy a view of it into `out` (see the rules
 * above) without taking the region's lock (the tenants never wait on the reader) and without
 * mapping it (a file its tenant shrinks, replaces or rewrites meanwhile is an error, never a
 * signal). Returns VGPU_REGION_OK, VGPU_REGION_EFAIL (missing, refused, changed while being
 * read: the reason is in err) or VGPU_REGION_EBUSY (two reads never agreed in time). */
int vgpu_region_snapshot(const char *path, struct vgpu_region_snapshot *out, char *err,
                         size_t errlen);

#endif
