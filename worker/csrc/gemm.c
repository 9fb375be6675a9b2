/* Dense projections against weights packed once at load: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Packed layout: groups of NR output columns (48 with AVX-512, 24 with AVX2; see below), each
 * group [K][NR] contiguous, so that one k step of a group is NP vectors read in order:
 *
 *     W [N, K] row-major          packed: group g = columns NR g .. NR g + NR - 1
 *     n0: w00 w01 w02 ...         wp[g][k][c] = W[NR g + c, k]      (rows past N are zero)
 *     n1: w10 w11 w12 ...
 *
 * A micro-tile keeps MR rows of x against one group in MR x NP vector accumulators, broadcasting
 * one x value per row and k: with AVX-512, 24 FMAs per 3 weight loads and 8 broadcasts. Weights are read once
 * per panel of rows of x (blocks of up to MB rows, as many as half the L2 holds; see tasks), with no
 * per-call repacking; that is where this beats a general GEMM library at decode shapes.
 *
 * Prefetch: where a block has several row tiles, every tile of a group also pulls a share of the
 * *next* group into L2, spread evenly over the k steps of all the row tiles of the block. The
 * weight stream is then fetched while the cores compute, instead of in a burst during each group's
 * first tile (25% faster at 32 rows with weights coming from DRAM), and the current group is
 * prefetched a few KB ahead of its loads (AHEAD_BYTES); float32 blocks of 2-4 tiles take turns on
 * each group instead (see TURN_K). Below prefetch_min_rows rows (6, or 2 where
 * the engine measured that it pays) both are left to the hardware prefetcher (one row of widened
 * bf16 has a path of its own, gemv_bf16_group). A prefetch never faults, so running past the end is
 * harmless.
 * bf16 weights are widened in registers, x and y float32; or, where the build has AVX512-BF16 and the
 * process has no AMX tiles (csrc/amx_gemm.c), multiplied by dot-product instructions (below). Built
 * with -ffp-contract=fast, so that `acc += x * w` is one fused multiply-add.
 *
 * bf16 dot products (VDPBF16PS): one instruction takes 16 columns x 2 k steps of bf16 pairs against
 * one broadcast pair of x and adds both products to 16 float32 sums, twice the multiply-adds of a
 * widening FMA. Weights are packed in k pairs (k rounded up to even, the pad zero):
 *
 *     wp[g][kp][c][2] = W[NR g + c, 2 kp .. 2 kp + 1]
 *
 * the same bytes per group as the widening layout, and x is rounded to bf16 (exact for a bf16
 * model's activations). On a Zen 4 EPYC, whose FMA pipes are 256 bits wide but which runs a 512-bit
 * dot product at full rate, a SmolLM2 step's bf16 products took 10.1 ms at 8 rows, 29.0 at 32 and
 * 52.9 at 64 (297-325 GFLOP/s), against 16.1, 53.0 and 118.9 widened and 15.4, 31.7 and 55.6
 * through oneDNN; from about 128 rows oneDNN is ahead. Each row's sums run in
 * one order (pair by pair, one accumulator per column) with or without rows beside it, one row
 * included, so outputs still do not depend on batching.
 */
#define _GNU_SOURCE /* sysconf(_SC_LEVEL2_CACHE_SIZE) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <unistd.h>

#include "thread_slot.h"
#include "vec.h"

/* The tile follows the vector registers the build has. With AVX-512 (32 registers of 16 floats):
 * MR = 8 rows x NP = 3 vectors = 24 accumulators, NR = 48. With AVX2 (16 registers of 8 floats):
 * MR = 4 x NP = 3 = 12 accumulators + 3 weights + 1 broadcast, NR = 24 (on a 2-core AMD EPYC host,
 * 115-150 GFLOP/s from 8 to 256 rows, up to 35% ahead of a 6 x 2 tile). The AVX-512 tile there would
 * need 48 registers, and its spills made the GEMM about 30x slower. The packed group is NR columns
 * (kvs_gemm_group), so weights are packed for the build that multiplies them. */
#define NP 3
#if VW == 16
#define MR 8
#else
#define MR 4
#endif

#define NR (VW * NP)   /* output columns per group */
#if VW == 16 && defined(__AVX512BF16__)
#define HAVE_DOT 1
#else
#define HAVE_DOT 0
#endif
#define MB 64          /* rows of x per block, which stays in L2 while the groups stream past it */
#define PF 32          /* k steps of weight prefetch: 16 before, and 32 made a step's fp32 products 1.06-1.09x
                        * faster at 6-8 rows, 1.01-1.04x at 16-32, bf16 pairs 1.02-1.18x at 8 rows
                        * and 1.04-1.06x at 16 (Zen 5 EPYC, weights from memory, lockstep) */
/* Where the current group's prefetch goes, and how far ahead of the loads. With AVX-512, into L2
 * and PF float32 k steps ahead in bytes (6 KB) whatever the weights' format: a tile of 6-8 rows
 * consumes a weight line every 8 cycles, and prefetched into L1 the lines in flight were capped by
 * L1's few miss buffers, so the products waited on memory instead of overlapping with it. On a
 * Zen 4 EPYC (one copy of a step's weights on huge pages through both builds, lockstep, three runs)
 * the fp32 products ran 1.06-1.13x faster at 6-8 rows, 0.95-1.02x at 12-16 and 0.99-1.04x at
 * 24-64; bf16 pairs 0.98-1.15x at 6-8 rows, 1.0-1.06x at 12-16 and 1.02-1.07x at 24-64; decode
 * steps of 6-8 sequences 1.02-1.11x in fp32 and 1.08-1.17x in bf16. The same change in an AVX2
 * build (4-row tiles) ran 0.94-1.07x there, so AVX2 keeps L1 and PF k steps of its own format. */
#if VW == 16
#define AHEAD_HINT 2
#define AHEAD_BYTES(elem) (PF * NR * 4)
#else
#define AHEAD_HINT 3
#define AHEAD_BYTES(elem) (PF * NR * (elem))
#endif

static inline __attribute__((always_inline)) vf load_weight(const void *w, int64_t idx, int is_bf16) {
    vf v;
    if (is_bf16) {
        v = widen_bf16((const uint16_t *)w + idx);
    } else {
        memcpy(&v, (const float *)w + idx, sizeof v);
    }
    return v;
}

/* AVX2 widens a group's bf16 weights (24 a k step) with 4 operations instead of 6: the first 16 in
 * one load, widened by two unpacks against zero, which leave columns 0-3 and 8-11 in w[0] and 4-7
 * and 12-15 in w[1] (as gemv_bf16_two_groups does), the last 8 by a widening load. The tile's sums
 * of those two vectors are then in that order, and bf16_column_order swaps their middle halves
 * (its own inverse) before they are stored. Each column's sum is the same chain of multiply-adds
 * of the same values, so the bits do not change. */
#if VW == 8 && defined(__AVX2__)
#define UNPACKED_BF16 1
static inline __attribute__((always_inline)) void unpack_bf16(vf w[NP], const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    w[0] = (vf)_mm256_unpacklo_epi16(zero, v);
    w[1] = (vf)_mm256_unpackhi_epi16(zero, v);
    w[2] = widen_bf16(p + 16);
}

static inline __attribute__((always_inline)) void bf16_column_order(vf acc[NP]) {
    __m256 a = (__m256)acc[0], b = (__m256)acc[1];
    acc[0] = (vf)_mm256_permute2f128_ps(a, b, 0x20);
    acc[1] = (vf)_mm256_permute2f128_ps(a, b, 0x31);
}
#else
#define UNPACKED_BF16 0
static inline __attribute__((always_inline)) void bf16_column_order(vf acc[NP]) { (void)acc; }
#endif

