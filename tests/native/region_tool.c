/* Functional checks of the shared region, one subcommand each, run by
 * tests/integration/test_region.py. Prints "... ok" and exits 0 when every check holds;
 * prints "FAIL: <what>" and exits 1 otherwise. Some subcommands only set a scene (hold a
 * charge, die holding the lock) for the test to act on. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "region_test.h"

static const char *path;

static void snapshot_or_die(struct vgpu_region_snapshot *s) {
    char err[VGPU_REGION_ERRLEN];
    int rc = R.snapshot(path, s, err, sizeof err);
    CHECK(rc == VGPU_REGION_OK, "snapshot: %s", err);
}

static const struct vgpu_snapshot_process *find_slot(const struct vgpu_region_snapshot *s,
                                                     uint32_t slot) {
    for (uint32_t i = 0; i < s->process_count; i++)
        if (s->processes[i].slot == slot) return &s->processes[i];
    return NULL;
}

/* The region file mapped directly, as only a test may: to forge or tear its contents. */
static struct vgpu_region_file *map_raw(void) {
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0, "open %s: %s", path, strerror(errno));
    void *p = mmap(NULL, sizeof(struct vgpu_region_file), PROT_READ | PROT_WRITE, MAP_SHARED,
                   fd, 0);
    CHECK(p != MAP_FAILED, "mmap: %s", strerror(errno));
    close(fd);
    return p;
}

/* A slot's liveness byte, as region_file.c locks it: F_OFD_SETLK (take) or F_OFD_GETLK (ask). */
static int slot_byte(int fd, int slot, int cmd, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(offsetof(struct vgpu_region_file, slots) + (size_t)slot * sizeof(struct vgpu_region_slot));
    fl.l_len = 1;
    if (fcntl(fd, cmd, &fl) != 0) return -1;
    return cmd == F_OFD_GETLK ? fl.l_type == F_UNLCK : 0;
}

/* The region's lock behind the library's back, as a writer takes it: as the holder of a slot
 * (an OFD lock on its byte, through a description of our own that dies with us), whose index
 * + 1 goes into the lock word. Returns that description; raw_unlock closes it. */
static int raw_lock(struct vgpu_region_file *f) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    CHECK(fd >= 0, "open %s: %s", path, strerror(errno));
    int s = 0;
    while (s < VGPU_MAX_SLOTS && slot_byte(fd, s, F_OFD_SETLK, F_WRLCK) != 0) s++;
    CHECK(s < VGPU_MAX_SLOTS, "raw_lock: no slot to hold the lock as");
    uint32_t zero = 0;
    while (!__atomic_compare_exchange_n(&f->lock, &zero, (uint32_t)s + 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        CHECK(!(zero && slot_byte(fd, (int)zero - 1, F_OFD_GETLK, F_WRLCK) == 1),
              "raw_lock: region needs repair; tests forge only healthy regions");
        zero = 0;
        usleep(100);
    }
    return fd;
}

static void raw_unlock(struct vgpu_region_file *f, int fd) {
    __atomic_store_n(&f->lock, 0u, __ATOMIC_RELEASE);
    close(fd);
}

/* A consistent slot for `pid` holding `bytes` on device 0, whose lock nobody holds. */
static uint32_t forge_slot(int32_t pid, uint64_t start_time, uint64_t bytes) {
    struct vgpu_region_file *f = map_raw();
    int lock_fd = raw_lock(f);
    uint32_t s = 0;
    while (s < VGPU_MAX_SLOTS && f->slots[s].state != VGPU_SLOT_FREE) s++;
    CHECK(s < VGPU_MAX_SLOTS, "no free slot to forge");
    f->slots[s].pid = pid;
    f->slots[s].start_time = start_time;
    f->slots[s].dev[0].charged = bytes;
    f->slots[s].state = VGPU_SLOT_LIVE;
    if (s >= f->slot_hwm) f->slot_hwm = s + 1;
    raw_unlock(f, lock_fd);
    munmap(f, sizeof *f);
    return s;
}

/* Reserve and commit `bytes` on device 0, or die. */
static void charge(struct vgpu_region *r, uint64_t bytes, const char *who) {
    CHECK(R.reserve(r, 0, bytes) == VGPU_REGION_OK, "%s: cannot reserve %llu", who,
          (unsigned long long)bytes);
    R.commit(r, 0, bytes);
}

