/* A step's layer in one call, packed weights: its decodes, and with K/V rows of the model's dtype
 * also the prefill chunks after them. float32 (kvs_layer_f32):
 *
 *   qkv = x Wqkv^T (+ b); RoPE and the K/V write; attention (the decode rows, then the prefill
 *   chunks', each attending causally to its context); o = attn Wo^T;
 *   residual += o; x = norm(residual) * post_norm; gate_up = x Wgu^T; act = silu(gate) * up;
 *   o = act Wdown^T; residual += o; x = norm(residual) * next_norm (the next layer's input norm;
 *   without one, the last layer, only the add)
 *
 * bf16 (kvs_layer_bf16): the same stages with csrc/bf16_ops.c's rounding; the GEMM and attention
 * read float32, so their inputs are widened into `wide_in` and their outputs, in `wide_out`,
 * rounded back, as CpuKernels.gemm and paged_decode (and attention.py for prefills) do from Python.
 *
 * float32 also takes quantized K/V (kv_kind): rows of one-byte codes with a scale (int8, fp8) or int4,
 * rotated in place, written by csrc/kv_write.c and read by the decode kernel's row formats (decodes
 * only: with prefill chunks the step runs call by call).
 *
 * Each stage is the same kernel the step would call one by one from Python, on the same buffers
 * in the same order, so the results are the same bits; what goes away is the Python and ctypes
 * work between them (about 30-40 us a layer). Pointers that stay for the whole model sit in a
 * LayerWeights, those of one step in a DecodeStep, so a call passes four pointers.
 *
 * While a caller has handed kvs_layers_time_stages an array, each stage's wall time is added to its
 * slot (Stage below): where a step's time goes, read from the engine's own step rather than from a
 * copy of it. Two clock reads a stage, about 20 calls a layer; off (NULL, the default), a branch.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

void kvs_gemm_f32(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k);
void kvs_gemm_f32_silu(const float *x, const float *wp, float *gate_up, float *act, int64_t m, int64_t inter,
                       int64_t k);
int kvs_gemm_silu_fuses(int64_t m, int64_t inter);
void kvs_silu_mul_f32(const float *gate_up, float *act, int64_t rows, int64_t inter);
void kvs_rope_write_kv_f32(float *qkv, int64_t tokens, int64_t row, int64_t num_heads, int64_t num_kv_heads,
                           int64_t d, const float *cos, const float *ssin, float *k_cache, float *v_cache,
                           const int64_t *slots);
int kvs_paged_prefill_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                          const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride, int64_t num_heads,
                          int64_t num_kv_heads, int64_t d, int64_t bs, float scale);
void kvs_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                          int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width,
                          float scale);
void kvs_paged_decode_codes(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                            int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width,
                            float scale, const float *lut);
void kvs_paged_decode_int4(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                           int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width,
                           float scale, const float *lut, int64_t extra, int64_t v_group);
void kvs_codes_write(uint8_t *cache, int64_t num_kv_heads, int64_t head_dim, const float *x, int64_t x_stride,
                     const int64_t *slots, int64_t num_tokens, int kind, float max_code);
int kvs_int4_write_keys(uint8_t *cache, int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t row_width,
                        const float *x, int64_t x_stride, const int64_t *slots, int64_t num_tokens,
                        const float *steps, int starts_blocks);
void kvs_int4_write_values(uint8_t *cache, int64_t num_kv_heads, int64_t head_dim, int64_t row_width, int64_t group,
                           const float *x, int64_t x_stride, const int64_t *slots, int64_t num_tokens,
                           const float *steps);
void kvs_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                          float eps);
void kvs_gemm_bf16(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k);
void kvs_rope_write_kv_bf16(uint16_t *qkv, int64_t tokens, int64_t row, int64_t num_heads, int64_t num_kv_heads,
                            int64_t d, const uint16_t *cos, const uint16_t *ssin, uint16_t *k_cache,
                            uint16_t *v_cache, const int64_t *slots);
int kvs_paged_prefill_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t width, const int64_t *starts, const int64_t *counts,
                           const int64_t *ctxs, int64_t num_prefills, float *out, int64_t out_stride,
                           int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, float scale);
void kvs_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                           int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width,
                           float scale);
void kvs_paged_decode_bf16_rows(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int64_t *block_tables, const int64_t *seq_lens,
                                uint16_t *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                                int64_t bs, int64_t width, float scale);
void kvs_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w, uint16_t *out, int64_t rows,
                           int64_t n, float eps);
void kvs_silu_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t rows, int64_t inter);
void kvs_widen_bf16(const uint16_t *src, int64_t src_stride, float *dst, int64_t rows, int64_t n);
void kvs_narrow_bf16(const float *src, uint16_t *dst, int64_t count);

/* Packed weights and norms of the model's dtype; the bias is float32. */
typedef struct {
    const void *qkv;
    const float *qkv_bias;
    const void *o_proj, *post_norm, *gate_up, *down, *next_norm; /* next_norm: NULL in the last layer */
} LayerWeights;