static inline __attribute__((always_inline)) void micro(const float *x, int64_t k, const void *wp, int64_t g,
                                                        float *y, int64_t ldy, int mr, int ncols, int is_bf16,
                                                        int ahead, const char *next, int64_t next_step, int64_t k0,
                                                        int64_t k1, int load) {
    vf acc[MR][NP];
    UNROLL for (int i = 0; i < MR; i++)
        UNROLL for (int j = 0; j < NP; j++) acc[i][j] = (vf){0};
    if (load) { /* the sums of the k steps before k0, left in y by the turn before (whole groups only) */
        UNROLL for (int i = 0; i < mr; i++) memcpy(acc[i], y + i * ldy, sizeof acc[i]);
        if (is_bf16) UNROLL for (int i = 0; i < mr; i++) bf16_column_order(acc[i]);
    }
    int64_t base = g * k * NR;
    const char *pf = (const char *)wp + base * (is_bf16 ? 2 : 4) + AHEAD_BYTES(is_bf16 ? 2 : 4);
    int64_t pf_step = NR * (is_bf16 ? 2 : 4);
    for (int64_t kk = k0; kk < k1; kk++) {
        vf w[NP];
#if UNPACKED_BF16
        if (is_bf16)
            unpack_bf16(w, (const uint16_t *)wp + base + kk * NR);
        else
#endif
            UNROLL for (int j = 0; j < NP; j++) w[j] = load_weight(wp, base + kk * NR + VW * j, is_bf16);
        if (ahead)
            for (int64_t b = 0; b < pf_step; b += 64) __builtin_prefetch(pf + kk * pf_step + b, 0, AHEAD_HINT);
        if (next)
            for (int64_t b = 0; b < next_step; b += 64) __builtin_prefetch(next + kk * next_step + b, 0, 2);
        UNROLL for (int i = 0; i < mr; i++) {
            float xv = x[i * k + kk];
            UNROLL for (int j = 0; j < NP; j++) acc[i][j] += xv * w[j];
        }
    }
    if (is_bf16) UNROLL for (int i = 0; i < mr; i++) bf16_column_order(acc[i]);
    if (ncols == NR) {
        UNROLL for (int i = 0; i < mr; i++) memcpy(y + i * ldy, acc[i], sizeof acc[i]);
    } else {
        for (int i = 0; i < mr; i++) memcpy(y + i * ldy, acc[i], (size_t)ncols * sizeof(float));
    }
}

#if HAVE_DOT
/* The micro-tile on bf16 pairs: x holds each row's k pairs (kp of them) as 32-bit words, wp the pair
 * layout above. Prefetches as in micro, per pair of k steps. */
static inline __attribute__((always_inline)) void dot_micro(const uint32_t *x, int64_t kp, const uint16_t *wp,
                                                            int64_t g, float *y, int64_t ldy, int mr, int ncols,
                                                            int ahead, const char *next, int64_t next_step,
                                                            int64_t kp0, int64_t kp1, int load) {
    __m512 acc[MR][NP];
    UNROLL for (int i = 0; i < MR; i++)
        UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps();
    if (load)
        UNROLL for (int i = 0; i < mr; i++) memcpy(acc[i], y + i * ldy, sizeof acc[i]);
    const uint16_t *wg = wp + g * kp * 2 * NR;
    const char *pf = (const char *)wg + AHEAD_BYTES(2);
    for (int64_t kk = kp0; kk < kp1; kk++) {
        __m512bh w[NP];
        UNROLL for (int j = 0; j < NP; j++) w[j] = (__m512bh)_mm512_loadu_si512(wg + (kk * NR + VW * j) * 2);
        if (ahead)
            for (int64_t b = 0; b < 4 * NR; b += 64) __builtin_prefetch(pf + kk * 4 * NR + b, 0, AHEAD_HINT);
        if (next)
            for (int64_t b = 0; b < 2 * next_step; b += 64) __builtin_prefetch(next + kk * 2 * next_step + b, 0, 2);
        UNROLL for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[i * kp + kk]);
            UNROLL for (int j = 0; j < NP; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
        }
    }
    for (int i = 0; i < mr; i++) memcpy(y + i * ldy, acc[i], (size_t)ncols * sizeof(float));
}

#endif

/* mode: 0 float32 weights, 1 bf16 weights widened, 2 bf16 pairs (x: bf16 pairs, k: even) */
static inline __attribute__((always_inline)) void tile_rows(const void *x, int64_t k, const void *wp, int64_t g,
                                                            float *y, int64_t ldy, int64_t mr, int ncols, int mode,
                                                            int ahead, const char *next, int64_t next_step,
                                                            int64_t k0, int64_t k1, int load) {
    /* a constant row count lets each variant unroll fully and keep its accumulators in registers */
#if HAVE_DOT
#define DOT(n)                                                                                                \
    if (mode == 2) {                                                                                          \
        dot_micro(x, k / 2, wp, g, y, ldy, n, ncols, ahead, next, next_step, k0 / 2, k1 / 2, load);           \
        break;                                                                                                \
    }
#else
#define DOT(n)
#endif
    switch (mr) {
#define ROWS(n) case n: DOT(n) micro(x, k, wp, g, y, ldy, n, ncols, mode, ahead, next, next_step, k0, k1, load); break;
#if MR == 8
    ROWS(8) ROWS(7) ROWS(6) ROWS(5)
#endif
    ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
    default: DOT(1) micro(x, k, wp, g, y, ldy, 1, ncols, mode, ahead, next, next_step, k0, k1, load); break;
    }
#undef DOT
}

/* Each combination of the prefetches gets a loop of its own (constant flags), as each mode does (see
 * gemm): tested inside the k loop, they left the branches and their spilled operands in it. */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t k, const void *wp, int64_t g,
                                                       float *y, int64_t ldy, int64_t mr, int ncols, int mode,
                                                       int ahead, const char *next, int64_t next_step) {
    if (next && ahead)
        tile_rows(x, k, wp, g, y, ldy, mr, ncols, mode, 1, next, next_step, 0, k, 0);
    else if (next)
        tile_rows(x, k, wp, g, y, ldy, mr, ncols, mode, 0, next, next_step, 0, k, 0);
    else if (ahead)
        tile_rows(x, k, wp, g, y, ldy, mr, ncols, mode, 1, NULL, next_step, 0, k, 0);
    else
        tile_rows(x, k, wp, g, y, ldy, mr, ncols, mode, 0, NULL, next_step, 0, k, 0);
}

/* k steps k0 .. k1 - 1 of a float32 tile of a whole group (ncols == NR), its sums started from y
 * where k0 > 0 and left there, prefetching next + kk * next_step for each k step kk: see TURN_K. */
static inline __attribute__((always_inline)) void tile_turn(const float *x, int64_t k, const void *wp, int64_t g,
                                                            float *y, int64_t ldy, int64_t mr, int64_t k0,
                                                            int64_t k1, const char *next, int64_t next_step) {
    tile_rows(x, k, wp, g, y, ldy, mr, NR, 0, 0, next, next_step, k0, k1, k0 > 0);
}

/* One row of x (a batch-1 decode step) streams the weights once, a read of the packed groups at memory
 * speed, in the tile without prefetches (below prefetch_min_rows): each run of groups a thread
 * takes (see tasks) is contiguous and read in order, which the hardware prefetcher follows, and the
 * tile's prefetching only cost issue slots there (66 GB/s with it, 80-84 without, on a 2-core AMD
 * EPYC with 40 fresh 7 MB weights). Widened bf16 weights, half the bytes per k step, have this path
 * of their own, prefetching 64 k steps ahead (66 -> 74 GB/s). fp32 and bf16 pairs had one too, until on a Zen 4
 * EPYC the tile read a step's weights from memory 4-5% faster at one row (fp32 19.8 -> 19.0 ms,
 * pairs 10.9 -> 10.4 ms, lockstep). Either way a row's sums run in the tile's order, one fused
 * multiply-add per k step in one accumulator, so its result is the same bits whatever the number of
 * rows beside it: outputs do not depend on how requests were batched. */
