/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the block pool.
 *
 * Each (sequence, KV head) pair streams its blocks once, keeping the G = H / Hkv query heads that
 * share the KV head together, with an online softmax, so nothing is gathered or copied and every K/V
 * byte is read once per step from memory. Tasks are whole sequences, or (sequence, KV head) pairs
 * when the batch is small (decode_all). Queries live in registers; scores of VW tokens are reduced
 * together (transpose_sumv). float32 and bf16 rows of head size 64 or 128 go to the two-pass kernel
 * of dense_decode.c instead (the same tasks); this one serves the coded rows and other head sizes.
 *
 *   k_cache, v_cache: [num_blocks, block_size, Hkv, row]: fp32 rows of D, bf16 rows of D stored as
 *                     uint16, byte-code rows: D one-byte codes (int8 or fp8, decoded through a
 *                     256-entry table) followed by the row's fp16 scale, or int4 rows: D/2 bytes of
 *                     two 4-bit codes (channel 2i low) and E bytes of one-byte log-coded scales
 *                     (the table maps a scale byte to its step). A value row's E bytes scale its
 *                     channel groups: v = (code - 8) * step[group]. A key block's rows' E bytes,
 *                     taken together, are the block's D step codes, then D zero points (signed,
 *                     half steps): k = (code - zero[c]) * step[c], decoded once per block and head.
 *   q, out:           [B, H, D] float32 (the caller converts bf16); q's rows are q_stride floats apart
 *   block_tables:     [B, W] int64, seq_lens: [B] int64 (tokens to attend, this step's included)
 *
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef float v16f __attribute__((vector_size(64))); /* the int4 unpacking works on 32 channels at a time */
typedef int32_t v16i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static const v16i lane_ids16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline __attribute__((always_inline)) v16f select16(v16i mask, v16f a, v16f b) {
    v16i r = (mask & (v16i)a) | (~mask & (v16i)b);
    return (v16f)r;
}

enum { ROW_F32 = 0, ROW_BF16 = 1, ROW_CODES = 2, ROW_INT4 = 3 };

/* How the pool's rows are stored. */
typedef struct {
    int kind;
    const float *lut;  /* ROW_CODES: each code's value; ROW_INT4: each scale byte's step */
    int64_t extra;     /* ROW_INT4: scale bytes after a row's D/2 code bytes */
    int64_t v_group;   /* ROW_INT4: channels per value scale */
} RowFormat;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
    if (exp == 0) { /* zero or subnormal: exact as a float product */
        float f = (float)mant * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -f : f;
    }
    u = exp == 31 ? sign | 0x7f800000 | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef uint8_t v16u8 __attribute__((vector_size(16)));

/* 16 bytes of packed int4 codes (channel 2i in byte i's low nibble) -> channels 0..15 (a) and
 * 16..31 (b) as floats. */
static inline __attribute__((always_inline)) void unpack32(const uint8_t *src, v16f *a, v16f *b) {
    v16u8 bytes;
    memcpy(&bytes, src, sizeof bytes);
    v16f lo = __builtin_convertvector(__builtin_convertvector(bytes & 15, v16i), v16f);
    v16f hi = __builtin_convertvector(__builtin_convertvector(bytes >> 4, v16i), v16f);
    *a = __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    *b = __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

/* Bytes of one head's row of one token. */
static inline int64_t head_row_bytes(const RowFormat *f, int64_t d) {
    switch (f->kind) {
    case ROW_F32: return 4 * d;
    case ROW_BF16: return 2 * d;
    case ROW_CODES: return d + 2;
    default: return d / 2 + f->extra;
    }
}

/* An int4 key block's parameters for one head: kp[0..d) the steps, kp[d..2d) the zero points (in codes). */
static void int4_key_params(const uint8_t *cache, int64_t block, int64_t bs, int64_t num_kv_heads, int64_t kv_head,
                            int64_t d, const RowFormat *f, float *kp) {
    int64_t row_bytes = d / 2 + f->extra;
    for (int64_t p = 0; p < 2 * d; p++) {
        int64_t t = p / f->extra, o = p % f->extra;
        uint8_t b = cache[((block * bs + t) * num_kv_heads + kv_head) * row_bytes + d / 2 + o];
        kp[p] = p < d ? f->lut[b] : (float)(int8_t)b * 0.5f;
    }
}

/* Row `row` of the cache (d values) as float32: fp32 is used in place, the others are decoded into
 * buf. kp: an int4 key row's block parameters (int4_key_params); NULL for value rows. */
static inline __attribute__((always_inline)) const float *load_row(const void *cache, int64_t row, int64_t d,
                                                                   const RowFormat *f, const float *kp, float *buf) {
    if (f->kind == ROW_F32) return (const float *)cache + row * d;
    if (f->kind == ROW_BF16) {
        const uint16_t *src = (const uint16_t *)cache + row * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) buf[i] = bf16_to_f32(src[i]);
        return buf;
    }
    if (f->kind == ROW_CODES) {
        const uint8_t *src = (const uint8_t *)cache + row * (d + 2);
        float sc = f16_to_f32((uint16_t)(src[d] | (src[d + 1] << 8)));
        for (int64_t i = 0; i < d; i++) buf[i] = f->lut[src[i]] * sc;
        return buf;
    }
    const uint8_t *src = (const uint8_t *)cache + row * (d / 2 + f->extra);
    if (d % 32 == 0 && (kp != NULL || f->v_group == 8 || f->v_group == 16)) {
        const uint8_t *scales = src + d / 2;
        for (int64_t k = 0; k < d / 32; k++) { /* 16 bytes: channels 32k .. 32k + 31 */
            v16f a, b, sa, sb;
            unpack32(src + 16 * k, &a, &b);
            if (kp != NULL) {
                a = (a - load16(kp + d + 32 * k)) * load16(kp + 32 * k);
                b = (b - load16(kp + d + 32 * k + 16)) * load16(kp + 32 * k + 16);
            } else {
                if (f->v_group == 16) {
                    sa = (v16f){0} + f->lut[scales[2 * k]];
                    sb = (v16f){0} + f->lut[scales[2 * k + 1]];
                } else {
                    v16i low_half = lane_ids16 < 8;
                    sa = select16(low_half, (v16f){0} + f->lut[scales[4 * k]], (v16f){0} + f->lut[scales[4 * k + 1]]);
                    sb = select16(low_half, (v16f){0} + f->lut[scales[4 * k + 2]],
                                  (v16f){0} + f->lut[scales[4 * k + 3]]);
                }
                a = (a - 8.0f) * sa;
                b = (b - 8.0f) * sb;
            }
            memcpy(buf + 32 * k, &a, sizeof a);
            memcpy(buf + 32 * k + 16, &b, sizeof b);
        }
        return buf;
    }
    if (kp != NULL) {
#pragma omp simd
        for (int64_t i = 0; i < d / 2; i++) {
            buf[2 * i] = ((float)(src[i] & 15) - kp[d + 2 * i]) * kp[2 * i];
            buf[2 * i + 1] = ((float)(src[i] >> 4) - kp[d + 2 * i + 1]) * kp[2 * i + 1];
        }
        return buf;
    }
    const uint8_t *scales = src + d / 2;
    for (int64_t g = 0, c = 0; c < d; g++) {
        float sc = f->lut[scales[g]];
        for (int64_t end = c + f->v_group; c < end; c++)
            buf[c] = ((float)((src[c / 2] >> (4 * (c & 1))) & 15) - 8.0f) * sc;
    }
    return buf;
}

#define QMAX 4 /* queries of one KV head held in registers at once (d = 64; half that for d = 128) */

/* One sequence, one KV head, NQ (<= QMAX) of its queries, head size DV vectors of VW, blocks ib0 ..
 * ib1 - 1 of its context: the queries stay in registers, each K/V row of the head is read once per
 * block, and the running state (output sums [NQ][d], then the NQ maxima and NQ sums) is in `state`,
 * so that a sequence's heads can take turns block by block. The output is written after the last
 * block. The output sums sit in memory (in L1) rather than registers: kept in registers beside the
 * queries, GCC spilled one of them around every FMA of the value pass. */
static inline __attribute__((always_inline)) void decode_queries(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
    int64_t kv_head, int64_t num_kv_heads, const int NQ, const int DV, int64_t bs, float scale, const RowFormat *f,
    float *work, float *state, int64_t ib0, int64_t ib1) {
    const int64_t d = VW * DV;
    vf qv[QMAX][128 / VW];
    float *acc = state, *st_m = state + NQ * d, *st_l = st_m + NQ;
    float m[QMAX], l[QMAX];
    int64_t bs16 = (bs + 15) / 16 * 16;
    vf *part = (vf *)work;               /* [NQ][VW] per-token partial products */
    float *s = (float *)(part + QMAX * VW); /* [NQ][bs16] scores, then probabilities, of one block */
    float *buf = s + QMAX * bs16;        /* [d] a row decoded to float */
    float *kp = buf + d;                 /* [2d] an int4 key block's steps and zero points */
    UNROLL for (int g = 0; g < NQ; g++) {
        UNROLL for (int i = 0; i < DV; i++) {
            qv[g][i] = loadv(q + g * d + VW * i) * scale;
            if (ib0 == 0) memset(acc + g * d + VW * i, 0, sizeof(vf));
        }
        m[g] = ib0 == 0 ? -1e30f : st_m[g];
        l[g] = ib0 == 0 ? 0.0f : st_l[g];
    }
    int64_t num_blocks = (ctx + bs - 1) / bs, head_bytes = head_row_bytes(f, d);
    const float *key_params = f->kind == ROW_INT4 ? kp : NULL;
    if (ib1 > num_blocks) ib1 = num_blocks;
    for (int64_t ib = ib0; ib < ib1; ib++) {
        int64_t block = table[ib];
        int64_t n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
        if (key_params != NULL) int4_key_params(k_cache, block, bs, num_kv_heads, kv_head, d, f, kp);
        /* blocks sit anywhere in the pool, out of the hardware prefetcher's sight: while a token is
         * scored, ask for the same row of the next block (K and V, this head only), into L2 rather
         * than L1. On a 2-core AMD EPYC (Zen 4) host, prefetches into L1 held the kernel to about 12
         * GB/s from memory; into L2 it ran 1.4x faster from memory and 1.3x with K/V in L3 (32
         * sequences of 300 tokens, 30 layers, in one process against the L1 build), the same bits.
         * Two blocks ahead into L1 gained nothing; two ahead into L2 as much as one. */
        const char *next_k = NULL, *next_v = NULL;
        if (ib + 1 < num_blocks) {
            int64_t off = (table[ib + 1] * bs * num_kv_heads + kv_head) * head_bytes;
            next_k = (const char *)k_cache + off;
            next_v = (const char *)v_cache + off;
        }
        int64_t row_bytes = num_kv_heads * head_bytes;
        /* scores, VW tokens at a time */
        for (int64_t j0 = 0; j0 < n; j0 += VW) {
            int64_t nj = n - j0 < VW ? n - j0 : VW;
            for (int64_t j = 0; j < VW; j++) {
                if (j < nj) {
                    if (next_k) {
                        for (int64_t b = 0; b < head_bytes; b += 64) {
                            __builtin_prefetch(next_k + (j0 + j) * row_bytes + b, 0, 1);
                            __builtin_prefetch(next_v + (j0 + j) * row_bytes + b, 0, 1);
                        }
                    }
                    int64_t row = (block * bs + j0 + j) * num_kv_heads + kv_head;
                    vf kv[128 / VW];
                    const float *kr = load_row(k_cache, row, d, f, key_params, buf);
                    UNROLL for (int i = 0; i < DV; i++) kv[i] = loadv(kr + VW * i);
                    UNROLL for (int g = 0; g < NQ; g++) {
                        vf t = qv[g][0] * kv[0];
                        UNROLL for (int i = 1; i < DV; i++) t += qv[g][i] * kv[i];
                        part[g * VW + j] = t;
                    }
                } else {
                    UNROLL for (int g = 0; g < NQ; g++) part[g * VW + j] = (vf){0};
                }
            }
            vi live = lane_ids < (int32_t)nj;
            UNROLL for (int g = 0; g < NQ; g++) {
                vf sc = transpose_sumv(part + g * VW);
                sc = selectv(live, sc, (vf){0} - 1e30f); /* padding: weighs e^-87, never read by the value pass */
                memcpy(s + g * bs16 + j0, &sc, sizeof sc);
            }
        }
        /* online softmax over this block; score lanes past n were set to -inf-like above */
        int64_t chunks = (n + VW - 1) / VW;
        UNROLL for (int g = 0; g < NQ; g++) {
            float *sr = s + g * bs16;
            vf vmax = loadv(sr);
            for (int64_t c = 1; c < chunks; c++) vmax = vmaxv(vmax, loadv(sr + VW * c));
            float mx = hmaxv(vmax);
            mx = mx > m[g] ? mx : m[g];
            float corr = expv((vf){0} + (m[g] - mx))[0];
            vf vsum = {0};
            for (int64_t c = 0; c < chunks; c++) {
                vf e = expv(loadv(sr + VW * c) - mx);
                vsum += e;
                memcpy(sr + VW * c, &e, sizeof e);
            }
            if (corr != 1.0f)
                UNROLL for (int i = 0; i < DV; i++) {
                    vf t = loadv(acc + g * d + VW * i) * corr;
                    memcpy(acc + g * d + VW * i, &t, sizeof t);
                }
            m[g] = mx;
            l[g] = l[g] * corr + hsumv(vsum);
        }
        /* weighted values */
        vf av[QMAX][128 / VW];
        UNROLL for (int g = 0; g < NQ; g++)
            UNROLL for (int i = 0; i < DV; i++) av[g][i] = loadv(acc + g * d + VW * i);
        for (int64_t j = 0; j < n; j++) {
            int64_t row = (block * bs + j) * num_kv_heads + kv_head;
            vf vv[128 / VW];
            const float *vr = load_row(v_cache, row, d, f, NULL, buf);
            UNROLL for (int i = 0; i < DV; i++) vv[i] = loadv(vr + VW * i);
            UNROLL for (int g = 0; g < NQ; g++) {
                float p = s[g * bs16 + j];
                UNROLL for (int i = 0; i < DV; i++) av[g][i] += p * vv[i];
            }
        }
        UNROLL for (int g = 0; g < NQ; g++)
            UNROLL for (int i = 0; i < DV; i++) memcpy(acc + g * d + VW * i, &av[g][i], sizeof(vf));
    }
    if (ib1 < num_blocks) { /* more blocks to come: keep the softmax state */
        UNROLL for (int g = 0; g < NQ; g++) {
            st_m[g] = m[g];
            st_l[g] = l[g];
        }
        return;
    }
    UNROLL for (int g = 0; g < NQ; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        UNROLL for (int i = 0; i < DV; i++) {
            vf o = loadv(acc + g * d + VW * i) * inv;
            memcpy(out + g * d + VW * i, &o, sizeof o);
        }
    }
}

/* A generic head size (not a multiple of 16, or above 128): one query at a time, scalar dots. */
static void decode_query_generic(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                                 int64_t ctx, float *out, int64_t kv_head, int64_t num_kv_heads, int64_t d,
                                 int64_t bs, float scale, const RowFormat *f, float *work) {
    float *s = work, *buf = s + bs, *acc = buf + d, *kp = acc + d;
    const float *key_params = f->kind == ROW_INT4 ? kp : NULL;
    float m = -1e30f, l = 0.0f;
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    int64_t num_blocks = (ctx + bs - 1) / bs;
    for (int64_t ib = 0; ib < num_blocks; ib++) {
        int64_t block = table[ib], n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
        if (key_params != NULL) int4_key_params(k_cache, block, bs, num_kv_heads, kv_head, d, f, kp);
        for (int64_t j = 0; j < n; j++) {
            const float *kr = load_row(k_cache, (block * bs + j) * num_kv_heads + kv_head, d, f, key_params, buf);
            float t = 0.0f;
            for (int64_t i = 0; i < d; i++) t += q[i] * kr[i];
            s[j] = t * scale;
        }
        float mx = m;
        for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        float corr = expf(m - mx), sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        for (int64_t i = 0; i < d; i++) acc[i] *= corr;
        for (int64_t j = 0; j < n; j++) {
            const float *vr = load_row(v_cache, (block * bs + j) * num_kv_heads + kv_head, d, f, NULL, buf);
            for (int64_t i = 0; i < d; i++) acc[i] += s[j] * vr[i];
        }
        m = mx;
        l = l * corr + sum;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t i = 0; i < d; i++) out[i] = acc[i] * inv;
}

/* Queries of one KV head taken together by decode_queries (a multiple of 64 floats of state each). */
static inline int64_t query_chunk(int64_t d) { return d == 64 ? QMAX : QMAX / 2; }
static inline int64_t chunk_state_floats(int64_t d) { return query_chunk(d) * d + 64; }

/* All queries of one (sequence, KV head) pair, in register-sized chunks, over blocks ib0 .. ib1 - 1;
 * state: chunk_state_floats(d) per chunk. The generic head size runs a whole sequence in the first
 * range (ib0 == 0) and nothing after. */
static inline __attribute__((always_inline)) void decode_head(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, float *out,
    int64_t kv_head, int64_t num_kv_heads, int64_t group, int64_t d, int64_t bs, float scale, const RowFormat *f,
    float *work, float *state, int64_t ib0, int64_t ib1) {
    if (d != 64 && d != 128) {
        if (ib0 > 0) return;
        for (int64_t g = 0; g < group; g++)
            decode_query_generic(q + g * d, k_cache, v_cache, table, ctx, out + g * d, kv_head, num_kv_heads, d, bs,
                                 scale, f, work);
        return;
    }
    int64_t chunk = query_chunk(d);
    for (int64_t g0 = 0; g0 < group; g0 += chunk) {
        int64_t nq = group - g0 < chunk ? group - g0 : chunk;
        const float *qc = q + g0 * d;
        float *oc = out + g0 * d;
        /* constant query counts and head sizes let each variant keep its state in registers */
#define VARIANT(NQ, DV) decode_queries(qc, k_cache, v_cache, table, ctx, oc, kv_head, num_kv_heads, NQ, DV, bs, \
                                       scale, f, work, state + g0 / chunk * chunk_state_floats(d), ib0, ib1)
        if (d == 64) {
            if (nq == 4) VARIANT(4, 64 / VW);
            else if (nq == 3) VARIANT(3, 64 / VW);
            else if (nq == 2) VARIANT(2, 64 / VW);
            else VARIANT(1, 64 / VW);
        } else {
            if (nq == 2) VARIANT(2, 128 / VW);
            else VARIANT(1, 128 / VW);
        }
#undef VARIANT
    }
}

