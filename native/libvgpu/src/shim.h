/* Internals of the enforcement shim shared by its source files (everything but region*.c).
 *
 * One process-wide state struct (`vgpu`, defined in load.c) holds what the shim learns about
 * the process: the real driver entry points, the limits, the per-device state. It is one
 * struct rather than scattered globals so that what the shim keeps is visible in one place.
 *
 * The driver header is included as a driver implementation includes it
 * (__CUDA_API_VERSION_INTERNAL): every versioned, legacy and _ptsz/_ptds entry point is then
 * declared under its own name, and each hook below is *defined* with that name, so a hook
 * whose signature differs from NVIDIA's prototype does not compile. */
#ifndef VGPU_SHIM_H
#define VGPU_SHIM_H

#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>
/* The versioned NVML entry points under their own names (nvml.h would rename the legacy ones). */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "region_private.h"
#include "vgpu/region.h"

#define VGPU_API __attribute__((visibility("default")))
#define VGPU_HIDDEN __attribute__((visibility("hidden")))
/* Thread-locals in the static TLS block: a plain %fs-relative access on the hot path instead
 * of a __tls_get_addr call (the shim's few bytes fit the loader's surplus when dlopen'ed). */
#define VGPU_TLS __attribute__((tls_model("initial-exec")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* --- the entry points -----------------------------------------------------------------------
 * H: hooked (exported by the shim, real one called through vgpu.real), R: only called. */
#define VGPU_CUDA_HOOKS(H)                                                                     \
    H(cuGetProcAddress) H(cuGetProcAddress_v2) H(cuMemAlloc) H(cuMemAlloc_v2)                  \
    H(cuMemAllocPitch) H(cuMemAllocPitch_v2) H(cuMemAllocManaged) H(cuMemAllocAsync)           \
    H(cuMemAllocAsync_ptsz) H(cuMemAllocFromPoolAsync) H(cuMemAllocFromPoolAsync_ptsz)         \
    H(cuMemFree) H(cuMemFree_v2) H(cuMemFreeAsync) H(cuMemFreeAsync_ptsz) H(cuMemCreate)       \
    H(cuMemRelease) H(cuMemRetainAllocationHandle) H(cuMemPoolCreate) H(cuMemPoolDestroy)      \
    H(cuArrayCreate) H(cuArrayCreate_v2) H(cuArray3DCreate) H(cuArray3DCreate_v2)              \
    H(cuArrayDestroy) H(cuMipmappedArrayCreate) H(cuMipmappedArrayDestroy) H(cuCtxCreate)      \
    H(cuCtxCreate_v2) H(cuCtxCreate_v3) H(cuCtxCreate_v4) H(cuCtxDestroy) H(cuCtxDestroy_v2)   \
    H(cuDevicePrimaryCtxRetain) H(cuDevicePrimaryCtxRelease) H(cuDevicePrimaryCtxRelease_v2)   \
    H(cuDevicePrimaryCtxReset) H(cuDevicePrimaryCtxReset_v2) H(cuCtxSetCurrent)                \
    H(cuCtxSetLimit) H(cuCtxSynchronize) H(cuStreamSynchronize) H(cuStreamSynchronize_ptsz)    \
    H(cuMemGetInfo) H(cuMemGetInfo_v2) H(cuDeviceTotalMem) H(cuDeviceTotalMem_v2)              \
    H(cuLaunchKernel) H(cuLaunchKernel_ptsz) H(cuLaunchKernelEx) H(cuLaunchKernelEx_ptsz)      \
    H(cuLaunchCooperativeKernel) H(cuLaunchCooperativeKernel_ptsz) H(cuGraphLaunch)            \
    H(cuGraphLaunch_ptsz) H(cuGraphAddMemAllocNode) H(cuGraphInstantiate)                      \
    H(cuGraphInstantiate_v2) H(cuGraphInstantiateWithFlags) H(cuGraphInstantiateWithParams)    \
    H(cuGraphInstantiateWithParams_ptsz) H(cuGraphUpload) H(cuGraphUpload_ptsz)                \
    H(cuGraphExecDestroy) H(cuGetExportTable) H(cuModuleLoad) H(cuModuleLoadData)              \
    H(cuModuleLoadDataEx) H(cuModuleLoadFatBinary) H(cuModuleGetFunction) H(cuLibraryLoadData)  \
    H(cuLibraryLoadFromFile) H(cuLibraryGetModule) H(cuKernelGetFunction) H(cuLibraryGetGlobal)  \
    H(cuModuleUnload) H(cuLibraryUnload)

