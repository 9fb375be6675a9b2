"""The greedy head (worker/greedy_head.py, csrc/greedy_head.c): a float32 model's greedy tokens from an int8
or bf16 copy of the head, the same tokens the float32 logits' argmax gives."""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.worker import greedy_head
from kvstrata.worker.cpu_kernels import load_cpu_kernels

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None or not greedy_head.available(KERNELS),
                                   reason="no C compiler, or no fused multiply-adds")
needs_int8 = pytest.mark.skipif(KERNELS is None or not greedy_head.available(KERNELS)
                                or not greedy_head.int8_available(KERNELS), reason="no int8 products in this build")
COPIES = ["bf16", pytest.param("int8", marks=needs_int8)]


@pytest.fixture
def copy_env(monkeypatch):
    """Sets KVSTRATA_GREEDY_HEAD_COPY for the GreedyHeads a test makes."""
    return lambda copy: monkeypatch.setenv(greedy_head.COPY_ENV, copy)


def _head(vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head [vocab, k] and rows x [24, k], the first 8 of which pick token 1 in float32 while the bf16
    products put token 0 ahead by nearly as much as they misjudge token 1. Every value of b, a bf16
    vector, sits just below a power of two (its largest mantissa), so that b raised by 0.99 x 2^-9
    still rounds to b: row 1 is b so raised, and its bf16 products miss that much of its logit, all
    of it one way (x[:8] point along b); row 0 is b with enough values one bf16 step larger that its
    logit lies about 0.9 of that above b's."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, k, generator=gen) * 0.05
    signs = torch.randint(0, 2, (k,), generator=gen).float() * 2 - 1
    b = signs * (2 - 2 ** -7) * 2 ** -4  # bf16 values with the largest mantissa
    step = (2 ** -3 - (2 - 2 ** -7) * 2 ** -4) * 32 * (2 - 2 ** -7) * 2 ** -4  # one value one step up, x = 32 b
    missed = 0.99 * 2 ** -9 * k * 32 * ((2 - 2 ** -7) * 2 ** -4) ** 2
    bumped = b.clone()
    bumped[:round(0.9 * missed / step)] = signs[:round(0.9 * missed / step)] * 2 ** -3
    head[0], head[1], head[2] = bumped, b * (1 + 0.99 * 2 ** -9), b
    x = torch.randn(24, k, generator=gen)
    x[:8] = b * 32 + torch.randn(8, k, generator=gen) * 1e-3 * (torch.rand(8, k, generator=gen) < 0.01)
    return head, x


def _made(copy_env, copy: str, make, vocab: int, k: int, kept: bool = False):
    """(head, x, packed head, GreedyHead) for `make`'s head and rows, with the given copy."""
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env(copy)
    head, x = make(vocab, k, seed=vocab + k)
    packed = KERNELS.pack(head)
    return head, x, packed, GreedyHead(KERNELS, head, packed, kept=kept)


def _reference(x: torch.Tensor, packed) -> torch.Tensor:
    logits = KERNELS.gemm(x, packed, None, to_float=True)  # the float32 head, as the engine computes it
    return KERNELS.argmax(logits)


@needs_kernels
@pytest.mark.parametrize("kept", [True, False])  # the float32 rows read from the head itself, or the packed copy
# a last group of the head part empty, an odd width (the bf16 pairs padded), a tail past the last vector and block
@pytest.mark.parametrize("vocab,k", [(1000, 576), (1000, 63), (49152 + 7, 576)])
def test_greedy_tokens_are_the_float32_logits_argmax(kept, vocab, k, copy_env):
    head, x, packed, greedy = _made(copy_env, "bf16", _head, vocab, k, kept)
    want = _reference(x, packed)
    approx = KERNELS.gemm(x, KERNELS.pack(head.bfloat16()), None, to_float=True)
    assert (approx.argmax(dim=1)[:8] == 0).all() and (want[:8] == 1).all()  # the bf16 products alone get these wrong
    values = torch.empty(len(x))
    got = greedy.tokens(x, values)
    assert torch.equal(got, want)
    full = KERNELS.gemm(x, packed, None, to_float=True)
    assert torch.equal(values, full[torch.arange(len(x)), want])  # the float32 logits' own bits
    # the bound left tokens 0 and 1 (at least) of the first rows to check, and little else
    assert 2 * 8 <= greedy.checked < 24 * 40
    for rows in (1, 5, 70):  # one row, a few, more than one bf16 product's worth
        xs = x.repeat(3, 1)[:rows]
        assert torch.equal(greedy.tokens(xs), _reference(xs, packed))
    _check_values_past_the_first_call(greedy, x, packed)


def _int8_head(vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head [vocab, k] and rows x [24, k], the first 8 of which pick token 1 in float32 while the int8
    copy puts token 0 ahead, by more than any bound without the copy's own error (|x| |e_j|) allows.
    Both rows hold M = 127 s at column 0 (x is 0 there), so both scale by s; over the next p columns
    row 0 holds 0.51 s (code 1) and row 1 0.49 s (code 0), over the p after them row 0 holds 0 and row
    1 0.49 s (code 0). Where x is 1 on those 2p columns, the codes give token 0 p s and token 1
    nothing, while the float32 logits are 0.51 p s and 0.98 p s. The other rows are small."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, k, generator=gen) * 1e-3
    p, big = (k - 1) // 2, 0.5
    s = big / 127
    head[0:2] = 0.0
    head[0:2, 0] = big
    head[0, 1:1 + p] = 0.51 * s
    head[1, 1:1 + 2 * p] = 0.49 * s
    x = torch.randn(24, k, generator=gen)
    x[:8] = 0.0
    x[:8, 1:1 + 2 * p] = 1.0 + torch.rand(8, 2 * p, generator=gen) * 1e-3
    return head, x


@needs_int8
@pytest.mark.parametrize("kept", [True, False])
# a tail past the last vector of a tile, k not a whole number of quads, a tail past the last tile and block
@pytest.mark.parametrize("vocab,k", [(1000, 576), (1000, 63), (49152 + 7, 576)])
def test_int8_copy_tokens_are_the_float32_logits_argmax(kept, vocab, k, copy_env):
    head, x, packed, greedy = _made(copy_env, "int8", _int8_head, vocab, k, kept)
    assert greedy.copy == "int8" and greedy.bf16 is None
    want = _reference(x, packed)
    approx = greedy.approx_logits(x)
    assert (approx.argmax(dim=1)[:8] == 0).all() and (want[:8] == 1).all()  # the int8 products alone get these wrong
    # elsewhere (random rows against random tokens), the copy's logits lie close to the float32 ones
    full = KERNELS.gemm(x, packed, None, to_float=True)
    assert (approx[8:, 2:] - full[8:, 2:]).abs().max() < 0.02 * full[8:, 2:].abs().max()
    values = torch.empty(len(x))
    assert torch.equal(greedy.tokens(x, values), want)
    assert torch.equal(values, full[torch.arange(len(x)), want])  # the float32 logits' own bits
    assert 2 * 8 <= greedy.checked < 24 * 100
    for rows in (1, 2, 4, 5, 70):  # tiles of 1, 2 and 3 rows; more than one call's worth
        xs = x.repeat(3, 1)[:rows]
        assert torch.equal(greedy.tokens(xs), _reference(xs, packed))
    _check_values_past_the_first_call(greedy, x, packed)
    assert greedy.nbytes < head.numel() * 2  # a byte a weight, and its row sums, scales and norms


def _check_values_past_the_first_call(greedy, x, packed):
    """70 rows (two calls of the first pass): every row's token and logit where it belongs."""
    xs = x.repeat(3, 1)[:70]
    want = _reference(xs, packed)
    values = torch.empty(70)
    assert torch.equal(greedy.tokens(xs, values), want)
    assert torch.equal(values, KERNELS.gemm(xs, packed, None, to_float=True)[torch.arange(70), want])


@needs_int8
def test_the_int8_copys_scales_sums_and_residual_norms_bound_what_they_claim(copy_env):
    """What the bound rests on, against float64: each row's codes times its scale, its code sum, and
    |w_j - s_j q_j| from above (and barely above); each input row's |x| and |x - s_x qx| likewise."""
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env("int8")
    gen = torch.Generator().manual_seed(11)
    v, k = 130, 70  # a partial last tile and a partial last quad
    head = torch.randn(v, k, generator=gen) * torch.rand(v, 1, generator=gen)
    greedy = GreedyHead(KERNELS, head, KERNELS.pack(head))
    quads, cols, tile = (k + 3) // 4, -(-v // 64) * 64, greedy_head.int8_tile_cols(KERNELS)
    q = greedy.int8.view(cols // tile, quads, tile, 4).permute(0, 2, 1, 3).reshape(cols, 4 * quads)
    assert (q[v:] == 0).all() and (q[:, k:] == 0).all()  # the padding
    q = q[:v, :k].double()
    scale = greedy.int8_scale[:v].double()
    w = head.double()
    assert torch.equal(scale, (head.abs().amax(dim=1) / 127).double())
    assert (q.abs() <= 127).all() and ((w / scale[:, None] - q).abs() <= 0.5 + 1e-6).all()
    assert torch.equal(greedy.int8_rowsum[:v], q.sum(dim=1).int())
    residual = (w - scale[:, None] * q).norm(dim=1)
    enorm = greedy.int8_enorm.double()
    assert (enorm >= residual).all() and (enorm <= residual * (1 + 1e-5) + 1e-30).all()
    x = torch.randn(5, k, generator=gen) * 3
    x[2, 7] = 40.0  # one large value: taken to x's high byte, not to the row's scale (AVX2: it coarsens it)
    xnorms = greedy._approx_into(x, torch.empty(5, v), greedy.hi_dims).double()
    xd = x.double()
    sx = _x_scale(x, greedy.hi_dims).double()
    assert (xnorms[:, 0] >= xd.norm(dim=1)).all() and (xnorms[:, 0] <= xd.norm(dim=1) * (1 + 1e-5)).all()
    # |e_x| is at most half a step an element, and at least what rounding x itself to 16 bits leaves
    assert (xnorms[:, 1] <= (sx[:, 0] / 2) * k ** 0.5 * (1 + 1e-5)).all()
    ideal = (xd - (xd / sx).round() * sx).norm(dim=1)
    assert (xnorms[:, 1] >= ideal * (1 - 1e-3)).all()


def _x_qmax(k: int) -> int:
    """x's largest code in this build: 32639 with AVX-512 VNNI (hi within +-127); with AVX2, 32767,
    fewer for long rows (each lane's 2 kq products within int32)."""
    if KERNELS._lib.kvs_int8_head_available() == 2:
        return min(32767, (2 ** 31 - 1) // (254 * ((k + 3) // 4)))
    return 32639


def _x_scale(x: torch.Tensor, hi_dims: int) -> torch.Tensor:
    """Each row's s_x [rows, 1] (float32) as csrc/int8_head.c chooses it: with AVX-512 VNNI, max |x| /
    32639 or, for hi_dims 0-64, where larger, the (hi_dims + 1)-th largest |x_k| / 127; with AVX2, max
    |x| / 32767, fewer codes for long rows (each quotient computed in float64 and rounded: float32's own
    division)."""
    k = x.shape[1]
    big = x.abs().amax(dim=1, keepdim=True).double()
    s = (big / _x_qmax(k)).float()
    if KERNELS._lib.kvs_int8_head_available() == 2:
        return s
    if 0 <= hi_dims < k and hi_dims <= 64:
        t = x.abs().sort(dim=1, descending=True).values[:, hi_dims:hi_dims + 1].double()
        s = torch.maximum(s, (t / 127).float())
    return s


def _x_codes(x: torch.Tensor, hi_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_x [rows, 1], qx [rows, k]) as the C kernel takes them: qx = round(x * (1 / s_x)) in float32,
    ties to even, within the build's largest code."""
    sx = _x_scale(x, hi_dims)
    inv = torch.where(sx > 0, (1 / sx.double()).float(), torch.zeros_like(sx))
    qmax = _x_qmax(x.shape[1])
    return sx, (x * inv).round().clamp(-qmax, qmax)


def _int8_codes(greedy, v: int, k: int) -> torch.Tensor:
    """The int8 copy's codes q [v, k], unpacked from its tiles."""
    quads, cols, tile = (k + 3) // 4, -(-v // 64) * 64, greedy_head.int8_tile_cols(KERNELS)
    q = greedy.int8.view(cols // tile, quads, tile, 4).permute(0, 2, 1, 3).reshape(cols, 4 * quads)
    return q[:v, :k]


@needs_int8
@pytest.mark.parametrize("k", [576, 63, 100])  # the model's width; a last quad part padded; no whole tile
def test_the_int8_copys_logits_are_its_exact_sums_whatever_quads_hold_high_bytes(k, copy_env):
    """The copy's logits against a float64 model of its own arithmetic: each row's codes times the
    head's, summed exactly, times both scales. Rows hold three values 25x the rest at dims of their own,
    so that a block's rows (up to 6 a block, as even as they go: 1 to 13 rows) take x's high byte in
    different quads, which the kernel multiplies only there; with 0, 1, 8 and 64 of a row's largest
    values past its low byte, and every value at 16 bits (-1, a bf16 model's). A quad's high byte
    left out, or the offsets taken off wrongly, moves a logit by hundreds of its own scale."""
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env("int8")
    gen = torch.Generator().manual_seed(k)
    v = 300
    head = torch.randn(v, k, generator=gen)
    greedy = GreedyHead(KERNELS, head, KERNELS.pack(head))
    q = _int8_codes(greedy, v, k).double()
    scale = greedy.int8_scale[:v].double()
    x = torch.randn(13, k, generator=gen)
    for r in range(13):
        x[r, torch.randperm(k, generator=gen)[:3]] *= 25
    assert greedy.approx_logits(x[:0]).shape == (0, v)  # no rows, no blocks
    assert greedy.hi_dims == greedy_head.HI_DIMS == 8  # a float32 model's
    for hi_dims in (0, 1, 8, 64, greedy_head.HI_DIMS_ALL):
        greedy.hi_dims = hi_dims
        for rows in (1, 2, 5, 7, 13):
            sx, qx = _x_codes(x[:rows], hi_dims)
            if hi_dims != 0:
                assert (qx.abs() > 127).any()  # past a byte: high bytes to multiply
            exact = (qx.double() @ q.T) * scale * sx.double()
            approx = greedy.approx_logits(x[:rows]).double()
            assert (approx - exact).abs().max() <= 1e-5 * exact.abs().max(), (hi_dims, rows)
        assert torch.equal(greedy.tokens(x), _reference(x, KERNELS.pack(head)))


@needs_int8
# whole blocks of 64 for the tiles; one block, its last quad padded; a k the tiles leave to the vectors
@pytest.mark.parametrize("k", [576, 63, 100])
def test_the_int8_copys_tiles_give_the_vector_kernels_bits(k, copy_env):
    """On AMX tiles (from 4 rows, and only where k's quads are whole blocks of 16) the int8 copy's
    sums are the vector kernel's, exact in integers, so its approximate logits are the same floats: rows
    split into tile passes of up to 8, as even as they go (4 to 8 rows one pass, 9 two of 5 and 4,
    17 three), a row with a non-finite value among them."""
    import ctypes

    if not KERNELS.amx:
        pytest.skip("no AMX tiles here")
    lib = KERNELS._lib
    lib.kvs_int8_head_set_amx.argtypes = [ctypes.c_int]
    lib.kvs_int8_head_set_amx.restype = ctypes.c_int
    head, x, packed, greedy = _made(copy_env, "int8", _int8_head, 1000 + 9, k)
    x = torch.cat([x, x * 3 + 1])[:41]
    x[13, 5] = float("inf")
    assert lib.kvs_int8_head_set_amx(-1) == 1  # on by default
    try:
        for rows in (1, 3, 4, 5, 8, 9, 16, 17, 24, 41):
            lib.kvs_int8_head_set_amx(1)
            tiles = greedy.approx_logits(x[:rows])
            lib.kvs_int8_head_set_amx(0)
            vectors = greedy.approx_logits(x[:rows])
            finite = torch.isfinite(x[:rows]).all(dim=1)
            assert torch.equal(tiles[finite], vectors[finite]), rows
            assert tiles[finite].abs().max() > 0
    finally:
        lib.kvs_int8_head_set_amx(1)
    assert greedy.tokens(x[:17]) is None  # row 13: the caller takes the float32 head
    keep = torch.isfinite(x).all(dim=1)
    assert torch.equal(greedy.tokens(x[keep]), _reference(x[keep], packed))


@needs_int8
def test_the_int8_copy_of_a_zero_row_and_of_zero_inputs(copy_env):
    """A head row of zeros (no scale) and an input row of zeros (every token ties at 0: the first wins)."""
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env("int8")
    head, x = _int8_head(300, 64, seed=3)
    head[5] = 0.0
    x[3] = 0.0
    packed = KERNELS.pack(head)
    greedy = GreedyHead(KERNELS, head, packed)
    assert torch.equal(greedy.tokens(x), _reference(x, packed))
    assert int(greedy.tokens(x[3:4])[0]) == 0


@needs_int8
def test_the_int8_copys_sums_stay_exact_for_long_rows(copy_env):
    """k past 1,032 with every code of x and of the head at its largest: taken to 16 bits, x's
    products would pass int32 in one lane of the AVX2 kernel's sums (2 kq of them a lane), so x takes
    fewer bits there; the copy's logits stay close and the tokens are the float32 logits' argmax."""
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env("int8")
    k = 2100
    head = (0.01 * (1 + torch.arange(300) / 1000)).unsqueeze(1).repeat(1, k)  # each row one value: codes 127
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2] = torch.randn(k, generator=torch.Generator().manual_seed(5))
    packed = KERNELS.pack(head)
    greedy = GreedyHead(KERNELS, head, packed)
    full = KERNELS.gemm(x, packed, None, to_float=True)
    assert (greedy.approx_logits(x) - full).abs().max() < 1e-3 * full.abs().max()
    want = _reference(x, packed)
    assert want[:2].tolist() == [299, 0]
    assert torch.equal(greedy.tokens(x), want)


def _bf16_model_head(vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 head [vocab, k] and bf16 rows x [24, k]. Rows 0 and 1 of the head hold 127 s at column 0
    (x is 0 there: both scale by s = 2^-7, and their int8 copies are exact) and 100, 100, 100 against
    100, 100, 101 times s at columns 1-3, where x[:8] is 1 and 0 elsewhere: their float32 logits 2.34375
    and 2.3515625, which round to the same bf16 value, so the answer is token 0, though both the copy
    and the float32 sums put token 1 ahead by far more than the copy's bound. Rows 2 and 3 are equal,
    for ties among the others."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, k, generator=gen) * 0.01
    head[0:2] = 0.0
    head[0:2, 0] = 127 * 2 ** -7
    head[0, 1:4] = torch.tensor([100.0, 100.0, 100.0]) * 2 ** -7
    head[1, 1:4] = torch.tensor([100.0, 100.0, 101.0]) * 2 ** -7
    head[3] = head[2]
    x = torch.randn(24, k, generator=gen)
    x[:8] = 0.0
    x[:8, 1:4] = 1.0
    return head.bfloat16(), x.bfloat16()


@needs_int8
@pytest.mark.parametrize("vocab,k", [(1000, 576), (1000, 63), (49152 + 7, 576)])
def test_a_bf16_models_greedy_tokens_are_its_own_logits_argmax(vocab, k, copy_env):
    """For a bf16 model the answer is the first of the largest of its GEMM's logits rounded to bf16:
    tokens whose float32 sums lie within a bf16 step of the best are checked too."""
    from kvstrata.worker.greedy_head import GreedyHead

    head, x, packed, greedy = _made(copy_env, "int8", _bf16_model_head, vocab, k, kept=True)
    assert greedy.model_bf16 and greedy.head_rows.data_ptr() == head.data_ptr()  # kept: read in place
    logits = KERNELS.gemm(x, packed, None, to_float=True)  # the model's own logits, as bf16 values
    want = KERNELS.argmax(logits)
    sums = x.float() @ head.float().T
    assert (sums[:8, 1] > sums[:8, 0]).all() and (want[:8] == 0).all()  # rounding ties them: the first wins
    assert (greedy.approx_logits(x)[:8].argmax(dim=1) == 1).all()
    values = torch.empty(len(x))
    assert torch.equal(greedy.tokens(x, values), want)
    assert torch.equal(values, logits[torch.arange(len(x)), want])
    for rows in (1, 2, 5, 70):
        xs = x.repeat(3, 1)[:rows]
        assert torch.equal(greedy.tokens(xs), KERNELS.argmax(KERNELS.gemm(xs, packed, None, to_float=True)))
    with pytest.raises(ValueError, match="bfloat16 rows"):
        greedy.tokens(x.float())
    copy_env("bf16")
    with pytest.raises(ValueError, match="int8 copy"):
        GreedyHead(KERNELS, head, packed)


def _crowded_bf16_head(vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 head whose first 40 rows are one row plus noise far below a bf16 step of the rows' logits,
    and rows x that favour that row: each row of x leaves dozens of tokens to check."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, k, generator=gen) * 0.02
    base = torch.randn(k, generator=gen) * 0.05
    head[:40] = base + torch.randn(40, k, generator=gen) * 1e-4
    x = (base * 40 + torch.randn(12, k, generator=gen) * 0.1).bfloat16()
    return head.bfloat16(), x


@needs_int8
@pytest.mark.parametrize("k", [576, 70])  # k pairs a whole number of 16, and a tail of 3
@pytest.mark.parametrize("dot", [True, False])  # the GEMM on bf16 dot products, or widened
def test_a_bf16_models_checks_from_its_rows_give_its_gemms_bits(k, dot, copy_env):
    """The tokens a bf16 model's bound leaves, computed from the head's rows 16 at a time (kept rows,
    the GEMM on bf16 dot products) or group by group by its GEMM, have the GEMM's logits bit for bit:
    the answers and their values match its own head's with dozens of tokens checked a row."""
    from kvstrata.worker.greedy_head import GreedyHead, WAY_HI_DIMS

    lib = KERNELS._lib
    if dot and not KERNELS.bf16_dot:
        pytest.skip("no bf16 dot products in this build or CPU")
    assert lib.kvs_bf16_dot_enable(int(dot)) == dot
    try:
        copy_env("int8")
        head, x = _crowded_bf16_head(3000, k, seed=k)
        packed = KERNELS.pack(head)
        logits = KERNELS.gemm(x, packed, None, to_float=True)
        want = KERNELS.argmax(logits)
        for kept in (True, False):
            greedy = GreedyHead(KERNELS, head, packed, kept=kept)
            for hi_dims in sorted(set(WAY_HI_DIMS.values())):
                values = torch.full((len(x),), float("nan"))
                before = greedy.checked
                assert torch.equal(greedy._copy_tokens(x, values, hi_dims), want), (kept, hi_dims)
                assert torch.equal(values, logits[torch.arange(len(x)), want]), (kept, hi_dims)
                assert greedy.checked - before > 16 * len(x), (kept, hi_dims)  # more than a batch of 16 a row
        # the kept rows are what the checks read (off AMX tiles, which keep the group path): rows moved
        # away from the packed head move the values
        greedy = GreedyHead(KERNELS, head, packed, kept=True)
        greedy.head_rows = head.clone()
        greedy.head_rows[:40] = 0
        values = torch.full((len(x),), float("nan"))
        greedy._copy_tokens(x, values, -1)
        assert torch.equal(values, logits[torch.arange(len(x)), want]) == KERNELS.amx
    finally:
        lib.kvs_bf16_dot_enable(int(KERNELS.bf16_dot))


@needs_int8
@pytest.mark.parametrize("k", [576, 70, 2])
@pytest.mark.parametrize("dot", [True, False])  # the GEMM on bf16 dot products, or widened
def test_bf16_checks_from_rows_are_the_gemms_float32_sums(k, dot):
    """csrc/greedy_head.c's sums from the head's rows, 1 to 16 columns at once (dot_logits on the dot
    products, exact_bf16_logits for the widened weights), against the packed GEMM's float32 sums
    the same way: the same bits."""
    import ctypes

    if dot and not KERNELS.bf16_dot:
        pytest.skip("no bf16 dot products in this build or CPU")
    if KERNELS.amx:
        pytest.skip("the GEMM runs on AMX tiles here, in their own order; their checks keep the group path")
    lib = KERNELS._lib
    lib.kvs_greedy_row_logits.restype = ctypes.c_int
    lib.kvs_greedy_row_logits.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    gen = torch.Generator().manual_seed(k)
    head = (torch.randn(500, k, generator=gen) * torch.logspace(-3, 2, k)).bfloat16()  # sums that round
    x = (torch.randn(3, k, generator=gen) * 10).bfloat16()
    sums = torch.empty(3, 500)
    assert lib.kvs_bf16_dot_enable(int(dot)) == dot
    try:
        packed = KERNELS.pack(head)  # held: C gets only its pointer
        lib.kvs_gemm_bf16x(x.data_ptr(), k, packed.data.data_ptr(), None, sums.data_ptr(), 0, 3, 500, k)
    finally:
        lib.kvs_bf16_dot_enable(int(KERNELS.bf16_dot))
    for count in (1, 5, 9, 16):
        idx = torch.randint(0, 500, (count,), generator=gen, dtype=torch.int32)
        for r in range(3):
            out = torch.full((count,), float("nan"))
            assert lib.kvs_greedy_row_logits(x[r].data_ptr(), head.data_ptr(), k, idx.data_ptr(), count, int(dot),
                                             out.data_ptr()) == 0
            assert torch.equal(out, sums[r, idx.long()]), (count, r)
    assert lib.kvs_greedy_row_logits(x[0].data_ptr(), head.data_ptr(), k, idx.data_ptr(), 17, int(dot),
                                     out.data_ptr()) == -1


@needs_int8
def test_a_bf16_models_ways_give_the_same_tokens_and_the_calls_take_the_fastest(copy_env):
    """Each of a bf16 model's ways (the int8 copy with x's largest values past a byte or all at 16 bits,
    its own head) gives its logits' argmax and their values; the calls, timed by the choice's clock,
    then go the fastest way: with the own head the quickest, nothing is checked any more."""
    from kvstrata.worker.greedy_head import OWN_WAY, WAY_HI_DIMS

    head, x, packed, greedy = _made(copy_env, "int8", _bf16_model_head, 1000, 576)
    choice = greedy.choice
    assert OWN_WAY in choice.ways and set(choice.ways) - {OWN_WAY} <= set(WAY_HI_DIMS) and len(choice.ways) >= 2
    logits = KERNELS.gemm(x, packed, None, to_float=True)
    want = KERNELS.argmax(logits)
    for way in choice.ways:
        choice.pick = lambda rows, way=way: way
        values = torch.full((len(x),), float("nan"))
        before = greedy.checked
        assert torch.equal(greedy.tokens(x, values), want), way
        assert torch.equal(values, logits[torch.arange(len(x)), want]), way
        assert (greedy.checked > before) == (way != OWN_WAY), way
    del choice.pick
    cost = {way: 1.0 + (way != OWN_WAY) for way in choice.ways}  # seconds a call of 8 rows
    taken: list[str] = []
    reads: list[float] = []
    real = choice.pick

    def pick(rows: int) -> str:
        taken.append(real(rows))
        return taken[-1]

    def clock() -> float:  # read before and after each call: the second read moves by the way's cost
        reads.append(reads[-1] + (cost[taken[-1]] if len(reads) % 2 else 0.0) if reads else 0.0)
        return reads[-1]

    choice.pick, choice.clock = pick, clock
    for _ in range(choice.samples * len(choice.ways)):
        assert torch.equal(greedy.tokens(x[:8]), want[:8])
    assert sorted(set(taken)) == sorted(choice.ways)
    before = greedy.checked
    for _ in range(5):
        assert torch.equal(greedy.tokens(x[:8]), want[:8])
    assert greedy.checked == before and taken[-5:] == [OWN_WAY] * 5 and choice.best(8) == OWN_WAY


def test_the_copy_is_chosen_by_its_switch_or_by_the_build(monkeypatch):
    from kvstrata.worker.greedy_head import COPY_ENV, chosen_copy

    class Build:
        amx = False

    monkeypatch.setattr(greedy_head, "int8_available", lambda kernels: vnni)
    monkeypatch.delenv(COPY_ENV, raising=False)
    for vnni, amx, want in ((True, False, "int8"), (False, False, "bf16"), (True, True, "int8")):
        Build.amx = amx
        assert chosen_copy(Build) == want
    vnni = True
    monkeypatch.setenv(COPY_ENV, "bf16")
    assert chosen_copy(Build) == "bf16"
    monkeypatch.setenv(COPY_ENV, "int4")
    with pytest.raises(ValueError, match=COPY_ENV):
        chosen_copy(Build)
    vnni = False
    monkeypatch.setenv(COPY_ENV, "int8")
    with pytest.raises(ValueError, match="VNNI"):
        chosen_copy(Build)


@needs_kernels
@pytest.mark.parametrize("copy", COPIES)
def test_a_row_with_a_non_finite_value_is_left_to_the_float32_head(copy, copy_env):
    from kvstrata.worker.greedy_head import GreedyHead

    copy_env(copy)
    head, x = _head(1000, 64, seed=1)
    greedy = GreedyHead(KERNELS, head, KERNELS.pack(head), kept=True)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 5] = bad
        assert greedy.tokens(y) is None
    with pytest.raises(ValueError, match="float32 rows"):
        greedy.tokens(x.double())
    with pytest.raises(ValueError, match="same dtype"):
        GreedyHead(KERNELS, head.bfloat16(), KERNELS.pack(head))


def test_the_switch_is_0_or_1(monkeypatch):
    from kvstrata.worker.greedy_head import ENV, wanted

    monkeypatch.delenv(ENV, raising=False)
    assert wanted()
    monkeypatch.setenv(ENV, "0")
    assert not wanted()
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        wanted()


@needs_kernels
def test_calls_of_more_rows_than_max_rows_are_left_to_the_float32_head():
    from kvstrata.worker.greedy_head import GreedyHead

    head, x = _head(1000, 64, 5)
    packed = KERNELS.pack(head)
    greedy = GreedyHead(KERNELS, head, packed)
    greedy.max_rows = 3
    assert torch.equal(greedy.tokens(x[:3]), _reference(x[:3], packed))
    assert greedy.tokens(x[:4]) is None
    greedy.max_rows = 0
    assert greedy.tokens(x[:1]) is None


def _tuned(monkeypatch, wins_up_to: int | None, dot: bool = False) -> tuple[int | None, list[int]]:
    """GreedyHead.tune where the copy's timing wins at every row count up to wins_up_to (None: all) and
    loses after, on a CPU without bf16 dot products or AMX tiles unless `dot`: (max_rows, the row
    counts timed)."""
    from kvstrata.worker.greedy_head import GreedyHead

    head, _ = _head(300, 64, 6)
    monkeypatch.setenv(greedy_head.COPY_ENV, "bf16")
    greedy = GreedyHead(KERNELS, head, KERNELS.pack(head))
    asked: list[int] = []

    def timed(rows: int, rounds: int) -> tuple[float, float]:
        asked.append(rows)
        return (1.0, 0.5) if wins_up_to is None or rows <= wins_up_to else (1.0, 1.5)

    monkeypatch.setattr(greedy, "_time_both", timed)
    monkeypatch.setattr(KERNELS, "tune_wide_copy", lambda weights: True)
    monkeypatch.setattr(KERNELS, "amx", False)
    monkeypatch.setattr(KERNELS, "bf16_dot", dot)
    chosen = greedy.tune()
    assert chosen == greedy.max_rows
    return chosen, asked


@needs_kernels
def test_tune_keeps_the_last_row_count_at_which_the_copy_won(monkeypatch):
    from kvstrata.worker.greedy_head import ROWS_ENV

    monkeypatch.delenv(ROWS_ENV, raising=False)
    assert _tuned(monkeypatch, 12) == (12, [4, 8, 12, 16])  # timed until the first loss
    assert _tuned(monkeypatch, 20) == (16, [4, 8, 12, 16, 24])
    assert _tuned(monkeypatch, 2) == (0, [4])
    assert _tuned(monkeypatch, None) == (None, [4, 8, 12, 16, 24, 32, 48, 64])
    assert _tuned(monkeypatch, 2, dot=True) == (None, [])  # bf16 dot products: any rows, untimed
    if greedy_head.int8_available(KERNELS):  # the int8 copy: any rows, untimed
        from kvstrata.worker.greedy_head import GreedyHead

        monkeypatch.setenv(greedy_head.COPY_ENV, "int8")
        head, _ = _head(300, 64, 6)
        int8 = GreedyHead(KERNELS, head, KERNELS.pack(head))
        monkeypatch.setattr(int8, "_time_both", lambda rows, rounds: pytest.fail("timed"))
        assert int8.tune() is None
    monkeypatch.setenv(ROWS_ENV, "40")
    assert _tuned(monkeypatch, 2) == (40, [])
    monkeypatch.setenv(ROWS_ENV, "many")
    with pytest.raises(ValueError, match=ROWS_ENV):
        _tuned(monkeypatch, 2)


@needs_kernels
def test_tune_times_the_real_heads_and_counts_nothing(monkeypatch):
    """Timed for real, at whatever count it stops; the timing's own float32 logits are not counted."""
    from kvstrata.worker.greedy_head import ROWS_ENV, GreedyHead

    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.setenv(greedy_head.COPY_ENV, "bf16")
    monkeypatch.setattr(KERNELS, "amx", False)
    monkeypatch.setattr(KERNELS, "bf16_dot", False)
    head, x = _head(2000, 64, 7)
    packed = KERNELS.pack(head)
    greedy = GreedyHead(KERNELS, head, packed)
    assert greedy.tune(rounds=1) in (None, 0, 4, 8, 12, 16, 24, 32, 48)
    assert greedy.checked == 0
    greedy.max_rows = None
    assert torch.equal(greedy.tokens(x), _reference(x, packed))


@needs_kernels
def test_a_model_times_its_head_once_per_process_and_drops_a_copy_that_never_wins(llm, monkeypatch):
    from kvstrata.worker import model as model_module
    from kvstrata.worker.greedy_head import ROWS_ENV, GreedyHead

    model = llm.engine.runner.model
    head = model.embed  # SmolLM2's head is its tied embedding
    limits = iter([8, 0])
    calls: list[int | None] = []

    def tune(self, rounds: int = 3) -> int | None:
        self.max_rows = int(os.environ[ROWS_ENV]) if ROWS_ENV in os.environ else next(limits)
        calls.append(self.max_rows)
        return self.max_rows

    monkeypatch.setattr(GreedyHead, "tune", tune)
    monkeypatch.setattr(model_module, "_GREEDY_HEAD_ROWS", {})
    monkeypatch.delenv(ROWS_ENV, raising=False)
    first = model._make_greedy_head(head, torch.float32, None)
    again = model._make_greedy_head(head, torch.float32, None)
    assert first.max_rows == again.max_rows == 8 and calls == [8]  # timed once
    monkeypatch.setenv(ROWS_ENV, "5")
    assert model._make_greedy_head(head, torch.float32, None).max_rows == 5 and calls == [8, 5]
    assert model_module._GREEDY_HEAD_ROWS == {(tuple(head.shape), torch.float32): 8}  # a setting is not kept
    monkeypatch.delenv(ROWS_ENV)
    monkeypatch.setattr(model_module, "_GREEDY_HEAD_ROWS", {})
    assert model._make_greedy_head(head, torch.float32, None) is None  # the copy won at no row count


@needs_kernels
def test_the_engine_takes_greedy_tokens_only_for_greedy_rows_without_log_probs(llm):
    """The session's float32 model has a greedy head. Greedy requests come out the same tokens with it
    and without it; a step with a sampled row, or a row asking for log-probs, takes the float32 logits."""
    from kvstrata.worker.sampling_params import SamplingParams

    model = llm.engine.runner.model
    greedy = model.greedy_head
    assert greedy is not None and greedy.nbytes >= model.embed.numel()  # a byte a weight (int8) or two (bf16)
    prompts = [[17 + (7 * i + j) % 4000 for j in range(20 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = greedy.checked
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert greedy.checked > before
    model.greedy_head = None
    try:
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        model.greedy_head = greedy
    assert with_head == without
    before = greedy.checked
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True))
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                               SamplingParams(temperature=0.8, max_tokens=4, seed=3, ignore_eos=True)])
    assert greedy.checked == before


@needs_int8
def test_a_bf16_engine_takes_greedy_tokens_from_the_int8_copy_with_the_same_outputs(monkeypatch):
    """A bf16 model gets the int8 greedy head (its candidates computed by the packed GEMM's groups,
    or on AMX tiles by its 16-column tiles), for no more rows than that GEMM takes; greedy requests
    come out the same tokens with it and without it, alone and batched."""
    from kvstrata import LLM
    from kvstrata.worker.greedy_head import ROWS_ENV
    from kvstrata.worker.sampling_params import SamplingParams

    monkeypatch.delenv(greedy_head.COPY_ENV, raising=False)
    monkeypatch.setenv(ROWS_ENV, "1000000")  # every row count it may take, untimed
    bf16 = LLM("smollm2-135m", num_gpu_blocks=64, dtype="bfloat16")
    model = bf16.engine.runner.model
    greedy = model.greedy_head
    assert greedy is not None and greedy.model_bf16 and greedy.copy == "int8"
    # beyond the packed GEMM's rows oneDNN computes the logits (AVX2 builds: the packed GEMM takes any)
    limit = getattr(model.linear, "max_packed_rows", None)
    assert greedy.max_rows == (1000000 if limit is None else limit)
    prompts = [[17 + (7 * i + j) % 4000 for j in range(20 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = []
    for head in (greedy, None):
        model.greedy_head = head
        before = greedy.checked
        runs.append(([o.outputs[0].token_ids for o in bf16.generate(prompts, params)],
                     bf16.generate(prompts[:1], params)[0].outputs[0].token_ids, greedy.checked - before))
    model.greedy_head = greedy
    (batched, alone, checked), (batched_without, alone_without, unchecked) = runs
    assert checked > 0 and unchecked == 0
    assert batched == batched_without and alone == alone_without
    bf16.check_integrity()
