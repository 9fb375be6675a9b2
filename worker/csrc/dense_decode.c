/* Paged decode attention at head sizes 64 and 128, every row format of kv_rows.h, in two passes per
 * chunk of a sequence's context: every score of the chunk first, then one softmax, then the values.
 *
 *   chunk of CT tokens (whole blocks), every query of the sequence (H of them, G per KV head):
 *   pass 1: for each block, for each token row, every head's K (token-major, a dense row of all
 *           heads: 768 bytes for SmolLM2 in fp32), scores into s[qi][0 .. CT); bf16 rows with
 *           AVX-512 go a head at a time over 16 rows, its queries in registers (see key_tile)
 *   softmax: the chunk's max, e^(s - max) in place, the sum of weights
 *   pass 2: for each block and head, acc[qi] += p[qi][t] * V[t, head], a head's G queries together,
 *           so that a value row is read once for all of them
 *
 * Each chunk's (acc, max, sum) is computed from scratch and the chunks are combined in order, so a
 * task can be a whole sequence (a large batch: it combines as it goes) or a single chunk (a small
 * one: the partials are combined per sequence afterwards), with the same bits. Chunk length depends
 * only on the model's head count and the block size, so outputs do not depend on batching.
 *
 * The block-by-block kernel (paged_attention.c) runs a softmax per block and reads a block's rows
 * one head after another, with one task per (sequence, KV head) in small batches. On a 2-core Zen 5
 * EPYC (lockstep, one process, several runs), with 32 sequences of 282 tokens over 30 layers, this
 * one took 0.61-0.73x its time with each sequence's blocks in ascending order (the engine's usual
 * layout), fp32 and bf16 alike, 0.79-0.85x with blocks scattered and 0.59-0.69x with K/V in cache;
 * with 4 sequences of 600 tokens 0.72x, and one of 2048 tokens 0.65x (fp32, ascending). While a
 * block's keys are scored, the next block's key rows and this block's value rows are prefetched
 * into L2, a token row at a time, so the value pass finds them there; while the values are summed,
 * the keys of the chunk that follows are (see KeyAhead). float32 rows read by tasks of all heads
 * take a Stream instead: the rows prefetched in the order the passes read them, a fixed distance
 * ahead. In a large batch, a block several sequences share (a common prompt prefix) is prefetched
 * by the first of them only (see Owners).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"
#include "thread_slot.h"

#define MAX_DV (128 / VW) /* vectors of a row at the largest head size */
#define GMAX 4            /* queries of one head whose value sums stay in registers at once (d = 64) */
/* Bytes of the following chunk's keys a value pass pulls ahead (see KeyAhead): all of a 282-token
 * bf16 chunk of SmolLM2 (108 KB); in fp32 without a cap (216-384 KB beside the chunk's values in L2)
 * 4 sequences x 1,000 tokens took 1.08x as long, with it 1.00-1.02x. */
#define AHEAD_MAX (128 << 10)
#define CHUNK_MAX 512      /* tokens; 64-256 were as fast or slower, and leave more partials */

/* Tokens of one chunk: a whole number of blocks, with the scores of all the model's queries about
 * 32 KB (an L1's worth), and at most 512. */
static int64_t chunk_tokens(int64_t num_heads, int64_t bs) {
    int64_t t = 8192 / num_heads;
    t = t > CHUNK_MAX ? CHUNK_MAX : t;
    t = t / bs * bs;
    return t < bs ? bs : t;
}

/* The rows a task of all heads reads, in the order it reads them: its chunk's key rows, the same
 * rows' values, then the key and value rows of the chunk it takes next. The passes prefetch them
 * stream_bytes ahead of where they read (stream_upto), so memory is asked for at the pace it is
 * read, in both passes; the rows of the next chunk it has prefetched a thread carries over to that
 * chunk's stream (stream_start), which skips them.
 *
 * The per-block prefetches and KeyAhead instead ask for two rows (a key and a value) per key row
 * scored and a share of the next keys per value row summed: twice the pace in the key pass, less
 * in the value pass. With float32 rows (768 bytes for SmolLM2) the key pass waited on memory. On a
 * 2-core Zen 4 EPYC (32 MB of L3; K/V of 30 layers on huge pages, alternating in one process) 32
 * sequences of 273 tokens took 1.07-1.24x less time with K/V from memory and 0.93-0.97x with it in
 * L3, 8 of 1,000 tokens 1.10-1.37x; batch-8 and 32 decode steps 1.02-1.03x (stream 16-64 KB ahead
 * about the same; 128-256 KB slower). bf16 rows, half the bytes a token, gained 0.97-1.07x alone and
 * nothing measurable in steps, so they keep the old prefetches. */
#define STREAM_BYTES (32 << 10)
/* Where software prefetches fill L1 whatever their hint (AMD family 17h, Zen 1 and Zen 2: on a Zen 2
 * EPYC t0, t1, t2 and nta ran alike; Zen 1 not measured), a 32 KB stream runs an L1's worth ahead
 * and evicts rows before the passes read them: on a 2-core Zen 2 EPYC (32 KB of L1d, K/V of 30 layers from memory,
 * alternating in one process, nine rounds) 12 KB ahead ran 1.16x faster than 32 at 32 sequences of
 * 278 tokens, 1.08x at 8 of 214 and 1.15x at 16 of 300 (8 and 16 KB 1.06-1.11x; one sequence of
 * 1,000 tokens even). Zen 3 hosts measured 2-128 KB within their noise, Zen 4 16-64 KB alike. */
#define STREAM_BYTES_L1 (12 << 10)
static int64_t stream_bytes = -1;
int64_t kvs_decode_set_stream_bytes(int64_t bytes) { /* bytes <= 0 leaves it; returns the setting before */
    if (stream_bytes < 0) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        stream_bytes = __builtin_cpu_is("amdfam17h") ? STREAM_BYTES_L1 : STREAM_BYTES;
#else
        stream_bytes = STREAM_BYTES;
#endif
    }
    int64_t was = stream_bytes;
    if (bytes > 0) stream_bytes = bytes;
    return was;
}

/* For each block id a call's tables use, the first sequence in the batch that holds it (see
 * stream_block; entries for ids no table uses are never read), and which sequences are done. */
typedef struct {
    int32_t *first;
    int *done;
    const int64_t *tables;
    int64_t width;
} Owners;

