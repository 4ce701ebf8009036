/* GPU images: what a module learns from a fat binary or a cubin (the kernels it defines, its
 * global and constant variables with their sizes and initial contents, and the device memory
 * it takes). Pure: no driver state, no locks.
 *
 * Formats (facts from NVIDIA's ELF headers for CUDA, cuobjdump's output and public notes on the
 * fat binary container, checked against the cubins NVRTC makes and cuBLAS's fat binaries):
 * - a fat binary: a 16-byte header {u32 magic 0xBA55ED50, u16 version 1, u16 header size,
 *   u64 size of the entries}, then entries, each a header {u16 kind (1 PTX, 2 ELF), u16,
 *   u32 header size, u64 payload size (padded), u32 payload bytes used, u32, u16 u16 (version),
 *   u32 arch (sm_XY as 10X+Y), u32 u32 (name), u64 flags, u64, u64 uncompressed size} and the
 *   payload right after that header. Flags 0x2000: the payload is an LZ4 block; 0x8000: a
 *   Zstandard frame (decoded with the system's libzstd.so.1 when present).
 * - a cubin: an ELF64 file whose .symtab names kernels (STT_FUNC, st_other bit 0x10
 *   "CUDA entry") and variables (STT_OBJECT) in .nv.global (zero-filled), .nv.global.init and
 *   .nv.constant<N> (initialised); st_value is the offset in its section. */
#include <dlfcn.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_image.h"

#define FATBIN_MAGIC 0xba55ed50u
#define FATBINC_MAGIC 0x466243b1u /* the registration wrapper nvcc puts around a fat binary */
#define ENTRY_PTX 1
#define ENTRY_ELF 2
#define FLAG_LZ4 0x2000ull
#define FLAG_ZSTD 0x8000ull
#define STO_CUDA_ENTRY 0x10
#define MAX_IMAGE (1ull << 32) /* an entry or section past this is not a real image */

enum { SHT_PROGBITS = 1, SHT_SYMTAB = 2, SHT_NOBITS = 8 };
enum { SHF_ALLOC = 2 };
enum { STT_OBJECT = 1, STT_FUNC = 2 };

struct elf_ehdr {
    unsigned char ident[16];
    uint16_t type, machine;
    uint32_t version;
    uint64_t entry, phoff, shoff;
    uint32_t flags;
    uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
};

struct elf_shdr {
    uint32_t name, type;
    uint64_t flags, addr, offset, size;
    uint32_t link, info;
    uint64_t addralign, entsize;
};

struct elf_sym {
    uint32_t name;
    unsigned char info, other;
    uint16_t shndx;
    uint64_t value, size;
};

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, sizeof v); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, sizeof v); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, sizeof v); return v; }

/* --- LZ4 block format: sequences of literals then a back-reference ------------------------- */

/* Lengths of 15 continue in the following bytes, each adding up to 255. */
static int lz4_len(const uint8_t **p, const uint8_t *end, size_t *len) {
    if (*len != 15) return 0;
    for (;;) {
        if (*p >= end) return -1;
        uint8_t b = *(*p)++;
        *len += b;
        if (b != 255) return 0;
    }
}

int sim_lz4_decode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap) {
    const uint8_t *p = src, *end = src + n;
    size_t o = 0;
    while (p < end) {
        uint8_t token = *p++;
        size_t lit = token >> 4;
        if (lz4_len(&p, end, &lit) != 0 || lit > (size_t)(end - p) || lit > cap - o) return -1;
        memcpy(dst + o, p, lit);
        p += lit;
        o += lit;
        if (p == end) break; /* the last sequence has literals only */
        if (end - p < 2) return -1;
        size_t off = rd16(p);
        p += 2;
        size_t mlen = token & 15;
        if (lz4_len(&p, end, &mlen) != 0) return -1;
        mlen += 4;
        if (off == 0 || off > o || mlen > cap - o) return -1;
        for (size_t i = 0; i < mlen; i++, o++) dst[o] = dst[o - off]; /* may overlap forwards */
    }
    return o == cap ? 0 : -1;
}

