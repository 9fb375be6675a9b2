// Copying KV blocks between the device pool and the DRAM tier in one pass, when both are in host
// memory: each (segment, block) piece is one memcpy straight from source to destination, with no
// gathered intermediate. A segment is one layer's K or V; a piece is block_size * heads * head_dim
// elements. Strides are in bytes, so the same function serves the pool's [L, 2, N, B, H, D] layout
// and the tier's block-major [N, L, 2, B, H, D] one.
#include <stdint.h>
#include <string.h>

void kvs_copy_blocks(const char *src, char *dst, const int64_t *src_ids, const int64_t *dst_ids, int64_t n,
                     int64_t segments, int64_t piece_bytes, int64_t src_seg_stride, int64_t src_block_stride,
                     int64_t dst_seg_stride, int64_t dst_block_stride) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t s = 0; s < segments; s++) {
            memcpy(dst + s * dst_seg_stride + dst_ids[i] * dst_block_stride,
                   src + s * src_seg_stride + src_ids[i] * src_block_stride, (size_t)piece_bytes);
        }
    }
}
