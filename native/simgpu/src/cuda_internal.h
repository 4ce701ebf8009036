/* Private to the simulated libcuda.so.1: the process-wide driver state the cuda_*.c files share.
 *
 * Rules every file follows:
 * - One process mutex (sim_lock) guards every table and every stream's bookkeeping. It is taken
 *   before the node lock of state.c, never after.
 * - An exported entry point never calls another exported entry point: a preloaded interposer
 *   (our own shim) defines the same names, and an internal call through the PLT would land in
 *   it and be counted twice. Shared work lives in hidden sim_* functions.
 */
#ifndef SIMGPU_CUDA_INTERNAL_H
#define SIMGPU_CUDA_INTERNAL_H

/* The driver defines every versioned entry point, so it needs every declaration: legacy (v1)
 * and per-thread (_ptds/_ptsz) ones appear only with this set. */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "state.h"

#define SIM_HIDDEN __attribute__((visibility("hidden")))

/* A hidden alias of an entry point, for the cuGetProcAddress table: taking the address of the
 * exported name would bind to an interposer's definition, and the real driver hands out its
 * own functions. Placed after the definition, in the same file. */
#define SIM_SELF(f) extern __typeof__(f) sim_self_##f __attribute__((alias(#f), visibility("hidden")));

#define SIM_GRANULARITY (2ull << 20)        /* VMM granularity, as on current datacenter GPUs */
#define SIM_PITCH_ALIGN 512u                /* cuMemAllocPitch rounds rows up to this */
#define SIM_DEFAULT_KERNEL_NS 5000ull       /* a kernel the simulator knows nothing about */
#define SIM_QUEUE_MAX_LAUNCHES 1024u        /* a launch blocks beyond this many pending ... */
#define SIM_QUEUE_MAX_NS 1000000000ull      /* ... or when its stream is this far ahead */
#define SIM_BUILTIN_SLEEP "simgpu_sleep"    /* built-in kernel: first parameter = ns to run */

enum {
    SIM_CTX_MAGIC = 0x53435458,
    SIM_STREAM_MAGIC = 0x53535452,
    SIM_EVENT_MAGIC = 0x53455654,
    SIM_MOD_MAGIC = 0x534d4f44,
    SIM_FUNC_MAGIC = 0x5346554e,
    SIM_GRAPH_MAGIC = 0x53475248,
    SIM_NODE_MAGIC = 0x534e4f44,
    SIM_EXEC_MAGIC = 0x53455845,
    SIM_POOL_MAGIC = 0x53504f4c,
    SIM_ARRAY_MAGIC = 0x53415252,
    SIM_MIPMAP_MAGIC = 0x534d4950,
};

/* --- streams and contexts ----------------------------------------------------------------- */

enum sim_stream_kind { SIM_STREAM_USER, SIM_STREAM_LEGACY, SIM_STREAM_PER_THREAD };

struct CUstream_st {
    uint32_t magic;
    enum sim_stream_kind kind;
    struct CUctx_st *ctx;
    unsigned int flags;
    int priority;
    unsigned long long id;
    uint64_t end_ns;          /* when the last work queued on this stream completes */
    uint64_t *ring;           /* completion times of queued kernels, oldest first */
    unsigned int ring_head, ring_len;
    struct CUgraph_st *capture; /* set while the stream is being captured */
    int capture_invalid;
    struct CUstream_st *next; /* the context's user streams */
};

struct CUctx_st {
    uint32_t magic;
    int dev;           /* CUDA ordinal */
    uint32_t phys;     /* node GPU index */
    int primary;
    int active;        /* holds its overhead on the node; a released primary context is inactive */
    unsigned int refs; /* primary context: retain count */
    unsigned int flags;
    unsigned long long id;
    uint64_t owner;            /* its name on the node's GPU timelines */
    struct CUstream_st legacy; /* the legacy default stream (NULL / CU_STREAM_LEGACY) */
    uint64_t blocking_end;     /* latest completion queued on any blocking stream */
    uint64_t all_end;          /* latest completion queued on any stream */
    struct CUstream_st *streams;
    struct sim_cls *cls;       /* the runtime's context-local storage (cuda_cls.c) */
    struct CUctx_st *next;     /* every context of the process (handles are never freed) */
    uint64_t grown;            /* memory its heap and printf FIFO take beyond the defaults */
};

