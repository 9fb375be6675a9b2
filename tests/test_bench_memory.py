"""`kvstrata bench memory`: exact replay arithmetic, agreement with the real KVCacheManager, the command."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random

import pytest

from kvstrata.cluster.bench.memory import (
    ContiguousAllocator,
    KVCacheManagerAllocator,
    PagedAllocator,
    add_bench_memory_parser,
    fit_lengths,
    replay,
    run_memory_bench,
)
from kvstrata.cluster.bench.trace import load_trace

# Budget 64 slots, max_seq_len 32. Contiguous holds 2 slabs; paged B=16 has 4 blocks, B=8 has 8.
MIX = [10, 20, 5, 30]


def test_fit_lengths_scale_and_clip():
    assert fit_lengths([100, 50, 25, 1], 10) == [10, 5, 3, 1]  # 2.5 rounds up; nothing drops to 0
    assert fit_lengths([100, 50, 25, 1], 10, "clip") == [10, 10, 10, 1]
    assert fit_lengths([126527, 7255], 8192) == [8192, math.ceil(7255 * 8192 / 126527)]
    with pytest.raises(ValueError, match="fit mode"):
        fit_lengths([1], 10, "squash")
    with pytest.raises(ValueError, match="positive"):
        fit_lengths([0, 3], 10)


def test_contiguous_replay_exact():
    # admit 10, 20 -> full at 5: stored 30 / 64; finish 10, admit 5 -> full at 30: stored 25 / 64
    r = replay(MIX, ContiguousAllocator(64, 32), 64)
    assert r.scheme == "contiguous (32)" and r.block_size is None
    assert r.kv_utilization == pytest.approx((30 / 64 + 25 / 64) / 2)
    assert r.wasted_fraction == pytest.approx(1 - 55 / 128)
    assert (r.max_seqs, r.mean_seqs_at_full, r.reserved_fraction_at_full, r.num_full_events) == (2, 2.0, 1.0, 2)


@pytest.mark.parametrize("allocator", [PagedAllocator, KVCacheManagerAllocator])
def test_paged_replay_exact(allocator):
    # B=16: 10, 20, 5 take 1 + 2 + 1 = 4 blocks -> full at 30: stored 35 / 64 slots
    r16 = replay(MIX, allocator(64, 16), 64)
    assert r16.scheme == "paged B=16" and r16.block_size == 16
    assert r16.kv_utilization == pytest.approx(35 / 64)
    assert (r16.max_seqs, r16.mean_seqs_at_full, r16.reserved_fraction_at_full, r16.num_full_events) == (3, 3.0, 1.0, 1)
    # B=8: 2 + 3 + 1 = 6 of 8 blocks; 30 needs 4 -> full: stored 35 / 48 slots, 48 / 64 reserved
    r8 = replay(MIX, allocator(64, 8), 64)
    assert r8.kv_utilization == pytest.approx(35 / 48)
    assert r8.reserved_fraction_at_full == pytest.approx(48 / 64)
    assert (r8.max_seqs, r8.num_full_events) == (3, 1)


def test_run_memory_bench_result_and_json():
    result = run_memory_bench(MIX, budget_tokens=64, max_seq_len=32, block_sizes=[8, 16])
    assert [s.scheme for s in result.schemes] == ["paged B=8", "paged B=16", "contiguous (32)"]
    assert result.mean_seq_len == pytest.approx(65 / 4)
    assert result.reference_block_size == 16
    assert result.max_seqs_ratio(16) == pytest.approx(1.5)
    data = json.loads(json.dumps(result.to_json()))
    assert data["max_seqs_ratio"] == pytest.approx(1.5)
    assert data["schemes"][1]["kv_utilization"] == pytest.approx(35 / 64)
    assert data["schemes"][2]["max_seqs"] == 2
    with pytest.raises(KeyError):
        result.paged(32)


def test_a_mix_that_never_fills_reports_its_end_state():
    r = replay([10, 20], PagedAllocator(1024, 16), 1024)
    assert r.num_full_events == 0
    assert r.kv_utilization == pytest.approx(30 / 48) and r.max_seqs == 2


def test_impossible_budgets_are_errors():
    with pytest.raises(ValueError, match="cannot hold even one"):
        run_memory_bench([10], budget_tokens=16, max_seq_len=32)
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        run_memory_bench([40], budget_tokens=64, max_seq_len=32)
    # 100 slots are 1 block of 64: a 100-token sequence needs 2
    with pytest.raises(ValueError, match="does not fit in an empty budget"):
        run_memory_bench([100], budget_tokens=100, max_seq_len=100, block_sizes=[64])


def long_tailed_lengths(n: int, seed: int, max_len: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max_len, max(1, round(rng.lognormvariate(5.0, 1.2)))) for _ in range(n)]


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_paged_arithmetic_matches_the_real_kv_cache_manager(block_size):
    lengths = long_tailed_lengths(400, seed=block_size, max_len=1024)
    budget = 16 * 1024 + 5  # not a multiple of any block size
    real = KVCacheManagerAllocator(budget, block_size)
    assert replay(lengths, PagedAllocator(budget, block_size), budget) == replay(lengths, real, budget)
    real.check_integrity()
    # step by step, including refused allocations and frees out of order
    arith, real = PagedAllocator(budget, block_size), KVCacheManagerAllocator(budget, block_size)
    rng, held = random.Random(block_size), []
    for seq_id, n in enumerate(lengths):
        if held and rng.random() < 0.4:
            victim = held.pop(rng.randrange(len(held)))
            arith.free(victim)
            real.free(victim)
        ok = arith.allocate(seq_id, n)
        assert real.allocate(seq_id, n) == ok
        if ok:
            held.append(seq_id)
        assert real.num_reserved_slots == arith.num_reserved_slots
        assert real.manager.num_free_blocks == arith.num_blocks - arith.num_used_blocks
    real.check_integrity()


def test_trace_mix_meets_the_issue_targets():
    try:
        trace = load_trace(limit=1500)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    lengths = fit_lengths([r.total_length for r in trace], 8192)
    result = run_memory_bench(lengths, budget_tokens=64 * 8192, max_seq_len=8192, block_sizes=[16])
    assert result.paged(16).num_full_events > 0
    assert result.paged(16).kv_utilization >= 0.98
    assert result.max_seqs_ratio(16) >= 3.0
    assert result.contiguous.max_seqs == 64


# -- the command --------------------------------------------------------------------------------

def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata bench")
    add_bench_memory_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def tiny_trace(tmp_path):
    f = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i, "input_length": n - 2, "output_length": 2, "hash_ids": [i]} for i, n in enumerate(MIX)]
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f


def test_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "memory.json"
    args = bench_parser().parse_args([
        "memory", "--trace", str(tiny_trace(tmp_path)), "--max-seq-len", "32", "--fit", "clip",
        "--budget-tokens", "64", "--block-sizes", "16,8", "--json", str(out),
    ])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["num_requests"] == 4 and data["budget_tokens"] == 64
    assert [s["block_size"] for s in data["schemes"]] == [8, 16, None]
    assert data["schemes"][1]["kv_utilization"] == pytest.approx(35 / 64)
    assert data["max_seqs_ratio"] == pytest.approx(1.5)
    table = capsys.readouterr().out
    assert "paged B=16" in table and "54.7%" in table and "contiguous (32)" in table
    assert "1.50x the sequences" in table


def test_command_defaults_budget_to_64_max_length_sequences(tmp_path):
    out = tmp_path / "m.json"
    args = bench_parser().parse_args(["memory", "--trace", str(tiny_trace(tmp_path)), "--max-seq-len", "32",
                                      "--json", str(out)])
    assert args.block_sizes == [8, 16, 32, 64] and args.fit == "scale"
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["budget_tokens"] == 64 * 32 and data["max_seq_len"] == 32


def test_command_errors_are_one_line(tmp_path, capsys):
    parser = bench_parser()
    args = parser.parse_args(["memory", "--trace", str(tmp_path / "nope.jsonl")])
    assert args.func(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvstrata bench memory: error:") and "nope.jsonl" in err and "\n" not in err
    args = parser.parse_args(["memory", "--trace", str(tiny_trace(tmp_path)), "--max-seq-len", "32",
                              "--budget-tokens", "16"])
    assert args.func(args) == 1
    assert "cannot hold even one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["memory", "--block-sizes", "8,x"])


def test_plot_needs_matplotlib(tmp_path, capsys):
    png = tmp_path / "m.png"
    args = bench_parser().parse_args(["memory", "--trace", str(tiny_trace(tmp_path)), "--max-seq-len", "32",
                                      "--plot", str(png)])
    rc = args.func(args)
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 1
        err = capsys.readouterr().err.strip()
        assert "matplotlib" in err and "\n" not in err and not png.exists()
    else:
        assert rc == 0 and png.stat().st_size > 0
