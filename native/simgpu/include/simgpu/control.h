/* simgpu control API: create a simulated GPU node, inspect it, inject faults.
 *
 * Bound from Python with cffi (src/vgpu_plugin/sim/simgpu.py), which feeds this header to
 * ffi.cdef() after dropping preprocessor lines: keep it plain C declarations, array sizes as
 * literals, no macros.
 */
#ifndef SIMGPU_CONTROL_H
#define SIMGPU_CONTROL_H

#include <stdint.h>

enum {
    SIMGPU_MAX_GPUS = 16,
    SIMGPU_MAX_PROCS = 512
};

/* Static description of one simulated GPU, fixed when the node is created. */
struct simgpu_gpu_config {
    char name[96];             /* "NVIDIA H100 80GB HBM3" */
    char uuid[80];             /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char serial[32];
    char pci_bus_id[32];       /* "00000000:17:00.0" (NVML's 16-char form) */
    uint64_t total_memory;     /* bytes */
    uint64_t context_overhead; /* bytes a new context consumes on this GPU */
    uint32_t sm_count;
    int32_t numa_node;         /* -1: unknown */
    uint32_t minor_number;
    int32_t cc_major;
    int32_t cc_minor;
    uint32_t pci_device_id;    /* e.g. 0x233010DE */
};

/* Dynamic view of one GPU, as the node sees it now. */
struct simgpu_gpu_status {
    uint64_t used_memory;      /* bytes held by all live processes (contexts included) */
    uint64_t timeline_end_ns;  /* CLOCK_MONOTONIC time when queued work finishes */
    uint32_t utilization;      /* percent busy over the last second */
    uint32_t live_processes;   /* processes with a context or memory on this GPU */
    uint64_t xid_count;        /* XIDs injected so far */
    int32_t lost;              /* 1: the GPU has fallen off the bus */
};

/* Create (or replace) the node state in state_dir (created if missing). 0 on success. */
int simgpu_node_create(const char *state_dir, const struct simgpu_gpu_config *gpus, uint32_t count);
/* Number of GPUs of the node in state_dir, or -1. */
int simgpu_node_gpu_count(const char *state_dir);
/* Configuration and status of GPU `gpu` (physical index). 0 on success. */
int simgpu_node_gpu(const char *state_dir, uint32_t gpu, struct simgpu_gpu_config *cfg,
                    struct simgpu_gpu_status *status);
/* Deliver an XID event to every NVML event set registered for it on GPU `gpu`. */
int simgpu_inject_xid(const char *state_dir, uint32_t gpu, uint64_t xid);
/* Mark GPU `gpu` lost (1) or back (0): calls on it answer the "GPU is lost" errors. */
int simgpu_set_lost(const char *state_dir, uint32_t gpu, int32_t lost);
/* Reclaim the memory of dead processes now (otherwise done lazily). Returns slots freed. */
int simgpu_reap(const char *state_dir);
/* GPU time one process got on a GPU in a span of the simulated timeline. */
struct simgpu_pid_busy {
    int32_t pid;               /* as NVML reports it */
    uint32_t reserved;
    uint64_t busy_ns;
};
/* Per process, the GPU time GPU `gpu` ran its work during [from_ns, to_ns] of simgpu's clock
 * (CLOCK_MONOTONIC); at most `max` processes. *covered_ns: from when on the GPU's record of
 * work is complete (older work has left its ring). Returns how many processes it wrote. */
int simgpu_node_busy(const char *state_dir, uint32_t gpu, uint64_t from_ns, uint64_t to_ns,
                     struct simgpu_pid_busy *out, uint32_t max, uint64_t *covered_ns);
/* One span of work a GPU ran: queued by process `pid` at queued_ns, run in [start_ns, end_ns]
 * of simgpu's clock (a kernel that was time-sliced is several spans, each queued when it was). */
struct simgpu_span {
    uint64_t queued_ns;
    uint64_t start_ns;
    uint64_t end_ns;
    int32_t pid;               /* as NVML reports it */
    uint32_t reserved;
};
/* The spans of GPU `gpu`'s record whose time from queued to end meets [from_ns, to_ns], oldest
 * recorded first; at most `max` (the record keeps 16384 spans a GPU). *covered_ns as
 * simgpu_node_busy's. Returns how many it wrote. */
int simgpu_node_spans(const char *state_dir, uint32_t gpu, uint64_t from_ns, uint64_t to_ns,
                      struct simgpu_span *out, uint32_t max, uint64_t *covered_ns);
/* Text of the last error of this thread's control call. */
const char *simgpu_last_error(void);

#endif
