/* Paged prefill attention for CPU, K/V rows read from the block pool (causal, after a cached
 * prefix, grouped-query): float32 rows in place, or bf16 rows widened and quantized rows (kv_rows.h:
 * one-byte codes with a scale, int4) decoded a chunk of keys at a time.
 *
 * A prefill's rows are its (token, query head) pairs; those of one KV head are taken VW at a time,
 * one row per vector lane. With the rows in lanes, every step is vertical:
 *
 *   scores:   S[j] (lanes: rows) = sum over d of Qt[d] (lanes: rows) * K[j][d] (one key's value,
 *             broadcast), for a chunk of KC keys: KC accumulators, no horizontal sums
 *   softmax:  the online update per lane (running maximum m, sum l), one e^x per key of the chunk
 *   values:   Ot[d] (lanes: rows) += P[j] * V[j][d] (broadcast), in chunks of DC channels
 *
 * Qt (the tile's queries, scaled, channel-major) is built once per tile and Ot is kept channel-
 * major until the end, when each lane's row is written out divided by its sum (AVX2's one-vector
 * tiles keep Ot row-major instead: see value_rows). A key after a
 * row's position gets a probability of exactly 0 (softmax_chunk). Work is split over (prefill, KV
 * head, tile of VW rows, or of 2 VW where the step has tiles enough: see prefill_tile); K and V of
 * a prefill's blocks stay in L2 between the tiles that share them.
 *
 *   q, out:    [T, H, D] float32, heads and channels dense, token rows q_stride (out_stride) floats apart
 *   caches:    [num_blocks, block_size, Hkv, row] (float32 rows of D, or a RowFormat's)
 *   prefills:  starts[i] (first token row), counts[i] (new tokens), ctxs[i] (cached + new keys),
 *              tables [P, width] int64 block ids
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "kv_rows.h"

#if VW == 16
#define KC 16 /* keys per chunk: KC score accumulators */
#define DC 16 /* channels per value pass: DC output accumulators */
#else
#define KC 8
#define DC 8
#endif

typedef struct {
    int64_t prefill, kv_head, row0, nv; /* nv vectors of VW rows from row0 */
} Tile;

/* Rows into lanes and back, d channels (a multiple of VW): lanes[c * stride + r] = rows[r][c] * scale,
 * and rows[r][c] = lanes[c * stride + r] * inv[r] for the first n rows. With AVX-512, 16 x 16 blocks
 * transposed in registers (scalar, the strided stores of a 32-row tile's queries and outputs took
 * a fifth of a 512-token prefill's attention; vec.h's transpose16); the same products either way. */
static inline __attribute__((always_inline)) void to_lanes(const float *const *rows, float scale, float *lanes,
                                                           int64_t stride, int64_t d) {
#if VW == 16
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
        __m512 x[16];
        for (int r = 0; r < 16; r++) x[r] = _mm512_mul_ps(_mm512_loadu_ps(rows[r] + c0), sc);
        transpose16(x);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(lanes + (c0 + i) * stride, x[i]);
    }
#else
    for (int64_t r = 0; r < VW; r++)
        for (int64_t c = 0; c < d; c++) lanes[c * stride + r] = rows[r][c] * scale;
#endif
}

static inline __attribute__((always_inline)) void from_lanes(const float *lanes, int64_t stride, vf inv,
                                                             float *const *rows, int64_t n, int64_t d) {
#if VW == 16
    float iv[16];
    memcpy(iv, &inv, sizeof iv);
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
        __m512 x[16];
        for (int i = 0; i < 16; i++) x[i] = _mm512_loadu_ps(lanes + (c0 + i) * stride);
        transpose16(x);
        for (int64_t r = 0; r < n; r++) _mm512_storeu_ps(rows[r] + c0, _mm512_mul_ps(x[r], _mm512_set1_ps(iv[r])));
    }
#else
    float iv[VW];
    memcpy(iv, &inv, sizeof iv);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < d; c++) rows[r][c] = lanes[c * stride + r] * iv[r];
#endif
}