typedef struct {
    int64_t tokens, hidden, qkv_n, inter, num_heads, num_kv_heads, head_dim, block_size, table_width;
    float eps, scale;
    const void *cos, *ssin;
    const int64_t *slots, *block_tables, *seq_lens;
    void *residual, *x, *qkv, *attn, *o, *gate_up, *act; /* [tokens, ...] of the model's dtype */
    float *wide_in, *wide_out; /* bf16: [tokens, max(hidden, inter, H * D)] and [tokens, max(qkv_n, 2 inter)] */
    int64_t kv_kind;           /* 0: rows of the model's dtype; 1-3: codes (kvs_codes_write's kinds); 4: int4 */
    const float *kv_table;     /* codes: each code's value; int4: each step code's step */
    int64_t kv_extra, kv_group; /* int4: scale bytes a row, channels a value scale */
    float kv_max_code;         /* codes: the value a row's largest magnitude maps to */
    int64_t num_decodes;       /* the first rows, one token each (block_tables, seq_lens: [num_decodes]) */
    int64_t num_prefills;      /* kv_kind 0: chunks in the rows after the decodes */
    const int64_t *pf_tables, *pf_starts, *pf_counts, *pf_ctxs; /* csrc/prefill_attention.c's arrays */
    int64_t pf_width;
} DecodeStep;

enum { KV_PLAIN = 0, KV_INT4 = 4 };

/* The slots of kvs_layers_time_stages's array. Quantized K/V rows time their RoPE and write with
 * the decode attention (one call does all three); CONVERT is a bf16 step's prompt rows widened for
 * the prefill attention and its output rounded back (decode rows go to attention as they are). */
typedef enum {
    STAGE_QKV, STAGE_ROPE_KV, STAGE_DECODE_ATTENTION, STAGE_PREFILL_ATTENTION, STAGE_O_PROJ, STAGE_NORMS,
    STAGE_GATE_UP, STAGE_SILU, STAGE_DOWN, STAGE_CONVERT, NUM_STAGES
} Stage;

static double *stage_seconds; /* set by one caller around the steps it times (the engine's step loop) */

int kvs_layers_num_stages(void) { return NUM_STAGES; }
void kvs_layers_time_stages(double *seconds) { stage_seconds = seconds; }

static inline double clock_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Runs `call`, its time added to the stage's slot while timing is on. */
#define TIMED(stage, call)                                                                                            \
    do {                                                                                                              \
        double *acc_ = stage_seconds;                                                                                 \
        double t0_ = acc_ ? clock_seconds() : 0.0;                                                                    \
        call;                                                                                                         \
        if (acc_) acc_[stage] += clock_seconds() - t0_;                                                               \
    } while (0)

/* RoPE, the K/V write and attention of quantized rows: the rows rotated in place, then written from
 * there. Returns 0, or -1 when the int4 write found no memory for its scratch (nothing written). */
static int quantized_attention(const DecodeStep *s, uint8_t *k_cache, uint8_t *v_cache) {
    int64_t t = s->tokens, hq = s->num_heads, hkv = s->num_kv_heads, d = s->head_dim, bs = s->block_size;
    float *qkv = s->qkv;
    kvs_rope_write_kv_f32(qkv, t, s->qkv_n, hq, hkv, d, s->cos, s->ssin, NULL, NULL, s->slots);
    const float *k = qkv + hq * d, *v = k + hkv * d;
    if (s->kv_kind == KV_INT4) {
        int64_t width = d / 2 + s->kv_extra;
        if (kvs_int4_write_keys(k_cache, bs, hkv, d, width, k, s->qkv_n, s->slots, t, s->kv_table, 1)) return -1;
        kvs_int4_write_values(v_cache, hkv, d, width, s->kv_group, v, s->qkv_n, s->slots, t, s->kv_table);
        kvs_paged_decode_int4(qkv, s->qkv_n, k_cache, v_cache, s->block_tables, s->seq_lens, s->attn, t, hq, hkv, d,
                              bs, s->table_width, s->scale, s->kv_table, s->kv_extra, s->kv_group);
    } else {
        kvs_codes_write(k_cache, hkv, d, k, s->qkv_n, s->slots, t, (int)s->kv_kind, s->kv_max_code);
        kvs_codes_write(v_cache, hkv, d, v, s->qkv_n, s->slots, t, (int)s->kv_kind, s->kv_max_code);
        kvs_paged_decode_codes(qkv, s->qkv_n, k_cache, v_cache, s->block_tables, s->seq_lens, s->attn, t, hq, hkv, d,
                               bs, s->table_width, s->scale, s->kv_table);
    }
    return 0;
}

