/* Node-wide simulated GPU state, shared by every process that uses the same SIMGPU_STATE dir.
 *
 * One file, <dir>/node.simgpu, mmapped MAP_SHARED by every process of the node (the CUDA and
 * NVML fronts and the control API). Dynamic fields change under one robust, process-shared
 * mutex: a process killed while holding it cannot wedge the node (the next locker recovers).
 * Each process that attaches owns a slot, kept alive by an OFD byte lock on the file; a slot
 * whose lock can be taken belongs to a dead process and its memory is reclaimed, as the real
 * driver frees a dead process's memory.
 */
#ifndef SIMGPU_STATE_H
#define SIMGPU_STATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "simgpu/control.h"

#define SIMGPU_STATE_FILE "node.simgpu"
#define SIMGPU_STATE_MAGIC 0x3130555047494d53ULL /* "SIMGPU01" */
/* 3: per-cgroup memory limits (cgroup_limits.c); 4: busy spans name their process;
 * 5: cgroups are identified by their directory too; 6: a busy ring of 16384 spans;
 * 7: per-context lanes for time-slicing (SIMGPU_TIMESLICE); 8: a futex for event waits;
 * 9: busy spans say when their work was queued. */
#define SIMGPU_STATE_VERSION 9u
/* Spans of work kept per GPU: enough for tests to read seconds of 200 µs kernels of several
 * processes afterwards in simgpu's clock (simgpu_node_busy). */
#define SIMGPU_BUSY_RING 16384
#define SIMGPU_XID_RING 64
#define SIMGPU_LANES 32 /* contexts per GPU whose queued work time-slicing tracks at once */
#define SIMGPU_CGROUP_LIMITS 128 /* (cgroup, GPU) memory limits the node holds at once */
#define SIMGPU_CGROUP_PATH 512   /* bytes of a cgroup v2 path ("/kubepods/..."), NUL included */
#define SIMGPU_CGROUP_DEPTH 16   /* a process's cgroup directory and its ancestors kept, leaf first */

enum { SIMGPU_SLOT_FREE = 0, SIMGPU_SLOT_CLAIMED = 1, SIMGPU_SLOT_LIVE = 2 };

struct simgpu_busy_span {
    uint64_t start_ns;
    uint64_t end_ns;
    uint64_t queued_ns; /* when its process queued the work (it waited from then: tests tell a
                         * launcher the GPU kept waiting from one the host did not run) */
    int32_t pid; /* the process whose work ran (the pid NVML reports for it), for per-process NVML */
    uint32_t reserved;
};

/* Time-slicing (SIMGPU_TIMESLICE): a context's queued work on one GPU ends at end_ns. */
struct simgpu_lane {
    uint64_t owner;      /* the context's timeline name; 0: free */
    uint64_t end_ns;     /* its queued work ends */
    uint64_t next_ns;    /* its next work may start (the others' turn after its last slice) */
    uint64_t slice_left; /* of the slice its work ended in, for work queued right behind */
};

struct simgpu_xid_record {
    uint64_t xid;
    uint64_t time_ns;
};

struct simgpu_gpu_shared {
    struct simgpu_gpu_config cfg;
    uint64_t used;            /* bytes, node lock */
    uint64_t timeline_end_ns; /* node lock */
    uint64_t busy_count;      /* spans ever recorded; ring slot = count % RING; node lock */
    struct simgpu_busy_span busy[SIMGPU_BUSY_RING];
    /* Whose work is queued last, and when the latest work of any other context ends: enough to
     * tell any context when the work others queued before now is done (node lock). */
    uint64_t last_owner;
    uint64_t others_end_ns;
    _Atomic int32_t lost;
    /* XID ring: the record is written before xid_count is bumped (release), so a reader that
     * sees count n can read records n-RING..n-1. */
    _Atomic uint64_t xid_count;
    struct simgpu_xid_record xid_ring[SIMGPU_XID_RING];
    struct simgpu_lane lanes[SIMGPU_LANES]; /* node lock */
};

