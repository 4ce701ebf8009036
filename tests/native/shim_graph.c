/* Graph memory through the shim: an allocation node held by executable graphs.
 *
 *   shim_graph <mode> <ordinal> <node-bytes> <chunk-bytes> [launch|upload|params][_ptsz]
 *
 * A graph with one allocation node of node-bytes on the device, and two executables of it.
 * Each is given its memory by the way the last argument names (default launch):
 *   launch  instantiated, then launched: launch<i>=<rc>
 *   upload  instantiated, then cuGraphUpload: give<i>=<rc>
 *   params  cuGraphInstantiateWithParams with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD:
 *           give<i>=<rc>, result<i>=<result_out>
 * (upload and params: _ptsz calls the per-thread-stream entry point instead)
 * after which view_free<i> and gmem<i> (the device's graph memory, as the driver reports it).
 * With upload or params the first executable is then launched: launch1=<rc>, view_free1l,
 * gmem1l. The second is refused when the limit cannot take a second copy. Then cuMemAlloc
 * chunks until refused: allocated=<bytes>; "hold", waits for a line. Then frees, destroys
 * the executables: end_free, end_gmem. */
#include "shim_test.h"

enum { MAX_CHUNKS = 1024 };

static size_t view_free(void) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    return f;
}

static __typeof__(cuDeviceGetGraphMemAttribute) *g_gmem_attr;
static int g_ordinal;

static unsigned long long graph_mem(void) {
    cuuint64_t v = 0;
    CK(g_gmem_attr(g_ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &v));
    return (unsigned long long)v;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <node-bytes> <chunk-bytes> [launch|upload|params]\n", argv[0]);
        return 2;
    }
    int ordinal = g_ordinal = atoi(argv[2]);
    const char *how = argc > 5 ? argv[5] : "launch";
    int ptsz = strstr(how, "_ptsz") != NULL;
    size_t len = strcspn(how, "_");
    int launch = strcmp(how, "launch") == 0, upload = !strncmp(how, "upload", len) && len == 6,
        params = !strncmp(how, "params", len) && len == 6;
    if (!launch && !upload && !params) {
        fprintf(stderr, "unknown way: %s\n", how);
        return 2;
    }
    shim_start(argv[1], ordinal);
    size_t node_bytes = strtoull(argv[3], NULL, 0), chunk = strtoull(argv[4], NULL, 0);
    __typeof__(cuGraphAddMemAllocNode) *add_alloc = (__typeof__(cuGraphAddMemAllocNode) *)dlsym(g_lib, "cuGraphAddMemAllocNode");
    __typeof__(cuGraphExecDestroy) *exec_destroy = (__typeof__(cuGraphExecDestroy) *)dlsym(g_lib, "cuGraphExecDestroy");
    __typeof__(cuGraphUpload) *graph_upload =
        (__typeof__(cuGraphUpload) *)dlsym(g_lib, ptsz ? "cuGraphUpload_ptsz" : "cuGraphUpload");
    __typeof__(cuGraphInstantiateWithParams) *inst_params = (__typeof__(cuGraphInstantiateWithParams) *)dlsym(
        g_lib, ptsz ? "cuGraphInstantiateWithParams_ptsz" : "cuGraphInstantiateWithParams");
    g_gmem_attr = (__typeof__(cuDeviceGetGraphMemAttribute) *)dlsym(g_lib, "cuDeviceGetGraphMemAttribute");
    if (!add_alloc || !exec_destroy || !graph_upload || !inst_params || !g_gmem_attr) return 3;
    CUstream s;
    CK(C(stream_create, cuStreamCreate)(&s, CU_STREAM_NON_BLOCKING));
    CUgraph g;
    CK(C(graph_create, cuGraphCreate)(&g, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.poolProps.location.id = ordinal;
    p.bytesize = node_bytes;
    CUgraphNode node;
    CK(add_alloc(&node, g, NULL, 0, &p));
    CUgraphExec x[2] = {NULL, NULL};
    int have[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        CUresult rc;
        if (params) {
            CUDA_GRAPH_INSTANTIATE_PARAMS ip;
            memset(&ip, 0, sizeof ip);
            ip.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD;
            ip.hUploadStream = s;
            ip.result_out = (CUgraphInstantiateResult)99; /* not set: shows as 99 */
            rc = inst_params(&x[i], g, &ip);
            have[i] = rc == CUDA_SUCCESS;
            printf("give%d=%d\nresult%d=%d\n", i + 1, (int)rc, i + 1, (int)ip.result_out);
        } else {
            CK(C(graph_instantiate, cuGraphInstantiateWithFlags)(&x[i], g, 0));
            have[i] = 1;
            rc = launch ? C(graph_launch, cuGraphLaunch)(x[i], s) : graph_upload(x[i], s);
            printf("%s%d=%d\n", launch ? "launch" : "give", i + 1, (int)rc);
        }
        CK(C(stream_sync, cuStreamSynchronize)(s));
        printf("view_free%d=%zu\ngmem%d=%llu\n", i + 1, view_free(), i + 1, graph_mem());
        if (i == 0 && !launch && have[0]) { /* its memory is there already: a launch takes none */
            printf("launch1=%d\n", (int)C(graph_launch, cuGraphLaunch)(x[0], s));
            CK(C(stream_sync, cuStreamSynchronize)(s));
            printf("view_free1l=%zu\ngmem1l=%llu\n", view_free(), graph_mem());
        }
    }
    static CUdeviceptr ptr[MAX_CHUNKS];
    int n = 0;
    while (n < MAX_CHUNKS && C(alloc, cuMemAlloc)(&ptr[n], chunk) == CUDA_SUCCESS) n++;
    printf("allocated=%llu\nhold\n", (unsigned long long)n * chunk);
    fflush(stdout);
    int c;
    while ((c = getchar()) != '\n' && c != EOF) {
    }
    for (int i = 0; i < n; i++) CK(C(free, cuMemFree)(ptr[i]));
    for (int i = 0; i < 2; i++)
        if (have[i]) CK(exec_destroy(x[i]));
    printf("end_free=%zu\nend_gmem=%llu\n", view_free(), graph_mem());
    return 0;
}
