"""Speculative decoding by n-gram lookup (worker/speculative.py): the lookup itself, and on the real
model, the same greedy tokens as plain decoding in fewer steps, stops inside a draft, seeded sampled
and logprob requests that speculate and keep their tokens, and nothing of a rejected draft in the
prefix cache."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics

import pytest

from kvstrata.worker.scheduler import SchedulerConfig
from kvstrata.worker.speculative import NgramIndex


# -- the lookup --------------------------------------------------------------------------------
def test_draft_continues_the_latest_earlier_occurrence_of_the_suffix():
    idx = NgramIndex()
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    # "5 6 7" occurred at 0 (followed by 1) and at 4 (followed by 2): the later one wins
    assert idx.draft(tokens, 3) == [2, 5, 6]
    assert idx.draft(tokens, 1) == [2]
    assert idx.draft(tokens, 0) == []


def test_draft_prefers_the_longest_matching_suffix():
    idx = NgramIndex()
    # "9" alone last occurred at 5 (followed by 4); "3 9" at 1 (followed by 8)
    tokens = [3, 9, 8, 8, 0, 9, 4, 3, 9]
    assert idx.draft(tokens, 2) == [8, 8]
    assert NgramIndex().draft([1, 2, 3, 4], 3) == []  # nothing repeats


def test_draft_stops_at_the_end_of_the_known_tokens():
    # the match is the token just before the suffix: only what follows it is known
    assert NgramIndex().draft([4, 4, 4], 5) == [4]
    assert NgramIndex().draft([1, 2, 1, 2], 8) == [1, 2]


def test_incremental_index_matches_a_fresh_one():
    tokens = [7, 1, 2, 7, 1, 3, 7, 1]
    grown = NgramIndex()
    for n in range(1, len(tokens) + 1):
        assert grown.draft(tokens[:n], 4) == NgramIndex().draft(tokens[:n], 4)
    assert grown.upto == len(tokens)


def test_a_request_whose_drafts_fail_drafts_one_token_unless_alone():
    idx = NgramIndex()
    assert idx.draft_length(4, alone=False) == 4
    for _ in range(6):
        idx.record(4, 0)
    assert idx.draft_length(4, alone=False) == 1 and idx.draft_length(4, alone=True) == 4
    for _ in range(6):
        idx.record(1, 1)  # its one-token guesses start to come true
    assert idx.draft_length(4, alone=False) == 4


@pytest.mark.parametrize("field, value", [("speculative_tokens", -1), ("speculative_tokens", 2.5),
                                          ("speculative_step_tokens", 0), ("speculative_tokens", True)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_llm_rejects_bad_settings_before_loading():
    from kvstrata import LLM

    with pytest.raises(ValueError, match="speculative_tokens"):
        LLM("no-such-model", speculative_tokens=-2)
    with pytest.raises(ValueError, match="speculative_step_tokens"):
        LLM("no-such-model", speculative_tokens=4, speculative_step_tokens=0)


# -- on the real model -------------------------------------------------------------------------
@contextlib.contextmanager
def speculating(llm, tokens: int = 4, step_tokens: int = 16):
    """The shared engine with speculative decoding on, and its counters from zero."""
    engine = llm.engine
    config = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(config, speculative_tokens=tokens,
                                                  speculative_step_tokens=step_tokens)
    before = (engine.stats.num_draft_tokens, engine.stats.num_accepted_draft_tokens, engine.stats.num_steps)
    counts = {}
    try:
        yield counts
    finally:
        engine.scheduler.config = config
        counts.update(drafted=engine.stats.num_draft_tokens - before[0],
                      accepted=engine.stats.num_accepted_draft_tokens - before[1],
                      steps=engine.stats.num_steps - before[2])


# token lists the model continues with repetitions: a counting list, a repeated phrase
def _repetitive_prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])) for text in (
        "Count from 1 to 40, separated by commas.",
        "Write the word 'hello' twenty times, one per line.",
        "List the days of the week, then list them again in the same order.",
    )]


def _greedy(max_tokens: int, **kw):
    from kvstrata.worker.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_greedy_tokens_match_plain_decoding_in_fewer_steps(llm):
    prompts = _repetitive_prompts(llm)
    engine = llm.engine
    llm.reset_prefix_cache()
    s0 = engine.stats.num_steps
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(48, ignore_eos=True))]
    plain_steps = engine.stats.num_steps - s0
    llm.reset_prefix_cache()
    with speculating(llm) as counts:
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(48, ignore_eos=True))]
        assert llm.cache_stats()["speculative"]["draft_tokens"] >= counts.get("drafted", 0)
    assert spec == plain
    assert counts["drafted"] > 0 and 0 < counts["accepted"] <= counts["drafted"]
    assert counts["steps"] < plain_steps
    engine.check_integrity()
    llm.reset_prefix_cache()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # no block kept by a draft
    assert "speculative" not in llm.cache_stats()  # off again


def test_one_request_saves_a_step_per_accepted_token_and_keeps_its_stops(llm):
    count, _, days = _repetitive_prompts(llm)
    engine = llm.engine
    llm.reset_prefix_cache()
    tokens = llm.generate([days], _greedy(64, ignore_eos=True))[0].outputs[0].token_ids
    first = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    stop = max(first, key=first.get)  # the token that appears first the latest
    assert first[stop] >= 20
    accepted = 0
    for prompt, params, reason in ((days, _greedy(64, ignore_eos=True, stop_token_ids=[stop]), "stop"),
                                   (count, _greedy(23, ignore_eos=True), "length")):
        llm.reset_prefix_cache()
        s0 = engine.stats.num_steps
        plain = llm.generate([prompt], params)[0].outputs[0]
        plain_steps = engine.stats.num_steps - s0
        assert plain.finish_reason == reason
        llm.reset_prefix_cache()
        with speculating(llm) as counts:
            out = llm.generate([prompt], params)[0].outputs[0]
        assert out.token_ids == plain.token_ids and out.finish_reason == reason
        # one prompt step, then a step per token less the accepted drafts
        assert counts["steps"] == plain_steps - counts["accepted"]
        accepted += counts["accepted"]
    assert accepted > 0
    engine.check_integrity()


def test_seeded_sampled_and_logprob_requests_speculate_and_keep_their_tokens(llm):
    from kvstrata.worker.sampling_params import SamplingParams

    prompts = _repetitive_prompts(llm)
    params = [SamplingParams(temperature=0.3, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
              _greedy(40, ignore_eos=True, logprobs=2)]
    engine = llm.engine
    llm.reset_prefix_cache()
    s0 = engine.stats.num_steps
    plain = llm.generate(prompts, params)
    plain_steps = engine.stats.num_steps - s0
    llm.reset_prefix_cache()
    with speculating(llm) as counts:
        spec = llm.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # the same tokens with the same top-2 alternatives; a chunk's rows round a little differently
    for a, b in zip(plain[2].outputs[0].logprobs, spec[2].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
    assert counts["accepted"] > 0 and counts["steps"] < plain_steps
    engine.check_integrity()


def test_a_seeded_generator_rewinds_to_the_rows_kept():
    import torch

    from kvstrata.worker.request import Request
    from kvstrata.worker.sampler import Sampler
    from kvstrata.worker.sampling_params import SamplingParams
    from kvstrata.worker.speculative import rewind

    req = Request("r", [1, 2], SamplingParams(temperature=1.0, seed=5), hash_root=b"")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for kept in (1, 2, 3):
        req.generator = torch.Generator().manual_seed(11)
        start = req.generator.get_state()
        drawn = Sampler().sample(logits, [req] * 4).token_ids  # a draft of three: four rows
        all_four = req.generator.get_state()
        rewind(req.generator, start, kept)
        rewound = req.generator.get_state()
        req.generator = torch.Generator().manual_seed(11)
        assert Sampler().sample(logits[:kept], [req] * kept).token_ids == drawn[:kept]  # rows draw in order
        assert req.generator.get_state().equal(rewound)  # as if only the kept rows were drawn
        assert not rewound.equal(all_four)


def test_rejected_drafts_never_reach_the_prefix_cache(llm):
    """A finished speculative sequence, sent again as a prompt, hits every full block it computed,
    and its continuation is the one computed from scratch: the cached K/V are the real tokens'."""
    prompt = _repetitive_prompts(llm)[1]
    llm.reset_prefix_cache()
    with speculating(llm) as counts:
        first = llm.generate([prompt], _greedy(64, ignore_eos=True))[0].outputs[0].token_ids
    assert counts["drafted"] > counts["accepted"] > 0  # some drafts were rejected
    sequence = prompt + first
    again = llm.generate([sequence], _greedy(16, ignore_eos=True))[0]
    bs = llm.engine.kv.block_size
    assert again.num_cached_tokens == (len(sequence) - 1) // bs * bs
    llm.reset_prefix_cache()
    fresh = llm.generate([sequence], _greedy(16, ignore_eos=True))[0]
    assert fresh.num_cached_tokens == 0
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    llm.engine.check_integrity()


