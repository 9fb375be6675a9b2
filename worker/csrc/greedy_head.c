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

/* The float32 sums the model's GEMM makes for bf16 weights widened (csrc/gemm.c: micro, and one row's
 * gemv_bf16_group, where no bf16 dot products run) for columns idx[0 .. count) (count <= CHAINS) of x
 * (its bf16 row widened): each column an FMA chain over k in order from zero of x and the column's
 * weights widened, here read from the head's row-major bf16 rows, so the same bits. */
static void exact_bf16_logits(const float *x, const uint16_t *rows, int64_t k, const int32_t *idx, int count,
                              float *out) {
    const uint16_t *w[CHAINS];
    for (int i = 0; i < CHAINS; i++) w[i] = rows + (int64_t)idx[i < count ? i : 0] * k;
    float acc[CHAINS] = {0};
    for (int64_t kk = 0; kk < k; kk++)
        for (int i = 0; i < CHAINS; i++) acc[i] = fmaf(x[kk], bf16_to_f32(w[i][kk]), acc[i]);
    memcpy(out, acc, (size_t)count * sizeof *out);
}

void kvs_gemm_bf16x(const uint16_t *x, int64_t ldx, const uint16_t *wp, const float *bias, void *y, int form,
                    int64_t m, int64_t n, int64_t k);
int kvs_amx_active(void);
int kvs_bf16_dot_active(void);
void kvs_widen_bf16(const uint16_t *src, int64_t src_stride, float *dst, int64_t rows, int64_t n);
void kvs_amx_row_config(void);
void kvs_amx_row_tile(const uint16_t *xp, const uint16_t *wp, int64_t kb_count, int64_t tile, float *out);
void kvs_amx_row_release(void);

/* A bf16 model's head (kvs_greedy_head with xb): the row of x in bf16, the packed bf16 head as the
 * model's GEMM reads it, and room for a group's logits. Its logits are the GEMM's float32 sums
 * rounded to bf16 (Y_BF16_IN_F32), and a column's sum does not depend on which columns or rows are
 * computed beside it, so one group's products give the bits the whole head's would. A group is
 * `cols` columns: the packed GEMM's (group_elems elements each), or on AMX tiles (amx) one
 * 16-column tile (kvs_amx_row_tile; xpad: the row padded to kb_count k blocks of 32). With `rows`
 * (the head [n, k] row-major, a tied embedding), off the AMX tiles, the candidates' sums come from
 * those rows instead: 16 at a time on the bf16 dot products (dot_logits), else CHAINS at a time as
 * the widened weights' chains (exact_bf16_logits). */
typedef struct {
    const uint16_t *xb, *wb, *rows;
    int64_t group_elems, cols, kb_count;
    int amx, dot; /* dot: the GEMM runs on bf16 dot products (else on the weights widened) */
    uint16_t *xpad;
    float *group;
} Bf16Head;

#if VW == 16 && defined(__AVX512BF16__)
#define DOT_LOGITS 1
/* The float32 sums the model's GEMM on bf16 dot products (csrc/gemm.c, dot_micro) makes for columns
 * idx[0 .. count) (count <= 16) of x's row (k even), into out: there each column is one lane's chain
 * of VDPBF16PS over x's k pairs in order from zero, a pair of x broadcast against the column's
 * pair. Here lane i carries column idx[i]'s chain, the same instruction on the same operands in the
 * same order, so the same bits; its pairs come from the head's row-major rows, 16 pairs of 16 rows
 * turned into 16 vectors of one pair each. Against a group of the GEMM for each candidate (48
 * columns, 55 KB of the packed head for SmolLM2), a candidate reads its own row: 1.1 KB. */
static void dot_logits(const uint16_t *xb, const uint16_t *rows, int64_t k, const int32_t *idx, int count,
                       float *out) {
    const uint32_t *x = (const uint32_t *)xb, *r[16];
    int64_t kp = k / 2;
    for (int i = 0; i < 16; i++) r[i] = (const uint32_t *)(rows + (int64_t)idx[i < count ? i : 0] * k);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < kp; k0 += 16) {
        int n = kp - k0 < 16 ? (int)(kp - k0) : 16;
        __mmask16 live = (__mmask16)((1u << n) - 1);
        __m512 m[16];
        for (int i = 0; i < 16; i++) m[i] = _mm512_maskz_loadu_ps(live, r[i] + k0);
        transpose16(m); /* (vec.h) */
        for (int j = 0; j < n; j++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x[k0 + j]), (__m512bh)m[j]);
    }
    float all[16];
    _mm512_storeu_ps(all, acc);
    memcpy(out, all, (size_t)count * sizeof *out);
}
#else
#define DOT_LOGITS 0
#endif