/* Handles the caller may never destroy stay linked in a process list, so leak checkers (our
 * sanitizer builds) see them reachable, as a real driver's handles are until exit. */
struct sim_link {
    struct sim_link *prev, *next;
};

struct CUevent_st {
    struct sim_link link; /* first: the list holds these */
    uint32_t magic;
    unsigned int flags;
    int recorded;
    uint64_t t_ns; /* when the recorded point of its stream completes */
};

/* --- memory ------------------------------------------------------------------------------- */

enum sim_mem_kind {
    SIM_MEM_DEVICE,
    SIM_MEM_PITCH,
    SIM_MEM_MANAGED,
    SIM_MEM_HOST,
    SIM_MEM_ASYNC,
    SIM_MEM_VMM, /* a cuMemMap'ed piece of a reserved range */
    SIM_MEM_MODULE, /* a module's variables in one context; charged its whole image, freed with it */
};

struct sim_phys; /* a VMM physical allocation (cuda_vmm.c) */

/* One entry of the process's address table: what a CUdeviceptr points into. */
struct sim_alloc {
    uintptr_t base;
    size_t size;
    size_t map_len; /* bytes mapped for it (page-rounded) */
    uint64_t charged; /* bytes charged on the node for it: a free uncharges exactly this */
    uint32_t phys;
    enum sim_mem_kind kind;
    struct CUctx_st *ctx;              /* owner; NULL for pool and VMM memory */
    struct CUmemPoolHandle_st *pool;   /* SIM_MEM_ASYNC */
    struct sim_phys *vmm;              /* SIM_MEM_VMM */
    int prot;                          /* SIM_MEM_VMM: PROT_* set by cuMemSetAccess */
};

struct CUmemPoolHandle_st {
    uint32_t magic;
    uint32_t phys;
    int dev;
    int is_default;
    int destroyed;
    uint64_t threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
    uint64_t reserved;  /* bytes charged on the node for the pool */
    uint64_t used;      /* bytes in live allocations; reserved - used is cached */
    uint64_t reserved_high, used_high;
    int reuse[3];       /* CU_MEMPOOL_ATTR_REUSE_*: stored, not modelled */
    struct CUmemPoolHandle_st *next;
};

/* --- modules and functions --------------------------------------------------------------- */

struct CUfunc_st {
    uint32_t magic;
    int kidx;           /* its index among its image's kernels (cuda_image.h), -1 if none */
    int builtin_sleep;  /* simgpu_sleep: duration from the first parameter */
    uint64_t cost_ns;   /* duration of one launch otherwise */
    struct CUmod_st *mod;
    char name[128];
};

/* A module or library loaded in one context: its variables' memory there. */
struct sim_modinst {
    struct CUctx_st *ctx;
    struct sim_alloc *mem; /* SIM_MEM_MODULE: the globals area; charged what the image takes here */
    uint8_t *loaded;       /* lazy loading: which kernels' code is loaded (charged) here */
    struct sim_modinst *next;
};

struct sim_image;

struct CUmod_st {
    uint32_t magic;
    struct CUctx_st *ctx; /* NULL: a library (context-independent) */
    int opaque;           /* an image simgpu cannot read: any name resolves, at the default cost */
    struct sim_image *img; /* a cubin read (cuda_image.c): its kernels and variables only */
    struct sim_modinst *inst; /* a module: one, made at load; a library: one per context using it */
    size_t nfunc, cap;
    struct CUfunc_st **funcs;
    struct CUmod_st *next;
};

/* --- the process ------------------------------------------------------------------------- */

struct sim_process {
    pthread_mutex_t mu;
    int ndev;
    uint32_t phys[SIMGPU_MAX_GPUS]; /* CUDA ordinal -> node GPU */
    struct CUctx_st *primary[SIMGPU_MAX_GPUS];
    struct CUctx_st *contexts;
    struct CUmemPoolHandle_st *pools;
    struct CUmemPoolHandle_st *cur_pool[SIMGPU_MAX_GPUS];
    struct CUmod_st *modules;
};

extern struct sim_process sim_proc SIM_HIDDEN;

SIM_HIDDEN void sim_lock(void);
/* Keep / drop a handle in the process's list of live handles (sim_lock held). */
SIM_HIDDEN void sim_link_add_locked(struct sim_link *l);
SIM_HIDDEN void sim_link_del_locked(struct sim_link *l);
SIM_HIDDEN void sim_unlock(void);
SIM_HIDDEN unsigned long long sim_next_id(void);
SIM_HIDDEN uint64_t sim_max64(uint64_t a, uint64_t b);