/* Reserve to the limit in 1 MiB steps, exactly to it, past it; release back to zero;
 * rollback, pending, clamping and bad device indexes. */
static int cmd_basic(void) {
    struct vgpu_region *r = open_region(path, NULL);
    uint64_t limit = R.limit(r, 0), chunk = 1 << 20, got = 0;
    CHECK(limit > 16 * chunk, "limit %llu too small for this test", (unsigned long long)limit);
    while (R.reserve(r, 0, chunk) == VGPU_REGION_OK) {
        R.commit(r, 0, chunk);
        got += chunk;
    }
    CHECK(R.usage(r, 0) == got && R.own_usage(r, 0) == got, "usage %llu != reserved %llu",
          (unsigned long long)R.usage(r, 0), (unsigned long long)got);
    CHECK(got * 100 >= limit * 99, "only %llu of %llu usable", (unsigned long long)got,
          (unsigned long long)limit);
    uint64_t rest = limit - got;
    if (rest) {
        CHECK(R.reserve(r, 0, rest) == VGPU_REGION_OK, "the last %llu bytes are refused",
              (unsigned long long)rest);
        R.commit(r, 0, rest);
    }
    CHECK(R.usage(r, 0) == limit, "usage %llu at the limit %llu", (unsigned long long)R.usage(r, 0),
          (unsigned long long)limit);
    CHECK(R.reserve(r, 0, 1) == VGPU_REGION_DENIED, "one byte past the limit was granted");
    CHECK(R.reserve(r, 0, UINT64_MAX) == VGPU_REGION_DENIED, "UINT64_MAX was granted");
    R.release(r, 0, rest);
    for (uint64_t i = 0; i < got / chunk; i++) R.release(r, 0, chunk);
    CHECK(R.usage(r, 0) == 0 && R.own_usage(r, 0) == 0, "released back to %llu",
          (unsigned long long)R.usage(r, 0));

    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    CHECK(R.reserve(r, 0, 3 * chunk) == VGPU_REGION_OK, "reserve after release");
    snapshot_or_die(s);
    CHECK(s->process_count == 1 && s->processes[0].pending[0] == 3 * chunk &&
              s->processes[0].used[0] == 3 * chunk && s->processes[0].alive &&
              s->processes[0].pid == getpid(),
          "a reservation in flight is not shown as pending");
    R.commit(r, 0, 3 * chunk);
    snapshot_or_die(s);
    CHECK(s->processes[0].pending[0] == 0 && s->devices[0].used == 3 * chunk, "commit");
    R.release(r, 0, 3 * chunk);
    CHECK(R.reserve(r, 0, 5 * chunk) == VGPU_REGION_OK, "reserve to roll back");
    R.rollback(r, 0, 5 * chunk);
    snapshot_or_die(s);
    CHECK(s->devices[0].used == 0 && s->processes[0].pending[0] == 0, "rollback");

    /* Releasing more than held clamps (one warning), never wraps. */
    charge(r, chunk, "before over-release");
    R.release(r, 0, 2 * chunk);
    R.release(r, 0, chunk);
    CHECK(R.usage(r, 0) == 0 && R.own_usage(r, 0) == 0, "over-release wrapped to %llu",
          (unsigned long long)R.usage(r, 0));
    CHECK(R.reserve(r, 0, limit) == VGPU_REGION_OK, "the whole limit after over-release");
    R.release(r, 0, limit);

    CHECK(R.reserve(r, 99, 1) == VGPU_REGION_EINVAL && R.reserve(r, -1, 1) == VGPU_REGION_EINVAL,
          "a bad device index is not refused");
    CHECK(R.device_index(r, "GPU-nope") == -1, "unknown uuid has an index");
    R.close(r);
    snapshot_or_die(s);
    CHECK(s->process_count == 0 && s->devices[0].used == 0, "close left a slot behind");
    free(s);
    printf("basic ok limit=%llu usable=%llu\n", (unsigned long long)limit,
           (unsigned long long)got);
    return 0;
}