#define VGPU_CUDA_USED(R)                                                                      \
    R(cuStreamGetCtx) R(cuStreamGetCtx_ptsz) R(cuCtxGetDevice) R(cuCtxGetCurrent)              \
    R(cuDeviceGetUuid) R(cuDeviceGetCount) R(cuDeviceGet) R(cuDevicePrimaryCtxGetState)        \
    R(cuEventCreate) R(cuEventDestroy_v2) R(cuEventRecord) R(cuEventRecord_ptsz)               \
    R(cuEventQuery) R(cuEventSynchronize) R(cuEventElapsedTime) R(cuStreamIsCapturing)         \
    R(cuStreamIsCapturing_ptsz) R(cuCtxPushCurrent_v2) R(cuCtxPopCurrent_v2)                   \
    R(cuMemPoolGetAttribute) R(cuMemPoolTrimTo) R(cuDeviceGetMemPool) R(cuCtxGetLimit)         \
    R(cuDeviceGetGraphMemAttribute) R(cuDeviceGraphMemTrim)

#define VGPU_NVML_HOOKS(H)                                                                     \
    H(nvmlDeviceGetMemoryInfo) H(nvmlDeviceGetMemoryInfo_v2)                                   \
    H(nvmlDeviceGetComputeRunningProcesses) H(nvmlDeviceGetComputeRunningProcesses_v2)         \
    H(nvmlDeviceGetComputeRunningProcesses_v3)

#define VGPU_NVML_USED(R) R(nvmlInit_v2) R(nvmlDeviceGetHandleByUUID) R(nvmlDeviceGetUUID)       \
    R(nvmlDeviceGetProcessUtilization)

#define VGPU_PTR_FIELD(n) __typeof__(n) *n;
struct vgpu_real {
    VGPU_CUDA_HOOKS(VGPU_PTR_FIELD)
    VGPU_CUDA_USED(VGPU_PTR_FIELD)
    VGPU_NVML_HOOKS(VGPU_PTR_FIELD)
    VGPU_NVML_USED(VGPU_PTR_FIELD)
};

/* One hooked name: what dlsym and cuGetProcAddress hand out instead of the real function. */
struct vgpu_hook {
    const char *name;
    void *hook;
    void **real; /* the slot in vgpu.real */
    int nvml;
};

/* --- limits (limits.c) ----------------------------------------------------------------- */

enum { VGPU_MODE_NONE = 0, VGPU_MODE_FILE = 1, VGPU_MODE_ENV = 2 };
enum { VGPU_MAX_ORDINALS = 64 };

struct vgpu_limit {
    char uuid[VGPU_UUID_SIZE]; /* empty: applies by CUDA ordinal (env without UUIDs) */
    uint64_t mem;              /* bytes; UINT64_MAX: no memory limit */
    int sm;                    /* 0..100, 0 = not limited */
    int req;                   /* 0..100 guaranteed (sharing.compute: guaranteed), 0 = none */
    int bad;                   /* a value was rejected: this device fails closed */
};

struct vgpu_config {
    int mode;
    int all_bad;                       /* the limits file is unusable: every device fails closed */
    int count;
    struct vgpu_limit dev[VGPU_MAX_DEVICES]; /* file: by UUID; env: visible index i */
    int by_uuid;                       /* env: NVIDIA_VISIBLE_DEVICES named UUIDs */
    struct vgpu_limit dflt;            /* env: CUDA_DEVICE_*_LIMIT without index */
    int oversubscribe;
    char allocation[128];
    char region_path[4096];
    char pace_path[4096];
    char lock_dir[4096];
    char peers_dir[4096];              /* the GPU's other containers' pacing files, read-only */
};

/* Parse the limits file or the envs into `c` (messages on stderr). */
VGPU_HIDDEN void vgpu_config_load(struct vgpu_config *c);
/* The limits of the device with this UUID and CUDA ordinal. */
VGPU_HIDDEN struct vgpu_limit vgpu_config_lookup(const struct vgpu_config *c, const char *uuid,
                                                 int ordinal);
