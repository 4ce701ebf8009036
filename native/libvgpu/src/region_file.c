/* The region file: creation (complete before anyone can see it), mapping and validation
 * (a file that is not exactly our layout is refused, never repaired), slot liveness locks. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "region_internal.h"

static const char k_magic[8] = "VGPUREG";

/* A NUL within the n bytes of s (memchr, less an import: each costs every process a
 * relocation at load). */
static int terminated(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!s[i]) return 1;
    return 0;
}

_Static_assert(sizeof(struct vgpu_region_slot) % 64 == 0, "slots must fill whole cache lines");
_Static_assert(offsetof(struct vgpu_region_file, lock) == 64 &&
                   offsetof(struct vgpu_region_file, stats) == 320,
               "the lock word and slot_hwm on line 1, the counters from byte 320");
_Static_assert(offsetof(struct vgpu_region_file, slots) % 64 == 0, "slots are line-aligned");
_Static_assert(sizeof(((struct vgpu_limits *)0)->devices) ==
                   VGPU_MAX_DEVICES * sizeof(struct vgpu_device_limit),
               "header literals disagree with VGPU_MAX_DEVICES");
_Static_assert(sizeof(((struct vgpu_region_file *)0)->slots) ==
                   VGPU_MAX_SLOTS * sizeof(struct vgpu_region_slot),
               "header literals disagree with VGPU_MAX_SLOTS");
_Static_assert(sizeof(((struct vgpu_region_device *)0)->uuid) == VGPU_UUID_SIZE,
               "header literals disagree with VGPU_UUID_SIZE");

