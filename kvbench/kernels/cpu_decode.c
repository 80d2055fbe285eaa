/*
 * Decode attention on the CPU over a float32 KV pool read in place.
 *
 * One query row per sequence attends all of its context: keys and values are read where they
 * lie in the pool, through the sequence's block table (paged) or from its extent's first slot
 * (contiguous), with no gathered copy. Keys are taken in chunks of CHUNK token positions with
 * an online softmax; the chunks fall on the same positions whatever the layout, so paged and
 * contiguous caches holding the same keys give bit-identical outputs. The query heads of one
 * KV head (grouped-query attention) read its keys and values while they are in cache.
 *
 * Pool: k_cache / v_cache [slots, Hkv, D], a slot every slot_stride floats, D contiguous and
 * a multiple of 8. Query [rows, Hq, D] with the given row and head strides (D contiguous);
 * out [rows, Hq, D] contiguous, written only at the decode rows; lse [rows, Hq] (or NULL): the
 * log-sum-exp of each row's scaled scores, -inf where a sequence has no context (its output
 * is zeros).
 *
 * Written with GCC/Clang vector extensions (8 floats a vector), which the compiler maps onto
 * the CPU's SIMD registers. Built by kvbench.kernels.cpu_native with the machine's C compiler
 * and loaded with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 64
#define W 8
#define MAX_VECS 32 /* head size up to 256 */

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf load(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

static inline float sum(vf v)
{
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

#define SHUF __builtin_shufflevector

/* The sums of eight vectors' lanes, as one vector: (sum p[0], ..., sum p[7]), by pairwise
 * transposing adds (what eight separate horizontal sums would cost four times over). */
static inline vf sum8(const vf *p)
{
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + SHUF(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + SHUF(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUF(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline vf pick(vi mask, vf yes, vf no)
{
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}

static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }

/* e^x for x <= 0 (scores less their running maximum; -inf gives 0): x = n ln2 + r with
 * |r| <= ln2 / 2 (n rounded to nearest by adding and taking away 1.5 * 2^23), e^r by its
 * degree-6 Taylor polynomial (relative error under 2e-7, a float's rounding), 2^n put in the
 * exponent bits. Below -87 (under FLT_MIN) it is 0. */
static inline vf exp_nonpositive(vf x)
{
    const vi under = x < splat(-87.0f);
    x = pick(under, splat(-87.0f), x);
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    vf p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return pick(under, splat(0.0f), p * (vf)bits);
}

static inline float exp_scalar(float x) { return exp_nonpositive(splat(x))[0]; }

/* One sequence's decode: all heads over its context, d = nv * W. Inlined per head size so
 * that the loops over D unroll and keep a head's query and accumulator in registers. */
static inline __attribute__((always_inline)) void decode_one(
    const float *restrict q, int64_t q_head_stride,
    const float *restrict k_cache, const float *restrict v_cache, int64_t slot_stride,
    int64_t ctx, const int32_t *restrict table, int64_t block_size, int64_t start,
    int64_t hkv, int64_t g_size, const int64_t nv, float scale,
    float *restrict acc, float *restrict score, float *restrict mx, float *restrict total,
    int64_t *restrict slots, float *restrict out, float *restrict lse)
{
    const int64_t hq = hkv * g_size, d = nv * W;
    memset(acc, 0, sizeof(float) * hq * d);
    for (int64_t h = 0; h < hq; h++) {
        mx[h] = -INFINITY;
        total[h] = 0.0f;
    }
    int64_t block = 0, offset = 0;
    for (int64_t t0 = 0; t0 < ctx; t0 += CHUNK) {
        const int64_t c = ctx - t0 < CHUNK ? ctx - t0 : CHUNK;
        const int64_t cw = (c + W - 1) / W * W; /* scores padded to whole vectors with -inf */
        for (int64_t j = 0; j < cw; j++) {
            if (j >= c) {
                slots[j] = slots[c - 1]; /* padding: read again, scored -inf */
            } else if (table != NULL) {
                slots[j] = (int64_t)table[block] * block_size + offset;
                if (++offset == block_size) {
                    offset = 0;
                    block++;
                }
            } else {
                slots[j] = start + t0 + j;
            }
        }
        for (int64_t h = 0; h < hq; h++) {
            const float *k_head = k_cache + (h / g_size) * d;
            const float *v_head = v_cache + (h / g_size) * d;
            vf qv[MAX_VECS], a[MAX_VECS], b[MAX_VECS];
            for (int64_t x = 0; x < nv; x++)
                qv[x] = load(q + h * q_head_stride + x * W) * scale;
            float *s = score + h * CHUNK;
            for (int64_t j = 0; j < cw; j += W) {
                vf part[W];
                for (int i = 0; i < W; i++) {
                    const float *k = k_head + slots[j + i] * slot_stride;
                    part[i] = qv[0] * load(k);
                    for (int64_t x = 1; x < nv; x++)
                        part[i] += qv[x] * load(k + x * W);
                }
                store(s + j, sum8(part));
            }
            for (int64_t j = c; j < cw; j++)
                s[j] = -INFINITY;
            vf m = splat(mx[h]);
            for (int64_t j = 0; j < cw; j += W)
                m = vmax(m, load(s + j));
            float m_new = m[0];
            for (int l = 1; l < W; l++)
                m_new = m[l] > m_new ? m[l] : m_new;
            /* The first chunk finds mx = -inf and nothing accumulated yet: alpha 0. */
            const float alpha = exp_scalar(mx[h] - m_new);
            vf p_sum = splat(0.0f);
            for (int64_t j = 0; j < cw; j += W) {
                const vf p = exp_nonpositive(load(s + j) - m_new);
                store(s + j, p);
                p_sum += p;
            }
            total[h] = total[h] * alpha + sum(p_sum);
            mx[h] = m_new;
            /* Values in two interleaved sums where a head has few vectors, so that each
             * multiply-add does not wait for the one before. */
            const int two = nv <= 8;
            float *acc_h = acc + h * d;
            for (int64_t x = 0; x < nv; x++) {
                a[x] = load(acc_h + x * W) * alpha;
                b[x] = splat(0.0f);
            }
            int64_t j = 0;
            for (; two && j + 1 < c; j += 2) {
                const float *v0 = v_head + slots[j] * slot_stride;
                const float *v1 = v_head + slots[j + 1] * slot_stride;
                const vf p0 = splat(s[j]), p1 = splat(s[j + 1]);
                for (int64_t x = 0; x < nv; x++) {
                    a[x] += p0 * load(v0 + x * W);
                    b[x] += p1 * load(v1 + x * W);
                }
            }
            for (; j < c; j++) {
                const float *v = v_head + slots[j] * slot_stride;
                const vf p = splat(s[j]);
                for (int64_t x = 0; x < nv; x++)
                    a[x] += p * load(v + x * W);
            }
            for (int64_t x = 0; x < nv; x++)
                store(acc_h + x * W, a[x] + b[x]);
        }
    }
    for (int64_t h = 0; h < hq; h++) {
        const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
        for (int64_t x = 0; x < nv; x++)
            store(out + h * d + x * W, load(acc + h * d + x * W) * inv);
        if (lse != NULL)
            lse[h] = total[h] > 0.0f ? mx[h] + logf(total[h]) : -INFINITY;
    }
}

/* Whether every key of every sequence lies in the pool's num_slots slots. */
static int keys_in_pool(int64_t n, const int64_t *seqs, const int32_t *context_lens,
                        const int32_t *block_tables, int64_t table_stride, int64_t block_size,
                        const int64_t *extent_starts, int64_t num_slots)
{
    for (int64_t i = 0; i < n; i++) {
        const int64_t seq = seqs[i], ctx = context_lens[seq];
        if (ctx < 0)
            return 0;
        if (block_tables == NULL) {
            if (ctx > 0 && (extent_starts[seq] < 0 || extent_starts[seq] + ctx > num_slots))
                return 0;
            continue;
        }
        const int32_t *table = block_tables + seq * table_stride;
        for (int64_t b = 0; b * block_size < ctx; b++) {
            const int64_t used = ctx - b * block_size < block_size ? ctx - b * block_size
                                                                   : block_size;
            if (table[b] < 0 || (int64_t)table[b] * block_size + used > num_slots)
                return 0;
        }
    }
    return 1;
}

/* The kernel's entry; returns 0, -1 when its buffers cannot be allocated, -2 for a head size
 * that is not a multiple of 8 or over 256, -3 when a block table or extent reaches outside
 * the pool (nothing is written then). */
int kvb_decode_attention(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache, int64_t slot_stride, int64_t num_slots,
    int64_t n, const int64_t *seqs, const int64_t *rows, const int32_t *context_lens,
    const int32_t *block_tables, int64_t table_stride, int64_t block_size,
    const int64_t *extent_starts,
    int64_t hq, int64_t hkv, int64_t d, float scale,
    float *out, float *lse)
{
    if (d % W != 0 || d > MAX_VECS * W)
        return -2;
    if (!keys_in_pool(n, seqs, context_lens, block_tables, table_stride, block_size,
                      extent_starts, num_slots))
        return -3;
    float *buf = malloc(sizeof(float) * (size_t)(hq * (d + CHUNK + 2)));
    int64_t *slots = malloc(sizeof(int64_t) * CHUNK);
    if (buf == NULL || slots == NULL) {
        free(buf);
        free(slots);
        return -1;
    }
    float *acc = buf;                 /* [Hq, D] */
    float *score = acc + hq * d;      /* [Hq, CHUNK] */
    float *mx = score + hq * CHUNK;   /* [Hq] running max */
    float *total = mx + hq;           /* [Hq] running sum of exp */
    const int64_t g_size = hq / hkv;

    for (int64_t i = 0; i < n; i++) {
        const int64_t seq = seqs[i], row = rows[i];
        const float *q = query + row * q_row_stride;
        const int32_t *table = block_tables != NULL ? block_tables + seq * table_stride : NULL;
        const int64_t start = extent_starts != NULL ? extent_starts[seq] : 0;
        float *o = out + row * hq * d;
        float *l = lse != NULL ? lse + row * hq : NULL;
#define DECODE(NV) decode_one(q, q_head_stride, k_cache, v_cache, slot_stride, \
                              context_lens[seq], table, block_size, start, hkv, g_size, (NV), \
                              scale, acc, score, mx, total, slots, o, l)
        switch (d / W) {
        case 4: DECODE(4); break;
        case 8: DECODE(8); break;
        case 16: DECODE(16); break;
        default: DECODE(d / W); break;
        }
#undef DECODE
    }
    free(buf);
    free(slots);
    return 0;
}
