"""`kvstrata bench routing`: the tiered block cache's exact eviction order, the simulator's exact hit rates
and TTFTs on tiny hand-written traces, the oracle bound, determinism, the targets' verdicts, and the
command on the real trace and on bad flags."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvstrata.cluster.bench.routing import (
    PolicyResult,
    RoutingReport,
    RoutingSettings,
    RoutingSim,
    oracle_hit_rate,
    policy_params,
    run_routing_bench,
)
from kvstrata.cluster.bench.block_cache import TieredBlockCache
from kvstrata.cluster.bench.sim_worker import TimeModel
from kvstrata.cluster.bench.trace import find_trace, load_trace
from kvstrata.cluster.cli import main
from kvstrata.router.placement import POLICIES, make_policy

TM = TimeModel()


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """rows: (timestamp ms, input length, output length, hash ids)."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}) + "\n"
                            for t, n, o, h in rows))
    return path


# -- the time model -------------------------------------------------------------------------------

def test_the_roofline_step():
    assert TM.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
    assert TM.step_s(8192, 0, 0) == pytest.approx(2 * 8.03e9 * 8192 / 989e12)  # compute-bound prefill
    assert TM.step_s(100, 0, 0) == pytest.approx(2 * 8.03e9 / 3.35e12)  # a short prefill still reads the weights
    assert TM.step_s(0, 4, 40_000) == pytest.approx((2 * 8.03e9 + 131072 * 40_000) / 3.35e12)  # decode reads K/V
    assert TM.step_s(0, 0, 0, 1024) - TM.step_s(0, 0, 0) == pytest.approx(1024 * 131072 / 50e9)  # DRAM copy-back


# -- the cache ------------------------------------------------------------------------------------

def test_eviction_is_lru_and_leaf_first():
    c = TieredBlockCache(hbm_blocks=3, dram_blocks=0)
    c.cache([1, 2, 3])
    c.cache([4])  # 1 is older, but only 3 is a leaf
    assert c.match([1, 2, 3]) == (2, 0) and c.match([4]) == (1, 0)
    c.fetch([1, 2], 2)  # touch: now 4 is the oldest leaf
    c.cache([5])
    assert c.match([4]) == (0, 0) and c.match([1, 2]) == (2, 0) and c.match([5]) == (1, 0)
    assert c.num_dropped == 2 and c.num_demoted == 0
    c.check_integrity()


def test_hbm_evictions_demote_to_dram_and_dram_hits_are_promoted():
    c = TieredBlockCache(hbm_blocks=2, dram_blocks=2)
    c.cache([1, 2])
    c.cache([3, 4])  # 2 goes down, then 1 (a leaf of HBM once 2 left it)
    c.check_integrity()
    assert c.block_to_tier == {1: 1, 2: 1, 3: 0, 4: 0}
    assert c.match([1, 2, 9]) == (0, 2) and c.match([3, 4]) == (2, 0)
    # promoting 1 pushes 4 out of HBM; DRAM holds only the chain being fetched, so 4 is dropped;
    # promoting 2 then pushes 3 down into the slot 1 left
    c.fetch([1, 2], 2)
    c.check_integrity()
    assert c.block_to_tier == {1: 0, 2: 0, 3: 1}
    assert (c.num_promoted, c.num_demoted, c.num_dropped) == (2, 3, 1)
    assert c.match([3, 4]) == (0, 1)


def test_a_chain_longer_than_hbm_caches_its_head():
    c = TieredBlockCache(hbm_blocks=2, dram_blocks=4)
    c.cache([1, 2, 3])
    assert c.match([1, 2, 3]) == (2, 0) and c.num_blocks == [2, 0]
    c.check_integrity()
    with pytest.raises(ValueError, match="hbm_blocks >= 1"):
        TieredBlockCache(0, 4)


# -- the simulation on hand-checkable traces ------------------------------------------------------

def one_worker(trace_path: Path, **kw) -> RoutingReport:
    settings = RoutingSettings(num_workers=1, time_scale=1.0, **kw)
    return run_routing_bench(load_trace(trace_path), settings, list(POLICIES), progress=False)


def test_one_worker_and_a_repeated_prefix(tmp_path):
    rows = [(0, 1124, 1, [0, 1, 2]),  # 2 full blocks cached, the partial third is not
            (10_000, 1124, 1, [0, 1, 3]),  # hits both full blocks: 1024 tokens
            (20_000, 1024, 1, [0, 1])]  # may hit only 1 block: one prompt token is always computed
    report = one_worker(write_trace(tmp_path / "t.jsonl", rows))
    assert report.oracle_hit_rate == pytest.approx(1536 / 3272)
    for r in report.results:
        assert (r.num_hit_tokens, r.num_prompt_tokens, r.num_dram_hit_tokens) == (1536, 3272, 0)
        assert r.ttfts_s == pytest.approx((TM.step_s(1124, 0, 0), TM.step_s(100, 0, 0), TM.step_s(512, 0, 0)))
        assert r.worker_prefilled_tokens == (1124 + 100 + 512,)


