/* Modules, libraries, functions, module variables and kernel launches.
 *
 * How long a kernel runs (documented in native/simgpu/README.md):
 * - a simgpu module image is text: a first line "simgpu-module 1", then lines
 *   "kernel <name> <duration>" where duration is a number with an optional unit (ns, us, ms,
 *   s; microseconds when bare), '#' starts a comment;
 * - the built-in kernel "simgpu_sleep", found in every module, runs for its first parameter
 *   (a uint64_t count of nanoseconds);
 * - any other kernel takes SIM_DEFAULT_KERNEL_NS per launch.
 *
 * A cubin, or a fat binary with a cubin for the device (cuda_image.c), is read: its kernels
 * are found by name (others: CUDA_ERROR_NOT_FOUND) and its variables (__device__,
 * __constant__) get device memory initialised from the image, charged with its code on the
 * GPU, in each context that loads it: a module at load, a library (context-independent) on
 * first use in a context (cuKernelGetFunction, cuLibraryGetGlobal, a launch), as the driver
 * loads lazily. PTX and anything else unreadable load as opaque modules where every kernel
 * name resolves and no variable exists. Kernels compute nothing. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_image.h"
#include "cuda_internal.h"

#define SIM_IMAGE_MAGIC "simgpu-module"

/* --- functions --------------------------------------------------------------------------- */

static struct CUfunc_st *func_add_locked(struct CUmod_st *m, const char *name, uint64_t cost_ns, int kidx) {
    if (m->nfunc == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 8;
        struct CUfunc_st **v = realloc(m->funcs, cap * sizeof *v);
        if (!v) return NULL;
        m->funcs = v;
        m->cap = cap;
    }
    struct CUfunc_st *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->magic = SIM_FUNC_MAGIC;
    f->mod = m;
    f->kidx = kidx;
    f->cost_ns = cost_ns;
    f->builtin_sleep = strcmp(name, SIM_BUILTIN_SLEEP) == 0;
    snprintf(f->name, sizeof f->name, "%s", name);
    m->funcs[m->nfunc++] = f;
    return f;
}

static struct CUfunc_st *func_find_locked(struct CUmod_st *m, const char *name) {
    for (size_t i = 0; i < m->nfunc; i++)
        if (strcmp(m->funcs[i]->name, name) == 0) return m->funcs[i];
    int k = m->img ? sim_image_kernel(m->img, name) : -1;
    if (strcmp(name, SIM_BUILTIN_SLEEP) == 0 || m->opaque || k >= 0) return func_add_locked(m, name, SIM_DEFAULT_KERNEL_NS, k);
    return NULL;
}

static int func_valid(const struct CUfunc_st *f) { return f && f->magic == SIM_FUNC_MAGIC; }

/* --- module images ----------------------------------------------------------------------- */

/* "250", "250us", "3ms", "1.5s", "800ns" -> ns; -1 on anything else. */
static int64_t parse_duration(const char *s) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || v < 0) return -1;
    double scale = 1e3;
    if (*end == 0 || strcmp(end, "us") == 0) scale = 1e3;
    else if (strcmp(end, "ns") == 0) scale = 1;
    else if (strcmp(end, "ms") == 0) scale = 1e6;
    else if (strcmp(end, "s") == 0) scale = 1e9;
    else return -1;
    double ns = v * scale;
    return ns > 9e18 ? -1 : (int64_t)ns;
}

