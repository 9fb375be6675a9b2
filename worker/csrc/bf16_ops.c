/* A bf16 layer's small operations, rounded where HF's bf16 Llama rounds, so that the engine's bf16
 * outputs stay those of the reference model rather than of a float32 model read at bf16:
 *
 *   add:        residual = bf16(residual + x)
 *   RMSNorm:    y = bf16(h * rsqrt(mean(h^2) + eps)) in float32, out = bf16(weight * y)
 *   RoPE:       x' = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))   (cos, sin in bf16)
 *   SiLU gate:  act = bf16(bf16(silu(gate)) * up)
 *
 * torch runs these as 8 (a norm), 5 (RoPE and the K/V write) and 3 (the gate) ops a call, each
 * widening, computing and rounding back: at decode sizes the per-op costs outweigh the arithmetic.
 * Tensors are bf16 (uint16) in memory; the products of two bf16 values are exact in float32, so
 * only the sums and the rounding points decide the results. The mean's sum and the exp inside SiLU
 * are this file's own (vector partial sums, vec.h's exp_negv), and may differ from torch's in the
 * last float32 bit, which moves a bf16 result by one step only when it lies on a rounding boundary.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline float round_bf16(float f) { return bf16_to_f32(to_bf16(f)); }

static inline __attribute__((always_inline)) void norm_row(const uint16_t *h, const uint16_t *w, uint16_t *out,
                                                           int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) {
        float v = bf16_to_f32(h[i]);
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(h[i]) * inv));
}

void kvs_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= SMALL_OPS_ROWS)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

/* residual = bf16(residual + x); then, with a weight, out = the norm of the new residual. */
void kvs_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t rows,
                           int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= SMALL_OPS_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = residual + r * n;
        const uint16_t *xr = x + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) h[i] = to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(xr[i]));
        if (w != NULL) norm_row(h, w, out + r * n, n, eps);
    }
}

/* ssin = [-sin | sin] over the two halves, so rotate_half(x) * sin == roll(x, D/2) * ssin, value
 * for value (a bf16 product's sign is exact). */
static void rotate_row(uint16_t *x, const uint16_t *cos, const uint16_t *ssin, int64_t d) {
    int64_t half = d / 2;
    float xs[256], rolled[256];
    for (int64_t i = 0; i < d; i++) xs[i] = bf16_to_f32(x[i]);
    memcpy(rolled, xs + half, (size_t)half * sizeof(float));
    memcpy(rolled + half, xs, (size_t)half * sizeof(float));
#pragma omp simd
    for (int64_t i = 0; i < d; i++)
        x[i] = to_bf16(round_bf16(xs[i] * bf16_to_f32(cos[i])) + round_bf16(rolled[i] * bf16_to_f32(ssin[i])));
}

/* One layer's RoPE (queries and keys of qkv [T, row], in place) and the write of the rotated keys
 * and the values to the caches [slots, Hkv, D] at slots [T]; cos, ssin [T, D]; d even, <= 256. */
void kvs_rope_write_kv_bf16(uint16_t *qkv, int64_t tokens, int64_t row, int64_t num_heads, int64_t num_kv_heads,
                            int64_t d, const uint16_t *cos, const uint16_t *ssin, uint16_t *k_cache,
                            uint16_t *v_cache, const int64_t *slots) {
    int64_t kv = num_kv_heads * d;
#pragma omp parallel for schedule(static) if (tokens >= SMALL_OPS_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        uint16_t *x = qkv + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rotate_row(x + h * d, cos + t * d, ssin + t * d, d);
        memcpy(k_cache + slots[t] * kv, x + num_heads * d, (size_t)kv * sizeof(uint16_t));
        memcpy(v_cache + slots[t] * kv, x + (num_heads + num_kv_heads) * d, (size_t)kv * sizeof(uint16_t));
    }
}

/* gate_up [T, 2I] (the gate's I columns, then the up projection's) -> act [T, I]. */
void kvs_silu_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= SILU_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *out = act + r * inter;
        int64_t i0 = 0;
        for (; i0 + VW <= inter; i0 += VW)
            store_bf16v(out + i0, round_bf16v(siluv(widen_bf16(g + i0))) * widen_bf16(u + i0));
        if (i0 < inter) { /* the last few, through a buffer of one vector */
            int64_t n = inter - i0;
            float s[VW] = {0};
            for (int64_t i = 0; i < n; i++) s[i] = bf16_to_f32(g[i0 + i]);
            vf sv = siluv(loadv(s));
            memcpy(s, &sv, sizeof sv);
            for (int64_t i = 0; i < n; i++) out[i0 + i] = to_bf16(round_bf16(s[i]) * bf16_to_f32(u[i0 + i]));
        }
    }
}

/* float32 <-> bf16 rows, for the fused bf16 layer (csrc/layer.c): its GEMM and attention read and
 * write float32. */
void kvs_widen_bf16(const uint16_t *src, int64_t src_stride, float *dst, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[r * n + i] = bf16_to_f32(src[r * src_stride + i]);
    }
}

void kvs_narrow_bf16(const float *src, uint16_t *dst, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++) dst[i] = to_bf16(src[i]);
}