/* Returns 0; -1 when a quantized write found no memory, -2 when the prefill kernel does not take
 * the shapes (the layer stops there; the caller checks both beforehand). */
int kvs_layer_f32(const LayerWeights *w, const DecodeStep *s, void *k_cache, void *v_cache) {
    int64_t t = s->tokens, h = s->hidden;
    int rc = 0;
    TIMED(STAGE_QKV, kvs_gemm_f32(s->x, w->qkv, w->qkv_bias, s->qkv, t, s->qkv_n, h));
    if (s->kv_kind == KV_PLAIN) {
        TIMED(STAGE_ROPE_KV, kvs_rope_write_kv_f32(s->qkv, t, s->qkv_n, s->num_heads, s->num_kv_heads, s->head_dim,
                                                   s->cos, s->ssin, k_cache, v_cache, s->slots));
        if (s->num_decodes)
            TIMED(STAGE_DECODE_ATTENTION,
                  kvs_paged_decode_f32(s->qkv, s->qkv_n, k_cache, v_cache, s->block_tables, s->seq_lens, s->attn,
                                       s->num_decodes, s->num_heads, s->num_kv_heads, s->head_dim, s->block_size,
                                       s->table_width, s->scale));
        if (s->num_prefills)
            TIMED(STAGE_PREFILL_ATTENTION,
                  rc = kvs_paged_prefill_f32(s->qkv, s->qkv_n, k_cache, v_cache, s->pf_tables, s->pf_width,
                                             s->pf_starts, s->pf_counts, s->pf_ctxs, s->num_prefills, s->attn,
                                             s->num_heads * s->head_dim, s->num_heads, s->num_kv_heads, s->head_dim,
                                             s->block_size, s->scale));
        if (rc) return -2;
    } else {
        TIMED(STAGE_DECODE_ATTENTION, rc = quantized_attention(s, k_cache, v_cache));
        if (rc) return -1;
    }
    TIMED(STAGE_O_PROJ, kvs_gemm_f32(s->attn, w->o_proj, NULL, s->o, t, h, s->num_heads * s->head_dim));
    TIMED(STAGE_NORMS, kvs_add_rms_norm_f32(s->o, s->residual, w->post_norm, s->x, t, h, s->eps));
    if (kvs_gemm_silu_fuses(t, s->inter)) { /* the SiLU in the product's own pass (csrc/gemm.c), timed with it */
        TIMED(STAGE_GATE_UP, kvs_gemm_f32_silu(s->x, w->gate_up, s->gate_up, s->act, t, s->inter, h));
    } else {
        TIMED(STAGE_GATE_UP, kvs_gemm_f32(s->x, w->gate_up, NULL, s->gate_up, t, 2 * s->inter, h));
        TIMED(STAGE_SILU, kvs_silu_mul_f32(s->gate_up, s->act, t, s->inter));
    }
    TIMED(STAGE_DOWN, kvs_gemm_f32(s->act, w->down, NULL, s->o, t, h, s->inter));
    if (w->next_norm != NULL) {
        TIMED(STAGE_NORMS, kvs_add_rms_norm_f32(s->o, s->residual, w->next_norm, s->x, t, h, s->eps));
    } else {
        float *residual = s->residual;
        const float *o = s->o;
        TIMED(STAGE_NORMS, for (int64_t i = 0; i < t * h; i++) residual[i] += o[i]);
    }
    return 0;
}

int kvs_amx_active(void);
int kvs_bf16_dot_active(void);
void kvs_gemm_bf16x(const uint16_t *x, int64_t ldx, const uint16_t *wp, const float *bias, void *y, int form,
                    int64_t m, int64_t n, int64_t k);
void kvs_gemm_bf16x_silu(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *gate_up, uint16_t *act,
                         int64_t m, int64_t inter, int64_t k);
void kvs_amx_gemm(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16, int64_t m,
                  int64_t n, int64_t k);

/* y [t, n] bf16 = x [t, k] bf16 times packed bf16 weights (+ bias): on AMX tiles or the dot
 * products bf16 in and out (each thread rounding its own sums), else through the float32 GEMM. */
