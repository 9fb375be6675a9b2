/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the block pool.
 *
 * Work is split over (sequence, KV head) pairs. Each pair streams its blocks once, keeping the
 * G = H / Hkv query heads that share the KV head together, with an online softmax, so nothing is
 * gathered or copied and every K/V byte is read exactly once per step.
 *
 *   k_cache, v_cache: [num_blocks, block_size, Hkv, D]   (fp32, or bf16 stored as uint16)
 *   q, out:           [B, H, D] float32 (the caller converts bf16); q's rows are q_stride floats apart
 *   block_tables:     [B, W] int64, seq_lens: [B] int64 (tokens to attend, this step's included)
 *
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

/* glibc's vector expf (libmvec); declared here so the softmax loop vectorizes without -ffast-math */
#pragma omp declare simd notinbranch
float expf(float);


static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A tree sum of the lanes: a reduction pragma lowers to 16 dependent scalar adds, which made the
 * score loop several times slower than the memory it reads. */
static inline __attribute__((always_inline)) float hsum16(v16f v) {
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    if (d % 16 == 0) {
        v16f acc = {0};
        for (int64_t i = 0; i < d; i += 16) acc += load16(a + i) * load16(b + i);
        return hsum16(acc);
    }
    float acc = 0.0f;
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* n cache elements from offset as float32: fp32 is used in place, bf16 is widened into buf. */
static inline __attribute__((always_inline)) const float *load_row(const void *cache, int64_t offset, int64_t n,
                                                                   int is_bf16, float *buf) {
    if (!is_bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* One sequence, KV heads [h0, h1): every K/V row segment of those heads is read once, in order. */
static inline __attribute__((always_inline)) void decode_heads(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx,
    float *out, int64_t h0, int64_t h1, int64_t num_kv_heads, int64_t group, int64_t d, int64_t bs,
    float scale, int is_bf16, float *work) {
    int64_t nq = (h1 - h0) * group; /* queries handled here, row r = (h - h0) * group + g */
    int64_t seg = (h1 - h0) * d;    /* floats of one token's K (or V) row for these heads */
    float *qs = work;               /* [nq, d] scaled queries */
    float *acc = qs + nq * d;       /* [nq, d] running sum of p * v */
    float *s = acc + nq * d;        /* [nq, bs] scores, then probabilities, of the current block */
    float *m = s + nq * bs;         /* [nq] running max */
    float *l = m + nq;              /* [nq] running softmax denominator */
    float *buf = l + nq;            /* [seg] a bf16 row widened to float */
    for (int64_t r = 0; r < nq; r++) {
        const float *qr = q + (h0 * group + r) * d;
        for (int64_t i = 0; i < d; i++) {
            qs[r * d + i] = qr[i] * scale;
            acc[r * d + i] = 0.0f;
        }
        m[r] = -1e30f;
        l[r] = 0.0f;
    }
    int64_t num_blocks = (ctx + bs - 1) / bs;
    for (int64_t ib = 0; ib < num_blocks; ib++) {
        int64_t block = table[ib];
        int64_t n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
        if (ib + 1 < num_blocks) {
            /* blocks sit anywhere in the pool, out of the hardware prefetcher's sight: ask for the
             * next block's rows (these heads only) while this one is computed */
            int64_t next = table[ib + 1], elem = is_bf16 ? 2 : 4;
            for (int64_t j = 0; j < bs; j++) {
                int64_t off = ((next * bs + j) * num_kv_heads + h0) * d * elem;
                for (int64_t b = 0; b < seg * elem; b += 64) {
                    __builtin_prefetch((const char *)k_cache + off + b);
                    __builtin_prefetch((const char *)v_cache + off + b);
                }
            }
        }
        for (int64_t j = 0; j < n; j++) {
            const float *kr = load_row(k_cache, ((block * bs + j) * num_kv_heads + h0) * d, seg, is_bf16, buf);
            for (int64_t r = 0; r < nq; r++) {
                const float *kh = kr + (r / group) * d;
                const float *qr = qs + r * d;
                s[r * bs + j] = dot(qr, kh, d);
            }
        }
        for (int64_t r = 0; r < nq; r++) {
            float *sr = s + r * bs;
            float mx = m[r];
            for (int64_t j = 0; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
            float corr = expf(m[r] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                sr[j] = expf(sr[j] - mx);
                sum += sr[j];
            }
            if (corr != 1.0f) {
                float *ar = acc + r * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ar[i] *= corr;
            }
            m[r] = mx;
            l[r] = l[r] * corr + sum;
        }
        for (int64_t j = 0; j < n; j++) {
            const float *vr = load_row(v_cache, ((block * bs + j) * num_kv_heads + h0) * d, seg, is_bf16, buf);
            for (int64_t r = 0; r < nq; r++) {
                const float *vh = vr + (r / group) * d;
                float *ar = acc + r * d;
                float p = s[r * bs + j];
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ar[i] += p * vh[i];
            }
        }
    }
    for (int64_t r = 0; r < nq; r++) {
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *o = out + (h0 * group + r) * d;
        for (int64_t i = 0; i < d; i++) o[i] = acc[r * d + i] * inv;
    }
}

static inline __attribute__((always_inline)) void decode_all(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *block_tables,
    const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t d, int64_t bs, int64_t width, float scale, int is_bf16) {
    int64_t group = num_heads / num_kv_heads;
    /* Whole sequences per task keep each token's K/V row contiguous; a small batch splits by head so
     * that every thread has work. */
    int64_t heads_per_task = batch >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
    int64_t tasks_per_seq = num_kv_heads / heads_per_task;
    size_t work_floats = (size_t)(heads_per_task * group) * (size_t)(2 * d + bs + 2) + (size_t)(heads_per_task * d);
#pragma omp parallel
    {
        float *work = malloc(work_floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * tasks_per_seq; task++) {
            int64_t b = task / tasks_per_seq, h0 = (task % tasks_per_seq) * heads_per_task;
            decode_heads(q + b * q_stride, k_cache, v_cache, block_tables + b * width, seq_lens[b],
                         out + b * num_heads * d, h0, h0 + heads_per_task, num_kv_heads, group, d, bs, scale,
                         is_bf16, work);
        }
        free(work);
    }
}

/* constant head sizes let the compiler unroll the per-row loops completely */
static inline __attribute__((always_inline)) void decode_dispatch(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *block_tables,
    const int64_t *seq_lens, float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
    int64_t bs, int64_t width, float scale, int is_bf16) {
    if (d == 64)
        decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, 64, bs,
                   width, scale, is_bf16);
    else if (d == 128)
        decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, 128, bs,
                   width, scale, is_bf16);
    else
        decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
                   width, scale, is_bf16);
}

void kvs_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                          int64_t width, float scale) {
    decode_dispatch(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d,
                    bs, width, scale, 0);
}

void kvs_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                           int64_t width, float scale) {
    decode_dispatch(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d,
                    bs, width, scale, 1);
}
