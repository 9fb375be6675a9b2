"""`kvstrata bench throughput` at a tiny size, so the benchmark cannot rot; plus its arithmetic."""

from __future__ import annotations

import json

import pytest

from kvstrata.cluster.bench.throughput import RunResult, ThroughputReport, percentile, run_kvstrata
from kvstrata.cluster.bench.workloads import WORKLOADS


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_report_ratio_uses_the_faster_baseline():
    ours = RunResult("kvstrata", 2.0, 4, 400, 100, [1.0, 2.0, 2.0, 2.0], 0.5)
    slow = RunResult("hf-a", 10.0, 4, 400, 100, [10.0] * 4)
    fast = RunResult("hf-b", 5.0, 4, 400, 100, [5.0] * 4)
    j = ThroughputReport("w", ours, [slow, fast]).to_json()
    assert j["best_baseline"] == "hf-b"
    assert j["ratio_output_tokens_per_s"] == pytest.approx(2.5)
    assert j["kvstrata"]["output_tokens_per_s"] == 50.0
    assert j["kvstrata"]["total_tokens_per_s"] == 250.0


def test_run_kvstrata_counts_tokens_and_prefix_hits(llm):
    llm.reset_prefix_cache()
    wl = WORKLOADS["shared-prefix"](num_requests=8, seed=0)
    res = run_kvstrata(llm, wl)
    assert res.num_requests == 8
    assert res.output_tokens == sum(r.max_tokens for r in wl.requests)
    assert len(res.latencies_s) == 8 and max(res.latencies_s) <= res.wall_s
    # 4 groups of 2 share a 256-token system prompt: the second of each pair hits it
    assert res.prefix_hit_rate >= 0.5 * wl.ideal_prefix_hit_rate(16) > 0
    llm.check_integrity()


def test_bench_throughput_cli_tiny(tmp_path):
    from tests.test_cli import kvstrata

    out = tmp_path / "tp.json"
    r = kvstrata("bench", "throughput", "--workload", "random", "--num-requests", "2",
                 "--baseline", "hf", "--hf-modes", "generate", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["workload"] == "random"
    assert report["kvstrata"]["num_requests"] == 2
    assert report["baselines"][0]["engine"].startswith("hf-generate")
    assert report["ratio_output_tokens_per_s"] > 0
    assert "kvstrata /" in r.stdout


def test_plots_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    from kvstrata.cluster.bench.cli import plot_throughput

    ours = RunResult("kvstrata", 2.0, 4, 400, 100, [1.0, 2.0, 2.0, 2.0], 0.5)
    base = RunResult("hf-a", 10.0, 4, 400, 100, [10.0] * 4)
    path = tmp_path / "tp.png"
    plot_throughput(ThroughputReport("w", ours, [base]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tests.test_cli import kvstrata

    trace = tmp_path / "trace.jsonl"  # a small trace of our own, so the test needs no shared/ folder
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 100 + 37 * i, "output_length": 20 + i,
                    "hash_ids": list(range((100 + 37 * i) // 512 + 1))}) + "\n"
        for i in range(60)))
    mem_png = tmp_path / "mem.png"
    r = kvstrata("bench", "memory", "--trace", str(trace), "--max-seq-len", "4096", "--plot", str(mem_png))
    assert r.returncode == 0, r.stderr[-2000:]
    assert mem_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
