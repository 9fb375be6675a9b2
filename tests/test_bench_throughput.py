"""`kvstrata bench throughput` at a tiny size, so the benchmark cannot rot; plus its arithmetic."""

from __future__ import annotations

import json
import time

import pytest

from kvstrata.cluster.bench.throughput import RunResult, StepProfile, ThroughputReport, percentile, run_kvstrata
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


def test_step_profile_splits_prompt_steps_from_decode_steps_by_rows():
    steps = [(0.5, 0, 300), (0.2, 3, 40),  # prompt chunks, one with decodes beside it
             (0.010, 1, 0), (0.012, 1, 0), (0.030, 1, 0),  # 1 row
             (0.020, 2, 0), (0.022, 4, 0),  # 2-4
             (0.040, 17, 0), (0.050, 32, 0), (0.060, 33, 0), (0.080, 100, 0)]
    p = StepProfile(steps).summary()
    assert p["steps"] == 11 and p["seconds"] == pytest.approx(sum(t for t, _, _ in steps), abs=1e-3)
    assert p["with_prompt_tokens"] == {"steps": 2, "seconds": 0.7, "prompt_tokens": 340}
    by = {b["rows"]: b for b in p["decode_only"]}
    assert list(by) == ["1", "2-4", "17-32", "33-64", "65+"]  # empty buckets are left out
    assert (by["1"]["steps"], by["1"]["seconds"], by["1"]["ms_per_step_p50"]) == (3, 0.052, 12.0)
    assert (by["2-4"]["steps"], by["2-4"]["ms_per_step_p50"]) == (2, 21.0)
    assert (by["17-32"]["steps"], by["33-64"]["steps"], by["65+"]["steps"]) == (2, 1, 1)
    assert StepProfile([]).summary()["decode_only"] == []


def test_run_kvstrata_counts_tokens_and_prefix_hits(llm):
    llm.reset_prefix_cache()
    wl = WORKLOADS["shared-prefix"](num_requests=8, seed=0)
    hit0 = llm.engine.kv.num_prompt_tokens_hit
    res = run_kvstrata(llm, wl)
    hit = llm.engine.kv.num_prompt_tokens_hit - hit0
    # every prompt token not served by the cache was computed in a step with prompt tokens, and
    # every output token after a request's first came from a decode row
    profile = res.step_profile.summary()
    decode_rows = sum(t[1] for t in res.step_profile.steps)
    assert profile["with_prompt_tokens"]["prompt_tokens"] == wl.num_prompt_tokens - hit
    assert decode_rows == res.output_tokens - res.num_requests
    assert sum(b["steps"] for b in profile["decode_only"]) + profile["with_prompt_tokens"]["steps"] == profile["steps"]
    assert res.num_requests == 8
    assert res.output_tokens == sum(r.max_tokens for r in wl.requests)
    assert len(res.latencies_s) == 8 and max(res.latencies_s) <= res.wall_s
    # 4 groups of 2 share a 256-token system prompt: the second of each pair hits it
    assert res.prefix_hit_rate >= 0.5 * wl.ideal_prefix_hit_rate(16) > 0
    llm.check_integrity()


