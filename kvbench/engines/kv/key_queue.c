/* An LRU queue of 64-bit keys for offload tiers (key_queue.py): keys join at the tail,
 * leave from anywhere, and are evicted from the head. A Mooncake replay sends about a
 * million evicted blocks through a tier; in a Python OrderedDict each costs about a
 * microsecond.
 *
 * The queue is a ring of keys with a live flag each: a key that leaves early leaves a dead
 * entry that eviction skips, and the ring is compacted when its tail reaches the end (grown
 * where that frees too little). A key's place is found through an open-addressing table
 * (linear probing, deletion by backward shift) kept at most half full. Calls return -1 when
 * out of memory, having changed nothing that the queue's contents depend on. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t key;
    int64_t pos; /* < 0: empty */
} Slot;

typedef struct {
    int64_t cap, head, tail, count;
    uint64_t *ring;
    uint8_t *live;
    int64_t hbits, hmask, hcount;
    Slot *h;
} Queue;

static inline int64_t home(const Queue *q, uint64_t k) {
    return (int64_t)((k * 0x9E3779B97F4A7C15ULL) >> (64 - q->hbits));
}

static inline int64_t slot_of(const Queue *q, uint64_t k) {
    int64_t i = home(q, k);
    while (q->h[i].pos >= 0 && q->h[i].key != k) i = (i + 1) & q->hmask;
    return i;
}

static void unslot(Queue *q, int64_t i) {
    int64_t j = i, mask = q->hmask;
    for (;;) {
        j = (j + 1) & mask;
        if (q->h[j].pos < 0) break;
        int64_t h = home(q, q->h[j].key);
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            q->h[i] = q->h[j];
            i = j;
        }
    }
    q->h[i].pos = -1;
    q->hcount--;
}

static int rehash(Queue *q, int64_t bits) {
    int64_t size = 1LL << bits, old_size = q->hmask + 1;
    Slot *h = malloc(size * sizeof(Slot)), *old = q->h;
    if (!h) return 0;
    for (int64_t i = 0; i < size; i++) h[i].pos = -1;
    q->h = h;
    q->hbits = bits;
    q->hmask = size - 1;
    for (int64_t i = 0; i < old_size; i++)
        if (old[i].pos >= 0) h[slot_of(q, old[i].key)] = old[i];
    free(old);
    return 1;
}

Queue *kvq_new(void) {
    Queue *q = calloc(1, sizeof(Queue));
    if (!q) return NULL;
    q->cap = 1024;
    q->ring = malloc(q->cap * sizeof(uint64_t));
    q->live = calloc(q->cap, 1);
    q->hbits = 11;
    q->hmask = (1LL << q->hbits) - 1;
    q->h = malloc((q->hmask + 1) * sizeof(Slot));
    if (!q->ring || !q->live || !q->h) {
        free(q->ring); free(q->live); free(q->h); free(q);
        return NULL;
    }
    for (int64_t i = 0; i <= q->hmask; i++) q->h[i].pos = -1;
    return q;
}

void kvq_free(Queue *q) {
    if (!q) return;
    free(q->ring); free(q->live); free(q->h); free(q);
}

/* Room in the ring for m more keys: live ones moved to the front, the ring grown if that
 * leaves too little. */
static int make_room(Queue *q, int64_t m) {
    if (q->tail + m <= q->cap) return 1;
    int64_t need = q->count + m, cap = q->cap;
    while (cap < 2 * need) cap *= 2;
    if (cap != q->cap) {
        uint64_t *ring = malloc(cap * sizeof(uint64_t));
        uint8_t *live = calloc(cap, 1);
        if (!ring || !live) {
            free(ring); free(live);
            return 0;
        }
        int64_t n = 0;
        for (int64_t i = q->head; i < q->tail; i++)
            if (q->live[i]) ring[n++] = q->ring[i];
        free(q->ring); free(q->live);
        q->ring = ring;
        q->live = live;
        q->cap = cap;
        memset(live, 1, n);
    } else {
        int64_t n = 0;
        for (int64_t i = q->head; i < q->tail; i++)
            if (q->live[i]) q->ring[n++] = q->ring[i];
        memset(q->live, 0, q->cap);
        memset(q->live, 1, n);
    }
    q->head = 0;
    q->tail = q->count;
    for (int64_t i = 0; i < q->count; i++) q->h[slot_of(q, q->ring[i])].pos = i;
    return 1;
}

