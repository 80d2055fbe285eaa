/* The event replay's C helpers, built on first use like the native attention kernel:
 *
 * - The block pool (BlockPool, LRU or LFU): the same blocks handed out, the same keys,
 *   counters and eviction order, with the prefix cache's key -> block index in an
 *   open-addressing table instead of a Python dict. A Mooncake replay makes millions of
 *   lookups, insertions and deletions of block keys; in a dict each one is a Python call and
 *   a cache miss on a large table.
 * - Prompt block digests (kvh_digests, at the end).
 *
 * Counters are in `c`, which Python reads in place:
 *   c[0] plain free blocks (the stack's top), c[1] queue head, c[2] queue tail,
 *   c[3] holes in the queue, c[4] shared, c[5] allocations, c[6] evictions, c[7] frees,
 *   c[8] leaked blocks no table holds.
 *
 * Plain free blocks form a stack whose top is block 0 in a fresh pool. Freed blocks holding
 * cached content (a key or a placeholder) queue least recently freed first; a prefix hit
 * that takes one back leaves a hole (-1) that eviction skips. With LFU eviction they wait
 * instead in a binary heap by (prefix hits, order freed), each block's place in qpos, the
 * heap's size in c[QTAIL] and no head or holes. The key table uses linear
 * probing with deletion by backward shift, sized for four times the blocks (a block holds one
 * key at a time): short probe runs. Block ids from Python are checked: a call with one
 * outside the pool (or taking more blocks than are free) returns -1 having done nothing. */

#include <stdint.h>
#include <stdlib.h>

enum { NONE = 0, PLACEHOLDER = 1, KEYED = 2 };
enum { TOP, QHEAD, QTAIL, QHOLES, SHARED, ALLOCS, EVICTIONS, FREES, LOST, NCOUNTERS };

typedef struct {
    uint64_t key;
    int64_t block;
} Entry;

/* An LFU heap entry: the block's hits when it was freed, and the order it was freed in. */
typedef struct {
    int64_t hits, stamp, block;
} Node;

typedef struct {
    int64_t n, bs, qcap, lfu, next_stamp;
    int64_t *ref, *plain, *q, *qpos, *hits;
    Node *heap;
    uint8_t *hit, *leaked;
    int8_t *state;
    uint64_t *key;
    int64_t c[NCOUNTERS];
    /* the key the next evicted placeholder goes down to offload tiers under: counting down
     * from the top of the key space */
    uint64_t placeholder;
    /* the key table: entries key -> block, block < 0 where empty */
    int64_t hbits, hmask, hcount;
    Entry *h;
} Pool;

static inline int64_t home(const Pool *p, uint64_t k) {
    return (int64_t)((k * 0x9E3779B97F4A7C15ULL) >> (64 - p->hbits));
}

/* The slot holding key k, or the empty slot ending its probe run. */
static inline int64_t slot_of(const Pool *p, uint64_t k) {
    int64_t i = home(p, k);
    while (p->h[i].block >= 0 && p->h[i].key != k) i = (i + 1) & p->hmask;
    return i;
}

/* The block caching key k, or -1. */
static inline int64_t get(const Pool *p, uint64_t k) {
    return p->h[slot_of(p, k)].block;
}

/* The table at twice the size, entries reinserted; 0 when out of memory (then unchanged). */
static int grow_table(Pool *p) {
    int64_t old_size = p->hmask + 1, size = 2 * old_size;
    Entry *h = malloc(size * sizeof(Entry)), *old = p->h;
    if (!h) return 0;
    for (int64_t i = 0; i < size; i++) h[i].block = -1;
    p->h = h;
    p->hbits++;
    p->hmask = size - 1;
    for (int64_t i = 0; i < old_size; i++) {
        if (old[i].block < 0) continue;
        h[slot_of(p, old[i].key)] = old[i];
    }
    free(old);
    return 1;
}

/* The block caching k, made b where none does; -2 when the table cannot take it. */
static inline int64_t setdefault(Pool *p, uint64_t k, int64_t b) {
    int64_t i = slot_of(p, k);
    if (p->h[i].block >= 0) return p->h[i].block;
    /* A block holds one key, so the table stays at most a quarter full, unless blocks are
     * keyed again under other keys (their old entries stay, as a dict's would): then it
     * grows. */
    if (2 * (p->hcount + 1) > p->hmask + 1) {
        if (!grow_table(p)) return -2;
        i = slot_of(p, k);
    }
    p->h[i].key = k;
    p->h[i].block = b;
    p->hcount++;
    return b;
}

