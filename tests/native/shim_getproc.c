/* cuGetProcAddress_v2 through the shim, one query per argument "<symbol>:<cudaVersion>:<ptds>",
 * printing
 *   <symbol>:<version>:<ptds>=<rc> <status> <object file of the pointer> <its symbol name>
 * so a test sees both which variant the driver chose and whose function it is. */
#include "shim_test.h"

int main(int argc, char **argv) {
    shim_load("handle");
    shim_getproc_t gp = (shim_getproc_t)dlsym(g_lib, "cuGetProcAddress_v2");
    if (!gp) return 3;
    for (int i = 1; i < argc; i++) {
        char sym[256];
        int version = 0, ptds = 0;
        if (sscanf(argv[i], "%255[^:]:%d:%d", sym, &version, &ptds) != 3) return 2;
        void *fn = NULL;
        CUdriverProcAddressQueryResult st = (CUdriverProcAddressQueryResult)-1;
        CUresult rc = gp(sym, &fn, version,
                         ptds ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT, &st);
        Dl_info info;
        const char *obj = "-", *name = "-";
        if (fn && dladdr(fn, &info)) {
            const char *slash = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
            obj = slash ? slash + 1 : info.dli_fname ? info.dli_fname : "?";
            name = info.dli_sname ? info.dli_sname : "?";
        }
        printf("%s=%d %d %s %s\n", argv[i], (int)rc, (int)st, obj, name);
    }
    return 0;
}