static inline __attribute__((always_inline)) void gemv_bf16_group(const float *x, int64_t k, const uint16_t *wp,
                                                                  int64_t g, float *y, int ncols) {
#if VW == 8 && defined(__AVX2__)
    /* With AVX2, in 128-bit halves: each half of 4 columns widened by one unpack against zero, 6 sums
     * a group instead of 3. On a Zen 1 EPYC (128-bit pipes) the 3 sums of 8 waited on each other's
     * multiply-adds and the widening took two operations a vector: one core, a group in cache, 4.1
     * -> 11.3 G weights/s. Each column's sum is the same chain of multiply-adds either way. */
    __m128 acc[2 * NP];
    UNROLL for (int j = 0; j < 2 * NP; j++) acc[j] = _mm_setzero_ps();
    const __m128i zero = _mm_setzero_si128();
    int64_t base = g * k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        __m128 xv = _mm_set1_ps(x[kk]);
        const char *ahead = (const char *)(wp + base + (kk + 64) * NR);
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead + 64);
        UNROLL for (int j = 0; j < NP; j++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(wp + base + kk * NR + VW * j));
            acc[2 * j] = _mm_fmadd_ps(xv, _mm_castsi128_ps(_mm_unpacklo_epi16(zero, v)), acc[2 * j]);
            acc[2 * j + 1] = _mm_fmadd_ps(xv, _mm_castsi128_ps(_mm_unpackhi_epi16(zero, v)), acc[2 * j + 1]);
        }
    }
    memcpy(y, acc, (size_t)ncols * sizeof(float));
#else
    vf acc[NP];
    UNROLL for (int j = 0; j < NP; j++) acc[j] = (vf){0};
    int64_t base = g * k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        float xv = x[kk];
        /* half the bytes per k step: the hardware prefetcher alone fell behind (66 -> 74 GB/s) */
        const char *ahead = (const char *)(wp + base + (kk + 64) * NR);
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead + 64);
        UNROLL for (int j = 0; j < NP; j++) acc[j] += xv * widen_bf16(wp + base + kk * NR + VW * j);
    }
    memcpy(y, acc, (size_t)ncols * sizeof(float));
#endif
}

#if VW == 8 && defined(__AVX2__) && defined(__FMA__)
/* A group's sums of gemv_bf16_two_groups (below) in column order to y[0 .. NR). */
static inline __attribute__((always_inline)) void store_unpacked(float *y, __m256 a0, __m256 a1, __m256 a2) {
    _mm_storeu_ps(y, _mm256_castps256_ps128(a0));
    _mm_storeu_ps(y + 4, _mm256_castps256_ps128(a1));
    _mm_storeu_ps(y + 8, _mm256_extractf128_ps(a0, 1));
    _mm_storeu_ps(y + 12, _mm256_extractf128_ps(a1, 1));
    _mm256_storeu_ps(y + 16, a2);
}

/* The first ncols of them (the weight's last group; a copy through the stack of its own, since in
 * the loop's function it left one of the sums on the stack through the k loop). */
static __attribute__((noinline)) void store_unpacked_part(float *y, __m256 a0, __m256 a1, __m256 a2, int ncols) {
    float out[NR];
    store_unpacked(out, a0, a1, a2);
    memcpy(y, out, (size_t)ncols * sizeof(float));
}

/* gemv_bf16_group for two groups at once with AVX2's 256-bit operations, for cores whose vector
 * units are 256 bits wide: a group's 16 first columns are one load, widened by two unpacks against
 * zero (columns 0-3 and 8-11 in one register, 4-7 and 12-15 in the other, put back in order at the
 * end), the last 8 by one widening load. Two groups give six sums a step, enough to keep the
 * multiply-adds busy through their latency (one group's three would wait on each other). Each
 * column's sum is the same chain of multiply-adds as in gemv_bf16_group, so the bits are the same.
 * On a 2-core Zen 3 EPYC (alternating with the halves, one process): a SmolLM2 step's bf16 weights
 * 1.13-1.15x faster from memory, one layer's from cache 1.15-1.36x, whole batch-1 bf16 decode steps
 * 1.05x (10.30 -> 9.77 ms). The engine times both ways at load (CpuKernels.tune_two_groups).
 * Not inlined: inside gemm's parallel region GCC kept one of the six sums on the stack, a store and
 * a load in its chain every k step (0.72x as fast as one group at a time, weights in cache). */
static __attribute__((noinline)) void gemv_bf16_two_groups(const float *x, int64_t k, const uint16_t *wp, int64_t g,
                                                            float *y, int ncols) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
    const __m256i zero = _mm256_setzero_si256();
    const uint16_t *w0 = wp + g * k * NR, *w1 = w0 + k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 xv = _mm256_set1_ps(x[kk]);
        const uint16_t *r0 = w0 + kk * NR, *r1 = w1 + kk * NR;
        __builtin_prefetch(r0 + 64 * NR);
        __builtin_prefetch((const char *)(r0 + 64 * NR) + 64);
        __builtin_prefetch(r1 + 64 * NR);
        __builtin_prefetch((const char *)(r1 + 64 * NR) + 64);
        __m256i v0 = _mm256_loadu_si256((const __m256i *)r0), v1 = _mm256_loadu_si256((const __m256i *)r1);
        __m256i u0 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r0 + 16))), 16);
        __m256i u1 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r1 + 16))), 16);
        a0 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v0)), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v0)), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(u0), a2);
        b0 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v1)), b0);
        b1 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v1)), b1);
        b2 = _mm256_fmadd_ps(xv, _mm256_castsi256_ps(u1), b2);
    }
    store_unpacked(y, a0, a1, a2);
    if (ncols == NR) store_unpacked(y + NR, b0, b1, b2);
    else store_unpacked_part(y + NR, b0, b1, b2, ncols);
}

/* The same for one row against float32 weights: six sums a step where a tile of one row has three,
 * each column's the same chain as in the tile. On the same host, a step's weights from memory
 * 1.02-1.19x faster (the more, the faster the memory was at the time), four layers' 1.38-1.51x. */
static __attribute__((noinline)) void gemv_f32_two_groups(const float *x, int64_t k, const float *wp, int64_t g,
                                                           float *y, int ncols) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
    const float *w0 = wp + g * k * NR, *w1 = w0 + k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 xv = _mm256_set1_ps(x[kk]);
        const float *r0 = w0 + kk * NR, *r1 = w1 + kk * NR;
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r0), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r0 + 8), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r0 + 16), a2);
        b0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r1), b0);
        b1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r1 + 8), b1);
        b2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(r1 + 16), b2);
    }
    _mm256_storeu_ps(y, a0);
    _mm256_storeu_ps(y + 8, a1);
    _mm256_storeu_ps(y + 16, a2);
    float out[NR];
    _mm256_storeu_ps(out, b0);
    _mm256_storeu_ps(out + 8, b1);
    _mm256_storeu_ps(out + 16, b2);
    memcpy(y + NR, out, (size_t)ncols * sizeof(float));
}
#define TWO_GROUPS 1
#else
#define TWO_GROUPS 0
#endif

/* The fewest rows for which the tiles prefetch their weights (the current group PF k steps ahead,
 * and, with several tiles a block, a share of the next group). Whether 2-5 rows gain from it
 * depends on the host: when their one tile still prefetched the next group too, on a Zen 4 EPYC
 * they ran 1.07-1.16x faster without (2 rows 62 -> 74 GB/s, 4 rows 62 -> 70), and on one 2-core
 * Xeon 3 rows 8-15% faster without; on another Xeon (Granite Rapids-class, 4 MB of L2 a core) 3-5
 * rows took 1.14-1.30x longer without (a model's weights from memory at 5 rows: 23.1 against 17.7
 * ms). Prefetching only their own group, on a Zen 5 EPYC, 3-5 rows ran 1.04-1.06x faster with it
 * (bf16 pairs at 4 rows 1.07-1.10x). From 6 rows on it pays or is even everywhere measured. The
 * engine times both once per process on the model's own weights (CpuKernels.tune_prefetch) and
 * sets it here. */
