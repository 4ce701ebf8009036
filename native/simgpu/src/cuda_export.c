/* cuGetExportTable: the private tables NVIDIA's CUDA runtime (libcudart) asks its driver for.
 *
 * A table is an array of pointers; most start with their own size in bytes. What each slot
 * does is known from the runtime's use of it and from ZLUDA's public reverse engineering
 * (github.com/vosen/ZLUDA, dark_api); slots nobody has seen used answer
 * CUDA_ERROR_NOT_SUPPORTED, and SIMGPU_TRACE=1 names them on stderr when called. The runtime
 * asks for the tables in a fixed order at initialisation and gives up at the first one it needs
 * and does not get: an unknown table is CUDA_ERROR_NOT_FOUND, which 12.9-13.2 accept for the
 * optional f8cff951-... table. 13.5 also needs the 21318c60-... table (cuda_toolsctx.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

typedef void (*sim_slot)(void);

/* A slot whose use is unknown: says so, and fails. Distinct functions, so a trace names it. */
#define UNKNOWN_SLOT(table, n)                                                                   \
    static CUresult unknown_##table##_##n(void) {                                                \
        if (sim_trace()) fprintf(stderr, "simgpu: export table %s slot %d called (unknown)\n", #table, n); \
        return CUDA_ERROR_NOT_SUPPORTED;                                                          \
    }

#define SLOT(f) ((void *)(sim_slot)(f))
#define SIZE_SLOT(n) ((void *)(uintptr_t)((n) * sizeof(void *)))

/* --- 6bd5fb6c-...: the runtime interface ------------------------------------------------- */

/* __fatBinC_Wrapper_t, as nvcc emits it around a fat binary. */
struct fatbinc_wrapper {
    uint32_t magic; /* 0x466243b1 */
    uint32_t version;
    const void *data; /* the fat binary, starting with its header */
    const void *filename_or_fatbins;
};

#define FATBINC_MAGIC 0x466243b1u
#define FATBIN_MAGIC 0xba55ed50u

static CUresult load_fatbin(CUmodule *mod, const void *fatbin) {
    if (!mod || !fatbin) return CUDA_ERROR_INVALID_VALUE;
    uint32_t magic;
    memcpy(&magic, fatbin, sizeof magic);
    if (magic != FATBIN_MAGIC) return CUDA_ERROR_INVALID_IMAGE;
    return sim_module_load_current(mod, fatbin);
}

static CUresult wrapped_fatbin(CUmodule *mod, const struct fatbinc_wrapper *w) {
    if (!mod || !w) return CUDA_ERROR_INVALID_VALUE;
    if (w->magic != FATBINC_MAGIC) return CUDA_ERROR_INVALID_IMAGE;
    return load_fatbin(mod, w->data);
}

/* Slot 1: load the fat binary a registration wrapper points to, in the current context. */
static CUresult rt_load_wrapped(CUmodule *mod, const struct fatbinc_wrapper *w) { return wrapped_fatbin(mod, w); }

/* Slot 6: the same with extra arguments (host variables to link; none used by a simulator). */
static CUresult rt_load_wrapped_ex(CUmodule *mod, const struct fatbinc_wrapper *w, void *a3, void *a4, unsigned int a5) {
    (void)a3, (void)a4, (void)a5;
    return wrapped_fatbin(mod, w);
}

/* Slot 8: a bare fat binary (the header first). */
static CUresult rt_load_fatbin_ex(const void *fatbin, CUmodule *mod, void *a3, void *a4, unsigned int a5) {
    (void)a3, (void)a4, (void)a5;
    return load_fatbin(mod, fatbin);
}

/* Slot 7: told something per module at registration; nothing to do. */
static CUresult rt_notify(uintptr_t arg) {
    (void)arg;
    return CUDA_SUCCESS;
}

UNKNOWN_SLOT(cudart, 3)
UNKNOWN_SLOT(cudart, 4)
UNKNOWN_SLOT(cudart, 5)
UNKNOWN_SLOT(cudart, 9)
UNKNOWN_SLOT(cudart, 10)
UNKNOWN_SLOT(cudart, 11)
UNKNOWN_SLOT(cudart, 13)
UNKNOWN_SLOT(cudart, 14)
UNKNOWN_SLOT(cudart, 15)

/* Slot 12: called once by the 13.2 runtime at initialisation, its argument registers holding
 * leftovers (it reads no arguments that we could see); success lets the runtime go on. */
static CUresult rt_init_13_2(void) { return CUDA_SUCCESS; }

#define CUDART_SLOTS 16
static void *const k_cudart[CUDART_SLOTS] = {
    SIZE_SLOT(CUDART_SLOTS), SLOT(rt_load_wrapped),   SLOT(sim_primary_ctx_get), SLOT(unknown_cudart_3),
    SLOT(unknown_cudart_4),  SLOT(unknown_cudart_5),  SLOT(rt_load_wrapped_ex),  SLOT(rt_notify),
    SLOT(rt_load_fatbin_ex), SLOT(unknown_cudart_9),  SLOT(unknown_cudart_10),   SLOT(unknown_cudart_11),
    SLOT(rt_init_13_2),           SLOT(unknown_cudart_13), SLOT(unknown_cudart_14),   SLOT(unknown_cudart_15),
};

/* --- a094798c-...: runtime callback hooks (for profilers) --------------------------------- */

static uint32_t g_hook_buf1[1024], g_hook_buf2[14];

/* Slots 2 and 6 hand the runtime buffers where tools would find its callbacks. */
static void hooks_buffer1(void **ptr, size_t *size) {
    if (ptr) *ptr = g_hook_buf1;
    if (size) *size = sizeof g_hook_buf1;
}

