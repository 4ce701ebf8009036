/* What each live allocation charged: (kind, pointer or handle) -> (device, bytes, context).
 *
 * A free must give back exactly what its allocation charged, whatever the API; the driver
 * does not tell us the size of what is freed. The table is 64 independently locked stripes,
 * each an open-addressing hash with linear probing and backward-shift deletion: a put or take
 * is one uncontended lock and a probe or two, and threads allocating at once rarely meet on
 * a stripe. The lock is a spinlock (one atomic exchange to take, one store to drop): it is
 * held for a probe only, never across a call out of this file, and process-private, so a
 * dying process cannot leave it held for anyone else. The stripes are this file's private
 * part of the process state (the table is process-wide by nature; only this file and the
 * inline put and take of ptrtab.h, which the memory hooks use, touch it). */
#include <stdlib.h>
#include <string.h>

#include "ptrtab.h"

struct vgpu_stripe vgpu_tab_stripes[VGPU_TAB_STRIPES];

/* Slot index of (kind, key), or -1. Stripe locked. */
static long find(const struct vgpu_stripe *s, int kind, uint64_t key, uint64_t h) {
    if (!s->cap) return -1;
    for (uint32_t i = vgpu_tab_home(s, h);; i = (i + 1) & (s->cap - 1)) {
        const struct vgpu_rec *r = &s->slots[i];
        if (!r->used) return -1;
        if (r->key == key && r->kind == kind) return i;
    }
}

static void place(struct vgpu_stripe *s, const struct vgpu_rec *rec) {
    uint32_t i = vgpu_tab_home(s, vgpu_tab_hash(rec->kind, rec->key));
    while (s->slots[i].used) i = (i + 1) & (s->cap - 1);
    s->slots[i] = *rec;
    s->n++;
}

static int __attribute__((noinline, cold)) grow(struct vgpu_stripe *s) {
    uint32_t cap = s->cap ? s->cap * 2 : VGPU_TAB_MIN_CAP;
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
void vgpu_tab_erase_shift(struct vgpu_stripe *s, uint32_t i) {
    uint32_t mask = s->cap - 1;
    for (uint32_t j = (i + 1) & mask; s->slots[j].used; j = (j + 1) & mask) {
        uint32_t k = vgpu_tab_home(s, vgpu_tab_hash(s->slots[j].kind, s->slots[j].key));
        /* Move j into the hole when its home is not cyclically within (i, j]. */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i].used = 0;
    s->n--;
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
void vgpu_tab_replace_stale(struct vgpu_stripe *s, struct vgpu_rec *at, const struct vgpu_rec *in) {
    struct vgpu_rec stale = *at;
    *at = *in;
    at->used = 1;
    vgpu_stripe_unlock(s);
    release(&stale);
}

/* A stripe that must grow first: out of line, so the common insert saves fewer registers. */
int vgpu_tab_put_growing(const struct vgpu_rec *in) {
    uint64_t h = vgpu_tab_hash(in->kind, in->key);
    struct vgpu_stripe *s = vgpu_stripe_of(h);
    vgpu_stripe_lock(s);
    if (s->n >= s->full && grow(s) != 0) {
        vgpu_stripe_unlock(s);
        return -1;
    }
    /* Grown (or another thread grew it meanwhile): the insert cannot need to grow again. */
    uint32_t mask = s->cap - 1, i = vgpu_tab_home(s, h);
    while (s->slots[i].used && (s->slots[i].key != in->key || s->slots[i].kind != in->kind)) i = (i + 1) & mask;
    if (s->slots[i].used) {
        vgpu_tab_replace_stale(s, &s->slots[i], in);
        return 0;
    }
    s->n++;
    s->slots[i] = *in;
    s->slots[i].used = 1;
    vgpu_stripe_unlock(s);
    return 0;
}

int vgpu_tab_put_rec(const struct vgpu_rec *in) {
    return vgpu_tab_put_inline(in->kind, in->key, in->ordinal, in->bytes, in->ctx, in->refs);
}

int vgpu_tab_put(int kind, uint64_t key, int ordinal, uint64_t bytes, CUcontext ctx) {
    return vgpu_tab_put_inline(kind, key, ordinal, bytes, ctx, 1);
}

int vgpu_tab_take(int kind, uint64_t key, struct vgpu_rec *out) { return vgpu_tab_take_inline(kind, key, out); }

int vgpu_tab_get(int kind, uint64_t key, struct vgpu_rec *out) {
    uint64_t h = vgpu_tab_hash(kind, key);
    struct vgpu_stripe *s = vgpu_stripe_of(h);
    vgpu_stripe_lock(s);
    long at = find(s, kind, key, h);
    if (at >= 0) *out = s->slots[at];
    vgpu_stripe_unlock(s);
    return at >= 0;
}

int vgpu_tab_unref(int kind, uint64_t key, int delta, struct vgpu_rec *out) {
    uint64_t h = vgpu_tab_hash(kind, key);
    struct vgpu_stripe *s = vgpu_stripe_of(h);
    int refs = -1;
    vgpu_stripe_lock(s);
    long at = find(s, kind, key, h);
    if (at >= 0) {
        struct vgpu_rec *r = &s->slots[at];
        int64_t n = (int64_t)r->refs + delta;
        refs = n < 0 ? 0 : (int)n;
        r->refs = (uint32_t)refs;
        if (refs == 0) {
            *out = *r;
            vgpu_tab_erase(s, (uint32_t)at);
        }
    }
    vgpu_stripe_unlock(s);
    return refs;
}

/* Every allocation ctx owns, by a scan of the stripes that hold any record at all: a table
 * grown by a past peak of allocations and now empty costs a look at each stripe's count, not
 * at its capacity. (A context's own charge is not in the table: ctx.c lists it.) */
void vgpu_tab_drop_ctx(CUcontext ctx) {
    if (!ctx) return;
    for (int k = 0; k < VGPU_TAB_STRIPES; k++) {
        struct vgpu_stripe *s = &vgpu_tab_stripes[k];
        struct vgpu_rec batch[64];
        int n;
        do { /* take a batch out under the lock, give its charges back outside it */
            n = 0;
            vgpu_stripe_lock(s);
            for (uint32_t i = 0; s->n && i < s->cap && n < 64;) { /* an empty stripe: not scanned */
                if (s->slots[i].used && s->slots[i].ctx == ctx) {
                    batch[n++] = s->slots[i];
                    vgpu_tab_erase(s, i); /* slot i now holds a later record, or is empty: look again */
                } else {
                    i++;
                }
            }
            vgpu_stripe_unlock(s);
            for (int j = 0; j < n; j++) release(&batch[j]);
        } while (n == 64);
    }
}