static int64_t prefetch_min_rows = 6;

void kvs_gemm_set_prefetch_rows(int64_t rows) { prefetch_min_rows = rows < 2 ? 2 : rows; }

/* Widened bf16 at wide_min_tiles row tiles a block or more (below): each group is widened once into the
 * thread's own float32 copy, which every tile of the block then multiplies as float32 weights, instead
 * of each tile widening every weight vector again. On a 2-core Zen 1 EPYC (AVX2 on 128-bit FMA pipes)
 * any vector operation beside the FMAs cost about as much as one, and a tile of widened weights
 * ran at 30 GFLOP/s a core against 40 for float32. The copy is read from L2 (k = 1536: 144 KB):
 * a step's bf16 products there ran 1.08x faster at 16 rows, 1.15x at 32 and 1.20x at 64, and
 * batch-32 decode steps 1.15x (206 -> 179 ms; lockstep). One core, a group's weights in cache, the
 * copy made 2 tiles 0.90x as fast, 4 tiles 1.10x, 8 1.20x and 16 1.28x; made with unpacks (below)
 * instead of widening loads, 1.04x, 1.20x, 1.25x and 1.30x. A tile's sums are the same multiply-adds
 * in the same order either way, so the outputs are the same bits. NULL where the copy cannot be had
 * (the tiles then widen as before). */
#define WIDE_MIN_TILES 4
/* On a 2-core Zen 3 EPYC, once its tiles widened with unpacks (unpack_bf16), the copy no longer paid:
 * products at 16 rows took 1.19-1.23x as long with it, 32 rows 1.07-1.08x, 64-128 rows 0.99-1.05x
 * (a model's bf16 projections, one build each way in one process, alternating; from memory and from
 * cache alike). So the engine times both ways when bf16 weights load (CpuKernels.tune_wide_copy). */
static int wide_copy_on = 1;
int kvs_gemm_set_wide_copy(int on) {
    wide_copy_on = on != 0;
    return wide_copy_on;
}

/* The fewest row tiles a block needs for the copy (WIDE_MIN_TILES until set): the copy's cost is a
 * block's, its gain a tile's, so between a host where 4 tiles lose and one where they win lies a
 * threshold of its own. On a 2-core Zen 2 EPYC (a model's bf16 projections from memory, alternating)
 * the copy ran even at 8-16 rows and 1.055x, 1.073x, 1.112x, 1.160x and 1.199x faster at 20, 24, 32,
 * 48 and 64 rows, while the timing at 4 tiles alone had turned it off for all (CpuKernels.tune_wide_copy
 * now times 8 tiles too). tiles <= 0 leaves it; returns the setting before. */
static int wide_min_tiles = WIDE_MIN_TILES;
int kvs_gemm_set_wide_min_tiles(int tiles) {
    int was = wide_min_tiles;
    if (tiles > 0) wide_min_tiles = tiles;
    return was;
}

typedef struct {
    int64_t capacity; /* floats */
    float *data;
} WideCopy;

static void free_wide_copy(void *p) {
    WideCopy *c = p;
    free(c->data);
    free(c);
}

THREAD_SLOT(wide_copy, WideCopy, free_wide_copy)

/* The calling thread's copy, kept for its next call (as large as the largest k it met) and freed
 * when the thread exits: a thread that calls in and goes away leaves nothing behind. */
static const float *widened_group(const uint16_t *wp, int64_t g, int64_t k) {
    WideCopy *c = wide_copy_get();
    if (c == NULL) return NULL;
    int64_t elems = k * NR;
    if (c->capacity < elems) {
        free(c->data);
        c->data = aligned_alloc(64, (size_t)(elems * 4 + 63) / 64 * 64);
        c->capacity = c->data ? elems : 0;
        if (c->data == NULL) return NULL;
    }
    float *copy = c->data;
    const uint16_t *src = wp + g * elems;
#if VW == 8 && defined(__AVX2__)
    /* 8 bf16 values at a time, interleaved with zeros in two 128-bit halves (one operation a half,
     * against two for a widening load and a shift on 128-bit pipes) */
    const __m128i zero = _mm_setzero_si128();
    for (int64_t i = 0; i < elems; i += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(src + i));
        _mm_store_si128((__m128i *)(copy + i), _mm_unpacklo_epi16(zero, v));
        _mm_store_si128((__m128i *)(copy + i + 4), _mm_unpackhi_epi16(zero, v));
    }
#else
    for (int64_t i = 0; i < elems; i += VW) {
        vf v = widen_bf16(src + i);
        memcpy(copy + i, &v, sizeof v);
    }
#endif
    return copy;
}

/* float32 blocks of 2-4 row tiles (9-32 rows with AVX-512): the tiles take turns on each TURN_K k
 * steps of a group, their sums left in y between turns, so that the group streams from memory in
 * one pass and the later tiles of a turn meet its lines in L1; every tile of a turn prefetches its
 * share of the weights TURN_AHEAD turns ahead, so the stream runs through all of them. One tile
 * after the other (the first from memory, the second from L2, the next group prefetched over all),
 * a model's products from memory took 1.6-1.7x their time in cache at 12-16 rows, against 1.0x at
 * 8. On a 2-core Xeon with AMX (SmolLM2's products, weights from memory, alternating in one
 * process): 1.14-1.18x faster at 12 and 16 rows, 1.08-1.10x at 24, 1.04-1.07x at 32; prefetching
 * 1 or 4 turns ahead about as fast as 2; with the first tile's own prefetch alone, 1.04x at 16
 * rows and 0.90-0.95x at 24-32; 5-8 tiles 0.92-0.98x at 48-128 rows; bf16 weights (pairs or
 * widened, measured with AMX off) 0.91-0.98x at 12-32 rows, so they keep the tiles one after the
 * other; turns of 32 or 256 k steps gained less than 64, 128 as much. On a 2-core Zen 4 EPYC, turns
 * made decode steps of 16-32 sequences 1.10-1.19x slower and the shared-prefix workload 1.11x, so the
 * engine times both ways when a float32 model loads (cpu_kernels.py's tune_turns). The sums are the
 * same multiply-adds in the same order, so the bits are the same. */
#define TURN_K 64
#define TURN_TILES 4
#define TURN_AHEAD 2
/* Until timed; AVX-512 only. With AVX2 (4-row tiles: 5-16 rows), on a 2-core Zen 3 EPYC, decode steps
 * of 12 and 16 sequences took 1.19x and 1.42x as long with turns (8: 1.05x); in that build the turn
 * loop also kept one of its 12 sums on the stack, and with the loop rebuilt without the spill the
 * products still ran 0.99x at 12 rows and 0.91x at 16 (1.06x at 8). */
static int turns_on = VW == 16;
void kvs_gemm_set_turns(int on) { turns_on = on; } /* tests and benchmarks */

/* Whether, in float32 blocks of 2-4 row tiles that do not take turns, only the first tile prefetches
 * the group ahead of its loads, as in larger blocks (block_group): on by default in AVX2 builds,
 * whose 4-row tiles have no turns. On a 2-core Zen 2 EPYC (SmolLM2's products from memory, one
 * process, alternating, nine rounds) 1.04-1.05x faster at 14-16 rows, even at 8-12 and 20; on a
 * Zen 3 EPYC 0.94-1.09x at 6-16 rows (an earlier session's scratch setter), even. */
static int lead_ahead = VW == 8;
int kvs_gemm_set_lead_ahead(int on) { /* tests and benchmarks; on < 0 leaves it; returns the setting before */
    int was = lead_ahead;
    if (on >= 0) lead_ahead = on != 0;
    return was;
}