static CUresult parse_image_locked(struct CUmod_st *m, const char *text) {
    char line[512];
    int first = 1;
    for (const char *p = text; *p;) {
        size_t n = strcspn(p, "\n");
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), p);
        p += n + (p[n] == '\n');
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char kw[32], name[sizeof m->funcs[0]->name], dur[64], extra[8];
        int k = sscanf(line, "%31s %127s %63s %7s", kw, name, dur, extra);
        if (k <= 0) continue;
        if (first) {
            if (strcmp(kw, SIM_IMAGE_MAGIC) != 0 || k != 2 || strcmp(name, "1") != 0) return CUDA_ERROR_INVALID_IMAGE;
            first = 0;
            continue;
        }
        int64_t ns = k == 3 ? parse_duration(dur) : -1;
        if (strcmp(kw, "kernel") != 0 || ns < 0) return CUDA_ERROR_INVALID_IMAGE;
        struct CUfunc_st *f = NULL;
        for (size_t i = 0; i < m->nfunc; i++)
            if (strcmp(m->funcs[i]->name, name) == 0) f = m->funcs[i];
        if (!f) f = func_add_locked(m, name, (uint64_t)ns, -1);
        if (!f) return CUDA_ERROR_OUT_OF_MEMORY;
        f->cost_ns = (uint64_t)ns; /* a later line for the same name wins */
    }
    return first ? CUDA_ERROR_INVALID_IMAGE : CUDA_SUCCESS;
}

static void inst_free_locked(struct sim_modinst *in) {
    sim_alloc_destroy_locked(in->mem);
    free(in->loaded);
    free(in);
}

/* CUDA_MODULE_LOADING=EAGER loads a module's kernels with it; otherwise (LAZY, the driver's
 * default since CUDA 12.2) each kernel's code is loaded at its first launch in a context. */
static int eager_loading(void) {
    static int eager = -1;
    if (__atomic_load_n(&eager, __ATOMIC_RELAXED) < 0) {
        const char *e = getenv("CUDA_MODULE_LOADING");
        __atomic_store_n(&eager, e && strcmp(e, "EAGER") == 0, __ATOMIC_RELAXED);
    }
    return eager;
}

int sim_module_loading_eager(void) { return eager_loading(); }

/* m's variables in ctx: made (charged, initialised) on first use there, with the code the
 * image takes beyond its kernels (all of it when loading is eager). */
