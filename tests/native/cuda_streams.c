/* Streams, events, launches and graphs on the simulated timeline. Each scenario prints
 * "key=value" lines: result codes, and times in milliseconds (simulated, from events, or wall
 * clock as the caller would see it).
 *
 *   cuda_streams events|ptds|graph|bound|contexts
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cuda_test.h"

static CUcontext g_ctx;
static CUmodule g_mod;
/* The per-thread-default-stream entry points (what a program built with
 * CUDA_API_PER_THREAD_DEFAULT_STREAM calls), found the way runtimes find them. */
static __typeof__(cuLaunchKernel) *launch_ptsz;
static __typeof__(cuEventRecord) *record_ptsz;

static CUfunction kernel(const char *name) {
    CUfunction f;
    CK(cuModuleGetFunction(&f, g_mod, name));
    return f;
}

static void launch(CUfunction f, CUstream s) { CK(cuLaunchKernel(f, 1, 1, 1, 64, 1, 1, 0, s, NULL, NULL)); }

static float elapsed(CUevent a, CUevent b) {
    float ms = -1;
    CK(cuEventElapsedTime(&ms, a, b));
    return ms;
}

static void events(void) {
    CUfunction k10 = kernel("k10ms"), sleep = kernel("simgpu_sleep");
    CUstream s, s2;
    CUevent a, b, never, untimed;
    CK(cuStreamCreate(&s, CU_STREAM_DEFAULT));
    CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&a, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&b, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&never, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));

    CK(cuEventRecord(a, s));
    launch(k10, s);
    CK(cuEventRecord(b, s));
    float ms = 0;
    printf("event_query_pending=%d\nstream_query_pending=%d\nelapsed_pending=%d\n", (int)cuEventQuery(b),
           (int)cuStreamQuery(s), (int)cuEventElapsedTime(&ms, a, b));
    double t0 = now_ms();
    CK(cuEventSynchronize(b));
    printf("event_sync_wall_ms=%.2f\n", now_ms() - t0);
    printf("event_query_done=%d\nstream_query_done=%d\n", (int)cuEventQuery(b), (int)cuStreamQuery(s));
    printf("kernel_ms=%.3f\n", elapsed(a, b));
    printf("query_unrecorded=%d\nelapsed_unrecorded=%d\n", (int)cuEventQuery(never), (int)cuEventElapsedTime(&ms, a, never));
    CK(cuEventRecord(untimed, s));
    printf("elapsed_untimed=%d\n", (int)cuEventElapsedTime(&ms, a, untimed));

    /* The built-in kernel: its first parameter is the duration in ns. */
    uint64_t ns = 20000000;
    void *params[] = {&ns};
    CK(cuEventRecord(a, s));
    CK(cuLaunchKernel(sleep, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(b));
    printf("sleep_ms=%.3f\n", elapsed(a, b));

    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    CUlaunchConfig cfg = {.gridDimX = 4, .gridDimY = 1, .gridDimZ = 1, .blockDimX = 128, .blockDimY = 1,
                          .blockDimZ = 1, .hStream = s, .attrs = &attr, .numAttrs = 1};
    CK(cuEventRecord(a, s));
    CK(cuLaunchKernelEx(&cfg, k10, NULL, NULL));
    CK(cuLaunchCooperativeKernel(k10, 2, 1, 1, 32, 1, 1, 0, s, NULL));
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(b));
    printf("ex_and_coop_ms=%.3f\n", elapsed(a, b));
    printf("coop_too_large=%d\n", (int)cuLaunchCooperativeKernel(k10, 1 << 20, 1, 1, 32, 1, 1, 0, s, NULL));
    printf("bad_block=%d\n", (int)cuLaunchKernel(k10, 1, 1, 1, 2048, 1, 1, 0, s, NULL, NULL));

    /* s2 waits for b, recorded behind 30 ms of work on s. */
    launch(k10, s);
    launch(k10, s);
    launch(k10, s);
    CK(cuEventRecord(b, s));
    CK(cuStreamWaitEvent(s2, b, 0));
    printf("wait_event_query=%d\n", (int)cuStreamQuery(s2));
    t0 = now_ms();
    CK(cuCtxSynchronize());
    printf("ctx_sync_wall_ms=%.2f\n", now_ms() - t0);
    printf("wait_event_query_after=%d\n", (int)cuStreamQuery(s2));
}

/* --- per-thread default streams against the legacy stream -------------------------------- */

/* A's kernel: long enough that B's queries, made at once, come while it runs even on a
 * loaded host; B says so ("late") if they did not, rather than report a wrong order. */
