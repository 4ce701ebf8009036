/* Stress of the shared region: P processes x T threads reserve, commit or roll back, and
 * release random sizes near the limit for S seconds, while this process checks snapshots
 * (every device's used equals its processes' sum and stays within the limit) and, with
 * --kill-ms, SIGKILLs a random worker every so often (often inside a critical section) and
 * starts another. At the end every charge must be back: used 0 on every device.
 *
 * The run lasts S seconds and then on until it has done what it is asked to prove (at least
 * --min-snapshots snapshots checked, --min-kills workers killed, the limit reached): a loaded
 * host makes it longer, never weaker. Past --max-seconds it fails, saying what it lacked.
 *
 *   region_stress PATH [--procs P] [--threads T] [--seconds S] [--devices D] [--limit SIZE]
 *                      [--kill-ms MS] [--no-check] [--min-snapshots N] [--min-kills K]
 *                      [--max-seconds M]
 * Prints one line of figures; exits 1 with "FAIL: ..." on any broken rule. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "region_test.h"

/* The snapshot's retry time for a sum over a limit (OVER_LIMIT_MS in region_snapshot.c), and
 * how long a sum may stay over before it is a broken limit rather than a stalled thread. */
#define OVER_LIMIT_NS 50000000ull
#define STALL_S 10

struct counters {
    uint64_t granted, denied, released;
};

static struct {
    const char *path;
    int procs, threads, devices;
    double seconds;
    uint64_t limit;
    int kill_ms, check;
    uint64_t min_snapshots;
    int min_kills;
    double max_seconds; /* 0: 10 x seconds + 30 */
    struct counters *shared; /* one per worker, in an anonymous shared mapping */
    int *stop;               /* set by the checker when the run is over (shared too) */
} opt = {NULL, 16, 4, 1, 5.0, 1 << 30, 0, 1, 0, 0, 0.0, NULL, NULL};

struct worker_thread {
    struct vgpu_region *r;
    struct counters *c;
    unsigned seed;
};

static uint64_t rnd(unsigned *seed) { return (uint64_t)rand_r(seed); }

/* Each thread holds up to 4 allocations; sizes up to a quarter of the limit, so 64 threads
 * keep the devices pinned near their limits. */
static void *worker_thread(void *arg) {
    struct worker_thread *w = arg;
    struct {
        int dev;
        uint64_t bytes;
    } held[4];
    int n = 0;
    while (!__atomic_load_n(opt.stop, __ATOMIC_RELAXED)) {
        if (n < 4 && (n == 0 || rnd(&w->seed) % 2)) {
            int dev = (int)(rnd(&w->seed) % (unsigned)opt.devices);
            uint64_t bytes = 1 + (rnd(&w->seed) << 16 ^ rnd(&w->seed)) % (opt.limit / 4);
            if (R.reserve(w->r, dev, bytes) != VGPU_REGION_OK) {
                __atomic_add_fetch(&w->c->denied, 1, __ATOMIC_RELAXED);
                continue;
            }
            /* R.usage() may pass the limit for an instant (a racer's add before its
             * back-out); what must hold is checked on the snapshots and by region_race. */
            __atomic_add_fetch(&w->c->granted, 1, __ATOMIC_RELAXED);
            if (rnd(&w->seed) % 8 == 0) { /* the driver failed: give it back */
                R.rollback(w->r, dev, bytes);
                continue;
            }
            R.commit(w->r, dev, bytes);
            held[n].dev = dev;
            held[n].bytes = bytes;
            n++;
        } else {
            int i = (int)(rnd(&w->seed) % (unsigned)n);
            R.release(w->r, held[i].dev, held[i].bytes);
            held[i] = held[--n];
            __atomic_add_fetch(&w->c->released, 1, __ATOMIC_RELAXED);
        }
    }
    while (n > 0) {
        n--;
        R.release(w->r, held[n].dev, held[n].bytes);
    }
    return NULL;
}

static void __attribute__((noreturn)) worker(int index) {
    struct vgpu_limits l = test_limits(opt.devices, opt.limit);
    struct vgpu_region *r = open_region(opt.path, &l);
    pthread_t tid[64];
    struct worker_thread w[64];
    for (int t = 0; t < opt.threads; t++) {
        w[t].r = r;
        w[t].c = &opt.shared[index];
        w[t].seed = (unsigned)(getpid() * 7919 + t);
        CHECK(pthread_create(&tid[t], NULL, worker_thread, &w[t]) == 0, "pthread_create");
    }
    for (int t = 0; t < opt.threads; t++) pthread_join(tid[t], NULL);
    for (int d = 0; d < opt.devices; d++)
        CHECK(R.own_usage(r, d) == 0, "worker kept %llu bytes after releasing all",
              (unsigned long long)R.own_usage(r, d));
    R.close(r);
    _exit(0);
}

