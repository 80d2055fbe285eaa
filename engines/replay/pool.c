/* The event replay's block pool (pool.py's ArrayPool) in C: the same blocks handed out, the
 * same keys, counters and LRU eviction order, with the prefix cache's key -> block index in an
 * open-addressing table instead of a Python dict. A Mooncake replay makes millions of
 * lookups, insertions and deletions of block keys; in a dict each one is a Python call and a
 * cache miss on a large table.
 *
 * Per-block state lives in arrays Python reads in place (reference counts for the replay's
 * room estimate; the rest for tests): ref, hit, state, key. Counters are in `c`:
 *   c[0] plain free blocks (the stack's top), c[1] queue head, c[2] queue tail,
 *   c[3] holes in the queue, c[4] shared, c[5] allocations, c[6] evictions, c[7] frees.
 *
 * Plain free blocks form a stack whose top is block 0 in a fresh pool. Freed blocks holding
 * cached content (a key or a placeholder) queue least recently freed first; a prefix hit
 * that takes one back leaves a hole (-1) that eviction skips. The key table uses linear
 * probing with deletion by backward shift, sized for twice the blocks (a block holds one key
 * at a time); kvp_cache and kvp_rekey return -1 where it could not grow (out of memory). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { NONE = 0, PLACEHOLDER = 1, KEYED = 2 };
enum { TOP, QHEAD, QTAIL, QHOLES, SHARED, ALLOCS, EVICTIONS, FREES, NCOUNTERS };

typedef struct {
    int64_t n, bs, qcap;
    int64_t *ref, *plain, *q, *qpos;
    uint8_t *hit;
    int8_t *state;
    uint64_t *key;
    int64_t c[NCOUNTERS];
    /* the key table: hkey[i] -> hblk[i], hblk[i] < 0 where empty */
    int64_t hbits, hmask, hcount;
    uint64_t *hkey;
    int64_t *hblk;
} Pool;

static inline int64_t home(const Pool *p, uint64_t k) {
    return (int64_t)((k * 0x9E3779B97F4A7C15ULL) >> (64 - p->hbits));
}

/* The slot holding key k, or the empty slot ending its probe run. */
static inline int64_t slot_of(const Pool *p, uint64_t k) {
    int64_t i = home(p, k);
    while (p->hblk[i] >= 0 && p->hkey[i] != k) i = (i + 1) & p->hmask;
    return i;
}

/* The block caching key k, or -1. */
static inline int64_t get(const Pool *p, uint64_t k) {
    return p->hblk[slot_of(p, k)];
}

/* The table at twice the size, entries reinserted; 0 when out of memory (then unchanged). */
static int grow_table(Pool *p) {
    int64_t old_size = p->hmask + 1, size = 2 * old_size;
    uint64_t *hkey = malloc(size * sizeof(uint64_t)), *okey = p->hkey;
    int64_t *hblk = malloc(size * sizeof(int64_t)), *oblk = p->hblk;
    if (!hkey || !hblk) {
        free(hkey);
        free(hblk);
        return 0;
    }
    for (int64_t i = 0; i < size; i++) hblk[i] = -1;
    p->hkey = hkey;
    p->hblk = hblk;
    p->hbits++;
    p->hmask = size - 1;
    for (int64_t i = 0; i < old_size; i++) {
        if (oblk[i] < 0) continue;
        int64_t j = slot_of(p, okey[i]);
        hkey[j] = okey[i];
        hblk[j] = oblk[i];
    }
    free(okey);
    free(oblk);
    return 1;
}

/* The block caching k, made b where none does; -2 when the table cannot take it. */
static inline int64_t setdefault(Pool *p, uint64_t k, int64_t b) {
    int64_t i = slot_of(p, k);
    if (p->hblk[i] >= 0) return p->hblk[i];
    /* A block holds one key, so the table stays half empty, unless blocks are keyed again
     * under other keys (their old entries stay, as a dict's would): then it grows. */
    if (4 * (p->hcount + 1) > 3 * (p->hmask + 1)) {
        if (!grow_table(p)) return -2;
        i = slot_of(p, k);
    }
    p->hkey[i] = k;
    p->hblk[i] = b;
    p->hcount++;
    return b;
}

