/* Loading and dispatch: nothing happens while the process does not use the GPU.
 *
 * The shim is preloaded into every process of a container, and most of them never touch
 * CUDA. So there is no constructor, no thread and no file opened at load time. Two loads,
 * each once: the limits (config, log level), read by the first hook of either kind; and
 * libcuda, for the first CUDA hook (or a dlsym/cuGetProcAddress lookup of a hooked CUDA
 * name), which dlopen()s the real libcuda.so.1 and resolves the real entry points on that
 * handle (a handle lookup searches libcuda and its dependencies only, so it can never resolve
 * to the shim). An NVML hook needs only the limits and libnvidia-ml.so.1 (loaded when an NVML
 * hook runs or a context is measured): nvidia-smi or a monitoring agent never maps libcuda. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"

/* The one process-wide state (see shim.h). All zero (so in .bss: nothing to map or relocate
 * in the many processes that never use it); the level of logging is set by the load. */
struct vgpu_state vgpu = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* --- the hook table -------------------------------------------------------------------------
 * Sorted by name once, searched by name (dlsym) and by real pointer (cuGetProcAddress). */

/* Filled by code at the first lookup rather than initialised statically: a static table of
 * pointers would cost every process ~150 load-time relocations and a copied page, and most
 * processes never look anything up. */
#define VGPU_HOOK_ONE(n) +1
enum { N_HOOKS = 0 VGPU_CUDA_HOOKS(VGPU_HOOK_ONE) VGPU_NVML_HOOKS(VGPU_HOOK_ONE) };
static struct vgpu_hook g_hooks[N_HOOKS];

/* Sorted by name once, for the lookups' binary search: a Shell sort here rather than qsort,
 * since every import costs every process a relocation at load. */
static void sort_hooks(void) {
    static const size_t gaps[] = {301, 132, 57, 23, 10, 4, 1};
    for (size_t g = 0; g < sizeof gaps / sizeof gaps[0]; g++) {
        for (size_t i = gaps[g]; i < N_HOOKS; i++) {
            struct vgpu_hook h = g_hooks[i];
            size_t j = i;
            for (; j >= gaps[g] && strcmp(g_hooks[j - gaps[g]].name, h.name) > 0; j -= gaps[g])
                g_hooks[j] = g_hooks[j - gaps[g]];
            g_hooks[j] = h;
        }
    }
}

/* A hook's own address. `&n` of an exported function is read from a GOT entry, and each such
 * entry costs every process a relocation at load (the linker does not relax them here); on
 * x86-64 the address is computed instead (the hooks bind locally: -Bsymbolic-functions). */