static void del(Pool *p, uint64_t k) {
    int64_t i = slot_of(p, k), j = i, mask = p->hmask;
    if (p->h[i].block < 0) return;
    for (;;) {
        j = (j + 1) & mask;
        if (p->h[j].block < 0) break;
        int64_t h = home(p, p->h[j].key);
        /* The entry at j may fill the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            p->h[i] = p->h[j];
            i = j;
        }
    }
    p->h[i].block = -1;
    p->hcount--;
}

void kvp_free(Pool *p) {
    if (!p) return;
    free(p->ref); free(p->plain); free(p->q); free(p->qpos); free(p->hit); free(p->leaked);
    free(p->state); free(p->key); free(p->hits); free(p->heap); free(p->h); free(p);
}

/* --- the LFU heap: blocks by (hits, stamp), the least first ------------------------------ */

static inline int before(const Node *a, const Node *b) {
    return a->hits < b->hits || (a->hits == b->hits && a->stamp < b->stamp);
}

static inline void put(Pool *p, int64_t i, Node x) {
    p->heap[i] = x;
    p->qpos[x.block] = i;
}

static void sift_up(Pool *p, int64_t i) {
    Node x = p->heap[i];
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!before(&x, &p->heap[parent])) break;
        put(p, i, p->heap[parent]);
        i = parent;
    }
    put(p, i, x);
}

static void sift_down(Pool *p, int64_t i) {
    int64_t n = p->c[QTAIL];
    Node x = p->heap[i];
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && before(&p->heap[child + 1], &p->heap[child])) child++;
        if (!before(&p->heap[child], &x)) break;
        put(p, i, p->heap[child]);
        i = child;
    }
    put(p, i, x);
}

static void heap_remove(Pool *p, int64_t b) {
    int64_t i = p->qpos[b], last = --p->c[QTAIL];
    p->qpos[b] = -1;
    if (i == last) return;
    int64_t moved = p->heap[last].block;
    put(p, i, p->heap[last]);
    sift_up(p, i);
    sift_down(p, p->qpos[moved]);
}

/* --- the pool ------------------------------------------------------------------------- */

Pool *kvp_new(int64_t n, int64_t bs, int64_t lfu) {
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    p->n = n;
    p->bs = bs;
    p->lfu = lfu;
    p->qcap = 2 * n + 64;
    p->hbits = 4;
    while ((1LL << p->hbits) < 4 * n) p->hbits++;
    int64_t hsize = 1LL << p->hbits;
    p->hmask = hsize - 1;
    p->ref = calloc(n ? n : 1, sizeof(int64_t));
    p->plain = malloc((n ? n : 1) * sizeof(int64_t));
    p->q = malloc(p->qcap * sizeof(int64_t));
    p->qpos = malloc((n ? n : 1) * sizeof(int64_t));
    p->hit = calloc(n ? n : 1, 1);
    p->leaked = calloc(n ? n : 1, 1);
    p->state = calloc(n ? n : 1, 1);
    p->key = calloc(n ? n : 1, sizeof(uint64_t));
    p->hits = calloc(n ? n : 1, sizeof(int64_t));
    p->heap = malloc((n ? n : 1) * sizeof(Node));
    p->h = malloc(hsize * sizeof(Entry));
    if (!p->ref || !p->plain || !p->q || !p->qpos || !p->hit || !p->leaked || !p->state || !p->key
        || !p->hits || !p->heap || !p->h) {
        kvp_free(p);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++) {
        p->plain[i] = n - 1 - i;
        p->qpos[i] = -1;
    }
    for (int64_t i = 0; i < p->qcap; i++) p->q[i] = -1;
    for (int64_t i = 0; i < hsize; i++) p->h[i].block = -1;
    p->c[TOP] = n;
    p->placeholder = UINT64_MAX;
    return p;
}


/* Where Python reads the pool's counters. */
int64_t *kvp_counters(Pool *p) {
    return p->c;
}

/* Block ids from Python outside the pool: refused (-1) before anything is touched. */
static int outside(const Pool *p, const int64_t *blocks, int64_t m) {
    for (int64_t i = 0; i < m; i++)
        if ((uint64_t)blocks[i] >= (uint64_t)p->n) return 1;
    return 0;
}

/* Hand out m blocks into out, each with one reference: plain ones first, then the cached
 * ones eviction gives up first (-1, nothing done, where fewer are free). Unless ev_keys is
 * NULL, the key each evicted block cached goes there, in eviction order, for offload tiers
 * (a placeholder's: one of its own), and its prefix hits to ev_hits unless that is NULL;
 * returns how many were evicted. */