/* "12g" -> bytes. 0 on success, -1 on anything but an integer with an optional k|m|g. */
VGPU_HIDDEN int vgpu_parse_size(const char *s, uint64_t *out);

/* --- per-device state (devices.c) ---------------------------------------------------------- */

struct vgpu_pace_dev; /* pace.c */

#define VGPU_PEER_UNTIL 8 /* busy peers whose queued work a kernel's charge allows for */

struct vgpu_dev {
    int ready;                /* resolved (acquire/release) */
    int ordinal;
    int rdev;                 /* region device index; -1: not accounted */
    int accounted;            /* allocations go through the region */
    int fail_closed;          /* allocations are refused */
    uint64_t limit;           /* bytes; UINT64_MAX when none */
    int sm;                   /* 1..99: launches are paced to this cap */
    int req;                  /* 1..100: guaranteed share; launches are paced to the rate
                               * pace.c works out from the GPU's busy peers (cap: sm, or 100) */
    int rate;                 /* guaranteed: the rate last worked out, and when (relaxed) */
    uint64_t rate_ns;
    struct vgpu_pace_dev *pace;
    struct vgpu_pace_dev *own; /* guaranteed: this process's private bucket at the same rate,
                                * which nothing the tenant writes can fill (pace.c) */
    struct vgpu_region *region; /* the attachment its usage is read from (when accounted) */
    char uuid[VGPU_UUID_SIZE];
    /* guaranteed: until when each busy peer's queued work runs, as last read (pace.c) */
    int npeer_until;
    uint64_t peer_until[VGPU_PEER_UNTIL];
    /* guaranteed: the GPU time charged (settled) since the driver's measure of this process
     * was last read (atomic); when it was last tried and read (pace.c, calibrate; g_peers.mu) */
    int64_t cal_charged;
    uint64_t cal_read_ns;
    unsigned long long cal_seen_us;
    unsigned long long cal_next_us; /* when the driver's next period is due to end */
    int cal_busy_before;      /* the settles started again with the process busy before */
    /* guaranteed: per mille, what the charges of kernels stretched by busy peers are scaled
     * by, learnt from the driver's measure at each settle (0: not learnt, 1000) */
    int cal_scale;
};

/* --- the process ----------------------------------------------------------------------------- */

struct vgpu_state {
    int ready;                /* libcuda loaded, limits read (acquire/release) */
    int limits_ready;         /* limits read: all the NVML hooks need (acquire/release) */
    int log_level;            /* 0 error .. 3 debug */
    int limited;              /* any limit applies: hooks do real work */
    int mem_hot;              /* limited, loaded, and the driver has cuMemAlloc_v2, cuMemFree_v2
                               * and cuCtxGetCurrent: their hooks test this word alone
                               * (acquire/release; set once with the load) */
    int pace_any;             /* some device is paced */
    int graph_mem;            /* the process has made graph allocations: launches settle them */
    int mem_hot_on;           /* what mem_hot is when no code settle is due (set with the load) */
    int code_watch;           /* the next launch is watched (it takes the slow path): ctx.c */
    int code_due;             /* a launch since the last code settle: allocations and views
                               * settle what the driver loaded for launches (ctx.c) */
    void *cuda;               /* dlopen handles of the real libraries */
    void *nvml;
    int nvml_state;           /* 0 not tried, 1 usable, -1 unavailable */
    struct vgpu_real real;
    struct vgpu_config cfg;
    struct vgpu_region *region;
    int region_state;         /* 0 not tried, 1 open, -1 failed */
    struct vgpu_region *view_region; /* envs by index, NVML only: for views (devices.c) */
    int view_state;           /* 0 no region yet, 1 attached, -1 failed */
    pthread_mutex_t mu;       /* device resolution, region and NVML loading */
    struct vgpu_dev dev[VGPU_MAX_ORDINALS];      /* by CUDA ordinal */
    struct vgpu_dev by_uuid[VGPU_MAX_DEVICES];   /* GPUs known only through NVML */
};

extern struct vgpu_state vgpu VGPU_HIDDEN;

/* load.c: the first CUDA call into the shim reads the limits and loads libcuda; the first
 * NVML call reads the limits only (an NVML-only process never maps libcuda). */
