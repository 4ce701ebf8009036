/* The shim's version, so the host can tell which build a container has mapped. */
#define EXPORT __attribute__((visibility("default")))

EXPORT const char *vgpu_shim_version(void) { return VGPU_VERSION; }