/* The next chunk's K and V rows, in any row format, pulled into L1 while this chunk computes. Only the
 * first tiles of a KV head ask: the later ones find the rows in L2. On a 2-core Zen 5 EPYC, four
 * chunks of 32 or 64 tokens over 288-400 keys ran 1.06-1.13x faster with it; one 512-token prompt
 * ran 0.95-0.98x with every tile prefetching, even with only the first two (and 2,048-4,096 keys
 * 0.94-0.97x with every tile prefetching where the rows pass 256 KB). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *k_cache, const void *v_cache, int64_t row,
                                                                int64_t num_kv_heads, int64_t d, const RowFormat *f) {
    int64_t bytes = head_row_bytes(f, d);
    for (int64_t j = 0; j < KC; j++) {
        int64_t at = (row + j * num_kv_heads) * bytes;
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch((const char *)k_cache + at + b, 0, 3);
            __builtin_prefetch((const char *)v_cache + at + b, 0, 3);
        }
    }
}

/* The online softmax over one chunk of KC scores s (lanes: rows): updates the lanes' running
 * maximum m and sum l, returns the old sums' correction in corr, and stores each key's
 * probabilities at p + j * nv * VW. A key after a lane's position takes no part in its maximum and
 * gets a probability of exactly 0, so a row's sums do not depend on the rows beside it (a tile's
 * last position decides how many keys the chunk computes); key 0 is visible to every row, so each
 * row's maximum is finite from the first chunk on. A chunk that every lane sees whole skips the
 * masks (masked 0): 1.02-1.05x faster over the kernel, the same bits. */
static inline __attribute__((always_inline)) void softmax_chunk(vf *s, vi posv, int64_t key0, int64_t nk, vf *m,
                                                                vf *l, vf *corr, float *p, const int nv,
                                                                const int masked) {
    vf t[KC];
    vi visible[KC];
    UNROLL for (int j = 0; j < KC; j++) { /* masked 0: every key of the chunk is visible to every lane */
        visible[j] = masked ? posv >= (int32_t)(key0 + j) : (vi){0} - 1;
        if (masked && j >= nk) visible[j] = (vi){0};
        t[j] = masked ? selectv(visible[j], s[j], (vf){0} - 1e30f) : s[j];
    }
    /* the maximum as a tree, not a chain of KC dependent steps (the same value either way) */
    UNROLL for (int w = KC / 2; w >= 1; w /= 2) UNROLL for (int j = 0; j < w; j++) t[j] = vmaxv(t[j], t[j + w]);
    vf mx = vmaxv(*m, t[0]);
    vf sum = (vf){0};
    *corr = expv(*m - mx);
    UNROLL for (int j = 0; j < KC; j++) {
        vf e = expv(s[j] - mx);
        if (masked) e = selectv(visible[j], e, (vf){0});
        sum += e;
        memcpy(p + j * nv * VW, &e, sizeof e);
    }
    *l = *l * *corr + sum;
    *m = mx;
}

/* softmax_chunk with the masks compiled out where the chunk is open to every lane. */
static inline __attribute__((always_inline)) void softmax_open_or_masked(vf *s, vi posv, int64_t key0, int64_t nk,
                                                                         vf *m, vf *l, vf *corr, float *p,
                                                                         const int nv, int open) {
    if (open)
        softmax_chunk(s, posv, key0, nk, m, l, corr, p, nv, 0);
    else
        softmax_chunk(s, posv, key0, nk, m, l, corr, p, nv, 1);
}

/* The value pass with the outputs row-major, for AVX2's one-vector tiles: ot [VW][d] holds row r's
 * sums O[r][c] with the channels in lanes, taken RT rows x CT vectors at a time. For each key, CT
 * value vectors are loaded and RT probabilities broadcast (pv [KC][VW] holds P[r][j] at j * VW + r)
 * for RT x CT multiply-adds. With the rows in lanes (the pass in prefill_tile), each key's DC
 * channels took DC broadcasts for DC multiply-adds, so the loads set the pace.
 *
 * The operations are those the rows-in-lanes pass compiles to: the first key's product added to
 * the old sum times the correction in one multiply-add (GCC contracts `o = ot * corr; o += p * x`
 * that way), then one multiply-add a key in order; written out here as intrinsics, so that the
 * compiler cannot choose. The bits are the same either way (the tiles-of-two test compares them).
 * Not inlined: inside prefill_tile, the register allocator spilled the sums (0.65-0.71x). The
 * scores (score_rows) likewise read each key where it lies instead of from a copy, through their own
 * function. On a 2-core Zen 3 EPYC (30 layers' attention, alternating with the build before, bits
 * compared): a 512-token prompt 1.08-1.15x faster, 4 chunks of 64 tokens after about 300 cached
 * 1.10-1.20x, 512 tokens after 3,584 cached 1.06-1.13x, fp32 and bf16 rows alike. */
