/* The greedy head's int8 copy (csrc/greedy_head.c bounds and picks from what it gives): the copy
 * made at load, and each step's approximate logits, x times the copy, on AVX-512 VNNI, AMX tiles or
 * AVX2. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

int kvs_amx_active(void);

/* The int8 copy of the head: each row j scaled by s_j = max |w_j| / 127 and rounded, q_j = round(w_j /
 * s_j) (kvs_int8_head_pack makes it, with s_j, sum_k q_jk and |e_j| = |w_j - s_j q_j|), packed in tiles of
 * Q_COLS columns: qp[t][kq][c][4] = q[Q_COLS t + c, 4 kq .. 4 kq + 3], a tile's k quad one 256-byte
 * line run, its four vectors Q_GROUP columns each (AVX2 builds: tiles of 16 columns, below).
 *
 * Each row of x is taken to 16 bits, qx = round(x / s_x), and split in two bytes, qx = 256 hi + lo
 * with lo in -128 .. 127 (hi = floor((qx + 128) / 256), within +-127 for |qx| <= 32639); the
 * unsigned-by-signed byte dot products (four products a lane, exact in int32) take hi + 128 and lo
 * + 128, and 128 sum_k q_j comes off each sum, so that sum_k qx q_j = 256 sum_k hi q_j + sum_k lo q_j,
 * exactly. The scale: s_x = max(max |x| / 32639, t / 127), t the (hi_dims + 1)-th largest |x_k|
 * (the caller's hi_dims: 8 for a float32 model's head), or max |x| / 32639 alone (hi_dims none).
 * SmolLM2's final hidden rows hold a few values 10-20x the rest; with s_x = max |x| / 32767 every
 * quad of k had a high byte to multiply, two dot products a quad where a bf16 copy takes one a
 * pair. With t, all but the hi_dims largest values fit in lo, so hi is zero outside a few quads:
 * the vector kernel multiplies lo over every quad and hi over only the quads where a row of the
 * block has one (int8_tile), nearly half the products. The coarser scale widens |e_x|, which the
 * bound takes as it comes: over 418 rows of SmolLM2 chat and random-token decoding (float64 model
 * of the bound), 15.8 tokens a row left to check on average against 5.2 (6 and 3 at the median),
 * the hi quads of a block of 6 rows 20 of 144 on average. A float32 model's tokens left cost a row
 * of the head each; a bf16 model's a group's products, and on rows without outliers (random ones,
 * which its load-time timing uses) 8 bits left so many that the copy lost, so it keeps 16 bits
 * (int8_tile_16, one pass for both bytes). */
#define Q_GROUP 16
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define Q_COLS 64
#else
#define Q_COLS 16
#endif
#define A_ROWS 8 /* rows of x in one AMX tile pass (their high and low bytes: 16 tile rows) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_INT8_HEAD 1
#define Q_ROWS 6 /* rows a block: 6 rows x 4 vectors = 24 sums of lo */
#define QH_ROWS 3 /* rows a pass over the hi quads: 3 rows x 4 vectors + 4 sums of q + 4 weights */
#ifndef Q_AHEAD
#define Q_AHEAD 6144
#endif

/* acc + the unsigned bytes of a times the signed bytes of b, four products a lane: the instruction
 * itself, so that the sums stay in their registers (through the intrinsic, gcc 12 copied the half of
 * them held in zmm16-31 to other registers and back on every k quad), b from a register (as a memory
 * operand, each weight vector was loaded again for every row). */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* A block's share of the next tile (see int8_tile): lines [0, lines) from `at`, asked for into L2
 * evenly over the kq quads of a pass, as many by quad kk as (kk + 1) lines / kq. */
typedef struct {
    const char *at;
    int64_t lines;
} NextShare;

static inline __attribute__((always_inline)) void share_upto(const NextShare *next, int64_t kk, int64_t kq,
                                                             int64_t *issued) {
    for (int64_t upto = (kk + 1) * next->lines / kq; *issued < upto; ++*issued)
        _mm_prefetch(next->at + *issued * 64, _MM_HINT_T1);
}

/* Block b of `blocks` against tile t of `tiles`: its share of tile t + 1's lines; none past the last
 * tile, nor where one block takes every row (see int8_tile). */
static inline NextShare next_share(const int8_t *qp, int64_t kq, int64_t t, int64_t tiles, int64_t b,
                                   int64_t blocks) {
    int64_t lines = kq * 4 * Q_COLS / 64, first = b * lines / blocks;
    NextShare s = {NULL, 0};
    if (t + 1 < tiles && blocks > 1) {
        s.at = (const char *)(qp + (t + 1) * kq * 4 * Q_COLS) + first * 64;
        s.lines = (b + 1) * lines / blocks - first;
    }
    return s;
}

