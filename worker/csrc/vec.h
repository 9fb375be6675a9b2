/* Vectors of the build's width and the few operations on them that both attention kernels use; and the
 * row counts from which the small row-wise passes run on every thread. */
#ifndef KVS_VEC_H
#define KVS_VEC_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Vectors of VW floats, the width of the build's registers: 16 with AVX-512, else 8 (AVX2). A 16-lane
 * type on AVX2 takes two registers each, and the kernel's queries and accumulators then spilled to
 * memory: it read K/V at 6 GB/s where the 8-lane build reads at the host's bandwidth. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
#define UNROLL _Pragma("GCC unroll 16")

static inline __attribute__((always_inline)) vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* float32 to bf16: to nearest, ties to even, as torch converts; a NaN becomes the quiet NaN 0x7fc0. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A bf16 value as the float32 it stands for. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* What a bf16 GEMM's y holds (kvs_amx_gemm's y_bf16, kvs_gemm_bf16x's form): float32 sums, or those
 * sums (plus the bias) rounded to bf16, stored as bf16 or as the float32 values they are. */
enum { Y_F32 = 0, Y_BF16 = 1, Y_BF16_IN_F32 = 2, Y_SILU = 3, Y_SILU_BF16 = 4 }; /* Y_SILU*: gemm.c's gate/up pairs */

#if defined(__AMX_TILE__)
/* Loads an AMX tile configuration (palette 1): tile t of rows[t] rows (0: unused) of 64 bytes each,
 * as csrc/amx_gemm.c and csrc/greedy_head.c use them. The config goes through a struct that
 * LDTILECFG reads, which gcc 12 did not count as a read: in a function that only filled a local
 * config and loaded it, the stores of its rows and widths were dropped as dead and the load
 * faulted (#GP on a malformed config). The empty asm with a memory clobber makes them land first. */
static inline __attribute__((always_inline)) void load_tile_rows(const uint8_t rows[8]) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#endif

/* VW bf16 values widened to float32: a 16-bit shift into the high half. Written as
 * __builtin_convertvector, GCC (tuned for a Zen 5 EPYC) split each 16-lane widening into two 8-lane
 * ones plus an extract and an insert, and the one-row bf16 GEMM read 29 GB/s on one core; the
 * intrinsics give one widening load and a shift. */
static inline __attribute__((always_inline)) vf widen_bf16(const uint16_t *p) {
    vf v;
#if defined(__AVX512F__)
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    memcpy(&v, &u, sizeof v);
#elif defined(__AVX2__)
    __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    memcpy(&v, &u, sizeof v);
#else
    typedef uint16_t vh __attribute__((vector_size(2 * VW)));
    typedef uint32_t vu __attribute__((vector_size(4 * VW)));
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    memcpy(&v, &u, sizeof v);
#endif
    return v;
}

#if VW == 16
static const vi lane_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const vi lane_ids = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

static inline __attribute__((always_inline)) vf selectv(vi mask, vf a, vf b) {
    vi r = (mask & (vi)a) | (~mask & (vi)b);
    return (vf)r;
}

static inline __attribute__((always_inline)) vf vmaxv(vf a, vf b) {
    return selectv(a > b, a, b);
}

/* y 2^n for n a whole number in -126 .. 127 held in a float (the exps below): AVX-512's VSCALEFPS
 * in one instruction, else 2^n built in the exponent bits and multiplied. 2^n is a normal float
 * there, so both are y 2^n rounded once, the same bits; on a Zen 5 core the SiLU gate's loop took
 * 4.1 ns a 16-lane vector against 4.8 with the convert, add, shift and multiply. */
static inline __attribute__((always_inline)) vf times_pow2v(vf y, vf n) {
#if defined(__AVX512F__)
    return (vf)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
#endif
}

/* e^x for x <= 0 (softmax arguments), to about 2e-7 relative: 2^(x log2 e) split into an integer
 * power, put straight into the exponent bits, and 2^f for |f| <= 1/2 by its Taylor series. Inputs
 * below -87 give e^-87 (about 1.6e-38), which is as good as zero next to the block maximum's 1. */
static inline __attribute__((always_inline)) vf expv(vf x) {
    const vf lo = (vf){0} - 87.0f;
    x = vmaxv(x, lo);
    vf t = x * 1.44269504f;
    vf n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 pushes the fraction out */
    vf f = t - n;
    vf p = 1.3333558e-3f + f * 1.5403530e-4f;
    p = 9.6181291e-3f + f * p;
    p = 5.5504109e-2f + f * p;
    p = 2.4022651e-1f + f * p;
    p = 6.9314718e-1f + f * p;
    p = 1.0f + f * p;
    return times_pow2v(p, n);
}

/* e^x for x <= 0, within about one float32 ulp (expv above trades that for speed: its reduction
 * multiplies by log2(e) in float32, which costs tens of ulps near x = -87): n = round(x / ln 2),
 * r = x - n ln 2 with ln 2 in two parts (Cody and Waite), e^r by a degree-7 polynomial, then 2^n.
 * Below -87.34, where e^x leaves the normal float32 range, 0. */
static inline __attribute__((always_inline)) vf exp_negv(vf x) {
    const vf lo = (vf){0} - 87.33654f;
    vi under = x < lo;
    x = vmaxv(x, lo);
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * (r * r) + r + 1.0f;
    return selectv(under, (vf){0}, times_pow2v(y, n));
}