#if VW == 8 && defined(__FMA__)
#define ROW_OUT 1
#define RT 4
#define CT 2
static inline __attribute__((always_inline)) void value_rows_d(float *ot, const float *pv, const float *const *vrow,
                                                                vf corr, int64_t nk, const int64_t d) {
    float cr[VW];
    memcpy(cr, &corr, sizeof cr);
    for (int64_t r0 = 0; r0 < VW; r0 += RT)
        for (int64_t c0 = 0; c0 < d; c0 += CT * VW) {
            __m256 o[RT][CT];
            UNROLL for (int i = 0; i < RT; i++)
                UNROLL for (int t = 0; t < CT; t++) {
                    __m256 first = _mm256_mul_ps(_mm256_set1_ps(pv[r0 + i]), _mm256_loadu_ps(vrow[0] + c0 + VW * t));
                    o[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(ot + (r0 + i) * d + c0 + VW * t),
                                              _mm256_set1_ps(cr[r0 + i]), first);
                }
            for (int64_t j = 1; j < nk; j++) {
                __m256 v[CT];
                UNROLL for (int t = 0; t < CT; t++) v[t] = _mm256_loadu_ps(vrow[j] + c0 + VW * t);
                UNROLL for (int i = 0; i < RT; i++) {
                    __m256 p = _mm256_set1_ps(pv[j * VW + r0 + i]);
                    UNROLL for (int t = 0; t < CT; t++) o[i][t] = _mm256_fmadd_ps(p, v[t], o[i][t]);
                }
            }
            UNROLL for (int i = 0; i < RT; i++)
                UNROLL for (int t = 0; t < CT; t++) _mm256_storeu_ps(ot + (r0 + i) * d + c0 + VW * t, o[i][t]);
        }
}

/* A chunk's KC scores of the tile's rows (lanes): the same multiply-adds, in the same order, as in
 * prefill_tile, each key's row read where it lies (float32) or from its decoded copy. */
static inline __attribute__((always_inline)) void score_rows_d(const float *qt, const float *const *krow,
                                                                const int64_t d, vf *out) {
    __m256 s[KC];
    UNROLL for (int j = 0; j < KC; j++) s[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        __m256 qc = _mm256_loadu_ps(qt + c * VW);
        UNROLL for (int j = 0; j < KC; j++) s[j] = _mm256_fmadd_ps(qc, _mm256_broadcast_ss(krow[j] + c), s[j]);
    }
    UNROLL for (int j = 0; j < KC; j++) memcpy(out + j, &s[j], sizeof s[j]);
}

/* Each head size a copy of its own (its loops unrolled), and neither inlined into prefill_tile. */
static __attribute__((noinline)) void value_rows(float *ot, const float *pv, const float *const *vrow, vf corr,
                                                 int64_t nk, int64_t d) {
    if (d == 64) value_rows_d(ot, pv, vrow, corr, nk, 64);
    else value_rows_d(ot, pv, vrow, corr, nk, 128);
}

static __attribute__((noinline)) void score_rows(const float *qt, const float *const *krow, int64_t d, vf *out) {
    if (d == 64) score_rows_d(qt, krow, 64, out);
    else score_rows_d(qt, krow, 128, out);
}
#else
#define ROW_OUT 0
static void score_rows(const float *qt, const float *const *krow, int64_t d, vf *out) {
    (void)qt, (void)krow, (void)d, (void)out;
}
static void value_rows(float *ot, const float *pv, const float *const *vrow, vf corr, int64_t nk, int64_t d) {
    (void)ot, (void)pv, (void)vrow, (void)corr, (void)nk, (void)d;
}
#endif

/* nv (1 or 2, a constant in each copy) vectors of rows share every key and value they read: with
 * two, each broadcast key or value element feeds two FMAs instead of one. The scores of a chunk are
 * then summed KC / 2 keys at a time (KC accumulators either way), and the value pass takes DC / 2
 * channels at a time; every row's sums run in the same order either way, so its bits do not depend
 * on its tile. On a 2-core Zen 5 EPYC (30 layers' attention, K/V from memory, alternating with the
 * one-vector tiles): a 512-token prompt and 288 tokens after a cached prefix of 312 ran 1.15-1.20x
 * faster, four chunks of 32 or 64 tokens 1.15-1.17x. */
