/* A steady stream of kernels: launch `kernel_us` kernels on a stream, `depth` in flight (2 by
 * default: one queued behind the running one), for `seconds` (wall clock), and count those that
 * completed within `seconds` of the first one's start on simgpu's clock (event times), not by
 * when this process saw them. With a deep queue a loaded host that wakes it late changes
 * neither the GPU's busy span nor the count, as long as the queue does not run dry. Prints
 * "warm" once `warm_s` seconds have passed (a test then reads the node's utilization while the
 * work goes on); a negative warm_s prints nothing.
 *
 *   cuda_workload <ordinal> <kernel_us> <seconds> [warm_s [depth]]
 */
#include "cuda_test.h"

#define MAX_DEPTH 256

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s <ordinal> <kernel_us> <seconds> [warm_s [depth]]\n", argv[0]);
        return 2;
    }
    int depth = argc > 5 ? atoi(argv[5]) : 2;
    if (depth < 1 || depth > MAX_DEPTH) {
        fprintf(stderr, "%s: depth must be 1..%d\n", argv[0], MAX_DEPTH);
        return 2;
    }
    double run_ms = atof(argv[3]) * 1e3;
    double warm_ms = argc > 4 ? atof(argv[4]) * 1e3 : -1;
    CK(cuInit(0));
    use_primary(atoi(argv[1]));
    CUmodule mod;
    CUfunction f = busy_kernel(&mod, (unsigned int)atoi(argv[2]));
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent first, ev[MAX_DEPTH];
    CK(cuEventCreate(&first, 0));
    for (int i = 0; i < depth; i++) CK(cuEventCreate(&ev[i], 0));
    CK(cuEventRecord(first, s)); /* the stream is empty: this is the first kernel's start */
    double start = now_ms(), deadline = start + run_ms;
    long launched = 0, completed = 0;
    int warm = warm_ms < 0;
    while (now_ms() < deadline) {
        if (launched >= depth) { /* the oldest queued kernel's slot is reused: wait for it */
            CK(cuEventSynchronize(ev[launched % depth]));
            float at_ms = 0;
            CK(cuEventElapsedTime(&at_ms, first, ev[launched % depth]));
            if (at_ms <= run_ms) completed++;
        }
        CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        CK(cuEventRecord(ev[launched % depth], s));
        launched++;
        if (!warm && now_ms() - start >= warm_ms) {
            printf("warm\n");
            fflush(stdout);
            warm = 1;
        }
    }
    for (long k = launched > depth ? launched - depth : 0; k < launched; k++) {
        CK(cuEventSynchronize(ev[k % depth]));
        float at_ms = 0;
        CK(cuEventElapsedTime(&at_ms, first, ev[k % depth]));
        if (at_ms <= run_ms) completed++;
    }
    printf("completed=%ld\nlaunched=%ld\nelapsed_ms=%.1f\n", completed, launched, now_ms() - start);
    return 0;
}
