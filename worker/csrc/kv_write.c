// Writing quantized K/V rows into the pool (the layouts are in worker/kv_format.py's docstring):
// one-byte codes with an fp16 scale per row (int8, fp8 e4m3 and e5m2), and int4. The same bytes as
// the formats' torch code, which stays the reference and serves other devices: every float
// operation below is the one torch does, in the same order, conversions rounding to nearest even
// as torch's do, and this file is compiled without fused multiply-adds so that nothing rounds
// differently. An int4 key write in torch costs some thirty small ops per layer; this is one pass.
//
// x, the rows written: token t's Hkv heads of D floats at x + t * x_stride (a view into a fused
// q/k/v projection is read in place).
//
// Values: each token's row holds its codes and one scale code per group of channels.
// Keys: a block's tokens share a step and zero point per channel, spread over the block's rows. A
// write dequantizes the block, puts the new tokens in, and re-fits each channel whose range no longer
// lies within half a step of its grid (then re-quantizes that channel's earlier tokens).
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

/* The step codes: steps[] is the 256 steps in increasing order (kv_format._STEP_TABLE). */
#define STEP_CODES 256
/* Zero points are stored in halves of a code. */
#define ZERO_UNITS 2.0f
/* The few smallest steps that cover a key channel's range, of which the fit takes the best. */
#define KEY_STEP_CANDIDATES 3

/* The smallest code whose step is >= s (255 at most). */
static int encode_step(const float *steps, float s) {
    int lo = 0, hi = STEP_CODES;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (steps[mid] < s)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < STEP_CODES ? lo : STEP_CODES - 1;
}

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
static inline float maxf(float a, float b) { return a > b ? a : b; }

/* float32 -> the nearest fp16 bits (ties to even), as torch's .half() */
static uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000) return sign | 0x7e00;  /* NaN */
    if (a >= 0x477ff000) return sign | 0x7c00; /* from 65520 on, infinity */
    if (a < 0x38800000) {                      /* below 2^-14: a multiple of 2^-24 (1024 of them is the least normal) */
        float v;
        memcpy(&v, &a, sizeof v);
        return sign | (uint16_t)nearbyintf(v * 0x1p24f);
    }
    uint32_t r = a - (112u << 23); /* the exponent rebiased from 127 to 15 */
    return sign | (uint16_t)((r + 0xfff + ((r >> 13) & 1)) >> 13);
}

/* float32 (within +-448) -> the nearest fp8 code (ties to even): e4m3 (bias 7, 3 mantissa bits) or
 * e5m2 (bias 15, 2 bits), as torch converts them. */
static uint8_t f32_to_fp8(float f, int e4m3) {
    const uint32_t bias = e4m3 ? 7 : 15, shift = e4m3 ? 20 : 21;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000) return sign | 0x7f; /* NaN */
    if (a < (128 - bias) << 23) {            /* below the least normal: a multiple of the least subnormal */
        float v;
        memcpy(&v, &a, sizeof v);
        return sign | (uint8_t)nearbyintf(v * (e4m3 ? 0x1p9f : 0x1p16f));
    }
    uint32_t r = a - ((127 - bias) << 23);
    return sign | (uint8_t)((r + (1u << (shift - 1)) - 1 + ((r >> shift) & 1)) >> shift);
}

/* Rows of D one-byte codes and the row's fp16 scale (max |x| / max_code): kind 1 int8 (codes
 * rounded, within +-127), 2 e4m3, 3 e5m2 (within +-max_code, converted). */
void kvs_codes_write(uint8_t *cache, int64_t num_kv_heads, int64_t head_dim, const float *x, int64_t x_stride,
                     const int64_t *slots, int64_t num_tokens, int kind, float max_code) {
    const int64_t rows = num_tokens * num_kv_heads, d = head_dim;
#pragma omp parallel for schedule(static) if (rows * d >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (r / num_kv_heads) * x_stride + (r % num_kv_heads) * d;
        uint8_t *row = cache + (slots[r / num_kv_heads] * num_kv_heads + r % num_kv_heads) * (d + 2);
        float amax = 0.0f;
        for (int64_t c = 0; c < d; c++) amax = fabsf(xr[c]) > amax ? fabsf(xr[c]) : amax;
        uint16_t half = f32_to_f16(amax / max_code);
        float scale = f16_to_f32(half), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t c = 0; c < d; c++) {
            float v = xr[c] * inv;
            if (kind == 1)
                row[c] = (uint8_t)(int8_t)clampf(nearbyintf(v), -127.0f, 127.0f);
            else
                row[c] = f32_to_fp8(clampf(v, -max_code, max_code), kind == 2);
        }
        row[d] = (uint8_t)(half & 0xff);
        row[d + 1] = (uint8_t)(half >> 8);
    }
}