#define A_KERNEL_MS 500.0

struct side {
    pthread_barrier_t go, done;
    int mode; /* 0: thread A queues on its per-thread stream, 1: on the legacy stream */
    double launched_ms; /* when A called its launch (its kernel started no sooner) */
};

static void *thread_a(void *arg) {
    struct side *sd = arg;
    CK(cuCtxSetCurrent(g_ctx));
    CUfunction k500 = kernel("k500ms");
    for (int round = 0; round < 2; round++) {
        pthread_barrier_wait(&sd->go);
        sd->launched_ms = now_ms(); /* before: the kernel starts no sooner, ends 500 ms later */
        if (sd->mode == 0) CK(launch_ptsz(k500, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        else CK(cuLaunchKernel(k500, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        pthread_barrier_wait(&sd->done);
    }
    return NULL;
}

/* Thread B records an event on each kind of stream while A's 500 ms kernel is queued, and
 * queries it at once: CUDA_ERROR_NOT_READY means that stream is ordered behind A's work.
 * Times are printed from A's launch: a stream behind A's kernel is done no sooner than it. */
static void b_side(const char *round, const struct side *sd, CUstream blocking,
                   CUstream nonblocking) {
    CUevent e[5];
    for (int i = 0; i < 5; i++) CK(cuEventCreate(&e[i], 0));
    CK(record_ptsz(e[0], NULL)); /* B's per-thread stream, through the _ptsz API */
    CK(cuEventRecord(e[1], CU_STREAM_PER_THREAD));
    CK(cuEventRecord(e[2], nonblocking));
    CK(cuEventRecord(e[3], blocking));
    CK(cuEventRecord(e[4], NULL)); /* the legacy stream */
    const char *names[] = {"ptds", "ptds_handle", "nonblocking", "blocking", "legacy"};
    for (int i = 0; i < 5; i++) printf("%s_%s=%d\n", round, names[i], (int)cuEventQuery(e[i]));
    printf("%s_legacy_stream_query=%d\n", round, (int)cuStreamQuery(NULL)); /* nothing queued on it */
    printf("%s_late=%d\n", round, now_ms() - sd->launched_ms >= A_KERNEL_MS);
    CK(cuEventSynchronize(e[0]));
    printf("%s_ptds_done_ms=%.2f\n", round, now_ms() - sd->launched_ms);
    CK(cuEventSynchronize(e[4]));
    printf("%s_legacy_done_ms=%.2f\n", round, now_ms() - sd->launched_ms);
    for (int i = 0; i < 5; i++) CK(cuEventDestroy(e[i]));
}

static void ptds(void) {
    struct side sd;
    pthread_barrier_init(&sd.go, NULL, 2);
    pthread_barrier_init(&sd.done, NULL, 2);
    pthread_t a;
    pthread_create(&a, NULL, thread_a, &sd);
    CUstream blocking, nonblocking;
    CK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
    CK(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING));
    const char *rounds[] = {"a_ptds", "a_legacy"};
    for (int r = 0; r < 2; r++) {
        sd.mode = r;
        pthread_barrier_wait(&sd.go);
        pthread_barrier_wait(&sd.done);
        b_side(rounds[r], &sd, blocking, nonblocking);
        CK(cuCtxSynchronize());
    }
    pthread_join(a, NULL);
}

/* --- graphs ------------------------------------------------------------------------------ */

static void graph(void) {
    CUfunction k10 = kernel("k10ms"), sleep = kernel("simgpu_sleep");
    CUstream s;
    CUevent a, b;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));

    CUstreamCaptureStatus st;
    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CK(cuStreamIsCapturing(s, &st));
    printf("capturing=%d\n", (int)st);
    for (int i = 0; i < 3; i++) launch(k10, s);
    CUgraph g;
    CK(cuStreamEndCapture(s, &g));
    printf("captured_ran=%d\n", (int)cuStreamQuery(s)); /* nothing was queued while capturing */
    size_t n = 0;
    CK(cuGraphGetNodes(g, NULL, &n));
    printf("captured_nodes=%zu\n", n);
    CUgraphExec x;
    CK(cuGraphInstantiate(&x, g, 0));
    CK(cuEventRecord(a, s));
    CK(cuGraphLaunch(x, s));
    CK(cuGraphLaunch(x, s));
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(b));
    printf("captured_graph_x2_ms=%.3f\n", elapsed(a, b));
    CK(cuGraphExecDestroy(x));
    CK(cuGraphDestroy(g));

    CK(cuGraphCreate(&g, 0));
    uint64_t ns = 5000000;
    void *params[] = {&ns};
    CUDA_KERNEL_NODE_PARAMS kp;
    memset(&kp, 0, sizeof kp);
    kp.func = sleep;
    kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1;
    kp.blockDimX = kp.blockDimY = kp.blockDimZ = 1;
    kp.kernelParams = params;
    CUgraphNode n1, n2;
    CK(cuGraphAddKernelNode(&n1, g, NULL, 0, &kp));
    ns = 0; /* the node copied its parameters */
    kp.func = k10;
    kp.kernelParams = NULL;
    CK(cuGraphAddKernelNode(&n2, g, &n1, 1, &kp));
    CK(cuGraphInstantiateWithFlags(&x, g, 0));
    CK(cuEventRecord(a, s));
    CK(cuGraphLaunch(x, s));
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(b));
    printf("built_graph_ms=%.3f\n", elapsed(a, b));

    CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    launch(k10, s);
    printf("sync_while_capturing=%d\n", (int)cuStreamSynchronize(s));
    printf("end_invalidated=%d\n", (int)cuStreamEndCapture(s, &g));
    printf("capture_legacy=%d\n", (int)cuStreamBeginCapture(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL));
}

