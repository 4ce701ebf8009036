/* A steady stream of kernels of a known duration, through one launch API, for `seconds`;
 * reports the GPU time its kernels took per one-second window, as a percentage.
 *
 *   shim_launch <mode> <ordinal> <api> <kernel-us>[,<kernel-us>...] <seconds> [in-flight] [streams]
 *
 * api: kernel ptsz ex ex_ptsz coop coop_ptsz graph graph_ptsz (the _ptsz forms use the
 * per-thread default stream, NULL). Several durations (not with graphs, whose parameters are
 * fixed when built) are cycled through launch by launch, all as the same function with the same
 * grid (simgpu_sleep with the duration as its parameter): a kernel whose run time varies from
 * one launch to the next, as the shim sees it. With several `streams` (not with the _ptsz forms)
 * launches go round-robin over that many streams of the context, which a GPU may run
 * concurrently. Up to `in-flight` (default 4) kernels are queued; each
 * completion is attributed to the window in which the program saw it. Prints launched=<n>,
 * window_<i>=<percent> for each whole window and mean=<percent> over windows 1.. (window 0
 * is the warm-up). With SHIM_LAUNCH_STOP_ON_STDIN set it also stops at a line (or the end) on
 * stdin, `seconds` then being the most it runs: a test measures until it has what it needs,
 * however long a loaded host kept the launchers from running. */
#include <poll.h>

