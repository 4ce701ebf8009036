/* Logging: one line per event on stderr, prefixed "[vgpu]". The level comes from
 * LIBVGPU_LOG_LEVEL (error|warn|info|debug, default warn), read once at load; hooks test it
 * with one branch (VLOG) so nothing is formatted on the hot path unless debugging. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

int vgpu_log_level_from_env(void) {
    static const char *const names[] = {"error", "warn", "info", "debug"};
    const char *v = getenv("LIBVGPU_LOG_LEVEL");
    if (!v || !*v) return VGPU_LOG_WARN;
    for (int i = 0; i < 4; i++)
        if (strcasecmp(v, names[i]) == 0) return i;
    fprintf(stderr, "[vgpu] warn: LIBVGPU_LOG_LEVEL=%s is not error|warn|info|debug; using warn\n", v);
    return VGPU_LOG_WARN;
}

void vgpu_log(int level, const char *fmt, ...) {
    static const char *const tags[] = {"error", "warn", "info", "debug"};
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
