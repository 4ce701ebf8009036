/* Modules take device memory: their code and variables, in the context they are loaded into
 * (a library's, in each context that uses it). The driver accounts it to the process, not to
 * any allocation the shim sees, so each call that can make the driver load module memory into
 * the current context is measured across like a context's growth (ctx.c: vgpu_growth_*) and
 * the growth charged to the context; over the limit the load is undone and refused.
 *
 * Not the launch path: with lazy loading (CUDA_MODULE_LOADING=LAZY, the default) a kernel's
 * code is loaded at its first launch, and measuring launches would put an NVML process list on
 * the hot path. Such code, and a library first used in a context by a launch, is settled at
 * the next allocation or view instead (ctx.c, vgpu_code_settle; docs/contracts.md). */
#include "shim.h"

#define NEED VGPU_NEED

/* One measured call: `call` is the driver's, `undo` gives back what it made (NULL: nothing
 * can be undone, the refusal only reports it). */
#define MEASURED(call, undo, what)                                                             \
    do {                                                                                       \
        if (LIKELY(!vgpu.limited)) return (call);                                              \
        CUcontext ctx_ = NULL;                                                                 \
        struct vgpu_dev *d_ = vgpu_growth_begin(&ctx_);                                        \
        if (!d_) return (call); /* no context (the driver refuses) or not accounted */         \
        CUresult rc_ = (call);                                                                 \
        if (vgpu_growth_end(d_, ctx_, rc_, what) != 0) {                                       \
            undo;                                                                              \
            rc_ = CUDA_ERROR_OUT_OF_MEMORY;                                                    \
        }                                                                                      \
        return rc_;                                                                            \
    } while (0)

static void unload_module(CUmodule *m) {
    if (vgpu.real.cuModuleUnload && *m) vgpu.real.cuModuleUnload(*m);
    *m = NULL;
}

static void unload_library(CUlibrary *l) {
    if (vgpu.real.cuLibraryUnload && *l) vgpu.real.cuLibraryUnload(*l);
    *l = NULL;
}

VGPU_API CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    NEED(cuModuleLoad);
    MEASURED(vgpu.real.cuModuleLoad(module, fname), unload_module(module), "a module");
}

VGPU_API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    NEED(cuModuleLoadData);
    MEASURED(vgpu.real.cuModuleLoadData(module, image), unload_module(module), "a module");
}

VGPU_API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                     CUjit_option *options, void **optionValues) {
    NEED(cuModuleLoadDataEx);
    MEASURED(vgpu.real.cuModuleLoadDataEx(module, image, numOptions, options, optionValues),
             unload_module(module), "a module");
}

VGPU_API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    NEED(cuModuleLoadFatBinary);
    MEASURED(vgpu.real.cuModuleLoadFatBinary(module, fatCubin), unload_module(module), "a module");
}

/* A library's module in the current context (eager loading puts it there at load time). */
VGPU_API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                    void **jitOptionsValues, unsigned int numJitOptions,
                                    CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                    unsigned int numLibraryOptions) {
    NEED(cuLibraryLoadData);
    MEASURED(vgpu.real.cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions,
                                         libraryOptions, libraryOptionValues, numLibraryOptions),
             unload_library(library), "a library");
}

VGPU_API CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                        CUjit_option *jitOptions, void **jitOptionsValues,
                                        unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                        void **libraryOptionValues, unsigned int numLibraryOptions) {
    NEED(cuLibraryLoadFromFile);
    MEASURED(vgpu.real.cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues,
                                             numJitOptions, libraryOptions, libraryOptionValues,
                                             numLibraryOptions),
             unload_library(library), "a library");
}

/* Unloading gives the module's memory back to the driver: the next allocation or view
 * settles the process's charge to what the driver then holds (ctx.c). */
VGPU_API CUresult cuModuleUnload(CUmodule hmod) {
    NEED(cuModuleUnload);
    CUresult rc = vgpu.real.cuModuleUnload(hmod);
    if (rc == CUDA_SUCCESS && vgpu.limited) vgpu_code_due(1);
    return rc;
}

VGPU_API CUresult cuLibraryUnload(CUlibrary library) {
    NEED(cuLibraryUnload);
    CUresult rc = vgpu.real.cuLibraryUnload(library);
    if (rc == CUDA_SUCCESS && vgpu.limited) vgpu_code_due(1);
    return rc;
}

/* A library's first use in a context loads its module there; the driver has no call to take
 * that one module back, so over the limit the call is refused and the memory stays (the
 * refusal is logged with the limit) until the library is unloaded or the context goes. */
VGPU_API CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library) {
    NEED(cuLibraryGetModule);
    MEASURED(vgpu.real.cuLibraryGetModule(pMod, library), (void)0, "a library's module");
}

VGPU_API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    NEED(cuKernelGetFunction);
    MEASURED(vgpu.real.cuKernelGetFunction(pFunc, kernel), (void)0, "a library's module");
}

VGPU_API CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library,
                                     const char *name) {
    NEED(cuLibraryGetGlobal);
    MEASURED(vgpu.real.cuLibraryGetGlobal(dptr, bytes, library, name), (void)0, "a library's module");
}

VGPU_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    NEED(cuModuleGetFunction);
    MEASURED(vgpu.real.cuModuleGetFunction(hfunc, hmod, name), (void)0, "a module's function");
}
