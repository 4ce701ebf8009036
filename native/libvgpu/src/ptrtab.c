/* What each live allocation charged: (kind, pointer or handle) -> (device, bytes, context).
 *
 * A free must give back exactly what its allocation charged, whatever the API; the driver
 * does not tell us the size of what is freed. The table is 64 independently locked stripes,
 * each an open-addressing hash with linear probing and backward-shift deletion: a put or take
 * is one uncontended lock and a probe or two, and threads allocating at once rarely meet on
 * a stripe. The lock is a spinlock (one atomic exchange to take, one store to drop): it is
 * held for a probe only, never across a call out of this file, and process-private, so a
 * dying process cannot leave it held for anyone else. The stripes are this file's private
 * part of the process state (the table is process-wide by nature; only this file touches it). */
#include <stdlib.h>
#include <string.h>

#include "shim.h"

enum { STRIPES = 64, MIN_CAP = 64 };

struct stripe {
    int lock; /* 0 free, 1 held */
    uint32_t cap, n;
    uint32_t full; /* n at which an insert grows the stripe first: 70 % of cap (0: no slots) */
    struct vgpu_rec *slots;
} __attribute__((aligned(64)));

static struct stripe g_tab[STRIPES];

static inline void stripe_lock(struct stripe *s) {
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

static inline void stripe_unlock(struct stripe *s) { __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE); }

