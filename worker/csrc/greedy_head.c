/* Greedy decoding's LM head for float32 models, from half the bytes: the logits' argmax without
 * every float32 logit.
 *
 * A decode step of a few rows reads the whole head (49,152 x 576 float32 for SmolLM2: 113 MB, a
 * fifth of the step's weights) to pick one token a row. Here the head is first multiplied in bf16
 * (a second copy, packed for the bf16 products: half the bytes, and on CPUs with bf16 dot products
 * or AMX tiles twice the multiply-adds a cycle), which gives every logit to within a bound; then
 * only the tokens that bound cannot rule out get their float32 logit, each the same FMA chain over
 * k in order from zero that kvs_gemm_f32 computes, read from the same packed float32 weights, so
 * the same bits. The row's answer is the first of the largest of those, as kvs_argmax_f32 would
 * pick from the full row.
 *
 * The bound. Let S_j = sum_k |x_k| |w_jk| <= |x| |w_j| (Cauchy-Schwarz; |.| the 2-norm). Rounding x
 * and w to bf16 moves each product by at most (2^-9 + 2^-9 + 2^-18) of its size; the float32 sums,
 * in whatever order the bf16 kernel adds them, and the exact chain each move their sum by at most
 * gamma_K = K u / (1 - K u) of S_j (u = 2^-24) and a flushed denormal per term (the bf16 dot-product
 * and tile instructions flush them). So |A_j - L_j| <= E_j = c |x| |w_j| + K 2^-120 with c = 2^-8 +
 * 2^-16 + 3 gamma_K. With m = max_j (A_j - E_j), a lower bound of the largest L, a token with A_j +
 * E_j < m has L_j < m and cannot be the answer. The comparisons themselves run in float32 with a
 * slack of 2^-18 of the row's largest |A_j| + E_j, far above their own rounding.
 *
 * On SmolLM2 with chat and random-token prompts, 1 token a row was left to check at the median, 5 at
 * the 90th percentile, 29 at most (661 rows). The first pass keeps each block of BLOCK tokens'
 * largest A_j + E_j, so the second visits only the blocks that may hold one; the float32 logits run
 * CHAINS at a time. At 32 rows (2-core Zen 4 EPYC) the bf16 head took 4.6 ms and this 0.2, against
 * 8.7 for the float32 head; at one row 1.05 and 0.02 against 3.2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* The head's NR-column groups as csrc/gemm.c packs float32 weights: wp[g][k][c] = W[NR g + c, k]. */
int64_t kvs_gemm_group(void);

/* Whether exact_logit gives kvs_gemm_f32's bits: where the build fuses multiply-adds (the GEMM is
 * compiled with -ffp-contract=fast, its `acc += x * w` then an FMA, as fmaf is). Without FMA
 * instructions the GEMM rounds each product, and the caller keeps the float32 head. */
int kvs_greedy_head_exact(void) {
#if defined(__FMA__) || defined(__aarch64__)
    return 1;
#else
    return 0;
#endif
}

#define CHAINS 8 /* float32 logits computed at once: independent chains, so the FMAs' latency overlaps */
#define BLOCK (16 * VW) /* tokens whose largest A_j + E_j the first pass keeps, so the second visits few */

/* The float32 logits of columns idx[0 .. count) (count <= CHAINS) into out: kvs_gemm_f32's sums for
 * them, bit for bit (each an FMA chain over k in order from zero). The head's rows come from `rows`
 * [n, k] (row-major: each a contiguous read) where given, else from the packed groups (a read every
 * nr floats). */
static void exact_logits(const float *x, const float *rows, const float *wp, int64_t k, int64_t nr,
                         const int32_t *idx, int count, float *out) {
    const float *w[CHAINS];
    int64_t step = rows ? 1 : nr;
    for (int i = 0; i < CHAINS; i++) {
        int64_t j = idx[i < count ? i : 0];
        w[i] = rows ? rows + j * k : wp + (j / nr) * k * nr + j % nr;
    }
    float acc[CHAINS] = {0};
    for (int64_t kk = 0; kk < k; kk++)
        for (int i = 0; i < CHAINS; i++) acc[i] = fmaf(x[kk], w[i][kk * step], acc[i]);
    memcpy(out, acc, (size_t)count * sizeof *out);
}

/* One row: its answer into *out (and its logit into *value, the tokens checked into *checked);
 * returns 0, or 1 where the row holds a non-finite value. idx [n + CHAINS] and top [blocks]: room. */