/* Vector j of a row's sums, sum_k hi q_j (high) and sum_k lo q_j (low), combined and scaled into
 * approx (the columns past n left alone). */
static inline __attribute__((always_inline)) void q_emit_at(__m512i high, __m512i low, const float *scale, float sx,
                                                            int64_t c0, int64_t n, float *y) {
    if (c0 >= n) return;
    __mmask16 mask = c0 + Q_GROUP <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c0)) - 1);
    /* each exact in float32 to K = 1,032 */
    __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(low));
    __m512 a = _mm512_mul_ps(d, _mm512_mul_ps(_mm512_loadu_ps(scale + c0), _mm512_set1_ps(sx)));
    _mm512_mask_storeu_ps(y + c0, mask, a);
}

/* 128 sum of the k quad's q for columns c0 .. c0 + 15 (one of a sum's offsets) */
static inline __attribute__((always_inline)) __m512i q_offset(const int32_t *rowsum, int64_t c0) {
    return _mm512_slli_epi32(_mm512_loadu_si512(rowsum + c0), 7);
}

/* Rows i0 .. i0 + R - 1 of a block (their hi quads at hi, kq a row) against the tile at w over its
 * nu hi quads uq: sum_k hi q, added to each row's sums of lo at low [Q_ROWS][Q_COLS] (offset
 * taken off), emitted into approx from row i0's (sx: its scale). A quad where a row has no hi holds
 * 128s for it, which the quads' own sum of q (times 128) takes off again. */
static inline __attribute__((always_inline)) void int8_hi_pass(const uint32_t *hi, int64_t kq, const int32_t *uq,
                                                               int64_t nu, const int8_t *w, const int32_t *low,
                                                               const float *scale, const float *sx, int64_t c,
                                                               int64_t n, int R, float *approx) {
    __m512i h[QH_ROWS][4], sum[4];
    const __m512i ones = _mm512_set1_epi8(1);
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        sum[v] = _mm512_setzero_si512();
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) h[i][v] = sum[v];
    }
    for (int64_t u = 0; u < nu; u++) {
        const int8_t *wk = w + uq[u] * 4 * Q_COLS;
        __m512i wv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            wv[v] = _mm512_loadu_si512(wk + 64 * v);
            sum[v] = dpbusd(sum[v], ones, wv[v]);
        }
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) {
            __m512i b = _mm512_set1_epi32((int)hi[i * kq + uq[u]]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) h[i][v] = dpbusd(h[i][v], b, wv[v]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            q_emit_at(_mm512_sub_epi32(h[i][v], _mm512_slli_epi32(sum[v], 7)),
                      _mm512_load_si512(low + i * Q_COLS + v * Q_GROUP), scale, sx[i], c + v * Q_GROUP, n,
                      approx + i * n);
}

/* The block of R rows (their lo quads at lo and hi quads at hi, kq a row; uq: the block's nu hi
 * quads) against tile t: their approximate logits into approx [rows, n], from the block's first
 * row's. First lo over every quad (R x 4 sums), then hi over the block's hi quads, QH_ROWS rows a
 * pass, the tile's lines by then in L1 or L2. ahead: the lines Q_AHEAD bytes ahead are asked for,
 * into L2 (the first block against a tile). next: this block's share of the next tile's lines (where
 * the rows take more than one block), asked for into L2 as its quads go by, so that memory streams
 * the next tile while the later blocks multiply this one from L2; with the first block alone asking,
 * memory had idled through them. On a 2-core Zen 4 EPYC (SmolLM2's head, caches flushed, medians of
 * eleven, alternating) the approximate logits took 1.12-1.58x less time at 7-8 rows, 1.06-1.24x at
 * 12-16 and 1.04-1.12x at 24-32 (16-bit rows, a bf16 model's other way: 1.04-1.21x at 4-24), the
 * head's share of a decode step 0.3 ms less at batch 8 and 0.5 at 32 (fp32, medians of six). A
 * share of the next tile where one block takes every row ran 0.81x at one row. The first block
 * still asks Q_AHEAD ahead as well, which after a thread's first tile repeats lines already asked
 * for: without it anywhere, 0.87-1.08x at 8-32 rows, no better. The AVX2 kernel,
 * whose 16-bit products set its pace, ran 0.66-0.86x with the same shares, and keeps without. */
static inline __attribute__((always_inline)) void int8_tile(const uint32_t *hi, const uint32_t *lo, int64_t kq,
                                                            const int32_t *uq, int64_t nu, const int8_t *qp,
                                                            const float *scale, const int32_t *rowsum,
                                                            const float *sx, int64_t t, int64_t n, int R, int ahead,
                                                            NextShare next, float *approx) {
    __m512i acc[Q_ROWS][4];
    int64_t issued = 0;
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_si512();
    const int8_t *w = qp + t * kq * 4 * Q_COLS;
    for (int64_t kk = 0; kk < kq; kk++) {
        const int8_t *wk = w + kk * 4 * Q_COLS;
        if (ahead)
            for (int b = 0; b < 4 * Q_COLS; b += 64) _mm_prefetch((const char *)wk + Q_AHEAD + b, _MM_HINT_T1);
        if (next.at) share_upto(&next, kk, kq, &issued);
        __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64), w2 = _mm512_loadu_si512(wk + 128),
                w3 = _mm512_loadu_si512(wk + 192);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            __m512i b = _mm512_set1_epi32((int)lo[i * kq + kk]);
            acc[i][0] = dpbusd(acc[i][0], b, w0), acc[i][1] = dpbusd(acc[i][1], b, w1);
            acc[i][2] = dpbusd(acc[i][2], b, w2), acc[i][3] = dpbusd(acc[i][3], b, w3);
        }
    }
    int64_t c = t * Q_COLS;
    int32_t low[Q_ROWS * Q_COLS] __attribute__((aligned(64)));
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            _mm512_store_si512(low + i * Q_COLS + v * Q_GROUP,
                               _mm512_sub_epi32(acc[i][v], q_offset(rowsum, c + v * Q_GROUP)));
    if (R > QH_ROWS) { /* R is a constant here, so each pass's rows are too */
        int8_hi_pass(hi, kq, uq, nu, w, low, scale, sx, c, n, QH_ROWS, approx);
        int8_hi_pass(hi + QH_ROWS * kq, kq, uq, nu, w, low + QH_ROWS * Q_COLS, scale, sx + QH_ROWS, c, n,
                     R - QH_ROWS, approx + QH_ROWS * n);
    } else {
        int8_hi_pass(hi, kq, uq, nu, w, low, scale, sx, c, n, R, approx);
    }
}

