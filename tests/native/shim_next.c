/* Where dlsym(RTLD_NEXT / RTLD_DEFAULT, name) lands, from the main program and from a library
 * (libshim_nextlib.so, preloaded), for each name on the command line. Prints
 *   <who>.<name>=<file name of the object defining the answer, or NULL>
 * for who in main_next, lib_next, default. libcuda.so.1 is opened globally first. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RTLD_NEXT, RTLD_DEFAULT, dladdr */
#endif
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static const char *owner(void *p) {
    Dl_info info;
    if (!p) return "NULL";
    if (!dladdr(p, &info) || !info.dli_fname) return "?";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}

int main(int argc, char **argv) {
    if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return 3;
    }
    void *(*lib_lookup)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "shim_next_lookup");
    for (int i = 1; i < argc; i++) {
        printf("main_next.%s=%s\n", argv[i], owner(dlsym(RTLD_NEXT, argv[i])));
        printf("lib_next.%s=%s\n", argv[i], lib_lookup ? owner(lib_lookup(argv[i])) : "nolib");
        printf("default.%s=%s\n", argv[i], owner(dlsym(RTLD_DEFAULT, argv[i])));
    }
    return 0;
}
