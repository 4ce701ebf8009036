/* Drive cuGetProcAddress / cuGetProcAddress_v2 from stdin, one query per line:
 *     v1|v2 <symbol> <cudaVersion> <flags>
 * and print, per query:
 *     <rc> <status> <exported name the pointer belongs to, or -> <pointer == dlsym(lib, name)>
 * (status is -1 for v1, which has none). The library is the libcuda.so.1 this program links,
 * opened again with dlopen as a caller of the driver would. */
#include <dlfcn.h>
#include <string.h>

#include "cuda_test.h"

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) {
        fprintf(stderr, "libcuda.so.1 is not loaded: %s\n", dlerror());
        return 3;
    }
    /* The header maps cuGetProcAddress to _v2: the v1 entry point is only reachable by name. */
    typedef CUresult (*getproc_v1_t)(const char *, void **, int, cuuint64_t);
    getproc_v1_t getproc_v1 = (getproc_v1_t)dlsym(lib, "cuGetProcAddress");
    if (!getproc_v1) return 3;
    char api[8], sym[256];
    int version;
    unsigned long long flags;
    while (scanf("%7s %255s %d %llu", api, sym, &version, &flags) == 4) {
        void *fn = NULL;
        int status = -1;
        CUresult rc;
        if (strcmp(api, "v1") == 0) {
            rc = getproc_v1(sym, &fn, version, flags);
        } else {
            CUdriverProcAddressQueryResult st = (CUdriverProcAddressQueryResult)-1;
            rc = cuGetProcAddress_v2(sym, &fn, version, flags, &st);
            status = (int)st;
        }
        Dl_info info;
        const char *name = "-";
        int match = 0;
        if (fn && dladdr(fn, &info) && info.dli_sname) {
            name = info.dli_sname;
            match = dlsym(lib, name) == fn;
        }
        printf("%d %d %s %d\n", (int)rc, status, name, match);
    }
    return 0;
}
