"""Paged attention over block tables equals contiguous causal SDPA."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from kvstrata.worker.attention import (
    AttentionMetadata,
    PrefillChunk,
    contiguous_attention,
    paged_attention,
    prefill_arrays,
    write_kv,
)
from kvstrata.worker.cpu_kernels import load_cpu_kernels

BLOCK = 4
KERNELS = load_cpu_kernels()
# decodes run through the C kernel where it builds, and through plain torch everywhere
DECODE_BACKENDS = ["torch", pytest.param("kernel", marks=pytest.mark.skipif(KERNELS is None, reason="no C compiler"))]


def _decode_meta(table: torch.Tensor, seq_lens: torch.Tensor, backend: str, block: int = BLOCK) -> AttentionMetadata:
    width = table.shape[1]
    mask = (torch.arange(width * block)[None, :] < seq_lens[:, None]).view(len(seq_lens), 1, 1, -1)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(seq_lens), decode_block_tables=table,
        decode_seq_lens=seq_lens, decode_mask=None if backend == "kernel" else mask, prefills=[],
        cpu_kernels=KERNELS if backend == "kernel" else None,
    )


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
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=0, decode_block_tables=None,
                             decode_seq_lens=None, decode_mask=None, prefills=prefills)
    q = torch.cat([qf[L - n:] for qf, L, n in zip(qs, lens, new)])
    out = paged_attention(q, k_cache, v_cache, meta, scale)

    row = 0
    for (k, v), qf, L, n in zip(seqs, qs, lens, new):
        ref = contiguous_attention(qf, k, v, scale)[L - n:]
        torch.testing.assert_close(out[row:row + n], ref, rtol=1e-5, atol=1e-5)
        row += n


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("h,h_kv", [(9, 3), (4, 4)])
def test_batched_decode_equals_sdpa(h, h_kv, backend):
    gen = torch.Generator().manual_seed(7)
    d = 8
    d_scale = d ** -0.5
    lens = [1, 6, 17, 4]
    seqs = [(torch.randn(n, h_kv, d, generator=gen), torch.randn(n, h_kv, d, generator=gen)) for n in lens]
    qs = [torch.randn(n, h, d, generator=gen) for n in lens]
    k_cache, v_cache, tables = _scatter(seqs, 40, h_kv, d, gen)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = _decode_meta(table, torch.tensor(lens), backend)
    q = torch.stack([qf[-1] for qf in qs])
    out = paged_attention(q, k_cache, v_cache, meta, d_scale)
    for i, ((k, v), qf) in enumerate(zip(seqs, qs)):
        ref = contiguous_attention(qf, k, v, d_scale)[-1]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_garbage_in_unused_slots_is_ignored(backend):
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
    meta = _decode_meta(torch.tensor([[1]]), torch.tensor([3]), backend)
    out = paged_attention(q, k_cache, v_cache, meta, 0.5)
    ref = contiguous_attention(torch.cat([torch.zeros(2, h, d), q]), k, v, 0.5)[-1]
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,h,h_kv,d,block", [
    (1, 9, 3, 64, 16),    # one sequence, SmolLM2's heads: 3 queries per KV head in registers
    (12, 9, 3, 64, 24),   # many sequences; blocks of 24 tokens: a full and a partial 16-token chunk
    (3, 16, 2, 64, 32),   # 8 queries per KV head: two register chunks of 4
    (2, 6, 2, 128, 16),   # head_dim 128: chunks of 2 queries, then 1
    (5, 8, 8, 128, 8),    # MHA, head_dim 128, blocks shorter than a 16-token chunk
    (6, 4, 1, 40, 32),    # MQA, a head_dim with no specialised path
])
def test_kernel_matches_torch_decode(dtype, batch, h, h_kv, d, block):
    gen = torch.Generator().manual_seed(batch * 1000 + d)
    num_blocks = 64
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).to(dtype)
    seq_lens = torch.randint(1, 5 * block, (batch,), generator=gen)
    width = int(-(-seq_lens.max() // block))
    table = torch.randint(0, num_blocks, (batch, width), generator=gen)
    q = (torch.randn(batch, h, d, generator=gen) * 3).to(dtype)
    got = paged_attention(q, k_cache, v_cache, _decode_meta(table, seq_lens, "kernel", block), d ** -0.5)
    ref = paged_attention(q.float(), k_cache.float(), v_cache.float(),
                          _decode_meta(table, seq_lens, "torch", block), d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,h_kv,d,block,width", [
    (9, 3, 64, 16, 9), (16, 2, 64, 16, 9), (6, 2, 128, 8, 9), (4, 1, 40, 16, 9),
    (9, 3, 64, 16, 40),  # up to 640 tokens: two score chunks
    (64, 8, 64, 16, 20),  # chunks of 128 tokens, sized by the model's heads, not the task's
])
def test_kernel_gives_a_sequence_the_same_bits_alone_and_in_a_large_batch(dtype, h, h_kv, d, block, width):
    """A large batch runs one task per sequence, all its KV heads together; a lone sequence runs one
    task per (sequence, KV head). Each query's sums run in the same order either way (chunks of the
    same length included), so a sequence's output must not depend on which."""
    gen = torch.Generator().manual_seed(h * 100 + d)
    batch, num_blocks = 40, 96
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).to(dtype)
    seq_lens = torch.randint(1, width * block, (batch,), generator=gen)
    seq_lens[:3] = torch.tensor([1, block, width * block])  # one token, one full block, the widest table
    table = torch.randint(0, num_blocks, (batch, width), generator=gen)
    q = (torch.randn(batch, h, d, generator=gen) * 3).to(dtype)
    together = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    for b in range(batch):
        alone = KERNELS.paged_decode(q[b : b + 1], k_cache, v_cache, table[b : b + 1], seq_lens[b : b + 1], d ** -0.5)
        assert torch.equal(alone[0], together[b]), f"sequence {b} ({int(seq_lens[b])} tokens)"


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("h,h_kv,d,width", [(9, 3, 64, 40), (6, 2, 128, 9), (4, 1, 40, 9)])
@pytest.mark.parametrize("batch", [1, 6, 40])  # per KV head, per chunk, per sequence
def test_bf16_decode_rows_in_and_out_equal_the_float32_path_rounded(h, h_kv, d, width, batch):
    """bf16 queries and K/V take the kernel's bf16-rows entry (as the fused bf16 layer does): each task
    widens its own queries and rounds its own output. The bits must equal the float32 entry's (the
    queries widened first) rounded to bf16 after, at head sizes 64 and 128 and the generic path's."""
    gen = torch.Generator().manual_seed(h * 1000 + d + batch)
    block, num_blocks = 16, 96
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).bfloat16()
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).bfloat16()
    seq_lens = torch.randint(1, width * block, (batch,), generator=gen)
    if batch > 2:
        seq_lens[:2] = torch.tensor([0, width * block])  # an empty context (zeros out), the widest table
    table = torch.randint(0, num_blocks, (batch, width), generator=gen)
    # q as a view with rows further apart than its heads (the fused layer's q/k/v rows)
    qkv = (torch.randn(batch, h + 2 * h_kv, d, generator=gen) * 3).bfloat16()
    q = qkv[:, :h]
    rows = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    floats = KERNELS.paged_decode(q.float(), k_cache, v_cache, table, seq_lens, d ** -0.5)
    assert rows.dtype == torch.bfloat16 and floats.dtype == torch.float32
    assert torch.isfinite(floats).all() and floats.abs().sum() > 0
    assert torch.equal(rows.view(torch.int16), floats.bfloat16().view(torch.int16))


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 6, 12])  # per KV head, per chunk, per sequence
def test_decode_gives_the_same_bits_with_keys_pulled_ahead_or_not(monkeypatch, dtype, batch):
    """The value passes' pull of the next chunk's keys (csrc/dense_decode.c) only prefetches: off by
    default on Intel CPUs, on elsewhere, set by KVSTRATA_DECODE_KEY_AHEAD (0 or 1, else an error
    naming it) when the kernels load. Outputs are the same bits either way."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(batch)
    h, h_kv, d, block, num_blocks = 9, 3, 64, 16, 128
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).to(dtype)
    seq_lens = torch.randint(300, 1100, (batch,), generator=gen)  # one to three chunks of 512 each
    table = torch.randint(0, num_blocks, (batch, 69), generator=gen)  # 69 blocks hold 1,104 tokens
    q = (torch.randn(batch, h, d, generator=gen) * 3).to(dtype)
    lib = KERNELS._lib
    default = lib.kvs_decode_set_key_ahead(-1)
    try:
        outs = []
        for value in ("0", "1"):
            monkeypatch.setenv("KVSTRATA_DECODE_KEY_AHEAD", value)
            assert CpuKernels(lib).key_ahead is (value == "1")
            outs.append(KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5))
        monkeypatch.setenv("KVSTRATA_DECODE_KEY_AHEAD", "on")
        with pytest.raises(ValueError, match="KVSTRATA_DECODE_KEY_AHEAD"):
            CpuKernels(lib)
    finally:
        lib.kvs_decode_set_key_ahead(default)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("h,h_kv,d", [(9, 3, 64), (8, 2, 64), (8, 8, 64), (16, 4, 64), (6, 3, 128), (9, 3, 128),
                                      (4, 1, 40)])
@pytest.mark.parametrize("block", [16, 24])
@pytest.mark.parametrize("batch", [1, 6, 40])  # per KV head, per chunk, per sequence
def test_bf16_decode_gives_the_same_bits_with_a_heads_queries_held_or_not(h, h_kv, d, block, batch):
    """With bf16 rows the key pass takes a tile of tokens one KV head at a time, the head's queries held
    in registers (csrc/dense_decode.c's key_tile; on by default, with AVX-512 and where they fit),
    instead of a token at a time over all heads. The same multiply-adds in the same order: the same
    bits at groups of 1-4 queries, head sizes 64 and 128 (a group of 3 there does not fit) and the
    generic path's 40, tiles cut short by 24-token blocks and contexts, and every task shape."""
    gen = torch.Generator().manual_seed(h * 1000 + d * 10 + batch + block)
    width, num_blocks = 12, 128
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).bfloat16()
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).bfloat16()
    seq_lens = torch.randint(1, width * block, (batch,), generator=gen)
    seq_lens[0] = width * block - 5  # a last tile of a few tokens
    table = torch.randint(0, num_blocks, (batch, width), generator=gen)
    q = (torch.randn(batch, h, d, generator=gen) * 3).bfloat16()
    lib = KERNELS._lib
    default = lib.kvs_decode_set_key_tiles(-1)
    try:
        outs = []
        for on in (1, 0):
            lib.kvs_decode_set_key_tiles(on)
            outs.append(KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5))
            outs.append(KERNELS.paged_decode(q.float(), k_cache, v_cache, table, seq_lens, d ** -0.5))
    finally:
        lib.kvs_decode_set_key_tiles(default)
    assert default == 1
    assert torch.isfinite(outs[1]).all() and outs[1].abs().sum() > 0
    assert torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16))  # bf16 rows in and out
    assert torch.equal(outs[1], outs[3])  # float32 queries and output


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("stream_kb", [None, 1, 12, 1024])
@pytest.mark.parametrize("tasks", ["sequences", "chunks", "heads"])
def test_float32_decode_prefetches_every_row_it_reads_once(tasks, stream_kb):
    """With keys pulled ahead, float32 tasks of all KV heads (whole sequences in a large batch, single
    chunks in a smaller one) prefetch their rows in the order the passes read them, and a thread's
    stream carries the rows of its next chunk it has already prefetched over to that chunk's stream
    (csrc/dense_decode.c's Stream): each key and value row of every context is prefetched exactly once,
    however far ahead the stream runs (the kernel's default; 1 KB, not even a row ahead; 12 KB; 1 MB,
    past every context). Tasks of one KV head (a lone sequence), bf16 rows, and no pull-ahead keep the
    block prefetches."""
    lib = KERNELS._lib
    stream = lib.kvs_decode_set_stream_bytes(0 if stream_kb is None else stream_kb << 10)
    threads = lib.omp_get_max_threads()  # the tasks follow the kernel's threads (csrc/paged_attention.c)
    batch = {"sequences": 4 * threads, "chunks": 2 * threads, "heads": 1}[tasks]
    gen = torch.Generator().manual_seed(batch)
    h, h_kv, d, block, num_blocks = 9, 3, 64, 16, 160
    k_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen)
    longest = 1100 if tasks != "heads" else 500  # one to three chunks of 512; a lone one of one chunk
    seq_lens = torch.randint(1, longest, (batch,), generator=gen)
    seq_lens[0] = longest
    table = torch.randperm(num_blocks, generator=gen)[:69].repeat(batch, 1)  # 69 blocks hold 1,104 tokens
    q = torch.randn(batch, h, d, generator=gen)
    default = lib.kvs_decode_set_key_ahead(1)
    owners = lib.kvs_decode_set_shared_owners(0)  # every sequence's own rows (the test below shares them out)
    try:
        lib.kvs_decode_stream_rows()  # from zero
        streamed = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
        rows = lib.kvs_decode_stream_rows()
        KERNELS.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), table, seq_lens, d ** -0.5)
        bf16_rows = lib.kvs_decode_stream_rows()
        lib.kvs_decode_set_key_ahead(0)
        blocks = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
        unahead_rows = lib.kvs_decode_stream_rows()
    finally:
        lib.kvs_decode_set_key_ahead(default)
        lib.kvs_decode_set_shared_owners(owners)
        lib.kvs_decode_set_stream_bytes(stream)
    assert rows == (0 if tasks == "heads" else 2 * int(seq_lens.sum()))
    assert bf16_rows == 0 and unahead_rows == 0
    assert torch.equal(streamed, blocks)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
