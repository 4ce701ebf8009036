/* Modules and libraries of real GPU images (cubins, fat binaries): kernels by name, variables
 * with device memory, and the memory loading takes.
 *
 *   cuda_modules <image file> module|library|library:preserved|library:table [op]...
 *
 * ops, each printing one "key=value" line:
 *   global:NAME  global.NAME=<rc> <size> <hex of its first bytes, up to 16>
 *   write:NAME   write.NAME=<rc> <1 if a pattern written to it reads back, else 0>
 *   func:NAME    func.NAME=<rc>  (module: cuModuleGetFunction; library: cuLibraryGetKernel, then
 *                cuKernelGetFunction in the current context)
 *   launch:NAME  launch.NAME=<rc> (a module's function, or a library's kernel launched as is)
 *   alloc:BYTES  alloc.BYTES=<rc> (cuMemAlloc, kept)
 *   free:now     free.now=<free bytes> (cuMemGetInfo)
 *   sleep:MS     sleeps MS milliseconds (prints nothing)
 *   stall:alloc:BYTES, stall:free:BYTES
 *                another thread allocates BYTES (or frees BYTES allocated here first) and is
 *                held by simgpu half-way (SIMGPU_STALL names the gate file): the ops that
 *                follow see the call in flight, as a neighbouring thread's would be
 *   unstall:     lets it go and joins it: unstall=<its rc>
 *   sync:        sync.=<rc of cuCtxSynchronize>
 *   hold:        prints "held" and waits for a line on stdin (a test looks meanwhile)
 * and around them: load=<rc>, free0 (before loading), free_loaded, free_ops (after the ops),
 * free_unloaded, free_destroyed (after the context is destroyed, a library still loaded).
 * CUDA_MODULES_HOLD_MIB=<n>: allocate n MiB before loading (to load at a memory limit).
 * CUDA_MODULES_LEAVE=<n>: after loading, allocate all but n bytes of what cuMemGetInfo says is
 * free (to launch at a memory limit). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "cuda_test.h"

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) exit(2);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static CUresult global(CUmodule mod, CUlibrary lib, const char *name, CUdeviceptr *p, size_t *n) {
    if (lib) return cuLibraryGetGlobal(p, n, lib, name);
    return cuModuleGetGlobal(p, n, mod, name);
}

static void op_global(CUmodule mod, CUlibrary lib, const char *name) {
    CUdeviceptr p = 0;
    size_t n = 0;
    CUresult rc = global(mod, lib, name, &p, &n);
    unsigned char bytes[16] = {0};
    size_t show = n < sizeof bytes ? n : sizeof bytes;
    if (rc == CUDA_SUCCESS && show) CK(cuMemcpyDtoH(bytes, p, show));
    printf("global.%s=%d %zu ", name, (int)rc, n);
    for (size_t i = 0; i < show; i++) printf("%02x", bytes[i]);
    printf("\n");
}

static void op_write(CUmodule mod, CUlibrary lib, const char *name) {
    CUdeviceptr p = 0;
    size_t n = 0;
    CUresult rc = global(mod, lib, name, &p, &n);
    int same = 0;
    if (rc == CUDA_SUCCESS) {
        unsigned char *in = malloc(n), *out = calloc(1, n);
        for (size_t i = 0; i < n; i++) in[i] = (unsigned char)(i * 7 + 3);
        CK(cuMemcpyHtoD(p, in, n));
        CK(cuMemcpyDtoH(out, p, n));
        same = memcmp(in, out, n) == 0;
        free(in);
        free(out);
    }
    printf("write.%s=%d %d\n", name, (int)rc, same);
}

static CUresult function(CUmodule mod, CUlibrary lib, const char *name, CUfunction *f) {
    if (!lib) return cuModuleGetFunction(f, mod, name);
    CUkernel k;
    CUresult rc = cuLibraryGetKernel(&k, lib, name);
    if (rc == CUDA_SUCCESS) *f = (CUfunction)(void *)k;
    return rc;
}

/* A call held in flight by simgpu's SIMGPU_STALL gate, made by another thread. */
static struct {
    CUcontext ctx;
    int freeing;
    CUdeviceptr p;
    size_t n;
    CUresult rc;
    pthread_t thread;
    char gate[4096], mark[4096];
} g_stall;

static void *stalled_call(void *arg) {
    (void)arg;
    CK(cuCtxSetCurrent(g_stall.ctx));
    g_stall.rc = g_stall.freeing ? cuMemFree(g_stall.p) : cuMemAlloc(&g_stall.p, g_stall.n);
    return NULL;
}