#include "shim_test.h"

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <api> <kernel-us> <seconds> [in-flight] [streams]\n", argv[0]);
        return 2;
    }
    const char *api = argv[3];
    enum { MAX_DUR = 16 };
    unsigned durs[MAX_DUR];
    int ndur = 0;
    for (char *tok = strtok(argv[4], ","); tok && ndur < MAX_DUR; tok = strtok(NULL, ","))
        durs[ndur++] = (unsigned)atoi(tok);
    if (ndur == 0 || (ndur > 1 && !strncmp(api, "graph", 5))) {
        fprintf(stderr, "bad durations %s for %s\n", argv[4], api);
        return 2;
    }
    int seconds = atoi(argv[5]);
    int depth = argc > 6 ? atoi(argv[6]) : 4;
    int ptsz = strstr(api, "_ptsz") || !strcmp(api, "ptsz");
    enum { MAX_STREAMS = 8 };
    int nstreams = argc > 7 ? atoi(argv[7]) : 1;
    if (nstreams < 1 || nstreams > MAX_STREAMS || (nstreams > 1 && ptsz)) {
        fprintf(stderr, "bad stream count %s for %s\n", argv[7], api);
        return 2;
    }
    shim_start(argv[1], atoi(argv[2]));
    char image[128];
    snprintf(image, sizeof image, "simgpu-module 1\nkernel busy %uus\n", durs[0]);
    CUmodule mod;
    CUfunction f;
    CK(C(module_load, cuModuleLoadData)(&mod, image));
    CK(C(get_function, cuModuleGetFunction)(&f, mod, ndur > 1 ? "simgpu_sleep" : "busy"));
    uint64_t sleep_ns = 0;
    void *args_[] = {&sleep_ns};
    void **args = ndur > 1 ? args_ : NULL;
    CUstream streams[MAX_STREAMS] = {NULL}, s = NULL;
    for (int i = 0; i < nstreams && !ptsz; i++) CK(C(stream_create, cuStreamCreate)(&streams[i], CU_STREAM_NON_BLOCKING));
    CUgraphExec exec = NULL;
    if (!strncmp(api, "graph", 5)) {
        CUgraph g;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS kp;
        memset(&kp, 0, sizeof kp);
        kp.func = f;
        kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1;
        kp.blockDimX = 32;
        kp.blockDimY = kp.blockDimZ = 1;
        CK(C(graph_create, cuGraphCreate)(&g, 0));
        CK(C(graph_add_kernel, cuGraphAddKernelNode)(&node, g, NULL, 0, &kp));
        CK(C(graph_instantiate, cuGraphInstantiateWithFlags)(&exec, g, 0));
    }
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 32;
    cfg.blockDimY = cfg.blockDimZ = 1;
    CUevent *ev = calloc((size_t)depth, sizeof *ev);
    unsigned *ev_us = calloc((size_t)depth, sizeof *ev_us); /* what the kernel before ev[i] runs */
    for (int i = 0; i < depth; i++) CK(C(event_create, cuEventCreate)(&ev[i], 0));
    /* With SHIM_LAUNCH_GATE set: say "ready" and wait for a line on stdin before the clock
     * starts, so that a test's several launchers run together however long the host took to
     * start each one. */
    if (getenv("SHIM_LAUNCH_GATE")) {
        char go[16];
        printf("ready\n");
        fflush(stdout);
        if (!fgets(go, sizeof go, stdin)) {
            fprintf(stderr, "no go line on stdin\n");
            return 2;
        }
    }
    double busy_us[64] = {0};
    double start = shim_now_ms(), deadline = start + seconds * 1e3;
    long launched = 0, done = 0;
    struct pollfd in = {.fd = 0, .events = POLLIN};
    int stop_on_stdin = getenv("SHIM_LAUNCH_STOP_ON_STDIN") != NULL;
    while (shim_now_ms() < deadline) {
        if (stop_on_stdin && poll(&in, 1, 0) > 0) break;
        unsigned us = durs[launched % ndur];
        s = cfg.hStream = streams[launched % nstreams];
        sleep_ns = (uint64_t)us * 1000u;
        CUresult rc;
        if (!strcmp(api, "kernel")) rc = C(launch, cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, s, args, NULL);
        else if (!strcmp(api, "ptsz")) rc = C(launch_ptsz, cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, NULL, args, NULL);
        else if (!strcmp(api, "ex")) rc = C(launch_ex, cuLaunchKernelEx)(&cfg, f, args, NULL);
        else if (!strcmp(api, "ex_ptsz")) rc = C(launch_ex_ptsz, cuLaunchKernelEx)(&cfg, f, args, NULL);
        else if (!strcmp(api, "coop")) rc = C(launch_coop, cuLaunchCooperativeKernel)(f, 1, 1, 1, 32, 1, 1, 0, s, args);
        else if (!strcmp(api, "coop_ptsz"))
            rc = C(launch_coop_ptsz, cuLaunchCooperativeKernel)(f, 1, 1, 1, 32, 1, 1, 0, NULL, args);
        else if (!strcmp(api, "graph")) rc = C(graph_launch, cuGraphLaunch)(exec, s);
        else if (!strcmp(api, "graph_ptsz")) rc = C(graph_launch_ptsz, cuGraphLaunch)(exec, NULL);
        else {
            fprintf(stderr, "unknown api %s\n", api);
            return 2;
        }
        CK(rc);
        if (ptsz) CK(C(event_record_ptsz, cuEventRecord)(ev[launched % depth], NULL));
        else CK(C(event_record, cuEventRecord)(ev[launched % depth], s));
        ev_us[launched % depth] = us;
        launched++;
        if (launched >= depth) {
            CK(C(event_sync, cuEventSynchronize)(ev[launched % depth]));
            double t = shim_now_ms();
            int w = (int)((t - start) / 1e3);
            if (t < deadline && w < 64) busy_us[w] += ev_us[launched % depth];
            done++;
        }
    }
    printf("launched=%ld\ncompleted=%ld\n", launched, done);
    double sum = 0;
    for (int w = 0; w < seconds && w < 64; w++) {
        printf("window_%d=%.1f\n", w, busy_us[w] / 1e4);
        if (w > 0) sum += busy_us[w] / 1e4;
    }
    printf("mean=%.1f\n", seconds > 1 ? sum / (seconds - 1) : 0.0);
    free(ev);
    free(ev_us);
    return 0;
}