/* Append keys at the tail (one held already stays where it is); returns the count. */
int64_t kvq_add(Queue *q, const uint64_t *keys, int64_t m) {
    int64_t bits = q->hbits;
    while (2 * (q->hcount + m) > (1LL << bits)) bits++;
    if (bits != q->hbits && !rehash(q, bits)) return -1;
    if (!make_room(q, m)) return -1;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = slot_of(q, keys[i]);
        if (q->h[s].pos >= 0) continue; /* held already: stays where it is */
        q->h[s].key = keys[i];
        q->h[s].pos = q->tail;
        q->hcount++;
        q->ring[q->tail] = keys[i];
        q->live[q->tail++] = 1;
        q->count++;
    }
    return q->count;
}

/* Take out those of keys held; gone[i] (unless NULL) says whether keys[i] was. Returns how
 * many were. */
int64_t kvq_remove(Queue *q, const uint64_t *keys, int64_t m, uint8_t *gone) {
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = slot_of(q, keys[i]);
        int held = q->h[s].pos >= 0;
        if (held) {
            q->live[q->h[s].pos] = 0;
            unslot(q, s);
            q->count--;
            n++;
        }
        if (gone) gone[i] = (uint8_t)held;
    }
    while (q->head < q->tail && !q->live[q->head]) q->head++;
    return n;
}

/* The m least recently added keys (m at most the count), out of the queue into out. */
int64_t kvq_evict(Queue *q, int64_t m, uint64_t *out) {
    if (m < 0 || m > q->count) return -1;
    int64_t head = q->head;
    for (int64_t i = 0; i < m; i++) {
        while (!q->live[head]) head++;
        uint64_t k = q->ring[head];
        q->live[head++] = 0;
        unslot(q, slot_of(q, k));
        out[i] = k;
    }
    while (head < q->tail && !q->live[head]) head++;
    q->head = head;
    q->count -= m;
    return m;
}

/* How many of keys, from the first on, are held. */
int64_t kvq_run(const Queue *q, const uint64_t *keys, int64_t m) {
    int64_t i = 0;
    while (i < m && q->h[slot_of(q, keys[i])].pos >= 0) i++;
    return i;
}

/* The keys held, least recently added first, into out (room for the count). */
int64_t kvq_keys(const Queue *q, uint64_t *out) {
    int64_t n = 0;
    for (int64_t i = q->head; i < q->tail; i++)
        if (q->live[i]) out[n++] = q->ring[i];
    return n;
}

/* A ranked queue, for tiers that evict by lfu or cost: keys by (rank, order added), the
 * lowest first. A binary heap with lazy deletion: an entry whose key has left (or joined
 * again since) stays until it surfaces, and the heap is rebuilt without such entries once
 * they outnumber the live ones. The table maps each held key to the stamp of its entry. */

typedef struct {
    double rank;
    int64_t stamp;
    uint64_t key;
} Entry;

typedef struct {
    Entry *heap;
    int64_t size, cap, stamp, count;
    int64_t hbits, hmask, hcount;
    Slot *h; /* pos: the key's stamp */
} Ranked;

static inline int64_t rhome(const Ranked *q, uint64_t k) {
    return (int64_t)((k * 0x9E3779B97F4A7C15ULL) >> (64 - q->hbits));
}

static inline int64_t rslot_of(const Ranked *q, uint64_t k) {
    int64_t i = rhome(q, k);
    while (q->h[i].pos >= 0 && q->h[i].key != k) i = (i + 1) & q->hmask;
    return i;
}

static void runslot(Ranked *q, int64_t i) {
    int64_t j = i, mask = q->hmask;
    for (;;) {
        j = (j + 1) & mask;
        if (q->h[j].pos < 0) break;
        int64_t h = rhome(q, q->h[j].key);
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            q->h[i] = q->h[j];
            i = j;
        }
    }
    q->h[i].pos = -1;
    q->hcount--;
}

static int rrehash(Ranked *q, int64_t bits) {
    int64_t size = 1LL << bits, old_size = q->hmask + 1;
    Slot *h = malloc(size * sizeof(Slot)), *old = q->h;
    if (!h) return 0;
    for (int64_t i = 0; i < size; i++) h[i].pos = -1;
    q->h = h;
    q->hbits = bits;
    q->hmask = size - 1;
    for (int64_t i = 0; i < old_size; i++)
        if (old[i].pos >= 0) h[rslot_of(q, old[i].key)] = old[i];
    free(old);
    return 1;
}

