/* Logging: one line per event on stderr, prefixed "[vgpu]" (log.h). The level comes from
 * LIBVGPU_LOG_LEVEL (error|warn|info|debug, default warn), read once, at the first message or
 * the first hook; hooks test it with one branch (VLOG) so nothing is formatted on the hot path
 * unless debugging. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

static int g_level = -1; /* -1: not read yet */
static pthread_once_t g_level_once = PTHREAD_ONCE_INIT;

static void read_level(void) {
    static const char names[][6] = {"error", "warn", "info", "debug"}; /* no relocations */
    const char *v = getenv("LIBVGPU_LOG_LEVEL");
    int level = VGPU_LOG_WARN;
    if (v && *v) {
        int i = 0;
        while (i < 4 && strcasecmp(v, names[i]) != 0) i++;
        if (i < 4) level = i;
        else vgpu_log(VGPU_LOG_WARN, "LIBVGPU_LOG_LEVEL=%s is not error|warn|info|debug; using warn", v);
    }
    __atomic_store_n(&g_level, level, __ATOMIC_RELEASE);
}

int vgpu_log_level(void) {
    int level = __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
    if (__builtin_expect(level >= 0, 1)) return level;
    pthread_once(&g_level_once, read_level);
    return __atomic_load_n(&g_level, __ATOMIC_ACQUIRE);
}

void vgpu_log(int level, const char *fmt, ...) {
    static const char tags[][6] = {"error", "warn", "info", "debug"};
    char line[1024];
    int n = snprintf(line, sizeof line, "[vgpu] %s: ", tags[level < 0 ? 0 : level > 3 ? 3 : level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    /* One write, so lines of concurrent processes do not interleave. */
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}