/* Rows r0 .. r0 + R - 1 (R <= QH_ROWS) whose every quad has a hi byte (hi_dims none: every value at 16
 * bits) against tile t: both sums in one pass over the tile, 3 rows x 4 vectors x (hi, lo) = 24 of
 * them, each weight vector loaded once for both. ahead and next as in int8_tile (blocks of QH_ROWS
 * rows). */
static inline __attribute__((always_inline)) void int8_tile_16(const uint32_t *hi, const uint32_t *lo, int64_t kq,
                                                               const int8_t *qp, const float *scale,
                                                               const int32_t *rowsum, const float *sx, int64_t t,
                                                               int64_t n, int R, int ahead, NextShare next,
                                                               float *approx) {
    __m512i h[QH_ROWS][4], l[QH_ROWS][4];
    int64_t issued = 0;
#pragma GCC unroll 3
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) h[i][v] = l[i][v] = _mm512_setzero_si512();
    const int8_t *w = qp + t * kq * 4 * Q_COLS;
    for (int64_t kk = 0; kk < kq; kk++) {
        const int8_t *wk = w + kk * 4 * Q_COLS;
        if (ahead)
            for (int b = 0; b < 4 * Q_COLS; b += 64) _mm_prefetch((const char *)wk + Q_AHEAD + b, _MM_HINT_T1);
        if (next.at) share_upto(&next, kk, kq, &issued);
        __m512i wv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) wv[v] = _mm512_loadu_si512(wk + 64 * v);
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) {
            __m512i bh = _mm512_set1_epi32((int)hi[i * kq + kk]), bl = _mm512_set1_epi32((int)lo[i * kq + kk]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) h[i][v] = dpbusd(h[i][v], bh, wv[v]), l[i][v] = dpbusd(l[i][v], bl, wv[v]);
        }
    }
