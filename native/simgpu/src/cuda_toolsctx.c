/* The 21318c60-9714-3248-8ca6-41ff7324c8f2 export table: the driver's context table for tools.
 *
 * NVIDIA's runtime from 13.5 on asks cuGetExportTable for it at initialisation and gives up
 * (cudaErrorNotFound from its first call) when the driver does not have it; 12.9-13.2 never
 * ask. Public notes name it after contexts: NVIDIA's cuxtra library calls it
 * CU_ETID_ToolsContext, and probes of the real driver name slot 3 "get device" and slot 4 "get
 * context number" and report a size slot and 94 entries (driver 595). The 13.5.37 runtime only
 * needs the table to exist: over initialisation, allocation (cudaMalloc and the stream-ordered
 * pools), copies, PyTorch's kernel launches and out-of-memory handling it reads none of its
 * slots (measured by handing it an unreadable page instead). cuBLASLt 12.9 reads slot 4
 * (context, u64 *number) for the current context (from the tools TLS table's slot 2) to key its
 * caches: it gets the context's unique id, as cuCtxGetId gives it. Every other slot is one that
 * says so: SIMGPU_TRACE=1 names it with its first arguments, and it answers
 * CUDA_ERROR_NOT_SUPPORTED. */
#include <stdio.h>

#include "cuda_internal.h"

#define TOOLS_CTX_SLOTS 95 /* the size slot, then 94 entries */

static CUresult tools_ctx_unknown(int slot, uintptr_t a0, uintptr_t a1, uintptr_t a2) {
    if (sim_trace())
        fprintf(stderr, "simgpu: export table 21318c60 slot %d called (unknown; %#lx, %#lx, %#lx)\n", slot,
                (unsigned long)a0, (unsigned long)a1, (unsigned long)a2);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* One function per slot, so a trace names the slot. */
#define U(n) \
    static CUresult tc_##n(uintptr_t a0, uintptr_t a1, uintptr_t a2) { return tools_ctx_unknown(n, a0, a1, a2); }
#define U10(t) U(t##0) U(t##1) U(t##2) U(t##3) U(t##4) U(t##5) U(t##6) U(t##7) U(t##8) U(t##9)
U(1) U(2) U(3) U(5) U(6) U(7) U(8) U(9)

/* Slot 4: the context's number (its unique id). */
static CUresult tc_4(CUcontext ctx, unsigned long long *number) {
    CUresult rc = sim_ctx_valid(ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (!number) return CUDA_ERROR_INVALID_VALUE;
    *number = ctx->id;
    return CUDA_SUCCESS;
}
U10(1) U10(2) U10(3) U10(4) U10(5) U10(6) U10(7) U10(8)
U(90) U(91) U(92) U(93) U(94)

#define S(n) (void *)(uintptr_t)tc_##n
#define S10(t) S(t##0), S(t##1), S(t##2), S(t##3), S(t##4), S(t##5), S(t##6), S(t##7), S(t##8), S(t##9)
void *const sim_tools_ctx_table[TOOLS_CTX_SLOTS] = {
    (void *)(uintptr_t)(TOOLS_CTX_SLOTS * sizeof(void *)),
    S(1), S(2), S(3), S(4), S(5), S(6), S(7), S(8), S(9),
    S10(1), S10(2), S10(3), S10(4), S10(5), S10(6), S10(7), S10(8),
    S(90), S(91), S(92), S(93), S(94),
};
