/* The key queues of offload tiers (key_queue.py). A Mooncake replay sends about a million
 * evicted blocks through a tier; in a Python OrderedDict or heap each costs about a
 * microsecond.
 *
 * - Queue (kvq_*), for lru tiers: keys join at the tail, leave from anywhere, and are
 *   evicted from the head. A ring of keys with a live flag each: a key that leaves early
 *   leaves a dead entry that eviction skips, and the ring is compacted when its tail reaches
 *   the end (grown where that frees too little).
 * - Ranked (kvr_*), for lfu and cost tiers: keys by (rank, order added), the lowest first.
 *   A binary heap with lazy deletion: an entry whose key has left (or joined again since)
 *   stays until it surfaces, and the heap is rebuilt without such entries once they
 *   outnumber the live ones.
 *
 * Both find a held key through a Table: open addressing, linear probing, deletion by
 * backward shift, kept at most half full; its count is the queue's. Calls return -1 when out
 * of memory, having changed nothing that the queue's contents depend on. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t key;
    int64_t pos; /* < 0: empty; else the key's place in the ring, or its heap entry's stamp */
} Slot;

typedef struct {
    int64_t bits, mask, count;
    Slot *h;
} Table;

static int table_init(Table *t) {
    t->bits = 11;
    t->mask = (1LL << t->bits) - 1;
    t->count = 0;
    t->h = malloc((t->mask + 1) * sizeof(Slot));
    if (!t->h) return 0;
    for (int64_t i = 0; i <= t->mask; i++) t->h[i].pos = -1;
    return 1;
}

static inline int64_t home(const Table *t, uint64_t k) {
    return (int64_t)((k * 0x9E3779B97F4A7C15ULL) >> (64 - t->bits));
}

/* The slot holding key k, or the empty slot ending its probe run. */
static inline int64_t slot_of(const Table *t, uint64_t k) {
    int64_t i = home(t, k);
    while (t->h[i].pos >= 0 && t->h[i].key != k) i = (i + 1) & t->mask;
    return i;
}

static void unslot(Table *t, int64_t i) {
    int64_t j = i, mask = t->mask;
    for (;;) {
        j = (j + 1) & mask;
        if (t->h[j].pos < 0) break;
        int64_t h = home(t, t->h[j].key);
        /* The entry at j may fill the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            t->h[i] = t->h[j];
            i = j;
        }
    }
    t->h[i].pos = -1;
    t->count--;
}

/* Room for m more keys, the table at most half full; 0 when out of memory. */
static int reserve(Table *t, int64_t m) {
    int64_t bits = t->bits;
    while (2 * (t->count + m) > (1LL << bits)) bits++;
    if (bits == t->bits) return 1;
    int64_t size = 1LL << bits, old_size = t->mask + 1;
    Slot *h = malloc(size * sizeof(Slot)), *old = t->h;
    if (!h) return 0;
    for (int64_t i = 0; i < size; i++) h[i].pos = -1;
    t->h = h;
    t->bits = bits;
    t->mask = size - 1;
    for (int64_t i = 0; i < old_size; i++)
        if (old[i].pos >= 0) h[slot_of(t, old[i].key)] = old[i];
    free(old);
    return 1;
}

/* Take out those of keys held; gone[i] (unless NULL) says whether keys[i] was, and each
 * one's place in live (unless NULL) is marked dead. Returns how many were. */
static int64_t take_keys(Table *t, const uint64_t *keys, int64_t m, uint8_t *gone,
                         uint8_t *live) {
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = slot_of(t, keys[i]);
        int held = t->h[s].pos >= 0;
        if (held) {
            if (live) live[t->h[s].pos] = 0;
            unslot(t, s);
            n++;
        }
        if (gone) gone[i] = (uint8_t)held;
    }
    return n;
}

/* How many of keys, from the first on, are held. */
static int64_t run_of(const Table *t, const uint64_t *keys, int64_t m) {
    int64_t i = 0;
    while (i < m && t->h[slot_of(t, keys[i])].pos >= 0) i++;
    return i;
}

/* --- Queue: lru ------------------------------------------------------------------------ */

typedef struct {
    Table t;
    int64_t cap, head, tail;
    uint64_t *ring;
    uint8_t *live;
} Queue;

Queue *kvq_new(void) {
    Queue *q = calloc(1, sizeof(Queue));
    if (!q) return NULL;
    q->cap = 1024;
    q->ring = malloc(q->cap * sizeof(uint64_t));
    q->live = calloc(q->cap, 1);
    if (!q->ring || !q->live || !table_init(&q->t)) {
        free(q->ring); free(q->live); free(q);
        return NULL;
    }
    return q;
}

void kvq_free(Queue *q) {
    if (!q) return;
    free(q->ring); free(q->live); free(q->t.h); free(q);
}

/* Room in the ring for m more keys: live ones moved to the front, the ring grown if that
 * leaves too little. */
static int make_room(Queue *q, int64_t m) {
    if (q->tail + m <= q->cap) return 1;
    int64_t count = q->t.count, cap = q->cap;
    while (cap < 2 * (count + m)) cap *= 2;
    uint64_t *ring = q->ring;
    uint8_t *live = q->live;
    if (cap != q->cap) {
        ring = malloc(cap * sizeof(uint64_t));
        live = malloc(cap);
        if (!ring || !live) {
            free(ring); free(live);
            return 0;
        }
    }
    int64_t n = 0;
    for (int64_t i = q->head; i < q->tail; i++)
        if (q->live[i]) ring[n++] = q->ring[i];
    if (ring != q->ring) {
        free(q->ring); free(q->live);
        q->ring = ring;
        q->live = live;
        q->cap = cap;
    }
    memset(live, 1, n);
    memset(live + n, 0, cap - n);
    q->head = 0;
    q->tail = n;
    for (int64_t i = 0; i < n; i++) q->t.h[slot_of(&q->t, ring[i])].pos = i;
    return 1;
}

/* Append keys at the tail (one held already stays where it is); returns the count. */
int64_t kvq_add(Queue *q, const uint64_t *keys, int64_t m) {
    if (!reserve(&q->t, m) || !make_room(q, m)) return -1;
    Table *t = &q->t;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = slot_of(t, keys[i]);
        if (t->h[s].pos >= 0) continue;
        t->h[s].key = keys[i];
        t->h[s].pos = q->tail;
        t->count++;
        q->ring[q->tail] = keys[i];
        q->live[q->tail++] = 1;
    }
    return t->count;
}