def test_speculation_stays_within_the_step_budget(llm):
    prompts = _repetitive_prompts(llm)
    engine = llm.engine
    sizes = []
    original = engine.runner.execute

    def recording(batch, rows, spans=None, **kwargs):
        sizes.append(batch.num_tokens)
        return original(batch, rows, spans, **kwargs)

    llm.reset_prefix_cache()
    engine.runner.execute = recording
    try:
        with speculating(llm, tokens=8, step_tokens=6) as counts:
            llm.generate(prompts, _greedy(32, ignore_eos=True))
    finally:
        del engine.runner.execute
    assert counts["drafted"] > 0
    # steps of three decodes took at most 3 draft tokens in all; prompt steps are not speculative
    decode_steps = [n for n in sizes if n <= 8]
    assert decode_steps and max(decode_steps) <= 6


@pytest.mark.slow
def test_bench_throughput_reports_draft_tokens(llm, tmp_path, capsys):
    from kvstrata.cluster.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "throughput", "--workload", "random", "--num-requests", "2", "--no-bound",
                 "--speculative-tokens", "4", "--json", str(out)]) == 0
    k = json.loads(out.read_text())["kvstrata"]
    assert k["accepted_draft_tokens"] <= k["draft_tokens"]
    assert k["draft_tokens"] > 0 and "speculative decoding:" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_speculative_cli_tiny(llm, tmp_path, capsys):
    from kvstrata.cluster.cli import main

    out = tmp_path / "spec.json"
    # the last built-in prompt counts: it drafts well
    assert main(["bench", "speculative", "--num-prompts", "8", "--max-tokens", "24", "--rounds", "1",
                 "--json", str(out)]) == 0
    j = json.loads(out.read_text())
    assert len(j["alone"]) == 8 and all(r["identical"] for r in j["alone"]) and j["batch"]["identical"]
    counting = j["alone"][-1]
    assert counting["output_tokens"] == 24 and counting["accepted_draft_tokens"] > 0
    assert j["median_speedup_alone"] > 0 and "median speedup" in capsys.readouterr().out
    # each run's median wait for a request's last token: no longer than the run, as long for one alone
    for r in j["alone"] + [j["batch"]]:
        for waits, walls in ((r["plain_latency_s"], r["plain_s"]), (r["speculative_latency_s"], r["speculative_s"])):
            assert len(waits) == len(walls) == 1 and 0 < waits[0] <= walls[0]
    assert all(r["plain_latency_s"][0] >= 0.9 * r["plain_s"][0] for r in j["alone"])
    assert j["batch"]["latency_speedup"] > 0