static void pack_codes(uint8_t *dst, const float *codes, int64_t d) {
    for (int64_t j = 0; j < d / 2; j++)
        dst[j] = (uint8_t)((uint8_t)codes[2 * j] | ((uint8_t)codes[2 * j + 1] << 4));
}

void kvs_int4_write_values(uint8_t *cache, int64_t num_kv_heads, int64_t head_dim, int64_t row_width, int64_t group,
                           const float *x, int64_t x_stride, const int64_t *slots, int64_t num_tokens,
                           const float *steps) {
    const int64_t rows = num_tokens * num_kv_heads, d = head_dim;
#pragma omp parallel for schedule(static) if (rows * d >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (r / num_kv_heads) * x_stride + (r % num_kv_heads) * d;
        uint8_t *row = cache + (slots[r / num_kv_heads] * num_kv_heads + r % num_kv_heads) * row_width;
        float codes[256];
        memset(row + d / 2, 0, (size_t)(row_width - d / 2));
        for (int64_t g = 0; g < d / group; g++) {
            const float *xg = xr + g * group;
            float lo = xg[0], hi = xg[0];
            for (int64_t c = 1; c < group; c++) {
                lo = xg[c] < lo ? xg[c] : lo;
                hi = xg[c] > hi ? xg[c] : hi;
            }
            // codes -8..7 reach from -8.5 to 7.5 scales within half a step; the scale code rounds up
            int code = encode_step(steps, maxf(hi / 7.5f, lo / -8.5f));
            float scale = steps[code];
            for (int64_t c = 0; c < group; c++)
                codes[g * group + c] = clampf(nearbyintf(xg[c] / scale), -8.0f, 7.0f) + 8.0f;
            row[d / 2 + g] = (uint8_t)code;
        }
        pack_codes(row, codes, d);
    }
}

/* |x - its value| on the grid step * (code - zero), codes 0..15. */
static float grid_error(float x, float step, float zero) {
    float code = clampf(nearbyintf(x / step + zero), 0.0f, 15.0f);
    return fabsf((code - zero) * step - x);
}

/* A channel's range -> its step code and zero point (in codes, a multiple of 1/ZERO_UNITS);
   kv_format._fit_key_params says why. */
static void fit_key_channel(const float *steps, float low, float high, int *code_out, float *zero_out) {
    const float reach_up = 15.5f + 128 / ZERO_UNITS, reach_down = 127 / ZERO_UNITS + 0.5f;
    float need = maxf((high - low) / 15.0f, maxf(high / reach_up, low / -reach_down));
    int first_code = encode_step(steps, need);
    float best = INFINITY;
    for (int j = 0; j < KEY_STEP_CANDIDATES; j++) {
        int code = first_code + j < STEP_CODES ? first_code + j : STEP_CODES - 1;
        float step = steps[code];
        float ratio = (high - low) / step;
        float n = nearbyintf(ratio);
        n = n > 15.0f ? 15.0f : n;
        float first = floorf((15.0f - n) / 2.0f);
        float a = first - low / step, b = (ratio - n) / 2.0f;
        float zero = clampf(nearbyintf((a - b) * ZERO_UNITS), -128.0f, 127.0f) / ZERO_UNITS;
        float cost = maxf(grid_error(low, step, zero), grid_error(high, step, zero)) + step / 4.0f;
        if (j == 0 || cost < best) {
            best = cost;
            *code_out = code;
            *zero_out = zero;
        }
    }
}

typedef struct {
    int64_t block, token;
} BlockToken;

static int by_block_then_token(const void *a, const void *b) {
    const BlockToken *p = a, *q = b;
    if (p->block != q->block) return p->block < q->block ? -1 : 1;
    return p->token < q->token ? -1 : (p->token > q->token);
}

/* One block's keys of one head: the block's rows dequantized into held [bs, D], then `n` tokens
   (ts[i].token of x, each at its slot's offset), a re-fit where needed, and the block written back. */