VGPU_HIDDEN void vgpu_load_slow(void);
static inline void vgpu_ensure(void) {
    if (UNLIKELY(!__atomic_load_n(&vgpu.ready, __ATOMIC_ACQUIRE))) vgpu_load_slow();
}
VGPU_HIDDEN void vgpu_limits_slow(void);
static inline void vgpu_ensure_limits(void) {
    if (UNLIKELY(!__atomic_load_n(&vgpu.limits_ready, __ATOMIC_ACQUIRE))) vgpu_limits_slow();
}
/* 1 when this process has initialised CUDA itself; then the shim's CUDA entry points are
 * loaded too. Never loads libcuda into a process that has not (cuInit can only be there). */
VGPU_HIDDEN int vgpu_cuda_initialised(void);
/* 1 while this thread is inside the load (lookups made then are passed through). */
VGPU_HIDDEN int vgpu_loading_here(void);
/* NVML's real entry points, loaded on demand (the NVML hooks). */
VGPU_HIDDEN void vgpu_nvml_load(void);
/* NVML initialised for the shim's own queries (views, context measurement). 1 usable. */
VGPU_HIDDEN int vgpu_nvml_ready(void);
/* The same with vgpu.mu held (it may dlopen libnvidia-ml under the lock, the first time). */
VGPU_HIDDEN int vgpu_nvml_ready_locked(void);
VGPU_HIDDEN const struct vgpu_hook *vgpu_hook_by_name(const char *name);
VGPU_HIDDEN void *vgpu_hook_for_real(void *real);
/* driver_limit.c: once per container, record in the region whether the driver holds this
 * process's cgroup to a memory limit on each of the region's GPUs. vgpu.mu held. */
VGPU_HIDDEN void vgpu_driver_limit_check(struct vgpu_region *r);
/* The real dlsym (dlsym.c), resolved on first use. */
VGPU_HIDDEN void *vgpu_real_dlsym(void *handle, const char *name);
/* The process's environ, looked up when asked: a reference to it would be a symbol lookup at
 * load in every process. */
VGPU_HIDDEN char **vgpu_environ(void);

/* log.c (log.h): the hooks test the level cached in vgpu.log_level, set with the limits. */
#define VLOG(level, ...)                                                                       \
    do {                                                                                       \
        if (UNLIKELY((level) <= vgpu.log_level)) vgpu_log((level), __VA_ARGS__);               \
    } while (0)

#define VGPU_NEED(fn)                                                                          \
    do {                                                                                       \
        vgpu_ensure();                                                                         \
        if (UNLIKELY(!vgpu.real.fn)) return CUDA_ERROR_NOT_INITIALIZED;                        \
    } while (0)

/* No device for the call: without a context (ctx NULL) the driver answers, and refuses too;
 * a context whose device the shim cannot resolve is refused while limits are in force. */
#define UNRESOLVED(ctx, call) ((ctx) ? CUDA_ERROR_OUT_OF_MEMORY : (call))

/* devices.c */
/* The state of CUDA device `ordinal`, resolved on first use; NULL when it cannot be. */
VGPU_HIDDEN struct vgpu_dev *vgpu_dev_resolve(int ordinal);
static inline struct vgpu_dev *vgpu_dev(int ordinal) {
    if (UNLIKELY((unsigned)ordinal >= VGPU_MAX_ORDINALS)) return NULL;
    struct vgpu_dev *d = &vgpu.dev[ordinal];
    return LIKELY(__atomic_load_n(&d->ready, __ATOMIC_ACQUIRE)) ? d : vgpu_dev_resolve(ordinal);
}
/* The device of the calling thread's current context, or NULL. */
VGPU_HIDDEN struct vgpu_dev *vgpu_current_dev(void);
VGPU_HIDDEN void vgpu_format_uuid(const CUuuid *u, char out[VGPU_UUID_SIZE]);
/* Charge `bytes` to d before an allocation: CUDA_SUCCESS (charged, or nothing to charge) or
 * CUDA_ERROR_OUT_OF_MEMORY. */
