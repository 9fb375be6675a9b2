/* The K/V pool's row formats, and reading one head's row of one token as float32.
 *
 *   k_cache, v_cache: [num_blocks, block_size, Hkv, row]: fp32 rows of D, bf16 rows of D stored as
 *                     uint16, byte-code rows: D one-byte codes (int8 or fp8, decoded through a
 *                     256-entry table) followed by the row's fp16 scale, or int4 rows: D/2 bytes of
 *                     two 4-bit codes (channel 2i low) and E bytes of one-byte log-coded scales
 *                     (the table maps a scale byte to its step). A value row's E bytes scale its
 *                     channel groups: v = (code - 8) * step[group]. A key block's rows' E bytes,
 *                     taken together, are the block's D step codes, then D zero points (signed,
 *                     half steps): k = (code - zero[c]) * step[c], decoded once per block and head.
 */
#ifndef KVS_KV_ROWS_H
#define KVS_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

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

/* What a byte-code table turns out to hold (codes_kind): codes the vector registers can decode by
 * arithmetic, the same floats as the table's, or any other table, read entry by entry. */
enum { CODES_TABLE = 0, CODES_INT8 = 1, CODES_E4M3 = 2, CODES_E5M2 = 3 };

/* How the pool's rows are stored. */
typedef struct {
    int kind;
    const float *lut;  /* ROW_CODES: each code's value; ROW_INT4: each scale byte's step */
    int64_t extra;     /* ROW_INT4: scale bytes after a row's D/2 code bytes */
    int64_t v_group;   /* ROW_INT4: channels per value scale */
    int codes;         /* ROW_CODES: CODES_* */
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

/* float32 bits of one-byte codes x (VW lanes of 0..255): int8, or fp8 e4m3 (no infinities; NaN at
 * 0x7f and 0xff) or e5m2 (the high byte of an fp16), exactly as torch converts them. An fp8 code
 * e..e m..m with M mantissa bits and bias B is, when its exponent is nonzero, the float whose
 * exponent is rebiased by 127 - B and whose mantissa is m shifted to the top; with a zero exponent
 * it is m * 2^(1 - B - M), which int -> float conversion gives exactly. */
static inline __attribute__((always_inline)) vf codes_to_f32(vi x, int codes) {
    if (codes == CODES_INT8) return __builtin_convertvector((x ^ 0x80) - 0x80, vf);
    int m_bits = codes == CODES_E4M3 ? 3 : 2, bias = codes == CODES_E4M3 ? 7 : 15;
    vi em = x & 0x7f, sign = (x & 0x80) << 24, top = em >> m_bits; /* top: the exponent field */
    vi normal = (em << (23 - m_bits)) + ((127 - bias) << 23);
    vf tiny = __builtin_convertvector(em, vf) * (codes == CODES_E4M3 ? 0x1p-9f : 0x1p-16f);
    vi r = (vi)selectv(top == 0, tiny, (vf)normal);
    if (codes == CODES_E4M3)
        r = (vi)selectv(em == 0x7f, (vf)((vi){0} + 0x7fc00000), (vf)r);
    else
        r = (vi)selectv(top == 31, (vf)(((vi){0} + 0x7f800000) | ((em & 3) << 21)), (vf)r);
    return (vf)(r | sign);
}

/* Which of the CODES_* `lut` holds: each arithmetic decoding is compared with it, value for value
 * (any NaN matching any NaN: a NaN's payload does not change what attention computes). */
static inline int codes_kind(const float *lut) {
    for (int kind = CODES_INT8; kind <= CODES_E5M2; kind++) {
        int same = 1;
        for (int c = 0; c < 256 && same; c += VW) {
            vf v = codes_to_f32(lane_ids + c, kind), t = loadv(lut + c);
            vi ok = (v == t) | ((v != v) & (t != t));
            for (int i = 0; i < VW; i++) same &= ok[i] != 0;
        }
        if (same) return kind;
    }
    return CODES_TABLE;
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

/* An int4 key block's parameters for one head: kp[0..d) the steps, kp[d..2d) the zero points (in codes).
 * The bytes are gathered row by row first (the usual row shares as fixed-size copies), then decoded
 * in two plain loops. A division per byte, with the decoding in the same loop, took 1.5x the time of
 * the whole kernel (4 sequences of 2,048 tokens over 30 layers: 11.5 ms); row by row with one loop,
 * 7.5-9.0 ms; gathered first, 0.87x of that, at 32 x 300 tokens too, and the steps' table read
 * by vector gathers, 0.96x again (2-core Zen 5 EPYC, lockstep). A gather of each value row's
 * scales, then a permute per 16 lanes, was 1.2x slower than the broadcasts below. */
static inline void int4_key_params(const uint8_t *cache, int64_t block, int64_t bs, int64_t num_kv_heads,
                                   int64_t kv_head, int64_t d, const RowFormat *f, float *kp) {
    uint8_t bytes[512 + 16]; /* 2d (d <= 256), and what a last fixed-size copy brings past it */
    int64_t row_bytes = d / 2 + f->extra, e = f->extra, stride = num_kv_heads * row_bytes;
    const uint8_t *row = cache + ((block * bs) * num_kv_heads + kv_head) * row_bytes + d / 2;
    switch (e) {
#define ROWS(E)                                                                     \
    case E:                                                                         \
        for (int64_t r = 0; r * E < 2 * d; r++) memcpy(bytes + E * r, row + r * stride, E); \
        break;
        ROWS(4)
        ROWS(8)
        ROWS(16)
#undef ROWS
    default:
        for (int64_t p = 0, r = 0; p < 2 * d; p += e, r++)
            for (int64_t o = 0; o < e && p + o < 2 * d; o++) bytes[p + o] = row[r * stride + o];
    }
    int64_t c0 = 0;
#if defined(__AVX512F__)
    for (; c0 + 16 <= d; c0 += 16)
        _mm512_storeu_ps(kp + c0, _mm512_i32gather_ps(
                                      _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + c0))), f->lut, 4));
#endif
    for (int64_t c = c0; c < d; c++) kp[c] = f->lut[bytes[c]];
    for (int64_t c = 0; c < d; c++) kp[d + c] = (float)(int8_t)bytes[d + c] * 0.5f;
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
        int64_t i = 0;
        /* by arithmetic where the table is a known one: on a 2-core Zen 5 EPYC, 4 sequences of 2,048
         * tokens over 30 layers decoded in 5.2 ms in int8, 7.3 in e4m3 and 8.0 in e5m2, against
         * 17.6-18.0 through the table; a loop each, so that the kind is a constant inside (read in
         * the loop, int8 took 15 ms) */
        switch (f->codes) {
#define DECODE(KIND)                                                                \
    for (; i + VW <= d; i += VW) {                                                  \
        uint8_t b[VW];                                                              \
        memcpy(b, src + i, sizeof b);                                               \
        vi x;                                                                       \
        for (int j = 0; j < VW; j++) x[j] = b[j];                                   \
        vf v = codes_to_f32(x, KIND) * sc;                                          \
        memcpy(buf + i, &v, sizeof v);                                              \
    }                                                                               \
    break;
        case CODES_INT8: DECODE(CODES_INT8)
        case CODES_E4M3: DECODE(CODES_E4M3)
        case CODES_E5M2: DECODE(CODES_E5M2)
#undef DECODE
        default: break;
        }
        for (; i < d; i++) buf[i] = f->lut[src[i]] * sc;
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

#endif
