/* RMSNorm for float32 rows, alone or fused with the residual add that precedes it in every layer:
 *
 *     residual += x;  out = residual * rsqrt(mean(residual^2) + eps) * weight
 *
 * torch runs this as about eight small ops per call, which at decode sizes cost more than the
 * arithmetic; here it is one pass over the row.
 */
#include <math.h>
#include <stdint.h>

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
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

void kvs_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                          float eps) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        const float *xr = x + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) h[i] += xr[i];
        norm_row(h, w, out + r * n, n, eps);
    }
}