def test_bench_speculative_sampled_keeps_seeded_tokens(llm, tmp_path, capsys):
    from kvstrata.cluster.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--num-prompts", "8", "--max-tokens", "24", "--rounds", "1",
                 "--temperature", "0.5", "--json", str(out)]) == 0
    j = json.loads(out.read_text())
    assert j["temperature"] == 0.5 and all(r["identical"] for r in j["alone"]) and j["batch"]["identical"]
    assert sum(r["accepted_draft_tokens"] for r in j["alone"]) > 0
    assert "sampled at temperature 0.5" in capsys.readouterr().out
    assert main(["bench", "speculative", "--temperature", "0.5", "--baseline", "hf"]) == 2
    assert "--temperature" in capsys.readouterr().err


def test_the_request_with_most_output_to_go_drafts_first(llm):
    from kvstrata.worker.sampling_params import SamplingParams

    count = _repetitive_prompts(llm)[0]
    engine = llm.engine
    seen = []
    original = engine.runner.execute

    def recording(batch, rows, spans=None, **kwargs):
        decoding = [r for r, n in zip(batch.requests, batch.num_new_tokens) if r.num_computed_tokens >= len(count)]
        drafting = [r for r, n in zip(batch.requests, batch.num_new_tokens) if n > 1 and r in decoding]
        if len(decoding) == 2 and drafting:
            (other,) = [r for r in decoding if r is not drafting[0]]
            n = batch.num_new_tokens[batch.requests.index(drafting[0])]  # its tokens hold the draft now
            left = [drafting[0].params.max_tokens - drafting[0].num_output_tokens + n - 1,
                    other.params.max_tokens - other.num_output_tokens]
            # the other one may have more to go only if it had nothing to draft
            seen.append((len(drafting), left[0] >= left[1] or NgramIndex().draft(other.token_ids, 1) == []))
        return original(batch, rows, spans, **kwargs)

    llm.reset_prefix_cache()
    engine.runner.execute = recording
    try:  # room for one request's draft in a step of two decodes
        with speculating(llm, tokens=4, step_tokens=6):
            llm.generate([count, count], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                          SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)])
    finally:
        del engine.runner.execute
    assert seen and all(n == 1 and ok for n, ok in seen)


