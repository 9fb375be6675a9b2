/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the block pool.
 *
 * Head sizes 64 and 128, every row format, go to the two-pass kernel of dense_decode.c. Other head
 * sizes run here, one task per (sequence, KV head) and one query at a time, with scalar dot products
 * and an online softmax per block.
 *
 *   k_cache, v_cache: [num_blocks, block_size, Hkv, row], rows as kv_rows.h describes
 *   q, out:           [B, H, D] float32, or bf16 for kvs_paged_decode_bf16_rows; q's rows are q_stride
 *                     elements apart
 *   block_tables:     [B, W] int64, seq_lens: [B] int64 (tokens to attend, this step's included)
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "kv_rows.h"

/* A head size other than 64 and 128: one query at a time, scalar dots. */
static void decode_query_generic(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                                 int64_t ctx, float *out, int64_t kv_head, int64_t num_kv_heads, int64_t d,
                                 int64_t bs, float scale, const RowFormat *f, float *work) {
    float *s = work, *buf = s + bs, *acc = buf + d, *kp = acc + d;
    const float *key_params = f->kind == ROW_INT4 ? kp : NULL;
    float m = -1e30f, l = 0.0f;
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    int64_t num_blocks = (ctx + bs - 1) / bs;
    for (int64_t ib = 0; ib < num_blocks; ib++) {
        int64_t block = table[ib], n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
        if (key_params != NULL) int4_key_params(k_cache, block, bs, num_kv_heads, kv_head, d, f, kp);
        for (int64_t j = 0; j < n; j++) {
            const float *kr = load_row(k_cache, (block * bs + j) * num_kv_heads + kv_head, d, f, key_params, buf);
            float t = 0.0f;
            for (int64_t i = 0; i < d; i++) t += q[i] * kr[i];
            s[j] = t * scale;
        }
        float mx = m;
        for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
        float corr = expf(m - mx), sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - mx);
            sum += s[j];
        }
        for (int64_t i = 0; i < d; i++) acc[i] *= corr;
        for (int64_t j = 0; j < n; j++) {
            const float *vr = load_row(v_cache, (block * bs + j) * num_kv_heads + kv_head, d, f, NULL, buf);
            for (int64_t i = 0; i < d; i++) acc[i] += s[j] * vr[i];
        }
        m = mx;
        l = l * corr + sum;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t i = 0; i < d; i++) out[i] = acc[i] * inv;
}

/* Tasks are whole sequences from SEQUENCES_PER_THREAD sequences a thread (dense_decode.c), so that
 * a task reads its blocks' rows of all heads as dense runs; with fewer there are too few such tasks
 * to share out, and the two-pass kernel takes single chunks of context instead. */
#define SEQUENCES_PER_THREAD 4

void kvs_dense_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t batch,
                      int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width, float scale,
                      const RowFormat *f, int by_sequence, int bf16_io);

/* q [B, H, d] (rows q_stride apart) and out [B, H, d]: float32, or with bf16_io bf16 (q widened and
 * out rounded by the tasks themselves, the same values as a widening pass before and a narrowing
 * pass after would give). */
static void decode_all(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                       const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t batch,
                       int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width, float scale,
                       const RowFormat *f, int bf16_io) {
    if (d == 64 || d == 128) {
        int by_sequence = batch >= SEQUENCES_PER_THREAD * omp_get_max_threads();
        kvs_dense_decode(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d,
                         bs, width, scale, f, by_sequence, bf16_io);
        return;
    }
    int64_t group = num_heads / num_kv_heads, tasks = batch * num_kv_heads;
    size_t work_floats = (size_t)(bs + 6 * d); /* decode_query_generic's, then a widened q row and an out row */
#pragma omp parallel
    {
        float *work = malloc(work_floats * sizeof(float));
        float *q_row = work + bs + 4 * d, *out_row = q_row + d;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            for (int64_t g = 0; g < group; g++) {
                int64_t head = h * group + g, q_at = b * q_stride + head * d, out_at = (b * num_heads + head) * d;
                if (!bf16_io) {
                    decode_query_generic((const float *)q + q_at, k_cache, v_cache, block_tables + b * width,
                                         seq_lens[b], (float *)out + out_at, h, num_kv_heads, d, bs, scale, f, work);
                    continue;
                }
                for (int64_t i = 0; i < d; i++) q_row[i] = bf16_to_f32(((const uint16_t *)q)[q_at + i]);
                decode_query_generic(q_row, k_cache, v_cache, block_tables + b * width, seq_lens[b], out_row, h,
                                     num_kv_heads, d, bs, scale, f, work);
                for (int64_t i = 0; i < d; i++) ((uint16_t *)out)[out_at + i] = to_bf16(out_row[i]);
            }
        }
        free(work);
    }
}

void kvs_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                          int64_t width, float scale) {
    RowFormat f = {ROW_F32, NULL, 0, 0, CODES_TABLE};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f, 0);
}

void kvs_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                           int64_t width, float scale) {
    RowFormat f = {ROW_BF16, NULL, 0, 0, CODES_TABLE};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f, 0);
}

/* The same with q and out as bf16 (a bf16 model's fused layer: its q/k/v rows and its attention
 * rows as they are, no widening pass before nor narrowing pass after; csrc/layer.c). */
void kvs_paged_decode_bf16_rows(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *block_tables, const int64_t *seq_lens,
                                uint16_t *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                                int64_t bs, int64_t width, float scale) {
    RowFormat f = {ROW_BF16, NULL, 0, 0, CODES_TABLE};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f, 1);
}

/* Byte-code rows (int8, fp8): lut maps each code to its value before the row's scale. */
void kvs_paged_decode_codes(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out,
                            int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                            int64_t width, float scale, const float *lut) {
    RowFormat f = {ROW_CODES, lut, 0, 0, codes_kind(lut)};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f, 0);
}

/* int4 rows (see the top): lut maps each scale byte to its step; extra = E, v_group = channels per value scale. */
void kvs_paged_decode_int4(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs,
                           int64_t width, float scale, const float *lut, int64_t extra, int64_t v_group) {
    RowFormat f = {ROW_INT4, lut, extra, v_group, CODES_TABLE};
    decode_all(q, q_stride, k_cache, v_cache, block_tables, seq_lens, out, batch, num_heads, num_kv_heads, d, bs,
               width, scale, &f, 0);
}

/* Which decoding byte-code rows with this table get (CODES_*: 0 the table itself, 1 int8, 2 fp8
 * e4m3, 3 fp8 e5m2 by arithmetic in vector registers). */
int kvs_codes_kind(const float *lut) { return codes_kind(lut); }