#pragma GCC unroll 3
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            int64_t c0 = t * Q_COLS + v * Q_GROUP;
            __m512i offset = q_offset(rowsum, c0);
            q_emit_at(_mm512_sub_epi32(h[i][v], offset), _mm512_sub_epi32(l[i][v], offset), scale, sx[i], c0, n,
                      approx + i * n);
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
/* The same sums on AMX tiles (TDPBUSD: unsigned bytes of A by signed bytes of B, four products a
 * lane, exact in int32, as the VNNI instruction), so the same bits. A column tile's k quads are
 * already B tiles: 16 quads of 16 columns, one 64-byte row each, 256 bytes apart. An A tile holds
 * up to A_ROWS rows of x for 16 quads, their high bytes in tile rows 0 .. R - 1 and their low bytes
 * in R .. 2R - 1, so one product gives both sums of all R rows for 16 columns: four products a k
 * block of 64 for a column tile. The vector kernel's 24 multiply-adds a k quad for 3 rows set its
 * pace from a few rows on; the tiles' products stay far below the time the weights take to arrive
 * (see AMX_MIN_ROWS). Only where k is whole blocks of 64 (else the vector kernel). */
#define HAVE_AMX_INT8_HEAD 1
/* Weights prefetched into L2 this far past a k block's tile loads and products (the next k block,
 * or the next column tile's first), as csrc/amx_gemm.c does for its bf16 tiles. */
#define Q_AMX_AHEAD 4096
/* Fewer rows take the vector kernel: on a 2-core Xeon of the 480 MB-L3 class (SmolLM2's head,
 * caches flushed, medians of ten, alternating) the tiles took 1.09-1.14x its time at one row,
 * 1.0-1.06x at two, 1.05x at three, 0.97-1.0x at four, 0.90x at six, 0.78-0.81x at 8, 0.65-0.67x
 * at 16 and 0.50-0.54x at 32. A prefetch distance of 8 or 16 KB and a guided schedule left the
 * one-row time within 4%. */
#define AMX_MIN_ROWS 4

static void amx_config(int R) {
    uint8_t a = (uint8_t)(2 * R); /* 0: A; 1-3: B; 4-7: C, a 16-column group each */
    load_tile_rows((const uint8_t[8]){a, 16, 16, 16, a, a, a, a});
}

/* R rows (a: the A tiles' rows, [2R][kq] quads, high then low) against column tile t: their
 * approximate logits into approx [rows, n] from the first's (sx: their scales). kq a multiple of 16;
 * out: room for [2R][64] sums. */