/* Zstandard through the system's library, looked up once (no build dependency). */
static int zstd_decode(const uint8_t *src, size_t n, uint8_t *dst, size_t cap) {
    typedef size_t (*decompress_fn)(void *, size_t, const void *, size_t);
    typedef unsigned (*iserror_fn)(size_t);
    static decompress_fn dec;
    static iserror_fn iserr;
    static int tried;
    if (!__atomic_load_n(&tried, __ATOMIC_ACQUIRE)) {
        void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            dec = (decompress_fn)dlsym(h, "ZSTD_decompress");
            iserr = (iserror_fn)dlsym(h, "ZSTD_isError");
        }
        __atomic_store_n(&tried, 1, __ATOMIC_RELEASE);
    }
    if (!dec || !iserr) return -2;
    size_t got = dec(dst, cap, src, n);
    return iserr(got) || got != cap ? -1 : 0;
}

/* --- ELF ----------------------------------------------------------------------------------- */

static int in_bounds(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

/* A variable's section: device memory the module holds for its globals. Kernel parameter banks
 * (.nv.constant0.<kernel>) are per launch, not variables. */
static int variable_section(const char *name) {
    if (strncmp(name, ".nv.global", 10) == 0) return 1;
    return strncmp(name, ".nv.constant", 12) == 0 && strncmp(name, ".nv.constant0", 13) != 0;
}

/* Device memory an image takes: its allocated sections but shared and local memory (per
 * block and per thread, not held by the module). */
static int module_section(const char *name, uint64_t flags) {
    return (flags & SHF_ALLOC) && strncmp(name, ".nv.shared", 10) != 0 && strncmp(name, ".nv.local", 9) != 0;
}

static char *dup_name(const char *s, size_t max) {
    size_t n = strnlen(s, max);
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int push_kernel(struct sim_image *img, const char *name, size_t max, uint64_t code) {
    char **v = realloc(img->kernels, (img->nkern + 1) * sizeof *v);
    if (!v) return -1;
    img->kernels = v;
    uint64_t *b = realloc(img->kernel_bytes, (img->nkern + 1) * sizeof *b);
    if (!b) return -1;
    img->kernel_bytes = b;
    if (!(v[img->nkern] = dup_name(name, max))) return -1;
    b[img->nkern++] = code;
    return 0;
}

static int push_global(struct sim_image *img, const char *name, size_t max, uint64_t off, uint64_t size) {
    struct sim_image_global *v = realloc(img->globals, (img->nglob + 1) * sizeof *v);
    if (!v) return -1;
    img->globals = v;
    if (!(v[img->nglob].name = dup_name(name, max))) return -1;
    v[img->nglob].off = off;
    v[img->nglob].size = size;
    img->nglob++;
    return 0;
}

/* The size an ELF image spans, from its headers (cuModuleLoadData is given no length). */
static int elf_span(const uint8_t *p, uint64_t *span) {
    struct elf_ehdr eh;
    memcpy(&eh, p, sizeof eh);
    if (eh.shentsize != sizeof(struct elf_shdr) || eh.shnum == 0) return -1;
    uint64_t end = eh.shoff + (uint64_t)eh.shnum * sizeof(struct elf_shdr);
    if (eh.shoff > MAX_IMAGE || end > MAX_IMAGE) return -1;
    for (uint16_t i = 0; i < eh.shnum; i++) {
        struct elf_shdr sh;
        memcpy(&sh, p + eh.shoff + (uint64_t)i * sizeof sh, sizeof sh);
        if (sh.type == SHT_NOBITS) continue;
        if (sh.offset > MAX_IMAGE || sh.size > MAX_IMAGE) return -1;
        if (sh.offset + sh.size > end) end = sh.offset + sh.size;
    }
    *span = end;
    return 0;
}

int sim_image_from_elf(const uint8_t *p, uint64_t size, struct sim_image *img) {
    struct elf_ehdr eh;
    if (size < sizeof eh || memcmp(p, "\177ELF", 4) != 0) return -1;
    memcpy(&eh, p, sizeof eh);
    if (eh.ident[4] != 2 || eh.ident[5] != 1) return -1; /* ELF64, little endian */
    if (eh.shentsize != sizeof(struct elf_shdr) || !in_bounds(eh.shoff, (uint64_t)eh.shnum * sizeof(struct elf_shdr), size) ||
        eh.shstrndx >= eh.shnum)
        return -1;
    struct elf_shdr *sh = calloc(eh.shnum, sizeof *sh);
    uint64_t *place = calloc(eh.shnum, sizeof *place); /* a variable section's offset in the area */
    if (!sh || !place) {
        free(sh);
        free(place);
        return -1;
    }
    memcpy(sh, p + eh.shoff, (size_t)eh.shnum * sizeof *sh);
    int rc = -1;
    const struct elf_shdr *strs = &sh[eh.shstrndx];
    if (!in_bounds(strs->offset, strs->size, size)) goto out;
    const char *shnames = (const char *)p + strs->offset;
    for (uint16_t i = 0; i < eh.shnum; i++) {
        if (sh[i].name >= strs->size || (sh[i].type != SHT_NOBITS && !in_bounds(sh[i].offset, sh[i].size, size)))
            goto out;
        const char *name = shnames + sh[i].name;
        if (module_section(name, sh[i].flags)) img->device_bytes += sh[i].size;
        if (!variable_section(name) || !(sh[i].flags & SHF_ALLOC)) continue;
        uint64_t align = sh[i].addralign ? sh[i].addralign : 1;
        if (align > 4096 || (align & (align - 1))) goto out;
        place[i] = (img->globals_size + align - 1) & ~(align - 1);
        img->globals_size = place[i] + sh[i].size;
        if (img->globals_size > MAX_IMAGE) goto out;
    }
    img->init = calloc(1, img->globals_size ? img->globals_size : 1);
    if (!img->init) goto out;
    for (uint16_t i = 0; i < eh.shnum; i++)
        if (variable_section(shnames + sh[i].name) && (sh[i].flags & SHF_ALLOC) && sh[i].type == SHT_PROGBITS)
            memcpy(img->init + place[i], p + sh[i].offset, sh[i].size);
    for (uint16_t i = 0; i < eh.shnum; i++) {
        if (sh[i].type != SHT_SYMTAB) continue;
        if (sh[i].entsize != sizeof(struct elf_sym) || sh[i].link >= eh.shnum) goto out;
        const struct elf_shdr *st = &sh[sh[i].link];
        if (!in_bounds(st->offset, st->size, size)) goto out;
        const char *names = (const char *)p + st->offset;
        for (uint64_t k = 0; k < sh[i].size / sizeof(struct elf_sym); k++) {
            struct elf_sym s;
            memcpy(&s, p + sh[i].offset + k * sizeof s, sizeof s);
            if (s.name >= st->size || s.shndx == 0 || s.shndx >= eh.shnum || !names[s.name]) continue;
            const char *name = names + s.name;
            size_t max = st->size - s.name;
            const struct elf_shdr *home = &sh[s.shndx];
            if ((s.info & 15) == STT_FUNC && (s.other & STO_CUDA_ENTRY)) {
                /* its code: its own .text.<name> section (nvcc gives each kernel one) */
                uint64_t code = strncmp(shnames + home->name, ".text.", 6) == 0 ? home->size : 0;
                if (push_kernel(img, name, max, code) != 0) goto out;
            } else if ((s.info & 15) == STT_OBJECT && variable_section(shnames + home->name) && (home->flags & SHF_ALLOC)) {
                if (s.value > home->size || s.size > home->size - s.value) goto out;
                if (push_global(img, name, max, place[s.shndx] + s.value, s.size) != 0) goto out;
            }
        }
    }
    rc = 0;
out:
    free(sh);
    free(place);
    return rc;
}

/* --- PTX: kernels (.entry) and module-scope variables (.global, .const) ------------------------ */

static const char *skip_space(const char *p, const char *end) {
    while (p < end && isspace((unsigned char)*p)) p++;
    return p;
}

static int ident_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '$' || c == '.' || c == '%'; }

/* The bytes of a PTX scalar type (.b8 ... .f64), 0 if not one. */
static unsigned type_bytes(const char *t, size_t n) {
    if (n < 3 || t[0] != '.' || !strchr("bsuf", t[1])) return 0;
    int bits = atoi(t + 2);
    return bits == 8 || bits == 16 || bits == 32 || bits == 64 ? (unsigned)bits / 8 : 0;
}

/* One initializer value into `size` little-endian bytes: decimal or 0x integers, 0f/0d float
 * bits. Anything else (an address, generic(...)) stays zero, as nothing here can resolve it. */
static void put_value(const char *tok, size_t n, uint8_t *out, unsigned size) {
    char buf[64];
    if (n == 0 || n >= sizeof buf) return;
    memcpy(buf, tok, n);
    buf[n] = 0;
    uint64_t v = 0;
    char *end = NULL;
    if ((buf[0] == '0') && (buf[1] == 'f' || buf[1] == 'F' || buf[1] == 'd' || buf[1] == 'D')) v = strtoull(buf + 2, &end, 16);
    else if (buf[0] == '-') v = (uint64_t)strtoll(buf, &end, 0);
    else v = strtoull(buf, &end, 0);
    if (!end || *end) return;
    for (unsigned i = 0; i < size; i++) out[i] = (uint8_t)(v >> (8 * i));
}

struct ptx_var {
    char name[256];
    uint64_t align, size, count;
    unsigned elem;
    const char *init, *init_end; /* the text after '=', or NULL */
};

/* A module-scope statement declaring a variable in global or constant memory: 1 if it is one. */
static int ptx_var_parse(const char *p, const char *end, struct ptx_var *v) {
    memset(v, 0, sizeof *v);
    int space = 0, vec = 1;
    while ((p = skip_space(p, end)) < end) {
        const char *t = p;
        if (*p == '=') {
            v->init = p + 1;
            v->init_end = end;
            break;
        }
        while (p < end && (ident_char(*p) || *p == '[' || *p == ']' || isdigit((unsigned char)*p))) p++;
        size_t n = (size_t)(p - t);
        if (n == 0) return 0;
        if (n == 7 && !memcmp(t, ".extern", 7)) return 0; /* a declaration, defined elsewhere */
        if ((n == 7 && !memcmp(t, ".global", 7)) || (n == 6 && !memcmp(t, ".const", 6))) space = 1;
        else if (n == 6 && !memcmp(t, ".align", 6)) {
            p = skip_space(p, end);
            v->align = strtoull(p, (char **)&p, 10);
        } else if (n == 3 && !memcmp(t, ".v2", 3)) vec = 2;
        else if (n == 3 && !memcmp(t, ".v4", 3)) vec = 4;
        else if (type_bytes(t, n)) v->elem = type_bytes(t, n) * (unsigned)vec;
        else if (t[0] != '.' && space && v->elem && !v->name[0]) {
            const char *br = memchr(t, '[', n);
            size_t len = br ? (size_t)(br - t) : n;
            if (len >= sizeof v->name) return 0;
            memcpy(v->name, t, len);
            v->count = 1;
            for (const char *q = br; q && q < t + n; q = memchr(q + 1, '[', (size_t)(t + n - q - 1))) {
                uint64_t dim = strtoull(q + 1, NULL, 10);
                v->count *= q[1] == ']' ? 0 : dim; /* [] : sized by the initializer */
            }
        }
    }
    if (!space || !v->elem || !v->name[0]) return 0;
    if (v->count == 0 && v->init) { /* name[] = {...}: one element per value */
        v->count = 1;
        for (const char *q = v->init; q < v->init_end; q++) v->count += *q == ',';
    }
    v->size = v->count * v->elem;
    if (!v->align) v->align = v->elem;
    return 1;
}

static int ptx_var_add(struct sim_image *img, const struct ptx_var *v) {
    if (v->align > 4096 || (v->align & (v->align - 1)) || v->size > MAX_IMAGE) return -1;
    uint64_t off = (img->globals_size + v->align - 1) & ~(v->align - 1);
    uint8_t *init = realloc(img->init, off + v->size ? off + v->size : 1);
    if (!init) return -1;
    memset(init + img->globals_size, 0, off + v->size - img->globals_size);
    img->init = init;
    img->globals_size = off + v->size;
    for (const char *q = v->init, *stop = v->init_end; q && q < stop;) {
        uint64_t k = 0;
        for (; q < stop && k < v->count; k++) { /* the values, in order, braces ignored */
            while (q < stop && (isspace((unsigned char)*q) || *q == '{' || *q == '}' || *q == ',')) q++;
            const char *t = q;
            while (q < stop && *q != ',' && *q != '}' && !isspace((unsigned char)*q)) q++;
            put_value(t, (size_t)(q - t), init + off + k * v->elem, v->elem);
        }
        break;
    }
    return push_global(img, v->name, sizeof v->name, off, v->size);
}

/* Kernels and variables of PTX text (n bytes). Function bodies are skipped by brace depth. */
int sim_image_from_ptx(const char *p, size_t n, struct sim_image *img) {
    const char *end = p + n, *stmt = p;
    int depth = 0;
    for (const char *q = p; q < end; q++) {
        if (q + 1 < end && q[0] == '/' && q[1] == '/') { /* comments: to the end of the line */
            const char *nl = memchr(q, '\n', (size_t)(end - q));
            q = nl ? nl : end - 1;
            if (depth == 0) stmt = q + 1;
            continue;
        }
        if (q + 1 < end && q[0] == '/' && q[1] == '*') {
            const char *c = q + 2;
            while (c + 1 < end && !(c[0] == '*' && c[1] == '/')) c++;
            q = c + 1 < end ? c + 1 : end - 1;
            if (depth == 0) stmt = q + 1;
            continue;
        }
        if (*q == '{') {
            if (depth == 0 && memchr(stmt, '=', (size_t)(q - stmt))) { /* an initializer */
                const char *c = q;
                while (c < end && *c != '}') c++;
                q = c < end ? c : end - 1;
                continue;
            }
            if (depth++ == 0) { /* a function: an entry if declared so */
                for (const char *e = stmt; e + 6 <= q; e++) {
                    if (memcmp(e, ".entry", 6) != 0 || (e > stmt && ident_char(e[-1])) || !isspace((unsigned char)e[6])) continue;
                    const char *name = skip_space(e + 6, q), *ne = name;
                    while (ne < q && ident_char(*ne)) ne++;
                    if (ne > name && push_kernel(img, name, (size_t)(ne - name), 0) != 0) return -1;
                    break;
                }
            }
        } else if (*q == '}') {
            if (depth > 0 && --depth == 0) stmt = q + 1;
        } else if (*q == ';' && depth == 0) {
            struct ptx_var v;
            if (ptx_var_parse(stmt, q, &v) && ptx_var_add(img, &v) != 0) return -1;
            stmt = q + 1;
        }
    }
    if (!img->init && !(img->init = calloc(1, 1))) return -1;
    img->device_bytes = img->globals_size + n; /* JIT-compiled code: sized as its text */
    return 0;
}

/* PTX text starts with a comment or a directive (NVRTC's and nvcc's: "//\n// Generated by ..."). */
static int looks_like_ptx(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p != '/' && *p != '.') return 0;
    const char *v = strstr(p, ".version");
    return v && strstr(v, ".target") != NULL;
}

