/* What NVML's process lists show inside a container: this process uses the GPU through the
 * shim (a context and 256 MiB), then lists GPU 0's compute processes by each of NVML's three
 * entry points, the two-call way (count first) as nvidia-smi does.
 *
 *   shim_nvml_procs <mode>
 * Prints self=<pid> and, per entry point, v<k>=<pid>:<bytes>,... ; then waits for a line. */
#include <nvml.h>
#include <unistd.h>

#include "shim_test.h"

typedef nvmlReturn_t (*list_fn)(nvmlDevice_t, unsigned int *, void *);

static void list(void *nvml, const char *name, const char *key, size_t stride, nvmlDevice_t h) {
    list_fn f = (list_fn)dlsym(nvml, name);
    if (!f) exit(3);
    unsigned int n = 0;
    nvmlReturn_t rc = f(h, &n, NULL);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_INSUFFICIENT_SIZE) exit(11);
    char *buf = calloc(n + 1, stride);
    unsigned int cap = n + 1;
    if (f(h, &cap, buf) != NVML_SUCCESS) exit(12);
    printf("%s=", key);
    for (unsigned int i = 0; i < cap; i++) {
        unsigned int pid;
        unsigned long long used;
        memcpy(&pid, buf + i * stride, sizeof pid);
        memcpy(&used, buf + i * stride + 8, sizeof used);
        printf("%s%u:%llu", i ? "," : "", pid, used);
    }
    printf("\n");
    free(buf);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    shim_start(argv[1], 0);
    CUdeviceptr p;
    CK(C(alloc, cuMemAlloc)(&p, 256 << 20));
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) return 3;
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))dlsym(nvml, "nvmlInit_v2");
    nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t *) =
        (nvmlReturn_t(*)(unsigned int, nvmlDevice_t *))dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlDevice_t h;
    if (!init || !by_index || init() != NVML_SUCCESS || by_index(0, &h) != NVML_SUCCESS) return 4;
    printf("self=%d\n", (int)getpid());
    list(nvml, "nvmlDeviceGetComputeRunningProcesses", "v1", sizeof(nvmlProcessInfo_v1_t), h);
    list(nvml, "nvmlDeviceGetComputeRunningProcesses_v2", "v2", sizeof(nvmlProcessInfo_v2_t), h);
    list(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", "v3", sizeof(nvmlProcessInfo_v2_t), h);
    fflush(stdout);
    return 0;
}