/* Tasks are whole sequences, their KV heads taking turns block by block, so that a task reads each
 * block's K and V (all heads) as two dense runs: on a 2-core Xeon host 9-11% faster than one task per
 * (sequence, KV head), whose rows of one head sit a row of all heads apart. With fewer than
 * SEQUENCES_PER_THREAD sequences per thread there are too few such tasks to share out, and each
 * (sequence, KV head) pair is a task of its own. Either way each head's blocks run in the same
 * order, so the output is the same bits. */
#define SEQUENCES_PER_THREAD 4

void kvs_dense_decode(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                      int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width, float scale,
                      int bf16, int by_sequence);

static void decode_all(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                       const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                       int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width, float scale,
                       const RowFormat *f) {
    int64_t group = num_heads / num_kv_heads;
    int64_t bs16 = (bs + 15) / 16 * 16;
    size_t work_floats = (size_t)(QMAX * 16 * 16 + QMAX * bs16 + 5 * d + bs16);
    int64_t head_state = (group + query_chunk(d) - 1) / query_chunk(d) * chunk_state_floats(d);
    int by_sequence = batch >= SEQUENCES_PER_THREAD * omp_get_max_threads();
    if ((f->kind == ROW_F32 || f->kind == ROW_BF16) && (d == 64 || d == 128)) {
        kvs_dense_decode(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d,
                         bs, width, scale, f->kind == ROW_BF16, by_sequence);
        return;
    }
    int64_t tasks = by_sequence ? batch : batch * num_kv_heads;
#pragma omp parallel
    {
        float *work = aligned_alloc(64, (work_floats * sizeof(float) + 63) / 64 * 64);
        float *state = aligned_alloc(64, (size_t)(num_kv_heads * head_state) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = by_sequence ? task : task / num_kv_heads;
            int64_t h0 = by_sequence ? 0 : task % num_kv_heads, h1 = by_sequence ? num_kv_heads : h0 + 1;
            int64_t num_blocks = (seq_lens[b] + bs - 1) / bs;
            int64_t step = by_sequence || num_blocks == 0 ? 1 : num_blocks;
            for (int64_t ib = 0; ib < num_blocks || ib == 0; ib += step)
                for (int64_t h = h0; h < h1; h++)
                    decode_head(q + b * q_stride + h * group * d, k_cache, v_cache, block_tables + b * width,
                                seq_lens[b], out + (b * num_heads + h * group) * d, h, num_kv_heads, group, d, bs,
                                scale, f, work, state + h * head_state, ib, ib + step);
        }
        free(work);
        free(state);
    }
}

void kvs_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                          int64_t width, float scale) {
    RowFormat f = {ROW_F32, NULL, 0, 0};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f);
}

void kvs_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                           int64_t width, float scale) {
    RowFormat f = {ROW_BF16, NULL, 0, 0};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f);
}

/* Byte-code rows (int8, fp8): lut maps each code to its value before the row's scale. */
void kvs_paged_decode_codes(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out,
                            int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                            int64_t width, float scale, const float *lut) {
    RowFormat f = {ROW_CODES, lut, 0, 0};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f);
}

/* int4 rows (see the top): lut maps each scale byte to its step; extra = E, v_group = channels per value scale. */
void kvs_paged_decode_int4(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                           int64_t width, float scale, const float *lut, int64_t extra, int64_t v_group) {
    RowFormat f = {ROW_INT4, lut, extra, v_group};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f);
}
