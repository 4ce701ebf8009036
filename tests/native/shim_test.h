/* Helpers of the shim's test programs (tests/native/shim_*.c).
 *
 * The programs link nothing from CUDA: they dlopen libcuda.so.1 and take the driver's entry
 * points through one of the three ways a real program can reach them, chosen on the command
 * line, so that each test covers each interception path:
 *   handle   dlsym(dlopen("libcuda.so.1"), "cuMemAlloc_v2")     -> the shim's dlsym override
 *   default  dlsym(RTLD_DEFAULT, ...) after a global dlopen       -> the shim's exported symbols,
 *            as a program linked with -lcuda binds them
 *   getproc  cuGetProcAddress_v2("cuMemAlloc", 12080, flags)      -> the shim's cuGetProcAddress
 * Results are "key=value" lines on stdout; a failed CK() exits with status 10. */
#ifndef VGPU_TESTS_SHIM_TEST_H
#define VGPU_TESTS_SHIM_TEST_H

#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* field, exported name, base name for cuGetProcAddress, per-thread-stream variant */
#define SHIM_API(F)                                                                            \
    F(init, cuInit, "cuInit", 0)                                                               \
    F(device_get, cuDeviceGet, "cuDeviceGet", 0)                                               \
    F(device_count, cuDeviceGetCount, "cuDeviceGetCount", 0)                                   \
    F(device_uuid, cuDeviceGetUuid_v2, "cuDeviceGetUuid", 0)                                   \
    F(total_mem, cuDeviceTotalMem_v2, "cuDeviceTotalMem", 0)                                   \
    F(retain, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 0)                         \
    F(release, cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 0)                   \
    F(ctx_create, cuCtxCreate_v4, "cuCtxCreate", 0)                                            \
    F(ctx_destroy, cuCtxDestroy_v2, "cuCtxDestroy", 0)                                         \
    F(set_current, cuCtxSetCurrent, "cuCtxSetCurrent", 0)                                      \
    F(sync, cuCtxSynchronize, "cuCtxSynchronize", 0)                                           \
    F(mem_info, cuMemGetInfo_v2, "cuMemGetInfo", 0)                                            \
    F(alloc, cuMemAlloc_v2, "cuMemAlloc", 0)                                                   \
    F(alloc_pitch, cuMemAllocPitch_v2, "cuMemAllocPitch", 0)                                   \
    F(alloc_managed, cuMemAllocManaged, "cuMemAllocManaged", 0)                                \
    F(alloc_async, cuMemAllocAsync, "cuMemAllocAsync", 0)                                      \
    F(alloc_async_ptsz, cuMemAllocAsync_ptsz, "cuMemAllocAsync", 1)                            \
    F(alloc_pool, cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0)                       \
    F(alloc_pool_ptsz, cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 1)             \
    F(free, cuMemFree_v2, "cuMemFree", 0)                                                      \
    F(free_async, cuMemFreeAsync, "cuMemFreeAsync", 0)                                         \
    F(free_async_ptsz, cuMemFreeAsync_ptsz, "cuMemFreeAsync", 1)                               \
    F(pool_create, cuMemPoolCreate, "cuMemPoolCreate", 0)                                      \
    F(pool_destroy, cuMemPoolDestroy, "cuMemPoolDestroy", 0)                                   \
    F(pool_default, cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 0)                 \
    F(granularity, cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0)          \
    F(mem_create, cuMemCreate, "cuMemCreate", 0)                                               \
    F(mem_release, cuMemRelease, "cuMemRelease", 0)                                            \
    F(array_create, cuArrayCreate_v2, "cuArrayCreate", 0)                                      \
    F(array3d_create, cuArray3DCreate_v2, "cuArray3DCreate", 0)                                \
    F(array_destroy, cuArrayDestroy, "cuArrayDestroy", 0)                                      \
    F(mip_create, cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 0)                         \
    F(mip_level, cuMipmappedArrayGetLevel, "cuMipmappedArrayGetLevel", 0)                      \
    F(mip_destroy, cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 0)                      \
    F(map_array, cuMemMapArrayAsync, "cuMemMapArrayAsync", 0)                                  \
    F(stream_create, cuStreamCreate, "cuStreamCreate", 0)                                      \
    F(stream_sync, cuStreamSynchronize, "cuStreamSynchronize", 0)                              \
    F(stream_sync_ptsz, cuStreamSynchronize_ptsz, "cuStreamSynchronize", 1)                    \
    F(module_load, cuModuleLoadData, "cuModuleLoadData", 0)                                    \
    F(get_function, cuModuleGetFunction, "cuModuleGetFunction", 0)                             \
    F(launch, cuLaunchKernel, "cuLaunchKernel", 0)                                             \
    F(launch_ptsz, cuLaunchKernel_ptsz, "cuLaunchKernel", 1)                                   \
    F(launch_ex, cuLaunchKernelEx, "cuLaunchKernelEx", 0)                                      \
    F(launch_ex_ptsz, cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 1)                            \
    F(launch_coop, cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0)                  \
    F(launch_coop_ptsz, cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 1)        \
    F(graph_create, cuGraphCreate, "cuGraphCreate", 0)                                         \
    F(graph_add_kernel, cuGraphAddKernelNode_v2, "cuGraphAddKernelNode", 0)                    \
    F(graph_instantiate, cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 0)        \
    F(graph_launch, cuGraphLaunch, "cuGraphLaunch", 0)                                         \
    F(graph_launch_ptsz, cuGraphLaunch_ptsz, "cuGraphLaunch", 1)                               \
    F(event_create, cuEventCreate, "cuEventCreate", 0)                                         \
    F(event_record, cuEventRecord, "cuEventRecord", 0)                                         \
    F(event_record_ptsz, cuEventRecord_ptsz, "cuEventRecord", 1)                               \
    F(event_sync, cuEventSynchronize, "cuEventSynchronize", 0)                                 \
    F(event_query, cuEventQuery, "cuEventQuery", 0)                                            \
    F(error_name, cuGetErrorName, "cuGetErrorName", 0)                                         \
    F(export_table, cuGetExportTable, "cuGetExportTable", 0)