/* Whether a float32 block of `tiles` row tiles runs a group in turns (see TURN_K). */
static inline __attribute__((always_inline)) int in_turns(int mode, int64_t tiles, int ncols, int ahead) {
    return mode == 0 && tiles >= 2 && tiles <= TURN_TILES && ncols == NR && ahead && turns_on;
}

/* The `count` sums at src, plus the bias where given (added in float32, as the Y_F32 form adds it),
 * rounded to bf16 into y from element `at` on, in `form` (Y_BF16 or Y_BF16_IN_F32). */
static inline __attribute__((always_inline)) void emit(const float *src, const float *bias, void *y, int form,
                                                       int64_t at, int64_t count) {
    uint16_t *half = (uint16_t *)y + at;
    float *full = (float *)y + at;
#pragma omp simd
    for (int64_t c = 0; c < count; c++) {
        uint16_t h = to_bf16(bias ? src[c] + bias[c] : src[c]);
        if (form == Y_BF16) {
            half[c] = h;
        } else {
            uint32_t u = (uint32_t)h << 16;
            memcpy(full + c, &u, sizeof u);
        }
    }
}

/* Rows r0 .. r1 - 1 of one group's columns c0 .. c0 + ncols - 1 from a block's sums (NR floats a
 * row) into y [m, n]: written while the sums are in L1, by the thread that made them, instead of
 * in a pass over a float32 y on one thread afterwards. */
static inline __attribute__((always_inline)) void emit_rows(const float *sums, const float *bias, void *y, int form,
                                                            int64_t r0, int64_t r1, int64_t n, int64_t c0, int ncols) {
    for (int64_t i = r0; i < r1; i++)
        emit(sums + (i - r0) * NR, bias ? bias + c0 : NULL, y, form, i * n + c0, ncols);
}

/* Bytes of x a panel of row blocks may hold (tasks, below): half the L2, as the system reports it,
 * else 256 KB. Set once; a race sets the same value twice. */
static int64_t panel_bytes;
static int64_t x_panel_bytes(void) {
    if (!panel_bytes) {
        long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        panel_bytes = l2 > 0 ? l2 / 2 : (int64_t)256 << 10;
    }
    return panel_bytes;
}
/* How tasks' blocks share panels (see tasks): 1 panels of as many blocks as half the L2 holds, 2 only
 * a short last block (MB / 2 rows or fewer) in a panel with the block before it, the others block by
 * block, 0 block by block (tests and benchmarks). 1 until the engine has timed 1 against 2
 * (CpuKernels.tune_short_panels). */
static int row_panels_on = 1;
void kvs_gemm_set_row_panels(int mode) { row_panels_on = mode; }

/* Where blocks run one by one (panels of one block: x of a block takes more than half the L2, as
 * SmolLM2's at 512 KB of L2), a short last block runs first. The threads take runs of tasks
 * (OpenMP's guided schedule: half of what is left over the threads), which balances them only
 * where tasks cost the same; a short last block's tasks cost a fraction of the others', and last
 * in the order they made the first thread's run most of the work while the other, done with the
 * cheap tail, waited: on a 2-core Zen 3 EPYC (512 KB of L2) SmolLM2's 120 float32 products took
 * 156.8 ms at 68 rows against 82.7 at 64, and 409 at 272 against 345 at 256. First, the runs that
 * come last are of full blocks and the split evens out: 68 rows 99.6 ms, 80 rows 111.7 (152.5),
 * 136 rows 171.0 (233.7), 272 rows 337.4, 288 rows 361.6 (417.1); whole prefills of one prompt
 * (alternating in one process, six rounds) 1.52x faster at 68 tokens, 1.29x at 136, 1.16x at 200,
 * 1.10x at 268 and 1.09x at 300 in float32, bf16 1.59x, 1.28x, 1.15x, 1.10x and 0.99x. Which thread
 * computes a tile does not change its sums: the bits are the same. */
static int short_first_on = 1;
int kvs_gemm_set_short_first(int on) { /* tests and benchmarks; on < 0 leaves it; returns the setting before */
    int was = short_first_on;
    if (on >= 0) short_first_on = on != 0;
    return was;
}

/* Where row tile t of a block's `rows` rows, in `tiles` tiles of at most MR, starts. Tiles of MR rows,
 * unless the last would hold MR / 2 rows or fewer: then the rows are shared evenly, so that 17 rows
 * run as 5 + 6 + 6 rather than 8 + 8 + 1. A tile of one to three rows keeps too few sums in flight
 * to hide its multiply-adds' latency and reloads the group's weights from L2 for little work. On a
 * 2-core Zen 4 EPYC (a step's 30 layers of products, weights from memory, alternating in one
 * process, medians of 9-21 rounds): float32 9-11 rows 1.03-1.05x faster, 17 rows 1.07-1.11x, 25
 * 1.06x, 12 1.02-1.03x, 18 1.04x, 20 (7 + 7 + 6) 0.99-1.05x; bf16 pairs 9 rows 1.04x, 17 1.10x, 25
 * 1.07x, 12 1.02x, 20 1.00x. Where the last tile held five or more rows, sharing evenly ran even or
 * slower (13 and 14 rows 0.98-1.00x), so those keep their tiles. A row's sums do not depend on its
 * tile: the bits are the same either way. */
static int even_tiles = 1;
int kvs_gemm_set_even_tiles(int on) { /* tests and benchmarks; returns the setting before */
    int was = even_tiles;
    even_tiles = on != 0;
    return was;
}
static inline __attribute__((always_inline)) int64_t tile_start(int64_t rows, int64_t tiles, int64_t t) {
    int64_t last = rows - (tiles - 1) * MR;
    if (even_tiles && tiles > 1 && last <= MR / 2) return t * rows / tiles;
    return t * MR < rows ? t * MR : rows;
}

/* One block's tiles (rows b * MB .. m_end - 1) against group g, their float32 sums left at ty (ldt
 * apart). `next`: the group whose share each tile prefetches (see tasks), or NULL; `after`: the group
 * this thread computes after this one, into which tiles in turns prefetch past this group's end. */
static inline __attribute__((always_inline)) void block_group(const void *x, const void *wp, int64_t k, int mode,
                                                              int64_t b, int64_t m_end, int64_t g, int ncols,
                                                              int ahead, const char *next, const char *after,
                                                              float *ty, int64_t ldt) {
    int64_t rows = m_end - b * MB, tiles = (rows + MR - 1) / MR, elem = mode ? 2 : 4;
    /* tile t prefetches bytes [t * k * next_step, (t + 1) * k * next_step) of the next group */
    int64_t next_step = (NR * elem + tiles - 1) / tiles;
    /* With more than TURN_TILES float32 tiles a block (prompt chunks), only the first tile prefetches
     * the group ahead of its loads: the others find it in L2, where their prefetches only took issue
     * slots. On a 2-core Xeon (AMX, AVX-512; one process, alternating) prompts of 256, 512 and 1,024
     * tokens went 1.058x, 1.025x and 1.047x faster; 9-32 rows (turns, or tiles tuned off them on
     * other hosts) and bf16 weights are as they were; smaller blocks follow lead_ahead. */
    int first_tile_ahead = mode == 0 && (tiles > TURN_TILES || lead_ahead);
    const float *wide = mode == 1 && tiles >= wide_min_tiles && wide_copy_on ? widened_group(wp, g, k) : NULL;
    if (in_turns(mode, tiles, ncols, ahead)) {
        /* tile t of a turn prefetches its share of the weights TURN_AHEAD turns on (into `after` at the
         * end) */
        int64_t step = (NR * 4 + tiles - 1) / tiles, group_bytes = k * NR * 4;
        const char *group = (const char *)wp + g * group_bytes;
        for (int64_t k0 = 0; k0 < k; k0 += TURN_K) {
            int64_t at = (k0 + TURN_AHEAD * TURN_K) * NR * 4;
            const char *base = (at < group_bytes ? group + at : after + (at - group_bytes)) - k0 * step;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t m0 = b * MB + tile_start(rows, tiles, t), mr = b * MB + tile_start(rows, tiles, t + 1) - m0;
                tile_turn((const float *)x + m0 * k, k, wp, g, ty + (m0 - b * MB) * ldt, ldt, mr, k0,
                          k0 + TURN_K < k ? k0 + TURN_K : k, base + t * TURN_K * step, step);
            }
        }
    } else {
        for (int64_t t = 0; t < tiles; t++) {
            int64_t m0 = b * MB + tile_start(rows, tiles, t), mr = b * MB + tile_start(rows, tiles, t + 1) - m0;
            const char *xt = (const char *)x + m0 * k * (mode == 2 ? 2 : 4); /* pairs: 2 bytes a k step */
            const char *share = next ? next + t * k * next_step : NULL;
            if (wide)
                tile(xt, k, wide, 0, ty + (m0 - b * MB) * ldt, ldt, mr, ncols, 0, ahead, share, next_step);
            else
                tile(xt, k, wp, g, ty + (m0 - b * MB) * ldt, ldt, mr, ncols, mode,
                     ahead && (t == 0 || !first_tile_ahead), share, next_step);
        }
    }
}

