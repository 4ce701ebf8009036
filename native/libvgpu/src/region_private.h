/* The region's entry points for the shim's own use (hidden: not part of region.h's ABI). */
#ifndef VGPU_REGION_PRIVATE_H
#define VGPU_REGION_PRIVATE_H

#include <stdint.h>

#include "vgpu/region.h"

#define VGPU_REGION_HIDDEN __attribute__((visibility("hidden")))

/* This process's committed charge on dev (charged, less what is between reserve and commit). */
VGPU_REGION_HIDDEN uint64_t vgpu_region_own_committed(const struct vgpu_region *r, int dev);
/* 1 if a live slot of the region records `pid` (the container's processes, in its pid namespace). */
VGPU_REGION_HIDDEN int vgpu_region_has_pid(const struct vgpu_region *r, int32_t pid);

enum vgpu_region_counter { VGPU_COUNT_REFUSED, VGPU_COUNT_FALLBACK, VGPU_COUNT_GPU_NS };
/* Add n to one of device dev's counters (atomic, no lock). */
VGPU_REGION_HIDDEN void vgpu_region_count(struct vgpu_region *r, int dev, enum vgpu_region_counter what,
                                          uint64_t n);

/* Charge `bytes` on dev to this process whatever the limit: memory the driver already gave
 * (an executable graph's, known only after its launch). The container is then over its
 * limit, and its allocations are refused until it is back under. */
VGPU_REGION_HIDDEN void vgpu_region_force(struct vgpu_region *r, int dev, uint64_t bytes);

#endif