/* Inline: they are most of what an allocation and its free add. */
VGPU_HIDDEN CUresult vgpu_charge_denied(struct vgpu_dev *d, uint64_t bytes, int rc);
static inline CUresult vgpu_charge(struct vgpu_dev *d, uint64_t bytes) {
    /* accounted implies not fail_closed: one test on the common path */
    if (UNLIKELY(!d->accounted)) return d->fail_closed ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    int rc = vgpu_region_reserve_dev(vgpu.region, d->rdev, bytes);
    return LIKELY(rc == VGPU_REGION_OK) ? CUDA_SUCCESS : vgpu_charge_denied(d, bytes, rc);
}
static inline void vgpu_commit(struct vgpu_dev *d, uint64_t bytes) {
    if (d->accounted) vgpu_region_commit_dev(vgpu.region, d->rdev, bytes);
}
static inline void vgpu_rollback(struct vgpu_dev *d, uint64_t bytes) {
    if (d->accounted) vgpu_region_rollback(vgpu.region, d->rdev, bytes);
}
static inline void vgpu_uncharge(struct vgpu_dev *d, uint64_t bytes) {
    if (d->accounted && bytes) vgpu_region_release_dev(vgpu.region, d->rdev, bytes);
}
VGPU_HIDDEN uint64_t vgpu_used(struct vgpu_dev *d);
/* GPU time measured on d (launch.c). */
VGPU_HIDDEN void vgpu_note_gpu_time(struct vgpu_dev *d, uint64_t ns);
/* An allocation on d fell back to managed memory (counted in the region). */
VGPU_HIDDEN void vgpu_note_fallback(struct vgpu_dev *d);
/* Every GPU of the container with its limits, as the shared files record them. */
VGPU_HIDDEN void vgpu_container_limits(struct vgpu_limits *lim);
/* The region's device for a GPU UUID (NVML views); NULL if the GPU is not limited. */
VGPU_HIDDEN struct vgpu_dev *vgpu_dev_by_uuid(const char *uuid);

/* ptrtab.c: what each live allocation charged, so its free gives back exactly that. */
enum {
    VGPU_OBJ_PTR = 1, VGPU_OBJ_VMM = 2, VGPU_OBJ_ARRAY = 3, VGPU_OBJ_POOL = 5, /* 4 was a context's own charge: ctx.c lists those */
    VGPU_OBJ_MIPMAP = 6, /* its own kind: a level's CUarray may share a mipmapped array's address */
    VGPU_OBJ_POOLPTR = 7, /* stream-ordered memory of a pool: the pool carries the charge */
    VGPU_OBJ_GRAPH = 8,   /* a graph's allocation nodes (bytes), not charged by themselves */
    VGPU_OBJ_EXEC = 9,    /* an executable graph's allocation nodes; refs 1 once launched */
};
struct vgpu_rec {
    uint64_t key;
    uint64_t bytes;
    CUcontext ctx;  /* owner: its destruction frees the allocation */
    int16_t ordinal;
    uint8_t kind;
    uint8_t used;
    uint32_t refs;  /* VMM handles: retains; POOLPTR: the pool's index in pool.c + 1 */
};
VGPU_HIDDEN int vgpu_tab_put_rec(const struct vgpu_rec *rec);
VGPU_HIDDEN int vgpu_tab_put(int kind, uint64_t key, int ordinal, uint64_t bytes, CUcontext ctx);
/* Put back a record taken out (the driver refused the free). */
static inline void vgpu_tab_restore(const struct vgpu_rec *r) { vgpu_tab_put_rec(r); }
VGPU_HIDDEN int vgpu_tab_take(int kind, uint64_t key, struct vgpu_rec *out);
/* A copy of the record, left in place; 1 if found. */
VGPU_HIDDEN int vgpu_tab_get(int kind, uint64_t key, struct vgpu_rec *out);
/* Add `delta` to a record's refs; returns the new count, or -1 if absent. Takes the record
 * out (into *out) when the count reaches 0. */
VGPU_HIDDEN int vgpu_tab_unref(int kind, uint64_t key, int delta, struct vgpu_rec *out);
/* Remove every record owned by ctx, releasing its charge. */
VGPU_HIDDEN void vgpu_tab_drop_ctx(CUcontext ctx);

/* mem.c: with CUDA_OVERSUBSCRIBE, an allocation the GPU cannot hold as managed memory
 * (v1: only below 4 GiB). CUDA_ERROR_OUT_OF_MEMORY when not oversubscribed or impossible. */
