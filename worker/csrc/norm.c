/* RMSNorm for float32 rows, alone or fused with the residual add that precedes it in every layer:
 *
 *     residual += x;  out = residual * rsqrt(mean(residual^2) + eps) * weight
 *
 * torch runs this as about eight small ops per call, which at decode sizes cost more than the
 * arithmetic; here it is one pass over the row. Also the MLP's SiLU gate, act = silu(gate) * up.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

static inline __attribute__((always_inline)) void norm_row(const float *h, const float *w, float *out, int64_t n,
                                                           float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (h[i] * inv);
}

void kvs_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= SMALL_OPS_ROWS)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

void kvs_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                          float eps) {
#pragma omp parallel for schedule(static) if (rows >= SMALL_OPS_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        const float *xr = x + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) h[i] += xr[i];
        norm_row(h, w, out + r * n, n, eps);
    }
}

/* gate_up [T, 2I] (the gate's I columns, then the up projection's) -> act [T, I] = silu(gate) * up,
 * with vec.h's exp_negv: within 2 float32 ulps of the exact value (torch's within 1.5), and the same
 * bits on every CPU path (fused decode layers and call by call). In the fused decode step it replaced
 * two torch ops and a return to Python between a layer's two C calls, 22 us a layer at 8 rows by
 * timers there, against 3 us for this; whole steps gained less (1% at batch 8, 1-3% at 32, Zen 5). */
void kvs_silu_mul_f32(const float *gate_up, float *act, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= SILU_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *out = act + r * inter;
        int64_t i0 = 0;
        for (; i0 + VW <= inter; i0 += VW) {
            vf a = siluv(loadv(g + i0)) * loadv(u + i0);
            memcpy(out + i0, &a, sizeof a);
        }
        if (i0 < inter) { /* the last few, through a buffer of one vector */
            float s[VW] = {0};
            memcpy(s, g + i0, (size_t)(inter - i0) * sizeof *s);
            vf a = siluv(loadv(s));
            memcpy(s, &a, sizeof a);
            for (int64_t i = 0; i < inter - i0; i++) out[i0 + i] = s[i] * u[i0 + i];
        }
    }
}
