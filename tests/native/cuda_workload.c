/* A steady stream of kernels: launch `kernel_us` kernels on a stream, two in flight, for
 * `seconds`, and count those that completed in time. Prints "warm" once `warm_s` seconds have
 * passed (a test then reads the node's utilization while the work goes on).
 *
 *   cuda_workload <ordinal> <kernel_us> <seconds> [warm_s]
 */
#include "cuda_test.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s <ordinal> <kernel_us> <seconds> [warm_s]\n", argv[0]);
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
    CUevent ev[2];
    CK(cuEventCreate(&ev[0], 0));
    CK(cuEventCreate(&ev[1], 0));
    double start = now_ms(), deadline = start + run_ms;
    long launched = 0, completed = 0;
    int warm = warm_ms < 0;
    while (now_ms() < deadline) {
        CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        CK(cuEventRecord(ev[launched % 2], s));
        launched++;
        if (launched >= 2) { /* keep one kernel queued behind the running one */
            CK(cuEventSynchronize(ev[launched % 2]));
            if (now_ms() <= deadline) completed++;
        }
        if (!warm && now_ms() - start >= warm_ms) {
            printf("warm\n");
            fflush(stdout);
            warm = 1;
        }
    }
    printf("completed=%ld\nlaunched=%ld\nelapsed_ms=%.1f\n", completed, launched, now_ms() - start);
    return 0;
}
