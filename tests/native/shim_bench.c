/* Timings for bench/bench_shim.py: the same calls with and without the shim preloaded.
 *
 *   shim_bench launch <n>           ns per cuLaunchKernel (a zero-length kernel)
 *   shim_bench alloc <n> <bytes>    ns per cuMemAlloc + cuMemFree pair (wall and CPU); with
 *                                   a line on stdin first when started with "gate" last
 *   shim_bench ctx <n> [history]    n cuCtxCreate_v2 + cuCtxDestroy_v2 pairs; with "history",
 *                                   after 20,000 allocations made (all live at once) and freed
 *   shim_bench meminfo <n>          n cuMemGetInfo_v2 calls
 *   shim_bench init                 us from the first driver call to a first allocation done
 *   shim_bench ab-launch <n>        in one process under the shim: the hooked cuLaunchKernel and
 *   shim_bench ab-alloc <n>         the driver's own (found with libc's dlsym, past the shim's
 *                                   override), alternated in blocks; prints hook_ns and real_ns
 *                                   (the best block of each)
 *
 * Entry points are bound like a program linked with -lcuda binds them (the "default" way of
 * shim_test.h), after the process has started. */
#include "shim_test.h"

static double clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static double now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
static double cpu_ns(void) { return clock_ns(CLOCK_PROCESS_CPUTIME_ID); }

enum { BLOCK = 2000 };

static double best_block(double cur, double t0, long n) {
    double per = (now_ns() - t0) / (double)n;
    return cur == 0 || per < cur ? per : cur;
}

static void ab_launch(long n, CUfunction f, CUstream s) {
    __typeof__(cuLaunchKernel) *hook = C(launch, cuLaunchKernel);
    __typeof__(cuLaunchKernel) *real = (__typeof__(cuLaunchKernel) *)real_sym("cuLaunchKernel");
    if (!real || real == hook) exit(4);
    double h = 0, r = 0;
    for (long done = 0; done < n; done += 2 * BLOCK) {
        double t0 = now_ns();
        for (int i = 0; i < BLOCK; i++) hook(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
        h = best_block(h, t0, BLOCK);
        t0 = now_ns();
        for (int i = 0; i < BLOCK; i++) real(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
        r = best_block(r, t0, BLOCK);
    }
    printf("hook_ns=%.1f\nreal_ns=%.1f\n", h, r);
}

static void ab_alloc(long n, size_t bytes) {
    __typeof__(cuMemAlloc) *hook_a = C(alloc, cuMemAlloc);
    __typeof__(cuMemFree) *hook_f = C(free, cuMemFree);
    __typeof__(cuMemAlloc) *real_a = (__typeof__(cuMemAlloc) *)real_sym("cuMemAlloc_v2");
    __typeof__(cuMemFree) *real_f = (__typeof__(cuMemFree) *)real_sym("cuMemFree_v2");
    if (!real_a || !real_f || real_a == hook_a) exit(4);
    double h = 0, r = 0;
    CUdeviceptr p;
    for (long done = 0; done < n; done += 2 * BLOCK / 10) {
        double t0 = now_ns();
        for (int i = 0; i < BLOCK / 10; i++) {
            CK(hook_a(&p, bytes));
            CK(hook_f(p));
        }
        h = best_block(h, t0, BLOCK / 10);
        t0 = now_ns();
        for (int i = 0; i < BLOCK / 10; i++) {
            CK(real_a(&p, bytes));
            CK(real_f(p));
        }
        r = best_block(r, t0, BLOCK / 10);
    }
    printf("hook_ns=%.1f\nreal_ns=%.1f\n", h, r);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *what = argv[1];
    if (!strcmp(what, "init")) {
        shim_load("default");
        double t0 = now_ns();
        CUdevice dev;
        CUcontext ctx;
        CUdeviceptr p;
        CK(C(init, cuInit)(0));
        CK(C(device_get, cuDeviceGet)(&dev, 0));
        CK(C(retain, cuDevicePrimaryCtxRetain)(&ctx, dev));
        CK(C(set_current, cuCtxSetCurrent)(ctx));
        CK(C(alloc, cuMemAlloc)(&p, 1 << 20));
        CK(C(free, cuMemFree)(p));
        printf("init_us=%.1f\n", (now_ns() - t0) / 1e3);
        return 0;
    }
    long n = argc > 2 ? atol(argv[2]) : 100000;
    CUdevice dev = shim_start("default", 0);
    if (!strcmp(what, "ctx")) {
        if (argc > 3 && !strcmp(argv[3], "history")) {
            enum { HISTORY = 20000 };
            static CUdeviceptr ptrs[HISTORY];
            for (int i = 0; i < HISTORY; i++) CK(C(alloc, cuMemAlloc)(&ptrs[i], 4096));
            for (int i = 0; i < HISTORY; i++) CK(C(free, cuMemFree)(ptrs[i]));
        }
        CUcontext ctx;
        for (long i = 0; i < n; i++) {
            CK(C(ctx_create, cuCtxCreate_v4)(&ctx, NULL, 0, dev));
            CK(C(ctx_destroy, cuCtxDestroy)(ctx));
        }
        printf("pairs=%ld\n", n);
    } else if (!strcmp(what, "meminfo")) {
        size_t f, t;
        for (long i = 0; i < n; i++) CK(C(mem_info, cuMemGetInfo)(&f, &t));
        printf("calls=%ld\n", n);
    } else if (!strcmp(what, "ab-alloc")) {
        ab_alloc(n, 1 << 20);
    } else if (!strcmp(what, "launch") || !strcmp(what, "ab-launch")) {
        CUmodule mod;
        CUfunction f;
        CK(C(module_load, cuModuleLoadData)(&mod, "simgpu-module 1\nkernel nop 0us\n"));
        CK(C(get_function, cuModuleGetFunction)(&f, mod, "nop"));
        CUstream s;
        CK(C(stream_create, cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING));
        __typeof__(cuLaunchKernel) *launch = C(launch, cuLaunchKernel);
        for (int i = 0; i < 1000; i++) CK(launch(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL));
        if (!strcmp(what, "ab-launch")) {
            ab_launch(n, f, s);
            return 0;
        }
        double t0 = now_ns();
        for (long i = 0; i < n; i++) launch(f, 1, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
        printf("ns_per_call=%.1f\n", (now_ns() - t0) / (double)n);
    } else if (!strcmp(what, "alloc")) {
        size_t bytes = argc > 3 ? strtoull(argv[3], NULL, 0) : (1 << 20);
        __typeof__(cuMemAlloc) *alloc = C(alloc, cuMemAlloc);
        __typeof__(cuMemFree) *release = C(free, cuMemFree);
        CUdeviceptr p;
        for (int i = 0; i < 100; i++) {
            CK(alloc(&p, bytes));
            CK(release(p));
        }
        if (!strcmp(argv[argc - 1], "gate")) {
            printf("ready\n");
            fflush(stdout);
            while (getchar() != '\n') {
            }
        }
        double t0 = now_ns(), c0 = cpu_ns();
        for (long i = 0; i < n; i++) {
            CK(alloc(&p, bytes));
            CK(release(p));
        }
        printf("ns_per_pair=%.1f\ncpu_ns_per_pair=%.1f\n", (now_ns() - t0) / (double)n, (cpu_ns() - c0) / (double)n);
    } else {
        return 2;
    }
    return 0;
}