static void del(Pool *p, uint64_t k) {
    int64_t i = slot_of(p, k), j = i, mask = p->hmask;
    if (p->hblk[i] < 0) return;
    for (;;) {
        j = (j + 1) & mask;
        if (p->hblk[j] < 0) break;
        int64_t h = home(p, p->hkey[j]);
        /* The entry at j may fill the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            p->hkey[i] = p->hkey[j];
            p->hblk[i] = p->hblk[j];
            i = j;
        }
    }
    p->hblk[i] = -1;
    p->hcount--;
}

Pool *kvp_new(int64_t n, int64_t bs) {
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    p->n = n;
    p->bs = bs;
    p->qcap = 2 * n + 64;
    p->hbits = 4;
    while ((1LL << p->hbits) < 2 * n) p->hbits++;
    int64_t hsize = 1LL << p->hbits;
    p->hmask = hsize - 1;
    p->ref = calloc(n ? n : 1, sizeof(int64_t));
    p->plain = malloc((n ? n : 1) * sizeof(int64_t));
    p->q = malloc(p->qcap * sizeof(int64_t));
    p->qpos = malloc((n ? n : 1) * sizeof(int64_t));
    p->hit = calloc(n ? n : 1, 1);
    p->state = calloc(n ? n : 1, 1);
    p->key = calloc(n ? n : 1, sizeof(uint64_t));
    p->hkey = malloc(hsize * sizeof(uint64_t));
    p->hblk = malloc(hsize * sizeof(int64_t));
    if (!p->ref || !p->plain || !p->q || !p->qpos || !p->hit || !p->state || !p->key
        || !p->hkey || !p->hblk) {
        free(p->ref); free(p->plain); free(p->q); free(p->qpos); free(p->hit);
        free(p->state); free(p->key); free(p->hkey); free(p->hblk); free(p);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        p->plain[i] = n - 1 - i;
        p->qpos[i] = -1;
    }
    for (int64_t i = 0; i < p->qcap; i++) p->q[i] = -1;
    for (int64_t i = 0; i < hsize; i++) p->hblk[i] = -1;
    p->c[TOP] = n;
    return p;
}

void kvp_free(Pool *p) {
    if (!p) return;
    free(p->ref); free(p->plain); free(p->q); free(p->qpos); free(p->hit);
    free(p->state); free(p->key); free(p->hkey); free(p->hblk); free(p);
}

/* Where Python reads the pool's state: ref, hit, state, key, counters. */
void kvp_arrays(Pool *p, void **out) {
    out[0] = p->ref;
    out[1] = p->hit;
    out[2] = p->state;
    out[3] = p->key;
    out[4] = p->c;
}

/* Hand out m blocks into out, each with one reference (the caller checked they are free):
 * plain ones first, then the least recently freed cached ones, evicted. */
void kvp_take(Pool *p, int64_t m, int64_t *out) {
    int64_t *c = p->c, top = c[TOP];
    int64_t k = m < top ? m : top;
    for (int64_t i = 0; i < k; i++) out[i] = p->plain[top - 1 - i];
    c[TOP] = top - k;
    int64_t head = c[QHEAD];
    for (int64_t i = k; i < m; i++) {
        int64_t b = p->q[head++];
        while (b < 0) {
            c[QHOLES]--;
            b = p->q[head++];
        }
        p->qpos[b] = -1;
        if (p->state[b] == KEYED) del(p, p->key[b]);
        p->state[b] = NONE;
        out[i] = b;
    }
    c[QHEAD] = head;
    c[EVICTIONS] += m - k;
    for (int64_t i = 0; i < m; i++) p->ref[out[i]] = 1;
    c[ALLOCS] += m;
}

/* The blocks caching the longest leading run of keys, into out; returns how many. */
int64_t kvp_lookup(const Pool *p, const uint64_t *keys, int64_t m, int64_t *out) {
    int64_t i = 0;
    for (; i < m; i++) {
        int64_t b = get(p, keys[i]);
        if (b < 0) break;
        out[i] = b;
    }
    return i;
}

/* How many of blocks have refs references. */
int64_t kvp_count_refs(const Pool *p, const int64_t *blocks, int64_t m, int64_t refs) {
    int64_t count = 0;
    for (int64_t i = 0; i < m; i++) count += p->ref[blocks[i]] == refs;
    return count;
}

/* Reference cached blocks for a prefix hit; returns how many were free before. */
int64_t kvp_touch(Pool *p, const int64_t *blocks, int64_t m) {
    int64_t *c = p->c, free_ = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i], r = p->ref[b];
        if (r == 0) {
            p->q[p->qpos[b]] = -1;
            p->qpos[b] = -1;
            c[QHOLES]++;
            free_++;
        }
        c[SHARED] += !p->hit[b] && r <= 1;
        p->ref[b] = r + 1;
        p->hit[b] = 1;
    }
    c[ALLOCS] += free_;
    return free_;
}

