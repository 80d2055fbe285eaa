/* Belady's MIN over a prefix cache's block accesses (oracle.py), built on first use like
 * the native attention kernel.
 *
 * A trace is n references to 64-bit block names, each of kind 0 (the block was written: it
 * may be cached from here), 1 (first block a request looks up) or 2 (a later block of the
 * same lookup). A lookup counts its leading run of cached blocks as hits, as the prefix
 * cache does; a lookup that misses caches nothing (only a write does). With `capacity`
 * blocks, keeping the blocks whose next lookup is nearest, and not keeping a block whose
 * next reference is a write (it comes back for free) or absent, gives the most hits any
 * cache of that size could have (oracle.py says why).
 *
 * Names get dense ids through an open-addressing table grown at half load; each reference's
 * next use comes from one backward pass; the forward pass keeps the cached blocks in a max
 * heap of next-use positions with lazy deletion (an entry is live while its block's recorded
 * position equals it), rebuilt when stale entries outnumber live ones. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t *names;
    int32_t *ids;  /* -1: empty slot */
    int64_t mask, count;
} Table;

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    return x ^ (x >> 33);
}

static int table_alloc(Table *t, int64_t slots) {
    t->names = malloc(sizeof(uint64_t) * slots);
    t->ids = malloc(sizeof(int32_t) * slots);
    if (!t->names || !t->ids) {
        free(t->names);
        free(t->ids);
        return -1;
    }
    memset(t->ids, 0xff, sizeof(int32_t) * slots);
    t->mask = slots - 1;
    return 0;
}

static int64_t table_put(Table *t, uint64_t name, int32_t id) {
    int64_t i = (int64_t)(mix(name) & (uint64_t)t->mask);
    while (t->ids[i] >= 0) {
        if (t->names[i] == name) return t->ids[i];
        i = (i + 1) & t->mask;
    }
    t->names[i] = name;
    t->ids[i] = id;
    t->count++;
    return id;
}

static int table_grow(Table *t) {
    Table bigger = {0};
    if (table_alloc(&bigger, 2 * (t->mask + 1))) return -1;
    for (int64_t i = 0; i <= t->mask; i++)
        if (t->ids[i] >= 0) table_put(&bigger, t->names[i], t->ids[i]);
    free(t->names);
    free(t->ids);
    *t = bigger;
    return 0;
}

/* Dense ids of the names in `ids`; returns how many distinct names, or -1 out of memory. */
static int64_t dense_ids(const uint64_t *names, int64_t n, int32_t *ids) {
    Table t = {0};
    if (table_alloc(&t, 1 << 12)) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (2 * (t.count + 1) > t.mask + 1 && table_grow(&t)) {
            free(t.names);
            free(t.ids);
            return -1;
        }
        ids[i] = (int32_t)table_put(&t, names[i], (int32_t)t.count);
    }
    int64_t distinct = t.count;
    free(t.names);
    free(t.ids);
    return distinct;
}

typedef struct {
    int32_t key, id;
} Item;

static void sift_up(Item *h, int64_t i) {
    Item x = h[i];
    while (i > 0 && h[(i - 1) / 2].key < x.key) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = x;
}

static void sift_down(Item *h, int64_t len, int64_t i) {
    Item x = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= len) break;
        if (c + 1 < len && h[c + 1].key > h[c].key) c++;
        if (h[c].key <= x.key) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

/* Leading-run hits with `capacity` blocks, kept by MIN; `next[i]` is the position of the
 * next reference to the same name (n if none); `at[id]` is scratch of `distinct` entries. */
static int64_t min_hits(const int32_t *ids, const int8_t *kinds, const int32_t *next, int64_t n,
                        int64_t capacity, int32_t *at, Item *heap) {
    const int32_t never = (int32_t)n;
    int64_t len = 0, size = 0, hits = 0;
    int run = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i], nx = next[i];
        int32_t key = (nx < never && kinds[nx] != 0) ? nx : never;
        int cached = at[id] >= 0;
        if (kinds[i] == 1) run = 1;
        if (kinds[i] != 0) {
            run = run && cached;
            hits += run;
        }
        if (cached && key == never) {
            at[id] = -1;
            size--;
        } else if (cached) {
            at[id] = key;
            heap[len] = (Item){key, id};
            sift_up(heap, len++);
        } else if (kinds[i] == 0 && key != never && capacity > 0) {
            if (size == capacity) {
                while (at[heap[0].id] != heap[0].key) {  /* stale tops */
                    heap[0] = heap[--len];
                    sift_down(heap, len, 0);
                }
                if (heap[0].key < key) continue;  /* every cached block is needed sooner */
                at[heap[0].id] = -1;
                heap[0] = heap[--len];
                sift_down(heap, len, 0);
                size--;
            }
            at[id] = key;
            heap[len] = (Item){key, id};
            sift_up(heap, len++);
            size++;
        }
        if (len > 2 * size + 1024) {  /* drop stale entries, then re-heapify */
            int64_t live = 0;
            for (int64_t j = 0; j < len; j++)
                if (at[heap[j].id] == heap[j].key) heap[live++] = heap[j];
            len = live;
            for (int64_t j = len / 2 - 1; j >= 0; j--) sift_down(heap, len, j);
        }
    }
    return hits;
}

/* out[0]: leading-run hits with `capacity` blocks; out[1]: with unbounded capacity (a block
 * hits when it was written before). Returns 0, -1 out of memory, -2 for a trace of
 * 2**31 references or more. */
int64_t kvo_belady(const uint64_t *names, const int8_t *kinds, int64_t n, int64_t capacity,
                   int64_t *out) {
    out[0] = out[1] = 0;
    if (n <= 0) return 0;
    if (n >= INT32_MAX) return -2;
    int32_t *ids = malloc(sizeof(int32_t) * n), *next = malloc(sizeof(int32_t) * n);
    int32_t *at = NULL;
    Item *heap = NULL;
    int64_t distinct = -1, rc = -1;
    if (ids && next) distinct = dense_ids(names, n, ids);
    if (distinct >= 0) {
        int64_t cap = capacity < distinct ? capacity : distinct;
        at = malloc(sizeof(int32_t) * distinct);
        heap = malloc(sizeof(Item) * (2 * cap + 1026));
    }
    if (at && heap) {
        for (int64_t d = 0; d < distinct; d++) at[d] = (int32_t)n;
        for (int64_t i = n - 1; i >= 0; i--) {
            next[i] = at[ids[i]];
            at[ids[i]] = (int32_t)i;
        }
        memset(at, 0xff, sizeof(int32_t) * distinct);
        out[0] = min_hits(ids, kinds, next, n, capacity < distinct ? capacity : distinct,
                          at, heap);
        /* Unbounded: written before, counted by leading run (at[] marks written names). */
        memset(at, 0xff, sizeof(int32_t) * distinct);
        int run = 0;
        for (int64_t i = 0; i < n; i++) {
            if (kinds[i] == 1) run = 1;
            if (kinds[i] != 0) {
                run = run && at[ids[i]] >= 0;
                out[1] += run;
            } else {
                at[ids[i]] = 0;
            }
        }
        rc = 0;
    }
    free(ids);
    free(next);
    free(at);
    free(heap);
    return rc;
}