def test_a_dram_hit_is_copied_back(tmp_path):
    rows = [(0, 1100, 1, [0, 1, 2]),
            (10_000, 1100, 1, [5, 6, 7]),  # pushes 0 and 1 down to DRAM
            (20_000, 1600, 1, [0, 1, 8, 9])]  # hits both in DRAM
    report = one_worker(write_trace(tmp_path / "t.jsonl", rows), hbm_blocks=2, dram_blocks=8)
    for r in report.results:
        assert (r.num_hit_tokens, r.num_dram_hit_tokens) == (1024, 1024)
        # 576 tokens computed (compute-bound), then 1024 tokens of K/V copied over PCIe
        assert r.ttfts_s[2] == pytest.approx(2 * 8.03e9 * 576 / 989e12 + 1024 * 131072 / 50e9)
    assert report.oracle_hit_rate == pytest.approx(1024 / 3800)


def test_prefill_is_chunked_fifo_and_decodes_share_the_step(tmp_path):
    # both arrive at t = 0; the first's step starts before the second is routed, so it prefills alone
    rows = [(0, 3000, 3, []), (0, 3000, 1, [])]
    report = one_worker(write_trace(tmp_path / "t.jsonl", rows), max_batched_tokens=2000)
    r = report.result("round_robin")
    s1 = TM.step_s(2000, 0, 0)  # 2000 of the first
    s2 = TM.step_s(2000, 0, 0)  # its last 1000, the second's first 1000: the first token of the first
    s3 = TM.step_s(1999, 1, 3000)  # the first decodes over its 3000 tokens; the budget left goes to the second
    s4 = TM.step_s(1, 1, 3001)  # the second's last token, the first's last decode
    assert r.ttfts_s == pytest.approx((s1 + s2, s1 + s2 + s3 + s4))
    assert r.makespan_s == pytest.approx(s1 + s2 + s3 + s4)
    assert r.worker_prefill_busy_s == pytest.approx((s1 + s2 + s3 + s4,))
    assert r.worker_prefilled_tokens == (6000,)


def conversations(tmp_path: Path, num_conversations: int = 24, num_turns: int = 4, seed: int = 0) -> Path:
    """A shared system block, then each conversation's own: 5 blocks in its first turn, 2 more a turn, each
    turn resending the last one's blocks. Turns come about 3 s apart, at seeded random offsets."""
    rng = random.Random(seed)
    rows, next_id = [], 1
    for c in range(num_conversations):
        history = [0]
        for t in range(num_turns):
            new = 5 if t == 0 else 2
            history = history + list(range(next_id, next_id + new))
            next_id += new
            rows.append((t * 3000 + rng.randrange(2500), 512 * len(history) + 100, 20, history + [next_id]))
            next_id += 1
    return write_trace(tmp_path / "chat.jsonl", sorted(rows))


def test_the_oracle_bounds_every_policy_and_runs_are_deterministic(tmp_path):
    trace = load_trace(conversations(tmp_path))
    # the fleet holds every block of the chat (24 x 11 + 1), one worker a third of them
    settings = RoutingSettings(num_workers=4, hbm_blocks=16, dram_blocks=64, time_scale=1.0, seed=5)
    report = run_routing_bench(trace, settings, list(POLICIES), progress=False)
    assert report.oracle_hit_rate == pytest.approx(oracle_hit_rate(trace, 10**6, 0))  # = an unbounded cache
    hits = {r.policy: r.hit_rate for r in report.results}
    assert all(0 < h <= report.oracle_hit_rate for h in hits.values()), (hits, report.oracle_hit_rate)
    assert hits["prefix_aware"] >= 0.9 * report.oracle_hit_rate
    assert hits["prefix_aware"] > 1.5 * max(hits["round_robin"], hits["least_loaded"], hits["power_of_two"])
    again = run_routing_bench(trace, settings, list(POLICIES), progress=False)
    assert again.to_json() == report.to_json()
    assert [r.ttfts_s for r in again.results] == [r.ttfts_s for r in report.results]
    other_seed = RoutingSettings(num_workers=4, hbm_blocks=16, dram_blocks=64, time_scale=1.0, seed=6)
    p2 = run_routing_bench(trace, other_seed, ["power_of_two"], progress=False).results[0]
    assert p2.worker_num_requests != report.result("power_of_two").worker_num_requests
    for name in POLICIES:  # every worker's books balance after a run
        sim = RoutingSim(settings)
        sim.run(trace, make_policy(name, **policy_params(name, sim.clock, 0)), progress=False)
        sim.check_integrity()