/* Own limits below the region's lower this process's limit; above it change nothing. */
static int cmd_limits(void) {
    struct vgpu_region *plain = open_region(path, NULL);
    uint64_t limit = R.limit(plain, 0);
    struct vgpu_limits higher = test_limits(1, 2 * limit), lower = test_limits(1, limit / 2);
    struct vgpu_limits other = test_limits(1, limit);
    snprintf(other.devices[0].uuid, sizeof other.devices[0].uuid, "GPU-not-in-this-region");
    struct vgpu_region *hi = open_region(path, &higher);
    struct vgpu_region *lo = open_region(path, &lower);
    struct vgpu_region *ot = open_region(path, &other);
    CHECK(R.limit(hi, 0) == limit, "own limits raised the limit to %llu",
          (unsigned long long)R.limit(hi, 0));
    CHECK(R.limit(lo, 0) == limit / 2, "own lower limits ignored");
    CHECK(R.limit(ot, 0) == limit, "limits naming another GPU changed this one");
    CHECK(R.reserve(lo, 0, limit / 2 + 1) == VGPU_REGION_DENIED, "lower own limit not enforced");
    CHECK(R.reserve(hi, 0, limit + 1) == VGPU_REGION_DENIED, "region limit not enforced");
    CHECK(R.reserve(hi, 0, limit) == VGPU_REGION_OK, "the region's limit is not usable");
    R.release(hi, 0, limit);
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    snapshot_or_die(s);
    CHECK(s->devices[0].memory_limit == limit, "the region's limit changed");
    R.close(hi);
    R.close(lo);
    R.close(ot);
    R.close(plain);
    free(s);
    printf("limits ok\n");
    return 0;
}

/* Charge `bytes` on device 0 (committed, or left pending) and wait to be killed. */
static int __attribute__((noreturn)) cmd_hold(uint64_t bytes, int commit) {
    struct vgpu_region *r = open_region(path, NULL);
    if (commit)
        charge(r, bytes, "hold");
    else
        CHECK(R.reserve(r, 0, bytes) == VGPU_REGION_OK, "hold: cannot reserve");
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    for (;;) pause();
}

/* Reserve `bytes` on device 0, retrying for up to `timeout_ms`. */
static int cmd_reserve(uint64_t bytes, uint64_t timeout_ms) {
    struct vgpu_region *r = open_region(path, NULL);
    uint64_t t0 = now_ns();
    for (;;) {
        int rc = R.reserve(r, 0, bytes);
        uint64_t ms = (now_ns() - t0) / 1000000u;
        if (rc == VGPU_REGION_OK) {
            R.commit(r, 0, bytes);
            R.release(r, 0, bytes);
            R.close(r);
            printf("granted after %llu ms\n", (unsigned long long)ms);
            return 0;
        }
        CHECK(rc == VGPU_REGION_DENIED, "reserve: status %d", rc);
        if (ms > timeout_ms) {
            printf("denied for %llu ms\n", (unsigned long long)ms);
            return 2;
        }
        usleep(1000);
    }
}

/* Take the region's lock behind the library's back as a slot of our own, charge 12345 bytes
 * there as a reservation does before its check, then die (SIGKILL) or stop: the worst moment
 * for a process to go. */
static int __attribute__((noreturn)) cmd_lock_and(const char *what) {
    struct vgpu_region_file *f = map_raw();
    (void)raw_lock(f); /* held until this process dies or is stopped */
    uint32_t s = __atomic_load_n(&f->lock, __ATOMIC_ACQUIRE) - 1;
    f->slots[s].pid = (int32_t)getpid();
    __atomic_store_n(&f->slots[s].state, (uint32_t)VGPU_SLOT_LIVE, __ATOMIC_RELEASE);
    if (s >= f->slot_hwm) __atomic_store_n(&f->slot_hwm, s + 1, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&f->slots[s].dev[0].charged, 12345, __ATOMIC_SEQ_CST);
    if (strcmp(what, "kill") == 0) raise(SIGKILL);
    printf("locked %d\n", (int)getpid());
    fflush(stdout);
    for (;;) pause();
}

/* One snapshot, printed; its books checked (`over_ok`: a device may show more than its limit). */
static int cmd_snapshot(int over_ok) {
    char err[VGPU_REGION_ERRLEN];
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    int rc = R.snapshot(path, s, err, sizeof err);
    if (rc != VGPU_REGION_OK) {
        printf("error %d: %s\n", rc, err);
        free(s);
        return rc;
    }
    printf("ok processes=%u attempts=%u", s->process_count, s->attempts);
    for (uint32_t d = 0; d < s->device_count; d++)
        printf(" used%u=%llu", d, (unsigned long long)s->devices[d].used);
    for (uint32_t i = 0; i < s->process_count; i++)
        printf(" pid%u=%d alive%u=%d", i, s->processes[i].pid, i, s->processes[i].alive);
    printf("\n");
    if (!over_ok) check_books(s, "snapshot");
    free(s);
    return 0;
}