static void op_stall(CUcontext ctx, const char *what) {
    const char *gate = getenv("SIMGPU_STALL");
    if (!gate) {
        fprintf(stderr, "stall: SIMGPU_STALL is not set\n");
        exit(2);
    }
    g_stall.ctx = ctx;
    g_stall.freeing = strncmp(what, "free:", 5) == 0;
    g_stall.n = (size_t)strtoull(strchr(what, ':') + 1, NULL, 10);
    if (g_stall.freeing) CK(cuMemAlloc(&g_stall.p, g_stall.n));
    snprintf(g_stall.gate, sizeof g_stall.gate, "%s", gate);
    snprintf(g_stall.mark, sizeof g_stall.mark, "%s.stalled", gate);
    FILE *f = fopen(g_stall.gate, "w");
    if (!f) exit(2);
    fputs(g_stall.freeing ? "cuMemFree_v2" : "cuMemAlloc_v2", f);
    fclose(f);
    if (pthread_create(&g_stall.thread, NULL, stalled_call, NULL) != 0) exit(2);
    while (access(g_stall.mark, F_OK) != 0) { /* held: the call is half-way */
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void op_unstall(void) {
    unlink(g_stall.gate);
    pthread_join(g_stall.thread, NULL);
    printf("unstall=%d\n", (int)g_stall.rc);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: cuda_modules <image> module|library [op]...\n");
        return 2;
    }
    char *image = slurp(argv[1]);
    /* library:preserved passes CU_LIBRARY_BINARY_IS_PRESERVED (1), a flag, with no values
     * array, as cuBLAS 13 does; library:table passes the host table option (0) the same way,
     * which needs a value. */
    int library = strncmp(argv[2], "library", 7) == 0;
    CUlibraryOption opt[1] = {(CUlibraryOption)(strcmp(argv[2], "library:table") == 0 ? 0 : 1)};
    unsigned int nopt = strchr(argv[2], ':') ? 1 : 0;
    CK(cuInit(0));
    CUdevice dev;
    CUcontext ctx;
    CK(cuDeviceGet(&dev, 0));
    CK(cuCtxCreate(&ctx, NULL, 0, dev));
    const char *hold = getenv("CUDA_MODULES_HOLD_MIB");
    CUdeviceptr held = 0;
    if (hold && atoi(hold) > 0) CK(cuMemAlloc(&held, (size_t)atoi(hold) << 20));
    printf("free0=%zu\n", free_bytes());
    CUmodule mod = NULL;
    CUlibrary lib = NULL;
    CUresult rc = library ? cuLibraryLoadData(&lib, image, NULL, NULL, 0, nopt ? opt : NULL, NULL, nopt) : cuModuleLoadData(&mod, image);
    printf("load=%d\n", (int)rc);
    if (rc != CUDA_SUCCESS) {
        free(image);
        CK(cuCtxDestroy(ctx));
        return 0;
    }
    printf("free_loaded=%zu\n", free_bytes());
    const char *leave = getenv("CUDA_MODULES_LEAVE");
    if (leave) {
        size_t f = free_bytes(), n = (size_t)strtoull(leave, NULL, 10);
        CUdeviceptr filler = 0;
        if (f > n) CK(cuMemAlloc(&filler, f - n));
        printf("free_left=%zu\n", free_bytes());
    }
    for (int i = 3; i < argc; i++) {
        const char *name = strchr(argv[i], ':');
        if (!name) return 2;
        name++;
        if (strncmp(argv[i], "global:", 7) == 0) {
            op_global(mod, lib, name);
        } else if (strncmp(argv[i], "write:", 6) == 0) {
            op_write(mod, lib, name);
        } else if (strncmp(argv[i], "func:", 5) == 0) {
            CUfunction f;
            CUresult r = function(mod, lib, name, &f);
            if (r == CUDA_SUCCESS && lib) r = cuKernelGetFunction(&f, (CUkernel)(void *)f);
            printf("func.%s=%d\n", name, (int)r);
        } else if (strncmp(argv[i], "launch:", 7) == 0) {
            CUfunction f;
            CUresult r = function(mod, lib, name, &f);
            if (r == CUDA_SUCCESS) r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
            if (r == CUDA_SUCCESS) r = cuCtxSynchronize();
            printf("launch.%s=%d\n", name, (int)r);
        } else if (strncmp(argv[i], "alloc:", 6) == 0) {
            CUdeviceptr p = 0;
            printf("alloc.%s=%d\n", name, (int)cuMemAlloc(&p, (size_t)strtoull(name, NULL, 10)));
        } else if (strncmp(argv[i], "free:", 5) == 0) {
            printf("free.%s=%zu\n", name, free_bytes());
        } else if (strncmp(argv[i], "stall:", 6) == 0) {
            op_stall(ctx, name);
        } else if (strcmp(argv[i], "unstall:") == 0) {
            op_unstall();
        } else if (strcmp(argv[i], "sync:") == 0) {
            printf("sync.=%d\n", (int)cuCtxSynchronize());
        } else if (strcmp(argv[i], "hold:") == 0) {
            printf("held\n");
            fflush(stdout);
            char line[8];
            if (!fgets(line, sizeof line, stdin)) return 2;
        } else if (strncmp(argv[i], "sleep:", 6) == 0) {
            struct timespec ts = {atoi(name) / 1000, (long)(atoi(name) % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        } else {
            return 2;
        }
    }
    printf("free_ops=%zu\n", free_bytes());
    if (!library) {
        CK(cuModuleUnload(mod));
        printf("free_unloaded=%zu\n", free_bytes());
    }
    CK(cuCtxDestroy(ctx));
    CK(cuCtxCreate(&ctx, NULL, 0, dev));
    printf("free_destroyed=%zu\n", free_bytes());
    if (library) CK(cuLibraryUnload(lib));
    CK(cuCtxDestroy(ctx));
    free(image);
    return 0;
}
