// Copying KV blocks between the device pool and the DRAM tier in one pass, when both are in host
// memory: each (segment, block) piece is one memcpy straight from source to destination, with no
// gathered intermediate. A segment is one layer's K or V; a piece is block_size * heads * head_dim
// elements. Strides are in bytes, so the same function serves the pool's [L, 2, N, B, H, D] layout
// and the tier's block-major [N, L, 2, B, H, D] one.
//
// streaming: the destination is written with non-temporal stores, which skip the caches, where
// that is possible (aligned, whole vectors). A plain store first reads the destination line into
// the cache, so a cold copy moves its bytes three times instead of twice, and it evicts what the
// step loop is using. A 12 KB piece is far below the size where memcpy itself turns to such stores.
// Both directions stream: a demoted or swapped-out block is not read soon, and a promoted one is
// read by the next step's attention a layer at a time, after the weights of the layers before it
// have passed through the caches. On a 2-core AMD EPYC host, random 1-8 block demotions ran
// 1.12-1.25x faster streamed.
//
// The streamed copy also asks for the source's next piece while it copies one (pieces sit anywhere
// in the pool), into L2: asked into L1, the prefetches compete with the streamed stores for the
// core's line buffers. On a 2-core Zen 4 EPYC (SmolLM2 blocks, cold caches, both layouts on huge
// pages, the variants in lockstep, medians of four runs), 1, 4 and 16 random blocks copied at
// 8.6-10.1, 15.4-20.0 and 18.0-24.1 GB/s with L2 prefetches, against 7.3-8.5, 13.9-14.6 and
// 17.2-19.0 with L1 ones (three runs; the fourth's were 1.5-4.0), 8.7-10.6, 14.0-18.8 and
// 16.2-23.1 for one contiguous memcpy of the same bytes on both cores, and 8.5-9.7, 12.7-17.1
// and 13.5-18.4 for a plain memcpy of each piece.
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* One vector of the build's width, stored past the caches. */
#if defined(__AVX512F__)
#define STREAM_BYTES 64
#define STREAM(dst, src) _mm512_stream_si512((__m512i *)(dst), _mm512_loadu_si512((const void *)(src)))
#elif defined(__AVX2__)
#define STREAM_BYTES 32
#define STREAM(dst, src) _mm256_stream_si256((__m256i *)(dst), _mm256_loadu_si256((const __m256i *)(src)))
#endif

static inline void copy_piece(char *dst, const char *src, size_t n, int streaming, const char *next) {
#ifdef STREAM_BYTES
    if (streaming && (uintptr_t)dst % STREAM_BYTES == 0 && n % STREAM_BYTES == 0) {
        for (size_t i = 0; i < n; i += STREAM_BYTES) {
            if (next && i % 64 == 0) __builtin_prefetch(next + i, 0, 2); /* prefetcht1: into L2 */
            STREAM(dst + i, src + i);
        }
        return;
    }
#endif
    memcpy(dst, src, n);
}

void kvs_copy_blocks(const char *src, char *dst, const int64_t *src_ids, const int64_t *dst_ids, int64_t n,
                     int64_t segments, int64_t piece_bytes, int64_t src_seg_stride, int64_t src_block_stride,
                     int64_t dst_seg_stride, int64_t dst_block_stride, int64_t streaming) {
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t i = 0; i < n; i++) {
            for (int64_t s = 0; s < segments; s++) {
                const char *next = s + 1 < segments ? src + (s + 1) * src_seg_stride + src_ids[i] * src_block_stride
                                   : i + 1 < n ? src + src_ids[i + 1] * src_block_stride : NULL;
                copy_piece(dst + s * dst_seg_stride + dst_ids[i] * dst_block_stride,
                           src + s * src_seg_stride + src_ids[i] * src_block_stride, (size_t)piece_bytes,
                           (int)streaming, next);
            }
        }
#ifdef STREAM_BYTES
        if (streaming) _mm_sfence(); /* this thread's streamed stores are visible before the barrier */
#endif
    }
}