/* Whether block ib of a sequence's table, whole in the sequence's first `end` tokens, is another
 * sequence's to prefetch, one that is done (see stream_block). */
static inline int left_to_owner(const Owners *o, const int64_t *table, int64_t ib, int64_t end, int64_t bs) {
    if (!o || (ib + 1) * bs > end) return 0;
    int32_t owner = o->first[table[ib]];
    return owner != (table - o->tables) / o->width && __atomic_load_n(o->done + owner, __ATOMIC_RELAXED);
}

typedef struct {
    const char *cache[4]; /* K, V, next K, next V */
    const int64_t *table[4];
    int64_t rows[4], first[4]; /* each segment's rows, and its first block's index in its table */
    int seg;
    int64_t r, ib, j;  /* the next row to prefetch: row r of segment seg, token j of block table[ib] */
    const char *block; /* that block's first row */
    int64_t issued, skipped, bs, row_bytes, dist; /* rows issued (the skipped ones included), ahead: dist */
    const Owners *owners; /* the call's (see stream_block), or NULL */
    int shared;           /* the current block's rows are another sequence's to prefetch: issued, not prefetched */
    int64_t dropped;      /* rows issued without a prefetch for that reason */
} Stream;

/* A block several sequences of a call share (a common prompt prefix: one physical block in several
 * tables) is prefetched by its first sequence in the batch; once that sequence is done, the others
 * skip it and read its rows from L3, where its prefetches brought them. A sequence that runs beside
 * the first one (the other thread took it) prefetches as usual: skipping there made 8 sequences in
 * pairs 1.2x slower. Only a whole block is skipped, and a stream skips one only where it enters it
 * at its first row (one that resumes inside a block, the rows a carry covered, prefetches the rest:
 * at worst some rows twice). Prefetches change when bytes arrive, not the sums. */
static inline void stream_block(Stream *st) {
    st->block = st->cache[st->seg] + st->table[st->seg][st->ib] * st->bs * st->row_bytes;
    st->shared = st->j == 0 && left_to_owner(st->owners, st->table[st->seg], st->ib,
                                             st->first[st->seg] * st->bs + st->rows[st->seg], st->bs);
}

/* Segment seg from its row r on (r <= its rows). */
static inline void stream_seek(Stream *st, int seg, int64_t r) {
    st->seg = seg;
    st->r = r;
    st->ib = st->first[seg] + r / st->bs;
    st->j = r % st->bs;
    if (r < st->rows[seg]) stream_block(st);
}