/* --- the bounded launch queue ------------------------------------------------------------ */

static void bound(void) {
    CUfunction small = kernel("k500us"), k100 = kernel("k100ms");
    CUstream s;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    double t0 = now_ms();
    for (int i = 0; i < 1100; i++) launch(small, s); /* 550 ms of work, > 1024 launches */
    printf("count_bound_launch_ms=%.2f\n", now_ms() - t0);
    CK(cuStreamSynchronize(s));
    t0 = now_ms();
    for (int i = 0; i < 13; i++) launch(k100, s); /* 1.3 s of work, > 1 s ahead */
    printf("time_bound_launch_ms=%.2f\n", now_ms() - t0);
    t0 = now_ms();
    CK(cuStreamSynchronize(s));
    printf("time_bound_sync_ms=%.2f\n", now_ms() - t0);
}

/* --- contexts time-share the GPU ----------------------------------------------------------- */

/* Another context's 50 ms kernel is running when this one records an event, launches 10 ms
 * and records another: the first event is written only when the GPU turns to this context. */
static void contexts(void) {
    CUdevice dev;
    CUcontext other;
    CUmodule mod;
    CUfunction k50;
    CK(cuCtxGetDevice(&dev));
    CK(cuCtxCreate(&other, NULL, 0, dev)); /* current now */
    CK(cuModuleLoadData(&mod, "simgpu-module 1\nkernel k50ms 50ms\n"));
    CK(cuModuleGetFunction(&k50, mod, "k50ms"));
    launch(k50, NULL);
    CK(cuCtxSetCurrent(g_ctx));
    CUstream s;
    CUevent a, b, c;
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    CK(cuEventCreate(&c, 0));
    double t0 = now_ms();
    CK(cuEventRecord(a, s));
    printf("start_query=%d\n", (int)cuEventQuery(a));
    launch(kernel("k10ms"), s);
    CK(cuEventRecord(b, s));
    CK(cuEventSynchronize(a));
    printf("start_wall_ms=%.2f\n", now_ms() - t0);
    CK(cuEventSynchronize(b));
    printf("bracket_ms=%.3f\n", elapsed(a, b));
    /* The same context's other streams do not hold an event back (a GPU runs them at once). */
    CUstream s2;
    CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    launch(kernel("k100ms"), s);
    CK(cuEventRecord(c, s2));
    printf("own_stream_query=%d\n", (int)cuEventQuery(c));
    CK(cuCtxSynchronize());
    CK(cuCtxDestroy(other));
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "events";
    CK(cuInit(0));
    g_ctx = use_primary(0);
    CK(cuGetProcAddress("cuLaunchKernel", (void **)&launch_ptsz, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL));
    CK(cuGetProcAddress("cuEventRecord", (void **)&record_ptsz, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, NULL));
    CK(cuModuleLoadData(&g_mod, "simgpu-module 1\n"
                                "kernel k10ms 10ms   # the tests' unit of work\n"
                                "kernel k100ms 100000\n"
                                "kernel k500us 500us\n"
                                "kernel k500ms 500ms\n"));
    if (strcmp(what, "events") == 0) events();
    else if (strcmp(what, "ptds") == 0) ptds();
    else if (strcmp(what, "graph") == 0) graph();
    else if (strcmp(what, "bound") == 0) bound();
    else if (strcmp(what, "contexts") == 0) contexts();
    else return 2;
    printf("done=1\n");
    return 0;
}