/* The sm_XY of a PTX ".target sm_XY[a|f]" line (0 if none). */
static int ptx_target(const char *p) {
    const char *t = strstr(p, ".target");
    if (!t || !(t = strstr(t, "sm_"))) return 0;
    return atoi(t + 3);
}

/* --- fat binaries ---------------------------------------------------------------------------- */

struct entry {
    uint16_t kind;
    uint32_t arch;
    uint64_t flags, used, full;
    const uint8_t *payload;
};

/* The cubin to run on sm_<cc>: the one built for it, else the newest of the same major
 * version no newer than the device (SASS runs across minors of a major). */
static int better(const struct entry *e, const struct entry *best, int cc) {
    if (e->kind != ENTRY_ELF || (int)e->arch / 10 != cc / 10 || (int)e->arch > cc) return 0;
    return !best || e->arch > best->arch;
}

static int decode_entry(const struct entry *e, uint8_t **out, uint64_t *len) {
    if (!(e->flags & (FLAG_LZ4 | FLAG_ZSTD))) {
        *out = NULL;
        *len = e->used ? e->used : e->full;
        return 0;
    }
    if (!e->full || e->full > MAX_IMAGE) return -1;
    uint8_t *buf = malloc(e->full);
    if (!buf) return -1;
    int rc = e->flags & FLAG_LZ4 ? sim_lz4_decode(e->payload, e->used, buf, e->full)
                                 : zstd_decode(e->payload, e->used, buf, e->full);
    if (rc != 0) {
        free(buf);
        return rc;
    }
    *out = buf;
    *len = e->full;
    return 0;
}