def test_bench_throughput_cli_tiny(tmp_path, capsys, monkeypatch, hf_reference):
    """The command end to end in this process. Its HF baseline is the session's copy of the model
    (conftest loads it with the bench's own load_hf_model): loading the GGUF through transformers
    once more took most of this test's time."""
    import kvstrata.cluster.bench.hf_baseline as hf_baseline
    from kvstrata.cluster.cli import main

    asked = []

    def session_copy(model, dtype):
        asked.append((model, dtype))
        return hf_reference[1]

    monkeypatch.setattr(hf_baseline, "load_hf_model", session_copy)
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--workload", "random", "--num-requests", "2",
                 "--baseline", "hf", "--hf-modes", "generate", "--no-bound", "--stages", "--json", str(out)]) == 0
    assert asked == [("smollm2-135m", "float32")]
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["workload"] == "random"
    assert report["scheduling"] == "offline"  # the default: a batch judged by its total time
    assert "kvstrata scheduling: offline" in stdout
    assert report["kvstrata"]["num_requests"] == 2
    assert report["baselines"][0]["engine"].startswith("hf-generate")
    assert report["ratio_output_tokens_per_s"] > 0
    assert report["bound"] is None and report["bound_ratio"] is None
    assert "kvstrata /" in stdout
    steps = report["kvstrata"]["step_profile"]
    assert steps["with_prompt_tokens"]["prompt_tokens"] == report["kvstrata"]["prompt_tokens"]  # nothing cached
    assert "decode-only:" in stdout and "kvstrata steps:" in stdout
    stages = steps["stages_ms_per_step"]  # --stages: the fused layers' stages by kind of step
    assert stages["with_prompt_tokens"]["prefill_attention"] > 0 and stages["decode_only"]["prefill_attention"] == 0
    assert stages["decode_only"]["decode_attention"] > 0 and stages["decode_only"]["lm_head"] > 0
    assert "decode only, ms a step:" in stdout


def test_bench_throughput_samples_when_asked(tmp_path, capsys, monkeypatch, hf_reference):
    """--temperature and --top-p reach both engines: kvstrata's seeded requests, and HF's generate."""
    import kvstrata.cluster.bench.hf_baseline as hf_baseline
    import kvstrata.cluster.bench.throughput as throughput
    from kvstrata.cluster.cli import main

    monkeypatch.setattr(hf_baseline, "load_hf_model", lambda model, dtype: hf_reference[1])
    hf_calls = []
    generate = hf_reference[1].generate

    def recording(*args, **kwargs):
        hf_calls.append({k: kwargs.get(k) for k in ("do_sample", "temperature", "top_p", "top_k")})
        return generate(*args, **kwargs)

    monkeypatch.setattr(hf_reference[1], "generate", recording)
    engines = []
    run = throughput.run_kvstrata

    def kvstrata_run(llm, workload, clock=time.perf_counter, decoding=throughput.GREEDY, **kwargs):
        engines.append(llm.engine)
        seen = []
        add = llm.engine.add_request

        def recording_add(rid, ids, sp, **kwargs):
            if rid.startswith("bench-"):  # not the warm-up
                seen.append(sp)
            return add(rid, ids, sp, **kwargs)

        llm.engine.add_request = recording_add
        try:
            return run(llm, workload, clock, decoding, **kwargs)
        finally:
            del llm.engine.add_request
            engines.append(seen)

    monkeypatch.setattr(throughput, "run_kvstrata", kvstrata_run)
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--workload", "random", "--num-requests", "2", "--temperature", "0.8",
                 "--top-p", "0.9", "--baseline", "hf", "--hf-modes", "generate", "--no-bound",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["temperature"] == 0.8 and report["top_p"] == 0.9
    assert "sampled at temperature 0.8, top_p 0.9" in capsys.readouterr().out
    params = engines[1]
    assert [(p.temperature, p.top_p, p.seed) for p in params] == [(0.8, 0.9, 0), (0.8, 0.9, 1)]
    assert report["kvstrata"]["output_tokens"] == sum(p.max_tokens for p in params)  # EOS ignored
    # the warm-up call is greedy; the timed ones sample as kvstrata does, without HF's default top-k
    assert hf_calls[-1] == {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 0}
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--workload", "random", "--top-p", "1.5", "--no-bound"])
    assert e.value.code == 2 and "argument --top-p" in capsys.readouterr().err


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


class _FakeEngine:
    """Finishes one request per step; each step costs `cost` on the shared fake clock."""

    def __init__(self, clock: list[float], cost: float):
        self.clock, self.cost, self.pending = clock, cost, []

    def add_request(self, rid, prompt, params):
        self.pending.append(params.max_tokens)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        from types import SimpleNamespace

        self.clock[0] += self.cost
        n = self.pending.pop(0)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * n)])]