/* The host's loop: snapshot for `ms` milliseconds as fast as it can, whatever the tenant does
 * to the file meanwhile. Prints the counts, each distinct reason given and each distinct view
 * of device 0 (limit, used) read (up to 16 each); a signal (SIGBUS from a shrunk mapping)
 * kills it instead. */
static int cmd_snap_loop(uint64_t ms) {
    enum { MAX_REASONS = 16 };
    static char reasons[MAX_REASONS][VGPU_REGION_ERRLEN + 16];
    uint64_t views[MAX_REASONS][2];
    int nreasons = 0, nviews = 0;
    uint64_t ok = 0, failed = 0, deadline = now_ns() + ms * 1000000u;
    /* Past `ms`, on until it has met both a snapshot and a refusal (a loaded host may leave the
     * tenant's side idle for the whole time), for 30 s at most. */
    uint64_t give_up = deadline + 30000000000ull;
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    for (uint64_t t; (t = now_ns()) < deadline || ((!ok || !failed) && t < give_up);) {
        char err[VGPU_REGION_ERRLEN];
        int rc = R.snapshot(path, s, err, sizeof err);
        if (rc == VGPU_REGION_OK) {
            ok++;
            uint64_t view[2] = {s->devices[0].memory_limit, s->devices[0].used};
            int seen = 0;
            for (int i = 0; i < nviews && !seen; i++)
                seen = views[i][0] == view[0] && views[i][1] == view[1];
            if (!seen && nviews < MAX_REASONS) memcpy(views[nviews++], view, sizeof view);
            continue;
        }
        failed++;
        char reason[VGPU_REGION_ERRLEN + 16];
        snprintf(reason, sizeof reason, "%d %s", rc, err);
        int seen = 0;
        for (int i = 0; i < nreasons && !seen; i++) seen = strcmp(reasons[i], reason) == 0;
        if (!seen && nreasons < MAX_REASONS)
            snprintf(reasons[nreasons++], sizeof reasons[0], "%s", reason);
    }
    printf("snap-loop ok=%llu failed=%llu\n", (unsigned long long)ok, (unsigned long long)failed);
    for (int i = 0; i < nreasons; i++) printf("reason: %s\n", reasons[i]);
    for (int i = 0; i < nviews; i++)
        printf("view: limit=%llu used=%llu\n", (unsigned long long)views[i][0],
               (unsigned long long)views[i][1]);
    free(s);
    return 0;
}

static int cmd_open(void) {
    char err[VGPU_REGION_ERRLEN];
    struct vgpu_region *r = NULL;
    int rc = R.open(path, NULL, &r, err, sizeof err);
    if (rc != VGPU_REGION_OK) {
        printf("error %d: %s\n", rc, err);
        return 1;
    }
    R.close(r);
    printf("ok\n");
    return 0;
}

/* A slot with our own (live) pid but another start time, holding the whole limit: a pid
 * reused by us. We must not inherit it, and its charge must be reclaimable. */
static int cmd_pid_reuse(void) {
    struct vgpu_region *probe = open_region(path, NULL);
    uint64_t limit = R.limit(probe, 0);
    R.close(probe);
    uint32_t forged = forge_slot((int32_t)getpid(), 4242, limit);
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    snapshot_or_die(s);
    const struct vgpu_snapshot_process *p = find_slot(s, forged);
    CHECK(p && p->pid == getpid() && !p->alive && p->used[0] == limit && s->devices[0].used == 0,
          "a slot nobody locks must read dead (and count for nobody) although its pid is alive");
    struct vgpu_region *r = open_region(path, NULL);
    CHECK(R.own_usage(r, 0) == 0, "the new process inherited %llu bytes of a reused pid",
          (unsigned long long)R.own_usage(r, 0));
    CHECK(R.reserve(r, 0, limit) == VGPU_REGION_OK,
          "the dead slot's charge was not reclaimed (its pid is alive)");
    R.release(r, 0, limit);
    R.close(r);
    free(s);
    printf("pid-reuse ok\n");
    return 0;
}