int64_t kvp_take(Pool *p, int64_t m, int64_t *out, uint64_t *ev_keys, int64_t *ev_hits) {
    int64_t *c = p->c, top = c[TOP];
    if (m < 0 || m > top + c[QTAIL] - c[QHEAD] - c[QHOLES]) return -1;
    int64_t k = m < top ? m : top;
    for (int64_t i = 0; i < k; i++) out[i] = p->plain[top - 1 - i];
    c[TOP] = top - k;
    int64_t head = c[QHEAD];
    for (int64_t i = k; i < m; i++) {
        int64_t b;
        if (p->lfu) {
            b = p->heap[0].block;
            heap_remove(p, b);
        } else {
            b = p->q[head++];
            while (b < 0) {
                c[QHOLES]--;
                b = p->q[head++];
            }
            p->qpos[b] = -1;
        }
        if (ev_hits) ev_hits[i - k] = p->hits[b];
        p->hits[b] = 0;
        if (ev_keys) ev_keys[i - k] = p->state[b] == KEYED ? p->key[b] : p->placeholder--;
        if (p->state[b] == KEYED) del(p, p->key[b]);
        p->state[b] = NONE;
        out[i] = b;
    }
    if (!p->lfu) c[QHEAD] = head;
    c[EVICTIONS] += m - k;
    for (int64_t i = 0; i < m; i++) p->ref[out[i]] = 1;
    c[ALLOCS] += m;
    return m - k;
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
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) count += p->ref[blocks[i]] == refs;
    return count;
}

/* Reference cached blocks for a prefix hit; returns how many were free before. */
int64_t kvp_touch(Pool *p, const int64_t *blocks, int64_t m) {
    int64_t *c = p->c, free_ = 0;
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i], r = p->ref[b];
        if (r == 0) {
            if (p->lfu) {
                heap_remove(p, b);
            } else {
                p->q[p->qpos[b]] = -1;
                p->qpos[b] = -1;
                c[QHOLES]++;
            }
            free_++;
        }
        c[SHARED] += !p->hit[b] && r <= 1;
        p->ref[b] = r + 1;
        p->hit[b] = 1;
        p->hits[b]++;
    }
    c[ALLOCS] += free_;
    return free_;
}

int64_t kvp_cache_placeholders(Pool *p, const int64_t *blocks, int64_t m) {
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) p->state[blocks[i]] = PLACEHOLDER;
    return 0;
}

/* Make blocks findable by keys; a key another block (or an earlier one here) caches keeps
 * that block, the duplicate staying as it was, or (rekey: blocks held under placeholders
 * getting their content's keys) going uncached. -1: a block outside; -2: out of memory. */
int64_t kvp_cache(Pool *p, const int64_t *blocks, const uint64_t *keys, int64_t m,
                  int64_t rekey) {
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i], held = setdefault(p, keys[i], b);
        if (held == -2) return -2;
        if (held == b) {
            p->key[b] = keys[i];
            p->state[b] = KEYED;
        } else if (rekey) {
            p->state[b] = NONE;
        }
    }
    return 0;
}

static void enqueue(Pool *p, int64_t b) {
    int64_t *c = p->c;
    if (p->lfu) {
        Node x = {p->hits[b], p->next_stamp++, b};
        put(p, c[QTAIL], x);
        sift_up(p, c[QTAIL]++);
        return;
    }
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
    if (outside(p, blocks, m)) return -1;
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
        if (p->leaked[b]) {
            c[LOST]++;
            continue;
        }
        c[FREES]++;
        if (p->state[b] != NONE) enqueue(p, b);
        else p->plain[c[TOP]++] = b;
    }
    return any_alive ? filled : num_filled;
}

/* Set held blocks' prefix hits (blocks loaded from offload tiers bring theirs). */
int64_t kvp_set_hits(Pool *p, const int64_t *blocks, const int64_t *hits, int64_t m) {
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) p->hits[blocks[i]] = hits[i];
    return 0;
}

/* kvp_release, but the blocks lose their keys and never go free again: the leak fault. */
int64_t kvp_leak(Pool *p, const int64_t *blocks, int64_t m, int64_t num_filled) {
    if (outside(p, blocks, m)) return -1;
    for (int64_t i = 0; i < m; i++) {
        int64_t b = blocks[i];
        if (p->state[b] == KEYED) del(p, p->key[b]);
        p->state[b] = NONE;
        p->leaked[b] = 1;
    }
    return kvp_release(p, blocks, m, num_filled);
}

/* Prompt block digests (kvbench.engines.kv.hashing.BlockHasher.digests) of the token ids of
 * consecutive contents (kvbench.workloads.model.contents_token_ids): content i, whose key
 * hashes to bases[i], contributes its first counts[i] ids (a multiple of bs), and each block
 * of bs ids becomes one digest in out. The same uint64 arithmetic as those numpy passes, in
 * one pass and without their arrays of every token. */

static inline uint64_t splitmix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

#define GOLDEN 0x9E3779B97F4A7C15ULL

void kvh_digests(const uint64_t *bases, const int64_t *counts, int64_t n, uint64_t vocab,
                 int64_t bs, const uint64_t *weights, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t base = bases[i];
        for (int64_t start = 0; start < counts[i]; start += bs) {
            uint64_t dot = 0;
            for (int64_t j = 0; j < bs; j++) {
                uint64_t pos = (uint64_t)(start + j);
                uint64_t id = splitmix(pos * GOLDEN + base + GOLDEN) % vocab;
                dot += id * weights[j];
            }
            *out++ = splitmix(dot + GOLDEN);
        }
    }
}
