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
 * major until the end, when each lane's row is written out divided by its sum. A key after a
 * row's position scores e^-87 of the maximum (as good as zero; key 0 is always visible). Work is
 * split over (prefill, KV head, tile of VW rows); K and V of a prefill's blocks stay in L2 between
 * the tiles that share them.
 *
 *   q, out:    [T, H, D] float32, heads and channels dense, token rows q_stride (out_stride) floats apart
 *   caches:    [num_blocks, block_size, Hkv, row] (float32 rows of D, or a RowFormat's)
 *   prefills:  starts[i] (first token row), counts[i] (new tokens), ctxs[i] (cached + new keys),
 *              tables [P, width] int64 block ids
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#if VW == 16
#define KC 16 /* keys per chunk: KC score accumulators */
#define DC 16 /* channels per value pass: DC output accumulators */
#else
#define KC 8
#define DC 8
#endif

typedef struct {
    int64_t prefill, kv_head, row0;
} Tile;

static inline __attribute__((always_inline)) void prefill_tile(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *table, int64_t start,
    int64_t count, int64_t ctx, int64_t kv_head, int64_t row0, float *out, int64_t out_stride, int64_t group,
    int64_t num_kv_heads, const int64_t d, int64_t bs, float scale, const RowFormat *f, float *work) {
    /* [d][VW] queries, [d][VW] outputs, [KC][VW] probabilities, [KC][d] the chunk's keys, [KC][d]
     * its values decoded, [2d] an int4 key block's parameters */
    float *qt = work, *ot = qt + d * VW, *pv = ot + d * VW, *kbuf = pv + KC * VW, *vbuf = kbuf + KC * d;
    float *kp = vbuf + KC * d;
    int64_t rows = count * group, lanes = rows - row0 < VW ? rows - row0 : VW, cached = ctx - count;
    int32_t pos[VW];
    for (int64_t r = 0; r < VW; r++) {
        int64_t row = row0 + (r < lanes ? r : lanes - 1), t = row / group, g = row % group;
        pos[r] = (int32_t)(cached + t);
        const float *qr = q + (start + t) * q_stride + (kv_head * group + g) * d;
        for (int64_t c = 0; c < d; c++) qt[c * VW + r] = qr[c] * scale;
    }
    memset(ot, 0, (size_t)(d * VW) * sizeof(float));
    vi posv;
    memcpy(&posv, pos, sizeof posv);
    vf m = (vf){0} - 1e30f, l = (vf){0};
    int64_t last = pos[VW - 1]; /* keys 0 .. last are visible to some lane */
    for (int64_t key0 = 0; key0 <= last; key0 += KC) {
        int64_t nk = last + 1 - key0 < KC ? last + 1 - key0 : KC;
        /* the chunk's rows (KC divides the block size, so a chunk sits in one block); rows past nk
         * are read but masked below. The keys are copied together so that, with d a constant, each
         * score FMA takes its key value at a fixed offset from one pointer */
        int64_t block = table[key0 / bs], row = (block * bs + key0 % bs) * num_kv_heads + kv_head;
        if (f->kind == ROW_INT4) int4_key_params(k_cache, block, bs, num_kv_heads, kv_head, d, f, kp);
        const float *vrow[KC];
        for (int64_t j = 0; j < KC; j++) {
            const float *kr = load_row(k_cache, row + j * num_kv_heads, d, f, f->kind == ROW_INT4 ? kp : NULL,
                                       kbuf + j * d);
            if (kr != kbuf + j * d) memcpy(kbuf + j * d, kr, (size_t)d * sizeof(float));
            /* values of the visible keys only: the value pass reads no others */
            if (j < nk) vrow[j] = load_row(v_cache, row + j * num_kv_heads, d, f, NULL, vbuf + j * d);
        }
        vf s[KC];
        UNROLL for (int j = 0; j < KC; j++) s[j] = (vf){0};
        for (int64_t c = 0; c < d; c++) {
            vf qc = loadv(qt + c * VW);
            UNROLL for (int j = 0; j < KC; j++) s[j] += qc * kbuf[j * d + c];
        }
        vf mx = m;
        UNROLL for (int j = 0; j < KC; j++) {
            vi visible = posv >= (int32_t)(key0 + j);
            if (j >= nk) visible = (vi){0};
            s[j] = selectv(visible, s[j], (vf){0} - 1e30f);
            mx = vmaxv(mx, s[j]);
        }
        vf corr = expv(m - mx), sum = (vf){0};
        UNROLL for (int j = 0; j < KC; j++) {
            vf p = expv(s[j] - mx);
            sum += p;
            memcpy(pv + j * VW, &p, sizeof p);
        }
        l = l * corr + sum;
        m = mx;
        for (int64_t c0 = 0; c0 < d; c0 += DC) {
            vf o[DC];
            UNROLL for (int t = 0; t < DC; t++) o[t] = loadv(ot + (c0 + t) * VW) * corr;
            for (int64_t j = 0; j < nk; j++) {
                vf p = loadv(pv + j * VW);
                const float *v = vrow[j] + c0;
                UNROLL for (int t = 0; t < DC; t++) o[t] += p * v[t];
            }
            UNROLL for (int t = 0; t < DC; t++) memcpy(ot + (c0 + t) * VW, &o[t], sizeof o[t]);
        }
    }
    float inv[VW];
    vf invv = (vf){0} + 1.0f;
    invv = invv / l;
    memcpy(inv, &invv, sizeof inv);
    for (int64_t r = 0; r < lanes; r++) {
        int64_t row = row0 + r, t = row / group, g = row % group;
        float *orow = out + (start + t) * out_stride + (kv_head * group + g) * d;
        for (int64_t c = 0; c < d; c++) orow[c] = ot[c * VW + r] * inv[r];
    }
}

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
    Tile *tiles = malloc((size_t)(num_tiles > 0 ? num_tiles : 1) * sizeof(Tile));
    if (tiles == NULL) return -1;
    int64_t n = 0;
    for (int64_t i = 0; i < num_prefills; i++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t r = 0; r < counts[i] * group; r += VW) tiles[n++] = (Tile){i, h, r};
#pragma omp parallel
    {
        float *work = aligned_alloc(64, (size_t)((2 * d + KC) * VW + 2 * KC * d + 2 * d) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tiles; t++) {
            int64_t i = tiles[t].prefill;
            /* a constant head size for each variant (see the key copy) */
#define TILE(D) prefill_tile(q, q_stride, k_cache, v_cache, tables + i * width, starts[i], counts[i], ctxs[i], \
                             tiles[t].kv_head, tiles[t].row0, out, out_stride, group, num_kv_heads, D, bs, scale, f, \
                             work)
            if (d == 64) TILE(64);
            else TILE(128);
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