/* Same pid, no registration: a forged slot stays listed until somebody reaps. */
static int cmd_forge(uint64_t bytes, int32_t pid) {
    printf("forged slot %u\n", forge_slot(pid, 1, bytes));
    return 0;
}

/* A forked child registers a slot of its own; the parent reaps it after it dies. */
static int cmd_fork(uint64_t x, uint64_t y) {
    struct vgpu_region *r = open_region(path, NULL);
    charge(r, x, "parent");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        CHECK(R.own_usage(r, 0) == 0, "the child sees its parent's charge as its own");
        charge(r, y, "child");
        CHECK(R.own_usage(r, 0) == y && R.usage(r, 0) == x + y, "child books");
        struct vgpu_region_snapshot *s = malloc(sizeof *s);
        snapshot_or_die(s);
        CHECK(s->process_count == 2, "child and parent should have a slot each, got %u",
              s->process_count);
        check_books(s, "fork");
        _exit(0); /* without closing: its slot is left for the parent to reap */
    }
    int st;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "child failed");
    CHECK(R.usage(r, 0) == x + y, "the dead child's charge vanished before reaping");
    CHECK(R.reap(r) == 1, "reap did not reclaim exactly the child's slot");
    CHECK(R.reap(r) == 0, "a second reap reclaimed again");
    CHECK(R.usage(r, 0) == x && R.own_usage(r, 0) == x, "after reap: %llu",
          (unsigned long long)R.usage(r, 0));
    R.release(r, 0, x);
    R.close(r);
    printf("fork ok\n");
    return 0;
}

/* Charge x, fork a child that never uses the region and outlives us, then exit without
 * closing: our slot must read dead although the child inherited our descriptors. */
static int __attribute__((noreturn)) cmd_fork_orphan(uint64_t x) {
    struct vgpu_region *r = open_region(path, NULL);
    charge(r, x, "orphan's parent");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        int null = open("/dev/null", O_RDWR); /* let the caller's pipes close with us */
        dup2(null, 1);
        dup2(null, 2);
        sleep(60);
        _exit(0);
    }
    printf("child %d\n", (int)child);
    fflush(stdout);
    _exit(0);
}

/* n processes create-or-attach at once: one creates, none sees a half-made region. */
static int cmd_race(int n) {
    int go[2];
    CHECK(pipe(go) == 0, "pipe");
    int created = 0;
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        CHECK(p >= 0, "fork");
        if (p == 0) {
            char c, err[VGPU_REGION_ERRLEN];
            close(go[1]);
            if (read(go[0], &c, 1) != 0) _exit(3);
            struct vgpu_limits l = test_limits(2, 1 << 30);
            int rc = R.create(path, &l, err, sizeof err);
            if (rc < 0) die("create: %s", err);
            struct vgpu_region *r = open_region(path, &l);
            CHECK(R.reserve(r, 1, 4096) == VGPU_REGION_OK, "reserve in a fresh region");
            _exit(rc == 1 ? 10 : 0);
        }
    }
    close(go[0]);
    close(go[1]); /* everyone starts now */
    for (int i = 0; i < n; i++) {
        int st;
        CHECK(wait(&st) > 0 && WIFEXITED(st), "a racer died");
        CHECK(WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 10, "a racer failed");
        created += WEXITSTATUS(st) == 10;
    }
    CHECK(created == 1, "%d processes created the region", created);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0666, "mode %o, not 0666",
          (unsigned)(st.st_mode & 0777));
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    snapshot_or_die(s);
    check_books(s, "after the race");
    free(s);
    printf("race ok created=%d\n", created);
    return 0;
}

/* Two processes race reservations of 0.6 x the limit, all starting each
 * round together, for `rounds` rounds: exactly one may win each round (two would pass the
 * limit; none is the spurious refusal of racers that saw each other's add and both backed
 * out). */
enum { RACERS = 2 };
struct race_board {
    int go, looked, done[RACERS], released[RACERS];
    int won[RACERS];
    int last; /* the last round: the referee lowers it to end early */
};

/* Racers spin (they must be on their CPUs when the round starts); the referee yields its
 * CPU to them. */
static void wait_for(const int *w, int v, int spins) {
    for (int i = 0; __atomic_load_n(w, __ATOMIC_ACQUIRE) < v; i++)
        if (i > spins) sched_yield();
}