/* Decode entry e and read it (ELF or PTX) into img. */
static enum sim_image_status read_entry(const struct entry *e, struct sim_image *img) {
    uint8_t *buf = NULL;
    uint64_t len = 0;
    int rc = decode_entry(e, &buf, &len);
    if (rc == -2) return SIM_IMAGE_OPAQUE; /* Zstandard without libzstd: nothing learnt */
    if (rc != 0) return SIM_IMAGE_INVALID;
    const uint8_t *p = buf ? buf : e->payload;
    if (e->kind == ENTRY_ELF) rc = sim_image_from_elf(p, len, img);
    else rc = sim_image_from_ptx((const char *)p, strnlen((const char *)p, len), img);
    free(buf);
    return rc == 0 ? SIM_IMAGE_READ : SIM_IMAGE_INVALID;
}

static enum sim_image_status from_fatbin(const uint8_t *p, int cc, struct sim_image *img) {
    uint16_t hsize = rd16(p + 6);
    uint64_t total = rd64(p + 8);
    if (rd16(p + 4) != 1 || hsize < 16 || total > MAX_IMAGE) return SIM_IMAGE_INVALID;
    const uint8_t *q = p + hsize, *end = q + total;
    /* best: a cubin for the device; ptx: PTX it can compile; other: anything, for names only */
    struct entry e, best = {0}, ptx = {0}, other = {0};
    while (q + 64 <= end) {
        uint32_t ehs = rd32(q + 4);
        uint64_t psize = rd64(q + 8);
        if (ehs < 64 || psize > (uint64_t)(end - q) - ehs) return SIM_IMAGE_INVALID;
        e = (struct entry){.kind = rd16(q), .used = rd32(q + 16), .arch = rd32(q + 28), .flags = rd64(q + 40),
                           .full = rd64(q + 56), .payload = q + ehs};
        if (e.used > psize) return SIM_IMAGE_INVALID;
        if (!e.used) e.used = psize;
        if (better(&e, best.kind ? &best : NULL, cc)) best = e;
        if (e.kind == ENTRY_PTX && (int)e.arch <= cc && e.arch >= ptx.arch) ptx = e; /* PTX compiles for newer GPUs */
        if ((e.kind == ENTRY_ELF || e.kind == ENTRY_PTX) && (!other.kind || (e.kind == ENTRY_ELF && other.kind != ENTRY_ELF)))
            other = e;
        q += ehs + psize;
    }
    if (best.kind) return read_entry(&best, img);
    if (ptx.kind) return read_entry(&ptx, img);
    if (!other.kind) return SIM_IMAGE_NO_BINARY;
    enum sim_image_status st = read_entry(&other, img); /* its names, with no code for this GPU */
    img->foreign = 1;
    return st == SIM_IMAGE_READ ? SIM_IMAGE_NO_BINARY : st;
}