/* act [m, n] = silu(gate) * up from a block's sums of gate group i and up group i (NR floats a row),
 * written by the thread that made them while they are in L1: kvs_silu_mul_f32's arithmetic, so the
 * same bits as the product and that pass one after the other. */
static inline __attribute__((always_inline)) void emit_silu(const float *gate, const float *up, float *act,
                                                            int64_t r0, int64_t r1, int64_t n, int64_t c0) {
    for (int64_t r = r0; r < r1; r++)
        for (int c = 0; c < NR; c += VW) {
            vf a = siluv(loadv(gate + (r - r0) * NR + c)) * loadv(up + (r - r0) * NR + c);
            memcpy(act + r * n + c0 + c, &a, sizeof a);
        }
}

/* The same for bf16 [m, n] act, as a bf16 model rounds: gate and up rounded to bf16 (as the product's
 * bf16 y holds them), then kvs_silu_mul_bf16's arithmetic on them. They are rounded in registers
 * (round_bf16v), not stored as bf16 and widened back: the same values, a NaN aside, and a NaN in
 * either comes out as the quiet NaN all the same (store_bf16v); 1.05x on a Zen 5 core. */
static inline __attribute__((always_inline)) void emit_silu_bf16(const float *gate, const float *up, uint16_t *act,
                                                                 int64_t r0, int64_t r1, int64_t n, int64_t c0) {
    for (int64_t r = r0; r < r1; r++)
        for (int c = 0; c < NR; c += VW) {
            vf g = round_bf16v(loadv(gate + (r - r0) * NR + c)), u = round_bf16v(loadv(up + (r - r0) * NR + c));
            store_bf16v(act + r * n + c0 + c, round_bf16v(siluv(g)) * u);
        }
}

/* The (block, group) tasks, taken by the threads in runs of consecutive tasks as each
 * thread comes free, each run half of what is left over the threads (OpenMP's guided schedule):
 * long runs first, so that a thread streams a long stretch of the weights and its tiles' prefetch
 * of the next group is mostly for itself, then shorter ones, so that neither thread waits long on
 * the other at the end.
 *
 * A fixed split (each thread a contiguous share of the rows, which also balanced a prefill chunk
 * against a last block of a few decode rows) left the threads waiting on each other wherever the
 * cores ran at different speeds: on a shared 2-core Zen 3 EPYC, taking runs as they come made a
 * step's products at 32 rows 1.11-1.27x faster and at 64 rows 1.16x (four lockstep runs, both
 * orders), at 1-8 rows even, and a whole batch-32 decode step 1.02-1.15x. Those runs were of equal
 * size, 8 a thread; on a Zen 4 EPYC the guided runs made a step's products 1.02-1.21x faster from
 * 1 to 64 rows in fp32 and 0.97-1.18x in bf16 pairs (lockstep, one copy of the weights for both
 * builds; 1.03-1.39x in an AVX2 build there; with the threads pinned and one core shared with a
 * busy loop, 0.95-1.27x), and whole decode steps at batch 1, 8 and 32 1.0-1.05x in fp32 and
 * 0.99-1.09x in bf16 (two engines in lockstep, both load orders). Which thread computes a tile
 * does not change its sums, so the bits do not change either.
 *
 * The order of the tasks. Rows come in panels of as many blocks as half the L2 holds of x (split
 * evenly), and within a panel the tasks run group by group, every block of the panel against a
 * group while its weights sit in L2:
 *
 *     panel 0: (g0, b0) (g0, b1) (g0, b2) (g1, b0) (g1, b1) ...   panel 1: (g0, b3) (g0, b4) ...
 *
 * so the weights stream from memory once a panel, where block by block they had streamed once a
 * block: a prompt chunk with a few decode rows beside it (256 + 4 rows: four blocks and one of four
 * rows) had read all the weights five times, the last for four rows. On a 2-core Xeon (2 MB of L2
 * a core; SmolLM2's float32 products, a step's weights from memory, toggled in one process) 260
 * rows took 1.18x less time, 268 1.13x, 292 1.08x, 388 1.10x and 520 1.09x; whole numbers of
 * blocks ran even, so long as x fit (with all of 512 or 1,024 rows in one panel, 0.96x and 0.93x:
 * hence the panels). One block is the decode case, unchanged. Where panels are of one block, a
 * short last block runs first (short_first_on).
 *
 * Elsewhere the panels cost more than they save. On a 2-core Zen 4 EPYC without AVX-512 (an AVX2
 * build, 1 MB of L2 a core; a layer's four float32 products of SmolLM2, four layers' weights,
 * alternating in one process), group by group within panels ran 1.08-1.17x slower than block by
 * block from 196 to 512 rows, also with panels of two blocks, while at 66, 70 and 130 rows (a last
 * block of 2, 6 and 2 rows) panels ran 1.13-1.52x faster: the short last block is what re-streams
 * the weights for little work. So there (row_panels_on 2) only a last block of MB / 2 rows or fewer
 * shares a panel, with the block before it, and the rest run block by block: as fast as the panels
 * at 66-130 rows and as block by block from 196 on. Which way a host runs is timed at load. */
