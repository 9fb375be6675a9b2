"""Paged attention over block tables equals contiguous causal SDPA."""

from __future__ import annotations

import pytest
import torch

from kvstrata.worker.attention import (
    AttentionMetadata,
    PrefillChunk,
    contiguous_attention,
    paged_attention,
    write_kv,
)

BLOCK = 4


def _scatter(seqs, num_blocks, h_kv, d, gen):
    """Write each sequence's K/V into randomly chosen, non-contiguous blocks."""
    k_cache = torch.zeros(num_blocks, BLOCK, h_kv, d)
    v_cache = torch.zeros(num_blocks, BLOCK, h_kv, d)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in seqs:
        n = -(-k.shape[0] // BLOCK)
        ids = [perm.pop() for _ in range(n)]
        tables.append(ids)
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(ids)[pos // BLOCK] * BLOCK + pos % BLOCK
        write_kv(k_cache, v_cache, k, v, slots)
    return k_cache, v_cache, tables


@pytest.mark.parametrize("h,h_kv", [(8, 8), (8, 2), (9, 3), (4, 1)])
def test_varlen_prefill_with_cached_prefix_equals_sdpa(h, h_kv):
    gen = torch.Generator().manual_seed(h * 10 + h_kv)
    d, scale = 16, 0.25
    lens, new = [13, 5, 8], [4, 5, 1]  # context lengths; the last `new` tokens are this step's queries
    seqs = [(torch.randn(n, h_kv, d, generator=gen), torch.randn(n, h_kv, d, generator=gen)) for n in lens]
    qs = [torch.randn(n, h, d, generator=gen) for n in lens]
    k_cache, v_cache, tables = _scatter(seqs, 32, h_kv, d, gen)

    prefills, rows = [], 0
    for L, n, t in zip(lens, new, tables):
        prefills.append(PrefillChunk(rows, n, L, torch.tensor(t)))
        rows += n
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 0, None, None, prefills)
    q = torch.cat([qf[L - n:] for qf, L, n in zip(qs, lens, new)])
    out = paged_attention(q, k_cache, v_cache, meta, scale)

    row = 0
    for (k, v), qf, L, n in zip(seqs, qs, lens, new):
        ref = contiguous_attention(qf, k, v, scale)[L - n:]
        torch.testing.assert_close(out[row:row + n], ref, rtol=1e-5, atol=1e-5)
        row += n


@pytest.mark.parametrize("h,h_kv", [(9, 3), (4, 4)])
def test_batched_decode_equals_sdpa(h, h_kv):
    gen = torch.Generator().manual_seed(7)
    d = 8
    d_scale = d ** -0.5
    lens = [1, 6, 17, 4]
    seqs = [(torch.randn(n, h_kv, d, generator=gen), torch.randn(n, h_kv, d, generator=gen)) for n in lens]
    qs = [torch.randn(n, h, d, generator=gen) for n in lens]
    k_cache, v_cache, tables = _scatter(seqs, 40, h_kv, d, gen)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK)[None, :] < seq_lens[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), table, mask, [])
    q = torch.stack([qf[-1] for qf in qs])
    out = paged_attention(q, k_cache, v_cache, meta, d_scale)
    for i, ((k, v), qf) in enumerate(zip(seqs, qs)):
        ref = contiguous_attention(qf, k, v, d_scale)[-1]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_garbage_in_unused_slots_is_ignored():
    """Slots past a sequence's length may hold stale KV from earlier requests; they must not leak in."""
    gen = torch.Generator().manual_seed(3)
    h = h_kv = 2
    d = 4
    k = torch.randn(3, h_kv, d, generator=gen)
    v = torch.randn(3, h_kv, d, generator=gen)
    k_cache = torch.full((2, BLOCK, h_kv, d), 1e4)
    v_cache = torch.full((2, BLOCK, h_kv, d), 1e4)
    write_kv(k_cache, v_cache, k, v, torch.tensor([4, 5, 6]))  # block 1, offsets 0..2
    q = torch.randn(1, h, d, generator=gen)
    mask = (torch.arange(BLOCK) < 3).view(1, 1, 1, BLOCK)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 1, torch.tensor([[1]]), mask, [])
    out = paged_attention(q, k_cache, v_cache, meta, 0.5)
    ref = contiguous_attention(torch.cat([torch.zeros(2, h, d), q]), k, v, 0.5)[-1]
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
