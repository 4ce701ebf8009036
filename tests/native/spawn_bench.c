/* What a preloaded library costs a program that does nothing: bench/bench_shim.py's /bin/true.
 *
 *   spawn_bench <n> <program> <variant>...
 *
 * A variant is "none", "env:<lib>" (LD_PRELOAD=<lib>) or "file:<lib>" (<lib> listed in
 * /etc/ld.so.preload, as a pod gets the shim). The variants take turns, one spawn each, n
 * rounds, so that a machine's drifts hit them alike; prints "<variant> <median us>" each.
 *
 * "file:" writes /etc/ld.so.preload before its spawn and removes it after (outside the timing),
 * so it refuses to run where that file exists: run it in a mount namespace with a writable
 * overlay on /etc (bench_shim.py does). Every variant gets an environment of the same size
 * (a blank LD_PRELOAD, which the loader skips, where none is wanted): the size of the
 * environment moves the new process's stack and shows in its timings. */
#include <errno.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

static const char k_preload_file[] = "/etc/ld.so.preload";

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The caller's environment without LD_PRELOAD, plus one slot for ours. */
static char **base_env(size_t *n) {
    size_t c = 0;
    while (environ[c]) c++;
    char **env = calloc(c + 2, sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < c; i++)
        if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0) env[k++] = environ[i];
    *n = k;
    return env;
}

static int write_preload_file(const char *lib) {
    FILE *f = fopen(k_preload_file, "wx");
    if (!f) return -1;
    int ok = fprintf(f, "%s\n", lib) > 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: spawn_bench <n> <program> none|env:<lib>|file:<lib>...\n");
        return 2;
    }
    long n = atol(argv[1]);
    const char *prog = argv[2];
    int nv = argc - 3;
    char **variants = argv + 3;
    size_t width = 0;
    for (int v = 0; v < nv; v++) {
        const char *s = variants[v];
        if (strcmp(s, "none") && strncmp(s, "env:", 4) && strncmp(s, "file:", 5)) {
            fprintf(stderr, "spawn_bench: variant %d (%s): none, env:<lib> or file:<lib>\n", v, s);
            return 2;
        }
        if (!strncmp(s, "file:", 5) && access(k_preload_file, F_OK) == 0) {
            fprintf(stderr, "spawn_bench: %s exists; the file: variants run only where it "
                            "does not (a mount namespace with an overlay on /etc)\n", k_preload_file);
            return 2;
        }
        if (strlen(s) > width) width = strlen(s);
    }
    if (n < 1) {
        fprintf(stderr, "spawn_bench: <n> must be a positive count, not %s\n", argv[1]);
        return 2;
    }
    size_t nenv;
    char **env = base_env(&nenv);
    double *t = calloc((size_t)nv * (size_t)n, sizeof *t);
    char **preload = calloc((size_t)nv, sizeof *preload);
    if (!env || !t || !preload) return 1;
    for (int v = 0; v < nv; v++) {
        const char *lib = !strncmp(variants[v], "env:", 4) ? variants[v] + 4 : "";
        if (asprintf(&preload[v], "LD_PRELOAD=%-*s", (int)width, lib) < 0) return 1;
    }
    char *args[] = {(char *)prog, NULL};
    for (long r = 0; r < n; r++) {
        for (int v = 0; v < nv; v++) {
            int file = !strncmp(variants[v], "file:", 5);
            if (file && write_preload_file(variants[v] + 5) != 0) {
                fprintf(stderr, "spawn_bench: cannot write %s: %s\n", k_preload_file, strerror(errno));
                return 1;
            }
            env[nenv] = preload[v];
            pid_t pid;
            int status = 0;
            double t0 = now_us();
            int rc = posix_spawn(&pid, prog, NULL, NULL, args, env);
            if (rc == 0) waitpid(pid, &status, 0);
            t[(size_t)v * (size_t)n + (size_t)r] = now_us() - t0;
            if (file) unlink(k_preload_file);
            if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                fprintf(stderr, "spawn_bench: %s under %s failed\n", prog, variants[v]);
                return 1;
            }
        }
    }
    for (int v = 0; v < nv; v++) {
        double *tv = t + (size_t)v * (size_t)n;
        qsort(tv, (size_t)n, sizeof *tv, cmp_double);
        printf("%s %.2f\n", variants[v], tv[n / 2]);
    }
    return 0;
}
