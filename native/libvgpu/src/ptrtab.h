/* The pointer table's hot path (ptrtab.c has the rest): inline in the memory hooks, where a
 * call, its register saves and the record's copy through the stack were a third of what
 * put and take cost. Only ptrtab.c and mem.c include this. */
#ifndef VGPU_PTRTAB_H
#define VGPU_PTRTAB_H

#include "shim.h"

enum { VGPU_TAB_STRIPES = 64, VGPU_TAB_MIN_CAP = 64 };

struct vgpu_stripe {
    int lock; /* 0 free, 1 held */
    uint32_t cap, n;
    uint32_t full; /* n at which an insert grows the stripe first: 70 % of cap (0: no slots) */
    struct vgpu_rec *slots;
} __attribute__((aligned(64)));

extern VGPU_HIDDEN struct vgpu_stripe vgpu_tab_stripes[VGPU_TAB_STRIPES];

static inline void vgpu_stripe_lock(struct vgpu_stripe *s) {
    while (__atomic_exchange_n(&s->lock, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(&s->lock, __ATOMIC_RELAXED)) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        }
    }
}

static inline void vgpu_stripe_unlock(struct vgpu_stripe *s) { __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE); }

static inline uint64_t vgpu_tab_hash(int kind, uint64_t key) {
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

static inline struct vgpu_stripe *vgpu_stripe_of(uint64_t h) {
    return &vgpu_tab_stripes[h & (VGPU_TAB_STRIPES - 1)];
}

static inline uint32_t vgpu_tab_home(const struct vgpu_stripe *s, uint64_t h) {
    return (uint32_t)(h >> 6) & (s->cap - 1);
}

/* The slow cases, out of line (ptrtab.c). */
VGPU_HIDDEN void vgpu_tab_erase_shift(struct vgpu_stripe *s, uint32_t i);
VGPU_HIDDEN int vgpu_tab_put_growing(const struct vgpu_rec *in) __attribute__((cold));
VGPU_HIDDEN void __attribute__((cold)) vgpu_tab_replace_stale(struct vgpu_stripe *s, struct vgpu_rec *at, const struct vgpu_rec *in);

/* Remove slot i (stripe locked). A free slot is one with `used` clear: nothing else of it is
 * read, so only that byte is written. The common case (the next slot is free: nothing to
 * move back) inline, else the backward shift. */
static inline __attribute__((always_inline)) void vgpu_tab_erase(struct vgpu_stripe *s, uint32_t i) {
    if (LIKELY(!s->slots[(i + 1) & (s->cap - 1)].used)) {
        s->slots[i].used = 0;
        s->n--;
        return;
    }
    vgpu_tab_erase_shift(s, i);
}

/* Insert (the key's record replaced if it is there, else the first free slot, in one probe
 * run). 0, or -1 out of memory. The record is written field by field into its slot: building
 * it first and copying it cost as much again. */
static inline __attribute__((always_inline)) int vgpu_tab_put_inline(int kind, uint64_t key, int ordinal,
                                                                      uint64_t bytes, CUcontext ctx,
                                                                      uint32_t refs) {
    uint64_t h = vgpu_tab_hash(kind, key);
    struct vgpu_stripe *s = vgpu_stripe_of(h);
    vgpu_stripe_lock(s);
    uint32_t mask = s->cap - 1, i = vgpu_tab_home(s, h);
    struct vgpu_rec *slots = s->slots;
    if (LIKELY(s->n < s->full)) {
        while (slots[i].used && (slots[i].key != key || slots[i].kind != kind)) i = (i + 1) & mask;
        if (LIKELY(!slots[i].used)) {
            s->n++;
            struct vgpu_rec *r = &slots[i];
            r->key = key;
            r->bytes = bytes;
            r->ctx = ctx;
            r->ordinal = (int16_t)ordinal;
            r->kind = (uint8_t)kind;
            r->used = 1;
            r->refs = refs;
            vgpu_stripe_unlock(s);
            return 0;
        }
    }
    /* To grow first, or a stale record of the key to replace: out of line. */
    struct vgpu_rec in = {.key = key, .bytes = bytes, .ctx = ctx, .ordinal = (int16_t)ordinal,
                          .kind = (uint8_t)kind, .used = 1, .refs = refs};
    if (s->n >= s->full) {
        vgpu_stripe_unlock(s);
        return vgpu_tab_put_growing(&in);
    }
    vgpu_tab_replace_stale(s, &slots[i], &in);
    return 0;
}

/* Take (kind, key)'s record out into *out: 1 if it was there. */
static inline __attribute__((always_inline)) int vgpu_tab_take_inline(int kind, uint64_t key,
                                                                       struct vgpu_rec *out) {
    uint64_t h = vgpu_tab_hash(kind, key);
    struct vgpu_stripe *s = vgpu_stripe_of(h);
    int found = 0;
    vgpu_stripe_lock(s);
    if (LIKELY(s->cap)) {
        uint32_t mask = s->cap - 1;
        for (uint32_t i = vgpu_tab_home(s, h);; i = (i + 1) & mask) {
            struct vgpu_rec *r = &s->slots[i];
            if (!r->used) break;
            if (r->key == key && r->kind == kind) {
                *out = *r;
                vgpu_tab_erase(s, i);
                found = 1;
                break;
            }
        }
    }
    vgpu_stripe_unlock(s);
    return found;
}

#endif