/* Prefetch until dist rows past `pos` (rows read so far, in the stream's order) or the end. */
static inline void stream_upto(Stream *st, int64_t pos) {
    while (st->issued < pos + st->dist) {
        if (st->r >= st->rows[st->seg]) {
            if (st->seg == 3) return;
            stream_seek(st, st->seg + 1, 0);
            continue;
        }
        if (st->shared) {
            st->dropped++;
        } else {
            const char *p = st->block + st->j * st->row_bytes;
            for (int64_t b = 0; b < st->row_bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
        }
        st->r++;
        st->issued++;
        if (++st->j == st->bs) {
            st->j = 0;
            st->ib++;
            if (st->r < st->rows[st->seg]) stream_block(st);
        }
    }
}

/* Rows of the chunk covering tokens c * per_chunk * bs on, of a context of ctx tokens. */
static inline int64_t chunk_rows(int64_t ctx, int64_t c, int64_t per_chunk, int64_t bs) {
    int64_t start = c * per_chunk * bs, end = start + per_chunk * bs < ctx ? start + per_chunk * bs : ctx;
    return end > start ? end - start : 0;
}

/* A stream over chunk c (blocks from ib0 on, t rows) and the next chunk, `carry` rows of this one
 * already prefetched by the stream before it; the first dist rows asked for. */
static inline void stream_start(Stream *st, const void *k_cache, const void *v_cache, const int64_t *table,
                                int64_t ib0, int64_t t, const int64_t *nx_table, int64_t nx_ib0, int64_t nx_t,
                                int64_t bs, int64_t row_bytes, int64_t carry, const Owners *owners) {
    *st = (Stream){.cache = {k_cache, v_cache, k_cache, v_cache}, .table = {table, table, nx_table, nx_table},
                   .rows = {t, t, nx_t, nx_t}, .first = {ib0, ib0, nx_ib0, nx_ib0}, .bs = bs, .row_bytes = row_bytes,
                   .dist = stream_bytes / row_bytes > 0 ? stream_bytes / row_bytes : 1, .owners = owners};
    st->skipped = st->issued = carry < 2 * t ? carry : 2 * t;
    if (st->issued > t) stream_seek(st, 1, st->issued - t);
    else stream_seek(st, 0, st->issued);
    stream_upto(st, 0);
}

/* Rows of the next chunk the stream has prefetched: what the next chunk's stream skips. */
static inline int64_t stream_carry(const Stream *st) {
    return st->seg < 2 ? 0 : st->seg == 2 ? st->r : st->rows[2] + st->r;
}

/* Rows the streams prefetched (those skipped for a carry or left to a shared block's first sequence
 * not counted), summed over the threads since the last call, which resets it: for tests, where each
 * row read must be prefetched once. */
static int64_t stream_rows;
int64_t kvs_decode_stream_rows(void) { return __atomic_exchange_n(&stream_rows, 0, __ATOMIC_RELAXED); }

/* Row `row` of the cache as DV vectors: bf16 widened in registers, fp32 as it is, coded rows decoded
 * into buf first (kp: an int4 key block's parameters for the row's head, else NULL). */
static inline __attribute__((always_inline)) void row_vectors(const void *cache, int64_t row, const RowFormat *f,
                                                              const int DV, const float *kp, float *buf, vf *r) {
    if (f->kind == ROW_BF16) {
        const uint16_t *p = (const uint16_t *)cache + row * VW * DV;
        UNROLL for (int i = 0; i < DV; i++) r[i] = widen_bf16(p + VW * i);
    } else {
        const float *p = load_row(cache, row, VW * DV, f, kp, buf);
        UNROLL for (int i = 0; i < DV; i++) r[i] = loadv(p + VW * i);
    }
}

/* NQ queries' lane-wise products with one key row k (DV vectors), to out[g * VW]: the NQ sums
 * advance together, a multiply-add of each per vector of the row, so that the core has NQ
 * independent chains in view. One query after another, each chain of DV dependent multiply-adds
 * (8 with AVX2 at d = 64) ran nearly alone: on one core of a Zen 3 EPYC with K/V in L2, the whole
 * kernel went from 172 to 157 ns a token with this change alone. Each sum adds in the same order
 * as before, so the bits are the same. */
static inline __attribute__((always_inline)) void key_dots(const float *q, const vf *k, const int NQ, const int DV,
                                                           vf *out) {
    vf t[4];
    UNROLL for (int g = 0; g < NQ; g++) t[g] = loadv(q + g * VW * DV) * k[0];
    UNROLL for (int i = 1; i < DV; i++)
        UNROLL for (int g = 0; g < NQ; g++) t[g] += loadv(q + g * VW * DV + VW * i) * k[i];
    UNROLL for (int g = 0; g < NQ; g++) out[g * VW] = t[g];
}

/* One token row's prefetch in the key pass: bytes from .. to - 1 of the row at offset `at` in the
 * next block's keys (pf_k) and this block's values (pf_v), either NULL where not wanted. The key
 * row's lines first, then the value row's: interleaving them, one loop for both, was 1.1-1.2x
 * slower in fp32. */
static inline __attribute__((always_inline)) void row_prefetch(const char *pf_k, const char *pf_v, int64_t at,
                                                               int64_t from, int64_t to) {
    if (pf_k)
        for (int64_t b = from; b < to; b += 64) __builtin_prefetch(pf_k + at + b, 0, 1);
    if (pf_v)
        for (int64_t b = from; b < to; b += 64) __builtin_prefetch(pf_v + at + b, 0, 1);
}

/* With bf16 rows, where a KV head's queries fit the registers beside a row (AVX-512: group x d / 16
 * <= 16 vectors), the key pass takes a tile of VW tokens one head at a time, that head's queries
 * loaded once for the tile (key_tile), instead of a token at a time over all heads, which reloaded
 * every query vector from L1 for each row: per token and head 12 query loads beside 4 key loads at
 * SmolLM2's group of 3 and d = 64, and a Zen 4 does one 512-bit load a cycle. On a 2-core Zen 4 EPYC
 * (K/V of 30 layers, alternating in one process, ten rounds) bf16 attention at 8 and 32 sequences of
 * 262-277 tokens ran 1.07x and 1.05x faster from memory (1.02x and 1.06x in a second run), 1.19x and
 * 1.20x with K/V in cache; inside whole bf16 decode steps, attention 1.03-1.05x at 1, 8 and 32
 * sequences (0.96x at 16), the steps within their noise. float32 rows (and their stream, spread over
 * the heads' passes) ran 1.06-1.08x faster in cache but 0.96-1.00x from memory, where the engine
 * reads them, so they keep the token-major pass. kvs_decode_set_key_tiles switches it (tests,
 * benchmarks); the bits are the same either way. */
static int key_tiles = 1;
int kvs_decode_set_key_tiles(int on) { /* on < 0 leaves it; returns the setting before */
    int was = key_tiles;
    if (on >= 0) key_tiles = on != 0;
    return was;
}

/* NQ queries (q [NQ][d], DV vectors each, in registers through the tile) against nj token rows of one
 * KV head (row0, then every `step` rows): out[g * VW + j] gets query g's lane-wise products with row
 * j, lanes j >= nj zero; the same multiply-adds in the same order as key_dots, so the same bits.
 * Each head's pass prefetches its own part of each row (bytes from .. to - 1, as row_prefetch). */
static inline __attribute__((always_inline)) void key_tile(const float *q, const void *k_cache, int64_t row0,
                                                           int64_t step, const RowFormat *f, const int NQ,
                                                           const int DV, int64_t nj, vf *out, const char *pf_k,
                                                           const char *pf_v, int64_t row_bytes, int64_t from,
                                                           int64_t to) {
    vf qv[4 * MAX_DV];
    UNROLL for (int g = 0; g < NQ; g++)
        UNROLL for (int i = 0; i < DV; i++) qv[g * DV + i] = loadv(q + g * VW * DV + VW * i);
    for (int64_t j = 0; j < nj; j++) {
        row_prefetch(pf_k, pf_v, j * row_bytes, from, to);
        vf k[MAX_DV];
        row_vectors(k_cache, row0 + j * step, f, DV, NULL, NULL, k);
        UNROLL for (int g = 0; g < NQ; g++) {
            vf t = qv[g * DV] * k[0];
            UNROLL for (int i = 1; i < DV; i++) t += qv[g * DV + i] * k[i];
            out[g * VW + j] = t;
        }
    }
    for (int64_t j = nj; j < VW; j++)
        UNROLL for (int g = 0; g < NQ; g++) out[g * VW + j] = (vf){0};
}

/* Scores of one block's n tokens for the queries of KV heads h0 .. h1 - 1 (qs [H][d], pre-scaled)
 * into s[qi * ct + j]; lanes past n hold -1e30 (e^-87 after the softmax, never read by the values).
 * part: [H][VW] vectors; buf [d] and kp [Hkv][2d]: room to decode coded rows and int4 key blocks'
 * parameters. pf_k, pf_v: the next block's keys (NULL at the task's last block) and this block's
 * values (NULL: not prefetched), those heads' part of a token row prefetched per token; or a stream (st, the block's
 * first row at `pos` in it) that takes their place. bf16 rows take tiles of a head at a time where
 * key_tiles allows (never with a stream). */
static inline __attribute__((always_inline)) void score_block(
    const float *qs, const void *k_cache, int64_t block, int64_t bs, int64_t num_kv_heads, int64_t h0, int64_t h1,
    int64_t group, const RowFormat *f, const int DV, int64_t n, float *s, int64_t ct, vf *part, float *buf,
    float *kp, const char *pf_k, const char *pf_v, Stream *st, int64_t pos) {
    const int64_t d = VW * DV;
    int64_t head_bytes = head_row_bytes(f, d), row_bytes = num_kv_heads * head_bytes;
    int64_t pf_from = h0 * head_bytes, pf_to = h1 * head_bytes;
    const int tiled = VW == 16 && f->kind == ROW_BF16 && !st && group * DV <= 16 && key_tiles;
    if (f->kind == ROW_INT4)
        for (int64_t h = h0; h < h1; h++)
            int4_key_params(k_cache, block, bs, num_kv_heads, h, d, f, kp + h * 2 * d);
    for (int64_t j0 = 0; j0 < n; j0 += VW) {
        int64_t nj = n - j0 < VW ? n - j0 : VW;
        for (int64_t h = h0; tiled && h < h1; h++) {
            const float *qh = qs + h * group * d;
            vf *ph = part + h * group * VW;
            const char *tk = pf_k ? pf_k + j0 * row_bytes : NULL, *tv = pf_v ? pf_v + j0 * row_bytes : NULL;
            int64_t row0 = (block * bs + j0) * num_kv_heads + h, hb = h * head_bytes;
#define TILE(G) key_tile(qh, k_cache, row0, num_kv_heads, f, G, DV, nj, ph, tk, tv, row_bytes, hb, hb + head_bytes)
            switch (group) {
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
            }
#undef TILE
        }
        for (int64_t j = 0; !tiled && j < VW; j++) {
            if (j >= nj) {
                for (int64_t qi = h0 * group; qi < h1 * group; qi++) part[qi * VW + j] = (vf){0};
                continue;
            }
            if (st) stream_upto(st, pos + j0 + j + 1);
            else row_prefetch(pf_k, pf_v, (j0 + j) * row_bytes, pf_from, pf_to);
            for (int64_t h = h0; h < h1; h++) {
                vf k[MAX_DV];
                row_vectors(k_cache, (block * bs + j0 + j) * num_kv_heads + h, f, DV,
                            f->kind == ROW_INT4 ? kp + h * 2 * d : NULL, buf, k);
                const float *qh = qs + h * group * d;
                vf *ph = part + h * group * VW + j;
                int64_t g = 0;
                for (; g + 4 <= group; g += 4) key_dots(qh + g * d, k, 4, DV, ph + g * VW);
                switch (group - g) {
                case 3: key_dots(qh + g * d, k, 3, DV, ph + g * VW); break;
                case 2: key_dots(qh + g * d, k, 2, DV, ph + g * VW); break;
                case 1: key_dots(qh + g * d, k, 1, DV, ph + g * VW); break;
                }
            }
        }
        vi live = lane_ids < (int32_t)nj;
        for (int64_t qi = h0 * group; qi < h1 * group; qi++) {
            vf sc = selectv(live, transpose_sumv(part + qi * VW), (vf){0} - 1e30f);
            memcpy(s + qi * ct + j0, &sc, sizeof sc);
        }
    }
}

/* A chunk's t scores s (read in whole vectors: the lanes past t hold -1e30) become e^(s - max), the
 * max going to *m; returns their sum. Two chains each, so that neither is one long dependency. */
static float softmax_chunk(float *s, int64_t t, float *m) {
    int64_t chunks = (t + VW - 1) / VW, c;
    vf m0 = loadv(s), m1 = m0;
    for (c = 1; c + 1 < chunks; c += 2) {
        m0 = vmaxv(m0, loadv(s + VW * c));
        m1 = vmaxv(m1, loadv(s + VW * (c + 1)));
    }
    if (c < chunks) m0 = vmaxv(m0, loadv(s + VW * c));
    float mx = hmaxv(vmaxv(m0, m1));
    vf s0 = {0}, s1 = {0};
    for (c = 0; c + 1 < chunks; c += 2) {
        vf e0 = expv(loadv(s + VW * c) - mx), e1 = expv(loadv(s + VW * (c + 1)) - mx);
        s0 += e0;
        s1 += e1;
        memcpy(s + VW * c, &e0, sizeof e0);
        memcpy(s + VW * (c + 1), &e1, sizeof e1);
    }
    if (c < chunks) {
        vf e0 = expv(loadv(s + VW * c) - mx);
        s0 += e0;
        memcpy(s + VW * c, &e0, sizeof e0);
    }
    *m = mx;
    return hsumv(s0 + s1);
}

/* acc [NQ][d] += p [NQ][ct] (from token 0 of this block) times one head's n value rows: a row is
 * loaded (and widened) once for the NQ queries, whose sums stay in registers through the block.
 * With fp32 or bf16 rows, whose vectors are read straight from the row, the sums go a slice of DS
 * of the row's DV vectors at a time (the block's rows read once per slice, from L1 after the
 * first), so that NQ x DS sums fit the registers beside the row's vectors: with AVX2's 16, three
 * queries' 3 x 8 sums at d = 64 lived on the stack, a load and a store around every multiply-add
 * (with chunks_of below: 153 -> 135 ns a token on one core of a Zen 3 EPYC, K/V in L2). Each sum
 * still adds its tokens in order, so the bits are the same. Coded rows, decoded into buf a row at a
 * time, take the row whole. */
#define ACC_MAX (VW == 16 ? 24 : 12) /* sums that fit beside a slice's vectors and the broadcast weight */
static inline __attribute__((always_inline)) void value_slice(const float *p, const void *v_cache, int64_t block,
                                                              int64_t bs, int64_t num_kv_heads, int64_t head,
                                                              const RowFormat *f, const int NQ, const int DV,
                                                              const int S0, const int DS, int64_t n, int64_t ct,
                                                              float *acc, float *buf) {
    const int64_t d = VW * DV;
    vf a[GMAX * MAX_DV]; /* a[g * DS + i]: sum i of the slice for query g */
    UNROLL for (int g = 0; g < NQ; g++)
        UNROLL for (int i = 0; i < DS; i++) a[g * DS + i] = loadv(acc + g * d + VW * (S0 + i));
    for (int64_t j = 0; j < n; j++) {
        vf v[MAX_DV];
        row_vectors(v_cache, (block * bs + j) * num_kv_heads + head, f, DV, NULL, buf, v);
        UNROLL for (int g = 0; g < NQ; g++) {
            float pj = p[g * ct + j];
            UNROLL for (int i = 0; i < DS; i++) a[g * DS + i] += pj * v[S0 + i];
        }
    }
    UNROLL for (int g = 0; g < NQ; g++)
        UNROLL for (int i = 0; i < DS; i++) memcpy(acc + g * d + VW * (S0 + i), &a[g * DS + i], sizeof a[0]);
}

static inline __attribute__((always_inline)) void value_block(const float *p, const void *v_cache, int64_t block,
                                                              int64_t bs, int64_t num_kv_heads, int64_t head,
                                                              const RowFormat *f, const int NQ, const int DV,
                                                              int64_t n, int64_t ct, float *acc, float *buf) {
    int ds = DV;
    while (NQ * ds > ACC_MAX && ds % 2 == 0) ds /= 2;
    if (ds < DV && (f->kind == ROW_F32 || f->kind == ROW_BF16)) {
        UNROLL for (int s0 = 0; s0 < DV; s0 += ds) /* unrolled: each slice's S0 a constant */
            value_slice(p, v_cache, block, bs, num_kv_heads, head, f, NQ, DV, s0, ds, n, ct, acc, buf);
    } else {
        value_slice(p, v_cache, block, bs, num_kv_heads, head, f, NQ, DV, 0, DV, n, ct, acc, buf);
    }
}

static inline __attribute__((always_inline)) void value_head(const float *p, const void *v_cache, int64_t block,
                                                             int64_t bs, int64_t num_kv_heads, int64_t head,
                                                             int64_t group, const RowFormat *f, int64_t d, int64_t n,
                                                             int64_t ct, float *acc, float *buf) {
    int64_t per = d == 64 ? GMAX : GMAX / 2; /* 4 x 4 or 2 x 8 vectors of sums */
    for (int64_t g0 = 0; g0 < group; g0 += per) {
        int64_t nq = group - g0 < per ? group - g0 : per;
        const float *pg = p + g0 * ct;
        float *ag = acc + g0 * d;
#define VALUES(NQ, DV) value_block(pg, v_cache, block, bs, num_kv_heads, head, f, NQ, DV, n, ct, ag, buf)
        if (d == 64) {
            if (nq == 4) VALUES(4, 64 / VW);
            else if (nq == 3) VALUES(3, 64 / VW);
            else if (nq == 2) VALUES(2, 64 / VW);
            else VALUES(1, 64 / VW);
        } else {
            if (nq == 2) VALUES(2, 128 / VW);
            else VALUES(1, 128 / VW);
        }
#undef VALUES
    }
}

/* state = state (+) other for queries q0 .. q1 - 1: both move to the larger maximum, then add. */
static void combine(float *state, const float *other, int64_t num_heads, int64_t d, int64_t q0, int64_t q1) {
    float *acc = state, *m = acc + num_heads * d, *l = m + num_heads;
    const float *oacc = other, *om = oacc + num_heads * d, *ol = om + num_heads;
    for (int64_t i = q0; i < q1; i++) {
        float mx = m[i] > om[i] ? m[i] : om[i];
        float a = expv((vf){0} + (m[i] - mx))[0], b = expv((vf){0} + (om[i] - mx))[0];
        for (int64_t c = 0; c < d; c++) acc[i * d + c] = acc[i * d + c] * a + oacc[i * d + c] * b;
        l[i] = l[i] * a + ol[i] * b;
        m[i] = mx;
    }
}

/* A sequence's output rows from its state: float32, or (bf16) rounded as kvs_narrow_bf16 rounds. */
static void finish(const float *state, void *out, int64_t num_heads, int64_t d, int bf16) {
    const float *acc = state, *l = acc + num_heads * d + num_heads;
    for (int64_t i = 0; i < num_heads; i++) {
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        if (bf16)
            for (int64_t c = 0; c < d; c++) ((uint16_t *)out)[i * d + c] = to_bf16(acc[i * d + c] * inv);
        else
            for (int64_t c = 0; c < d; c++) ((float *)out)[i * d + c] = acc[i * d + c] * inv;
    }
}

/* The key rows of the chunk a thread takes after this one (the task's next chunk, or the first chunk
 * of the task it has claimed next), pulled into L2 a share at a time during this chunk's value pass:
 * the value pass computes from L2, where the key pass prefetched its rows, and the memory would
 * idle through it. On a 2-core Zen 5 EPYC (four engines in lockstep, SmolLM2 at 282 tokens) bf16
 * decode steps ran 1.4-2.3% faster at 8 sequences, 4-11% at 16 and 4-6% at 32; fp32 steps, whose
 * chunks are twice the bytes, 0.99-1.01x. A prefetch never faults and the sums do not change. */
typedef struct {
    const char *k_cache;
    const int64_t *table; /* NULL: nothing follows */
    int64_t ib, ib1;      /* blocks left: ib .. ib1 - 1 */
    int64_t off, block_bytes;
    const Owners *owners; /* whole blocks (of a context of ctx tokens) owned elsewhere are skipped */
    int64_t ctx, bs;
} KeyAhead;

/* Whether value passes pull keys ahead: -1 until the first call decides (on, except on Intel CPUs),
 * or as set (CpuKernels sets it from KVSTRATA_DECODE_KEY_AHEAD). On a 2-core Xeon (AMX, AVX-512;
 * one process, kernels alternating, K/V from memory) the pulls were 45% of the kernel's samples,
 * stalled on the prefetches themselves, and without them bf16 attention at 4-32 sequences of 262
 * tokens ran 1.06-1.12x faster, fp32 1.02-1.06x (one sequence 0.98x); the block's own prefetches
 * are kept there (without those, 0.78-0.86x). */
static int key_ahead = -1;
int kvs_decode_set_key_ahead(int on) { /* on < 0 leaves it; returns the setting before */
    if (key_ahead < 0) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        key_ahead = !__builtin_cpu_is("intel");
#else
        key_ahead = 1;
#endif
    }
    int was = key_ahead;
    if (on >= 0) key_ahead = on != 0;
    return was;
}

