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
 * per block of up to MB rows of x, with no per-call repacking; that is where this beats a general
 * GEMM library at decode shapes.
 *
 * Prefetch: every tile of a group also pulls a share of the *next* group into L2, spread evenly
 * over the k steps of all the row tiles of the block. The weight stream is then fetched while the
 * cores compute, instead of in a burst during each group's first tile (25% faster at 32 rows with
 * weights coming from DRAM), and the current group is prefetched PF k steps ahead. Below
 * prefetch_min_rows rows (6, or 2 where the engine measured that it pays) both are left to the
 * hardware prefetcher, and one row has a path of its own (gemv_group). A prefetch never faults, so
 * running past the end is harmless.
 * bf16 weights are widened in registers; x and y are always float32. Built with
 * -ffp-contract=fast, so that `acc += x * w` is one fused multiply-add.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>

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
#define MB 64          /* rows of x per block, which stays in L2 while the groups stream past it */
#define PF 16          /* k steps of weight prefetch */

static inline __attribute__((always_inline)) vf load_weight(const void *w, int64_t idx, int is_bf16) {
    vf v;
    if (is_bf16) {
        v = widen_bf16((const uint16_t *)w + idx);
    } else {
        memcpy(&v, (const float *)w + idx, sizeof v);
    }
    return v;
}

static inline __attribute__((always_inline)) void micro(const float *x, int64_t k, const void *wp, int64_t g,
                                                        float *y, int64_t ldy, int mr, int ncols, int is_bf16,
                                                        int ahead, const char *next, int64_t next_step) {
    vf acc[MR][NP];
    UNROLL for (int i = 0; i < MR; i++)
        UNROLL for (int j = 0; j < NP; j++) acc[i][j] = (vf){0};
    int64_t base = g * k * NR;
    const char *pf = (const char *)wp + (base + PF * NR) * (is_bf16 ? 2 : 4);
    int64_t pf_step = NR * (is_bf16 ? 2 : 4);
    for (int64_t kk = 0; kk < k; kk++) {
        vf w[NP];
        UNROLL for (int j = 0; j < NP; j++) w[j] = load_weight(wp, base + kk * NR + VW * j, is_bf16);
        if (ahead)
            for (int64_t b = 0; b < pf_step; b += 64) __builtin_prefetch(pf + kk * pf_step + b);
        if (next)
            for (int64_t b = 0; b < next_step; b += 64) __builtin_prefetch(next + kk * next_step + b, 0, 2);
        UNROLL for (int i = 0; i < mr; i++) {
            float xv = x[i * k + kk];
            UNROLL for (int j = 0; j < NP; j++) acc[i][j] += xv * w[j];
        }
    }
    if (ncols == NR) {
        UNROLL for (int i = 0; i < mr; i++) memcpy(y + i * ldy, acc[i], sizeof acc[i]);
    } else {
        for (int i = 0; i < mr; i++) memcpy(y + i * ldy, acc[i], (size_t)ncols * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const void *wp, int64_t g,
                                                       float *y, int64_t ldy, int64_t mr, int ncols, int is_bf16,
                                                       int ahead, const char *next, int64_t next_step) {
    /* a constant row count lets each variant unroll fully and keep its accumulators in registers */
    switch (mr) {
#define ROWS(n) case n: micro(x, k, wp, g, y, ldy, n, ncols, is_bf16, ahead, next, next_step); break;
#if MR == 8
    ROWS(8) ROWS(7) ROWS(6) ROWS(5)
#endif
    ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
    default: micro(x, k, wp, g, y, ldy, 1, ncols, is_bf16, ahead, next, next_step); break;
    }
}

/* One row of x (a batch-1 decode step): the weights stream once, so this is a read of the packed
 * groups at memory speed. Each thread's groups are contiguous and read in order, which the hardware
 * prefetcher follows; the tile's prefetching of the next group, spread over its k steps, only cost
 * issue slots here (66 GB/s with it, 80-84 without, on a 2-core AMD EPYC with 40 fresh 7 MB
 * weights). bf16 weights, half the bytes per k step, are prefetched 64 k steps ahead. The sums
 * run in the tile's order, one fused multiply-add per k step in one accumulator, so a row's result
 * is the same bits whatever the number of rows beside it: outputs do not depend on how requests
 * were batched. (Four accumulators over alternate k steps read a few % faster.) */
static inline __attribute__((always_inline)) void gemv_group(const float *x, int64_t k, const void *wp, int64_t g,
                                                             float *y, int ncols, int is_bf16) {
    vf acc[NP];
    UNROLL for (int j = 0; j < NP; j++) acc[j] = (vf){0};
    int64_t base = g * k * NR;
    for (int64_t kk = 0; kk < k; kk++) {
        float xv = x[kk];
        if (is_bf16) { /* half the bytes per k step: the hardware prefetcher alone fell behind (66 -> 74 GB/s) */
            const char *ahead = (const char *)wp + (base + (kk + 64) * NR) * 2;
            __builtin_prefetch(ahead);
            __builtin_prefetch(ahead + 64);
        }
        UNROLL for (int j = 0; j < NP; j++) acc[j] += xv * load_weight(wp, base + kk * NR + VW * j, is_bf16);
    }
    memcpy(y, acc, (size_t)ncols * sizeof(float));
}

/* The first (block, group) task, in block-major order, before which at least `rows` rows of work lie
 * (a task's work is its block's row count; blocks are MB rows, the last one what is left). */
static int64_t task_at_rows(int64_t rows, int64_t m, int64_t groups) {
    int64_t blocks = (m + MB - 1) / MB, full = (blocks - 1) * MB * groups;
    if (rows <= full) {
        int64_t b = rows / (MB * groups), r = rows - b * MB * groups;
        return b * groups + (r + MB - 1) / MB;
    }
    int64_t last = m - (blocks - 1) * MB, r = rows - full;
    int64_t g = (r + last - 1) / last;
    return (blocks - 1) * groups + (g < groups ? g : groups);
}

/* The fewest rows for which the tiles prefetch their weights (the current group PF k steps ahead,
 * and a share of the next group). Whether 2-5 rows gain from it depends on the host: on a Zen 4
 * EPYC they ran 1.07-1.16x faster without (2 rows 62 -> 74 GB/s, 4 rows 62 -> 70), and on one
 * 2-core Xeon 3 rows 8-15% faster without; on another Xeon (Granite Rapids-class, 4 MB of L2 a
 * core) 3-5 rows took 1.14-1.30x longer without (a model's weights from memory at 5 rows: 23.1
 * against 17.7 ms). From 6 rows on it pays or is even everywhere measured. The engine times both
 * once per process on the model's own weights (CpuKernels.tune_prefetch) and sets it here. */
static int64_t prefetch_min_rows = 6;

void kvs_gemm_set_prefetch_rows(int64_t rows) { prefetch_min_rows = rows < 2 ? 2 : rows; }

static inline __attribute__((always_inline)) void gemm(const float *x, const void *wp, const float *bias, float *y,
                                                       int64_t m, int64_t n, int64_t k, int is_bf16) {
    int64_t groups = (n + NR - 1) / NR;
    if (m == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int ncols = (g + 1) * NR <= n ? NR : (int)(n - g * NR);
            gemv_group(x, k, wp, g, y + g * NR, ncols, is_bf16);
            if (bias)
                for (int64_t c = g * NR; c < g * NR + ncols; c++) y[c] += bias[c];
        }
        return;
    }
    /* Tasks are (block, group) pairs, block-major, and each thread takes a contiguous run of them
     * holding its share of the rows: split by count, a last block of a few rows (a prefill chunk
     * with a few decodes beside it: 512 + 4 rows is 8 full blocks and one of 4) left one thread
     * with less work, which then waited at the barrier (72 rows: half; on a Zen 4 EPYC, 72 rows took
     * 0.6x the time and 260 rows 0.83x once the rows were split). */
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t first = task_at_rows(m * groups * tid / nt, m, groups);
        int64_t end = task_at_rows(m * groups * (tid + 1) / nt, m, groups);
        for (int64_t task = first; task < end; task++) {
            int64_t b = task / groups, g = task % groups;
            int64_t m_end = (b + 1) * MB < m ? (b + 1) * MB : m;
            int ncols = (g + 1) * NR <= n ? NR : (int)(n - g * NR);
            /* tile t prefetches bytes [t * k * next_step, (t + 1) * k * next_step) of the next group */
            int64_t tiles = (m_end - b * MB + MR - 1) / MR, elem = is_bf16 ? 2 : 4;
            int64_t next_step = (NR * elem + tiles - 1) / tiles;
            /* from prefetch_min_rows rows on (see kvs_gemm_set_prefetch_rows) */
            int ahead = m >= prefetch_min_rows;
            const char *next = g + 1 < groups && ahead ? (const char *)wp + (g + 1) * k * NR * elem : NULL;
            for (int64_t m0 = b * MB, t = 0; m0 < m_end; m0 += MR, t++) {
                int64_t mr = m_end - m0 < MR ? m_end - m0 : MR;
                tile(x + m0 * k, k, wp, g, y + m0 * n + g * NR, n, mr, ncols, is_bf16, ahead,
                     next ? next + t * k * next_step : NULL, next_step);
            }
            if (bias)
                for (int64_t i = b * MB; i < m_end; i++)
                    for (int64_t c = g * NR; c < g * NR + ncols; c++) y[i * n + c] += bias[c];
        }
    }
}