static CUresult inst_locked(struct CUmod_st *m, struct CUctx_st *ctx, struct sim_modinst **out) {
    *out = NULL;
    if (!m->img) return CUDA_SUCCESS; /* nothing read: nothing to place */
    for (struct sim_modinst *in = m->inst; in; in = in->next)
        if (in->ctx == ctx) {
            *out = in;
            return CUDA_SUCCESS;
        }
    struct sim_modinst *in = calloc(1, sizeof *in);
    if (!in || !(in->loaded = calloc(m->img->nkern + 1, 1))) {
        free(in);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t charge = m->img->device_bytes;
    if (!eager_loading())
        for (size_t k = 0; k < m->img->nkern; k++) charge -= m->img->kernel_bytes[k];
    else
        memset(in->loaded, 1, m->img->nkern);
    CUresult rc = sim_module_mem_locked(ctx, m->img->globals_size, m->img->init, charge, &in->mem);
    if (rc != CUDA_SUCCESS) {
        free(in->loaded);
        free(in);
        return rc;
    }
    in->ctx = ctx;
    in->next = m->inst;
    m->inst = in;
    *out = in;
    return CUDA_SUCCESS;
}

static void module_free_locked(struct CUmod_st *m) {
    while (m->inst) {
        struct sim_modinst *in = m->inst;
        m->inst = in->next;
        inst_free_locked(in);
    }
    sim_image_free(m->img);
    for (size_t i = 0; i < m->nfunc; i++) {
        m->funcs[i]->magic = 0;
        free(m->funcs[i]);
    }
    free(m->funcs);
    m->magic = 0;
    free(m);
}

/* Read a GPU image for the device of `ctx` (a library: the current context's, else ordinal 0's).
 * lazy: loaded as the driver loads libraries and the runtime's fat binaries, lazily, so one with
 * nothing for this GPU loads (cuBLAS carries kernels for every architecture) and fails where it
 * would be used here (CUDA_ERROR_NO_BINARY_FOR_GPU); eager, cuModuleLoad* refuses it at once. */
static CUresult read_gpu_image(struct CUmod_st *m, const void *image, struct CUctx_st *ctx, int lazy) {
    uint32_t phys = 0;
    struct CUctx_st *cur = NULL;
    if (ctx) phys = ctx->phys;
    else if (sim_current(&cur) == CUDA_SUCCESS) phys = cur->phys;
    else if (sim_device(0, &phys) != CUDA_SUCCESS) return CUDA_ERROR_NO_DEVICE;
    const struct simgpu_gpu_config *cfg = &simgpu_node()->gpus[phys].cfg;
    enum sim_image_status st = sim_image_read(image, (int)(cfg->cc_major * 10 + cfg->cc_minor), &m->img);
    if (st == SIM_IMAGE_NO_BINARY && lazy) {
        if (!m->img && !(m->img = calloc(1, sizeof *m->img))) return CUDA_ERROR_OUT_OF_MEMORY;
        m->img->foreign = 1;
        return CUDA_SUCCESS;
    }
    if (st != SIM_IMAGE_READ) {
        sim_image_free(m->img);
        m->img = NULL;
    }
    if (sim_trace() && st != SIM_IMAGE_READ && st != SIM_IMAGE_OPAQUE && !(st == SIM_IMAGE_NO_BINARY && lazy))
        fprintf(stderr, "simgpu: a GPU image refused (%s for sm_%d%d)\n",
                st == SIM_IMAGE_NO_BINARY ? "no cubin or PTX" : "malformed", (int)cfg->cc_major, (int)cfg->cc_minor);
    switch (st) {
    case SIM_IMAGE_READ: return CUDA_SUCCESS;
    case SIM_IMAGE_OPAQUE:
        m->opaque = 1; /* unreadable: nothing to learn from it */
        if (sim_trace()) fprintf(stderr, "simgpu: a module image not read (unknown bytes, or compressed with Zstandard and no libzstd.so.1): any kernel name resolves\n");
        return CUDA_SUCCESS;
    case SIM_IMAGE_NO_BINARY: return CUDA_ERROR_NO_BINARY_FOR_GPU;
    case SIM_IMAGE_NOMEM: return CUDA_ERROR_OUT_OF_MEMORY;
    default: return CUDA_ERROR_INVALID_IMAGE;
    }
}

/* ctx NULL: a library. A module's variables take their memory in its context at once. */
static CUresult module_load(struct CUmod_st **out, const void *image, struct CUctx_st *ctx, int lazy) {
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = SIM_MOD_MAGIC;
    m->ctx = ctx;
    const char *text = image;
    while (*text == ' ' || *text == '\t' || *text == '\n' || *text == '\r') text++;
    int sim_text = strncmp(text, SIM_IMAGE_MAGIC, strlen(SIM_IMAGE_MAGIC)) == 0;
    CUresult rc = sim_text ? CUDA_SUCCESS : read_gpu_image(m, image, ctx, lazy);
    if (rc != CUDA_SUCCESS) {
        free(m);
        return rc;
    }
    sim_lock();
    if (sim_text) rc = parse_image_locked(m, text);
    struct sim_modinst *in;
    if (rc == CUDA_SUCCESS && ctx && !(m->img && m->img->foreign)) rc = inst_locked(m, ctx, &in);
    if (rc == CUDA_SUCCESS) {
        m->next = sim_proc.modules;
        sim_proc.modules = m;
        *out = m;
    } else {
        module_free_locked(m);
    }
    sim_unlock();
    return rc;
}

static CUresult read_file(const char *path, char **out) {
    if (!path) return CUDA_ERROR_INVALID_VALUE;
    FILE *f = fopen(path, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
        n += got;
        if (n + 1 == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) free(buf);
            buf = b;
        }
    }
    fclose(f);
    if (!buf) return CUDA_ERROR_OUT_OF_MEMORY;
    buf[n] = 0;
    *out = buf;
    return CUDA_SUCCESS;
}

static CUresult ctx_module_load(CUmodule *module, const void *image, int lazy) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    return rc != CUDA_SUCCESS ? rc : module_load(module, image, c, lazy);
}

CUresult sim_module_load_current(CUmodule *module, const void *image) { return ctx_module_load(module, image, 1); }