static void amx_int8_tile(const uint32_t *a, int64_t kq, const int8_t *qp, const float *scale,
                          const int32_t *rowsum, const float *sx, int64_t t, int64_t n, int R, int ahead,
                          int32_t *out, float *approx) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int8_t *w = qp + t * kq * 4 * Q_COLS;
    for (int64_t kb = 0; kb < kq / 16; kb++) {
        const int8_t *wk = w + kb * 16 * 4 * Q_COLS;
        _tile_loadd(0, a + kb * 16, kq * 4);
        _tile_loadd(1, wk, 4 * Q_COLS);
        _tile_loadd(2, wk + 64, 4 * Q_COLS);
        _tile_loadd(3, wk + 128, 4 * Q_COLS);
        _tile_dpbusd(4, 0, 1);
        _tile_dpbusd(5, 0, 2);
        _tile_dpbusd(6, 0, 3);
        _tile_loadd(1, wk + 192, 4 * Q_COLS);
        _tile_dpbusd(7, 0, 1);
        if (ahead)
            for (int b = 0; b < 16 * 4 * Q_COLS; b += 64) _mm_prefetch((const char *)wk + Q_AMX_AHEAD + b, _MM_HINT_T1);
    }
    _tile_stored(4, out, 4 * Q_COLS);
    _tile_stored(5, out + 16, 4 * Q_COLS);
    _tile_stored(6, out + 32, 4 * Q_COLS);
    _tile_stored(7, out + 48, 4 * Q_COLS);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) {
            int64_t c0 = t * Q_COLS + j * Q_GROUP;
            __m512i offset = q_offset(rowsum, c0);
            q_emit_at(_mm512_sub_epi32(_mm512_loadu_si512(out + i * Q_COLS + j * Q_GROUP), offset),
                      _mm512_sub_epi32(_mm512_loadu_si512(out + (R + i) * Q_COLS + j * Q_GROUP), offset), scale,
                      sx[i], c0, n, approx + i * n);
        }
}
#else
#define HAVE_AMX_INT8_HEAD 0
#endif
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 cores have no byte dot products whose sums stay exact (vpmaddubsw saturates its pairs at 16
 * bits), so there the copy's bytes are widened to 16 bits as they are loaded (vpmovsxbw) and
 * multiplied by x's 16-bit values themselves (vpmaddwd: two 16-bit products summed into each 32-bit
 * lane, exactly): 16 products and an add where float32 takes two fused multiply-adds, from a quarter
 * of the bytes. A 16-byte load of a tile's k quad holds four columns' four k, so each lane of a sum
 * keeps one column's k0 k1 or its k2 k3 products; the two lanes are converted to float32 and added
 * at the end. A lane stays exact in int32 while 2 kq 127 |qx| < 2^31, so x's range shrinks from
 * 32767 for k past 1,032 (the bound takes |e_x| as it comes). Tiles of 16 columns (Q_COLS: four
 * groups of four, a k quad one 64-byte line, a tile's lines in a row) and rows in blocks of up to
 * QA_ROWS, so that a block's 8 sums, a weight vector and x's values fit the 16 vector registers;
 * the first block streams a tile's lines from memory, the others read them from L1. Tiles of 64
 * columns, read as four chunks of 16, had taken 1.4-1.5 ms at one row with the head in memory
 * (SmolLM2, 2-core Zen 4 EPYC without AVX-512): 64 bytes of every 256 in the first pass. */
#include <immintrin.h>
#define HAVE_INT8_HEAD 2
#define HAVE_AMX_INT8_HEAD 0
#define QA_ROWS 2
#define QA_GROUPS 4 /* four-column groups a tile */
#ifndef Q_AHEAD
#define Q_AHEAD 6144
#endif

/* 8 columns' sums from two groups' lanes (a: columns c .. c + 3, b: c + 4 .. c + 7; each column's
 * k0 k1 and k2 k3 lanes side by side), scaled, into y from column c (the columns past n left
 * alone). */
static inline __attribute__((always_inline)) void qa_emit(__m256i a, __m256i b, const float *scale, float sx,
                                                          int64_t c, int64_t n, float *y) {
    if (c >= n) return;
    /* hadd: [c0 c1 c4 c5 | c2 c3 c6 c7]; the permute puts the 64-bit pairs in column order */
    __m256 d = _mm256_hadd_ps(_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b));
    d = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(d), 0xD8));
    __m256 v = _mm256_mul_ps(d, _mm256_mul_ps(_mm256_loadu_ps(scale + c), _mm256_set1_ps(sx)));
    if (c + 8 <= n) {
        _mm256_storeu_ps(y + c, v);
    } else {
        float tail[8];
        _mm256_storeu_ps(tail, v);
        memcpy(y + c, tail, (size_t)(n - c) * sizeof *tail);
    }
}

/* Rows r0 .. r0 + R - 1 (their 16-bit values at qx, 4 kq a row) against the tile of columns c .. c +
 * 15 (w): their approximate logits into approx [rows, n], from row r0's. ahead: the lines Q_AHEAD
 * bytes ahead are asked for, into L2. */
static inline __attribute__((always_inline)) void int8_tile_avx2(const int16_t *qx, int64_t kq, const int8_t *w,
                                                                  const float *scale, const float *sx, int64_t c,
                                                                  int64_t n, int R, int ahead, float *approx) {
    __m256i acc[QA_ROWS][QA_GROUPS];
    for (int i = 0; i < QA_ROWS; i++)
        for (int g = 0; g < QA_GROUPS; g++) acc[i][g] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < kq; kk++) {
        const int8_t *wk = w + kk * 4 * Q_COLS;
        if (ahead) _mm_prefetch((const char *)wk + Q_AHEAD, _MM_HINT_T1);
        __m256i xq[QA_ROWS];
        for (int i = 0; i < R; i++) {
            int64_t quad;
            memcpy(&quad, qx + (int64_t)i * 4 * kq + 4 * kk, sizeof quad);
            xq[i] = _mm256_set1_epi64x(quad);
        }
        for (int g = 0; g < QA_GROUPS; g++) {
            __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * g)));
            for (int i = 0; i < R; i++) acc[i][g] = _mm256_add_epi32(acc[i][g], _mm256_madd_epi16(wv, xq[i]));
        }
    }
    for (int i = 0; i < R; i++)
        for (int g = 0; g < QA_GROUPS; g += 2)
            qa_emit(acc[i][g], acc[i][g + 1], scale, sx[i], c + 4 * g, n, approx + (int64_t)i * n);
}

/* int8_tile_avx2 for one row or QA_ROWS, each count its own unrolled copy. */
static void int8_tile_rows(const int16_t *qx, int64_t kq, const int8_t *w, const float *scale, const float *sx,
                           int64_t c, int64_t n, int R, int ahead, float *approx) {
    if (R == 1)
        int8_tile_avx2(qx, kq, w, scale, sx, c, n, 1, ahead, approx);
    else
        int8_tile_avx2(qx, kq, w, scale, sx, c, n, QA_ROWS, ahead, approx);
}
#else
#define HAVE_INT8_HEAD 0
#define HAVE_AMX_INT8_HEAD 0
#endif