void kvp_cache_placeholders(Pool *p, const int64_t *blocks, int64_t m) {
    for (int64_t i = 0; i < m; i++) p->state[blocks[i]] = PLACEHOLDER;
}

/* Make blocks findable by keys; a key another block (or an earlier one here) caches keeps
 * that block, the duplicate staying as it was. */
int64_t kvp_cache(Pool *p, const int64_t *blocks, const uint64_t *keys, int64_t m) {
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i], held = setdefault(p, keys[i], b);
        if (held == -2) return -1;
        if (held == b) {
            p->key[b] = keys[i];
            p->state[b] = KEYED;
        }
    }
    return 0;
}

/* Give blocks held under placeholders their content's keys; a duplicate goes uncached. */
int64_t kvp_rekey(Pool *p, const int64_t *blocks, const uint64_t *keys, int64_t m) {
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i], held = setdefault(p, keys[i], b);
        if (held == -2) return -1;
        if (held == b) {
            p->key[b] = keys[i];
            p->state[b] = KEYED;
        } else {
            p->state[b] = NONE;
        }
    }
    return 0;
}

static void enqueue(Pool *p, int64_t b) {
    int64_t *c = p->c;
    if (c[QTAIL] == p->qcap) {
        /* Out of room at the tail: the live entries move to the front, in order. */
        int64_t w = 0;
        for (int64_t i = c[QHEAD]; i < c[QTAIL]; i++) {
            int64_t x = p->q[i];
            if (x >= 0) {
                p->q[w] = x;
                p->qpos[x] = w;
                w++;
            }
        }
        for (int64_t i = w; i < p->qcap; i++) p->q[i] = -1;
        c[QHEAD] = 0;
        c[QHOLES] = 0;
        c[QTAIL] = w;
    }
    p->q[c[QTAIL]] = b;
    p->qpos[b] = c[QTAIL];
    c[QTAIL]++;
}

/* Drop one reference to each block of a table whose first num_filled slots hold KV; returns
 * the filled slots no table references any more. Freed blocks go back tail first. */
int64_t kvp_release(Pool *p, const int64_t *blocks, int64_t m, int64_t num_filled) {
    int64_t *c = p->c, bs = p->bs, num_full = num_filled / bs, filled = 0, any_alive = 0;
    for (int64_t i = m - 1; i >= 0; i--) {
        int64_t b = blocks[i], r = p->ref[b] - 1;
        p->ref[b] = r;
        uint8_t hit = p->hit[b];
        if (r > 0) {
            any_alive = 1;
            c[SHARED] -= r == 1 && !hit;
            continue;
        }
        c[SHARED] -= hit;
        p->hit[b] = 0;
        if (i < num_full) filled += bs;
        else if (i == num_full) filled += num_filled - num_full * bs;
        c[FREES]++;
        if (p->state[b] != NONE) enqueue(p, b);
        else p->plain[c[TOP]++] = b;
    }
    return any_alive ? filled : num_filled;
}
