/* bf16 projections on AMX tiles, where the CPU has them (Intel Xeon from Sapphire Rapids on): y[M, N]
 * = x[M, K] @ W[N, K]^T (+ bias), x rounded to bf16 (exact for a bf16 model's activations), sums
 * in float32; x float32 or bf16, y float32, bf16 (rounded to nearest, ties to even, as torch
 * converts), or float32 holding those bf16 values (a bf16 model's logits, as the sampler reads them).
 *
 * One tile multiply (TDPBF16PS) takes 16 rows of x by 32 k steps (A, 1 KB) against 32 k steps of 16
 * columns (B, 1 KB, k steps in pairs: row r holds k = 2r and 2r + 1 of each column) into 16 x 16
 * float32 sums (C). Eight tile registers hold A for 32 rows, B for 32 columns and the four C tiles
 * between them. Weights are packed once at load into B tiles, in the order the kernel reads them:
 *
 *     wp[j][kb][t] = the B tile of columns 32 j + 16 t .. + 15, k steps 32 kb .. 32 kb + 31
 *
 * (columns past N and k steps past K are zero). Each thread takes runs of adjacent column pairs j
 * and, for each, runs every 32-row block of x against that pair's tiles, which stay in L2 meanwhile;
 * x, converted and padded once per call, stays in L2 too. A decode step's product is then a single
 * pass over the weights: on a 2-core Xeon with AMX, a SmolLM2 step's bf16 projections took 8.2-8.6
 * ms from 1 to 16 rows and 10.7 ms at 32 (25 and 20 GB/s), against 11.4-14.0 ms for oneDNN and
 * 10.6-25 ms for the widening kernel (csrc/gemm.c). Each row's sums are formed from its own row of
 * x alone, in the same order whatever the rows beside it, so outputs do not depend on batching.
 *
 * Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once per process:
 * kvs_amx_enable asks, and the bf16 GEMM and packing use tiles only once it has succeeded.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h" /* to_bf16, y's forms */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define TK 32 /* k steps per tile */
/* Weights are prefetched into L2 this far ahead of the tile loads (two k blocks of a column pair),
 * running on into the thread's next pair. A tile load is 16 lines at once, and with the hardware
 * prefetcher alone too few lines were in flight whenever the memory was busy: on a 2-core Xeon
 * (Emerald Rapids, AMX), a SmolLM2 step's bf16 products at 1-32 rows ran 1.1-1.35x faster with
 * it (15-17 -> 18-23 GB/s), and within 1% of the same when the memory was quiet; 2, 6, 8 and
 * 16 KB ahead were within a few percent of 4 KB, into L1 no better; decode steps at batch 1, 8
 * and 32 ran 1.17-1.28x faster. One line in four (the hardware prefetcher fetching the rest) ran
 * even with it on a Xeon of the 480 MB-L3 class, toggled in one build, and 1.04-1.10x slower inside
 * the engine's decode steps. The prefetches follow a k block's tile loads and products instead of
 * preceding them, so that the B tiles' loads, which the products wait on, do not queue behind 32
 * prefetched lines for the core's few outstanding misses (the likely cause; only the whole was
 * measured). On a Xeon of that class (placement toggled in one engine between rounds, the layers'
 * stage timers) a bf16 step's products took 1.12x less time at 1 row (8.35 -> 7.44 ms), 1.08x at 4,
 * 1.05x at 8, 1.07x at 16 and the same at 32; a float32 model's greedy head 1.05-1.11x less. */
#define AHEAD_BYTES 4096
#define X_BUF_KEEP ((size_t)1 << 21) /* bf16 elements of x a thread keeps between calls (4 MB) */

static int amx_on = 0;

/* 1 once the process may use AMX tiles (asked here, once), else 0: not built for them, or refused. */
int kvs_amx_enable(void) {
#if HAVE_AMX
    if (!amx_on) amx_on = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
    return amx_on;
}

int kvs_amx_active(void) { return amx_on; }

/* Elements of a packed [n, k] bf16 weight. */
int64_t kvs_amx_packed_elems(int64_t n, int64_t k) { return (n + 31) / 32 * 32 * ((k + TK - 1) / TK * TK); }

void kvs_amx_pack(const uint16_t *w, uint16_t *wp, int64_t n, int64_t k) {
    int64_t pairs = (n + 31) / 32, kb_count = (k + TK - 1) / TK;
    memset(wp, 0, (size_t)kvs_amx_packed_elems(n, k) * sizeof(uint16_t));
    for (int64_t j = 0; j < pairs; j++)
        for (int64_t kb = 0; kb < kb_count; kb++)
            for (int t = 0; t < 2; t++) {
                uint16_t *tile = wp + ((j * kb_count + kb) * 2 + t) * 512;
                for (int c = 0; c < 16; c++) {
                    int64_t col = j * 32 + t * 16 + c;
                    if (col >= n) break;
                    for (int64_t kk = kb * TK; kk < k && kk < (kb + 1) * TK; kk++)
                        tile[((kk - kb * TK) / 2 * 16 + c) * 2 + kk % 2] = w[col * k + kk];
                }
            }
}