int64_t kvq_remove(Queue *q, const uint64_t *keys, int64_t m, uint8_t *gone) {
    int64_t n = take_keys(&q->t, keys, m, gone, q->live);
    while (q->head < q->tail && !q->live[q->head]) q->head++;
    return n;
}

/* The m least recently added keys (m at most the count), out of the queue into out. */
int64_t kvq_evict(Queue *q, int64_t m, uint64_t *out) {
    if (m < 0 || m > q->t.count) return -1;
    int64_t head = q->head;
    for (int64_t i = 0; i < m; i++) {
        while (!q->live[head]) head++;
        uint64_t k = q->ring[head];
        q->live[head++] = 0;
        unslot(&q->t, slot_of(&q->t, k));
        out[i] = k;
    }
    while (head < q->tail && !q->live[head]) head++;
    q->head = head;
    return m;
}

int64_t kvq_run(const Queue *q, const uint64_t *keys, int64_t m) {
    return run_of(&q->t, keys, m);
}

/* The keys held, least recently added first, into out (room for the count). */
int64_t kvq_keys(const Queue *q, uint64_t *out) {
    int64_t n = 0;
    for (int64_t i = q->head; i < q->tail; i++)
        if (q->live[i]) out[n++] = q->ring[i];
    return n;
}

/* --- Ranked: lfu and cost -------------------------------------------------------------- */

typedef struct {
    double rank;
    int64_t stamp;
    uint64_t key;
} Entry;

typedef struct {
    Table t;
    Entry *heap;
    int64_t size, cap, stamp;
} Ranked;

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

/* Whether heap entry e is its key's current one. */
static inline int current(const Table *t, const Entry *e) {
    return t->h[slot_of(t, e->key)].pos == e->stamp;
}

Ranked *kvr_new(void) {
    Ranked *q = calloc(1, sizeof(Ranked));
    if (!q) return NULL;
    q->cap = 1024;
    q->heap = malloc(q->cap * sizeof(Entry));
    if (!q->heap || !table_init(&q->t)) {
        free(q->heap); free(q);
        return NULL;
    }
    return q;
}

void kvr_free(Ranked *q) {
    if (!q) return;
    free(q->heap); free(q->t.h); free(q);
}

/* Add keys with their ranks (a key held already joins again, as new); returns the count. */
int64_t kvr_add(Ranked *q, const uint64_t *keys, const double *ranks, int64_t m) {
    if (!reserve(&q->t, m)) return -1;
    if (q->size + m > q->cap) {
        int64_t cap = q->cap;
        while (cap < q->size + m) cap *= 2;
        Entry *heap = realloc(q->heap, cap * sizeof(Entry));
        if (!heap) return -1;
        q->heap = heap;
        q->cap = cap;
    }
    Table *t = &q->t;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = slot_of(t, keys[i]);
        if (t->h[s].pos < 0) {
            t->h[s].key = keys[i];
            t->count++;
        }
        t->h[s].pos = ++q->stamp;
        Entry *e = &q->heap[q->size];
        e->rank = ranks[i];
        e->stamp = q->stamp;
        e->key = keys[i];
        sift_up(q->heap, q->size++);
    }
    return t->count;
}

/* Take out those of keys held (their entries go stale); gone as take_keys. */
int64_t kvr_remove(Ranked *q, const uint64_t *keys, int64_t m, uint8_t *gone) {
    int64_t n = take_keys(&q->t, keys, m, gone, NULL);
    if (q->size > 2 * q->t.count + 64) {
        int64_t k = 0;
        for (int64_t i = 0; i < q->size; i++)
            if (current(&q->t, &q->heap[i])) q->heap[k++] = q->heap[i];
        q->size = k;
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(q->heap, k, i);
    }
    return n;
}

/* The m keys of lowest rank, the least recently added first among equals, out into out. */
int64_t kvr_evict(Ranked *q, int64_t m, uint64_t *out) {
    if (m < 0 || m > q->t.count) return -1;
    for (int64_t i = 0; i < m;) {
        Entry e = q->heap[0];
        q->heap[0] = q->heap[--q->size];
        if (q->size) sift_down(q->heap, q->size, 0);
        int64_t s = slot_of(&q->t, e.key);
        if (q->t.h[s].pos != e.stamp) continue;
        unslot(&q->t, s);
        out[i++] = e.key;
    }
    return m;
}

int64_t kvr_run(const Ranked *q, const uint64_t *keys, int64_t m) {
    return run_of(&q->t, keys, m);
}

/* The keys held, in no particular order, into out (room for the count). */
int64_t kvr_keys(const Ranked *q, uint64_t *out) {
    int64_t n = 0;
    for (int64_t i = 0; i <= q->t.mask; i++)
        if (q->t.h[i].pos >= 0) out[n++] = q->t.h[i].key;
    return n;
}
