/* The dlsym override: programs that dlopen libcuda and look entry points up by name get our
 * hooks, and every other lookup behaves exactly as it would without the shim.
 *
 * glibc's dlsym resolves RTLD_NEXT (and the namespace of RTLD_DEFAULT) relative to its
 * *caller*, found from its return address. A C wrapper that calls the real dlsym becomes that
 * caller, and dlsym(RTLD_NEXT, ...) from a library would then search after the shim instead
 * of after that library (the failure of earlier shims). So `dlsym` itself is a few
 * instructions of assembly: it asks vgpu_dlsym_route() whether the lookup is one of ours,
 * and otherwise restores the arguments and *jumps* to the real dlsym, which then sees the
 * original return address. There is no cache of earlier answers: every lookup is answered
 * afresh by the real dlsym. */
#include <dlfcn.h>
#include <signal.h>
#include <sys/syscall.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

/* The real dlsym; read by the assembly below. */
VGPU_HIDDEN void *(*vgpu_dlsym_next)(void *, const char *);

/* Sanitizers off here and in the route: their runtimes look their own symbols up through
 * dlsym while they initialise, before instrumented code may run. */
#define VGPU_NO_SANITIZE __attribute__((no_sanitize("address", "undefined", "thread")))

static VGPU_NO_SANITIZE void *(*resolve_real_dlsym(void))(void *, const char *) {
    void *(*p)(void *, const char *) = __atomic_load_n(&vgpu_dlsym_next, __ATOMIC_ACQUIRE);
    if (LIKELY(p != NULL)) return p;
    /* dlvsym(RTLD_NEXT) from here finds the definition after the shim: libc's (or libdl's
     * before glibc 2.34). Names: the current version, then the first of each architecture. */
    static const char versions[][12] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !p; i++)
        p = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!p) {
        static const char msg[] = "[vgpu] error: cannot find the real dlsym; aborting\n";
        ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1); /* stderr: a load-time symbol */
        (void)w;
        /* abort(), less an import: every import costs every process a relocation at load */
        syscall(SYS_kill, getpid(), SIGABRT);
        __builtin_trap();
    }
    __atomic_store_n(&vgpu_dlsym_next, p, __ATOMIC_RELEASE);
    return p;
}

void *vgpu_real_dlsym(void *handle, const char *name) { return resolve_real_dlsym()(handle, name); }

char **vgpu_environ(void) {
    /* The definition the program's own references use (its copy, if it made one): the first in
     * the global scope, as a load-time relocation would have found it. */
    char ***env = (char ***)vgpu_real_dlsym(RTLD_DEFAULT, "environ");
    return env ? *env : NULL;
}

/* Our answer to dlsym(handle, name), or NULL to let the real dlsym answer. */
VGPU_HIDDEN __attribute__((used)) VGPU_NO_SANITIZE void *
vgpu_dlsym_route(void *handle, const char *name) {
    void *(*real)(void *, const char *) = resolve_real_dlsym();
    /* Only explicit handles: RTLD_DEFAULT already finds our exported hooks (we are preloaded)
     * and RTLD_NEXT must be answered relative to the caller. */
    if (!name || handle == RTLD_NEXT || handle == RTLD_DEFAULT) return NULL;
    if (!(name[0] == 'c' && name[1] == 'u') &&
        !(name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l'))
        return NULL;
    if (vgpu_loading_here()) return NULL;
    const struct vgpu_hook *h = vgpu_hook_by_name(name);
    if (!h) return NULL;
    void *p = real(handle, name);
    if (!p) return NULL; /* the real call sets dlerror() */
    /* Is it the real library's function (and not, say, the shim's own, found through a
     * handle of the shim or of the main program)? */
    if (h->nvml) vgpu_nvml_load();
    else vgpu_ensure();
    return p == __atomic_load_n(h->real, __ATOMIC_ACQUIRE) ? h->hook : p;
}

#if defined(__x86_64__)
#if defined(__CET__)
#define VGPU_ENDBR "endbr64\n"
#else
#define VGPU_ENDBR ""
#endif
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        ".p2align 4\n"
        "dlsym:\n"
        ".cfi_startproc\n" VGPU_ENDBR
        "pushq %rdi\n"
        ".cfi_adjust_cfa_offset 8\n"
        "pushq %rsi\n"
        ".cfi_adjust_cfa_offset 8\n"
        "subq $8, %rsp\n" /* 16-byte alignment at the call */
        ".cfi_adjust_cfa_offset 8\n"
        "call vgpu_dlsym_route\n"
        "addq $8, %rsp\n"
        ".cfi_adjust_cfa_offset -8\n"
        "popq %rsi\n"
        ".cfi_adjust_cfa_offset -8\n"
        "popq %rdi\n"
        ".cfi_adjust_cfa_offset -8\n"
        "testq %rax, %rax\n"
        "jnz 1f\n"
        "jmp *vgpu_dlsym_next(%rip)\n" /* set by the route before it returned */
        "1:\n"
        "ret\n"
        ".cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
#if defined(__ARM_FEATURE_BTI_DEFAULT)
#define VGPU_BTI "bti c\n"
#else
#define VGPU_BTI ""
#endif
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        ".p2align 4\n"
        "dlsym:\n"
        ".cfi_startproc\n" VGPU_BTI
        "stp x29, x30, [sp, #-32]!\n"
        ".cfi_def_cfa_offset 32\n"
        ".cfi_offset 29, -32\n"
        ".cfi_offset 30, -24\n"
        "mov x29, sp\n"
        "stp x0, x1, [sp, #16]\n"
        "bl vgpu_dlsym_route\n"
        "cbnz x0, 1f\n"
        "ldp x0, x1, [sp, #16]\n"
        ".cfi_remember_state\n"
        "ldp x29, x30, [sp], #32\n" /* the caller's return address, for the real dlsym */
        ".cfi_def_cfa_offset 0\n"
        ".cfi_restore 29\n"
        ".cfi_restore 30\n"
        "adrp x16, vgpu_dlsym_next\n"
        "ldr x16, [x16, #:lo12:vgpu_dlsym_next]\n"
        "br x16\n"
        "1:\n"
        ".cfi_restore_state\n"
        "ldp x29, x30, [sp], #32\n"
        ".cfi_def_cfa_offset 0\n"
        "ret\n"
        ".cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#else
/* Elsewhere: a plain wrapper whose call to the real dlsym is, with optimisation, a tail call.
 * Without one, RTLD_NEXT lookups would be made relative to the shim. */
VGPU_API void *dlsym(void *handle, const char *name) {
    void *p = vgpu_dlsym_route(handle, name);
    return p ? p : vgpu_dlsym_next(handle, name);
}
#endif