def test_a_burst_sharing_a_fresh_prefix_lands_on_one_worker(tmp_path):
    shared = list(range(100, 108))  # 8 new blocks that no worker holds yet
    rows = [(0, 512 * 9 + 50, 5, shared + [200 + i]) for i in range(4)]
    trace = load_trace(write_trace(tmp_path / "burst.jsonl", rows))
    settings = RoutingSettings(num_workers=4, time_scale=1.0)
    burst = run_routing_bench(trace, settings, ["prefix_aware", "least_loaded"], progress=False)
    assert burst.result("prefix_aware").worker_num_requests == (4, 0, 0, 0)
    assert burst.result("least_loaded").worker_num_requests == (1, 1, 1, 1)
    # on one worker the later three start after the first's prefill and hit its 8 shared blocks
    assert burst.result("prefix_aware").num_hit_tokens == 3 * 8 * 512
    assert burst.result("least_loaded").num_hit_tokens == 0


# -- the targets ----------------------------------------------------------------------------------

def fake(policy: str, hit_rate: float, prefill_busy: tuple[float, ...], ttft_ms: float) -> PolicyResult:
    return PolicyResult(policy, 1, 1000, round(1000 * hit_rate), 0, 10, 1.0, prefill_busy, prefill_busy,
                        (0,) * len(prefill_busy), (1,) * len(prefill_busy), (ttft_ms / 1e3,))


def test_the_targets_verdicts():
    results = (fake("round_robin", 0.1, (1, 1), 300), fake("least_loaded", 0.1, (1, 1), 200),
               fake("prefix_aware", 0.45, (1.2, 0.8), 150))
    met = RoutingReport(RoutingSettings(), "t", 0.5, results).targets()
    assert [t.met for t in met] == [True, True, True, True], met
    assert met[0].detail == "45.0% vs oracle 50.0% (90%)"
    missed = RoutingReport(RoutingSettings(), "t", 0.51, (
        fake("least_loaded", 0.1, (1, 1), 150), fake("prefix_aware", 0.45, (1.3, 0.7), 150))).targets()
    assert [t.met for t in missed] == [False, False, None, False], missed
    assert RoutingReport(RoutingSettings(), "t", 0.5, results[:1]).targets()[0].met is None


# -- the command ----------------------------------------------------------------------------------

def real_trace() -> Path:
    try:
        return find_trace()
    except FileNotFoundError:
        pytest.skip("the production trace is not here")


def test_the_command_on_the_real_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    real_trace()
    out_json, out_png = tmp_path / "routing.json", tmp_path / "routing.png"
    assert main(["bench", "routing", "--num-requests", "300", "--workers", "4", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "oracle" in text and "targets:" in text and "prefix_aware" in text
    data = json.loads(out_json.read_text())
    assert [p["policy"] for p in data["policies"]] == list(POLICIES)
    assert data["settings"]["num_workers"] == 4 and data["policies"][0]["num_requests"] == 300
    assert all(p["hit_rate"] <= data["oracle"]["hit_rate"] for p in data["policies"])
    assert len(data["targets"]) == 4
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "routing", "--num-requests", "50", "--policy", "round_robin", "prefix_aware",
                 "--policy", "round_robin"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in POLICIES]
    assert rows == ["round_robin", "prefix_aware"]  # in the order asked, each once


@pytest.mark.parametrize("argv, flag", [
    (["--workers", "0"], "--workers"),
    (["--time-scale", "0"], "--time-scale"),
    (["--dram-blocks", "-1"], "--dram-blocks"),
    (["--hbm-blocks", "many"], "--hbm-blocks"),
    (["--num-requests", "0"], "--num-requests"),
    (["--policy", "fastest"], "--policy"),
    (["--json", "{tmp}/no/such/dir/r.json"], "--json"),
    (["--trace", "{tmp}/missing.jsonl"], "--trace"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, argv, flag):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(["bench", "routing", *argv])
    except SystemExit as e:  # argparse
        code = e.code
    assert code == 2
    assert flag in capsys.readouterr().err


def test_a_trace_whose_ids_do_not_name_prefixes_is_refused(tmp_path, capsys):
    bad = write_trace(tmp_path / "bad.jsonl", [(0, 1100, 1, [0, 1, 2]), (5, 1100, 1, [7, 1, 3])])
    assert main(["bench", "routing", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--trace" in err and "hash id 1 follows 7" in err