static inline void ahead_init(KeyAhead *a, const void *k_cache, const int64_t *table, int64_t ctx, int64_t c,
                              int64_t per_chunk, int64_t bs, int64_t row_bytes, const Owners *owners) {
    int64_t num_blocks = (ctx + bs - 1) / bs, ib0 = c * per_chunk;
    a->k_cache = k_cache;
    a->table = table != NULL && ib0 < num_blocks ? table : NULL;
    a->ib = ib0;
    a->ib1 = ib0 + per_chunk < num_blocks ? ib0 + per_chunk : num_blocks;
    a->off = 0;
    a->block_bytes = bs * row_bytes;
    a->owners = owners;
    a->ctx = ctx;
    a->bs = bs;
}

static inline void ahead_pull(KeyAhead *a, int64_t bytes) {
    while (a->table != NULL && bytes > 0 && a->ib < a->ib1) {
        if (a->off == 0 && left_to_owner(a->owners, a->table, a->ib, a->ctx, a->bs)) {
            a->ib++;
            continue;
        }
        const char *p = a->k_cache + a->table[a->ib] * a->block_bytes;
        int64_t end = a->off + bytes < a->block_bytes ? a->off + bytes : a->block_bytes;
        for (int64_t b = a->off; b < end; b += 64) __builtin_prefetch(p + b, 0, 1);
        bytes -= end - a->off;
        a->off = end;
        if (a->off >= a->block_bytes) {
            a->ib++;
            a->off = 0;
        }
    }
}