static void __attribute__((noreturn)) racer(struct race_board *b, int me, int rounds) {
    struct vgpu_region *r = open_region(path, NULL);
    uint64_t bytes = R.limit(r, 0) / 10 * 6;
    for (int k = 1; k <= rounds; k++) {
        wait_for(&b->go, k, 1 << 22);
        if (k > __atomic_load_n(&b->last, __ATOMIC_ACQUIRE)) break;
        int rc = R.reserve(r, 0, bytes);
        CHECK(rc == VGPU_REGION_OK || rc == VGPU_REGION_DENIED, "reserve: status %d", rc);
        if (rc == VGPU_REGION_OK) {
            R.commit(r, 0, bytes);
            __atomic_add_fetch(&b->won[me], 1, __ATOMIC_RELAXED);
        }
        __atomic_store_n(&b->done[me], k, __ATOMIC_RELEASE);
        wait_for(&b->looked, k, 1 << 22);
        if (rc == VGPU_REGION_OK) R.release(r, 0, bytes);
        __atomic_store_n(&b->released[me], k, __ATOMIC_RELEASE);
    }
    R.close(r);
    _exit(0);
}

/* `rounds` rounds, or as many as `max_seconds` allow (0: no bound): a loaded host, on which
 * each round waits for three processes to get a CPU, runs fewer; it says how many it ran. */
static int cmd_race_limit(int rounds, double max_seconds) {
    struct race_board *b = mmap(NULL, sizeof *b, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(b != MAP_FAILED, "mmap");
    memset(b, 0, sizeof *b);
    b->last = rounds;
    uint64_t give_up = max_seconds > 0 ? now_ns() + (uint64_t)(max_seconds * 1e9) : UINT64_MAX;
    /* Every slot in the sums (as in a region many processes came through): a reservation's
     * add-to-decision window widens from nanoseconds to a few hundred, so that racers
     * started together really overlap on a 2-CPU machine. */
    struct vgpu_region_file *f = map_raw();
    __atomic_store_n(&f->slot_hwm, (uint32_t)VGPU_MAX_SLOTS, __ATOMIC_SEQ_CST);
    munmap(f, sizeof *f);
    pid_t pids[RACERS];
    pid_t referee = getpid();
    for (int i = 0; i < RACERS; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0, "fork");
        if (pids[i] == 0) {
            /* Racers spin for the next round: if the referee dies (a failed check, a test's
             * timeout), they must not spin on for ever. */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != referee) _exit(1);
            racer(b, i, rounds);
        }
    }
    struct vgpu_region_snapshot *s = malloc(sizeof *s);
    int both = 0, none = 0, ran = 0;
    for (int k = 1; k <= rounds; k++) {
        if (now_ns() >= give_up) {
            __atomic_store_n(&b->last, k - 1, __ATOMIC_RELEASE);
            __atomic_store_n(&b->go, k, __ATOMIC_RELEASE); /* wakes the racers to leave */
            break;
        }
        ran = k;
        int before = b->won[0] + b->won[1];
        __atomic_store_n(&b->go, k, __ATOMIC_RELEASE);
        for (int i = 0; i < RACERS; i++) wait_for(&b->done[i], k, 0);
        int won = __atomic_load_n(&b->won[0], __ATOMIC_ACQUIRE) + __atomic_load_n(&b->won[1], __ATOMIC_ACQUIRE) - before;
        if (won > 1) both++;
        if (won < 1) none++;
        if (k % 64 == 1) {
            snapshot_or_die(s);
            check_books(s, "between the racers' reservations");
        }
        __atomic_store_n(&b->looked, k, __ATOMIC_RELEASE);
        for (int i = 0; i < RACERS; i++) wait_for(&b->released[i], k, 0);
    }
    for (int i = 0; i < RACERS; i++) {
        int st = 0;
        CHECK(waitpid(pids[i], &st, 0) == pids[i] && WIFEXITED(st) && WEXITSTATUS(st) == 0,
              "racer %d failed", i);
    }
    CHECK(both == 0, "%d of %d rounds granted both racers: the limit was passed", both, ran);
    CHECK(none == 0, "%d of %d rounds refused both racers although one fits", none, ran);
    snapshot_or_die(s);
    CHECK(s->devices[0].used == 0 && s->process_count == 0, "the racers left charges behind");
    free(s);
    printf("race-limit ok rounds=%d won0=%d won1=%d\n", ran, b->won[0], b->won[1]);
    return 0;
}

