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