/* A chunk's partial result, or a sequence's running one: for each of the H queries, the output
 * sums acc [H][d], then the maxima m [H] and the sums of weights l [H]. */
static inline int64_t partial_floats(int64_t num_heads, int64_t d) { return num_heads * (d + 2); }

/* Chunks c0 .. c1 - 1 of one sequence (q [H][d] its queries, float32 or, with q_bf16, bf16), each
 * from scratch: its keys scored, one softmax, its values; each chunk's partial is combined into
 * `state` in order (the first one is copied). Only the queries of KV heads h0 .. h1 - 1 are
 * computed, and only their parts of `state` written: each query's sums are its own, so a head's
 * bits do not depend on the range. Prefetches run on across the task's chunks. */
static inline __attribute__((always_inline)) void decode_chunks(
    const void *q, int q_bf16, const void *k_cache, const void *v_cache, const int64_t *table, int64_t ctx, int64_t c0,
    int64_t c1, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, float scale, const RowFormat *format,
    int64_t h0, int64_t h1, float *state, float *work, const int64_t *nx_table, int64_t nx_ctx, int64_t nx_c,
    int64_t *carry, int64_t *streamed, const Owners *owners, const int KIND, const int ALL_HEADS) {
    /* the row kind a constant where the caller knows it, and whether all heads are (see chunks_of) */
    if (ALL_HEADS) {
        h0 = 0;
        h1 = num_kv_heads;
    }
    const RowFormat fk = {KIND >= 0 ? KIND : format->kind, format->lut, format->extra, format->v_group, format->codes};
    const RowFormat *f = &fk;
    int64_t group = num_heads / num_kv_heads, ct = chunk_tokens(num_heads, bs), per_chunk = ct / bs;
    int64_t q0 = h0 * group, q1 = h1 * group, heads = h1 - h0;
    int64_t stride = ct + VW; /* a query's scores: a chunk, and room for the last tile's lanes */
    vf *part = (vf *)work;    /* [H][VW], 64-byte aligned */
    float *qs = (float *)(part + num_heads * VW), *mine = qs + num_heads * d, *s = mine + partial_floats(num_heads, d);
    float *buf = s + num_heads * stride, *kp = buf + d; /* [d], [Hkv][2d] */
    if (q_bf16) /* widened here, each task its own rows: the same floats as the layer's widening pass gave */
        for (int64_t i = q0 * d; i < q1 * d; i++) qs[i] = bf16_to_f32(((const uint16_t *)q)[i]) * scale;
    else
        for (int64_t i = q0 * d; i < q1 * d; i++) qs[i] = ((const float *)q)[i] * scale;
    int64_t num_blocks = (ctx + bs - 1) / bs, row_bytes = num_kv_heads * head_row_bytes(f, d);
    int64_t last_block = c1 * per_chunk < num_blocks ? c1 * per_chunk : num_blocks;
    for (int64_t c = c0; c < c1; c++) {
        int64_t ib0 = c * per_chunk, ib1 = ib0 + per_chunk < num_blocks ? ib0 + per_chunk : num_blocks;
        float *acc = c == c0 ? state : mine, *m = acc + num_heads * d, *l = m + num_heads;
        memset(acc + q0 * d, 0, (size_t)((q1 - q0) * d) * sizeof *acc);
        int64_t t = chunk_rows(ctx, c, per_chunk, bs);
        Stream stream, *st = NULL;
        if (KIND == ROW_F32 && ALL_HEADS && key_ahead) {
            /* the next chunk: this sequence's, or the first of the task the thread takes next */
            int last = c + 1 == c1;
            const int64_t *nt = last ? nx_table : table;
            int64_t nc = last ? nx_c : c + 1, nt_rows = nt ? chunk_rows(last ? nx_ctx : ctx, nc, per_chunk, bs) : 0;
            stream_start(&stream, k_cache, v_cache, table, ib0, t, nt, nc * per_chunk, nt_rows, bs, row_bytes, *carry,
                         owners);
            st = &stream;
        }
        for (int64_t ib = ib0; ib < ib1; ib++) {
            int64_t block = table[ib], n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
            const char *pf_k = ib + 1 < last_block ? (const char *)k_cache + table[ib + 1] * bs * row_bytes : NULL;
            const char *pf_v = (const char *)v_cache + block * bs * row_bytes;
            if (!st) { /* the stream asks the owners itself */
                if (pf_k && left_to_owner(owners, table, ib + 1, ctx, bs)) pf_k = NULL;
                if (left_to_owner(owners, table, ib, ctx, bs)) pf_v = NULL;
            }
            float *sb = s + (ib - ib0) * bs;
            if (d == 64)
                score_block(qs, k_cache, block, bs, num_kv_heads, h0, h1, group, f, 64 / VW, n, sb, stride, part, buf,
                            kp, pf_k, pf_v, st, (ib - ib0) * bs);
            else
                score_block(qs, k_cache, block, bs, num_kv_heads, h0, h1, group, f, 128 / VW, n, sb, stride, part, buf,
                            kp, pf_k, pf_v, st, (ib - ib0) * bs);
        }
        /* the softmax reads whole vectors: with blocks that are not a multiple of VW tokens the last
         * block's tiles can end short of them, and what lies there is an earlier call's */
        for (int64_t i = q0; i < q1; i++) {
            for (int64_t p = t; p < (t + VW - 1) / VW * VW; p++) s[i * stride + p] = -1e30f;
            l[i] = softmax_chunk(s + i * stride, t, m + i);
        }
        KeyAhead ahead;
        if (c + 1 < c1) ahead_init(&ahead, k_cache, table, ctx, c + 1, per_chunk, bs, row_bytes, owners);
        else ahead_init(&ahead, k_cache, nx_table, nx_ctx, nx_c, per_chunk, bs, row_bytes, owners);
        int64_t ahead_bytes = !st && key_ahead && ahead.table ? (ahead.ib1 - ahead.ib) * ahead.block_bytes : 0;
        ahead_bytes = ahead_bytes < AHEAD_MAX ? ahead_bytes : AHEAD_MAX;
        int64_t share = (ahead_bytes + (ib1 - ib0) * heads - 1) / ((ib1 - ib0) * heads);
        share = (share + 63) / 64 * 64;
        for (int64_t ib = ib0; ib < ib1; ib++) {
            int64_t block = table[ib], n = ctx - ib * bs < bs ? ctx - ib * bs : bs;
            for (int64_t h = h0; h < h1; h++) {
                if (st) stream_upto(st, t + (ib - ib0) * bs + n * (h - h0 + 1) / heads);
                else ahead_pull(&ahead, share);
                value_head(s + h * group * stride + (ib - ib0) * bs, v_cache, block, bs, num_kv_heads, h, group, f, d,
                           n, stride, acc + h * group * d, buf);
            }
        }
        if (c > c0) combine(state, mine, num_heads, d, q0, q1);
        *carry = st ? stream_carry(st) : 0;
        *streamed += st ? st->issued - st->skipped - st->dropped : 0;
    }
}