def test_decode_streams_12_kb_ahead_on_amd_family_17h_else_32_unless_set(monkeypatch):
    """The float32 stream runs 12 KB ahead on AMD family 17h (Zen 1 and 2, whose prefetches all fill
    L1), else 32 KB; KVSTRATA_DECODE_STREAM_KB sets it when the kernels load (1 to 1024 KiB, anything
    else an error naming it). Outputs are the same bits at any distance."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    lib = KERNELS._lib
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines()[:12] if ":" in line)}
    family_17h = fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "23"
    default = lib.kvs_decode_set_stream_bytes(0)
    if platform.machine() in ("x86_64", "AMD64"):
        assert default == (12 << 10 if family_17h else 32 << 10)
    gen = torch.Generator().manual_seed(3)
    h, h_kv, d, block, batch = 9, 3, 64, 16, 12
    k_cache = torch.randn(96, block, h_kv, d, generator=gen)
    v_cache = torch.randn(96, block, h_kv, d, generator=gen)
    table = torch.randperm(96, generator=gen)[:48].repeat(batch, 1)
    seq_lens = torch.randint(1, 48 * block, (batch,), generator=gen)
    q = torch.randn(batch, h, d, generator=gen)
    outs = []
    try:
        for value in ("1", "12", "1024"):
            monkeypatch.setenv("KVSTRATA_DECODE_STREAM_KB", value)
            assert CpuKernels(lib).decode_stream_bytes == int(value) << 10
            outs.append(KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5))
        for bad in ("0", "1025", "12k", "-4"):
            monkeypatch.setenv("KVSTRATA_DECODE_STREAM_KB", bad)
            with pytest.raises(ValueError, match="KVSTRATA_DECODE_STREAM_KB"):
                CpuKernels(lib)
    finally:
        lib.kvs_decode_set_stream_bytes(default)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("threads", [1, None])
def test_decode_leaves_blocks_sequences_share_to_the_first_one(threads):
    """Sequences of a large batch whose tables begin with the same blocks (a shared prompt prefix):
    the first sequence holding a block prefetches it, and once that sequence is done the others skip
    the block's prefetches (csrc/dense_decode.c's Owners). The outputs are the same bits either way,
    float32 and bf16. On one thread every later sequence runs after the first is done, so their
    streams drop every row of the shared blocks they enter whole; on the kernel's own threads they
    drop some, never add any. Without sharing out, each row read is prefetched once."""
    lib = KERNELS._lib
    before = lib.omp_get_max_threads()
    if threads is not None:
        lib.omp_set_num_threads(threads)
    gen = torch.Generator().manual_seed(7)
    h, h_kv, d, block, batch, shared, own = 9, 3, 64, 16, 16, 20, 3  # 320 shared tokens, 3 blocks each after
    k_cache = torch.randn(shared + batch * own, block, h_kv, d, generator=gen)
    v_cache = torch.randn(shared + batch * own, block, h_kv, d, generator=gen)
    table = torch.cat([torch.arange(shared).repeat(batch, 1),
                       shared + torch.arange(batch * own).reshape(batch, own)], dim=1)
    seq_lens = shared * block + torch.randint(1, own * block + 1, (batch,), generator=gen)
    q = torch.randn(batch, h, d, generator=gen)
    ahead, owners = lib.kvs_decode_set_key_ahead(1), lib.kvs_decode_set_shared_owners(1)
    outs, rows = {}, {}
    try:
        lib.kvs_decode_stream_rows()  # from zero
        for on in (1, 0):
            lib.kvs_decode_set_shared_owners(on)
            outs[on] = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
            rows[on] = lib.kvs_decode_stream_rows()
            outs[on, "bf16"] = KERNELS.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), table, seq_lens,
                                                    d ** -0.5)
    finally:
        lib.kvs_decode_set_key_ahead(ahead)
        lib.kvs_decode_set_shared_owners(owners)
        lib.omp_set_num_threads(before)
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[1, "bf16"], outs[0, "bf16"])
    assert rows[0] == 2 * int(seq_lens.sum())  # K and V rows, each once
    shared_rows = 2 * shared * block  # K and V rows of the shared blocks
    assert rows[1] >= shared_rows + 2 * int((seq_lens - shared * block).sum())  # the first's, and each one's own
    if threads == 1:  # sequences 2 .. 15 drop all of them (sequence 1 some: the first one's stream ran into it)
        assert rows[1] <= rows[0] - (batch - 2) * shared_rows
    else:
        assert rows[1] <= rows[0]


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,h_kv,d,block,max_len", [
    (9, 3, 64, 16, 1300),  # SmolLM2's heads: chunks of 512 tokens, the last one partial
    (64, 8, 64, 16, 400),  # many heads: chunks of 128 tokens, 8 queries per KV head
    (32, 4, 128, 24, 700),  # head_dim 128, blocks of 24: chunks of 240 tokens
])
def test_kernel_matches_torch_decode_over_several_score_chunks(dtype, h, h_kv, d, block, max_len):
    """fp32 and bf16 rows score a chunk of blocks, then take one softmax step for it: contexts that
    span several chunks carry the running maximum and sums from one to the next. Both task shapes:
    a lone sequence per (sequence, KV head), a batch of 12 a sequence per task."""
    gen = torch.Generator().manual_seed(h * 10 + d)
    width = -(-max_len // block)
    num_blocks = 12 * width + 4
    k_cache = (torch.randn(num_blocks, block, h_kv, d, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen).to(dtype)
    for batch in (1, 12):
        seq_lens = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen)
        table = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
        q = (torch.randn(batch, h, d, generator=gen) * 3).to(dtype)
        got = KERNELS.paged_decode(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
        ref = paged_attention(q.float(), k_cache.float(), v_cache.float(),
                              _decode_meta(table, seq_lens, "torch", block), d ** -0.5)
        tol = 3e-5 if dtype == torch.float32 else 2e-2  # sums of up to 1300 terms
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
def test_kernel_reads_nothing_an_earlier_call_left_behind():
    """Blocks of 24 tokens end mid-vector: a context of 34 tokens has scores up to 34 but the softmax
    reads vectors up to 48. A call whose keys all score 640 runs first, in the same shapes, so that
    its scores are what lies past 34 in the reused buffers unless the kernel fills them."""
    gen = torch.Generator().manual_seed(11)
    h, h_kv, d, block, batch = 9, 3, 64, 24, 12
    table = torch.arange(batch * 2).view(batch, 2)
    loud = torch.full((batch * 2, block, h_kv, d), 10.0)
    KERNELS.paged_decode(torch.ones(batch, h, d), loud, loud, table, torch.full((batch,), 2 * block), 1.0)
    q = torch.randn(batch, h, d, generator=gen)
    k_cache = torch.randn(batch * 2, block, h_kv, d, generator=gen)
    v_cache = torch.randn(batch * 2, block, h_kv, d, generator=gen)
    lens = torch.full((batch,), block + 10)
    got = KERNELS.paged_decode(q, k_cache, v_cache, table, lens, d ** -0.5)
    ref = paged_attention(q, k_cache, v_cache, _decode_meta(table, lens, "torch", block), d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("big_at", [5, 550])  # in the first chunk of 512 tokens, or in the second
def test_kernel_softmax_stays_exact_when_the_maximum_moves_between_chunks(big_at):
    """One key scores 1000 and the rest 0: the output is that token's value row, whether the large
    score comes first (later chunks add e^-1000) or last (the earlier chunk's sums scaled to zero)."""
    d, n = 64, 600
    blocks = -(-n // 16)
    k_cache = torch.zeros(blocks, 16, 1, d)
    v_cache = torch.randn(blocks, 16, 1, d, generator=torch.Generator().manual_seed(big_at))
    k_cache.view(-1, d)[big_at, 0] = 1000.0
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    out = KERNELS.paged_decode(q, k_cache, v_cache, torch.arange(blocks)[None], torch.tensor([n]), 1.0)
    torch.testing.assert_close(out[0, 0], v_cache.view(-1, d)[big_at])


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("d", [64, 2])  # the vectorised head size and the generic path
def test_kernel_softmax_is_stable_for_large_scores(d):
    """Scores far beyond exp's range must not overflow: the running max keeps exp's argument <= 0."""
    k_cache = torch.zeros(2, BLOCK, 1, d)
    v_cache = torch.zeros(2, BLOCK, 1, d)
    k_cache[0, :, 0, 0] = torch.tensor([500.0, 1000.0, -1000.0, 0.0])
    v_cache[0, :, 0, :2] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [7.0, 7.0]])
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    out = paged_attention(q, k_cache, v_cache, _decode_meta(torch.tensor([[0]]), torch.tensor([4]), "kernel"), 1.0)
    torch.testing.assert_close(out[0, 0, :2], torch.tensor([0.0, 1.0]))
    assert torch.isfinite(out).all()


