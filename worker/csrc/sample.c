/* Random sampling of float32 logits rows [rows, n], one uniform number a row: the inverse of the
 * distribution's cumulative sum. The exponential race the sampler used before draws n random numbers
 * a row and sorted the whole vocabulary for top-k and top-p: on a 2-core Zen 4, 1.1-1.3 ms a row of
 * a 49,152-token vocabulary at a temperature, 3.5-5 ms with top_p or top_k, against a decode step
 * of 16-20 ms.
 *
 * A row's weights are w_i = e^((x_i - max) / T), so the largest is exactly 1. The tokens kept are
 * top-k of them (0: all), then the smallest run of the largest whose mass before each is under
 * top_p of the top-k mass, then those with w_i >= min_p (min_p of the largest's probability); the
 * largest is always kept. Ties at a cut keep the lower token ids. The sample is the first token, in
 * id order, at which the kept weights' running sum passes u times their total.
 *
 * Top-k and top-p need the largest weights in order, but not the whole row sorted: a histogram of
 * log2-weights in bins of 1/16 finds the bin where the count passes k or the mass passes top_p, and
 * only the tokens at or above that bin (one bin more for the mass, whose sums round) are sorted.
 * min_p alone needs no order at all.
 *
 * Sums are taken in float32 over runs of BLOCK tokens and in double across runs; the walk to the
 * sample repeats the run sums exactly, then adds within its run in double, so the sample never
 * falls past the row. A row holding a NaN is counted and left to the caller. Rows run on both
 * cores; each row's numbers depend on that row alone, so a row samples the same in any batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define BLOCK 256
/* log2-weight bins of 1/16, read off a weight's float bits: its exponent and the top 4 bits of its
 * mantissa. A weight of 1 falls in bin 15, 0 in bin 2047; a larger weight never in a later bin. */
#define BINS 2048

typedef struct {
    float w;
    int32_t id;
} Cand;

static int by_weight_desc(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The row's largest value; *nan set when it holds a NaN. */
static float row_max(const float *p, int64_t n, int *nan) {
    float best = p[0];
    int64_t j = 0;
    int bad = best != best;
    if (n >= VW) {
        vf vmax = loadv(p);
        vi vbad = (vi)(vmax != vmax);
        for (j = VW; j + VW <= n; j += VW) {
            vf v = loadv(p + j);
            vmax = vmaxv(v, vmax);
            vbad |= (vi)(v != v);
        }
        float lanes[VW];
        int32_t lanes_bad[VW];
        memcpy(lanes, &vmax, sizeof lanes);
        memcpy(lanes_bad, &vbad, sizeof lanes_bad);
        for (int i = 0; i < VW; i++) {
            bad |= lanes_bad[i];
            if (lanes[i] > best) best = lanes[i];
        }
    }
    for (; j < n; j++) {
        bad |= p[j] != p[j];
        if (p[j] > best) best = p[j];
    }
    *nan = bad;
    return best;
}

/* Sum of w[0 .. len), float32 lanes then the lanes in order. */
static float run_sum(const float *w, int64_t len) {
    int64_t j = 0;
    float s = 0.0f;
    if (len >= VW) {
        vf acc = loadv(w);
        for (j = VW; j + VW <= len; j += VW) acc += loadv(w + j);
        s = hsumv(acc);
    }
    for (; j < len; j++) s += w[j];
    return s;
}

/* w[i] = e^((p[i] - max) * inv) over the row. */
static void weights(const float *p, int64_t n, float max, float inv, float *w) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        vf z = (loadv(p + j) - max) * inv;
        vf e = exp_negv(z);
        memcpy(w + j, &e, sizeof e);
    }
    for (; j < n; j++) {
        float z[VW] = {0}, e[VW];
        z[0] = (p[j] - max) * inv;
        vf ez = exp_negv(loadv(z));
        memcpy(e, &ez, sizeof e);
        w[j] = e[0];
    }
}

static inline int bin_of(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return 2047 - (int)(bits >> 19);
}

