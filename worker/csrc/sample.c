/* Random sampling of float32 logits rows [rows, n]: the exponential race, argmax of w_i / E_i over
 * the kept weights w_i with E_i ~ Exp(1), which draws token i with probability w_i / sum(w) exactly.
 * The torch version drew n exponentials a row from a generator and sorted the whole vocabulary for
 * top-k and top-p: on a 2-core Zen 4, 1.1-1.3 ms a row of a 49,152-token vocabulary at a
 * temperature, 3.5-5 ms with top_p or top_k, against a decode step of 16-20 ms.
 *
 * Here the row's noise comes from one 53-bit key a row (the caller draws it from the row's
 * generator): U_i = hash(key, i), a counter-based hash (two rounds of a 32-bit integer mix), and
 * E_i = -ln U_i, all in registers. A race, unlike the inverse of the cumulative sum, is stable: a
 * last-bit change in the logits (a speculative chunk's rows, a recomputed prompt) moves the sample
 * only where two tokens' w / E nearly tie, so a seeded request gives the same tokens either way.
 *
 * A row's weights are w_i = e^((x_i - max) / T), so the largest is exactly 1. The tokens kept are
 * top-k of them (0: all), then the smallest run of the largest whose mass before each is under
 * top_p of the top-k mass, then those with w_i >= min_p (min_p of the largest's probability); the
 * largest is always kept. Ties at a cut keep the lower token ids; the rest race with w = 0.
 *
 * Top-k and top-p need the largest weights in order, but not the whole row sorted: a histogram of
 * log2-weights in bins of 1/16 finds the bin where the count passes k or the mass passes top_p, and
 * only the tokens at or above that bin (one bin more for the mass, whose sums round) are sorted.
 * min_p alone needs no order at all. A row holding a NaN is counted and left to the caller. Rows
 * run on both cores; each row's numbers depend on that row alone, so a row samples the same in any
 * batch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

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

typedef uint32_t vu __attribute__((vector_size(4 * VW)));

/* A 32-bit integer mix (Wellons' "lowbias32" constants): a bijection, each output bit flipping
 * with about half of the input bits. */
static inline __attribute__((always_inline)) vu mix32(vu x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* ln x for x in (0, 1], to about 1 float32 ulp: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then
 * ln(m) by the classic degree-9 polynomial in m - 1 and e ln 2 in two parts. */
static inline __attribute__((always_inline)) vf log_unitv(vf x) {
    vi bits;
    memcpy(&bits, &x, sizeof bits);
    vf e = __builtin_convertvector(((bits >> 23) & 0xff) - 126, vf);
    vi mb = (bits & 0x007fffff) | 0x3f000000; /* m in [1/2, 1) */
    vf m;
    memcpy(&m, &mb, sizeof m);
    vi small = m < 0.70710678f;
    e = selectv(small, e - 1.0f, e);
    m = selectv(small, m + m - 1.0f, m - 1.0f);
    vf z = m * m;
    vf y = (vf){0} + 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y = y + e * -2.12194440e-4f - 0.5f * z;
    return m + y + e * 0.693359375f;
}

/* The row's winner of the race: the first index of the largest w_i / E_i, E_i = -ln U_i with
 * U_i = (mix32(mix32(i * golden ^ k1) ^ k2) >> 8 + 1/2) / 2^24, strictly inside (0, 1). */
static int64_t race(const float *w, int64_t n, uint64_t key) {
    const uint32_t k1 = (uint32_t)key, k2 = (uint32_t)(key >> 32);
    vf best_r = (vf){0} - 1.0f;
    vi best_at = (vi){0};
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        vu idx = (vu)(lane_ids + (int32_t)j);
        vu h = mix32(mix32(idx * 0x9e3779b9u ^ k1) ^ k2);
        vf u = __builtin_convertvector(h >> 8, vf) * 5.9604645e-8f + 2.9802322e-8f;
        vf r = loadv(w + j) / -log_unitv(u);
        vi more = (vi)(r > best_r);
        best_r = selectv(more, r, best_r);
        best_at = (more & (lane_ids + (int32_t)j)) | (~more & best_at);
    }
    float lane_r[VW];
    int32_t lane_at[VW];
    memcpy(lane_r, &best_r, sizeof lane_r);
    memcpy(lane_at, &best_at, sizeof lane_at);
    float best = -1.0f;
    int64_t at = 0;
    for (int i = 0; i < VW; i++) {
        if (lane_r[i] > best || (lane_r[i] == best && lane_at[i] < at)) {
            best = lane_r[i];
            at = lane_at[i];
        }
    }
    for (; j < n; j += VW) { /* the tail, one padded vector */
        float tail_w[VW] = {0};
        memcpy(tail_w, w + j, (size_t)(n - j) * sizeof *w);
        vu idx = (vu)(lane_ids + (int32_t)j);
        vu h = mix32(mix32(idx * 0x9e3779b9u ^ k1) ^ k2);
        vf u = __builtin_convertvector(h >> 8, vf) * 5.9604645e-8f + 2.9802322e-8f;
        vf r = loadv(tail_w) / -log_unitv(u);
        float tr[VW];
        memcpy(tr, &r, sizeof tr);
        for (int i = 0; i < n - j; i++)
            if (tr[i] > best) {
                best = tr[i];
                at = j + i;
            }
    }
    return at;
}

/* Bytes of scratch kvs_sample_f32 needs for rows of n tokens: a row's weights and candidates for
 * each thread the call may run on. */
int64_t kvs_sample_scratch_bytes(int64_t n) {
    return (int64_t)omp_get_max_threads() * n * 12;
}

/* out[r]: row r's sample with noise from key[r]; rows with temperature[r] <= 0 take their first
 * largest value. scratch: kvs_sample_scratch_bytes(n). Returns the number of rows that hold a NaN
 * (their out is not set). */
int64_t kvs_sample_f32(const float *x, int64_t rows, int64_t n, const float *temperature, const int64_t *top_k,
                       const float *top_p, const float *min_p, const int64_t *key, void *scratch, int64_t *out) {
    int64_t nan_rows = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : nan_rows) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * n;
        float *w = (float *)scratch + (int64_t)omp_get_thread_num() * n * 3;
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
        out[r] = race(w, n, (uint64_t)key[r]);
    }
    return nan_rows;
}