VGPU_HIDDEN CUresult vgpu_managed_fallback(struct vgpu_dev *d, int v1, CUdeviceptr *dptr, size_t bytes);

/* pool.c: pools charge their reservation, not their allocations. */
/* Trim this process's pools on d to nothing and give back what they released: the last
 * resort before refusing an allocation. Returns the bytes released. */
VGPU_HIDDEN uint64_t vgpu_pools_trim(struct vgpu_dev *d);
/* Give back what this process's pools on d have released since their last call (views). */
VGPU_HIDDEN void vgpu_pools_reconcile(struct vgpu_dev *d);
/* The same on every device, where a pool may hold a cache (after a synchronisation). */
VGPU_HIDDEN void vgpu_pools_settle(void);
/* A pool allocation's record, taken out by a successful free. */
VGPU_HIDDEN void vgpu_pool_freed(const struct vgpu_rec *r);

/* graph.c: graph memory, charged like a pool's reservation. */
VGPU_HIDDEN CUresult vgpu_graph_launch(CUgraphExec x, CUstream s, int ptsz,
                                       CUresult (*launch)(CUgraphExec, CUstream));
VGPU_HIDDEN void vgpu_graphs_settle(void);

/* ctx.c: contexts, their devices and the memory they take. */
/* This process's pid in NVML's lists: the node pid a probe learned, else getpid(). */
VGPU_HIDDEN unsigned int vgpu_nvml_pid(void);
/* The device of context ctx (NULL: the current one); *ctx_out gets the context. */
VGPU_HIDDEN struct vgpu_dev *vgpu_ctx_dev_slow(CUcontext ctx, int is_current, CUcontext *ctx_out);
/* A thread's last answer, valid while vgpu_ctx_gen (bumped when a context goes) is unchanged.
 * The current context itself is asked of the driver at every call: the runtime switches
 * contexts through its private table, unseen. */
struct vgpu_ctx_last {
    CUcontext ctx;
    struct vgpu_dev *dev; /* resolved (ready) */
    uint64_t gen;
};
extern VGPU_HIDDEN _Thread_local struct vgpu_ctx_last vgpu_ctx_last VGPU_TLS;
extern VGPU_HIDDEN uint64_t vgpu_ctx_gen;
/* Inline: every allocation asks, and the answer is nearly always the thread's last one.
 * The current context's device, with the driver's cuCtxGetCurrent known to be loaded. */
static inline struct vgpu_dev *vgpu_ctx_dev_current(CUcontext *ctx_out) {
    CUcontext ctx = NULL;
    if (vgpu.real.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) {
        *ctx_out = NULL;
        return NULL;
    }
    *ctx_out = ctx;
    if (LIKELY(vgpu_ctx_last.ctx == ctx &&
               vgpu_ctx_last.gen == __atomic_load_n(&vgpu_ctx_gen, __ATOMIC_ACQUIRE)))
        return vgpu_ctx_last.dev;
    return vgpu_ctx_dev_slow(ctx, 1, ctx_out);
}
static inline struct vgpu_dev *vgpu_ctx_dev(CUcontext ctx, CUcontext *ctx_out) {
    if (ctx == NULL && LIKELY(vgpu.real.cuCtxGetCurrent != NULL)) return vgpu_ctx_dev_current(ctx_out);
    return vgpu_ctx_dev_slow(ctx, ctx == NULL, ctx_out);
}
/* A primary context got by `get` (the driver's retain, retain 1; the runtime table's slot,
 * retain 0: rtable.c), charged before the driver makes it (refused over the limit). */
VGPU_HIDDEN CUresult vgpu_primary_get(CUcontext *pctx, CUdevice dev,
                                      CUresult (*get)(CUcontext *, CUdevice), int retain);
/* The device of a stream (NULL and the special handles: the current context's). */
VGPU_HIDDEN struct vgpu_dev *vgpu_stream_dev(CUstream s, int ptsz, CUcontext *ctx_out);

/* pace.c / launch.c */
/* The shared budget of GPU `uuid` (vgpu.mu held); may lower *percent to the file's; publishes
 * the guarantee `req` (0: none) for the GPU's other containers to read. */
