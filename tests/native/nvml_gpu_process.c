/* A stand-in GPU process for the NVML tests: it uses the node the way a CUDA process does
 * (memory, contexts, kernels), straight through libsimgpu's state API, so NVML's view of other
 * processes can be tested without the CUDA front.
 *
 * Usage: nvml_gpu_process STEP...   with STEP one of
 *   mem:GPU:MIB     charge MIB MiB on physical GPU GPU
 *   ctx:GPU         create a context on GPU (charges the node's context overhead)
 *   busy:GPU:MS     keep GPU busy for MS ms with back-to-back 5 ms kernels
 * Memory and contexts are set up first, then it prints "ready", runs the busy steps (each
 * prints "busy GPU START END", its span on simgpu's clock, CLOCK_MONOTONIC ns), prints "done"
 * and holds everything until stdin closes (or it is killed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../native/simgpu/src/state.h"

#define KERNEL_NS 5000000ull

/* Like a stream with every launch queued up front: the kernels sit back to back on the
 * timeline, so the span is exactly [start, end] however late this process is scheduled (a
 * loaded host). The tests time their queries by the printed span, on the same clock. */
static void keep_busy(uint32_t gpu, uint64_t ms) {
    uint64_t owner = simgpu_timeline_owner(); /* one context of this process */
    uint64_t now = simgpu_now_ns();
    uint64_t start = simgpu_timeline_submit(gpu, owner, now, KERNEL_NS) - KERNEL_NS;
    uint64_t end = start + KERNEL_NS;
    while (end < start + ms * 1000000ull) end = simgpu_timeline_submit(gpu, owner, now, KERNEL_NS);
    printf("busy %u %llu %llu\n", gpu, (unsigned long long)start, (unsigned long long)end);
    fflush(stdout);
    simgpu_sleep_until(end);
}

int main(int argc, char **argv) {
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            printf("ready\n");
            fflush(stdout);
        }
        for (int i = 1; i < argc; i++) {
            unsigned gpu = 0;
            unsigned long long amount = 0;
            if (sscanf(argv[i], "mem:%u:%llu", &gpu, &amount) == 2) {
                if (pass == 0 && simgpu_mem_charge(gpu, amount << 20) != 0) {
                    fprintf(stderr, "nvml_gpu_process: cannot charge %llu MiB on GPU %u\n", amount, gpu);
                    return 1;
                }
            } else if (sscanf(argv[i], "ctx:%u", &gpu) == 1) {
                if (pass == 0 && simgpu_context_add(gpu) != 0) {
                    fprintf(stderr, "nvml_gpu_process: cannot create a context on GPU %u\n", gpu);
                    return 1;
                }
            } else if (sscanf(argv[i], "busy:%u:%llu", &gpu, &amount) == 2) {
                if (pass == 1) keep_busy(gpu, amount);
            } else {
                fprintf(stderr, "nvml_gpu_process: bad step %s\n", argv[i]);
                return 2;
            }
        }
    }
    printf("done\n");
    fflush(stdout);
    while (getchar() != EOF) {
    }
    return 0;
}