static inline __attribute__((always_inline)) void tasks(const void *x, const void *wp, const float *bias, void *y,
                                                        int64_t m, int64_t n, int64_t k, int mode, int form) {
    /* Y_SILU, Y_SILU_BF16: wp holds 2n rows, the gate's n and then the up projection's (n a whole
     * number of groups), y is act [m, n] (float32, bf16); a task is a block against gate group g and
     * then up group g */
    int silu = form == Y_SILU || form == Y_SILU_BF16;
    int64_t groups = (n + NR - 1) / NR, blocks = (m + MB - 1) / MB, all = blocks * groups, elem = mode ? 2 : 4;
    int64_t group_bytes = k * NR * elem;
    float sums[MB * NR] __attribute__((aligned(64))); /* a block's sums against one group, for forms other than Y_F32 */
    float up_sums[silu ? MB * NR : 1] __attribute__((aligned(64)));
    int64_t fit = row_panels_on ? x_panel_bytes() / (MB * k * (mode == 2 ? 2 : 4)) : 1;
    int64_t panels = fit > 1 ? (blocks + fit - 1) / fit : blocks; /* panel p: blocks p B / P .. (p + 1) B / P - 1 */
    if (row_panels_on == 2) /* the short last block with the one before it: P = B - 1 puts both in the last panel */
        panels = fit > 1 && blocks >= 2 && m % MB != 0 && m % MB <= MB / 2 ? blocks - 1 : blocks;
    int short_first = short_first_on && panels == blocks && blocks > 1 && m % MB != 0;
#pragma omp for schedule(guided) nowait
    for (int64_t task = 0; task < all; task++) {
        int64_t p = task * panels / all; /* a first guess, then the panel whose tasks hold `task` */
        while (p > 0 && groups * (p * blocks / panels) > task) p--;
        while (p + 1 < panels && groups * ((p + 1) * blocks / panels) <= task) p++;
        int64_t b0 = p * blocks / panels, nb = (p + 1) * blocks / panels - b0, local = task - groups * b0;
        int64_t b = b0 + local % nb, g = local / nb;
        if (short_first) b = (b + blocks - 1) % blocks;
        int64_t m_end = (b + 1) * MB < m ? (b + 1) * MB : m;
        int ncols = (g + 1) * NR <= n ? NR : (int)(n - g * NR);
        /* from prefetch_min_rows rows on (see kvs_gemm_set_prefetch_rows); the next group only
         * where a block has more than one tile to share it: one tile (up to MR rows) prefetching
         * a whole group besides its own ran 1.07-1.14x slower at 6-8 rows (fp32 and bf16 pairs,
         * Zen 5 EPYC, a step's weights from memory), and without it 10-12 rows ran even, 16
         * rows 1.25x slower */
        int ahead = m >= prefetch_min_rows;
        int64_t tiles = (m_end - b * MB + MR - 1) / MR;
        /* the next group, by the panel's last block against this one (the others find this group in L2);
         * where that is the call's last block and fetches none of it (one tile, or float32 tiles in
         * turns), by the block before it. Prompt products of 272, 288 and 352 rows (a last block of 16,
         * 32 and 32) ran 1.034x, 1.024x and 1.021x faster on a 2-core Xeon with AMX (one process,
         * alternating; 256 rows, unchanged, 0.993x), whole prefills of 272 and 288 tokens 1.041x and
         * 1.013x. */
        int64_t last_tiles = (m - (blocks - 1) * MB + MR - 1) / MR;
        int64_t short_last =
            b0 + nb == blocks && nb > 1 && (last_tiles == 1 || in_turns(mode, last_tiles, ncols, ahead));
        int fetches = ahead && tiles > 1 && local % nb == nb - 1 - short_last;
        const char *w = wp;
        if (silu) {
            /* gate group g, then up group g (group groups + g), then gate group g + 1 */
            const char *up = w + (groups + g) * group_bytes, *gate_next = w + (g + 1) * group_bytes;
            block_group(x, wp, k, mode, b, m_end, g, NR, ahead, fetches ? up : NULL, up, sums, NR);
            block_group(x, wp, k, mode, b, m_end, groups + g, NR, ahead, fetches && g + 1 < groups ? gate_next : NULL,
                        gate_next, up_sums, NR);
            if (form == Y_SILU)
                emit_silu(sums, up_sums, y, b * MB, m_end, n, g * NR);
            else
                emit_silu_bf16(sums, up_sums, y, b * MB, m_end, n, g * NR);
            continue;
        }
        /* where the tiles leave their float32 sums: y itself, or the block's own buffer */
        int64_t ldt = form == Y_F32 ? n : NR;
        float *ty = form == Y_F32 ? (float *)y + b * MB * n + g * NR : sums;
        block_group(x, wp, k, mode, b, m_end, g, ncols, ahead,
                    fetches && g + 1 < groups ? w + (g + 1) * group_bytes : NULL, w + (g + 1) * group_bytes, ty, ldt);
        if (form != Y_F32)
            emit_rows(sums, bias, y, form, b * MB, m_end, n, g * NR, ncols);
        else if (bias)
            for (int64_t i = b * MB; i < m_end; i++)
                for (int64_t c = g * NR; c < g * NR + ncols; c++) ((float *)y)[i * n + c] += bias[c];
    }
}

/* Whether one row of float32 or widened bf16 takes two groups at a time (gemv_*_two_groups), where
 * built: on until the engine has timed both ways (CpuKernels.tune_two_groups). Returns the setting. */
static int two_groups_on = TWO_GROUPS;
int kvs_gemm_set_two_groups(int on) {
    two_groups_on = TWO_GROUPS && on;
    return two_groups_on;
}

static inline __attribute__((always_inline)) void gemm(const void *x, const void *wp, const float *bias, void *yv,
                                                       int64_t m, int64_t n, int64_t k, int mode, int form) {
    float *y = yv; /* float32 sums, the form of every call but the bf16 dot products' */
    int64_t groups = (n + NR - 1) / NR;
    /* one group of one tile (the greedy head's candidates) on the calling thread: no team to wake, and
     * none made afresh when the caller is inside a parallel region of one thread */
    int alone = groups == 1 && m <= MR;
    if (m == 1 && (mode == 1 || (mode == 0 && two_groups_on))) { /* one row streams on its own path */
        int64_t step = two_groups_on ? 2 : 1;
#pragma omp parallel for schedule(static) if (!alone)
        for (int64_t g = 0; g < groups; g += step) {
            int64_t last = g + step < groups ? g + step : groups; /* groups g .. last - 1 */
            int ncols = last * NR <= n ? NR : (int)(n - (last - 1) * NR);
#if TWO_GROUPS
            if (mode == 0 && last - g == 2)
                gemv_f32_two_groups(x, k, wp, g, y + g * NR, ncols);
            else if (mode == 0)
                tile(x, k, wp, g, y + g * NR, 1, 1, ncols, 0, 0, NULL, 0);
            else if (last - g == 2)
                gemv_bf16_two_groups(x, k, wp, g, y + g * NR, ncols);
            else
#endif
                gemv_bf16_group(x, k, wp, g, y + g * NR, ncols);
            if (bias)
                for (int64_t c = g * NR; c < (last - 1) * NR + ncols; c++) y[c] += bias[c];
        }
        return;
    }
#pragma omp parallel if (!alone)
    {
        /* a literal mode in each call: the parallel region is outlined into a function of its own,
         * where a mode read from the captured variables stayed a test inside the k loop */
        if (mode == 0)
            tasks(x, wp, bias, y, m, n, k, 0, Y_F32);
        else if (mode == 1)
            tasks(x, wp, bias, y, m, n, k, 1, Y_F32);
        else
            tasks(x, wp, bias, yv, m, n, k, 2, form);
    }
}

void kvs_gemm_f32(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    gemm(x, wp, bias, y, m, n, k, 0, Y_F32);
}

void kvs_silu_mul_f32(const float *gate_up, float *act, int64_t rows, int64_t inter);

/* act [m, inter] = silu(x Wg^T) * (x Wu^T), wp packing the gate's inter rows and then the up
 * projection's (an MLP's fused gate_up). With two rows or more and inter a whole number of groups,
 * in one pass: each task takes a block of rows against gate group g and then up group g and writes
 * their act columns from L1, where the product wrote gate_up [m, 2 inter] for a second parallel pass
 * (kvs_silu_mul_f32) to read back, half of it from the other core's cache. Otherwise (and with
 * kvs_gemm_set_fused_silu(0)) that product and pass, into gate_up. The sums and the SiLU are the same
 * arithmetic either way, so the same bits. */
static int fused_silu_on = 1;
int kvs_gemm_set_fused_silu(int on) { /* tests and benchmarks; returns the setting before */
    int was = fused_silu_on;
    fused_silu_on = on != 0;
    return was;
}

/* Whether kvs_gemm_f32_silu takes m rows of an MLP of `inter` in one pass. */
int kvs_gemm_silu_fuses(int64_t m, int64_t inter) { return fused_silu_on && m >= 2 && inter % NR == 0; }

void kvs_gemm_f32_silu(const float *x, const float *wp, float *gate_up, float *act, int64_t m, int64_t inter,
                       int64_t k) {
    if (kvs_gemm_silu_fuses(m, inter)) {
#pragma omp parallel
        tasks(x, wp, NULL, act, m, inter, k, 0, Y_SILU);
        return;
    }
    gemm(x, wp, NULL, gate_up, m, 2 * inter, k, 0, Y_F32);
    kvs_silu_mul_f32(gate_up, act, m, inter);
}