void kvs_gemm_f32(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    gemm(x, wp, bias, y, m, n, k, 0);
}

int kvs_amx_active(void);
int64_t kvs_amx_packed_elems(int64_t n, int64_t k);
void kvs_amx_pack(const uint16_t *w, uint16_t *wp, int64_t n, int64_t k);
void kvs_amx_gemm(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16, int64_t m,
                  int64_t n, int64_t k);

/* bf16 weights: on AMX tiles once the process has them (csrc/amx_gemm.c; packed for them too), else
 * widened to float32 here. */
void kvs_gemm_bf16(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t m, int64_t n,
                   int64_t k) {
    if (kvs_amx_active()) {
        kvs_amx_gemm(x, 0, wp, bias, y, 0, m, n, k);
        return;
    }
    gemm(x, wp, bias, y, m, n, k, 1);
}

int64_t kvs_gemm_group(void) { return NR; }

/* Elements of a packed [n, k] weight (elem 4: float32, 2: bf16). */
int64_t kvs_packed_elems(int64_t n, int64_t k, int64_t elem) {
    if (elem == 2 && kvs_amx_active()) return kvs_amx_packed_elems(n, k);
    return (n + NR - 1) / NR * NR * k;
}

/* w [n, k] -> packed groups of NR columns (see the top of this file), or AMX tiles for bf16 where
 * they are in use; elem is 4 (fp32) or 2 (bf16). */
void kvs_pack(const void *w, void *wp, int64_t n, int64_t k, int64_t elem) {
    if (elem == 2 && kvs_amx_active()) {
        kvs_amx_pack(w, wp, n, k);
        return;
    }
    int64_t groups = (n + NR - 1) / NR;
    memset(wp, 0, (size_t)(groups * k * NR * elem)); /* columns past n stay zero */
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < NR && g * NR + c < n; c++)
                memcpy((char *)wp + ((g * k + kk) * NR + c) * elem, (const char *)w + ((g * NR + c) * k + kk) * elem,
                       (size_t)elem);
}
