"""Paged attention in plain torch: K/V are written to and read from blocks through block tables.

The flattened batch puts decode tokens first, then the prefill chunks:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1 ]
               decodes     prefill 0       prefill 1 (a chunk; its earlier tokens are in the cache)

Decodes (one query each) run as one padded batch: their block tables are gathered into a
[B, max_ctx] view and masked by sequence length. Each prefill chunk attends causally to its whole
context (cached prefix + earlier chunks + itself), gathered from its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kvstrata.worker.cpu_kernels import CpuKernels, PrefillArrays
from kvstrata.worker.kv_format import KVFormat


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # tokens of context including this chunk
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long
    decode_seq_lens: torch.Tensor | None  # [D] long: tokens each decode attends to, its new one included
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool, True = attend (torch path)
    prefills: list[PrefillChunk]
    cpu_kernels: CpuKernels | None = None  # set: decodes read K/V in place through the C kernel
    kv_format: KVFormat | None = None  # how the pool stores K/V; None: plain floats in the model's dtype
    # called after each layer's attention as observer(layer, q [T, H, D], k_cache, meta): token
    # eviction policies that need attention scores (H2O, SnapKV) read them here
    attention_observer: Callable[[int, torch.Tensor, torch.Tensor, "AttentionMetadata"], None] | None = None
    prefill_arrays: PrefillArrays | None = None  # the prefills for the C kernel, built at the first layer


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_format: KVFormat | None = None) -> None:
    """k_cache, v_cache: [num_blocks, block_size, Hkv, W]; k, v: [T, Hkv, D] (W = D for plain floats)."""
    if kv_format is not None and not kv_format.is_plain:
        kv_format.write(k_cache, k, slot_mapping, key=True)
        kv_format.write(v_cache, v, slot_mapping, key=False)
        return
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]; K/V for the new tokens must already be written."""
    d = meta.num_decodes
    decoded = _decode(q[:d], k_cache, v_cache, meta, scale) if d else None
    if not meta.prefills and decoded is not None:
        return decoded  # decode-only step (the common case): no copy into a shared output
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if decoded is not None:
        out[:d] = decoded
    if _prefill_in_c(q, k_cache, v_cache, meta, scale, out):
        return out
    num_kv_heads = k_cache.shape[2]
    for p in meta.prefills:
        ctx = p.context_len
        # k, v: [ctx, Hkv, D] gathered from this request's blocks
        k = read_blocks(k_cache, p.block_ids, meta.kv_format)[:ctx]
        v = read_blocks(v_cache, p.block_ids, meta.kv_format, key=False)[:ctx]
        qc = q[p.token_start : p.token_start + p.num_tokens]
        out[p.token_start : p.token_start + p.num_tokens] = _causal_attention(
            qc, k, v, ctx - p.num_tokens, num_kv_heads, scale
        )
    return out


def _prefill_in_c(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor) -> bool:
    """The prefill chunks through the C kernel, when the pool holds float32 rows, bf16 rows of a
    bf16 model, or quantized rows the decode kernel reads too (one-byte codes, int4), in a shape it
    takes. bf16 queries are widened for it, and its float32 outputs rounded back, as the decode
    kernel's are."""
    fmt = meta.kv_format
    if meta.cpu_kernels is None or (fmt is not None and not fmt.is_plain and fmt.code_table is None):
        return False
    arrays = step_prefill_arrays(meta)
    table = None if fmt is None or fmt.is_plain else fmt.code_table
    group = None if table is None else fmt.int4_value_group
    if q.dtype != torch.bfloat16:
        return meta.cpu_kernels.paged_prefill(q, k_cache, v_cache, out, arrays, scale, table, group)
    if k_cache.dtype != torch.bfloat16:
        return False
    wide = torch.empty(q.shape, dtype=torch.float32)
    if not meta.cpu_kernels.paged_prefill(q.float(), k_cache, v_cache, wide, arrays, scale):
        return False
    first = meta.num_decodes  # the prefill rows follow the decodes
    out[first:] = wide[first:].to(torch.bfloat16)
    return True


def step_prefill_arrays(meta: AttentionMetadata) -> PrefillArrays:
    """The step's prefill chunks for the C kernel, built at the first layer that asks."""
    if meta.prefill_arrays is None:
        meta.prefill_arrays = prefill_arrays(meta.prefills)
    return meta.prefill_arrays


def prefill_arrays(chunks: list[PrefillChunk]) -> PrefillArrays:
    """The chunks as the C kernel takes them: block tables padded with block 0."""
    width = max(len(p.block_ids) for p in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for i, p in enumerate(chunks):
        tables[i, : len(p.block_ids)] = p.block_ids
    return PrefillArrays(*prefill_columns(chunks), tables)


def prefill_columns(chunks: list[PrefillChunk]) -> torch.Tensor:
    """The chunks' first rows, new tokens and contexts, int64 [3, P], in one tensor call."""
    return torch.tensor([[p.token_start for p in chunks], [p.num_tokens for p in chunks],
                         [p.context_len for p in chunks]], dtype=torch.int64)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float) -> torch.Tensor:
    if meta.cpu_kernels is not None:
        fmt = meta.kv_format
        table = fmt.code_table if fmt is not None else None  # None for float rows
        group = fmt.int4_value_group if fmt is not None else None
        return meta.cpu_kernels.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                             scale, table, group)
    return _decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale, meta.kv_format)


def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, kv_format: KVFormat | None = None,
                key: bool = True) -> torch.Tensor:
    """K (or V, key=False) of whole blocks as floats: cache [num_blocks, bs, Hkv, W], block_ids [n]
    -> [n * bs, Hkv, D], dequantized when the pool is quantized."""
    if kv_format is not None and not kv_format.is_plain:
        return kv_format.read(cache, block_ids, key)
    return _gather_blocks(cache, block_ids)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D], block_ids [n] -> [n * bs, Hkv, D]."""
    # index_select copies whole blocks; advanced indexing (cache[ids]) is several times slower on CPU
    return cache.index_select(0, block_ids).flatten(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      mask: torch.Tensor, scale: float, kv_format: KVFormat | None = None) -> torch.Tensor:
    # q: [B, H, D]; grouped so each KV head's queries form the "length" axis, so K/V are not repeated
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    ids = block_tables.flatten()
    k = read_blocks(k_cache, ids, kv_format).view(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = read_blocks(v_cache, ids, kv_format, key=False).view(bsz, -1, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: [B, Hkv, max_ctx, D]
    qg = q.view(bsz, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, D]
    return o.reshape(bsz, num_heads, head_dim)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                      num_kv_heads: int, scale: float) -> torch.Tensor:
    """q: [n, H, D] at positions num_cached.. num_cached+n-1; k, v: [num_cached + n, Hkv, D]."""
    n, num_heads, head_dim = q.shape
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if num_cached == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        ctx = k.shape[0]
        # query i sits at position num_cached + i and sees keys 0 .. num_cached + i
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=num_cached)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)  # [n, H, D]


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: causal SDPA over contiguous q [n, H, D], k/v [n, Hkv, D] (for tests)."""
    return _causal_attention(q, k, v, 0, k.shape[1], scale)