static inline __attribute__((always_inline)) void prefill_tile(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *table, int64_t start,
    int64_t count, int64_t ctx, int64_t kv_head, int64_t row0, float *out, int64_t out_stride, int64_t group,
    int64_t num_kv_heads, const int64_t d, int64_t bs, float scale, const RowFormat *f, float *work, const int nv) {
    /* [d][nv][VW] queries, [d][nv][VW] outputs, [KC][nv][VW] probabilities, [nv][KC][VW] scores,
     * [KC][d] the chunk's keys, [KC][d] its values decoded, [2d] an int4 key block's parameters */
    float *qt = work, *ot = qt + d * nv * VW, *pv = ot + d * nv * VW, *sv = pv + KC * nv * VW;
    float *kbuf = sv + KC * nv * VW, *vbuf = kbuf + KC * d, *kp = vbuf + KC * d;
    const int dc = DC / nv; /* channels a value pass */
    int64_t rows = count * group, cached = ctx - count;
    int32_t pos[2][VW];
    for (int v = 0; v < nv; v++) {
        const float *qr[VW];
        for (int64_t r = 0; r < VW; r++) {
            int64_t row = row0 + v * VW + r;
            if (row >= rows) row = rows - 1;
            int64_t t = row / group, g = row % group;
            pos[v][r] = (int32_t)(cached + t);
            qr[r] = q + (start + t) * q_stride + (kv_head * group + g) * d;
        }
        to_lanes(qr, scale, qt + v * VW, nv * VW, d);
    }
    memset(ot, 0, (size_t)(d * nv * VW) * sizeof(float));
    vi posv[2];
    vf m[2], l[2], corr[2];
    for (int v = 0; v < nv; v++) {
        memcpy(&posv[v], pos[v], sizeof posv[v]);
        m[v] = (vf){0} - 1e30f;
        l[v] = (vf){0};
    }
    int64_t last = pos[nv - 1][VW - 1]; /* keys 0 .. last are visible to some lane */
    for (int64_t key0 = 0; key0 <= last; key0 += KC) {
        int64_t nk = last + 1 - key0 < KC ? last + 1 - key0 : KC;
        int open = key0 + KC - 1 <= pos[0][0]; /* every key visible to every lane (row0's is the least) */
        /* the chunk's rows (KC divides the block size, so a chunk sits in one block); rows past nk
         * are read but masked below. The keys are copied together so that, with d a constant, each
         * score FMA takes its key value at a fixed offset from one pointer */
        int64_t block = table[key0 / bs], row = (block * bs + key0 % bs) * num_kv_heads + kv_head;
        if (f->kind == ROW_INT4) int4_key_params(k_cache, block, bs, num_kv_heads, kv_head, d, f, kp);
        if (row0 < 2 * nv * VW && key0 + KC <= last) /* the first tiles of a KV head: its K/V come from memory */
            prefetch_rows(k_cache, v_cache, (table[(key0 + KC) / bs] * bs + (key0 + KC) % bs) * num_kv_heads + kv_head,
                          num_kv_heads, d, f);
        const float *vrow[KC], *krow[KC];
        for (int64_t j = 0; j < KC; j++) {
            const float *kr = load_row(k_cache, row + j * num_kv_heads, d, f, f->kind == ROW_INT4 ? kp : NULL,
                                       kbuf + j * d);
            krow[j] = kr;
            if (!(ROW_OUT && nv == 1) && kr != kbuf + j * d) memcpy(kbuf + j * d, kr, (size_t)d * sizeof(float));
            /* values of the visible keys only: the value pass reads no others */
            if (j < nk) vrow[j] = load_row(v_cache, row + j * num_kv_heads, d, f, NULL, vbuf + j * d);
        }
        if (ROW_OUT && nv == 1) {
            vf s[KC];
            score_rows(qt, krow, d, s);
            softmax_open_or_masked(s, posv[0], key0, nk, &m[0], &l[0], &corr[0], pv, 1, open);
        } else if (nv == 1) { /* KC sums in registers through the softmax */
            vf s[KC];
            UNROLL for (int j = 0; j < KC; j++) s[j] = (vf){0};
            for (int64_t c = 0; c < d; c++) {
                vf qc = loadv(qt + c * VW);
                UNROLL for (int j = 0; j < KC; j++) s[j] += qc * kbuf[j * d + c];
            }
            softmax_open_or_masked(s, posv[0], key0, nk, &m[0], &l[0], &corr[0], pv, 1, open);
        } else { /* KC / 2 keys at a time against both vectors, through the scores' buffer */
            UNROLL for (int j0 = 0; j0 < KC; j0 += KC / 2) {
                vf s0[KC / 2], s1[KC / 2];
                UNROLL for (int j = 0; j < KC / 2; j++) s0[j] = s1[j] = (vf){0};
                for (int64_t c = 0; c < d; c++) {
                    vf q0 = loadv(qt + 2 * c * VW), q1 = loadv(qt + (2 * c + 1) * VW);
                    UNROLL for (int j = 0; j < KC / 2; j++) {
                        float kv = kbuf[(j0 + j) * d + c];
                        s0[j] += q0 * kv;
                        s1[j] += q1 * kv;
                    }
                }
                UNROLL for (int j = 0; j < KC / 2; j++) {
                    memcpy(sv + (j0 + j) * VW, &s0[j], sizeof s0[j]);
                    memcpy(sv + (KC + j0 + j) * VW, &s1[j], sizeof s1[j]);
                }
            }
            for (int v = 0; v < 2; v++) {
                vf s[KC];
                UNROLL for (int j = 0; j < KC; j++) s[j] = loadv(sv + (v * KC + j) * VW);
                softmax_open_or_masked(s, posv[v], key0, nk, &m[v], &l[v], &corr[v], pv + v * VW, 2, open);
            }
        }
        if (ROW_OUT && nv == 1) {
            value_rows(ot, pv, vrow, corr[0], nk, d);
            continue;
        }
        for (int64_t c0 = 0; c0 < d; c0 += dc) {
            vf o[2][DC];
            UNROLL for (int v = 0; v < nv; v++)
                UNROLL for (int t = 0; t < dc; t++) o[v][t] = loadv(ot + ((c0 + t) * nv + v) * VW) * corr[v];
            for (int64_t j = 0; j < nk; j++) {
                vf p[2];
                UNROLL for (int v = 0; v < nv; v++) p[v] = loadv(pv + (j * nv + v) * VW);
                const float *vr = vrow[j] + c0;
                UNROLL for (int t = 0; t < dc; t++) {
                    float x = vr[t];
                    UNROLL for (int v = 0; v < nv; v++) o[v][t] += p[v] * x;
                }
            }
            UNROLL for (int v = 0; v < nv; v++)
                UNROLL for (int t = 0; t < dc; t++) memcpy(ot + ((c0 + t) * nv + v) * VW, &o[v][t], sizeof o[v][t]);
        }
    }
    if (ROW_OUT && nv == 1) {
        float iv[VW];
        vf inv = (vf){0} + 1.0f / l[0];
        memcpy(iv, &inv, sizeof iv);
        for (int64_t r = 0; r < VW && row0 + r < rows; r++) {
            int64_t row = row0 + r, t = row / group, g = row % group;
            float *o = out + (start + t) * out_stride + (kv_head * group + g) * d;
            for (int64_t c = 0; c < d; c++) o[c] = ot[r * d + c] * iv[r];
        }
        return;
    }
    for (int v = 0; v < nv; v++) {
        float *orow[VW];
        int64_t lanes = 0;
        for (; lanes < VW && row0 + v * VW + lanes < rows; lanes++) {
            int64_t row = row0 + v * VW + lanes, t = row / group, g = row % group;
            orow[lanes] = out + (start + t) * out_stride + (kv_head * group + g) * d;
        }
        from_lanes(ot + v * VW, nv * VW, (vf){0} + 1.0f / l[v], orow, lanes, d);
    }
}