CUresult cuModuleLoadData(CUmodule *module, const void *image) { return ctx_module_load(module, image, 0); }
CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) { return ctx_module_load(module, fatCubin, 0); }

/* JIT options do not matter to a simulator. */
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                            void **optionValues) {
    if (numOptions && (!options || !optionValues)) return CUDA_ERROR_INVALID_VALUE;
    return ctx_module_load(module, image, 0);
}

CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c);
    char *text = NULL;
    if (rc == CUDA_SUCCESS) rc = read_file(fname, &text);
    if (rc == CUDA_SUCCESS) rc = module_load(module, text, c, 0);
    free(text);
    return rc;
}

static CUresult module_unload(struct CUmod_st *m, int library) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    sim_lock();
    struct CUmod_st **link = &sim_proc.modules;
    while (*link && *link != m) link = &(*link)->next;
    if (*link && (m->ctx == NULL) == library) {
        *link = m->next;
        module_free_locked(m);
    } else {
        rc = CUDA_ERROR_INVALID_HANDLE;
    }
    sim_unlock();
    return rc;
}

CUresult cuModuleUnload(CUmodule hmod) { return module_unload(hmod, 0); }

void sim_module_free_ctx_locked(struct CUctx_st *ctx) {
    for (struct CUmod_st **link = &sim_proc.modules; *link;) {
        struct CUmod_st *m = *link;
        if (m->ctx == ctx) {
            *link = m->next;
            module_free_locked(m);
            continue;
        }
        for (struct sim_modinst **il = &m->inst; *il;) { /* a library loaded in ctx */
            struct sim_modinst *in = *il;
            if (in->ctx == ctx) {
                *il = in->next;
                inst_free_locked(in);
            } else {
                il = &in->next;
            }
        }
        link = &m->next;
    }
}

static CUresult get_function(struct CUfunc_st **out, struct CUmod_st *m, const char *name) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != SIM_MOD_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    sim_lock();
    struct CUfunc_st *f = func_find_locked(m, name);
    sim_unlock();
    if (!f && sim_trace()) fprintf(stderr, "simgpu: kernel %s not in its image\n", name);
    if (!f) return CUDA_ERROR_NOT_FOUND;
    *out = f;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    return get_function(hfunc, hmod, name);
}

/* --- libraries: context-independent modules; a CUkernel is the same object as a CUfunction -- */

static CUresult library_load(CUlibrary *library, const void *code, unsigned int numJit, CUjit_option *jit, void **jitv,
                             unsigned int numLib, CUlibraryOption *lib, void **libv) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if ((numJit && (!jit || !jitv)) || (numLib && !lib)) return CUDA_ERROR_INVALID_VALUE;
    /* CU_LIBRARY_BINARY_IS_PRESERVED (1) is a flag with no value: cuBLAS 13 passes it with a NULL
     * values array for its cubins. Only the host table option (0) reads a value. */
    for (unsigned int i = 0; i < numLib; i++)
        if ((int)lib[i] == 0 && !libv) return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m = NULL;
    rc = module_load(&m, code, NULL, 1);
    if (rc == CUDA_SUCCESS) *library = (CUlibrary)(void *)m;
    return rc;
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                           unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions) {
    if (!library) return CUDA_ERROR_INVALID_VALUE;
    return library_load(library, code, numJitOptions, jitOptions, jitOptionsValues, numLibraryOptions, libraryOptions,
                        libraryOptionValues);
}

CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                               void **libraryOptionValues, unsigned int numLibraryOptions) {
    if (!library) return CUDA_ERROR_INVALID_VALUE;
    char *text = NULL;
    CUresult rc = read_file(fileName, &text);
    if (rc == CUDA_SUCCESS)
        rc = library_load(library, text, numJitOptions, jitOptions, jitOptionsValues, numLibraryOptions,
                          libraryOptions, libraryOptionValues);
    free(text);
    return rc;
}

CUresult cuLibraryUnload(CUlibrary library) { return module_unload((struct CUmod_st *)(void *)library, 1); }

CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    struct CUfunc_st *f = NULL;
    struct CUmod_st *m = (struct CUmod_st *)(void *)library;
    if (m && m->magic == SIM_MOD_MAGIC && m->ctx) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = get_function(&f, m, name);
    if (rc == CUDA_SUCCESS) *pKernel = (CUkernel)(void *)f;
    return rc;
}

/* The library's module in the current context: it loads there now (CUDA_ERROR_NO_BINARY_FOR_GPU
 * when it has no code for this GPU). The handle is the library's own. */
CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary library) {
    struct CUmod_st *m = (struct CUmod_st *)(void *)library;
    struct CUctx_st *c;
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!pMod) return CUDA_ERROR_INVALID_VALUE;
    if (!m || m->magic != SIM_MOD_MAGIC || m->ctx) return CUDA_ERROR_INVALID_HANDLE;
    if ((rc = sim_current(&c)) != CUDA_SUCCESS) return rc;
    struct sim_modinst *in;
    sim_lock();
    rc = inst_locked(m, c, &in);
    sim_unlock();
    if (rc == CUDA_SUCCESS) *pMod = m;
    return rc;
}

CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    struct CUctx_st *c;
    CUresult rc = sim_current(&c); /* the function is the kernel's form in the current context */
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = (struct CUfunc_st *)(void *)kernel;
    if (!pFunc) return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(f)) return CUDA_ERROR_INVALID_HANDLE;
    struct sim_modinst *in;
    sim_lock();
    if (!f->mod->ctx) rc = inst_locked(f->mod, c, &in); /* the library loads in this context */
    sim_unlock();
    if (rc == CUDA_SUCCESS) *pFunc = f;
    return rc;
}

/* The library a kernel comes from (a module's function is no library's kernel). */
CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUfunc_st *f = (struct CUfunc_st *)(void *)kernel;
    if (!pLib) return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(f) || f->mod->ctx) return CUDA_ERROR_INVALID_HANDLE;
    *pLib = (CUlibrary)(void *)f->mod;
    return CUDA_SUCCESS;
}

/* --- module variables ------------------------------------------------------------------------ */

/* A module's variables live in its context; a library's in the current context, where it loads
 * on first use. dptr and bytes are optional, as documented. */
static CUresult get_global(CUdeviceptr *dptr, size_t *bytes, struct CUmod_st *m, const char *name, int library) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!m || m->magic != SIM_MOD_MAGIC || (library && m->ctx)) return CUDA_ERROR_INVALID_HANDLE;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = m->ctx;
    if (!c && (rc = sim_current(&c)) != CUDA_SUCCESS) return rc;
    sim_lock();
    const struct sim_image_global *g = m->img ? sim_image_global(m->img, name) : NULL;
    struct sim_modinst *in = NULL;
    rc = g ? inst_locked(m, c, &in) : CUDA_ERROR_NOT_FOUND;
    if (rc == CUDA_SUCCESS) {
        if (dptr) *dptr = (CUdeviceptr)(in->mem->base + g->off);
        if (bytes) *bytes = g->size;
    }
    sim_unlock();
    if (rc != CUDA_SUCCESS && sim_trace())
        fprintf(stderr, "simgpu: global %s of a %s: %d%s\n", name, m->ctx ? "module" : "library", (int)rc,
                m->img && m->img->foreign ? " (no code for this GPU)" : m->opaque ? " (image not read)" : "");
    return rc;
}

CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod, const char *name) {
    return get_global(dptr, bytes, hmod, name, 0);
}

/* The 32-bit form: an address that does not fit cannot be given. */
CUresult cuModuleGetGlobal(CUdeviceptr_v1 *dptr, unsigned int *bytes, CUmodule hmod, const char *name) {
    CUdeviceptr p = 0;
    size_t n = 0;
    CUresult rc = get_global(&p, &n, hmod, name, 0);
    if (rc == CUDA_SUCCESS && (p > UINT32_MAX || n > UINT32_MAX)) rc = CUDA_ERROR_INVALID_VALUE;
    if (rc != CUDA_SUCCESS) return rc;
    if (dptr) *dptr = (CUdeviceptr_v1)p;
    if (bytes) *bytes = (unsigned int)n;
    return rc;
}

CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name) {
    return get_global(dptr, bytes, (struct CUmod_st *)(void *)library, name, 1);
}

/* --- function attributes ----------------------------------------------------------------- */

CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!pi || (int)attrib < 0 || attrib >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = 49152; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = -1; break;
    default: *pi = 0;
    }
    return CUDA_SUCCESS;
}

/* Accepted and not modelled: they change no simulated duration. */
CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
    (void)value;
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)attrib < 0 || attrib >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    return func_valid(hfunc) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)config < CU_FUNC_CACHE_PREFER_NONE || config > CU_FUNC_CACHE_PREFER_EQUAL) return CUDA_ERROR_INVALID_VALUE;
    return func_valid(hfunc) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult cuFuncGetName(const char **name, CUfunction hfunc) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!func_valid(hfunc)) return CUDA_ERROR_INVALID_HANDLE;
    *name = hfunc->name;
    return CUDA_SUCCESS;
}

/* --- launches ---------------------------------------------------------------------------- */

CUresult sim_launch_duration(struct CUfunc_st *f, void **params, void **extra, uint64_t *dur_ns) {
    if (!f->builtin_sleep) {
        *dur_ns = f->cost_ns;
        return CUDA_SUCCESS;
    }
    if (params && params[0]) {
        memcpy(dur_ns, params[0], sizeof *dur_ns);
        return CUDA_SUCCESS;
    }
    /* The packed form: CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size. */
    const void *buf = NULL;
    size_t size = 0;
    for (size_t i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
        if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
        else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1]) size = *(size_t *)extra[i + 1];
        else return CUDA_ERROR_INVALID_VALUE;
    }
    if (!buf || size < sizeof *dur_ns) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dur_ns, buf, sizeof *dur_ns);
    return CUDA_SUCCESS;
}

struct launch {
    struct CUfunc_st *f;
    unsigned int grid[3], block[3], shmem;
    CUstream stream;
    void **params, **extra;
    int cooperative;
};

static CUresult launch(const struct launch *l, int ptds) {
    CUresult rc = sim_ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!func_valid(l->f)) return CUDA_ERROR_INVALID_HANDLE;
    const unsigned int *g = l->grid, *b = l->block;
    if (!g[0] || !g[1] || !g[2] || !b[0] || !b[1] || !b[2] || g[1] > 65535 || g[2] > 65535 || b[0] > 1024 ||
        b[1] > 1024 || b[2] > 64 || (uint64_t)b[0] * b[1] * b[2] > 1024 || l->shmem > 232448 || (l->params && l->extra))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t dur = 0;
    rc = sim_launch_duration(l->f, l->params, l->extra, &dur);
    if (rc != CUDA_SUCCESS) return rc;
    struct CUctx_st *c;
    struct CUstream_st *s;
    sim_lock();
    rc = sim_stream_get(l->stream, ptds, &c, &s);
    if (rc == CUDA_SUCCESS && l->f->mod->ctx && l->f->mod->ctx != c) rc = CUDA_ERROR_INVALID_HANDLE;
    struct sim_modinst *in = NULL; /* a library's kernel loads in c now; one with no code here fails */
    if (rc == CUDA_SUCCESS) rc = l->f->mod->img && l->f->mod->img->foreign ? CUDA_ERROR_NO_BINARY_FOR_GPU
                                                                           : inst_locked(l->f->mod, c, &in);
    if (rc == CUDA_SUCCESS && in && l->f->kidx >= 0 && !in->loaded[l->f->kidx]) { /* lazy: its code now */
        uint64_t code = l->f->mod->img->kernel_bytes[l->f->kidx];
        if (code && simgpu_mem_charge(c->phys, code) != 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
        if (rc == CUDA_SUCCESS) {
            in->mem->charged += code; /* given back with the module's memory */
            in->loaded[l->f->kidx] = 1;
        }
    }
    /* Every block of a cooperative grid must be resident at once. */
    if (rc == CUDA_SUCCESS && l->cooperative &&
        (uint64_t)g[0] * g[1] * g[2] > (uint64_t)simgpu_node()->gpus[c->phys].cfg.sm_count * 32)
        rc = CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
    if (rc == CUDA_SUCCESS) rc = s->capture ? sim_capture_kernel_locked(s, l->f, dur) : sim_submit_kernel_locked(c, s, dur);
    sim_unlock();
    return rc;
}