VGPU_HIDDEN struct vgpu_pace_dev *vgpu_pace_attach(const char *uuid, int *percent, int req);
/* A bucket of this process's own (NULL out of memory). */
VGPU_HIDDEN struct vgpu_pace_dev *vgpu_pace_private(void);
/* Wait while d's budget is in debt (its rate: d->sm, or with a guarantee the rate worked out
 * from the GPU's busy peers; `queued_ns`: the GPU work the process has queued there). */
VGPU_HIDDEN void vgpu_pace_wait(struct vgpu_dev *d, uint64_t queued_ns);
/* Credit (ns > 0) or charge (ns < 0) d's budget. */
VGPU_HIDDEN void vgpu_pace_add(struct vgpu_dev *d, int64_t ns);
/* A stretched kernel's charge `ns` scaled as d's settles against the driver found (pace.c). */
VGPU_HIDDEN int64_t vgpu_pace_scaled(const struct vgpu_dev *d, int64_t ns);
/* Settle the launches whose timing events have completed (launch.c). */
VGPU_HIDDEN void vgpu_launch_settle(void);
/* The GPU time a kernel measured at `ns` stands for when contexts are time-sliced (pace.c). */
VGPU_HIDDEN int64_t vgpu_pace_gpu_time(struct vgpu_dev *d, int64_t ns, int64_t solo);
/* The driver's entry points are loaded: unpaced kernel launches go straight to them. */
VGPU_HIDDEN void vgpu_launch_loaded(void);
/* Launches straight to the driver again (1), or through their slow path (0) to be watched. */
VGPU_HIDDEN void vgpu_launch_fast_set(int on);
/* Drop this process's pending timings in ctx (destroying their events if it still exists). */
VGPU_HIDDEN void vgpu_launch_forget_ctx(CUcontext ctx, int destroy_events);

/* ctx.c: memory the driver takes at a launch (a kernel's code, loaded lazily at its first
 * launch; a library's module first used by a launch) is settled later, off the launch path:
 * the first launch after a settle is watched (vgpu_code_seen), and the next allocation, sync or
 * memory view at least VGPU_CODE_SETTLE_NS after the last settle charges what this process's
 * driver-side usage holds beyond its charge (vgpu_code_settle). */
#define VGPU_CODE_SETTLE_NS 100000000ull
VGPU_HIDDEN void vgpu_code_watch(void);
VGPU_HIDDEN void vgpu_code_seen(void);
VGPU_HIDDEN void vgpu_code_settle(void);
/* A settle is due at the next allocation, view or sync: after a watched launch, or (at_once: not
 * waiting for VGPU_CODE_SETTLE_NS) when the driver let memory go (a module unloaded). */
VGPU_HIDDEN void vgpu_code_due(int at_once);
/* Releases in flight: frees and context ends that the driver may have made and the shim not
 * yet given back, counted begun and ended (process-wide, a cache line of their own). A settle
 * that a release overlapped does not compare the driver's usage with the charge: the driver
 * would read as holding less than is charged, as after an unload. */
struct vgpu_releases {
    uint64_t begun, ended;
} __attribute__((aligned(64)));
VGPU_HIDDEN extern struct vgpu_releases vgpu_releases;
static inline __attribute__((always_inline)) void vgpu_release_begin(void) {
    __atomic_add_fetch(&vgpu_releases.begun, 1, __ATOMIC_SEQ_CST);
}
static inline __attribute__((always_inline)) void vgpu_release_end(void) {
    __atomic_add_fetch(&vgpu_releases.ended, 1, __ATOMIC_SEQ_CST);
}
#define VGPU_CODE_SETTLE()                                                                     \
    do {                                                                                       \
        if (UNLIKELY(__atomic_load_n(&vgpu.code_due, __ATOMIC_RELAXED))) vgpu_code_settle();   \
    } while (0)

/* ctx.c: a call that grows the current context's memory (cuCtxSetLimit, module loads),
 * measured across. begin: the current context's device (*ctx set), NULL when nothing is
 * measured (no begin/end pair then); end: charges the growth if rc succeeded, -1 when the
 * limit refuses it (the caller undoes the call). */
VGPU_HIDDEN struct vgpu_dev *vgpu_growth_begin(CUcontext *ctx);
VGPU_HIDDEN int vgpu_growth_end(struct vgpu_dev *d, CUcontext ctx, CUresult rc, const char *what);

#endif
