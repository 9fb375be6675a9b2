/* Dense projections against weights packed once at load: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Packed layout: panels of 16 output columns, each panel [K][16] contiguous, so that one k step
 * of a panel is one 64-byte vector:
 *
 *     W [N, K] row-major          packed: panel p = columns 16p .. 16p+15
 *     n0: w00 w01 w02 ...         wp[p][k][c] = W[16p + c, k]      (rows past N are zero)
 *     n1: w10 w11 w12 ...
 *
 * A micro-tile keeps MR rows of x against 2 panels in 2 * MR vector accumulators, broadcasting one
 * x value per row and k. Weights are read in order, once per block of up to MB rows of x, with
 * no per-call repacking; that is where this beats a general GEMM library at decode shapes.
 * bf16 weights are widened in registers; x and y are always float32.
 */
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#define MR 6  /* rows of x per micro-tile: 12 accumulators + 2 weight vectors fit the registers */
#define MB 48 /* rows of x per block, which stays in L2 while the panels stream past it */

static inline __attribute__((always_inline)) v16f load_panel(const void *wp, int64_t idx, int is_bf16) {
    v16f v;
    if (is_bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)wp + idx, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, (const float *)wp + idx, sizeof v);
    }
    return v;
}

static inline __attribute__((always_inline)) void micro(const float *x, int64_t k, const void *wp, int64_t p0,
                                                        int two, float *y, int64_t ldy, int mr, int is_bf16) {
    v16f a0[MR], a1[MR];
    for (int i = 0; i < MR; i++) {
        a0[i] = (v16f){0};
        a1[i] = (v16f){0};
    }
    int64_t base0 = p0 * k * 16, base1 = (p0 + 1) * k * 16;
    for (int64_t kk = 0; kk < k; kk++) {
        v16f w0 = load_panel(wp, base0 + kk * 16, is_bf16);
        v16f w1 = two ? load_panel(wp, base1 + kk * 16, is_bf16) : w0;
        for (int i = 0; i < mr; i++) {
            float xv = x[i * k + kk];
            a0[i] += xv * w0;
            if (two) a1[i] += xv * w1;
        }
    }
    for (int i = 0; i < mr; i++) {
        memcpy(y + i * ldy, &a0[i], sizeof(v16f));
        if (two) memcpy(y + i * ldy + 16, &a1[i], sizeof(v16f));
    }
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const void *wp, int64_t p0,
                                                       int two, float *y, int64_t ldy, int64_t mr, int is_bf16) {
    /* a constant row count lets each variant unroll fully and keep its accumulators in registers */
    switch (mr) {
    case 6: micro(x, k, wp, p0, two, y, ldy, 6, is_bf16); break;
    case 5: micro(x, k, wp, p0, two, y, ldy, 5, is_bf16); break;
    case 4: micro(x, k, wp, p0, two, y, ldy, 4, is_bf16); break;
    case 3: micro(x, k, wp, p0, two, y, ldy, 3, is_bf16); break;
    case 2: micro(x, k, wp, p0, two, y, ldy, 2, is_bf16); break;
    default: micro(x, k, wp, p0, two, y, ldy, 1, is_bf16); break;
    }
}

static inline __attribute__((always_inline)) void gemm(const float *x, const void *wp, const float *bias, float *y,
                                                       int64_t m, int64_t n, int64_t k, int64_t ldy, int is_bf16) {
    int64_t panels = (n + 15) / 16, pairs = (panels + 1) / 2, blocks = (m + MB - 1) / MB;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t pp = 0; pp < pairs; pp++) {
            int64_t p0 = 2 * pp, m_end = (b + 1) * MB < m ? (b + 1) * MB : m;
            int two = p0 + 1 < panels;
            for (int64_t m0 = b * MB; m0 < m_end; m0 += MR) {
                int64_t mr = m_end - m0 < MR ? m_end - m0 : MR;
                tile(x + m0 * k, k, wp, p0, two, y + m0 * ldy + p0 * 16, ldy, mr, is_bf16);
            }
            if (bias) {
                int64_t c_end = (p0 + 2) * 16 < n ? (p0 + 2) * 16 : n;
                for (int64_t i = b * MB; i < m_end; i++)
                    for (int64_t c = p0 * 16; c < c_end; c++) y[i * ldy + c] += bias[c];
            }
        }
    }
}

void kvs_gemm_f32(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                  int64_t ldy) {
    gemm(x, wp, bias, y, m, n, k, ldy, 0);
}

void kvs_gemm_bf16(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t m, int64_t n,
                   int64_t k, int64_t ldy) {
    gemm(x, wp, bias, y, m, n, k, ldy, 1);
}

/* w [n, k] -> packed panels of 16 columns (see the top of this file); elem is 4 (fp32) or 2 (bf16). */
void kvs_pack(const void *w, void *wp, int64_t n, int64_t k, int64_t elem) {
    int64_t panels = (n + 15) / 16;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < 16; c++) {
                int64_t row = p * 16 + c;
                char *dst = (char *)wp + ((p * k + kk) * 16 + c) * elem;
                if (row < n) memcpy(dst, (const char *)w + (row * k + kk) * elem, (size_t)elem);
                else memset(dst, 0, (size_t)elem);
            }
}
