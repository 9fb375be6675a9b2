"""Prefix reuse across requests, copy-on-write forks, and preemption by recompute."""

from __future__ import annotations

import pytest

from kvstrata import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _shared_prefix_prompts(llm, n_prefix=300):
    # a deterministic ~300-token document, then two different questions
    words = ("the cache keeps every block of keys and values that a prompt has produced so far "
             "and hands them to the next request that starts with the same tokens ").split()
    ids: list[int] = []
    i = 0
    while len(ids) < n_prefix:
        ids += llm.tokenizer.encode(" " + words[i % len(words)])
        i += 1
    prefix = ids[:n_prefix]
    a = prefix + llm.tokenizer.encode(" Question: what does the cache keep?")
    b = prefix + llm.tokenizer.encode(" Question: who receives the blocks?")
    return prefix, a, b


def test_second_prompt_reuses_300_token_prefix(llm):
    llm.reset_prefix_cache()
    _, a, b = _shared_prefix_prompts(llm)
    cold_b = llm.generate([b], GREEDY)[0]  # b alone, cold
    assert cold_b.num_cached_tokens == 0
    llm.reset_prefix_cache()
    first = llm.generate([a], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([b], GREEDY)[0]
    assert second.num_cached_tokens >= 288
    assert second.num_cached_tokens % 16 == 0
    assert second.outputs[0].token_ids == cold_b.outputs[0].token_ids
    stats = llm.cache_stats()
    assert stats["prefix_hit_rate"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.check_integrity()


def test_identical_prompt_is_cached_except_the_last_block(llm):
    llm.reset_prefix_cache()
    _, a, _ = _shared_prefix_prompts(llm)
    first = llm.generate([a], GREEDY)[0]
    again = llm.generate([a], GREEDY)[0]
    assert again.num_cached_tokens == ((len(a) - 1) // 16) * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.check_integrity()


def test_cache_salt_isolates_tenants(llm):
    llm.reset_prefix_cache()
    _, a, _ = _shared_prefix_prompts(llm)
    llm.generate([a], GREEDY, cache_salt="tenant-a")
    same = llm.generate([a], GREEDY, cache_salt="tenant-a")[0]
    other = llm.generate([a], GREEDY, cache_salt="tenant-b")[0]
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == same.outputs[0].token_ids
    llm.check_integrity()


def test_fork_shares_prompt_blocks_and_copies_on_write(llm):
    llm.reset_prefix_cache()
    prompt = llm.tokenizer.encode("Tell me a story about a dragon who learns to bake bread in a small village.")
    assert len(prompt) % 16 != 0  # the partial tail block is shared, then copied
    params = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=5, ignore_eos=True)
    engine = llm.engine
    rid = "fork-test"
    engine.add_request(rid, prompt, params)
    engine.step()  # prefill of sample 0, then the forks
    samples = engine.groups[rid].samples
    shared = [s.block_table[:len(prompt) // 16] for s in samples]
    assert all(t == shared[0] for t in shared)  # full prompt blocks are the same objects
    assert all(b.ref_count >= 4 for b in shared[0])
    tail = len(prompt) // 16
    assert len({s.block_table[tail].block_id for s in samples}) == 1  # the partial tail, shared
    engine.check_integrity()
    outs = engine.step()  # first decode: every sample writes into the shared tail
    assert len({s.block_table[tail].block_id for s in samples}) == 4  # copied on write
    assert all(s.block_table[:tail] == shared[0] for s in samples)  # full blocks still shared
    engine.check_integrity()
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples diverged
    # n=4 from one prefill equals running the same seeds again
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    llm.check_integrity()


@pytest.fixture(scope="module")
def tiny_pool_llm():
    # 12 blocks of 16 tokens: far too few for the batch below, so requests must be preempted
    return LLM("smollm2-135m", num_gpu_blocks=12, seed=0)


def test_preemption_by_recompute_gives_identical_outputs(llm, tiny_pool_llm):
    prompts = [llm.tokenizer.encode(f"Write a few sentences about the number {i} and why it matters.")
               for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = llm.generate(prompts, params)
    tight = tiny_pool_llm.generate(prompts, params)
    stats = tiny_pool_llm.cache_stats()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    tiny_pool_llm.check_integrity()


def test_seeded_sampling_survives_preemption(llm, tiny_pool_llm):
    prompts = [llm.tokenizer.encode(f"Once upon a time in city number {i}") for i in range(6)]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=11, ignore_eos=True)
    before = tiny_pool_llm.cache_stats()["num_preemptions"]
    tight = tiny_pool_llm.generate(prompts, params)
    assert tiny_pool_llm.cache_stats()["num_preemptions"] > before
    single = [llm.generate([p], params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in single]
    tiny_pool_llm.check_integrity()


def test_priority_runs_first(tiny_pool_llm):
    engine = tiny_pool_llm.engine
    p = tiny_pool_llm.tokenizer.encode("Count from one to twenty:")
    engine.add_request("low", p, SamplingParams(temperature=0, max_tokens=8, priority=5))
    engine.add_request("high", p, SamplingParams(temperature=0, max_tokens=8, priority=-5))
    first_done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_done = first_done or out.request_id
    assert first_done == "high"
    tiny_pool_llm.check_integrity()


def test_kv_utilization_is_high_while_running(llm):
    engine = llm.engine
    p = llm.tokenizer.encode("Describe the water cycle in detail.")
    for i in range(4):
        engine.add_request(f"util-{i}", p + [i + 100], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(30):
        engine.step()
    stats = llm.cache_stats()
    assert stats["num_used_blocks"] > 0
    # at most block_size - 1 empty slots per sequence
    assert stats["kv_utilization"] >= 1 - (4 * 15) / (stats["num_used_blocks"] * 16)
    while engine.has_unfinished_requests():
        engine.step()
    llm.check_integrity()


def test_requests_arriving_together_share_a_prefix_being_computed(llm):
    """A request whose prefix another request is prefilling in the same step waits one step and hits."""
    llm.reset_prefix_cache()
    _, a, _ = _shared_prefix_prompts(llm)
    prompts = [a + llm.tokenizer.encode(f" Variant {i}.") for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0
    assert all(c >= (len(a) // 16) * 16 for c in cached[1:]), cached
    # the deferral changes when a request runs, never what it produces
    llm.reset_prefix_cache()
    alone = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids
    llm.check_integrity()