static pid_t spawn(int index) {
    pid_t parent = getpid();
    pid_t p = fork();
    CHECK(p >= 0, "fork: %s", strerror(errno));
    if (p == 0) {
        /* Workers run until the checker says stop: if it dies first (a failed check, a test's
         * timeout), they must not run on. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        worker(index);
    }
    return p;
}

static void parse(int argc, char **argv) {
    if (argc < 2) die("usage: region_stress PATH [options]");
    opt.path = argv[1];
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--no-check") == 0) {
            opt.check = 0;
            continue;
        }
        if (!v) die("%s needs a value", a);
        i++;
        if (strcmp(a, "--procs") == 0) opt.procs = atoi(v);
        else if (strcmp(a, "--threads") == 0) opt.threads = atoi(v);
        else if (strcmp(a, "--seconds") == 0) opt.seconds = atof(v);
        else if (strcmp(a, "--devices") == 0) opt.devices = atoi(v);
        else if (strcmp(a, "--limit") == 0) opt.limit = parse_size(v);
        else if (strcmp(a, "--kill-ms") == 0) opt.kill_ms = atoi(v);
        else if (strcmp(a, "--min-snapshots") == 0) opt.min_snapshots = strtoull(v, NULL, 10);
        else if (strcmp(a, "--min-kills") == 0) opt.min_kills = atoi(v);
        else if (strcmp(a, "--max-seconds") == 0) opt.max_seconds = atof(v);
        else die("unknown option %s", a);
    }
    CHECK(opt.procs >= 1 && opt.procs <= 200 && opt.threads >= 1 && opt.threads <= 64 &&
              opt.devices >= 1 && opt.devices <= VGPU_MAX_DEVICES && opt.limit >= 1024,
          "options out of range");
    CHECK(!opt.min_kills || opt.kill_ms, "--min-kills needs --kill-ms");
    CHECK(!opt.min_snapshots || opt.check, "--min-snapshots needs the checks (no --no-check)");
    if (opt.max_seconds <= 0) opt.max_seconds = opt.seconds * 10 + 30;
}

static struct counters sum_counters(int spawned) {
    struct counters sum = {0, 0, 0};
    for (int i = 0; i < spawned; i++) {
        sum.granted += __atomic_load_n(&opt.shared[i].granted, __ATOMIC_RELAXED);
        sum.denied += __atomic_load_n(&opt.shared[i].denied, __ATOMIC_RELAXED);
        sum.released += __atomic_load_n(&opt.shared[i].released, __ATOMIC_RELAXED);
    }
    return sum;
}

int main(int argc, char **argv) {
    parse(argc, argv);
    region_api_load();
    struct vgpu_limits l = test_limits(opt.devices, opt.limit);
    char err[VGPU_REGION_ERRLEN];
    CHECK(R.create(opt.path, &l, err, sizeof err) >= 0, "create: %s", err);
    /* Room for the replacements of killed workers too. */
    int replacements = opt.kill_ms ? (int)(opt.seconds * 1000 / opt.kill_ms) : 0;
    if (replacements < opt.min_kills) replacements = opt.min_kills;
    int max_workers = opt.procs + replacements;
    opt.shared = mmap(NULL, sizeof(struct counters) * (size_t)max_workers + sizeof(int),
                      PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(opt.shared != MAP_FAILED, "mmap");
    opt.stop = (int *)(opt.shared + max_workers);
    uint64_t start = now_ns();
    uint64_t deadline_ns = start + (uint64_t)(opt.seconds * 1e9);
    uint64_t give_up_ns = start + (uint64_t)(opt.max_seconds * 1e9);
    pid_t *pids = calloc((size_t)opt.procs, sizeof *pids);
    int spawned = 0, kills = 0;
    for (int i = 0; i < opt.procs; i++) pids[i] = spawn(spawned++);

    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    uint64_t snapshots = 0, busy = 0, retried = 0, max_used = 0, next_kill = 0;
    uint64_t stalled = 0, over_since = 0;
    unsigned seed = (unsigned)getpid();
    for (;;) {
        uint64_t now = now_ns();
        if (now >= deadline_ns) {
            struct counters sum = sum_counters(spawned);
            if (snapshots >= opt.min_snapshots && kills >= opt.min_kills && sum.granted > 0 &&
                sum.denied > 0)
                break;
            if (now >= give_up_ns)
                die("after %.0f s (--max-seconds) only %llu snapshots (want %llu), %d kills "
                    "(want %d), %llu granted and %llu denied (want both > 0): a host this "
                    "starved cannot run the stress",
                    opt.max_seconds, (unsigned long long)snapshots,
                    (unsigned long long)opt.min_snapshots, kills, opt.min_kills,
                    (unsigned long long)sum.granted, (unsigned long long)sum.denied);
        }
        if (opt.kill_ms && now_ns() >= next_kill && spawned < max_workers) {
            int i = rand_r(&seed) % opt.procs;
            kill(pids[i], SIGKILL);
            CHECK(waitpid(pids[i], NULL, 0) == pids[i], "waitpid");
            pids[i] = spawn(spawned++);
            kills++;
            next_kill = now_ns() + (uint64_t)opt.kill_ms * 1000000u;
        }
        if (!opt.check) {
            usleep(1000);
            continue;
        }
        uint64_t asked = now_ns();
        int rc = R.snapshot(opt.path, s, err, sizeof err);
        uint64_t took = now_ns() - asked;
        if (rc == VGPU_REGION_EBUSY) {
            busy++;
            continue;
        }
        CHECK(rc == VGPU_REGION_OK, "snapshot: %s", err);
        int over = 0;
        for (uint32_t d = 0; d < s->device_count; d++) over |= s->devices[d].used > s->devices[d].memory_limit;
        /* A sum over the limit that the reader still saw after its OVER_LIMIT_MS of retries is
         * a reserving thread stalled between its add and its back-out (a loaded host, TSan):
         * the region shows it as it is (region_snapshot.c). It must clear once that thread
         * runs again; a charge that stays over for STALL_S is a broken limit. */
        if (over && took >= OVER_LIMIT_NS) {
            stalled++;
            if (!over_since) over_since = asked;
            CHECK(now_ns() - over_since < STALL_S * 1000000000ull,
                  "a device stayed over its limit for %d s", STALL_S);
            check_sums(s, "during the run");
            continue;
        }
        over_since = 0;
        check_books(s, "during the run");
        for (uint32_t d = 0; d < s->device_count; d++)
            if (s->devices[d].used > max_used) max_used = s->devices[d].used;
        retried += s->attempts > 1;
        snapshots++;
    }
    /* Workers must all finish soon after the stop: nobody may be blocked. */
    __atomic_store_n(opt.stop, 1, __ATOMIC_RELAXED);
    uint64_t stopped = now_ns();
    for (int i = 0; i < opt.procs; i++) {
        int st = 0;
        for (;;) {
            pid_t p = waitpid(pids[i], &st, WNOHANG);
            if (p == pids[i]) break;
            if (now_ns() - stopped > 60000000000ull)
                die("worker %d still running 60 s after the stop: blocked", pids[i]);
            usleep(1000);
        }
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed (status %d)", pids[i], st);
    }
    /* Killed workers' charges are reclaimed by the reap any newcomer does. */
    struct vgpu_region *r = open_region(opt.path, &l);
    R.close(r);
    CHECK(R.snapshot(opt.path, s, err, sizeof err) == VGPU_REGION_OK, "final snapshot: %s", err);
    check_books(s, "at the end");
    for (uint32_t d = 0; d < s->device_count; d++)
        CHECK(s->devices[d].used == 0, "device %u holds %llu bytes at the end", d,
              (unsigned long long)s->devices[d].used);
    CHECK(s->process_count == 0, "%u slots left at the end", s->process_count);
    struct counters sum = sum_counters(spawned);
    CHECK(sum.granted > 0 && sum.denied > 0, "the run never reached the limit");
    printf("stress ok procs=%d threads=%d seconds=%.1f granted=%llu denied=%llu released=%llu "
           "kills=%d snapshots=%llu retried=%llu busy=%llu stalled=%llu max_used=%llu "
           "limit=%llu\n",
           opt.procs, opt.threads, (double)(now_ns() - start) / 1e9,
           (unsigned long long)sum.granted, (unsigned long long)sum.denied,
           (unsigned long long)sum.released, kills, (unsigned long long)snapshots,
           (unsigned long long)retried, (unsigned long long)busy, (unsigned long long)stalled,
           (unsigned long long)max_used, (unsigned long long)opt.limit);
    free(s);
    free(pids);
    return 0;
}
