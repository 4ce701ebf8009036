/* Helpers shared by the driver-API test programs (tests/native/cuda_*.c). They print results
 * as "key=value" lines that tests/integration/test_simgpu_cuda.py parses. */
#ifndef VGPU_TESTS_CUDA_TEST_H
#define VGPU_TESTS_CUDA_TEST_H

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* A call that must succeed; anything else ends the program with exit status 10. */
#define CK(call)                                                                        \
    do {                                                                                \
        CUresult ck_rc_ = (call);                                                       \
        if (ck_rc_ != CUDA_SUCCESS) {                                                   \
            const char *ck_name_ = "?";                                                 \
            cuGetErrorName(ck_rc_, &ck_name_);                                          \
            fprintf(stderr, "%s:%d: %s -> %d %s\n", __FILE__, __LINE__, #call, (int)ck_rc_, ck_name_); \
            exit(10);                                                                   \
        }                                                                               \
    } while (0)

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* A module of simulated kernels: "busy" runs `us` microseconds per launch. */
static inline CUfunction busy_kernel(CUmodule *mod, unsigned int us) {
    char image[128];
    CUfunction f;
    snprintf(image, sizeof image, "simgpu-module 1\nkernel busy %uus\n", us);
    CK(cuModuleLoadData(mod, image));
    CK(cuModuleGetFunction(&f, *mod, "busy"));
    return f;
}

/* Retain device `ordinal`'s primary context and make it current. */
static inline CUcontext use_primary(int ordinal) {
    CUdevice dev;
    CUcontext ctx;
    CK(cuDeviceGet(&dev, ordinal));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    return ctx;
}

static inline size_t free_bytes(void) {
    size_t f, t;
    CK(cuMemGetInfo(&f, &t));
    return f;
}

#endif