/* Whether kvs_int8_head_approx may use AMX tiles where the process has them (1, the default), for
 * tests and benchmarks: -1 leaves it; returns the setting before. */
static int int8_amx = 1;
int kvs_int8_head_set_amx(int on) {
    int before = int8_amx;
    if (on >= 0) int8_amx = on != 0;
    return before;
}

/* The int8 copy of a float32 head w [n, k], in one pass a row: s_j = max |w_j| / 127 into scale[j],
 * q_j = round(w_j / s_j) (within +-127) into its tile of qp (laid out as above, for n padded to whole
 * tiles and k to whole quads; the caller zeroes qp, scale and rowsum first, so that the padding is
 * zero), sum_k q_jk into rowsum[j], and |e_j| = |w_j - s_j q_j| into enorm[j], each element of e_j
 * computed in double (s_j q_jk is exact there) and the norm rounded up. */
void kvs_int8_head_pack(const float *w, int64_t n, int64_t k, int8_t *qp, float *scale, int32_t *rowsum,
                        float *enorm) {
    int64_t kq = (k + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const float *row = w + j * k;
        float big = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) big = fabsf(row[kk]) > big ? fabsf(row[kk]) : big;
        float s = big / 127.0f, inv = big > 0.0f ? 1.0f / s : 0.0f;
        int8_t *tile = qp + (j / Q_COLS) * kq * 4 * Q_COLS + (j % Q_COLS) * 4;
        int32_t sum = 0;
        double es = 0.0;
        for (int64_t kk = 0; kk < k; kk++) {
            float v = nearbyintf(row[kk] * inv);
            int32_t q = v > 127.0f ? 127 : v < -127.0f ? -127 : (int32_t)v;
            tile[(kk / 4) * 4 * Q_COLS + kk % 4] = (int8_t)q;
            sum += q;
            double e = (double)row[kk] - (double)s * (double)q;
            es += e * e;
        }
        scale[j] = s;
        rowsum[j] = sum;
        enorm[j] = (float)(sqrt(es) * (1.0 + 0x1p-20));
    }
}

#define HI_DIMS_MAX 64 /* the most of a row's largest |x_k| that hi_dims may leave past lo */

#if HAVE_INT8_HEAD == 1
/* The (n + 1)-th largest of |x_0| .. |x_k-1| (0 where k <= n); n <= HI_DIMS_MAX. */
static float kth_largest_abs(const float *x, int64_t k, int n) {
    float top[HI_DIMS_MAX + 1]; /* the largest so far, in descending order */
    int have = 0;
    for (int64_t kk = 0; kk < k; kk++) {
        float v = fabsf(x[kk]);
        if (have == n + 1 && v <= top[n]) continue;
        int i = have < n + 1 ? have++ : n;
        for (; i > 0 && top[i - 1] < v; i--) top[i] = top[i - 1];
        top[i] = v;
    }
    return have == n + 1 ? top[n] : 0.0f;
}
#endif

/* Whether this build has the int8 copy's products: 1 AVX-512 with VNNI, 2 AVX2, 0 neither. */
int kvs_int8_head_available(void) { return HAVE_INT8_HEAD; }

/* The columns of one of the int8 copy's tiles in this build (Q_COLS). */
int kvs_int8_head_tile_cols(void) { return Q_COLS; }

/* approx [rows, n] = each row of x [rows, k] times the int8 copy (qp, packed as above for n columns
 * padded to whole tiles and k to whole quads; scale s_j and rowsum sum_k q_jk as long as the padded
 * columns, zero past n), x's scale leaving its hi_dims largest |x_k| past lo (0 .. HI_DIMS_MAX; any
 * other value: s_x = max |x| / 32639, every quad's hi multiplied; AVX2 builds take 16-bit values
 * whole and keep their own scale), and xnorms
 * [rows, 2] each row's |x| and |e_x| = |x - s_x qx| (in double, rounded up), for
 * kvs_greedy_head. A row with a non-finite value gets NaN norms (its pick then fails, and the
 * caller takes the float32 head). Returns 0, -1 without memory, -2 in a build without the products. */