/* Keep only the top-k / top-p / min-p tokens of w (the rest set to 0). cand: room for n. */
static void keep_top(float *w, int64_t n, int64_t top_k, float top_p, float min_p, Cand *cand) {
    int32_t counts[BINS];
    double mass[BINS];
    memset(counts, 0, sizeof counts);
    memset(mass, 0, sizeof mass);
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) {
        int b = bin_of(w[i]);
        counts[b]++;
        mass[b] += w[i];
        total += w[i];
    }
    /* the last bin holding a token that may be kept; never before the largest weight's (1's) */
    int last = BINS - 1;
    if (top_k > 0 && top_k < n) {
        int64_t seen = 0;
        for (int b = 0; b < BINS; b++) {
            seen += counts[b];
            if (seen >= top_k) {
                last = b;
                break;
            }
        }
    } else if (top_p < 1.0f) {
        double seen = 0.0;
        for (int b = 0; b < BINS; b++) {
            seen += mass[b];
            if (seen > 0.0 && seen >= top_p * total) {
                last = b + 1 < BINS ? b + 1 : b;
                break;
            }
        }
    }
    if (last < bin_of(1.0f)) last = bin_of(1.0f);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (bin_of(w[i]) <= last) cand[m++] = (Cand){w[i], (int32_t)i};
    qsort(cand, (size_t)m, sizeof *cand, by_weight_desc);
    int64_t kept = m;
    if (top_k > 0 && top_k < kept) kept = top_k;
    if (top_p < 1.0f) {
        double sum = 0.0;
        for (int64_t i = 0; i < kept; i++) sum += cand[i].w;
        if (top_k <= 0 || top_k >= n) sum = total; /* without top-k, the mass of the whole row */
        double before = 0.0;
        int64_t i = 0;
        while (i < kept && (i == 0 || before < top_p * sum)) before += cand[i++].w;
        kept = i;
    }
    while (kept > 1 && cand[kept - 1].w < min_p) kept--;
    /* the cut: weights above the last kept one's, and equal ones up to its id */
    float w_cut = cand[kept - 1].w;
    int32_t id_cut = cand[kept - 1].id;
    for (int64_t i = 0; i < n; i++)
        if (w[i] < w_cut || (w[i] == w_cut && i > id_cut)) w[i] = 0.0f;
}

/* The token at u of the row's weights (u in [0, 1)): run sums find the run, then the tokens in it. */
static int64_t pick(const float *w, int64_t n, double u) {
    int64_t runs = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t r = 0; r < runs; r++) {
        int64_t len = n - r * BLOCK < BLOCK ? n - r * BLOCK : BLOCK;
        total += run_sum(w + r * BLOCK, len);
    }
    double target = u * total, before = 0.0;
    for (int64_t r = 0; r < runs; r++) {
        int64_t start = r * BLOCK, len = n - start < BLOCK ? n - start : BLOCK;
        double s = run_sum(w + start, len);
        if (before + s > target || r == runs - 1) {
            int64_t last = -1;
            double acc = before;
            for (int64_t i = start; i < start + len; i++) {
                if (w[i] <= 0.0f) continue;
                acc += w[i];
                last = i;
                if (acc > target) return i;
            }
            if (last >= 0) return last; /* rounding within the run: its last kept token */
        }
        before += s;
    }
    for (int64_t i = n - 1; i >= 0; i--) /* not reached: every run was passed over by rounding */
        if (w[i] > 0.0f) return i;
    return 0;
}

/* out[r]: row r's sample; rows with temperature[r] <= 0 take their first largest value. scratch:
 * rows * n * 12 bytes. Returns the number of rows that hold a NaN (their out is not set). */
int64_t kvs_sample_f32(const float *x, int64_t rows, int64_t n, const float *temperature, const int64_t *top_k,
                       const float *top_p, const float *min_p, const double *u, void *scratch, int64_t *out) {
    int64_t nan_rows = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : nan_rows) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * n;
        float *w = (float *)scratch + r * n * 3;
        Cand *cand = (Cand *)(w + n);
        int nan;
        float max = row_max(p, n, &nan);
        if (nan) {
            nan_rows++;
            continue;
        }
        if (temperature[r] <= 0.0f) {
            int64_t at = 0;
            while (p[at] != max) at++;
            out[r] = at;
            continue;
        }
        weights(p, n, max, 1.0f / temperature[r], w);
        if ((top_k[r] > 0 && top_k[r] < n) || top_p[r] < 1.0f) {
            keep_top(w, n, top_k[r], top_p[r], min_p[r], cand);
        } else if (min_p[r] > 0.0f) { /* the largest weight is 1: min_p of it is min_p */
            for (int64_t i = 0; i < n; i++)
                if (w[i] < min_p[r]) w[i] = 0.0f;
        }
        out[r] = pick(w, n, u[r]);
    }
    return nan_rows;
}