static void hooks_buffer2(void **ptr, size_t *size) {
    if (ptr) *ptr = g_hook_buf2;
    if (size) *size = sizeof g_hook_buf2;
}

UNKNOWN_SLOT(hooks, 1)
UNKNOWN_SLOT(hooks, 3)
UNKNOWN_SLOT(hooks, 4)
UNKNOWN_SLOT(hooks, 5)

#define HOOKS_SLOTS 7
static void *const k_hooks[HOOKS_SLOTS] = {
    SIZE_SLOT(HOOKS_SLOTS), SLOT(unknown_hooks_1), SLOT(hooks_buffer1), SLOT(unknown_hooks_3),
    SLOT(unknown_hooks_4),  SLOT(unknown_hooks_5), SLOT(hooks_buffer2),
};

/* --- 42d85a81-...: tools thread-local storage -------------------------------------------- */

/* Slot 2 (void **out): the calling thread's current context (NULL when none). cuBLASLt 12.9
 * calls it at cublasCreate and per matmul heuristic query, then asks the tools context table
 * for that context's number (cuda_toolsctx.c, slot 4) to key its per-context caches. Slots 1
 * and 3 are empty: no caller seen uses them. */
static CUresult tls_current_ctx(void **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = sim_ctx_top();
    return CUDA_SUCCESS;
}

#define TLS_SLOTS 4
static void *const k_tools_tls[TLS_SLOTS] = {SIZE_SLOT(TLS_SLOTS), NULL, SLOT(tls_current_ctx), NULL};

/* --- c693336e-...: context-local storage (no size slot: the table starts with put) -------- */

static void *const k_cls[4] = {SLOT(sim_cls_put), SLOT(sim_cls_delete), SLOT(sim_cls_get), NULL};

/* --- 263e8860-...: context checks --------------------------------------------------------- */

/* Slot 2: whether a context is a wrapped one (never, here). */
static CUresult check_context(CUcontext ctx, uint32_t *wrapped, void **inner) {
    (void)ctx, (void)inner;
    if (wrapped) *wrapped = 0;
    return CUDA_SUCCESS;
}

/* Slot 3: a flag that is 0 on every driver observed. */
static uint32_t check_flag(void) { return 0; }

UNKNOWN_SLOT(checks, 1)

#define CHECK_SLOTS 4
static void *const k_checks[CHECK_SLOTS] = {
    SIZE_SLOT(CHECK_SLOTS), SLOT(unknown_checks_1), SLOT(check_context), SLOT(check_flag),
};

/* --- d4082055-...: the integrity check ---------------------------------------------------- */

static CUresult integrity(uint32_t version, uint64_t unix_seconds, uint64_t *result);

#define INTEGRITY_SLOTS 3
static void *const k_integrity[INTEGRITY_SLOTS] = {SIZE_SLOT(INTEGRITY_SLOTS), SLOT(integrity), NULL};

static CUresult integrity(uint32_t version, uint64_t unix_seconds, uint64_t *result) {
    return sim_integrity_answer(version, unix_seconds, result, k_cudart, k_integrity, k_integrity[1]);
}

/* --- 1734dc26-...: asked for by cuBLASLt 13 -------------------------------------------------
 * cuBLASLt 13.1's half-precision matmul heuristics ask for it and call its slot 4 (two output
 * pointers) without checking that the driver gave the table: without one they jump through
 * NULL. What the slots do is not public; each answers CUDA_ERROR_NOT_SUPPORTED (named by
 * SIMGPU_TRACE=1), on which cuBLASLt takes its path without them. The size is our guess. */
UNKNOWN_SLOT(lt, 1)
UNKNOWN_SLOT(lt, 2)
UNKNOWN_SLOT(lt, 3)
UNKNOWN_SLOT(lt, 4)
UNKNOWN_SLOT(lt, 5)
UNKNOWN_SLOT(lt, 6)
UNKNOWN_SLOT(lt, 7)
UNKNOWN_SLOT(lt, 8)

#define LT_SLOTS 9
static void *const k_lt[LT_SLOTS] = {
    SIZE_SLOT(LT_SLOTS),  SLOT(unknown_lt_1), SLOT(unknown_lt_2), SLOT(unknown_lt_3), SLOT(unknown_lt_4),
    SLOT(unknown_lt_5), SLOT(unknown_lt_6), SLOT(unknown_lt_7), SLOT(unknown_lt_8),
};

/* --- lookup ------------------------------------------------------------------------------- */

struct table {
    uint8_t id[16];
    void *const *slots;
};

static const struct table k_tables[] = {
    {{0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9}, k_cudart},
    {{0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66}, k_hooks},
    {{0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc}, k_tools_tls},
    {{0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93}, k_cls},
    {{0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e}, k_checks},
    {{0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2}, k_integrity},
    {{0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2}, sim_tools_ctx_table},
    {{0x17, 0x34, 0xdc, 0x26, 0x80, 0x0d, 0x47, 0x45, 0x87, 0x26, 0xc0, 0xf1, 0xe7, 0xdd, 0x8b, 0xca}, k_lt},
};

/* Works before cuInit, as the real one does: the runtime asks before initialising. */
CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    if (!ppExportTable || !pExportTableId) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof k_tables / sizeof k_tables[0]; i++) {
        if (memcmp(k_tables[i].id, pExportTableId->bytes, 16) == 0) {
            *ppExportTable = k_tables[i].slots;
            return CUDA_SUCCESS;
        }
    }
    if (sim_trace()) {
        const uint8_t *b = (const uint8_t *)pExportTableId->bytes;
        fprintf(stderr, "simgpu: export table %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x not provided\n",
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    }
    *ppExportTable = NULL;
    return CUDA_ERROR_NOT_FOUND;
}

SIM_SELF(cuGetExportTable)
