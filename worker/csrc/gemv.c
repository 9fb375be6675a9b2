/* Skinny matrix products for decode steps with few rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * With M of 1 to 4 a projection is a stream over its weights, so speed is memory bandwidth. Each
 * thread takes a contiguous range of weight rows and reads every row once for all M inputs;
 * bf16 weights are widened in registers, never copied.
 */
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float dot_row(const float *x, const void *w, int64_t k, int is_bf16) {
    float acc = 0.0f;
    if (is_bf16) {
        const uint16_t *wr = (const uint16_t *)w;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; i++) {
            uint32_t u = (uint32_t)wr[i] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            acc += x[i] * f;
        }
    } else {
        const float *wr = (const float *)w;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; i++) acc += x[i] * wr[i];
    }
    return acc;
}

static inline __attribute__((always_inline)) void gemv(const float *x, const void *w, const float *bias, float *y,
                                                       int64_t m, int64_t n, int64_t k, int is_bf16) {
    size_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const char *wr = (const char *)w + (size_t)j * (size_t)k * elem;
        float b = bias ? bias[j] : 0.0f;
        for (int64_t r = 0; r < m; r++) y[r * n + j] = dot_row(x + r * k, wr, k, is_bf16) + b;
    }
}

void kvs_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    gemv(x, w, bias, y, m, n, k, 0);
}

void kvs_gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                   int64_t k) {
    gemv(x, w, bias, y, m, n, k, 1);
}
