/* Many threads of one process allocating and freeing at random through the shim, for
 * tests/integration/test_shim_stress.py (several of these run at once, as one container).
 *
 *   shim_stress <mode> <ordinal> <seconds> <threads> <min-bytes> <max-bytes>
 *
 * Each thread holds up to 16 allocations and, until the deadline, either makes one more
 * (random size in [min, max], by a random path: cuMemAlloc, cuMemAllocAsync on its own
 * stream, or cuMemCreate) or frees a random one, so the container hovers at its limit and the
 * shim refuses often. Then every thread frees what it holds, the program prints
 * "granted=.. refused=.." and "freed", and waits for a line on stdin before it exits: the
 * test reads the region while every process is still alive, so a usage of zero there proves
 * the frees gave back what was charged (not the reclaim of dead processes).
 * Any result other than success or CUDA_ERROR_OUT_OF_MEMORY exits 10 (CK). */
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "shim_test.h"

enum { HELD = 16, PATHS = 3 };

struct held {
    int path; /* 0 cuMemAlloc, 1 cuMemAllocAsync, 2 cuMemCreate */
    CUdeviceptr p;
    CUmemGenericAllocationHandle h;
};

static struct {
    CUcontext ctx;
    int ordinal;
    double deadline_ms;
    uint64_t min, max;
    size_t granularity;
} g;

struct worker {
    pthread_t t;
    unsigned id;
    uint64_t granted, refused;
};

static uint64_t next_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Device memory of the stressed GPU, as cuMemCreate and its granularity query take it. */
static CUmemAllocationProp device_prop(void) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g.ordinal;
    return prop;
}

static CUresult make(struct held *o, int path, uint64_t bytes, CUstream s) {
    o->path = path;
    if (path == 0) return C(alloc, cuMemAlloc)(&o->p, bytes);
    if (path == 1) return C(alloc_async, cuMemAllocAsync)(&o->p, bytes, s);
    CUmemAllocationProp prop = device_prop();
    bytes = (bytes + g.granularity - 1) / g.granularity * g.granularity;
    return C(mem_create, cuMemCreate)(&o->h, bytes, &prop, 0);
}

static void drop(const struct held *o, CUstream s) {
    if (o->path == 0) CK(C(free, cuMemFree)(o->p));
    else if (o->path == 1) CK(C(free_async, cuMemFreeAsync)(o->p, s));
    else CK(C(mem_release, cuMemRelease)(o->h));
}

static void *work(void *arg) {
    struct worker *w = arg;
    CK(C(set_current, cuCtxSetCurrent)(g.ctx));
    CUstream s;
    CK(C(stream_create, cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING));
    uint64_t seed = ((uint64_t)getpid() << 20) ^ (w->id * 0x9E3779B97F4A7C15ull) ^ 0x5eedull;
    struct held held[HELD];
    int n = 0;
    while (shim_now_ms() < g.deadline_ms) {
        uint64_t r = next_rand(&seed);
        if (n < HELD && (n == 0 || (r & 1))) {
            uint64_t bytes = g.min + (r >> 8) % (g.max - g.min + 1);
            CUresult rc = make(&held[n], (int)((r >> 1) % PATHS), bytes, s);
            if (rc == CUDA_SUCCESS) {
                n++;
                w->granted++;
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                w->refused++;
            } else {
                CK(rc);
            }
        } else {
            int k = (int)((r >> 1) % (uint64_t)n);
            drop(&held[k], s);
            held[k] = held[--n];
        }
    }
    while (n > 0) drop(&held[--n], s);
    CK(C(stream_sync, cuStreamSynchronize)(s));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <seconds> <threads> <min-bytes> <max-bytes>\n", argv[0]);
        return 2;
    }
    g.ordinal = atoi(argv[2]);
    int threads = atoi(argv[4]);
    g.min = strtoull(argv[5], NULL, 0);
    g.max = strtoull(argv[6], NULL, 0);
    if (threads < 1 || threads > 64 || g.min < 1 || g.max < g.min) {
        fprintf(stderr, "shim_stress: bad threads (1..64) or sizes (1 <= min <= max)\n");
        return 2;
    }
    CUdevice dev = shim_start(argv[1], g.ordinal);
    CK(C(retain, cuDevicePrimaryCtxRetain)(&g.ctx, dev));
    CUmemAllocationProp prop = device_prop();
    CK(C(granularity, cuMemGetAllocationGranularity)(&g.granularity, &prop,
                                                      CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (g.granularity == 0) g.granularity = 1;
    printf("ready\n");
    fflush(stdout);
    for (int ch = getchar(); ch != '\n' && ch != EOF;) ch = getchar();
    g.deadline_ms = shim_now_ms() + atof(argv[3]) * 1e3;
    struct worker w[64];
    for (int i = 0; i < threads; i++) {
        w[i] = (struct worker){.id = (unsigned)i};
        if (pthread_create(&w[i].t, NULL, work, &w[i]) != 0) return 1;
    }
    uint64_t granted = 0, refused = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(w[i].t, NULL);
        granted += w[i].granted;
        refused += w[i].refused;
    }
    printf("granted=%llu\nrefused=%llu\nfreed\n", (unsigned long long)granted, (unsigned long long)refused);
    fflush(stdout);
    for (int ch = getchar(); ch != '\n' && ch != EOF;) ch = getchar();
    return 0;
}