/* cuda_init.c: CUDA_SUCCESS once cuInit succeeded, else CUDA_ERROR_NOT_INITIALIZED. */
SIM_HIDDEN CUresult sim_ready(void);
/* A valid ordinal: its node GPU in *phys. */
SIM_HIDDEN CUresult sim_device(CUdevice dev, uint32_t *phys);
/* CUDA_ERROR_UNKNOWN for a GPU that fell off the bus (what callers of a real driver see). */
SIM_HIDDEN CUresult sim_gpu_ok(uint32_t phys);
/* SIMGPU_TRACE=1: say on stderr what a client asked for and did not get. */
SIM_HIDDEN int sim_trace(void);

/* cuda_ctx.c */
SIM_HIDDEN struct CUctx_st *sim_ctx_top(void);
/* The calling thread's current context, usable (initialised, active, GPU present). */
SIM_HIDDEN CUresult sim_current(struct CUctx_st **out);
/* A handle the caller passed: a live context of this process. */
SIM_HIDDEN CUresult sim_ctx_valid(CUcontext ctx);

/* cuda_mem.c: the address table (sim_lock held). */
SIM_HIDDEN int sim_range_insert(struct sim_alloc *a);
SIM_HIDDEN void sim_range_remove(struct sim_alloc *a);
SIM_HIDDEN struct sim_alloc *sim_range_find(uintptr_t p);
/* [p, p+n) lies in device-accessible memory (writable if `write`). */
SIM_HIDDEN CUresult sim_range_check(uintptr_t p, size_t n, int write);
/* Anonymous, lazily backed memory: a 16 GiB allocation costs no RAM until touched. */
SIM_HIDDEN void *sim_map_anon(size_t len, int low32);
/* Unmap, unlink and uncharge an allocation (not VMM); frees the record. */
SIM_HIDDEN void sim_alloc_destroy_locked(struct sim_alloc *a);
/* A module's variables in ctx: `size` bytes mapped (initialised from init), `charge` charged on
 * its GPU (CUDA_ERROR_OUT_OF_MEMORY when it cannot hold them). */
SIM_HIDDEN CUresult sim_module_mem_locked(struct CUctx_st *ctx, size_t size, const void *init, uint64_t charge,
                                          struct sim_alloc **out);
/* Everything a context owns goes when it is destroyed, as on a real driver. */
SIM_HIDDEN void sim_mem_free_ctx_locked(struct CUctx_st *ctx);

/* cuPointerGetAttribute's answer (cuda_mem.c); CUDA_ERROR_INVALID_VALUE for unknown memory. */
SIM_HIDDEN CUresult sim_pointer_attribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);

/* cuda_vmm.c: physical handles, for the memory cuMemMapArrayAsync binds into arrays
 * (sim_lock held). A binding holds the handle's memory like a mapping does. */
SIM_HIDDEN struct sim_phys *sim_phys_live_locked(CUmemGenericAllocationHandle h);
SIM_HIDDEN void sim_phys_describe(const struct sim_phys *p, uint32_t *gpu, uint64_t *size, unsigned short *usage);
SIM_HIDDEN void sim_phys_bind_locked(struct sim_phys *p);
SIM_HIDDEN void sim_phys_unbind_locked(struct sim_phys *p);

/* cuda_pool.c */
SIM_HIDDEN void sim_pool_return_locked(struct CUmemPoolHandle_st *pool, uint64_t bytes);
/* Pools give memory above their release threshold back at synchronisation points. */
SIM_HIDDEN void sim_pools_trim_locked(void);

/* cuda_stream.c */
/* Resolve a stream argument (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a handle); `ptds`:
 * the caller entered through a _ptsz/_ptds variant, where NULL means the per-thread stream. */