/* A cgroup by its directory, as the driver knows it whatever path named it. {0, 0}: none. */
struct simgpu_cgroup_dir {
    uint64_t dev;
    uint64_t ino;
};

struct simgpu_proc_shared {
    _Atomic uint32_t state;
    int32_t pid;
    uint64_t start_time; /* field 22 of /proc/self/stat: tells pid reuse apart */
    uint64_t used[SIMGPU_MAX_GPUS];
    uint32_t contexts[SIMGPU_MAX_GPUS];
    char cgroup[SIMGPU_CGROUP_PATH]; /* its cgroup v2 path, "" unknown (cgroup_limits.c) */
    /* The (st_dev, st_ino) of its cgroup's directory and of the ancestors it can see, leaf
     * first: what a limit set through another mount of the cgroup fs is matched by. */
    uint32_t cgroup_ndirs;
    uint32_t reserved;
    struct simgpu_cgroup_dir cgroup_dirs[SIMGPU_CGROUP_DEPTH];
};

/* A memory limit the driver holds a cgroup to on one GPU (nvmlDeviceSetMemoryLimits_v1). */
struct simgpu_cgroup_limit {
    uint32_t in_use; /* node lock */
    uint32_t gpu;    /* physical index */
    uint64_t soft;   /* bytes; reported, not enforced (no memory pressure is modelled) */
    uint64_t hard;   /* bytes */
    struct simgpu_cgroup_dir dir; /* {0, 0}: its directory did not exist at set time */
    char cgroup[SIMGPU_CGROUP_PATH];
};

struct simgpu_node {
    uint64_t magic;
    uint32_t version;
    uint32_t gpu_count;
    uint64_t file_size;
    uint64_t lock_base; /* file offset of the per-slot liveness bytes */
    pthread_mutex_t lock;
    uint64_t owners;    /* timeline owner names handed out (node lock) */
    /* Bumped after each XID and each GPU lost or back, and waited on (a futex on the shared
     * file): an NVML event wait sleeps until something happens, as the driver's does. */
    _Atomic uint32_t events;
    uint32_t reserved;
    struct simgpu_gpu_shared gpus[SIMGPU_MAX_GPUS];
    struct simgpu_proc_shared procs[SIMGPU_MAX_PROCS];
    struct simgpu_cgroup_limit cgroup_limits[SIMGPU_CGROUP_LIMITS];
};

/* --- this process's attachment ------------------------------------------------------------ */

/* The node of SIMGPU_STATE, attached and this process registered on first use (thread-safe,
 * re-done in a forked child). NULL when SIMGPU_STATE is unset or its file is not a valid node;
 * the reason was printed once on stderr and is in simgpu_state_error(). */
struct simgpu_node *simgpu_node(void);
const char *simgpu_state_error(void);
/* This process's slot index in node->procs. */
int simgpu_self_slot(void);

void simgpu_lock(struct simgpu_node *node);
void simgpu_unlock(struct simgpu_node *node);

/* --- memory ------------------------------------------------------------------------------ */

/* Charge `bytes` on physical GPU `gpu` to this process. 0, or -1 when the GPU's physical memory
 * cannot hold it (after reclaiming dead processes once). */
int simgpu_mem_charge(uint32_t gpu, uint64_t bytes);
void simgpu_mem_uncharge(uint32_t gpu, uint64_t bytes);
/* Context bookkeeping: count (for process lists) and the configured overhead charge. */
int simgpu_context_add(uint32_t gpu);
void simgpu_context_remove(uint32_t gpu);
/* Free and total bytes of physical GPU `gpu`. */
void simgpu_mem_info(uint32_t gpu, uint64_t *free_bytes, uint64_t *total_bytes);

/* --- execution timeline ------------------------------------------------------------------ */

