/* A decode-only step's layer in two calls, float32, packed weights, plain K/V rows:
 *
 *   kvs_layer_attention:  qkv = x Wqkv^T (+ b); RoPE and the K/V write; attention; o = attn Wo^T;
 *                         residual += o; x = norm(residual) * post_norm; gate_up = x Wgu^T
 *   (the caller:          act = silu(gate) * up, in torch, whose exp the C code would not match)
 *   kvs_layer_mlp:        o = act Wdown^T; residual += o; x = norm(residual) * next_norm (the
 *                         next layer's input norm; without one, the last layer, only the add)
 *
 * Each stage is the same kernel the step would call one by one from Python, on the same buffers
 * in the same order, so the results are the same bits; what goes away is the Python and ctypes
 * work between them (about 30-40 us a layer). Pointers that stay for the whole model sit in a
 * LayerWeights, those of one step in a DecodeStep, so a call passes four pointers.
 */
#include <stddef.h>
#include <stdint.h>

void kvs_gemm_f32(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t n, int64_t k);
void kvs_rope_write_kv_f32(float *qkv, int64_t tokens, int64_t row, int64_t num_heads, int64_t num_kv_heads,
                           int64_t d, const float *cos, const float *ssin, float *k_cache, float *v_cache,
                           const int64_t *slots);
void kvs_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                          int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width,
                          float scale);
void kvs_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                          float eps);

typedef struct {
    const float *qkv, *qkv_bias, *o_proj, *post_norm, *gate_up, *down, *next_norm; /* next_norm: NULL last */
} LayerWeights;

typedef struct {
    int64_t tokens, hidden, qkv_n, inter, num_heads, num_kv_heads, head_dim, block_size, table_width;
    float eps, scale;
    const float *cos, *ssin;
    const int64_t *slots, *block_tables, *seq_lens;
    float *residual, *x, *qkv, *attn, *o, *gate_up, *act;
} DecodeStep;

void kvs_layer_attention(const LayerWeights *w, const DecodeStep *s, float *k_cache, float *v_cache) {
    int64_t t = s->tokens, h = s->hidden;
    kvs_gemm_f32(s->x, w->qkv, w->qkv_bias, s->qkv, t, s->qkv_n, h);
    kvs_rope_write_kv_f32(s->qkv, t, s->qkv_n, s->num_heads, s->num_kv_heads, s->head_dim, s->cos, s->ssin, k_cache,
                          v_cache, s->slots);
    kvs_paged_decode_f32(s->qkv, s->qkv_n, k_cache, v_cache, s->block_tables, s->seq_lens, s->attn, t, s->num_heads,
                         s->num_kv_heads, s->head_dim, s->block_size, s->table_width, s->scale);
    kvs_gemm_f32(s->attn, w->o_proj, NULL, s->o, t, h, s->num_heads * s->head_dim);
    kvs_add_rms_norm_f32(s->o, s->residual, w->post_norm, s->x, t, h, s->eps);
    kvs_gemm_f32(s->x, w->gate_up, NULL, s->gate_up, t, 2 * s->inter, h);
}

void kvs_layer_mlp(const LayerWeights *w, const DecodeStep *s) {
    int64_t t = s->tokens, h = s->hidden;
    kvs_gemm_f32(s->act, w->down, NULL, s->o, t, h, s->inter);
    if (w->next_norm != NULL) {
        kvs_add_rms_norm_f32(s->o, s->residual, w->next_norm, s->x, t, h, s->eps);
    } else {
        for (int64_t i = 0; i < t * h; i++) s->residual[i] += s->o[i];
    }
}