void vgpu_region_seterr(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

uint64_t vgpu_proc_start_time(void) {
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* The command name may hold spaces and parentheses: fields resume after the last ')'. */
    const char *p = strrchr(buf, ')');
    if (!p) return 0;
    p++; /* at the space before field 3 */
    for (int field = 3; field < 22 && p; field++) p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

static int ofd_lock(int fd, int slot, int cmd, short *type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = *type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(offsetof(struct vgpu_region_file, slots) +
                         (size_t)slot * sizeof(struct vgpu_region_slot));
    fl.l_len = 1;
    int rc = fcntl(fd, cmd, &fl);
    *type = fl.l_type;
    return rc;
}

int vgpu_slot_dead(int fd, int slot) {
    short type = F_WRLCK;
    /* F_OFD_GETLK reports a conflicting lock of another open description without taking
     * anything; our own description's locks never conflict, so never ask about our slot. */
    if (ofd_lock(fd, slot, F_OFD_GETLK, &type) != 0) return 0;
    return type == F_UNLCK;
}

int vgpu_slot_lock(int fd, int slot, int type) {
    short t = (short)type;
    return ofd_lock(fd, slot, F_OFD_SETLK, &t);
}

/* --- validation --------------------------------------------------------------------------- */

int vgpu_region_validate(const struct vgpu_region_file *f, uint64_t size, const char *path,
                         char *err, size_t errlen) {
    if (memcmp(f->magic, k_magic, sizeof k_magic) != 0) {
        vgpu_region_seterr(err, errlen, "%s is not a vgpu region: bad magic (expected \"%s\")",
                           path, k_magic);
        return -1;
    }
    if (f->version != VGPU_REGION_VERSION) {
        vgpu_region_seterr(err, errlen,
                           "%s has region layout version %u, this build reads version %d only",
                           path, f->version, VGPU_REGION_VERSION);
        return -1;
    }
    if (f->file_size != size || size != sizeof *f) {
        vgpu_region_seterr(err, errlen,
                           "%s has the wrong size: %llu bytes on disk, %llu in its header, "
                           "%zu expected (truncated or corrupt)",
                           path, (unsigned long long)size, (unsigned long long)f->file_size,
                           sizeof *f);
        return -1;
    }
    uint32_t ndev = f->device_count; /* read once: the tenant may write the file */
    if (f->slot_count != VGPU_MAX_SLOTS || ndev < 1 || ndev > VGPU_MAX_DEVICES) {
        vgpu_region_seterr(err, errlen, "%s is corrupt: %u devices, %u slots", path, ndev,
                           f->slot_count);
        return -1;
    }
    for (uint32_t d = 0; d < ndev; d++) {
        const struct vgpu_region_device *dv = &f->devices[d];
        if (!terminated(dv->uuid, sizeof dv->uuid) || dv->uuid[0] == 0 ||
            dv->sm_percent > 100) {
            vgpu_region_seterr(err, errlen, "%s is corrupt: device %u has a bad uuid or SM "
                               "percent", path, d);
            return -1;
        }
    }
    return 0;
}

int vgpu_region_open_file(const char *path, int writable, int *writable_out,
                          uint64_t *size_out, char *err, size_t errlen) {
    /* O_NOFOLLOW | O_NONBLOCK: the directory belongs to the tenant, so the host must not
     * follow a planted symlink or hang on a FIFO (or a leased file) put in the region's
     * place. */
    int flags = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
    int fd = open(path, flags | (writable ? O_RDWR : O_RDONLY));
    if (fd < 0 && writable < 0 && (errno == EACCES || errno == EROFS || errno == EPERM)) {
        writable = 0;
        fd = open(path, flags | O_RDONLY);
    }
    if (fd < 0) {
        vgpu_region_seterr(err, errlen, "cannot open region %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        vgpu_region_seterr(err, errlen, "%s is not a vgpu region: not a regular file", path);
        close(fd);
        return -1;
    }
    if ((uint64_t)st.st_size < sizeof(struct vgpu_region_file)) {
        /* Refused before anyone maps it: touching a page past the end would be a SIGBUS. */
        char head[8] = {0};
        ssize_t n = pread(fd, head, sizeof head, 0);
        if (n == (ssize_t)sizeof head && memcmp(head, k_magic, sizeof k_magic) == 0)
            vgpu_region_seterr(err, errlen, "%s is truncated: %lld bytes, a region has %zu",
                               path, (long long)st.st_size, sizeof(struct vgpu_region_file));
        else
            vgpu_region_seterr(err, errlen,
                               "%s is not a vgpu region: bad magic, %lld bytes", path,
                               (long long)st.st_size);
        close(fd);
        return -1;
    }
    if (writable_out) *writable_out = writable != 0;
    if (size_out) *size_out = (uint64_t)st.st_size;
    return fd;
}

struct vgpu_region_file *vgpu_region_map(const char *path, int writable, int *fd_out,
                                         int *writable_out, char *err, size_t errlen) {
    uint64_t size = 0;
    int fd = vgpu_region_open_file(path, writable, &writable, &size, err, errlen);
    if (fd < 0) return NULL;
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    struct vgpu_region_file *f = mmap(NULL, sizeof *f, prot, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) {
        vgpu_region_seterr(err, errlen, "cannot map region %s: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    /* A mapping is for the tenants only (a tenant that shrinks its own file harms itself):
     * the host reads with pread (region_snapshot.c) and no tenant can make it fault. */
    if (vgpu_region_validate(f, size, path, err, errlen) != 0) {
        munmap(f, sizeof *f);
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    if (writable_out) *writable_out = writable;
    return f;
}

void vgpu_region_unmap(struct vgpu_region_file *f, int fd) {
    if (f) munmap(f, sizeof *f);
    if (fd >= 0) close(fd);
}

/* --- creation ----------------------------------------------------------------------------- */

static int check_limits(const struct vgpu_limits *l, const char *path, char *err,
                        size_t errlen) {
    if (!l || l->count < 1 || l->count > VGPU_MAX_DEVICES) {
        vgpu_region_seterr(err, errlen, "cannot create region %s: %u devices (1..%d)", path,
                           l ? l->count : 0, VGPU_MAX_DEVICES);
        return -1;
    }
    for (uint32_t i = 0; i < l->count; i++) {
        const struct vgpu_device_limit *d = &l->devices[i];
        if (!terminated(d->uuid, sizeof d->uuid) || d->uuid[0] == 0 ||
            d->sm_percent > 100) {
            vgpu_region_seterr(err, errlen, "cannot create region %s: device %u has a bad "
                               "uuid or SM percent", path, i);
            return -1;
        }
        for (uint32_t j = 0; j < i; j++) {
            if (strcmp(d->uuid, l->devices[j].uuid) == 0) {
                vgpu_region_seterr(err, errlen, "cannot create region %s: GPU %s listed twice",
                                   path, d->uuid);
                return -1;
            }
        }
    }
    return 0;
}

VGPU_REGION_HIDDEN int vgpu_file_allocate(int fd, off_t size) {
    int rc = posix_fallocate(fd, 0, size);
    if (rc == 0) return 0;
    errno = rc; /* posix_fallocate returns its error rather than setting errno */
    return -1;
}

static int init_file(int fd, const struct vgpu_limits *l) {
    /* Allocated, not just sized: every process of the container maps it (vgpu_file_allocate). */
    if (vgpu_file_allocate(fd, sizeof(struct vgpu_region_file)) != 0) return -1;
    struct vgpu_region_file *f =
        mmap(NULL, sizeof *f, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (f == MAP_FAILED) return -1;
    /* The file is fresh and zero; nobody else can see it until it is linked into place. */
    memcpy(f->magic, k_magic, sizeof k_magic);
    f->version = VGPU_REGION_VERSION;
    f->device_count = l->count;
    f->file_size = sizeof *f;
    f->slot_count = VGPU_MAX_SLOTS;
    for (uint32_t d = 0; d < l->count; d++) {
        memcpy(f->devices[d].uuid, l->devices[d].uuid, sizeof f->devices[d].uuid);
        f->devices[d].memory_limit = l->devices[d].memory_limit;
        f->devices[d].sm_percent = l->devices[d].sm_percent;
    }
    /* The lock word is 0: free. */
    munmap(f, sizeof *f);
    return 0;
}

VGPU_EXPORT int vgpu_region_create(const char *path, const struct vgpu_limits *limits,
                                   char *err, size_t errlen) {
    if (!path || check_limits(limits, path ? path : "(null)", err, errlen) != 0) {
        if (!path) vgpu_region_seterr(err, errlen, "cannot create a region: no path");
        return -1;
    }
    if (access(path, F_OK) == 0) return 0;
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.XXXXXX", path) >= (int)sizeof tmp) {
        vgpu_region_seterr(err, errlen, "cannot create region %s: path too long", path);
        return -1;
    }
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        vgpu_region_seterr(err, errlen, "cannot create region %s: %s", path, strerror(errno));
        return -1;
    }
    int rc = -1;
    /* 0666 whatever the umask: every user of the container must be able to map it. */
    if (fchmod(fd, 0666) != 0 || init_file(fd, limits) != 0) {
        vgpu_region_seterr(err, errlen, "cannot create region %s: %s", path, strerror(errno));
    } else if (link(tmp, path) == 0) {
        rc = 1;
    } else if (errno == EEXIST) {
        rc = 0; /* another process won the race; its file is complete too */
    } else if (renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE) == 0) {
        rc = 1; /* a filesystem without hard links */
        tmp[0] = 0;
    } else if (errno == EEXIST) {
        rc = 0;
    } else {
        vgpu_region_seterr(err, errlen, "cannot create region %s: %s", path, strerror(errno));
    }
    if (tmp[0]) unlink(tmp);
    close(fd);
    return rc;
}
