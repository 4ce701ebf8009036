/* Graph memory through the shim: an allocation node held by executable graphs.
 *
 *   shim_graph <mode> <ordinal> <node-bytes> <chunk-bytes>
 *
 * A graph with one allocation node of node-bytes on the device, instantiated twice. The first
 * executable is launched (its memory is taken then): launch1=<rc>, view_free1; the second is
 * launched too: launch2=<rc> (refused when the limit cannot take a second copy), view_free2;
 * then cuMemAlloc chunks until refused: allocated=<bytes>; "hold", waits for a line. Then
 * frees, destroys both executables: end_free. */
#include "shim_test.h"

enum { MAX_CHUNKS = 1024 };

static size_t view_free(void) {
    size_t f = 0, t = 0;
    CK(C(mem_info, cuMemGetInfo)(&f, &t));
    return f;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s <mode> <ordinal> <node-bytes> <chunk-bytes>\n", argv[0]);
        return 2;
    }
    int ordinal = atoi(argv[2]);
    shim_start(argv[1], ordinal);
    size_t node_bytes = strtoull(argv[3], NULL, 0), chunk = strtoull(argv[4], NULL, 0);
    __typeof__(cuGraphAddMemAllocNode) *add_alloc = (__typeof__(cuGraphAddMemAllocNode) *)dlsym(g_lib, "cuGraphAddMemAllocNode");
    __typeof__(cuGraphExecDestroy) *exec_destroy = (__typeof__(cuGraphExecDestroy) *)dlsym(g_lib, "cuGraphExecDestroy");
    if (!add_alloc || !exec_destroy) return 3;
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
    CUgraphExec x1, x2;
    CK(C(graph_instantiate, cuGraphInstantiateWithFlags)(&x1, g, 0));
    CK(C(graph_instantiate, cuGraphInstantiateWithFlags)(&x2, g, 0));
    printf("launch1=%d\n", (int)C(graph_launch, cuGraphLaunch)(x1, s));
    CK(C(stream_sync, cuStreamSynchronize)(s));
    printf("view_free1=%zu\n", view_free());
    printf("launch2=%d\n", (int)C(graph_launch, cuGraphLaunch)(x2, s));
    CK(C(stream_sync, cuStreamSynchronize)(s));
    printf("view_free2=%zu\n", view_free());
    static CUdeviceptr ptr[MAX_CHUNKS];
    int n = 0;
    while (n < MAX_CHUNKS && C(alloc, cuMemAlloc)(&ptr[n], chunk) == CUDA_SUCCESS) n++;
    printf("allocated=%llu\nhold\n", (unsigned long long)n * chunk);
    fflush(stdout);
    int c;
    while ((c = getchar()) != '\n' && c != EOF) {
    }
    for (int i = 0; i < n; i++) CK(C(free, cuMemFree)(ptr[i]));
    CK(exec_destroy(x1));
    CK(exec_destroy(x2));
    printf("end_free=%zu\n", view_free());
    return 0;
}
