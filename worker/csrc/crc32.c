/* CRC-32 (the zlib / IEEE 802.3 polynomial, bit-reflected), and a copy that computes it on the way.
 *
 * The NVMe tier checksums every block it writes and reads (0.74 MB for SmolLM2 in fp32): zlib's
 * crc32 runs at about 5 GB/s on one core, and an IO thread staging a block for its write first
 * copied it (numpy) and then read it again for the CRC. Here the CRC folds 64 bytes per step with
 * carry-less multiplies (PCLMULQDQ), four 128-bit lanes at once, reduced to 32 bits at the end by
 * the method of Intel's white paper "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
 * Instruction" (Gopal et al., 2009); the copy stores each 64 bytes as it loads them. Where the CPU
 * has 512-bit carry-less multiplies (VPCLMULQDQ with AVX-512), four 512-bit registers fold 256
 * bytes a step first: 0.74 MB in 14 us instead of 52 on a Zen 5 core; with 256-bit ones and AVX2
 * only, four 256-bit registers fold 128 bytes a step (32 us instead of 79 on a Zen 3 core). The values
 * are zlib's: kvs_crc32(init, p, n) == zlib.crc32(bytes(p[:n]), init). Without PCLMULQDQ the same
 * values come from a byte-at-a-time table, slower than zlib's, so callers ask kvs_crc32_fast()
 * first and use zlib where it says 0.
 */
#include <stdint.h>
#include <string.h>
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#define KVS_CRC_FOLD 1
#else
#define KVS_CRC_FOLD 0
#endif

static uint32_t crc_table[256];

__attribute__((constructor)) static void build_crc_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* The running register (not inverted) over n bytes, one at a time; copies them when dst is set,
 * and then sums the copy, as the folding path sums exactly what it stores. */
static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, uint8_t *dst, size_t n) {
    if (dst != NULL) {
        memcpy(dst, p, n);
        p = dst;
    }
    for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return crc;
}

#if KVS_CRC_FOLD
/* One fold step: the lane's two 64-bit halves times their constants, carry-less, summed. */
static inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

static inline __m128i load_copy(const uint8_t *src, uint8_t *dst) {
    __m128i v = _mm_loadu_si128((const __m128i *)src);
    if (dst != NULL) _mm_storeu_si128((__m128i *)dst, v);
    return v;
}

#if defined(__VPCLMULQDQ__) && defined(__AVX512F__)
static inline __m512i fold512(__m512i x, __m512i k) {
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11));
}

/* A copy's 64 bytes go around the caches (non-temporal) where dst is 64-byte aligned: the slots
 * copied are megabytes that the disk reads next, not the CPU, and a store that went through the
 * cache would first read each line it fills. On a 2-core Xeon, a 0.74 MB copy with its CRC from
 * and to memory out of cache took 92 us this way against 117 (the CRC alone: 84). */
static inline __m512i load_copy512(const uint8_t *src, uint8_t *dst, int stream) {
    __m512i v = _mm512_loadu_si512((const void *)src);
    if (dst != NULL) {
        if (stream) _mm512_stream_si512((void *)dst, v);
        else _mm512_storeu_si512((void *)dst, v);
    }
    return v;
}

/* The 128-bit register that crc_fold's lanes reach after the first n bytes, n >= 256 and a
 * multiple of 64, folding 256 bytes a step in four 512-bit registers (VPCLMULQDQ): each register's
 * four 128-bit lanes fold as crc_fold's do, 2048 bits on at a time. */
