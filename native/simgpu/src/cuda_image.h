/* GPU images (cuda_image.c): the kernels, variables and device memory of a fat binary or
 * cubin, for the module that loads it. Pure parsing, no driver state. */
#ifndef SIMGPU_CUDA_IMAGE_H
#define SIMGPU_CUDA_IMAGE_H

#include <stddef.h>
#include <stdint.h>

struct sim_image_global {
    char *name;
    uint64_t off;  /* in the module's globals area */
    uint64_t size;
};

struct sim_image {
    size_t nkern;
    char **kernels; /* entry points (__global__ functions) */
    uint64_t *kernel_bytes; /* each one's code, loaded at its first launch when loading is lazy */
    size_t nglob;
    struct sim_image_global *globals;
    uint64_t globals_size; /* the area holding every variable section, aligned as the image says */
    uint8_t *init;         /* globals_size bytes: initial contents (zero where the image has none) */
    uint64_t device_bytes; /* what loading takes on the GPU: code, constant banks, variables */
    int foreign;           /* built for other GPUs only: names known, nothing runs here */
};

enum sim_image_status {
    SIM_IMAGE_READ,      /* *out describes it */
    SIM_IMAGE_OPAQUE,    /* PTX, unknown bytes, or a compression this host cannot decode */
    SIM_IMAGE_INVALID,   /* a fat binary or ELF that is malformed */
    SIM_IMAGE_NO_BINARY, /* nothing for the device's architecture; *out, if set, is the image
                          * for another (foreign: its names only) */
    SIM_IMAGE_NOMEM,
};

/* Read `image` (a fat binary, its registration wrapper, or a cubin) for a device of compute
 * capability cc (major * 10 + minor). */
enum sim_image_status sim_image_read(const void *image, int cc, struct sim_image **out)
    __attribute__((visibility("hidden")));
int sim_image_from_ptx(const char *p, size_t n, struct sim_image *img) __attribute__((visibility("hidden")));
int sim_image_from_elf(const uint8_t *p, uint64_t size, struct sim_image *img) __attribute__((visibility("hidden")));
/* An LZ4 block of n bytes into exactly cap bytes: 0, or -1 when malformed. */
int sim_lz4_decode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap) __attribute__((visibility("hidden")));
void sim_image_free(struct sim_image *img) __attribute__((visibility("hidden")));
/* The kernel's index in img->kernels, or -1. */
int sim_image_kernel(const struct sim_image *img, const char *name) __attribute__((visibility("hidden")));
const struct sim_image_global *sim_image_global(const struct sim_image *img, const char *name)
    __attribute__((visibility("hidden")));

#endif