@pytest.mark.slow
def test_bench_speculative_against_hf_prompt_lookup(llm, hf_reference, tmp_path, monkeypatch):
    from kvstrata.cluster.bench import hf_baseline, speculative
    from kvstrata.cluster.cli import main

    monkeypatch.setattr(hf_baseline, "load_hf_model", lambda model, dtype: hf_reference[1])
    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--num-prompts", "3", "--max-tokens", "12", "--rounds", "1",
                 "--baseline", "hf", "--json", str(out)]) == 0
    j = json.loads(out.read_text())
    assert [h["prompt"] for h in j["hf"]] == list(speculative.PROMPTS[:3])
    assert all(h["output_tokens"] > 0 and h["plain_s"] and h["speculative_s"] for h in j["hf"])
    # kvstrata's speculative tokens/s over HF's prompt lookup's, per prompt, then the median
    ratios = [(k["output_tokens"] / statistics.median(k["speculative_s"]))
              / (h["output_tokens"] / statistics.median(h["speculative_s"])) for k, h in zip(j["alone"], j["hf"])]
    assert j["kvstrata_over_hf_prompt_lookup"] == pytest.approx(statistics.median(ratios), abs=1e-3)


@pytest.mark.parametrize("dtype, status", [("float32", 1), ("bfloat16", 0)])
def test_bench_speculative_fails_on_changed_tokens_in_float32_only(monkeypatch, capsys, dtype, status):
    from kvstrata.cluster.bench import speculative
    from kvstrata.cluster.cli import main
    from kvstrata.worker import llm as llm_module

    class Stub:  # no model: the report is made up, only the verdict on it is under test
        tokenizer = None

        def __init__(self, *args, **kwargs):
            pass

        def close(self):
            pass

    changed = speculative.PromptResult("p", 3, [1.0], [0.5], 4, 2, identical=False)
    report = speculative.SpeculativeReport(4, 8, [changed], speculative.PromptResult("all", 3, [1.0], [1.0]))
    monkeypatch.setattr(llm_module, "LLM", Stub)
    monkeypatch.setattr(speculative, "bench_speculative", lambda *args: report)
    monkeypatch.setattr(speculative, "chat_ids", lambda tokenizer, prompts: [[1]])
    assert main(["bench", "speculative", "--dtype", dtype, "--rounds", "1"]) == status
    out = capsys.readouterr().out
    assert "NO" in out and ("depend on how a step is batched" in out) == (dtype == "bfloat16")