static inline uint64_t hash(int kind, uint64_t key) {
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

static inline struct stripe *stripe_of(uint64_t h) { return &g_tab[h & (STRIPES - 1)]; }

static inline uint32_t home(const struct stripe *s, uint64_t h) { return (uint32_t)(h >> 6) & (s->cap - 1); }

/* Slot index of (kind, key), or -1. Stripe locked. */
static long find(const struct stripe *s, int kind, uint64_t key, uint64_t h) {
    if (!s->cap) return -1;
    for (uint32_t i = home(s, h);; i = (i + 1) & (s->cap - 1)) {
        const struct vgpu_rec *r = &s->slots[i];
        if (!r->used) return -1;
        if (r->key == key && r->kind == kind) return i;
    }
}

static void place(struct stripe *s, const struct vgpu_rec *rec) {
    uint32_t i = home(s, hash(rec->kind, rec->key));
    while (s->slots[i].used) i = (i + 1) & (s->cap - 1);
    s->slots[i] = *rec;
    s->n++;
}

static int __attribute__((noinline, cold)) grow(struct stripe *s) {
    uint32_t cap = s->cap ? s->cap * 2 : MIN_CAP;
    struct vgpu_rec *old = s->slots, *fresh = calloc(cap, sizeof *fresh);
    if (!fresh) return -1;
    uint32_t oldcap = s->cap;
    s->slots = fresh;
    s->cap = cap;
    s->full = (uint32_t)((uint64_t)cap * 7 / 10); /* the first n with (n + 1) * 10 > cap * 7 */
    s->n = 0;
    for (uint32_t i = 0; i < oldcap; i++)
        if (old[i].used) place(s, &old[i]);
    free(old);
    return 0;
}

/* Remove slot i, moving later members of its probe run back. Stripe locked. */
static void __attribute__((noinline)) erase_shift(struct stripe *s, uint32_t i) {
    uint32_t mask = s->cap - 1;
    for (uint32_t j = (i + 1) & mask; s->slots[j].used; j = (j + 1) & mask) {
        uint32_t k = home(s, hash(s->slots[j].kind, s->slots[j].key));
        /* Move j into the hole when its home is not cyclically within (i, j]. */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    memset(&s->slots[i], 0, sizeof s->slots[i]);
    s->n--;
}

/* The common case inline (the next slot is empty: nothing to move back), else the shift. */
static inline __attribute__((always_inline)) void erase(struct stripe *s, uint32_t i) {
    if (LIKELY(!s->slots[(i + 1) & (s->cap - 1)].used)) {
        memset(&s->slots[i], 0, sizeof s->slots[i]);
        s->n--;
        return;
    }
    erase_shift(s, i);
}

static void release(const struct vgpu_rec *r) {
    if (r->kind == VGPU_OBJ_POOLPTR) { /* the pool holds the charge */
        vgpu_pool_freed(r);
        return;
    }
    struct vgpu_dev *d = vgpu_dev(r->ordinal);
    if (d) vgpu_uncharge(d, r->bytes);
}

/* The driver handed out an address we still list: its free passed us by (say, with its
 * context). Give the old charge back rather than keep it forever. Stripe locked; unlocks. */
static void __attribute__((noinline, cold)) replace_stale(struct stripe *s, struct vgpu_rec *at,
                                                          const struct vgpu_rec *in) {
    struct vgpu_rec stale = *at;
    *at = *in;
    at->used = 1;
    stripe_unlock(s);
    release(&stale);
}

/* Insert into stripe s (locked; unlocks): the key's record if it is there, else the first
 * empty slot, in one probe run. `grown`: 0 to grow first if needed. */
static inline __attribute__((always_inline)) int put_locked(struct stripe *s, uint64_t h, const struct vgpu_rec *in,
                                                            int grown) {
    if (!grown && UNLIKELY(s->n >= s->full) && grow(s) != 0) {
        stripe_unlock(s);
        return -1;
    }
    uint32_t mask = s->cap - 1, i = home(s, h);
    uint64_t key = in->key;
    while (s->slots[i].used && (s->slots[i].key != key || s->slots[i].kind != in->kind)) i = (i + 1) & mask;
    if (UNLIKELY(s->slots[i].used)) {
        replace_stale(s, &s->slots[i], in);
        return 0;
    }
    s->n++;
    s->slots[i] = *in;
    s->slots[i].used = 1;
    stripe_unlock(s);
    return 0;
}

/* A stripe that must grow first: out of line, so the common insert saves fewer registers. */
static int __attribute__((noinline, cold)) put_growing(const struct vgpu_rec *in) {
    uint64_t h = hash(in->kind, in->key);
    struct stripe *s = stripe_of(h);
    stripe_lock(s);
    return put_locked(s, h, in, 0);
}

static inline __attribute__((always_inline)) int put_rec(const struct vgpu_rec *in) {
    uint64_t h = hash(in->kind, in->key);
    struct stripe *s = stripe_of(h);
    stripe_lock(s);
    if (UNLIKELY(s->n >= s->full)) {
        stripe_unlock(s);
        return put_growing(in);
    }
    return put_locked(s, h, in, 1);
}

int vgpu_tab_put_rec(const struct vgpu_rec *in) { return put_rec(in); }

/* The same from its fields: the record is built in place, not copied from the caller's. */
int vgpu_tab_put(int kind, uint64_t key, int ordinal, uint64_t bytes, CUcontext ctx) {
    struct vgpu_rec r = {.key = key, .bytes = bytes, .ctx = ctx, .ordinal = (int16_t)ordinal,
                         .kind = (uint8_t)kind, .used = 1, .refs = 1};
    return put_rec(&r);
}

int vgpu_tab_take(int kind, uint64_t key, struct vgpu_rec *out) {
    uint64_t h = hash(kind, key);
    struct stripe *s = stripe_of(h);
    stripe_lock(s);
    long at = find(s, kind, key, h);
    if (at >= 0) {
        *out = s->slots[at];
        erase(s, (uint32_t)at);
    }
    stripe_unlock(s);
    return at >= 0;
}

int vgpu_tab_get(int kind, uint64_t key, struct vgpu_rec *out) {
    uint64_t h = hash(kind, key);
    struct stripe *s = stripe_of(h);
    stripe_lock(s);
    long at = find(s, kind, key, h);
    if (at >= 0) *out = s->slots[at];
    stripe_unlock(s);
    return at >= 0;
}

int vgpu_tab_unref(int kind, uint64_t key, int delta, struct vgpu_rec *out) {
    uint64_t h = hash(kind, key);
    struct stripe *s = stripe_of(h);
    int refs = -1;
    stripe_lock(s);
    long at = find(s, kind, key, h);
    if (at >= 0) {
        struct vgpu_rec *r = &s->slots[at];
        int64_t n = (int64_t)r->refs + delta;
        refs = n < 0 ? 0 : (int)n;
        r->refs = (uint32_t)refs;
        if (refs == 0) {
            *out = *r;
            erase(s, (uint32_t)at);
        }
    }
    stripe_unlock(s);
    return refs;
}

void vgpu_tab_drop_ctx(CUcontext ctx) {
    if (!ctx) return;
    for (int k = 0; k < STRIPES; k++) {
        struct stripe *s = &g_tab[k];
        struct vgpu_rec batch[64];
        int n;
        do { /* take a batch out under the lock, give its charges back outside it */
            n = 0;
            stripe_lock(s);
            for (uint32_t i = 0; i < s->cap && n < 64;) {
                if (s->slots[i].used && s->slots[i].ctx == ctx) {
                    batch[n++] = s->slots[i];
                    erase(s, i); /* slot i now holds a later record, or is empty: look again */
                } else {
                    i++;
                }
            }
            stripe_unlock(s);
            for (int j = 0; j < n; j++) release(&batch[j]);
        } while (n == 64);
    }
}
