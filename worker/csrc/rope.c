/* Rotary position embedding and the K/V write of one layer, for float32 rows, in one pass:
 *
 *     qkv [T, row]: per token, H query heads, then Hkv key heads, then Hkv value heads, D each
 *     q, k rotated in place:  x' = x * cos + roll(x, D/2) * signed_sin   (signed_sin = [-sin | sin])
 *     k_cache[slot[t]] = k'(t),  v_cache[slot[t]] = v(t)      (caches [slots, Hkv, D])
 *
 * torch runs this as a multiply, a roll, a multiply-add and two index copies per layer: 27 us at
 * 32 tokens and 16 at one on a 2-core AVX-512 EPYC, mostly per-op overhead, where this pass takes
 * 8 and 5 (from Python, checks included). Each value is formed as torch's addcmul
 * forms it on x86 (a rounded product x * cos, then one fused multiply-add), so the two paths give
 * the same bits there; the function is built without further contraction to keep it that way.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

__attribute__((optimize("fp-contract=off"))) static void rotate_row(float *x, const float *cos,
                                                                    const float *ssin, int64_t d) {
    int64_t half = d / 2;
    float rolled[256];
    memcpy(rolled, x + half, (size_t)half * sizeof(float));
    memcpy(rolled + half, x, (size_t)half * sizeof(float));
#pragma omp simd
    for (int64_t i = 0; i < d; i++) {
        x[i] = __builtin_fmaf(rolled[i], ssin[i], x[i] * cos[i]);
    }
}

/* cos, ssin: [T, D]; slots: [T] (block * block_size + offset); d <= 256 and even. Without caches
 * (NULL), only the rotation: quantized rows are written by csrc/kv_write.c. */
void kvs_rope_write_kv_f32(float *qkv, int64_t tokens, int64_t row, int64_t num_heads, int64_t num_kv_heads,
                           int64_t d, const float *cos, const float *ssin, float *k_cache, float *v_cache,
                           const int64_t *slots) {
    int64_t kv = num_kv_heads * d;
#pragma omp parallel for schedule(static) if (tokens >= SMALL_OPS_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        float *x = qkv + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) rotate_row(x + h * d, cos + t * d, ssin + t * d, d);
        if (k_cache == NULL) continue;
        memcpy(k_cache + slots[t] * kv, x + num_heads * d, (size_t)kv * sizeof(float));
        memcpy(v_cache + slots[t] * kv, x + (num_heads + num_kv_heads) * d, (size_t)kv * sizeof(float));
    }
}