SIM_HIDDEN CUresult sim_stream_get(CUstream h, int ptds, struct CUctx_st **ctx, struct CUstream_st **s);
/* When work queued now on s could start: its own work and the implicit legacy-stream ordering. */
SIM_HIDDEN uint64_t sim_stream_deps(struct CUctx_st *ctx, struct CUstream_st *s);
/* Queue a kernel of `dur_ns` on s (GPU timeline); may drop sim_lock while the queue is full. */
SIM_HIDDEN CUresult sim_submit_kernel_locked(struct CUctx_st *ctx, struct CUstream_st *s, uint64_t dur_ns);
SIM_HIDDEN void sim_stream_free_ctx_locked(struct CUctx_st *ctx);
SIM_HIDDEN void sim_stream_init(struct CUstream_st *s, struct CUctx_st *ctx, enum sim_stream_kind kind, unsigned int flags, int priority);
/* Block until the work before a synchronous copy on stream h is done (legacy-stream semantics). */
SIM_HIDDEN CUresult sim_sync_copy_wait(CUstream h, int ptds);
SIM_HIDDEN CUresult sim_ctx_synchronize(struct CUctx_st *ctx);

/* cuda_exec.c */
SIM_HIDDEN void sim_module_free_ctx_locked(struct CUctx_st *ctx);
/* Duration of one launch of f with these parameters. */
SIM_HIDDEN CUresult sim_launch_duration(struct CUfunc_st *f, void **params, void **extra, uint64_t *dur_ns);

/* cuda_graphmem.c: graph memory. An allocation node reserves an address range when added;
 * an executable graph holds its allocation nodes' memory on the node from its first launch
 * until it is destroyed, as the real driver maps it at launch (sim_lock held). */
struct sim_graph_alloc {
    uint64_t bytes;  /* 0: none */
    int dev;         /* CUDA ordinal */
    void *va;        /* a node's reserved range (PROT_NONE), unmapped with its graph */
    size_t va_len;
    int mapped;      /* an executable graph's memory is held on the node */
};
SIM_HIDDEN void sim_graph_alloc_add(struct sim_graph_alloc *exec, const struct sim_graph_alloc *node);
SIM_HIDDEN void sim_graph_alloc_node_free(struct sim_graph_alloc *node);
SIM_HIDDEN CUresult sim_graph_alloc_map_locked(struct sim_graph_alloc *exec);
SIM_HIDDEN void sim_graph_alloc_unmap_locked(struct sim_graph_alloc *exec);
SIM_HIDDEN CUresult sim_graph_add_alloc_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                             const struct sim_graph_alloc *alloc);

/* cuda_exec.c: whether modules load eagerly (CUDA_MODULE_LOADING=EAGER) or lazily (default). */
SIM_HIDDEN int sim_module_loading_eager(void);
/* cuda_exec.c: load an image as a module of the current context (the runtime's fat binaries). */
SIM_HIDDEN CUresult sim_module_load_current(CUmodule *mod, const void *image);

/* cuda_ctx.c: the runtime's private way to its device's primary context (export table slot):
 * the handle, activated with one reference if it was inactive, no new reference otherwise. */
SIM_HIDDEN CUresult sim_primary_ctx_get(CUcontext *pctx, CUdevice dev);
/* The 21318c60-... export table (cuda_toolsctx.c), which the 13.5 runtime needs. */
SIM_HIDDEN extern void *const sim_tools_ctx_table[];

/* cuda_cls.c: the runtime's context-local storage. Destructors run, without sim_lock, while the
 * context still lives, before it is destroyed, reset or released for the last time. */
typedef void (*sim_cls_dtor)(CUcontext ctx, void *key, void *value);
SIM_HIDDEN CUresult sim_cls_put(CUcontext ctx, void *key, void *value, sim_cls_dtor dtor);
SIM_HIDDEN CUresult sim_cls_delete(CUcontext ctx, void *key);
SIM_HIDDEN CUresult sim_cls_get(void **value, CUcontext ctx, void *key);
SIM_HIDDEN void sim_cls_destroy(struct CUctx_st *ctx);

/* cuda_init.c: what the integrity check hashes of a device (ordinal). */
SIM_HIDDEN void sim_device_hash_info(int dev, uint8_t uuid[16], int32_t *domain, int32_t *bus, int32_t *device);
/* cuda_integrity.c */
SIM_HIDDEN CUresult sim_integrity_answer(uint32_t version, uint64_t unix_seconds, uint64_t out[2],
                                         const void *cudart_table, const void *integrity_table, const void *fn);

/* cuda_graph.c: a launch on a capturing stream becomes a node of its graph. */
SIM_HIDDEN CUresult sim_capture_kernel_locked(struct CUstream_st *s, struct CUfunc_st *f, uint64_t dur_ns);

#endif