/* For tests: the float32 sums of columns idx[0 .. count) (count <= 16) of the bf16 rows [n, k]
 * against the bf16 row xb, as dot_logits (dot) or exact_bf16_logits make them; 0, or -1 where this
 * build has no bf16 dot products (dot) or for a bad count. */
int kvs_greedy_row_logits(const uint16_t *xb, const uint16_t *rows, int64_t k, const int32_t *idx, int count, int dot,
                          float *out) {
    if (count < 1 || count > 16 || (dot && (k % 2 || !DOT_LOGITS))) return -1;
#if DOT_LOGITS
    if (dot) {
        dot_logits(xb, rows, k, idx, count, out);
        return 0;
    }
#endif
    float *x = malloc((size_t)k * sizeof *x);
    if (!x) return -1;
    kvs_widen_bf16(xb, k, x, 1, k);
    for (int c = 0; c < count; c += CHAINS)
        exact_bf16_logits(x, rows, k, idx + c, count - c < CHAINS ? count - c : CHAINS, out + c);
    free(x);
    return 0;
}

/* One row: its answer into *out (and its logit into *value, the tokens checked into *checked);
 * returns 0, or 1 where the row holds a non-finite value. idx [n + CHAINS] and top [blocks]: room.
 * The bound on |A_j - L_j| is E_j = cx wnorm_j + floor, plus ce enorm_j where the int8 copy gave A
 * (has_e; see kvs_greedy_head). With bf (a bf16 model), the logits compared are L_j rounded to
 * bf16, which equal the largest only where L_j is within a bf16 step of it (2^-7 of its size), so
 * every token within 2^-6 of |m| below m is checked too, each candidate's group computed once. */
