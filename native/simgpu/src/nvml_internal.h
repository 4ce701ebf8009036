/* Private to the simulated libnvidia-ml.so.1 (nvml_*.c): library state, device records and
 * the checks every entry point shares.
 *
 * Signatures come from NVIDIA's nvml.h when the build has it (VGPU_NVML_INCLUDE_DIR), else from
 * native/compat/nvml/nvml.h; either way a mismatch with what we define is a compile error.
 */
#ifndef SIMGPU_NVML_INTERNAL_H
#define SIMGPU_NVML_INTERNAL_H

/* We export the legacy unversioned names (nvmlInit, nvmlDeviceGetCount, ...) next to the
 * versioned ones: without this the header would rename our definitions to the _vN names. */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <pthread.h>
#include <stdint.h>

#include "state.h"

#define NVML_HIDDEN __attribute__((visibility("hidden")))

/* What nvmlDevice_t points to: one record per GPU this process may see, process-local, so a
 * handle stays a plain pointer that pynvml can compare and pass back. */
struct nvmlDevice_st {
    uint32_t index; /* NVML index: position among the visible GPUs */
    uint32_t phys;  /* index of the GPU on the simulated node */
};

struct nvml_lib {
    pthread_mutex_t mu;      /* init/shutdown */
    _Atomic uint32_t refs;   /* nvmlInit calls not yet matched by nvmlShutdown */
    uint32_t count;          /* visible GPUs, fixed by the first nvmlInit */
    struct nvmlDevice_st devices[SIMGPU_MAX_GPUS];
};

extern struct nvml_lib nvml_lib NVML_HIDDEN;

/* Event types a simulated GPU accepts: those of a data-centre GPU with ECC. Only XIDs are ever
 * generated (injected through the control API). */
#define NVML_SIM_EVENT_TYPES \
    ((unsigned long long)(nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | \
                          nvmlEventTypeDoubleBitEccError))

/* NVML_SUCCESS when nvmlInit is in effect, else NVML_ERROR_UNINITIALIZED. */
NVML_HIDDEN nvmlReturn_t nvml_ready(void);

/* Validates `device` (initialized library, one of our handles) and answers
 * NVML_ERROR_GPU_IS_LOST while the node marks its GPU lost; on success *cfg is its config. */
NVML_HIDDEN nvmlReturn_t nvml_device(nvmlDevice_t device, const struct simgpu_gpu_config **cfg);

/* The same without the lost check, for calls that must still see a lost GPU (event sets). */
NVML_HIDDEN nvmlReturn_t nvml_device_any(nvmlDevice_t device);

/* Copies a string into a caller's buffer of `length` bytes, NUL included:
 * NVML_ERROR_INSUFFICIENT_SIZE when it does not fit. */
NVML_HIDDEN nvmlReturn_t nvml_put_string(char *dst, unsigned int length, const char *src);

#endif