#if HAVE_AMX
/* Rows r0 .. r0 + rows - 1 (rows <= 32) of y against column pair j. Tiles: 0, 1 A (rows 0-15,
 * 16-31); 2, 3 B (the pair's two column tiles); 4-7 C (A row tile x B column tile). */
static inline __attribute__((always_inline)) void pair_block(const uint16_t *xp, int64_t ldx, const uint16_t *wj,
                                                             int64_t kb_count, const float *bias, void *y,
                                                             int y_bf16, int64_t n, int64_t j, int64_t r0,
                                                             int64_t rows, float *out) {
    int two = rows > 16;
    _tile_zero(4);
    _tile_zero(5);
    if (two) {
        _tile_zero(6);
        _tile_zero(7);
    }
    const uint16_t *a = xp + r0 * ldx;
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(2, wj + kb * 1024, 64);
        _tile_loadd(3, wj + kb * 1024 + 512, 64);
        _tile_loadd(0, a + kb * TK, ldx * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (two) {
            _tile_loadd(1, a + 16 * ldx + kb * TK, ldx * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
        if (r0 == 0) { /* the first block streams the pair's weights; later blocks find them in L2 */
            const char *pf = (const char *)(wj + kb * 1024) + AHEAD_BYTES;
            for (int b = 0; b < 2048; b += 64) __builtin_prefetch(pf + b, 0, 2);
        }
    }
    _tile_stored(4, out, 128);
    _tile_stored(5, out + 16, 128);
    if (two) {
        _tile_stored(6, out + 16 * 32, 128);
        _tile_stored(7, out + 16 * 32 + 16, 128);
    }
    int64_t cols = n - j * 32 < 32 ? n - j * 32 : 32;
    for (int64_t i = 0; i < rows; i++) {
        float *src = out + i * 32;
        if (bias != NULL)
            for (int64_t c = 0; c < cols; c++) src[c] += bias[j * 32 + c];
        int64_t at = (r0 + i) * n + j * 32;
        if (y_bf16 == Y_BF16) {
            uint16_t *dst = (uint16_t *)y + at;
            for (int64_t c = 0; c < cols; c++) dst[c] = to_bf16(src[c]);
        } else if (y_bf16 == Y_BF16_IN_F32) {
            float *dst = (float *)y + at;
            for (int64_t c = 0; c < cols; c++) {
                uint32_t u = (uint32_t)to_bf16(src[c]) << 16;
                memcpy(dst + c, &u, sizeof u);
            }
        } else {
            memcpy((float *)y + at, src, (size_t)cols * sizeof(float));
        }
    }
}

/* A zeroed-once buffer of `elems` bf16 for x: the calling thread's own, kept from call to call, for
 * a decode step's few rows (no allocation and no memset of 32-row blocks a call), or for larger x a
 * new one that the caller frees (*owned). */
static uint16_t *x_buffer(size_t elems, int *owned) {
    static _Thread_local uint16_t *kept = NULL;
    static _Thread_local size_t kept_elems = 0;
    *owned = elems > X_BUF_KEEP;
    if (!*owned && elems <= kept_elems) return kept;
    uint16_t *buf = aligned_alloc(64, (elems * sizeof(uint16_t) + 63) / 64 * 64);
    memset(buf, 0, elems * sizeof(uint16_t));
    if (!*owned) {
        free(kept);
        kept = buf;
        kept_elems = elems;
    }
    return buf;
}
#endif

/* One row of x against single 16-column tiles of a packed weight, for a bf16 model's greedy head
 * (csrc/greedy_head.c), which needs the logits of a few columns exactly as kvs_amx_gemm computes
 * them: the same tile products over the same k blocks, one C tile of a single row, so the same
 * sums, from one of a pair's two tiles (half its bytes). kvs_amx_row_config loads the
 * tile shapes (A one row, B 16, C one row) on the calling thread; then each kvs_amx_row_tile call
 * gives tile `tile` (columns 16 tile .. + 15) of x padded with zeros to kb_count k blocks (xp), its
 * sums rounded to bf16 and held in float32 (Y_BF16_IN_F32) into out [16]; kvs_amx_row_release
 * ends it. Only once kvs_amx_enable has returned 1. */
void kvs_amx_row_config(void) {
#if HAVE_AMX
    load_tile_rows((const uint8_t[8]){1, 0, 16, 0, 1, 0, 0, 0});
#endif
}

void kvs_amx_row_tile(const uint16_t *xp, const uint16_t *wp, int64_t kb_count, int64_t tile, float *out) {
#if HAVE_AMX
    float sums[16] __attribute__((aligned(64)));
    const uint16_t *w = wp + (tile / 2) * kb_count * 1024 + (tile % 2) * 512;
    _tile_zero(4);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(0, xp + kb * TK, 64);
        _tile_loadd(2, w + kb * 1024, 64);
        _tile_dpbf16ps(4, 0, 2);
    }
    _tile_stored(4, sums, 64);
    for (int c = 0; c < 16; c++) {
        uint32_t u = (uint32_t)to_bf16(sums[c]) << 16;
        memcpy(out + c, &u, sizeof u);
    }
#else
    (void)xp, (void)wp, (void)kb_count, (void)tile, (void)out;
#endif
}

void kvs_amx_row_release(void) {
#if HAVE_AMX
    _tile_release();
#endif
}

/* x [m, k] (bf16 when x_bf16, else float32), y [m, n] (y_bf16: 0 float32, 1 bf16, 2 float32 holding
 * the bf16 values), bias [n] float32 or NULL; wp packed by kvs_amx_pack. Only once kvs_amx_enable has
 * returned 1. The bf16 values in float32 save a pass and a bf16 copy where the caller would widen y:
 * a bf16 model's logits at 32 rows are 3 MB of bf16 that torch then widened to 6.3 MB of float32 in
 * 0.5 ms after the product (a 2-core Xeon, caches cold). */
void kvs_amx_gemm(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16, int64_t m,
                  int64_t n, int64_t k) {
#if HAVE_AMX
    int64_t pairs = (n + 31) / 32, kb_count = (k + TK - 1) / TK, ldx = kb_count * TK;
    int64_t blocks = (m + 31) / 32;
    /* x as bf16, rows padded to whole 32-row blocks and k to whole tiles. Only the k padding of rows
     * below m must be zero (it meets the weights' zero padding); rows past m hold numbers from an
     * earlier call at most, and a tile row's sums come from its own row of x alone and are dropped */
    int owned;
    uint16_t *xp = x_buffer((size_t)(blocks * 32 * ldx), &owned);
    for (int64_t i = 0; i < m; i++) {
        if (x_bf16) {
            memcpy(xp + i * ldx, (const uint16_t *)x + i * k, (size_t)k * sizeof(uint16_t));
        } else {
            for (int64_t kk = 0; kk < k; kk++) xp[i * ldx + kk] = to_bf16(((const float *)x)[i * k + kk]);
        }
        memset(xp + i * ldx + k, 0, (size_t)(ldx - k) * sizeof(uint16_t));
    }
#pragma omp parallel if (pairs > 1)
    {
        uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        if (blocks == 1) {
            /* A and C tiles of only the rows there are (a decode step's few): every A tile had loaded
             * 16 rows of x, 16 lines a k block beside the weights' 32, padding included. Each row's
             * sums are its own, so the bits stay. On a 2-core Xeon with AMX, toggled in one engine,
             * bf16 decode steps ran 0.99-1.01x: the tiles' reads of x were not what waited there */
            uint8_t r0 = (uint8_t)(m < 16 ? m : 16), r1 = (uint8_t)(m > 16 ? m - 16 : 1);
            rows[0] = rows[4] = rows[5] = r0;
            rows[1] = rows[6] = rows[7] = r1;
        }
        load_tile_rows(rows);
        float out[32 * 32] __attribute__((aligned(64)));
        /* runs of column pairs, each half of what is left over the threads (OpenMP's guided
         * schedule): with half the pairs each, the worker thread of a 2-core Emerald Rapids VM took
         * 1.15-1.25x the main thread's time on the same work (either half), and the main thread
         * waited; with runs, the products ran 0.94-1.12x the time of halves (1.08-1.12x faster at
         * 32-64 rows) and decode steps 0.98-1.09x */
#pragma omp for schedule(guided) nowait
        for (int64_t j = 0; j < pairs; j++) {
            const uint16_t *wj = wp + j * kb_count * 1024;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t rows = m - b * 32 < 32 ? m - b * 32 : 32;
                pair_block(xp, ldx, wj, kb_count, bias, y, y_bf16, n, j, b * 32, rows, out);
            }
        }
        _tile_release();
    }
    if (owned) free(xp);
#else
    (void)x, (void)x_bf16, (void)wp, (void)bias, (void)y, (void)y_bf16, (void)m, (void)n, (void)k;
#endif
}