#if defined(__x86_64__)
#define HOOK_ADDR(n)                                                                           \
    ({                                                                                         \
        void *p_;                                                                              \
        __asm__("leaq " #n "(%%rip), %0" : "=r"(p_));                                          \
        p_;                                                                                    \
    })
#else
#define HOOK_ADDR(n) ((void *)&n)
#endif
#define VGPU_HOOK_CUDA(n) g_hooks[i++] = (struct vgpu_hook){#n, HOOK_ADDR(n), (void **)&vgpu.real.n, 0};
#define VGPU_HOOK_NVML(n) g_hooks[i++] = (struct vgpu_hook){#n, HOOK_ADDR(n), (void **)&vgpu.real.n, 1};
static pthread_once_t g_hooks_once = PTHREAD_ONCE_INIT;
static void build_hooks(void) {
    size_t i = 0;
    VGPU_CUDA_HOOKS(VGPU_HOOK_CUDA)
    VGPU_NVML_HOOKS(VGPU_HOOK_NVML)
    sort_hooks();
}

const struct vgpu_hook *vgpu_hook_by_name(const char *name) {
    pthread_once(&g_hooks_once, build_hooks);
    size_t lo = 0, hi = N_HOOKS;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, g_hooks[mid].name);
        if (c == 0) return &g_hooks[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

void *vgpu_hook_for_real(void *real) {
    if (!real) return NULL;
    pthread_once(&g_hooks_once, build_hooks);
    for (size_t i = 0; i < N_HOOKS; i++)
        if (__atomic_load_n(g_hooks[i].real, __ATOMIC_ACQUIRE) == real) return g_hooks[i].hook;
    return NULL;
}

/* --- loading ------------------------------------------------------------------------------ */

/* While this thread loads, libcuda's own constructors may look symbols up: those lookups must
 * not wait for the load they are part of. */
static _Thread_local int t_loading VGPU_TLS;

static void resolve(void *handle, const char *name, void **slot, const void *hook) {
    void *p = vgpu_real_dlsym(handle, name);
    if (p == hook) p = NULL; /* never call ourselves: treat as missing */
    __atomic_store_n(slot, p, __ATOMIC_RELEASE);
}

#define VGPU_RESOLVE_HOOK(n) resolve(vgpu.cuda, #n, (void **)&vgpu.real.n, HOOK_ADDR(n));
#define VGPU_RESOLVE_USED(n) resolve(vgpu.cuda, #n, (void **)&vgpu.real.n, NULL);
#define VGPU_RESOLVE_NVML_HOOK(n) resolve(vgpu.nvml, #n, (void **)&vgpu.real.n, HOOK_ADDR(n));
#define VGPU_RESOLVE_NVML_USED(n) resolve(vgpu.nvml, #n, (void **)&vgpu.real.n, NULL);

/* The limits: everything the NVML hooks need. Reads files and envs only (no lookup that
 * could re-enter the shim), so it needs no t_loading. */
static void limits_once(void) {
    vgpu.log_level = vgpu_log_level();
    vgpu_config_load(&vgpu.cfg);
    vgpu.limited = vgpu.cfg.mode != VGPU_MODE_NONE;
    if (vgpu.cfg.mode == VGPU_MODE_ENV || vgpu.cfg.mode == VGPU_MODE_FILE) {
        int any = (vgpu.cfg.dflt.sm > 0 && vgpu.cfg.dflt.sm < 100) || vgpu.cfg.dflt.req > 0;
        for (int i = 0; i < vgpu.cfg.count; i++)
            any |= (vgpu.cfg.dev[i].sm > 0 && vgpu.cfg.dev[i].sm < 100) || vgpu.cfg.dev[i].req > 0;
        vgpu.pace_any = any;
    }
    VLOG(VGPU_LOG_DEBUG, "limits from %s, %d device record(s), pacing %s",
         vgpu.cfg.mode == VGPU_MODE_FILE ? "the limits file"
         : vgpu.cfg.mode == VGPU_MODE_ENV ? "the environment" : "nowhere (pass-through)",
         vgpu.cfg.count, vgpu.pace_any ? "on" : "off");
}

static pthread_once_t g_limits_once = PTHREAD_ONCE_INIT;

void vgpu_limits_slow(void) {
    pthread_once(&g_limits_once, limits_once);
    __atomic_store_n(&vgpu.limits_ready, 1, __ATOMIC_RELEASE);
}

static void load_once(void) {
    vgpu_ensure_limits(); /* first: the hooks read the limits as soon as `ready` is set */
    t_loading = 1;
    vgpu.cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (vgpu.cuda) {
        VGPU_CUDA_HOOKS(VGPU_RESOLVE_HOOK)
        VGPU_CUDA_USED(VGPU_RESOLVE_USED)
        /* Newer drivers' elapsed-time entry point; the legacy one has the same signature. */
        void *v2 = vgpu_real_dlsym(vgpu.cuda, "cuEventElapsedTime_v2");
        if (v2) vgpu.real.cuEventElapsedTime = (__typeof__(cuEventElapsedTime) *)v2;
        void *uuid2 = vgpu_real_dlsym(vgpu.cuda, "cuDeviceGetUuid_v2");
        if (uuid2) vgpu.real.cuDeviceGetUuid = (__typeof__(cuDeviceGetUuid) *)uuid2;
    } else {
        VLOG(VGPU_LOG_INFO, "libcuda.so.1 not loadable (%s): CUDA hooks report "
             "CUDA_ERROR_NOT_INITIALIZED", dlerror());
    }
    /* Everything the allocation and free hooks test, in one word (the real pointers and the
     * limits do not change after this). */
    vgpu.mem_hot_on = vgpu.limited && vgpu.real.cuMemAlloc_v2 && vgpu.real.cuMemFree_v2 &&
                      vgpu.real.cuCtxGetCurrent;
    __atomic_store_n(&vgpu.mem_hot, vgpu.mem_hot_on, __ATOMIC_RELEASE);
    vgpu_launch_loaded();
    if (vgpu.limited) vgpu_code_watch(); /* what the first launches load is settled too */
    t_loading = 0;
}

static pthread_once_t g_load_once = PTHREAD_ONCE_INIT;

void vgpu_load_slow(void) {
    if (t_loading) return; /* re-entered from libcuda's constructors: real pointers not set */
    pthread_once(&g_load_once, load_once);
    __atomic_store_n(&vgpu.ready, 1, __ATOMIC_RELEASE);
}

int vgpu_cuda_initialised(void) {
    if (!__atomic_load_n(&vgpu.ready, __ATOMIC_ACQUIRE)) {
        /* Not loaded by the program: then it cannot have called cuInit, and loading libcuda
         * here would only cost the process the mapping. */
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!h) return 0;
        dlclose(h);
        vgpu_ensure();
        if (!__atomic_load_n(&vgpu.ready, __ATOMIC_ACQUIRE)) return 0; /* inside the load */
    }
    int n = 0;
    return vgpu.real.cuDeviceGetCount && vgpu.real.cuDeviceGetCount(&n) == CUDA_SUCCESS;
}

int vgpu_loading_here(void) { return t_loading; }

static void load_nvml(void) {
    t_loading = 1;
    vgpu.nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (vgpu.nvml) {
        VGPU_NVML_HOOKS(VGPU_RESOLVE_NVML_HOOK)
        VGPU_NVML_USED(VGPU_RESOLVE_NVML_USED)
    }
    t_loading = 0;
}

static pthread_once_t g_nvml_once = PTHREAD_ONCE_INIT;

/* The hooks need the real NVML entry points; NVML itself is initialised only for our own
 * queries (vgpu_nvml_ready), since a process's NVML calls work only after its nvmlInit. */
static void nvml_entry_points(void) { pthread_once(&g_nvml_once, load_nvml); }

int vgpu_nvml_ready_locked(void) {
    int st = vgpu.nvml_state;
    if (st == 0) {
        nvml_entry_points();
        /* NVML counts nvmlInit calls: ours is never undone, so a program's own shutdown
         * leaves our handle working. */
        st = vgpu.real.nvmlInit_v2 && vgpu.real.nvmlDeviceGetHandleByUUID &&
                     vgpu.real.nvmlDeviceGetMemoryInfo && vgpu.real.nvmlInit_v2() == NVML_SUCCESS
                 ? 1
                 : -1;
        if (st < 0) VLOG(VGPU_LOG_INFO, "NVML unavailable: context memory is not measured");
        __atomic_store_n(&vgpu.nvml_state, st, __ATOMIC_RELEASE);
    }
    return st > 0;
}

int vgpu_nvml_ready(void) {
    int st = __atomic_load_n(&vgpu.nvml_state, __ATOMIC_ACQUIRE);
    if (LIKELY(st != 0)) return st > 0;
    nvml_entry_points(); /* the dlopen outside the lock */
    pthread_mutex_lock(&vgpu.mu);
    int ok = vgpu_nvml_ready_locked();
    pthread_mutex_unlock(&vgpu.mu);
    return ok;
}

void vgpu_nvml_load(void) { nvml_entry_points(); }