uint64_t simgpu_now_ns(void); /* CLOCK_MONOTONIC, shared by all processes */
void simgpu_sleep_until(uint64_t t_ns);
/* Queue `duration_ns` of work of context `owner` (node-wide unique, not 0) on GPU `gpu`, ready
 * no earlier than `ready_ns`. Not time-sliced, work of all contexts runs one piece at a time in
 * submission order; time-sliced, it shares the GPU in slices with the work other contexts have
 * queued (state.c). Returns the time it completes. */
uint64_t simgpu_timeline_submit(uint32_t gpu, uint64_t owner, uint64_t ready_ns, uint64_t duration_ns);
/* A new name for a context on the timelines, unique on the node (pids are not: containers
 * have their own pid namespaces). */
uint64_t simgpu_timeline_owner(void);
/* The time slice contexts share a GPU in (SIMGPU_TIMESLICE, parsed once), 0: not time-sliced
 * (kernels of all contexts run one after another in submission order). */
uint64_t simgpu_timeslice_ns(void);
/* When the work queued so far on GPU `gpu` by contexts other than `owner` completes (0: none). */
uint64_t simgpu_timeline_others_end(uint32_t gpu, uint64_t owner);
/* Percent of the last `window_ns` during which GPU `gpu` was busy. */
uint32_t simgpu_utilization(uint32_t gpu, uint64_t window_ns);
/* The same for a GPU whose node lock the caller holds, at time `now`. */
uint32_t simgpu_busy_percent_locked(const struct simgpu_gpu_shared *g, uint64_t now, uint64_t window_ns);

/* How long one process's work ran on a GPU during [from_ns, now_ns]. */
struct simgpu_proc_busy {
    int32_t pid;
    uint64_t busy_ns;
};
/* Every process whose work ran on GPU `gpu` during [from_ns, now_ns], at most `max`, in order of
 * their latest work (most recent first); returns how many it wrote. */
uint32_t simgpu_process_busy(uint32_t gpu, uint64_t from_ns, uint64_t now_ns,
                             struct simgpu_proc_busy *out, uint32_t max);

/* --- faults ------------------------------------------------------------------------------ */

/* Tell every NVML event wait on the node that an XID or a lost GPU may be there. */
void simgpu_events_notify(struct simgpu_node *node);
/* Sleep until simgpu_events_notify runs after `node->events` read `seen`, or until `until_ns`
 * (CLOCK_MONOTONIC), whichever comes first; early returns are allowed (the caller looks). */
void simgpu_events_wait(struct simgpu_node *node, uint32_t seen, uint64_t until_ns);

int simgpu_gpu_lost(uint32_t gpu);
uint64_t simgpu_xid_count(uint32_t gpu);
/* The record of XID number `seq` (0-based), or -1 if it has left the ring. */
int simgpu_xid_get(uint32_t gpu, uint64_t seq, struct simgpu_xid_record *out);

/* --- visibility (what the NVIDIA container runtime would expose) ------------------------- */

/* Physical GPUs this process may see, honouring NVIDIA_VISIBLE_DEVICES (UUIDs or indices,
 * "all", "none", "void"), in physical order. Returns the count; fills map[i] = physical index. */
uint32_t simgpu_visible_gpus(uint32_t map[SIMGPU_MAX_GPUS]);

/* Reclaim the slots of dead processes through `fd` (an open description of the node file that
 * is not theirs), skipping `self_slot`; node lock held by the caller. Returns slots freed. */
int simgpu_reap_locked(struct simgpu_node *node, int fd, int self_slot);

/* Map and validate <dir>/node.simgpu without registering a process (control API). NULL on a
 * missing or invalid file, with the reason in simgpu_state_error(). Unmap with munmap(node,
 * node->file_size) and close(*fd_out). */
struct simgpu_node *simgpu_map(const char *dir, int *fd_out);
void simgpu_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* --- process view (what NVML lists) ------------------------------------------------------ */

struct simgpu_proc_usage {
    int32_t pid;
    uint32_t contexts;
    uint64_t used; /* bytes this process holds on the GPU, its contexts' overhead included */
};

