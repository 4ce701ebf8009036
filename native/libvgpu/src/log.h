/* The shim's one logger (log.c), for the hooks and the region alike: one line per event on
 * stderr, "[vgpu] <level>: ...", written with a single write(2). The level comes from
 * LIBVGPU_LOG_LEVEL (error|warn|info|debug, default warn), read once. Kept apart from shim.h
 * so that the region's sources, which know nothing of CUDA, use the same logger. */
#ifndef VGPU_LOG_H
#define VGPU_LOG_H

enum { VGPU_LOG_ERROR = 0, VGPU_LOG_WARN = 1, VGPU_LOG_INFO = 2, VGPU_LOG_DEBUG = 3 };

/* The level, read from LIBVGPU_LOG_LEVEL on first use (a complaint about a bad value once). */
__attribute__((visibility("hidden"))) int vgpu_log_level(void);
__attribute__((visibility("hidden"))) void vgpu_log(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Format only when the level is on: one load and a branch otherwise. */
#define VGPU_LOGF(level, ...)                                                                  \
    do {                                                                                       \
        if (__builtin_expect((level) <= vgpu_log_level(), 0)) vgpu_log((level), __VA_ARGS__);  \
    } while (0)

#endif