def _prefill_case(h, h_kv, d, block, specs, gen):
    """Prefill chunks (new tokens, context) over K/V in shuffled blocks, and a query tensor for all."""
    num_blocks = sum(-(-ctx // block) for _, ctx in specs) + 3
    k_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, h_kv, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, row = [], 0
    for n, ctx in specs:
        chunks.append(PrefillChunk(row, n, ctx, torch.tensor([perm.pop() for _ in range(-(-ctx // block))])))
        row += n
    return k_cache, v_cache, chunks, torch.randn(row, h, d, generator=gen)


def _prefill_meta(chunks, kernels):
    rows = sum(c.num_tokens for c in chunks)
    return AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long), num_decodes=0,
                             decode_block_tables=None, decode_seq_lens=None, decode_mask=None, prefills=chunks,
                             cpu_kernels=kernels)


# whole prompts, chunks after a cached prefix, one-token chunks, and tiles across the chunk's last rows
PREFILL_SPECS = [(40, 40), (32, 288), (1, 17), (5, 21), (17, 17), (3, 64)]


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("h,h_kv,d", [(9, 3, 64), (8, 8, 64), (8, 2, 128), (4, 1, 64)])
def test_c_prefill_attention_equals_the_torch_path(h, h_kv, d):
    gen = torch.Generator().manual_seed(h * 100 + h_kv + d)
    k_cache, v_cache, chunks, q = _prefill_case(h, h_kv, d, 16, PREFILL_SPECS, gen)
    meta = _prefill_meta(chunks, KERNELS)
    got = paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    assert meta.prefill_arrays is not None  # the C kernel took it
    want = paged_attention(q, k_cache, v_cache, _prefill_meta(chunks, None), d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one chunk alone gives the same bits: tiles never mix chunks
    alone = paged_attention(q[40:72], k_cache, v_cache, _prefill_meta([PrefillChunk(0, 32, 288, chunks[1].block_ids)],
                                                                       KERNELS), d ** -0.5)
    assert torch.equal(alone, got[40:72])


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "int4"])
@pytest.mark.parametrize("d", [64, 128])
def test_c_prefill_reads_quantized_rows_like_the_torch_path(name, d):
    """The pool recycled (random bytes; fp8 NaN codes among them) and only the chunks' context
    written: rows past a context are read by no visible key."""
    from kvstrata.worker.kv_format import make_kv_format

    gen = torch.Generator().manual_seed(d + len(name))
    h, h_kv = 9, 3
    k_float, v_float, chunks, q = _prefill_case(h, h_kv, d, 16, PREFILL_SPECS, gen)
    fmt = make_kv_format(name, d, 16, torch.float32)
    k_cache = torch.randint(0, 256, (*k_float.shape[:3], fmt.spec().row_width), dtype=torch.uint8, generator=gen)
    v_cache = torch.randint(0, 256, k_cache.shape, dtype=torch.uint8, generator=gen)
    for c in chunks:
        slots = (c.block_ids[:, None] * 16 + torch.arange(16)).flatten()[: c.context_len]
        fmt.write(k_cache, k_float.flatten(0, 1)[slots] * 3, slots, key=True)
        fmt.write(v_cache, v_float.flatten(0, 1)[slots], slots, key=False)
    meta = _prefill_meta(chunks, KERNELS)
    meta.kv_format = fmt
    got = paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    assert meta.prefill_arrays is not None  # the C kernel took it
    reference = _prefill_meta(chunks, None)
    reference.kv_format = fmt
    want = paged_attention(q, k_cache, v_cache, reference, d ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("h,h_kv,d", [(9, 3, 64), (8, 2, 128)])
def test_c_prefill_attention_reads_bf16_rows_like_the_float32_path(h, h_kv, d):
    """bf16 K/V widened as read, bf16 queries widened before: the float32 kernel's output over the
    same values, rounded once to bf16. Decode rows ahead of the chunks are left to the decode path."""
    gen = torch.Generator().manual_seed(h + d)
    k_float, v_float, chunks, q_float = _prefill_case(h, h_kv, d, 16, PREFILL_SPECS, gen)
    k_cache, v_cache, q = k_float.bfloat16(), v_float.bfloat16(), q_float.bfloat16()
    decodes = 2
    shifted = [PrefillChunk(c.token_start + decodes, c.num_tokens, c.context_len, c.block_ids) for c in chunks]
    q = torch.cat([torch.randn(decodes, h, d, generator=gen).bfloat16(), q])
    meta = _prefill_meta(shifted, KERNELS)
    meta.slot_mapping = torch.zeros(q.shape[0], dtype=torch.long)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    from kvstrata.worker.attention import _prefill_in_c

    meta.num_decodes = decodes
    assert _prefill_in_c(q, k_cache, v_cache, meta, d ** -0.5, out)
    assert (out[:decodes] == 7.0).all()  # not its rows
    want = paged_attention(q[decodes:].float(), k_cache.float(), v_cache.float(), _prefill_meta(chunks, KERNELS),
                           d ** -0.5)
    assert torch.equal(out[decodes:], want.bfloat16())
    # and against torch's bf16 path, which rounds differently: close
    reference = paged_attention(q[decodes:], k_cache, v_cache, _prefill_meta(chunks, None), d ** -0.5)
    torch.testing.assert_close(out[decodes:].float(), reference.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
def test_c_prefill_reads_queries_in_place_from_the_fused_projection():
    gen = torch.Generator().manual_seed(3)
    h, h_kv, d = 9, 3, 64
    k_cache, v_cache, chunks, q = _prefill_case(h, h_kv, d, 16, PREFILL_SPECS, gen)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * h_kv * d, generator=gen)], dim=1)
    view = qkv[:, : h * d].view(-1, h, d)  # token rows (h + 2 h_kv) d floats apart
    got = paged_attention(view, k_cache, v_cache, _prefill_meta(chunks, KERNELS), d ** -0.5)
    want = paged_attention(q, k_cache, v_cache, _prefill_meta(chunks, None), d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("d,block", [(32, 16), (64, 12)])  # 12: a multiple of no build's key chunk (8 or 16)
def test_shapes_the_c_prefill_does_not_take_go_through_torch(d, block):
    gen = torch.Generator().manual_seed(d + block)
    k_cache, v_cache, chunks, q = _prefill_case(4, 2, d, block, [(6, 6), (3, 20)], gen)
    assert not KERNELS.paged_prefill(q, k_cache, v_cache, torch.empty_like(q), prefill_arrays(chunks), 0.5)
    got = paged_attention(q, k_cache, v_cache, _prefill_meta(chunks, KERNELS), 0.5)
    torch.testing.assert_close(got, paged_attention(q, k_cache, v_cache, _prefill_meta(chunks, None), 0.5))


@pytest.mark.skipif(KERNELS is None, reason="no C compiler")
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("h,h_kv,d", [(9, 3, 64), (8, 2, 128)])
def test_c_prefill_tiles_of_two_row_vectors_give_each_row_the_same_bits(kv, h, h_kv, d):
    """A step with tiles enough takes two vectors of rows a tile (csrc/prefill_attention.c); each
    row's sums run in the same order as in a tile of one, so the output is the same bits."""
    from kvstrata.worker.kv_format import make_kv_format

    gen = torch.Generator().manual_seed(d + h + len(kv))
    specs = [(100, 400), (37, 37), (3, 64), (20, 52)]  # long, whole, short, and rows past a pair's end
    k_cache, v_cache, chunks, q = _prefill_case(h, h_kv, d, 16, specs, gen)
    meta = _prefill_meta(chunks, KERNELS)
    if kv == "bfloat16":
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    elif kv == "int8":
        fmt = make_kv_format(kv, d, 16, torch.float32)
        codes = torch.zeros((*k_cache.shape[:3], fmt.spec().row_width), dtype=torch.uint8)
        k_codes, v_codes = codes, codes.clone()
        slots = torch.arange(k_cache.shape[0] * 16)
        fmt.write(k_codes, k_cache.flatten(0, 1), slots, key=True)
        fmt.write(v_codes, v_cache.flatten(0, 1), slots, key=False)
        k_cache, v_cache, meta.kv_format = k_codes, v_codes, fmt
    lib = KERNELS._lib
    outs = []
    default = lib.kvs_prefill_set_pairs(0)
    try:
        for on in (0, 1):
            lib.kvs_prefill_set_pairs(on)
            before = lib.kvs_prefill_pair_tiles()
            outs.append(paged_attention(q, k_cache, v_cache, meta, d ** -0.5))
            assert meta.prefill_arrays is not None  # the C kernel took it
            assert (lib.kvs_prefill_pair_tiles() > before) == bool(on)
    finally:
        lib.kvs_prefill_set_pairs(default)
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