static int pick_row(const float *xr, const float *a, const float *wp, const float *head, const float *wnorm,
                    int64_t n, int64_t k, double c, int32_t *idx, float *top, int64_t *out, float *value,
                    int64_t *checked) {
    const int64_t nr = kvs_gemm_group(), blocks = (n + BLOCK - 1) / BLOCK;
    const float floor_e = (float)k * 0x1p-120f;
    double xs = 0.0;
    for (int64_t kk = 0; kk < k; kk++) xs += (double)xr[kk] * xr[kk];
    float cx = (float)(c * sqrt(xs) * (1.0 + 0x1p-20)); /* c |x|, rounded well up */
    if (!isfinite(cx) || n == 0) return 1;
    /* pass 1: m = max (A_j - E_j); the largest |A_j| + E_j for the slack; each block's largest
     * A_j + E_j; a NaN poisons `bad` */
    vf vm = (vf){0} - INFINITY, vbig = (vf){0}, vcx = (vf){0} + cx, vfloor = (vf){0} + floor_e;
    vi bad = (vi){0};
    int64_t j = 0;
    for (int64_t b = 0; b < blocks; b++) {
        vf vtop = (vf){0} - INFINITY;
        int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (; j + VW <= end; j += VW) {
            vf av = loadv(a + j), e = vcx * loadv(wnorm + j) + vfloor;
            bad |= (vi)(av != av);
            vm = vmaxv(vm, av - e);
            vtop = vmaxv(vtop, av + e);
            vbig = vmaxv(vbig, selectv((vi)(av < 0), (vf){0} - av, av) + e);
        }
        top[b] = hmaxv(vtop);
        for (; j < end; j++) { /* the last block's tail */
            float e = cx * wnorm[j] + floor_e;
            bad[0] |= a[j] != a[j];
            vm[0] = a[j] - e > vm[0] ? a[j] - e : vm[0];
            top[b] = a[j] + e > top[b] ? a[j] + e : top[b];
            vbig[0] = fabsf(a[j]) + e > vbig[0] ? fabsf(a[j]) + e : vbig[0];
        }
    }
    float m = hmaxv(vm), big = hmaxv(vbig);
    int32_t lanes_bad[VW];
    memcpy(lanes_bad, &bad, sizeof lanes_bad);
    int nan = 0;
    for (int i = 0; i < VW; i++) nan |= lanes_bad[i];
    if (nan || !isfinite(m) || !isfinite(big)) return 1;
    float floor_m = m - big * 0x1p-18f; /* every token at or above it is checked */
    /* pass 2, over the blocks that may hold one (a block's top and a token's sum, rounded apart,
     * differ by far less than the margin): the tokens the bound leaves, in index order */
    int64_t count = 0;
    vf vfl = (vf){0} + floor_m;
    for (int64_t b = 0; b < blocks; b++) {
        if (top[b] < floor_m - big * 0x1p-19f) continue;
        int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (j = b * BLOCK; j + VW <= end; j += VW) {
            vi keep = (vi)(loadv(a + j) + (vcx * loadv(wnorm + j) + vfloor) >= vfl);
            int32_t lanes[VW];
            memcpy(lanes, &keep, sizeof lanes);
            for (int i = 0; i < VW; i++) idx[count] = (int32_t)(j + i), count += lanes[i] != 0;
        }
        for (; j < end; j++) idx[count] = (int32_t)j, count += a[j] + (cx * wnorm[j] + floor_e) >= floor_m;
    }
    /* their float32 logits, CHAINS at a time; the first of the largest */
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t i0 = 0; i0 < count; i0 += CHAINS) {
        int take = count - i0 < CHAINS ? (int)(count - i0) : CHAINS;
        float l[CHAINS];
        exact_logits(xr, head, wp, k, nr, idx + i0, take, l);
        for (int i = 0; i < take; i++)
            if (at < 0 || l[i] > best) {
                best = l[i];
                at = idx[i0 + i];
            }
    }
    if (at < 0 || best != best) return 1; /* nothing left (cannot happen with finite values), or a NaN logit */
    *out = at;
    if (value) *value = best;
    if (checked) *checked = count;
    return 0;
}

/* For each of `rows` rows of x [rows, k] (the head's input) and approx [rows, n] (x times the bf16
 * head, float32 sums): the first index of the largest float32 logit into out[r]. The float32 head:
 * wp, packed as kvs_gemm_f32 reads it, and `head` [n, k] row-major where the caller has it (else
 * NULL). wnorm [n]: each head row's 2-norm, rounded up. Returns the number of rows that held a
 * non-finite value, or -1 without memory for the work (their out not set; the caller takes the
 * float32 head then). value (NULL or [rows]): each answer's float32 logit; checked (NULL or [rows]):
 * the float32 logits each row computed. */
int64_t kvs_greedy_head(const float *x, const float *approx, const float *wp, const float *head, const float *wnorm,
                        int64_t rows, int64_t n, int64_t k, int64_t *out, float *value, int64_t *checked) {
    const double u = 0x1p-24, gamma = (double)k * u / (1.0 - (double)k * u);
    const double c = 0x1p-8 + 0x1p-16 + 3.0 * gamma;
    int64_t bad_rows = 0, no_memory = 0;
#pragma omp parallel reduction(+ : bad_rows, no_memory) if (rows > 1)
    {
        int32_t *idx = malloc((size_t)(n + CHAINS) * sizeof *idx); /* a row's tokens left to check */
        float *top = malloc((size_t)((n + BLOCK - 1) / BLOCK + 1) * sizeof *top); /* each block's largest A_j + E_j */
        no_memory += idx == NULL || top == NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (idx != NULL && top != NULL)
                bad_rows += pick_row(x + r * k, approx + r * n, wp, head, wnorm, n, k, c, idx, top, out + r,
                                     value ? value + r : NULL, checked ? checked + r : NULL);
        free(idx);
        free(top);
    }
    return no_memory ? -1 : bad_rows;
}