static void write_block_keys(uint8_t *cache, int64_t bs, int64_t hkv, int64_t d, int64_t width, const float *x,
                             int64_t x_stride, const int64_t *slots, const BlockToken *ts, int64_t n, int64_t head,
                             const float *steps, int starts_blocks, float *held, uint8_t *params) {
    const int64_t extra = width - d / 2, block = ts[0].block;
    uint8_t *base = cache + block * bs * hkv * width + head * width;
#define ROW(o) (base + (o) * hkv * width)
    for (int64_t o = 0; o < bs; o++) memcpy(params + o * extra, ROW(o) + d / 2, (size_t)extra);
    /* each channel's step and zero point as floats, so that the loops over a block's rows vectorize */
    float step[256], zero[256], low[256], high[256], codes[256];
    for (int64_t c = 0; c < d; c++) {
        step[c] = steps[params[c]];
        zero[c] = (float)(int8_t)params[d + c] / ZERO_UNITS;
    }
    int fresh = 0;
    for (int64_t i = 0; i < n; i++) fresh |= starts_blocks && slots[ts[i].token] % bs == 0;
    if (fresh) {
        // a recycled block's rows take a new token's value, so the block's range is its own tokens'
        const float *first = x + ts[0].token * x_stride + head * d;
        for (int64_t o = 0; o < bs; o++) memcpy(held + o * d, first, (size_t)d * sizeof(float));
    } else {
        for (int64_t o = 0; o < bs; o++) {
            const uint8_t *row = ROW(o);
            float *h = held + o * d;
            for (int64_t j = 0; j < d / 2; j++) {
                h[2 * j] = ((float)(row[j] & 15) - zero[2 * j]) * step[2 * j];
                h[2 * j + 1] = ((float)(row[j] >> 4) - zero[2 * j + 1]) * step[2 * j + 1];
            }
        }
    }
    for (int64_t i = 0; i < n; i++)
        memcpy(held + (slots[ts[i].token] % bs) * d, x + ts[i].token * x_stride + head * d, (size_t)d * sizeof(float));
    memcpy(low, held, (size_t)d * sizeof(float));
    memcpy(high, held, (size_t)d * sizeof(float));
    for (int64_t o = 1; o < bs; o++)
        for (int64_t c = 0; c < d; c++) {
            float v = held[o * d + c];
            low[c] = v < low[c] ? v : low[c];
            high[c] = v > high[c] ? v : high[c];
        }
    for (int64_t c = 0; c < d; c++) {
        // a channel keeps its grid, and so its earlier codes, while its values lie within half a step of it
        if (fresh || !(low[c] >= (-0.5f - zero[c]) * step[c] && high[c] <= (15.5f - zero[c]) * step[c])) {
            int code;
            fit_key_channel(steps, low[c], high[c], &code, &zero[c]);
            params[c] = (uint8_t)code;
            params[d + c] = (uint8_t)(int8_t)nearbyintf(zero[c] * ZERO_UNITS);
            step[c] = steps[code];
        }
    }
    memset(params + 2 * d, 0, (size_t)(bs * extra - 2 * d));
    for (int64_t o = 0; o < bs; o++) {
        uint8_t *row = ROW(o);
        const float *h = held + o * d;
        for (int64_t c = 0; c < d; c++) codes[c] = clampf(nearbyintf(h[c] / step[c] + zero[c]), 0.0f, 15.0f);
        pack_codes(row, codes, d);
        memcpy(row + d / 2, params + o * extra, (size_t)extra);
    }
#undef ROW
}

/* Returns 0, or -1 when out of memory (then nothing is written). */
int kvs_int4_write_keys(uint8_t *cache, int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
                        const float *x, int64_t x_stride, const int64_t *slots, int64_t num_tokens,
                        const float *steps, int starts_blocks) {
    const int64_t bs = block_size, d = head_dim, extra = row_width - d / 2;
    const int64_t threads = omp_get_max_threads();
    const size_t scratch = (size_t)(bs * d) * sizeof(float) + (size_t)(bs * extra);  // held, then params
    BlockToken *ts = malloc((size_t)num_tokens * sizeof *ts);
    int64_t *starts = malloc((size_t)(num_tokens + 1) * sizeof *starts);
    char *buffers = malloc((size_t)threads * scratch);
    if (ts == NULL || starts == NULL || buffers == NULL) {
        free(ts);
        free(starts);
        free(buffers);
        return -1;
    }
    for (int64_t i = 0; i < num_tokens; i++) ts[i] = (BlockToken){slots[i] / bs, i};
    qsort(ts, (size_t)num_tokens, sizeof *ts, by_block_then_token);
    int64_t num_blocks = 0;
    for (int64_t i = 0; i < num_tokens; i++)
        if (i == 0 || ts[i].block != ts[i - 1].block) starts[num_blocks++] = i;
    starts[num_blocks] = num_tokens;
    const int64_t tasks = num_blocks * num_kv_heads;
#pragma omp parallel num_threads(threads) if (tasks * bs * d >= 65536)
    {
        char *mine = buffers + (size_t)omp_get_thread_num() * scratch;
        float *held = (float *)mine;
        uint8_t *params = (uint8_t *)(mine + (size_t)(bs * d) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t b = t / num_kv_heads;
            write_block_keys(cache, bs, num_kv_heads, d, row_width, x, x_stride, slots, ts + starts[b],
                             starts[b + 1] - starts[b],
                             t % num_kv_heads, steps, starts_blocks, held, params);
        }
    }
    free(ts);
    free(starts);
    free(buffers);
    return 0;
}