#define LAUNCH(f, gx, gy, gz, bx, by, bz, sh, st, p, x, coop) \
    (&(struct launch){(f), {(gx), (gy), (gz)}, {(bx), (by), (bz)}, (sh), (st), (p), (x), (coop)})

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int sh, CUstream st, void **p, void **x) {
    return launch(LAUNCH(f, gx, gy, gz, bx, by, bz, sh, st, p, x, 0), 0);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                             unsigned int by, unsigned int bz, unsigned int sh, CUstream st, void **p, void **x) {
    return launch(LAUNCH(f, gx, gy, gz, bx, by, bz, sh, st, p, x, 0), 1);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                   unsigned int by, unsigned int bz, unsigned int sh, CUstream st, void **p) {
    return launch(LAUNCH(f, gx, gy, gz, bx, by, bz, sh, st, p, NULL, 1), 0);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int sh,
                                        CUstream st, void **p) {
    return launch(LAUNCH(f, gx, gy, gz, bx, by, bz, sh, st, p, NULL, 1), 1);
}

/* Attributes other than cooperative change nothing the simulator measures. */
static CUresult launch_ex(const CUlaunchConfig *cfg, CUfunction f, void **p, void **x, int ptds) {
    if (!cfg || (cfg->numAttrs && !cfg->attrs)) return CUDA_ERROR_INVALID_VALUE;
    int coop = 0;
    for (unsigned int i = 0; i < cfg->numAttrs; i++)
        if (cfg->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE) coop = cfg->attrs[i].value.cooperative != 0;
    return launch(LAUNCH(f, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY,
                         cfg->blockDimZ, cfg->sharedMemBytes, cfg->hStream, p, x, coop),
                  ptds);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    return launch_ex(config, f, kernelParams, extra, 0);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    return launch_ex(config, f, kernelParams, extra, 1);
}

/* Entry points cuGetProcAddress hands out (cuda_internal.h, SIM_SELF). */
SIM_SELF(cuFuncGetAttribute)
SIM_SELF(cuFuncGetName)
SIM_SELF(cuFuncSetAttribute)
SIM_SELF(cuFuncSetCacheConfig)
SIM_SELF(cuKernelGetFunction)
SIM_SELF(cuKernelGetLibrary)
SIM_SELF(cuLaunchCooperativeKernel)
SIM_SELF(cuLaunchCooperativeKernel_ptsz)
SIM_SELF(cuLaunchKernel)
SIM_SELF(cuLaunchKernelEx)
SIM_SELF(cuLaunchKernelEx_ptsz)
SIM_SELF(cuLaunchKernel_ptsz)
SIM_SELF(cuLibraryGetGlobal)
SIM_SELF(cuLibraryGetKernel)
SIM_SELF(cuLibraryGetModule)
SIM_SELF(cuLibraryLoadData)
SIM_SELF(cuLibraryLoadFromFile)
SIM_SELF(cuLibraryUnload)
SIM_SELF(cuModuleGetFunction)
SIM_SELF(cuModuleGetGlobal)
SIM_SELF(cuModuleGetGlobal_v2)
SIM_SELF(cuModuleLoad)
SIM_SELF(cuModuleLoadData)
SIM_SELF(cuModuleLoadDataEx)
SIM_SELF(cuModuleLoadFatBinary)
SIM_SELF(cuModuleUnload)