static __m128i fold_wide(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t n) {
    const __m512i by_sixteen = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430, 0x11542778a));
    const __m512i by_four = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596, 0x154442bd4));
    const __m128i by_one = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const int s = dst != NULL && ((uintptr_t)dst & 63) == 0;
    __m512i z0 = load_copy512(src, dst, s), z1 = load_copy512(src + 64, dst ? dst + 64 : NULL, s);
    __m512i z2 = load_copy512(src + 128, dst ? dst + 128 : NULL, s);
    __m512i z3 = load_copy512(src + 192, dst ? dst + 192 : NULL, s);
    z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    size_t i = 256;
    for (; i + 256 <= n; i += 256) {
        uint8_t *d = dst ? dst + i : NULL;
        z0 = _mm512_xor_si512(fold512(z0, by_sixteen), load_copy512(src + i, d, s));
        z1 = _mm512_xor_si512(fold512(z1, by_sixteen), load_copy512(src + i + 64, d ? d + 64 : NULL, s));
        z2 = _mm512_xor_si512(fold512(z2, by_sixteen), load_copy512(src + i + 128, d ? d + 128 : NULL, s));
        z3 = _mm512_xor_si512(fold512(z3, by_sixteen), load_copy512(src + i + 192, d ? d + 192 : NULL, s));
    }
    z0 = _mm512_xor_si512(fold512(z0, by_four), z1);
    z0 = _mm512_xor_si512(fold512(z0, by_four), z2);
    z0 = _mm512_xor_si512(fold512(z0, by_four), z3);
    for (; i + 64 <= n; i += 64) z0 = _mm512_xor_si512(fold512(z0, by_four), load_copy512(src + i, dst ? dst + i : NULL, s));
    if (s) _mm_sfence();  /* the streamed stores reach memory before any store after them */
    __m128i x = _mm512_extracti32x4_epi32(z0, 0);
    x = _mm_xor_si128(fold(x, by_one), _mm512_extracti32x4_epi32(z0, 1));
    x = _mm_xor_si128(fold(x, by_one), _mm512_extracti32x4_epi32(z0, 2));
    return _mm_xor_si128(fold(x, by_one), _mm512_extracti32x4_epi32(z0, 3));
}
#define KVS_CRC_WIDE 1
#elif defined(__VPCLMULQDQ__) && defined(__AVX2__)
/* AVX2 cores with 256-bit carry-less multiplies and no AVX-512 (Zen 3; VMs that hide AVX-512): four
 * 256-bit registers fold 128 bytes a step, eight 128-bit lanes where crc_fold has four. crc_fold's
 * four chains wait on the multiply's latency; on a Zen 3 core a 0.74 MB CRC from cache took 79 us
 * that way. The copy streams where dst is 32-byte aligned, as the 512-bit path does at 64. */
static inline __m256i fold256(__m256i x, __m256i k) {
    return _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11));
}

static inline __m256i load_copy256(const uint8_t *src, uint8_t *dst, int stream) {
    __m256i v = _mm256_loadu_si256((const __m256i *)src);
    if (dst != NULL) {
        if (stream) _mm256_stream_si256((__m256i *)dst, v);
        else _mm256_storeu_si256((__m256i *)dst, v);
    }
    return v;
}

/* The 128-bit register that crc_fold's lanes reach after the first n bytes, n >= 128 and a
 * multiple of 32: each register's two lanes move 1024 bits on a step (by_eight), the registers
 * then fold into one 256 bits at a time (by_two), and its two lanes into one. */
static __m128i fold_wide(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t n) {
    const __m256i by_eight = _mm256_broadcastsi128_si256(_mm_set_epi64x(0x14a7fe880, 0x1e88ef372));
    const __m256i by_two = _mm256_broadcastsi128_si256(_mm_set_epi64x(0x15a546366, 0x0f1da05aa));
    const __m128i by_one = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const int s = dst != NULL && ((uintptr_t)dst & 31) == 0;
    __m256i z0 = load_copy256(src, dst, s), z1 = load_copy256(src + 32, dst ? dst + 32 : NULL, s);
    __m256i z2 = load_copy256(src + 64, dst ? dst + 64 : NULL, s);
    __m256i z3 = load_copy256(src + 96, dst ? dst + 96 : NULL, s);
    z0 = _mm256_xor_si256(z0, _mm256_set_m128i(_mm_setzero_si128(), _mm_cvtsi32_si128((int)crc)));
    size_t i = 128;
    for (; i + 128 <= n; i += 128) {
        uint8_t *d = dst ? dst + i : NULL;
        z0 = _mm256_xor_si256(fold256(z0, by_eight), load_copy256(src + i, d, s));
        z1 = _mm256_xor_si256(fold256(z1, by_eight), load_copy256(src + i + 32, d ? d + 32 : NULL, s));
        z2 = _mm256_xor_si256(fold256(z2, by_eight), load_copy256(src + i + 64, d ? d + 64 : NULL, s));
        z3 = _mm256_xor_si256(fold256(z3, by_eight), load_copy256(src + i + 96, d ? d + 96 : NULL, s));
    }
    z0 = _mm256_xor_si256(fold256(z0, by_two), z1);
    z0 = _mm256_xor_si256(fold256(z0, by_two), z2);
    z0 = _mm256_xor_si256(fold256(z0, by_two), z3);
    for (; i + 32 <= n; i += 32)
        z0 = _mm256_xor_si256(fold256(z0, by_two), load_copy256(src + i, dst ? dst + i : NULL, s));
    if (s) _mm_sfence();
    __m128i x = _mm256_castsi256_si128(z0);
    return _mm_xor_si128(fold(x, by_one), _mm256_extracti128_si256(z0, 1));
}
#define KVS_CRC_WIDE 1
#else
#define KVS_CRC_WIDE 0
#endif