#define PAIRS_MIN_TILES 4
/* with AVX2 (16 registers, 8-lane tiles) the pairs ran 0.87-0.93x on the same Zen 5 host: off there */
static int pairs_on = VW == 16;
static int64_t pair_tiles; /* run since load, for tests */
int kvs_prefill_set_pairs(int on) { /* tests and benchmarks; returns the setting before */
    int was = pairs_on;
    pairs_on = on;
    return was;
}
int64_t kvs_prefill_pair_tiles(void) { return __atomic_load_n(&pair_tiles, __ATOMIC_RELAXED); }

/* Whether paged_prefill takes these shapes: head size 64 or 128, blocks a whole number of key chunks. */
int kvs_paged_prefill_takes(int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs) {
    return (d == 64 || d == 128) && bs % KC == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0;
}

static int paged_prefill(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                         const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride, int64_t num_heads,
                         int64_t num_kv_heads, int64_t d, int64_t bs, float scale, const RowFormat *f) {
    if (!kvs_paged_prefill_takes(num_heads, num_kv_heads, d, bs)) return -1;
    int64_t group = num_heads / num_kv_heads, num_tiles = 0;
    for (int64_t i = 0; i < num_prefills; i++) num_tiles += num_kv_heads * ((counts[i] * group + VW - 1) / VW);
    /* pairs only where the threads still get several tiles each: with few tiles, one more on one
     * thread costs more than the pairs save */
    int pairs = pairs_on && num_tiles >= PAIRS_MIN_TILES * omp_get_max_threads();
    int64_t span = pairs ? 2 * VW : VW;
    if (pairs) {
        num_tiles = 0;
        for (int64_t i = 0; i < num_prefills; i++) num_tiles += num_kv_heads * ((counts[i] * group + span - 1) / span);
    }
    Tile *tiles = malloc((size_t)(num_tiles > 0 ? num_tiles : 1) * sizeof(Tile));
    if (tiles == NULL) return -1;
    int64_t n = 0, paired = 0;
    for (int64_t i = 0; i < num_prefills; i++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t r = 0; r < counts[i] * group; r += span) {
                int nv = pairs && counts[i] * group - r > VW ? 2 : 1;
                tiles[n++] = (Tile){i, h, r, nv};
                paired += nv == 2;
            }
    __atomic_fetch_add(&pair_tiles, paired, __ATOMIC_RELAXED);
#pragma omp parallel
    {
        float *work = aligned_alloc(64, (size_t)((4 * d + 4 * KC) * VW + 2 * KC * d + 2 * d) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tiles; t++) {
            int64_t i = tiles[t].prefill;
            /* a constant head size and row count for each variant (see the key copy) */
#define TILE(D, NV) prefill_tile(q, q_stride, k_cache, v_cache, tables + i * width, starts[i], counts[i], ctxs[i], \
                                 tiles[t].kv_head, tiles[t].row0, out, out_stride, group, num_kv_heads, D, bs, scale, \
                                 f, work, NV)
            if (d == 64) {
                if (tiles[t].nv == 2) TILE(64, 2);
                else TILE(64, 1);
            } else {
                if (tiles[t].nv == 2) TILE(128, 2);
                else TILE(128, 1);
            }
#undef TILE
        }
        free(work);
    }
    free(tiles);
    return 0;
}

