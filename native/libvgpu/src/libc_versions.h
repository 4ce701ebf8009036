/* Every process of a container loads the shim, and most never call it: what the loader does
 * for it must cost no more than an empty library's (issue 22). On x86-64 every libc import of
 * the shim is one libc has had since its first version there, GLIBC_2.2.5, with the meaning the
 * shim relies on. Force-included into every source of the shim (CMakeLists.txt: -include).
 *
 * Where libc.so.6 holds every import (glibc >= 2.34), the release build is linked without libc
 * (no DT_NEEDED, no symbol versions: nothing for the loader to map or check), so its imports
 * bind as an unversioned program's do: to libc's oldest version (index 2 of libc's version
 * definitions, GLIBC_2.2.5) where libc has several. Builds linked against libc
 * (VGPU_LIBC_PIN_VERSIONS: glibc < 2.34, VGPU_SHIM_LINK_LIBC=ON) bind the same versions with
 * .symver, one version need per library instead of eight; the sanitizer builds keep libc's
 * current versions (only the replacements below apply). tests/libvgpu/test_shim_loading.py
 * checks each import against the running libc.
 *
 * Why the oldest version keeps the meaning, checked against glibc 2.34-2.36's sources and
 * `objdump -T libc.so.6`:
 * - dl* / pthread_once / pthread_mutex_trylock: moved into libc.so.6 in 2.34, the GLIBC_2.2.5
 *   symbols are the same code (kept for programs linked against libdl/libpthread);
 * - clock_gettime: moved from librt in 2.17, the same code under both versions;
 * - memcpy@GLIBC_2.2.5 is memmove: a superset of memcpy's contract;
 * - sscanf@GLIBC_2.2.5 differs from __isoc99_sscanf only for "%a" (GNU allocation vs float),
 *   which the shim never uses;
 * - pthread_atfork@GLIBC_2.2.5 registers the handlers under libc's handle instead of the shim's,
 *   so a dlclose of the shim would not unregister them: the shim is linked -z nodelete (never
 *   unmapped), and it is never closed anyway (preloaded, or opened by ctypes);
 * - stat/fstat (2.33) are the __xstat/__fxstat(_STAT_VER_LINUX = 1, ...) calls that <sys/stat.h>
 *   made inline before 2.33; renameat2 (2.28) and openat (2.4) are their system calls, as glibc's
 *   wrappers make them; directories are read with getdents64 (pace.c), not fdopendir (2.4);
 *   mkostemp (2.7) is replaced below by the same loop over O_CREAT|O_EXCL names.
 * Elsewhere (aarch64: GLIBC_2.17 base, other libcs) nothing changes. */
#ifndef VGPU_LIBC_VERSIONS_H
#define VGPU_LIBC_VERSIONS_H

#include <features.h>

#if defined(__x86_64__) && defined(__GLIBC__)
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifdef VGPU_LIBC_PIN_VERSIONS
#define VGPU_OLD_LIBC_(sym) __asm__(".symver " #sym "," #sym "@GLIBC_2.2.5")
VGPU_OLD_LIBC_(memcpy);
VGPU_OLD_LIBC_(dlopen);
VGPU_OLD_LIBC_(dlclose);
VGPU_OLD_LIBC_(dlerror);
VGPU_OLD_LIBC_(dlvsym);
VGPU_OLD_LIBC_(pthread_once);
VGPU_OLD_LIBC_(pthread_mutex_trylock);
VGPU_OLD_LIBC_(pthread_atfork);
VGPU_OLD_LIBC_(clock_gettime);
VGPU_OLD_LIBC_(__xstat);
VGPU_OLD_LIBC_(__fxstat);
#endif

/* <stdio.h> names __isoc99_sscanf (GLIBC_2.7) for sscanf: call sscanf itself. */
extern int vgpu_sscanf_(const char *s, const char *fmt, ...) __asm__("sscanf")
    __attribute__((format(scanf, 2, 3)));
#define sscanf vgpu_sscanf_

extern int __xstat(int ver, const char *path, struct stat *st);
extern int __fxstat(int ver, int fd, struct stat *st);
#define stat(path, st) __xstat(1, (path), (st))
#define fstat(fd, st) __fxstat(1, (fd), (st))

static inline int vgpu_renameat2_(int ofd, const char *old, int nfd, const char *new_, unsigned fl) {
    return (int)syscall(SYS_renameat2, ofd, old, nfd, new_, fl);
}
#define renameat2 vgpu_renameat2_

/* openat (2.4): its system call, as glibc's wrapper makes it (the shim never passes O_CREAT). */
static inline int vgpu_openat_(int dfd, const char *path, int flags) {
    return (int)syscall(SYS_openat, dfd, path, flags, 0);
}
#define openat vgpu_openat_

/* mkostemp: the six trailing X's replaced until O_CREAT|O_EXCL makes a new file (0600). */
static inline int vgpu_mkostemp_(char *tmpl, int flags) {
    static const char digits[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    size_t len = strlen(tmpl);
    if (len < 6 || strcmp(tmpl + len - 6, "XXXXXX") != 0) {
        errno = EINVAL;
        return -1;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t v = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 40) ^
                 (uint64_t)(uintptr_t)tmpl;
    for (int attempt = 0; attempt < 62 * 62 * 62; attempt++) {
        v += 0x9e3779b97f4a7c15ULL; /* splitmix64: a fresh name each attempt */
        uint64_t z = v;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        for (int i = 0; i < 6; i++, z /= 62) tmpl[len - 6 + i] = digits[z % 62];
        int fd = open(tmpl, (flags & ~O_ACCMODE) | O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd >= 0 || errno != EEXIST) return fd;
    }
    errno = EEXIST;
    return -1;
}
#define mkostemp vgpu_mkostemp_

#endif
#endif