enum sim_image_status sim_image_read(const void *image, int cc, struct sim_image **out) {
    const uint8_t *p = image;
    *out = NULL;
    /* The magics have no zero byte: a shorter string is none of these (and may be that short). */
    if (strnlen(image, 4) < 4) return SIM_IMAGE_OPAQUE;
    if (rd32(p) == FATBINC_MAGIC) { /* the wrapper around a registered fat binary */
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        if (!data || rd32(data) != FATBIN_MAGIC) return SIM_IMAGE_INVALID;
        p = data;
    }
    int fatbin = rd32(p) == FATBIN_MAGIC, elf = memcmp(p, "\177ELF", 4) == 0;
    int ptx = !fatbin && !elf && looks_like_ptx((const char *)p);
    if (!fatbin && !elf && !ptx) return SIM_IMAGE_OPAQUE; /* bytes nothing here can read */
    struct sim_image *img = calloc(1, sizeof *img);
    if (!img) return SIM_IMAGE_NOMEM;
    enum sim_image_status st;
    uint64_t span = 0;
    if (fatbin) {
        st = from_fatbin(p, cc, img);
    } else if (elf) {
        st = elf_span(p, &span) == 0 && sim_image_from_elf(p, span, img) == 0 ? SIM_IMAGE_READ : SIM_IMAGE_INVALID;
    } else {
        st = sim_image_from_ptx((const char *)p, strlen((const char *)p), img) == 0 ? SIM_IMAGE_READ : SIM_IMAGE_INVALID;
        if (st == SIM_IMAGE_READ && ptx_target((const char *)p) > cc) {
            img->foreign = 1; /* PTX for a newer GPU than this one */
            st = SIM_IMAGE_NO_BINARY;
        }
    }
    if (st == SIM_IMAGE_READ || (st == SIM_IMAGE_NO_BINARY && img->foreign)) *out = img;
    else sim_image_free(img);
    return st;
}

void sim_image_free(struct sim_image *img) {
    if (!img) return;
    for (size_t i = 0; i < img->nkern; i++) free(img->kernels[i]);
    for (size_t i = 0; i < img->nglob; i++) free(img->globals[i].name);
    free(img->kernels);
    free(img->kernel_bytes);
    free(img->globals);
    free(img->init);
    free(img);
}

int sim_image_kernel(const struct sim_image *img, const char *name) {
    for (size_t i = 0; i < img->nkern; i++)
        if (strcmp(img->kernels[i], name) == 0) return (int)i;
    return -1;
}

const struct sim_image_global *sim_image_global(const struct sim_image *img, const char *name) {
    for (size_t i = 0; i < img->nglob; i++)
        if (strcmp(img->globals[i].name, name) == 0) return &img->globals[i];
    return NULL;
}