/* The live processes with memory or a context on physical GPU `gpu`, dead ones reaped first:
 * fills out[0..max) in slot order and returns how many there are (may be more than max). */
uint32_t simgpu_gpu_processes(uint32_t gpu, struct simgpu_proc_usage *out, uint32_t max);

/* --- per-cgroup memory limits (cgroup_limits.c), what nvmlDeviceSetMemoryLimits_v1 sets ------ */

/* A cgroup as an NVML nameSpace names it: its path below the cgroup fs and, where that
 * directory exists in this process's view, the directory itself. */
struct simgpu_cgroup_id {
    char path[SIMGPU_CGROUP_PATH]; /* canonical: "/" or "/a/b", no trailing '/' */
    struct simgpu_cgroup_dir dir;  /* {0, 0}: no such directory */
};

/* The calling process's cgroup: the path is SIMGPU_CGROUP when set (a simulation knob: tests
 * cannot always move processes between cgroups), else the "0::<path>" line of
 * /proc/self/cgroup ("" when neither gives one); `dirs` get the directory of that path under
 * the cgroup fs and its ancestors', leaf first, as far as they exist; returns their count. */
uint32_t simgpu_cgroup_self(char out[SIMGPU_CGROUP_PATH], struct simgpu_cgroup_dir dirs[SIMGPU_CGROUP_DEPTH]);
/* The cgroup of an NVML nameSpace (the cgroup's full sysfs path, "/sys/fs/cgroup<path>"): 0,
 * or -1 when it is not under /sys/fs/cgroup or too long. The directory is looked up in this
 * process's view: /sys/fs/cgroup, or the directory SIMGPU_SYSFS_CGROUP names (a simulation
 * knob: where a runtime mounted the cgroup fs, or a container's own cgroup, elsewhere). */
int simgpu_cgroup_of_namespace(const char *name_space, struct simgpu_cgroup_id *out);

enum {
    SIMGPU_LIMIT_OK = 0,
    SIMGPU_LIMIT_INVALID = -1, /* soft > hard, or a limit above the GPU's memory */
    SIMGPU_LIMIT_FULL = -2,    /* no room in the node's table */
    SIMGPU_LIMIT_NONE = -3,    /* no limit set for that cgroup on that GPU */
    SIMGPU_LIMIT_NO_NODE = -4,
};
#define SIMGPU_LIMIT_MAX UINT64_MAX /* hard limit "none": soft 0 and hard MAX clear a limit */

/* Set (or, soft 0 and hard SIMGPU_LIMIT_MAX, clear) the limit of `cgroup` on physical GPU
 * `gpu`. A cgroup whose directory exists is the directory (another path to it, from inside a
 * container, finds it); one without is its path. */
int simgpu_cgroup_limit_set(uint32_t gpu, const struct simgpu_cgroup_id *cgroup, uint64_t soft, uint64_t hard);
/* The limit of exactly `cgroup` on `gpu`, and the bytes its processes (those of its
 * descendants included) hold there now, dead processes reaped first. */
int simgpu_cgroup_limit_get(uint32_t gpu, const struct simgpu_cgroup_id *cgroup, uint64_t *soft, uint64_t *hard,
                            uint64_t *used);
/* Whether slot `slot` may charge `bytes` more on `gpu`: no limit on its cgroup or an ancestor
 * would go over its hard limit. Node lock held. */
int simgpu_cgroup_admits_locked(const struct simgpu_node *node, int slot, uint32_t gpu, uint64_t bytes);

/* --- versions the simulated driver reports (both fronts must agree) ---------------------- */

#define SIMGPU_DRIVER_VERSION "580.95.05" /* kernel driver: nvmlSystemGetDriverVersion */
#define SIMGPU_CUDA_VERSION 13000         /* CUDA 13.0: cuDriverGetVersion, NVML's CUDA version */

#endif
