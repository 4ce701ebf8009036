/* Fill a GPU: allocate in halving chunks until CUDA_ERROR_OUT_OF_MEMORY at 1 byte, so the total
 * is exactly what the node had left. With --hold, keep the memory until stdin closes (another
 * process can then look at the node); --limit N stops at N bytes.
 *
 *   cuda_mem_fill <ordinal> [--hold] [--limit BYTES]
 */
#include <string.h>
#include <unistd.h>

#include "cuda_test.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s <ordinal> [--hold] [--limit BYTES]\n", argv[0]);
        return 2;
    }
    int hold = 0;
    unsigned long long limit = ~0ull;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--hold") == 0) hold = 1;
        else if (strcmp(argv[i], "--limit") == 0 && i + 1 < argc) limit = strtoull(argv[++i], NULL, 0);
    }
    CK(cuInit(0));
    use_primary(atoi(argv[1]));
    size_t total;
    size_t start_free;
    CK(cuMemGetInfo(&start_free, &total));
    printf("start_free=%zu\ntotal=%zu\n", start_free, total);

    static CUdeviceptr ptrs[4096];
    int n = 0;
    unsigned long long allocated = 0;
    for (size_t chunk = 1ull << 30; chunk >= 1 && n < 4096;) {
        if (allocated + chunk > limit) {
            chunk /= 2;
            continue;
        }
        CUresult rc = cuMemAlloc(&ptrs[n], chunk);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            chunk /= 2;
            continue;
        }
        CK(rc);
        n++;
        allocated += chunk;
    }
    printf("allocated=%llu\nend_free=%zu\n", allocated, free_bytes());
    if (limit == ~0ull) {
        CUdeviceptr extra; /* full: not even one more byte */
        printf("last_rc=%d\n", (int)cuMemAlloc(&extra, 1));
    }
    if (hold) {
        printf("holding\n");
        fflush(stdout);
        char buf[64];
        while (read(0, buf, sizeof buf) > 0) {
        }
    }
    for (int i = 0; i < n; i++) CK(cuMemFree(ptrs[i]));
    printf("freed_free=%zu\n", free_bytes());
    return 0;
}