static void gemm_bf16_rows(const DecodeStep *s, const uint16_t *x, const void *w, const float *bias, uint16_t *y,
                           int64_t n, int64_t k) {
    if (kvs_amx_active()) {
        kvs_amx_gemm(x, 1, w, bias, y, 1, s->tokens, n, k);
        return;
    }
    if (kvs_bf16_dot_active()) { /* the rows as they are, to the dot products (csrc/gemm.c), y as bf16 */
        kvs_gemm_bf16x(x, k, w, bias, y, 1, s->tokens, n, k);
        return;
    }
    kvs_widen_bf16(x, k, s->wide_in, s->tokens, k);
    kvs_gemm_bf16(s->wide_in, w, bias, s->wide_out, s->tokens, n, k);
    kvs_narrow_bf16(s->wide_out, y, s->tokens * n);
}

/* Returns 0, or -2 when the prefill kernel does not take the shapes (the caller checks beforehand). */
int kvs_layer_bf16(const LayerWeights *w, const DecodeStep *s, uint16_t *k_cache, uint16_t *v_cache) {
    int64_t t = s->tokens, h = s->hidden, q_size = s->num_heads * s->head_dim;
    int rc = 0;
    TIMED(STAGE_QKV, gemm_bf16_rows(s, s->x, w->qkv, w->qkv_bias, s->qkv, s->qkv_n, h));
    TIMED(STAGE_ROPE_KV, kvs_rope_write_kv_bf16(s->qkv, t, s->qkv_n, s->num_heads, s->num_kv_heads, s->head_dim,
                                                s->cos, s->ssin, k_cache, v_cache, s->slots));
    /* decode rows go to attention as bf16 (each task widens its own queries and rounds its own
     * output); the prompt rows after them are widened for the prefill kernel, and its output rounded */
    int64_t nd = s->num_decodes;
    const uint16_t *qkv = s->qkv;
    uint16_t *attn = s->attn;
    if (t > nd) TIMED(STAGE_CONVERT, kvs_widen_bf16(qkv + nd * s->qkv_n, s->qkv_n, s->wide_in + nd * q_size, t - nd,
                                                    q_size));
    if (nd)
        TIMED(STAGE_DECODE_ATTENTION,
              kvs_paged_decode_bf16_rows(qkv, s->qkv_n, k_cache, v_cache, s->block_tables, s->seq_lens, attn, nd,
                                         s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, s->table_width,
                                         s->scale));
    if (s->num_prefills)
        TIMED(STAGE_PREFILL_ATTENTION,
              rc = kvs_paged_prefill_bf16(s->wide_in, q_size, k_cache, v_cache, s->pf_tables, s->pf_width,
                                          s->pf_starts, s->pf_counts, s->pf_ctxs, s->num_prefills, s->wide_out, q_size,
                                          s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, s->scale));
    if (rc) return -2;
    if (t > nd) TIMED(STAGE_CONVERT, kvs_narrow_bf16(s->wide_out + nd * q_size, attn + nd * q_size, (t - nd) * q_size));
    TIMED(STAGE_O_PROJ, gemm_bf16_rows(s, s->attn, w->o_proj, NULL, s->o, h, q_size));
    TIMED(STAGE_NORMS, kvs_add_rms_norm_bf16(s->o, s->residual, w->post_norm, s->x, t, h, s->eps));
    if (!kvs_amx_active() && kvs_gemm_silu_fuses(t, s->inter)) { /* as in float32, the weights paired or widened */
        TIMED(STAGE_GATE_UP, kvs_gemm_bf16x_silu(s->x, h, w->gate_up, s->gate_up, s->act, t, s->inter, h));
    } else {
        TIMED(STAGE_GATE_UP, gemm_bf16_rows(s, s->x, w->gate_up, NULL, s->gate_up, 2 * s->inter, h));
        TIMED(STAGE_SILU, kvs_silu_mul_bf16(s->gate_up, s->act, t, s->inter));
    }
    TIMED(STAGE_DOWN, gemm_bf16_rows(s, s->act, w->down, NULL, s->o, h, s->inter));
    /* no next norm: the add alone */
    TIMED(STAGE_NORMS, kvs_add_rms_norm_bf16(s->o, s->residual, w->next_norm, s->x, t, h, s->eps));
    return 0;
}

/* Every layer of a step in one call, so a step makes one ctypes call (and lets go of the GIL once)
 * instead of one a layer: layer i reads w[i] and the K and V caches at k_base + i * layer_bytes and
 * kv_bytes further on. Returns 0, or the first failing layer's code (see the two above) with
 * *failed set to that layer. */
int kvs_layers(const LayerWeights *w, int64_t num_layers, const DecodeStep *s, char *k_base, int64_t layer_bytes,
               int64_t kv_bytes, int bf16, int64_t *failed) {
    for (int64_t i = 0; i < num_layers; i++) {
        char *k = k_base + i * layer_bytes;
        int rc = bf16 ? kvs_layer_bf16(w + i, s, (uint16_t *)k, (uint16_t *)(k + kv_bytes))
                      : kvs_layer_f32(w + i, s, k, k + kv_bytes);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}