int kvs_int8_head_approx(const float *x, int64_t rows, int64_t k, const int8_t *qp, const float *scale,
                         const int32_t *rowsum, int64_t n, int64_t hi_dims, float *approx, float *xnorms) {
#if HAVE_INT8_HEAD
    if (rows <= 0) return 0; /* (the blocks below divide by their count) */
    int64_t kq = (k + 3) / 4, tiles = (n + Q_COLS - 1) / Q_COLS;
#if HAVE_AMX_INT8_HEAD
    int amx = int8_amx && kvs_amx_active() && kq % 16 == 0 && rows >= AMX_MIN_ROWS;
#else
    const int amx = 0;
#endif
    /* For the tiles, rows in chunks of at most A_ROWS, as even as they go (the first rows % chunks one
     * longer), chunk c's quads at 2 A_ROWS c rows: its rows' high quads, then their low quads. For the
     * vector kernel every row's high quads, then every row's low quads (AVX2: each row's 16-bit
     * values). Both hold hi + 128 and lo + 128, four bytes a quad. */
    int64_t chunks = amx ? (rows + A_ROWS - 1) / A_ROWS : 1, per = rows / chunks, longer = rows % chunks;
    uint32_t *quads = calloc((size_t)((amx ? 2 * A_ROWS * chunks : 2 * rows) * kq), sizeof *quads);
    float *sx = malloc((size_t)rows * sizeof *sx);
    if (quads == NULL || sx == NULL) {
        free(quads);
        free(sx);
        return -1;
    }
    uint32_t *hi = quads, *lo = quads + rows * kq;
#if HAVE_INT8_HEAD == 2 /* each lane's 2 kq products within int32 (see int8_tile_avx2) */
    const float qmax = (float)fmin(32767.0, floor(2147483647.0 / (254.0 * (double)kq)));
    (void)hi_dims; /* 16-bit values whole */
#else
    const float qmax = 32639.0f; /* hi within +-127 */
    const int split = hi_dims >= 0 && hi_dims <= HI_DIMS_MAX ? (int)hi_dims : -1;
#endif
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *hr = hi + r * kq, *lr = lo + r * kq; /* the row's high and low quads */
        if (amx) { /* row r is row i of chunk c, of R rows */
            int64_t c = r < longer * (per + 1) ? r / (per + 1) : longer + (r - longer * (per + 1)) / per;
            int64_t r0 = c * per + (c < longer ? c : longer), R = per + (c < longer);
            hr = quads + (2 * A_ROWS * c + r - r0) * kq;
            lr = hr + R * kq;
        }
        const float *xr = x + r * k;
        float big = 0.0f;
        int finite = 1;
        for (int64_t kk = 0; kk < k; kk++) {
            float v = fabsf(xr[kk]);
            finite &= isfinite(v);
            big = v > big ? v : big;
        }
        if (!finite) {
            sx[r] = 0.0f;
            xnorms[2 * r] = xnorms[2 * r + 1] = NAN; /* the sums are whatever, and unused */
#if HAVE_INT8_HEAD == 1
            memset(hr, 128, (size_t)kq * sizeof *hr); /* zeros: no hi quads for the row's block */
            memset(lr, 128, (size_t)kq * sizeof *lr);
#endif
            continue;
        }
        float s = big / qmax;
#if HAVE_INT8_HEAD == 1
        if (split >= 0) {
            float t = kth_largest_abs(xr, k, split) / 127.0f;
            s = t > s ? t : s;
        }
#endif
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        double xs = 0.0, es = 0.0;
#if HAVE_INT8_HEAD == 2
        int16_t *q16 = (int16_t *)quads + r * 4 * kq; /* the row's 16-bit values, 4 kq of them */
        (void)lr;
#else
        uint8_t *h = (uint8_t *)hr, *l = (uint8_t *)lr;
#endif
        for (int64_t kk = 0; kk < 4 * kq; kk++) {
            int32_t q = 0;
            if (kk < k) {
                float v = nearbyintf(xr[kk] * inv);
                q = v > qmax ? (int32_t)qmax : v < -qmax ? -(int32_t)qmax : (int32_t)v;
                double e = (double)xr[kk] - (double)s * (double)q;
                xs += (double)xr[kk] * xr[kk];
                es += e * e;
            }
#if HAVE_INT8_HEAD == 2
            q16[kk] = (int16_t)q;
#else
            int32_t high = (q + 32896) / 256; /* hi + 128, hi = floor((q + 128) / 256) */
            h[kk] = (uint8_t)high;
            l[kk] = (uint8_t)(q - 256 * (high - 128) + 128);
#endif
        }
        sx[r] = s;
        xnorms[2 * r] = (float)(sqrt(xs) * (1.0 + 0x1p-20));
        xnorms[2 * r + 1] = (float)(sqrt(es) * (1.0 + 0x1p-20));
    }