int kvs_amx_active(void);
int64_t kvs_amx_packed_elems(int64_t n, int64_t k);
void kvs_amx_pack(const uint16_t *w, uint16_t *wp, int64_t n, int64_t k);
void kvs_amx_gemm(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16, int64_t m,
                  int64_t n, int64_t k);
void kvs_widen_bf16(const uint16_t *src, int64_t src_stride, float *dst, int64_t rows, int64_t n);
void kvs_narrow_bf16(const float *src, uint16_t *dst, int64_t count);

/* Whether bf16 weights are packed in pairs for the dot-product kernel: asked for once per process,
 * before anything is packed (the layout follows), and only where the build has the instructions. */
static int dot_on = 0;

int kvs_bf16_dot_enable(int on) {
    dot_on = HAVE_DOT && on && !kvs_amx_active();
    return dot_on;
}

int kvs_bf16_dot_active(void) { return dot_on; }

static inline int64_t even(int64_t k) { return k + (k & 1); }

/* Rows [m, k] (row stride ldx) to the kernel's bf16 pairs, k padded to even with a zero: bf16 rows
 * copied, float32 rows rounded (x_f32). NULL where bf16 rows can be read as they are. The caller
 * frees it. */
static uint16_t *pairs_of(const void *x, int x_f32, int64_t ldx, int64_t m, int64_t k) {
    if (!x_f32 && !(k & 1) && ldx == k) return NULL;
    uint16_t *p = malloc((size_t)(m * even(k)) * sizeof *p);
    for (int64_t i = 0; i < m; i++) {
        if (x_f32)
            kvs_narrow_bf16((const float *)x + i * ldx, p + i * even(k), k);
        else
            memcpy(p + i * even(k), (const uint16_t *)x + i * ldx, (size_t)k * sizeof *p);
        if (k & 1) p[i * even(k) + k] = 0;
    }
    return p;
}

/* bf16 weights with float32 x: on AMX tiles once the process has them (csrc/amx_gemm.c; packed for
 * them too), in pairs on dot products where enabled (x rounded to bf16), else widened here. */
void kvs_gemm_bf16(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t m, int64_t n,
                   int64_t k) {
    if (kvs_amx_active()) {
        kvs_amx_gemm(x, 0, wp, bias, y, 0, m, n, k);
    } else if (dot_on) {
        uint16_t *p = pairs_of(x, 1, k, m, k);
        gemm(p, wp, bias, y, m, n, even(k), 2, Y_F32);
        free(p);
    } else {
        gemm(x, wp, bias, y, m, n, k, 1, Y_F32);
    }
}

/* bf16 weights and bf16 x [m, k] (row stride ldx), y [m, n] in `form` (Y_F32, Y_BF16 or
 * Y_BF16_IN_F32): on the dot products the rows go as they are, and each thread writes its own sums
 * in the form; otherwise they are widened for kvs_gemm_bf16 and the sums rounded after it (callers
 * on AMX tiles call kvs_amx_gemm). */
void kvs_gemm_bf16x(const uint16_t *x, int64_t ldx, const uint16_t *wp, const float *bias, void *y, int form,
                    int64_t m, int64_t n, int64_t k) {
    if (dot_on) {
        uint16_t *p = pairs_of(x, 0, ldx, m, k);
        gemm(p ? p : x, wp, bias, y, m, n, even(k), 2, form);
        free(p);
        return;
    }
    float *xf = malloc((size_t)(m * k) * sizeof *xf), *yf = form == Y_F32 ? y : malloc((size_t)(m * n) * sizeof *yf);
    kvs_widen_bf16(x, ldx, xf, m, k);
    kvs_gemm_bf16(xf, wp, bias, yf, m, n, k);
    if (form != Y_F32) {
        emit(yf, NULL, y, form, 0, m * n);
        free(yf);
    }
    free(xf);
}

void kvs_silu_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t rows, int64_t inter);

/* kvs_gemm_f32_silu for bf16 rows and weights, y rounded as a bf16 model rounds: in one pass on the
 * dot products, or with the weights widened (x widened first, as kvs_gemm_bf16x widens it), else
 * (AMX tiles, one row, or inter not whole groups) the product into gate_up [m, 2 inter] (bf16) and
 * kvs_silu_mul_bf16. The same sums either way, so the same bits. */
void kvs_gemm_bf16x_silu(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *gate_up, uint16_t *act,
                         int64_t m, int64_t inter, int64_t k) {
    if (dot_on && kvs_gemm_silu_fuses(m, inter)) {
        uint16_t *p = pairs_of(x, 0, ldx, m, k);
        const uint16_t *xp = p ? p : x;
#pragma omp parallel
        tasks(xp, wp, NULL, act, m, inter, even(k), 2, Y_SILU_BF16);
        free(p);
        return;
    }
    if (!dot_on && !kvs_amx_active() && kvs_gemm_silu_fuses(m, inter)) {
        float *xf = malloc((size_t)(m * k) * sizeof *xf);
        kvs_widen_bf16(x, ldx, xf, m, k);
#pragma omp parallel
        tasks(xf, wp, NULL, act, m, inter, k, 1, Y_SILU_BF16);
        free(xf);
        return;
    }
    kvs_gemm_bf16x(x, ldx, wp, NULL, gate_up, Y_BF16, m, 2 * inter, k);
    kvs_silu_mul_bf16(gate_up, act, m, inter);
}

int64_t kvs_gemm_group(void) { return NR; }

/* Elements of a packed [n, k] weight (elem 4: float32, 2: bf16). */
int64_t kvs_packed_elems(int64_t n, int64_t k, int64_t elem) {
    if (elem == 2 && kvs_amx_active()) return kvs_amx_packed_elems(n, k);
    return (n + NR - 1) / NR * NR * (elem == 2 && dot_on ? even(k) : k);
}

/* Group g of w [n, k] into its packed panel: columns past n zero, every element moved as the type it
 * is (a memcpy of a run-time size per element was a library call each, 0.4 s a SmolLM2 load). T is
 * uint32_t or uint16_t; PAIRS: bf16 in k pairs (kk_len = k rounded up to even; see the top of this file). */
#define PACK_GROUP(T, PAIRS)                                                                                     \
    do {                                                                                                         \
        const T *src = w;                                                                                        \
        T *dst = (T *)wp + g * NR * kk_len;                                                                      \
        int64_t cols = n - g * NR < NR ? n - g * NR : NR;                                                        \
        memset(dst, 0, (size_t)(NR * kk_len) * sizeof *dst);                                                     \
        for (int64_t c = 0; c < cols; c++) {                                                                     \
            const T *row = src + (g * NR + c) * k;                                                               \
            if (PAIRS)                                                                                           \
                for (int64_t kk = 0; kk < k; kk++) dst[((kk >> 1) * NR + c) * 2 + (kk & 1)] = row[kk];          \
            else                                                                                                 \
                for (int64_t kk = 0; kk < k; kk++) dst[kk * NR + c] = row[kk];                                   \
        }                                                                                                        \
    } while (0)

/* w [n, k] -> packed groups of NR columns (see the top of this file), for bf16 in k pairs where the
 * dot products are on, or AMX tiles where they are in use; elem is 4 (fp32) or 2 (bf16). Groups are
 * packed in parallel, each reading its rows in order. */
void kvs_pack(const void *w, void *wp, int64_t n, int64_t k, int64_t elem) {
    if (elem == 2 && kvs_amx_active()) {
        kvs_amx_pack(w, wp, n, k);
        return;
    }
    int pairs = elem == 2 && dot_on;
    int64_t groups = (n + NR - 1) / NR, kk_len = pairs ? even(k) : k;
#pragma omp parallel for schedule(static) if (n * k >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        if (elem == 4) PACK_GROUP(uint32_t, 0);
        else if (pairs) PACK_GROUP(uint16_t, 1);
        else PACK_GROUP(uint16_t, 0);
    }
}