/* The index of this process's live slot in the raw mapping `f`. */
static uint32_t own_slot(const struct vgpu_region_file *f) {
    uint32_t s = 0;
    while (s < VGPU_MAX_SLOTS && !(f->slots[s].state == VGPU_SLOT_LIVE && f->slots[s].pid == getpid())) s++;
    CHECK(s < VGPU_MAX_SLOTS, "no slot of ours");
    return s;
}

/* Register, add `bytes` to our own slot as a reservation does before its check (through the
 * file, behind the library), and die by SIGKILL before backing out or committing. */
static int __attribute__((noreturn)) cmd_die_mid_reserve(uint64_t bytes) {
    struct vgpu_region *r = open_region(path, NULL);
    (void)r;
    struct vgpu_region_file *f = map_raw();
    uint32_t s = own_slot(f);
    __atomic_fetch_add(&f->slots[s].dev[0].charged, bytes, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&f->slots[s].dev[0].pending, bytes, __ATOMIC_RELAXED);
    raise(SIGKILL);
    for (;;) pause();
}

/* Register, then put `bytes` on our own slot behind the library (over the limit if asked),
 * with the slot's forced bit for device 0 or without it (as a process stopped between its
 * add and its back-out would leave it), and wait to be killed. */
static int __attribute__((noreturn)) cmd_over(uint64_t bytes, int forced) {
    struct vgpu_region *r = open_region(path, NULL);
    (void)r;
    struct vgpu_region_file *f = map_raw();
    uint32_t s = own_slot(f);
    if (forced) __atomic_fetch_or(&f->slots[s].forced, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&f->slots[s].dev[0].charged, bytes, __ATOMIC_SEQ_CST);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    for (;;) pause();
}

int main(int argc, char **argv) {
    if (argc < 3) die("usage: region_tool CMD PATH [ARGS]");
    region_api_load();
    const char *cmd = argv[1];
    path = argv[2];
    const char *a3 = argc > 3 ? argv[3] : "0", *a4 = argc > 4 ? argv[4] : "0";
    if (strcmp(cmd, "create") == 0) {
        char err[VGPU_REGION_ERRLEN];
        struct vgpu_limits l = test_limits(atoi(a3), parse_size(a4));
        int rc = R.create(path, &l, err, sizeof err);
        if (rc < 0) die("create: %s", err);
        printf("%s\n", rc == 1 ? "created" : "exists");
        return 0;
    }
    if (strcmp(cmd, "basic") == 0) return cmd_basic();
    if (strcmp(cmd, "limits") == 0) return cmd_limits();
    if (strcmp(cmd, "hold") == 0) return cmd_hold(parse_size(a3), strcmp(a4, "pending") != 0);
    if (strcmp(cmd, "reserve") == 0) return cmd_reserve(parse_size(a3), parse_size(a4));
    if (strcmp(cmd, "lock-and") == 0) return cmd_lock_and(a3);
    if (strcmp(cmd, "snapshot") == 0) return cmd_snapshot(strcmp(a3, "over-ok") == 0);
    if (strcmp(cmd, "open") == 0) return cmd_open();
    if (strcmp(cmd, "snap-loop") == 0) return cmd_snap_loop(parse_size(a3));
    if (strcmp(cmd, "pid-reuse") == 0) return cmd_pid_reuse();
    if (strcmp(cmd, "forge") == 0) return cmd_forge(parse_size(a3), (int32_t)atoi(a4));
    if (strcmp(cmd, "fork") == 0) return cmd_fork(parse_size(a3), parse_size(a4));
    if (strcmp(cmd, "fork-orphan") == 0) return cmd_fork_orphan(parse_size(a3));
    if (strcmp(cmd, "race") == 0) return cmd_race(atoi(a3));
    if (strcmp(cmd, "race-limit") == 0) return cmd_race_limit(atoi(a3), atof(a4));
    if (strcmp(cmd, "die-mid-reserve") == 0) cmd_die_mid_reserve(parse_size(a3));
    if (strcmp(cmd, "over") == 0) cmd_over(parse_size(a3), strcmp(a4, "forced") == 0);
    die("unknown command %s", cmd);
}