#define SHIM_FIELD(field, sym, base, ptds) void *field;
static struct {
    SHIM_API(SHIM_FIELD)
} api_raw;
static void *g_lib;

/* The driver's own entry point: libc's dlsym, asked by version, skips the shim's override. */
static inline void *real_sym(const char *name) {
    void *(*libc_dlsym)(void *, const char *) = (void *(*)(void *, const char *))dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34");
    if (!libc_dlsym) libc_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.2.5");
    void *p = libc_dlsym ? libc_dlsym(g_lib, name) : NULL;
    if (!p) {
        fprintf(stderr, "no %s\n", name);
        exit(3);
    }
    return p;
}

typedef CUresult (*shim_getproc_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

/* Resolve every entry point the chosen way. Missing ones stay NULL. */
static inline void shim_load(const char *mode) {
    int global = strcmp(mode, "default") == 0;
    g_lib = dlopen("libcuda.so.1", RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
    if (!g_lib) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        exit(3);
    }
    shim_getproc_t gp = (shim_getproc_t)dlsym(g_lib, "cuGetProcAddress_v2");
#define SHIM_RESOLVE(field, sym, base, ptds)                                                  \
    if (strcmp(mode, "getproc") == 0 && gp) {                                                  \
        CUdriverProcAddressQueryResult st_;                                                    \
        if (gp(base, &api_raw.field, 12080,                                                    \
               (ptds) ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT, \
               &st_) != CUDA_SUCCESS)                                                          \
            api_raw.field = NULL;                                                              \
    } else {                                                                                   \
        api_raw.field = dlsym(global ? RTLD_DEFAULT : g_lib, #sym);                            \
    }
    SHIM_API(SHIM_RESOLVE)
}

/* Typed calls: C(field, type of the legacy entry point)(args). */
#define C(field, proto) ((__typeof__(proto) *)api_raw.field)

#define CK(call)                                                                               \
    do {                                                                                       \
        CUresult ck_rc_ = (call);                                                              \
        if (ck_rc_ != CUDA_SUCCESS) {                                                          \
            fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #call, (int)ck_rc_);      \
            exit(10);                                                                          \
        }                                                                                      \
    } while (0)

static inline double shim_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* cuInit, then device `ordinal`'s primary context, current. */
static inline CUdevice shim_start(const char *mode, int ordinal) {
    shim_load(mode);
    CUdevice dev;
    CUcontext ctx;
    CK(C(init, cuInit)(0));
    CK(C(device_get, cuDeviceGet)(&dev, ordinal));
    CK(C(retain, cuDevicePrimaryCtxRetain)(&ctx, dev));
    CK(C(set_current, cuCtxSetCurrent)(ctx));
    return dev;
}

#endif