static inline int below(const Entry *a, const Entry *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->stamp < b->stamp);
}

static void sift_up(Entry *heap, int64_t i) {
    Entry e = heap[i];
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!below(&e, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = e;
}

static void sift_down(Entry *heap, int64_t n, int64_t i) {
    Entry e = heap[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && below(&heap[c + 1], &heap[c])) c++;
        if (!below(&heap[c], &e)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = e;
}

static inline int live(const Ranked *q, const Entry *e) {
    int64_t s = rslot_of(q, e->key);
    return q->h[s].pos == e->stamp;
}

Ranked *kvr_new(void) {
    Ranked *q = calloc(1, sizeof(Ranked));
    if (!q) return NULL;
    q->cap = 1024;
    q->heap = malloc(q->cap * sizeof(Entry));
    q->hbits = 11;
    q->hmask = (1LL << q->hbits) - 1;
    q->h = malloc((q->hmask + 1) * sizeof(Slot));
    if (!q->heap || !q->h) {
        free(q->heap); free(q->h); free(q);
        return NULL;
    }
    for (int64_t i = 0; i <= q->hmask; i++) q->h[i].pos = -1;
    return q;
}

void kvr_free(Ranked *q) {
    if (!q) return;
    free(q->heap); free(q->h); free(q);
}

/* Add keys with their ranks (a key held already joins again, as new); returns the count. */
int64_t kvr_add(Ranked *q, const uint64_t *keys, const double *ranks, int64_t m) {
    int64_t bits = q->hbits;
    while (2 * (q->hcount + m) > (1LL << bits)) bits++;
    if (bits != q->hbits && !rrehash(q, bits)) return -1;
    if (q->size + m > q->cap) {
        int64_t cap = q->cap;
        while (cap < q->size + m) cap *= 2;
        Entry *heap = realloc(q->heap, cap * sizeof(Entry));
        if (!heap) return -1;
        q->heap = heap;
        q->cap = cap;
    }
    for (int64_t i = 0; i < m; i++) {
        int64_t s = rslot_of(q, keys[i]);
        if (q->h[s].pos < 0) {
            q->h[s].key = keys[i];
            q->hcount++;
            q->count++;
        }
        q->h[s].pos = ++q->stamp;
        Entry *e = &q->heap[q->size];
        e->rank = ranks[i];
        e->stamp = q->stamp;
        e->key = keys[i];
        sift_up(q->heap, q->size++);
    }
    return q->count;
}

/* Take out those of keys held (their entries go stale); gone as kvq_remove. */
int64_t kvr_remove(Ranked *q, const uint64_t *keys, int64_t m, uint8_t *gone) {
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = rslot_of(q, keys[i]);
        int held = q->h[s].pos >= 0;
        if (held) {
            runslot(q, s);
            q->count--;
            n++;
        }
        if (gone) gone[i] = (uint8_t)held;
    }
    if (q->size > 2 * q->count + 64) {
        int64_t k = 0;
        for (int64_t i = 0; i < q->size; i++)
            if (live(q, &q->heap[i])) q->heap[k++] = q->heap[i];
        q->size = k;
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(q->heap, k, i);
    }
    return n;
}

/* The m keys of lowest rank, the least recently added first among equals, out into out. */
int64_t kvr_evict(Ranked *q, int64_t m, uint64_t *out) {
    if (m < 0 || m > q->count) return -1;
    for (int64_t i = 0; i < m;) {
        Entry e = q->heap[0];
        q->heap[0] = q->heap[--q->size];
        if (q->size) sift_down(q->heap, q->size, 0);
        int64_t s = rslot_of(q, e.key);
        if (q->h[s].pos != e.stamp) continue;
        runslot(q, s);
        q->count--;
        out[i++] = e.key;
    }
    return m;
}

int64_t kvr_run(const Ranked *q, const uint64_t *keys, int64_t m) {
    int64_t i = 0;
    while (i < m && q->h[rslot_of(q, keys[i])].pos >= 0) i++;
    return i;
}

/* The keys held, in no particular order, into out (room for the count). */
int64_t kvr_keys(const Ranked *q, uint64_t *out) {
    int64_t n = 0;
    for (int64_t i = 0; i <= q->hmask; i++)
        if (q->h[i].pos >= 0) out[n++] = q->h[i].key;
    return n;
}