/* 0 when done; -1 when the shapes are not ones this kernel takes (the caller falls back). */
int kvs_paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                          const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride, int64_t num_heads,
                          int64_t num_kv_heads, int64_t d, int64_t bs, float scale) {
    RowFormat f = {ROW_F32, NULL, 0, 0, CODES_TABLE};
    return paged_prefill(q, q_stride, k_cache, v_cache, tables, width, starts, counts, ctxs, num_prefills, out,
                         out_stride, num_heads, num_kv_heads, d, bs, scale, &f);
}

/* bf16 rows, widened as they are read; q and out float32 as above. */
int kvs_paged_prefill_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                           const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride,
                           int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, float scale) {
    RowFormat f = {ROW_BF16, NULL, 0, 0, CODES_TABLE};
    return paged_prefill(q, q_stride, k_cache, v_cache, tables, width, starts, counts, ctxs, num_prefills, out,
                         out_stride, num_heads, num_kv_heads, d, bs, scale, &f);
}

/* Quantized rows: with extra > 0 int4 (lut: each step code's step, v_group channels a value scale),
 * else one-byte codes with an fp16 scale (lut: each code's value). */
int kvs_paged_prefill_quantized(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                                const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                                const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride,
                                int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, float scale,
                                const float *lut, int64_t extra, int64_t v_group) {
    RowFormat f = extra > 0 ? (RowFormat){ROW_INT4, lut, extra, v_group, CODES_TABLE}
                            : (RowFormat){ROW_CODES, lut, 0, 0, codes_kind(lut)};
    return paged_prefill(q, q_stride, k_cache, v_cache, tables, width, starts, counts, ctxs, num_prefills, out,
                         out_stride, num_heads, num_kv_heads, d, bs, scale, &f);
}