/* The running register over n bytes, n >= 64 and a multiple of 16; copies them when dst is set. */
static uint32_t crc_fold(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t n) {
    /* the white paper's constants for this polynomial, bit-reflected: powers of x mod P that move a
     * lane's two halves 512 bits on (by_four) or 128 bits on (by_one), the 64 -> 32 bit step, and
     * the Barrett pair (floor(x^64 / P) high, P low) */
    const __m128i by_four = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
    const __m128i by_one = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i by_32 = _mm_set_epi64x(0, 0x163cd6124);
    const __m128i barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);
    const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x0;
    size_t i;
#if KVS_CRC_WIDE
    if (n >= 256) {
        i = n / 64 * 64;
        x0 = fold_wide(crc, src, dst, i);
        goto tail;
    }
#endif
    x0 = load_copy(src, dst);
    __m128i x1 = load_copy(src + 16, dst ? dst + 16 : NULL);
    __m128i x2 = load_copy(src + 32, dst ? dst + 32 : NULL), x3 = load_copy(src + 48, dst ? dst + 48 : NULL);
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)crc));
    i = 64;
    for (; i + 64 <= n; i += 64) {
        uint8_t *d = dst ? dst + i : NULL;
        x0 = _mm_xor_si128(fold(x0, by_four), load_copy(src + i, d));
        x1 = _mm_xor_si128(fold(x1, by_four), load_copy(src + i + 16, d ? d + 16 : NULL));
        x2 = _mm_xor_si128(fold(x2, by_four), load_copy(src + i + 32, d ? d + 32 : NULL));
        x3 = _mm_xor_si128(fold(x3, by_four), load_copy(src + i + 48, d ? d + 48 : NULL));
    }
    x0 = _mm_xor_si128(fold(x0, by_one), x1);
    x0 = _mm_xor_si128(fold(x0, by_one), x2);
    x0 = _mm_xor_si128(fold(x0, by_one), x3);
#if KVS_CRC_WIDE
tail:
#endif
    for (; i + 16 <= n; i += 16) x0 = _mm_xor_si128(fold(x0, by_one), load_copy(src + i, dst ? dst + i : NULL));
    /* 128 bits -> 64: the low half moved on by 64 bits, added to the high half */
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(x0, by_one, 0x10));
    /* 64 -> 32 */
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 4), _mm_clmulepi64_si128(_mm_and_si128(x0, low32), by_32, 0x00));
    /* Barrett reduction modulo P */
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x0, t), 1);
}
#endif

static uint32_t crc_run(uint32_t init, const uint8_t *src, uint8_t *dst, int64_t n) {
    uint32_t crc = ~init;
    size_t done = 0;
#if KVS_CRC_FOLD
    if (n >= 64) {
        done = (size_t)n / 16 * 16;
        crc = crc_fold(crc, src, dst, done);
    }
#endif
    crc = crc_bytes(crc, src + done, dst ? dst + done : NULL, (size_t)n - done);
    return ~crc;
}

int kvs_crc32_fast(void) { return KVS_CRC_FOLD; }

uint32_t kvs_crc32(uint32_t init, const uint8_t *p, int64_t n) { return crc_run(init, p, NULL, n); }

uint32_t kvs_copy_crc32(uint32_t init, const uint8_t *src, uint8_t *dst, int64_t n) {
    return crc_run(init, src, dst, n);
}

/* One NVMe slot staged for its write, in one call without the GIL (tiering/slot_codec.py):
 *
 *   slot: [ head (header, zero pad)  | payload             | 0 tail ]
 *         0                          p                     p + n     slot_bytes
 *
 * head: the p packed head bytes, its payload CRC and header CRC to be filled in here; the header
 * is header_len bytes and ends with the payload CRC (u32), the sequence number (u64) and the CRC
 * of everything before it (u32), all little-endian (tiering/block_file.py). The payload is copied
 * from src with its CRC computed on the way. Returns the payload CRC. */
static void put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint32_t kvs_stage_slot(uint8_t *slot, int64_t slot_bytes, const uint8_t *head, int64_t p, int64_t header_len,
                        const uint8_t *src, int64_t n) {
    memcpy(slot, head, (size_t)p);
    uint32_t crc = crc_run(0, src, slot + p, n);
    put_le32(slot + header_len - 16, crc);
    put_le32(slot + header_len - 4, crc_run(0, slot, NULL, header_len - 4));
    memset(slot + p + n, 0, (size_t)(slot_bytes - p - n));
    return crc;
}