/* decode_chunks with fp32 rows, bf16 rows, or any kind read from the format: with the kind a
 * constant, each row is read by one path, and the sums and rows stay in registers across it. Read
 * from the format inside the loops, the two paths' rows met in memory, and the value pass's sums
 * with them, even where they would fit the registers. All heads, or the range h0 .. h1 - 1: with
 * the range in the loops, 32 sequences' bf16 steps ran about 1% slower. */
#define CHUNKS_ARGS const void *q, int q_bf16, const void *k_cache, const void *v_cache, const int64_t *table,  \
    int64_t ctx, int64_t c0, int64_t c1, int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, float scale, \
    const RowFormat *f, int64_t h0, int64_t h1, float *state, float *work, const int64_t *nx_table, int64_t nx_ctx, \
    int64_t nx_c, int64_t *carry, int64_t *streamed, const Owners *owners
#define CHUNKS_PASS q, q_bf16, k_cache, v_cache, table, ctx, c0, c1, num_heads, num_kv_heads, d, bs, scale, f, h0, \
    h1, state, work, nx_table, nx_ctx, nx_c, carry, streamed, owners
static void chunks_f32(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, ROW_F32, 1); }
static void chunks_bf16(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, ROW_BF16, 1); }
static void chunks_coded(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, -1, 1); }
static void heads_f32(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, ROW_F32, 0); }
static void heads_bf16(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, ROW_BF16, 0); }
static void heads_coded(CHUNKS_ARGS) { decode_chunks(CHUNKS_PASS, -1, 0); }
typedef void chunks_fn(CHUNKS_ARGS);
#undef CHUNKS_ARGS
#undef CHUNKS_PASS

