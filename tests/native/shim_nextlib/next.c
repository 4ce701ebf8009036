/* libshim_nextlib.so: a library that looks symbols up with dlsym(RTLD_NEXT, ...) from its own
 * code, as interposers and profilers do. The answer must be relative to this library, not to
 * the shim (tests/integration/test_shim_loading.py). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* RTLD_NEXT, RTLD_DEFAULT, dladdr */
#endif
#include <dlfcn.h>

/* Not a tail call: with one, dlsym's caller would be the program, not this library. */
__attribute__((visibility("default"), noinline)) void *shim_next_lookup(const char *name) {
    void *volatile p = dlsym(RTLD_NEXT, name);
    return p;
}