def test_lockstep_times_each_engine_by_its_own_steps():
    from types import SimpleNamespace

    from kvstrata.cluster.bench.throughput import run_lockstep
    from kvstrata.cluster.bench.workloads import BenchRequest, Workload

    now = [0.0]
    fast = SimpleNamespace(engine=_FakeEngine(now, 0.5))
    slow = SimpleNamespace(engine=_FakeEngine(now, 2.0))
    wl = Workload("w", [BenchRequest([20, 21], 3), BenchRequest([22], 5)])
    tps = run_lockstep([fast, slow], wl, clock=lambda: now[0])
    assert tps == [pytest.approx(8 / 1.0), pytest.approx(8 / 4.0)]


def test_ablation_cost_is_one_minus_the_median_paired_ratio():
    from kvstrata.cluster.bench.throughput import AblationResult

    r = AblationResult([98.0, 50.0, 200.0], [100.0, 50.0, 190.0])
    assert r.ratios == pytest.approx([0.98, 1.0, 200 / 190])
    assert r.cost == pytest.approx(0.0)
    assert AblationResult([90.0, 99.0], [100.0, 100.0]).cost == pytest.approx(1 - 0.945)
    assert r.to_json()["cost"] == 0.0


@pytest.mark.slow
def test_bench_throughput_ablation_and_bound_cli_tiny(tmp_path, capsys):
    from kvstrata.cluster.cli import main

    out = tmp_path / "ablate.json"
    assert main(["bench", "throughput", "--workload", "random", "--num-requests", "2", "--ablate-prefix-caching",
                 "--repeats", "2", "--json", str(out)]) == 0
    j = json.loads(out.read_text())["ablation"]
    assert len(j["on_output_tokens_per_s"]) == len(j["off_output_tokens_per_s"]) == 2
    assert all(x > 0 for x in j["on_output_tokens_per_s"] + j["off_output_tokens_per_s"])
    assert "cost of prefix caching" in capsys.readouterr().out

    out = tmp_path / "bound.json"
    assert main(["bench", "throughput", "--workload", "shared-prefix", "--num-requests", "2", "--quick",
                 "--scheduling", "fcfs", "--json", str(out)]) == 0
    j = json.loads(out.read_text())
    assert j["scheduling"] == "fcfs"
    assert j["bound"]["seconds"] > 0 and j["bound"]["kind"] in ("compute", "memory")
    assert j["bound_ratio"] == pytest.approx(j["kvstrata"]["wall_s"] / j["bound"]["seconds"], rel=0.01)
    assert "roofline bound" in capsys.readouterr().out


def test_rounds_summary_takes_medians_of_per_round_ratios():
    from kvstrata.cluster.bench.cli import summarize_rounds
    from kvstrata.cluster.bench.throughput import Bound

    reports = []
    for wall, hf_wall in ((2.0, 10.0), (4.0, 10.0), (1.0, 4.0)):
        ours = RunResult("kvstrata", wall, 4, 400, 100, [wall] * 4)
        rep = ThroughputReport("w", ours, [RunResult("hf", hf_wall, 4, 400, 100, [hf_wall] * 4)])
        rep.bound = Bound(1.0, "compute", 1.0, 1.0)
        reports.append(rep)
    s = summarize_rounds(reports)
    assert len(s["rounds"]) == 3
    assert s["median_ratio_output_tokens_per_s"] == pytest.approx(4.0)  # ratios 5, 2.5, 4
    assert s["median_bound_ratio"] == pytest.approx(2.0)  # walls 2, 4, 1 over a 1 s bound
    assert s["kvstrata"]["wall_s"] == 1.0  # the last round's report is the top level


def test_share_model_gives_the_second_engine_the_first_ones_weights():
    """The ablation's two engines run on one copy of the weights, so that where each copy lies in
    memory cannot tell them apart; engines of different models cannot share."""
    from types import SimpleNamespace

    from kvstrata.cluster.bench.throughput import share_model

    def fake(config):
        return SimpleNamespace(engine=SimpleNamespace(config=config, runner=SimpleNamespace(model=object())))

    on, off = fake("smollm2"), fake("smollm2")
    share_model(on, off)
    assert off.engine.runner.model is on.engine.runner.model
    with pytest.raises(ValueError, match="same model"):
        share_model(on, fake("other"))