/* VW values rounded to bf16 (to nearest, ties to even; a NaN stays one), left in float32 lanes. */
static inline __attribute__((always_inline)) vf round_bf16v(vf v) {
    typedef uint32_t vu __attribute__((vector_size(4 * VW)));
    vu u = (vu)v;
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return selectv(v != v, v, (vf)r);
}

/* ... and stored as bf16: the high halves of the rounded lanes, a NaN as the quiet NaN 0x7fc0 (as
 * to_bf16 and torch store it; its own high half could read as an infinity, or keep its sign). */
static inline __attribute__((always_inline)) void store_bf16v(uint16_t *dst, vf v) {
    typedef uint32_t vu __attribute__((vector_size(4 * VW)));
    typedef uint16_t vh __attribute__((vector_size(2 * VW)));
    vu u = (vu)selectv(v != v, (vf)((vu){0} + 0x7fc00000u), round_bf16v(v));
    vh h = __builtin_convertvector(u >> 16, vh);
    memcpy(dst, &h, sizeof h);
}

/* silu(g) = g / (1 + e^-g), through e^-|g| for either sign: within 2 float32 ulps of the exact
 * value down to g = -87 (torch's own within 1.5), and 0 below, where the exact value is under
 * 1e-35. */
static inline __attribute__((always_inline)) vf siluv(vf g) {
    vi neg = g < 0.0f;
    vf e = exp_negv(selectv(neg, g, -g));
    return selectv(neg, g * e, g) / (1.0f + e);
}

static inline __attribute__((always_inline)) float hsumv(vf v) {
    float t[VW];
    memcpy(t, &v, sizeof t);
    float a = 0.0f;
    for (int i = 0; i < VW; i++) a += t[i];
    return a;
}

static inline __attribute__((always_inline)) float hmaxv(vf v) {
    float t[VW];
    memcpy(t, &v, sizeof t);
    float a = t[0];
    for (int i = 1; i < VW; i++) a = t[i] > a ? t[i] : a;
    return a;
}

/* sums[j] = the lane sum of p[j], for VW vectors at once: log2(VW) rounds of pairwise lane sums,
 * each round halving the vectors (45 vector operations for 16, against about 110 for 16 separate
 * tree sums). */
static inline __attribute__((always_inline)) vf transpose_sumv(const vf *p) {
#if VW == 16
#define PAIRS(a, b)                                                                                                 \
    (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +                  \
     __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
    vf r1[8], r2[4], r3[2];
    UNROLL for (int i = 0; i < 8; i++) r1[i] = PAIRS(p[2 * i], p[2 * i + 1]);
    UNROLL for (int i = 0; i < 4; i++) r2[i] = PAIRS(r1[2 * i], r1[2 * i + 1]);
    UNROLL for (int i = 0; i < 2; i++) r3[i] = PAIRS(r2[2 * i], r2[2 * i + 1]);
    return PAIRS(r3[0], r3[1]);
#elif defined(__AVX2__)
    /* horizontal adds pair the lanes as the generic rounds below do (lanes 2i and 2i + 1, then
     * those pairs, then the two halves), so the sums are the same bits; the generic rounds' shuffles
     * cross the 128-bit halves, two permutes and a blend each (the decode kernel, K/V in L2 on one
     * core of a Zen 3 EPYC: 172 -> 147 ns a token) */
    __m256 q[8], h[4];
    memcpy(q, p, sizeof q);
    UNROLL for (int i = 0; i < 4; i++) h[i] = _mm256_hadd_ps(q[2 * i], q[2 * i + 1]);
    __m256 lo = _mm256_hadd_ps(h[0], h[1]), hi = _mm256_hadd_ps(h[2], h[3]);
    __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
    vf out;
    memcpy(&out, &r, sizeof out);
    return out;
#else
#define PAIRS(a, b) \
    (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15))
    vf r2[4], r3[2];
    UNROLL for (int i = 0; i < 4; i++) r2[i] = PAIRS(p[2 * i], p[2 * i + 1]);
    UNROLL for (int i = 0; i < 2; i++) r3[i] = PAIRS(r2[2 * i], r2[2 * i + 1]);
    return PAIRS(r3[0], r3[1]);
#endif
#undef PAIRS
}

/* Rows from which a layer's small row-wise passes (RMSNorm, RoPE with the K/V write, the SiLU gate;
 * float32 and bf16) run on every thread rather than the calling one. On a 2-core Xeon (AMX, AVX-512)
 * one of SmolLM2's bf16 layers at 32 rows spent about 110 us in them alone, the other core waiting:
 * split, a norm at 32 rows took 8 us instead of 13 and RoPE 12 instead of 21; at 4 rows float32's
 * norm and RoPE came out slower, while the gate (a division and an exp a value) gained from 4. */
#define SMALL_OPS_ROWS 8
#define SILU_ROWS 4

#if VW == 16
/* 16 x 16 lanes turned: r[c] gets lane c of each r[i] before, in lane i. It only moves bits, so rows
 * of any 32-bit values go through it (csrc/prefill_attention.c's rows and lanes, csrc/greedy_head.c's
 * bf16 pairs). */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + j]: column 4k + j of rows i .. i + 3, in 128-bit lane k */
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        __m512 lo = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), hi = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
        __m512 lo2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        __m512 hi2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_f32x4(lo, lo2, 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(lo, lo2, 0xDD);
        r[4 + j] = _mm512_shuffle_f32x4(hi, hi2, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(hi, hi2, 0xDD);
    }
}
#endif
#endif
