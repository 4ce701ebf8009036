/* Cost of the region's accounting, for bench/bench_region.py: N processes each run K
 * reserve+commit+release pairs of 4 KiB on one device, started together, optionally with a
 * busy wait of G ns between reserve and commit standing in for the driver's allocation.
 * With a gap, the time spent inside the calls is measured too; `--baseline` runs the same
 * loop without the region calls (the clock's own cost, to subtract).
 *
 *   region_bench PATH [--procs N] [--iters K] [--gap-ns G] [--baseline]
 * Prints one line: the means over processes of wall-clock time, CPU time and time inside
 * the calls per pair (in_calls only with a gap). */
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "region_test.h"

struct result {
    uint64_t wall_ns, cpu_ns, in_calls_ns;
};

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void spin_ns(uint64_t ns) {
    if (!ns) return;
    uint64_t end = now_ns() + ns;
    while (now_ns() < end) {
    }
}

int main(int argc, char **argv) {
    if (argc < 2) die("usage: region_bench PATH [--procs N] [--iters K] [--gap-ns G] [--baseline]");
    const char *path = argv[1];
    int procs = 1, baseline = 0;
    uint64_t iters = 1000000, gap = 0;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--baseline") == 0) baseline = 1;
        else if (i + 1 < argc && strcmp(argv[i], "--procs") == 0) procs = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--iters") == 0) iters = parse_size(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--gap-ns") == 0) gap = parse_size(argv[++i]);
        else die("bad argument %s", argv[i]);
    }
    CHECK(procs >= 1 && procs <= 256 && iters > 0, "options out of range");
    region_api_load();
    struct vgpu_limits l = test_limits(1, (uint64_t)1 << 50);
    char err[VGPU_REGION_ERRLEN];
    CHECK(R.create(path, &l, err, sizeof err) >= 0, "create: %s", err);
    struct result *res = mmap(NULL, sizeof *res * (size_t)procs, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(res != MAP_FAILED, "mmap");
    int ready[2], go[2];
    CHECK(pipe(ready) == 0 && pipe(go) == 0, "pipe");
    for (int p = 0; p < procs; p++) {
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid) continue;
        close(go[1]);
        struct vgpu_region *r = open_region(path, NULL);
        char c = 1;
        /* Warm up: the first calls fault in the pages and the code. */
        for (int i = 0; i < 1000 && !baseline; i++) {
            R.reserve(r, 0, 4096);
            R.commit(r, 0, 4096);
            R.release(r, 0, 4096);
        }
        CHECK(write(ready[1], &c, 1) == 1, "ready");
        CHECK(read(go[0], &c, 1) == 0, "go");
        uint64_t w0 = now_ns(), c0 = cpu_ns(), in_calls = 0;
        if (!gap) {
            for (uint64_t i = 0; i < iters && !baseline; i++) {
                if (R.reserve(r, 0, 4096) != VGPU_REGION_OK) die("reserve refused");
                R.commit(r, 0, 4096);
                R.release(r, 0, 4096);
            }
        } else {
            /* Time the calls themselves around the stand-in driver call; the baseline times
             * the same empty brackets, to subtract the clock's own cost. */
            for (uint64_t i = 0; i < iters; i++) {
                uint64_t t0 = now_ns();
                if (!baseline && R.reserve(r, 0, 4096) != VGPU_REGION_OK) die("reserve refused");
                uint64_t t1 = now_ns();
                spin_ns(gap);
                uint64_t t2 = now_ns();
                if (!baseline) {
                    R.commit(r, 0, 4096);
                    R.release(r, 0, 4096);
                }
                in_calls += t1 - t0 + now_ns() - t2;
            }
        }
        res[p].wall_ns = now_ns() - w0;
        res[p].cpu_ns = cpu_ns() - c0;
        res[p].in_calls_ns = in_calls;
        R.close(r);
        _exit(0);
    }
    close(ready[1]);
    close(go[0]);
    for (int p = 0; p < procs; p++) {
        char c;
        CHECK(read(ready[0], &c, 1) == 1, "a worker did not start");
    }
    close(go[1]);
    for (int p = 0; p < procs; p++) {
        int st;
        CHECK(wait(&st) > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "a worker failed");
    }
    double wall = 0, cpu = 0, in_calls = 0, max_wall = 0;
    for (int p = 0; p < procs; p++) {
        double w = (double)res[p].wall_ns / (double)iters;
        wall += w / procs;
        cpu += (double)res[p].cpu_ns / (double)iters / procs;
        in_calls += (double)res[p].in_calls_ns / (double)iters / procs;
        if (w > max_wall) max_wall = w;
    }
    printf("procs=%d iters=%llu gap_ns=%llu baseline=%d wall_ns_per_pair=%.1f "
           "cpu_ns_per_pair=%.1f max_wall_ns_per_pair=%.1f in_calls_ns_per_pair=%.1f\n",
           procs, (unsigned long long)iters, (unsigned long long)gap, baseline, wall, cpu,
           max_wall, in_calls);
    return 0;
}