static chunks_fn *chunks_of(const RowFormat *f, int all_heads) {
    if (all_heads) return f->kind == ROW_F32 ? chunks_f32 : f->kind == ROW_BF16 ? chunks_bf16 : chunks_coded;
    return f->kind == ROW_F32 ? heads_f32 : f->kind == ROW_BF16 ? heads_bf16 : heads_coded;
}

/* Floats of a thread's work area for decode_chunks. */
static size_t work_floats(int64_t num_heads, int64_t d, int64_t bs) {
    return (size_t)(num_heads * VW * VW + num_heads * d + partial_floats(num_heads, d) +
                    num_heads * (chunk_tokens(num_heads, bs) + VW) + d + 2 * num_heads * d) + 64;
}

/* Whether decode attention leaves the prefetches of a block several sequences share to the first of
 * them (stream_block): on unless set off (tests and benchmarks; on < 0 leaves it). Returns the
 * setting before. */
static int shared_owners = 1;
int kvs_decode_set_shared_owners(int on) {
    int was = shared_owners;
    if (on >= 0) shared_owners = on != 0;
    return was;
}

#define OWNERS_MAX_IDS (1 << 22) /* past this many block ids every sequence prefetches every row it reads */

/* The calling thread's buffers for its calls' Owners, grown as needed and kept until the thread ends
 * (an engine calls from one thread, 30 times a step): first [ids], done [batch]. */
typedef struct {
    int32_t *first;
    int *done;
    int64_t ids, batch;
} OwnersBuf;

static void free_owners_buf(void *p) {
    OwnersBuf *o = p;
    free(o->first);
    free(o->done);
    free(o);
}

THREAD_SLOT(owners_buf, OwnersBuf, free_owners_buf)

/* The calling thread's buffers with room for ids block ids and batch sequences, or NULL. */
static OwnersBuf *owners_room(int64_t ids, int64_t batch) {
    OwnersBuf *o = owners_buf_get();
    if (!o) return NULL;
    if (ids > o->ids) {
        int32_t *p = realloc(o->first, (size_t)ids * sizeof *p);
        if (!p) return NULL;
        o->first = p;
        o->ids = ids;
    }
    if (batch > o->batch) {
        int *p = realloc(o->done, (size_t)batch * sizeof *p);
        if (!p) return NULL;
        o->done = p;
        o->batch = batch;
    }
    return o;
}

/* The call's Owners, filled for the blocks the tables use, none done; first NULL where they are off,
 * where no two sequences share a block, or where a block id reaches OWNERS_MAX_IDS. */