#if HAVE_AMX_INT8_HEAD
    if (amx) {
#pragma omp parallel
        {
            int32_t out[2 * A_ROWS * Q_COLS] __attribute__((aligned(64)));
            int loaded = 0;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t c = 0; c < chunks; c++) {
                    int R = (int)(per + (c < longer));
                    if (R != loaded) amx_config(loaded = R);
                    int64_t r0 = c * per + (c < longer ? c : longer);
                    amx_int8_tile(quads + 2 * A_ROWS * c * kq, kq, qp, scale, rowsum, sx + r0, t, n, R, c == 0, out,
                                  approx + r0 * n);
                }
            if (loaded) _tile_release();
        }
    } else
#endif
    {
#if HAVE_INT8_HEAD == 2
        (void)rowsum; /* the 16-bit values are signed: no offset to take off */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r0 = 0; r0 < rows; r0 += QA_ROWS) {
                int R = (int)(rows - r0 < QA_ROWS ? rows - r0 : QA_ROWS);
                int8_tile_rows((const int16_t *)quads + r0 * 4 * kq, kq, qp + t * kq * 4 * Q_COLS, scale, sx + r0,
                                t * Q_COLS, n, R, r0 == 0, approx + r0 * n);
            }
#else
        if (split < 0) {
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t r0 = 0; r0 < rows; r0 += QH_ROWS) {
                    const uint32_t *h = hi + r0 * kq, *l = lo + r0 * kq;
                    float *a = approx + r0 * n;
                    int ahead = r0 == 0;
                    NextShare nx = next_share(qp, kq, t, tiles, r0 / QH_ROWS, (rows + QH_ROWS - 1) / QH_ROWS);
                    switch (rows - r0 < QH_ROWS ? rows - r0 : QH_ROWS) {
                    case 1: int8_tile_16(h, l, kq, qp, scale, rowsum, sx + r0, t, n, 1, ahead, nx, a); break;
                    case 2: int8_tile_16(h, l, kq, qp, scale, rowsum, sx + r0, t, n, 2, ahead, nx, a); break;
                    default: int8_tile_16(h, l, kq, qp, scale, rowsum, sx + r0, t, n, 3, ahead, nx, a); break;
                    }
                }
            free(quads);
            free(sx);
            return 0;
        }
        /* rows in blocks of at most Q_ROWS, as even as they go; each block's hi quads: those where
         * one of its rows has a hi byte other than zero (+ 128) */
        int64_t blocks = (rows + Q_ROWS - 1) / Q_ROWS, bper = rows / blocks, blonger = rows % blocks;
        int32_t *uq = malloc((size_t)(blocks * kq + blocks) * sizeof *uq), *nu = uq + blocks * kq;
        if (uq == NULL) {
            free(quads);
            free(sx);
            return -1;
        }
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0 = b * bper + (b < blonger ? b : blonger), R = bper + (b < blonger);
            nu[b] = 0;
            for (int64_t kk = 0; kk < kq; kk++) {
                uint32_t any = 0;
                for (int64_t i = 0; i < R; i++) any |= hi[(r0 + i) * kq + kk] ^ 0x80808080u;
                if (any) uq[b * kq + nu[b]++] = (int32_t)kk;
            }
        }
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t b = 0; b < blocks; b++) {
                int64_t r0 = b * bper + (b < blonger ? b : blonger);
                const uint32_t *h = hi + r0 * kq, *l = lo + r0 * kq;
                const int32_t *u = uq + b * kq;
                float *a = approx + r0 * n;
                int ahead = b == 0;
                NextShare nx = next_share(qp, kq, t, tiles, b, blocks);
                switch (bper + (b < blonger)) {
                case 1: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 1, ahead, nx, a); break;
                case 2: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 2, ahead, nx, a); break;
                case 3: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 3, ahead, nx, a); break;
                case 4: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 4, ahead, nx, a); break;
                case 5: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 5, ahead, nx, a); break;
                default: int8_tile(h, l, kq, u, nu[b], qp, scale, rowsum, sx + r0, t, n, 6, ahead, nx, a); break;
                }
            }
        free(uq);
#endif
    }
    free(quads);
    free(sx);
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)qp, (void)scale, (void)rowsum, (void)n, (void)hi_dims, (void)approx,
        (void)xnorms;
    return -2;
#endif
}