static inline __attribute__((always_inline)) int pick_row(const float *xr, const float *a, const float *wp,
                                                          const float *head, const float *wnorm, const float *enorm,
                                                          int has_e, const Bf16Head *bf, int64_t n, int64_t k,
                                                          float cx, float ce, int32_t *idx, float *top, int64_t *out,
                                                          float *value, int64_t *checked) {
    const int64_t nr = kvs_gemm_group(), blocks = (n + BLOCK - 1) / BLOCK;
    const float floor_e = (float)k * 0x1p-120f;
    if (!isfinite(cx) || !isfinite(ce) || n == 0) return 1;
    /* pass 1: m = max (A_j - E_j); the largest |A_j| + E_j for the slack; each block's largest
     * A_j + E_j; a NaN poisons `bad` */
    vf vm = (vf){0} - INFINITY, vbig = (vf){0}, vcx = (vf){0} + cx, vce = (vf){0} + ce, vfloor = (vf){0} + floor_e;
#define BOUND_V(j) (vcx * loadv(wnorm + (j)) + (has_e ? vce * loadv(enorm + (j)) : (vf){0}) + vfloor)
#define BOUND_1(j) (cx * wnorm[j] + (has_e ? ce * enorm[j] : 0.0f) + floor_e)
    vi bad = (vi){0};
    int64_t j = 0;
    for (int64_t b = 0; b < blocks; b++) {
        vf vtop = (vf){0} - INFINITY;
        int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (; j + VW <= end; j += VW) {
            vf av = loadv(a + j), e = BOUND_V(j);
            bad |= (vi)(av != av);
            vm = vmaxv(vm, av - e);
            vtop = vmaxv(vtop, av + e);
            vbig = vmaxv(vbig, selectv((vi)(av < 0), (vf){0} - av, av) + e);
        }
        top[b] = hmaxv(vtop);
        for (; j < end; j++) { /* the last block's tail */
            float e = BOUND_1(j);
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
    float floor_m = m - big * 0x1p-18f - (bf ? fabsf(m) * 0x1p-6f : 0.0f); /* every token at or above it is checked */
    /* pass 2, over the blocks that may hold one (a block's top and a token's sum, rounded apart,
     * differ by far less than the margin): the tokens the bound leaves, in index order */
    int64_t count = 0;
    vf vfl = (vf){0} + floor_m;
    for (int64_t b = 0; b < blocks; b++) {
        if (top[b] < floor_m - big * 0x1p-19f) continue;
        int64_t end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (j = b * BLOCK; j + VW <= end; j += VW) {
            vi keep = (vi)(loadv(a + j) + BOUND_V(j) >= vfl);
            int32_t lanes[VW];
            memcpy(lanes, &keep, sizeof lanes);
            for (int i = 0; i < VW; i++) idx[count] = (int32_t)(j + i), count += lanes[i] != 0;
        }
        for (; j < end; j++) idx[count] = (int32_t)j, count += a[j] + BOUND_1(j) >= floor_m;
    }
#undef BOUND_V
#undef BOUND_1
    /* their float32 logits, CHAINS at a time; the first of the largest */
    float best = -INFINITY;
    int64_t at = -1;
    if (bf && bf->amx && count > 0) {
        memcpy(bf->xpad, bf->xb, (size_t)k * sizeof *bf->xpad); /* the padding past k stays zero */
        kvs_amx_row_config();
    }
    for (int64_t i0 = 0; bf && bf->rows && i0 < count; i0 += 16) {
        int take = count - i0 < 16 ? (int)(count - i0) : 16;
        float l[16];
        for (int64_t i = i0 + 16; i < i0 + 32 && i < count; i++) /* the next 16 rows, read while these are summed */
            for (int64_t b = 0; b < 2 * k; b += 64) __builtin_prefetch((const char *)(bf->rows + idx[i] * k) + b, 0, 3);
#if DOT_LOGITS
        if (bf->dot)
            dot_logits(bf->xb, bf->rows, k, idx + i0, take, l);
        else
#endif
            for (int c = 0; c < take; c += CHAINS)
                exact_bf16_logits(xr, bf->rows, k, idx + i0 + c, take - c < CHAINS ? take - c : CHAINS, l + c);
        for (int i = 0; i < take; i++) {
            float v = bf16_to_f32(to_bf16(l[i])); /* rounded as the GEMM's Y_BF16_IN_F32 */
            if (at < 0 || v > best) {
                best = v;
                at = idx[i0 + i];
            }
        }
    }
    for (int64_t i = 0, last = -1; bf && !bf->rows && i < count; i++) {
        int64_t g = idx[i] / bf->cols;
        if (g != last) { /* the candidate's group, by the model's own GEMM */
            if (bf->amx) {
                kvs_amx_row_tile(bf->xpad, bf->wb, bf->kb_count, g, bf->group);
            } else {
                int64_t cols = (g + 1) * bf->cols <= n ? bf->cols : n - g * bf->cols;
                kvs_gemm_bf16x(bf->xb, k, bf->wb + g * bf->group_elems, NULL, bf->group, Y_BF16_IN_F32, 1, cols, k);
            }
            last = g;
        }
        float l = bf->group[idx[i] - g * bf->cols];
        if (at < 0 || l > best) {
            best = l;
            at = idx[i];
        }
    }
    if (bf && bf->amx && count > 0) kvs_amx_row_release();
    for (int64_t i0 = 0; !bf && i0 < count; i0 += CHAINS) {
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

static inline double gamma_k(int64_t k) {
    const double u = 0x1p-24;
    return (double)k * u / (1.0 - (double)k * u);
}

/* For each of `rows` rows of x [rows, k] (the head's input) and approx [rows, n] (x times the copy of
 * the head): the first index of the largest logit into out[r]. The float32 head: wp, packed as
 * kvs_gemm_f32 reads it, and `head` [n, k] row-major where the caller has it (else NULL); for a bf16
 * model instead xb (its rows of x in bf16), wb (its packed head) and group_elems (see Bf16Head), and
 * `head` its rows [n, k] in bf16 where the caller has them (else NULL).
 * wnorm [n]: each head row's 2-norm, rounded up. With the int8 copy (csrc/int8_head.c), xnorms
 * [rows, 2] holds each row's |x| and |e_x|, and enorm [n] each head row's |e_j|, rounded up (NULL
 * both for the bf16 copy). Returns the number of rows that held a non-finite value, or -1 without
 * memory for the work (their out not set; the caller takes the full head then). value (NULL or
 * [rows]): each answer's logit; checked (NULL or [rows]): the logits each row computed exactly.
 *
 * The int8 copy's bound:
 *
 *   A_j = (x - e_x) . (w_j - e_j) exactly in integers, scaled; x . w_j - that = e_x . w_j + x . e_j
 *   - e_x . e_j, so |A_j - x . w_j| <= |e_x| |w_j| + |x| |e_j| + |e_x| |e_j|; the float32 chain L_j
 *   is within gamma_K |x| |w_j| of x . w_j; and A_j's own roundings (the two sums converted to
 *   float32, at most sqrt(K) 2^-24 (|x| + |e_x|) (|w_j| + |e_j|) between them, the fused
 *   combination and the two scalings, 3 2^-24 of that) stay under (gamma_K + 2^-20) of it,
 *
 * so E_j = c1 |w_j| + c2 |e_j| + K 2^-120, with g = gamma_K + 2^-20, c1 = |e_x| + 3 gamma_K |x| +
 * g (|x| + |e_x|) and c2 = (|x| + |e_x|) (1 + g), both rounded up. */
int64_t kvs_greedy_head(const float *x, const float *approx, const float *xnorms, const float *wp, const void *head,
                        const float *wnorm, const float *enorm, const uint16_t *xb, const uint16_t *wb,
                        int64_t group_elems, int64_t rows, int64_t n, int64_t k, int64_t *out, float *value,
                        int64_t *checked) {
    const double gamma = gamma_k(k), c = 0x1p-8 + 0x1p-16 + 3.0 * gamma, up = 1.0 + 0x1p-20;
    int64_t bad_rows = 0, no_memory = 0;
#pragma omp parallel reduction(+ : bad_rows, no_memory) if (rows > 1)
    {
        int32_t *idx = malloc((size_t)(n + CHAINS) * sizeof *idx); /* a row's tokens left to check */
        float *top = malloc((size_t)((n + BLOCK - 1) / BLOCK + 1) * sizeof *top); /* each block's largest A_j + E_j */
        /* on AMX tiles the model's head is packed in 16-column tiles (csrc/amx_gemm.c) */
        int amx = xb != NULL && kvs_amx_active();
        int64_t cols = amx ? 16 : kvs_gemm_group(), kb_count = (k + 31) / 32;
        /* a bf16 model's rows of the head, off the AMX tiles (dot_logits, exact_bf16_logits) */
        int dot = kvs_bf16_dot_active();
        const uint16_t *bf_rows = xb && !amx && (!dot || k % 2 == 0) ? head : NULL;
        const float *f32_rows = xb ? NULL : head;
        Bf16Head bf = {NULL, wb, bf_rows, group_elems, cols, kb_count, amx, dot,
                       amx ? calloc((size_t)kb_count * 32, sizeof(uint16_t)) : NULL,
                       xb ? malloc((size_t)cols * sizeof(float)) : NULL};
        int lacking = idx == NULL || top == NULL || (xb && bf.group == NULL) || (amx && bf.xpad == NULL);
        no_memory += lacking;
        /* rows one at a time as threads come free: the tokens left to check differ from row to row (7
         * to 300 a row in one call of 32 after random prompts), and with rows split evenly one
         * thread had spun a third of such a call waiting for the other (2-core Zen 4 EPYC, perf);
         * those calls ran 1.08-1.15x faster whole, calls of few checks even */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (lacking) continue;
            bf.xb = xb ? xb + r * k : NULL;
            const float *xr = x + r * k;
            int64_t *o = out + r, *ch = checked ? checked + r : NULL;
            float *val = value ? value + r : NULL;
            if (xnorms == NULL) { /* the bf16 copy: E_j = c |x| |w_j| + floor */
                double xs = 0.0;
                for (int64_t kk = 0; kk < k; kk++) xs += (double)xr[kk] * xr[kk];
                float cx = (float)(c * sqrt(xs) * up); /* c |x|, rounded well up */
                bad_rows += pick_row(xr, approx + r * n, wp, f32_rows, wnorm, NULL, 0, NULL, n, k, cx, 0.0f, idx, top,
                                     o, val, ch);
            } else {
                double xn = xnorms[2 * r], en = xnorms[2 * r + 1];
                double g = gamma + 0x1p-20;
                float c1 = (float)((en + 3.0 * gamma * xn + g * (xn + en)) * up);
                float c2 = (float)((xn + en) * (1.0 + g) * up);
                bad_rows += pick_row(xr, approx + r * n, wp, f32_rows, wnorm, enorm, 1, xb ? &bf : NULL, n, k, c1, c2,
                                     idx, top, o, val, ch);
            }
        }
        free(bf.group);
        free(bf.xpad);
        free(idx);
        free(top);
    }
    return no_memory ? -1 : bad_rows;
}