static Owners owners_for(const int64_t *block_tables, const int64_t *seq_lens, int64_t batch, int64_t bs,
                         int64_t width) {
    Owners none = {NULL, NULL, block_tables, width};
    if (!shared_owners || batch < 2) return none;
    int64_t top = 0;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t ib = 0; ib < (seq_lens[b] + bs - 1) / bs; ib++)
            top = block_tables[b * width + ib] > top ? block_tables[b * width + ib] : top;
    OwnersBuf *buf = top < OWNERS_MAX_IDS ? owners_room(top + 1, batch) : NULL;
    if (!buf) return none;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t ib = 0; ib < (seq_lens[b] + bs - 1) / bs; ib++) buf->first[block_tables[b * width + ib]] = -1;
    int shared = 0;
    for (int64_t b = batch - 1; b >= 0; b--) /* the last write of a block's id is its first sequence's */
        for (int64_t ib = 0; ib < (seq_lens[b] + bs - 1) / bs; ib++) {
            int32_t *first = buf->first + block_tables[b * width + ib];
            shared |= *first >= 0;
            *first = (int32_t)b;
        }
    if (!shared) return none; /* no block to leave to another sequence: nothing for the prefetches to ask */
    memset(buf->done, 0, (size_t)batch * sizeof *buf->done);
    return (Owners){buf->first, buf->done, block_tables, width};
}

/* Task `task`'s sequence b and chunk c. */
static void locate(int64_t task, int by_sequence, const int64_t *first, int64_t batch, int64_t *b, int64_t *c) {
    if (by_sequence) {
        *b = task;
        *c = 0;
        return;
    }
    int64_t lo = 0, hi = batch;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (first[mid] <= task) lo = mid;
        else hi = mid;
    }
    *b = lo;
    *c = task - first[lo];
}

/* Tasks: with by_sequence (many sequences a thread) whole sequences, each combining its chunks as it
 * goes; else single chunks, whose partials are combined per sequence afterwards, in the same order,
 * so the bits are the same either way. With fewer chunks than two a thread, each chunk is one task
 * per KV head: a lone sequence of up to 512 tokens was one task, which one thread ran while the
 * other waited, and two chunks often both went to the thread that came first (see below); on a
 * 2-core Xeon, decode steps of 1-3 sequences ran 1.6-5.6% faster, 4 even. A thread takes tasks as it
 * comes free (as a dynamic schedule would), but claims its next one as it starts the current one,
 * so that the current one's value passes know whose keys to pull ahead. q and out are float32, or
 * with bf16_io bf16 (paged_attention.c's kvs_paged_decode_bf16_rows). */
void kvs_dense_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t batch,
                      int64_t num_heads, int64_t num_kv_heads, int64_t d, int64_t bs, int64_t width, float scale,
                      const RowFormat *f, int by_sequence, int bf16_io) {
    size_t q_elem = bf16_io ? 2 : 4, out_row = (size_t)(num_heads * d) * (bf16_io ? 2 : 4);
    int64_t ct = chunk_tokens(num_heads, bs), pf = partial_floats(num_heads, d);
    kvs_decode_set_key_ahead(-1); /* decided before the threads read them */
    kvs_decode_set_stream_bytes(0);
    int64_t *first = malloc((size_t)(batch + 1) * sizeof *first); /* sequence b's chunks: first[b] .. first[b + 1] */
    first[0] = 0;
    for (int64_t b = 0; b < batch; b++) first[b + 1] = first[b] + (seq_lens[b] + ct - 1) / ct;
    int64_t per_chunk = !by_sequence && first[batch] < 2 * omp_get_max_threads() ? num_kv_heads : 1;
    int64_t tasks = by_sequence ? batch : first[batch] * per_chunk;
    float *partials = by_sequence ? NULL : malloc((size_t)(first[batch] * pf) * sizeof(float));
    size_t floats = work_floats(num_heads, d, bs) + (size_t)pf;
    chunks_fn *run = chunks_of(f, per_chunk == 1);
    /* where a task is a whole sequence, so that a sequence is done when its task is */
    Owners own = by_sequence ? owners_for(block_tables, seq_lens, batch, bs, width) : (Owners){NULL, NULL, NULL, 0};
    const Owners *owners = own.first ? &own : NULL;
    int64_t claimed = 0;
#pragma omp parallel
    {
        float *work = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        float *state = work + work_floats(num_heads, d, bs);
        int64_t carry = 0, streamed = 0; /* rows of its next chunk a stream prefetched; rows streamed */
        int64_t task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (task < tasks) {
            /* the next task is claimed now, so that this one's value passes can pull its keys ahead */
            int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            int64_t b = 0, c = 0, nb = 0, nc = 0;
            locate(task / per_chunk, by_sequence, first, batch, &b, &c);
            const int64_t *nx_table = NULL;
            int64_t nx_ctx = 0;
            if (next < tasks) {
                locate(next / per_chunk, by_sequence, first, batch, &nb, &nc);
                nx_table = block_tables + nb * width;
                nx_ctx = seq_lens[nb];
            }
            const char *qb = (const char *)q + b * q_stride * q_elem;
            const int64_t *table = block_tables + b * width;
            if (by_sequence) {
                int64_t chunks = first[b + 1] - first[b];
                if (chunks == 0) {
                    memset((char *)out + b * out_row, 0, out_row);
                } else {
                    run(qb, bf16_io, k_cache, v_cache, table, seq_lens[b], 0, chunks, num_heads, num_kv_heads, d, bs,
                        scale, f, 0, num_kv_heads, state, work, nx_table, nx_ctx, nc, &carry, &streamed, owners);
                    finish(state, (char *)out + b * out_row, num_heads, d, bf16_io);
                }
                if (owners) __atomic_store_n(own.done + b, 1, __ATOMIC_RELAXED);
            } else {
                int64_t h0 = task % per_chunk, h1 = per_chunk == 1 ? num_kv_heads : h0 + 1;
                run(qb, bf16_io, k_cache, v_cache, table, seq_lens[b], c, c + 1, num_heads, num_kv_heads, d, bs, scale,
                    f, h0, h1, partials + task / per_chunk * pf, work, nx_table, nx_ctx, nc, &carry, &streamed, owners);
            }
            task = next;
        }
        if (!by_sequence) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t b = 0; b < batch; b++) {
                char *o = (char *)out + b * out_row;
                if (first[b + 1] == first[b]) {
                    memset(o, 0, out_row);
                    continue;
                }
                float *st = partials + first[b] * pf;
                for (int64_t c = first[b] + 1; c < first[b + 1]; c++)
                    combine(st, partials + c * pf, num_heads, d, 0, num_heads);
                finish(st, o, num_heads, d, bf16_io);
            }
        }
        __atomic_fetch_add(&stream_rows, streamed, __ATOMIC_RELAXED);
        free(work);
    }
    free(partials);
    free(first);
}
