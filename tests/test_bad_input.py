"""Bad input gets a clear ValueError naming the field; the engine keeps serving everyone else."""

from __future__ import annotations

import pytest

from kvstrata import LLM, SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([""], r"prompts\[0\] is empty"),
        ([[]], r"prompts\[0\] is empty"),
        ([[1, 2, 49152]], r"prompts\[0\].*49152.*outside the vocabulary"),
        ([[1, -3]], r"prompts\[0\].*-3"),
        (["fine", [5, "x"]], r"prompts\[1\]"),
        ([], r"prompts must be a non-empty list"),
        ([3.5], r"prompts\[0\] must be a string or a list of token ids"),
    ],
)
def test_bad_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, OK)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -1), ("temperature", -0.5),
                                           ("top_p", 0.0), ("n", 0), ("logprobs", 99),
                                           ("temperature", float("inf")), ("min_p", float("nan")),
                                           ("kv_eviction", "lru(8)"), ("kv_eviction", 32)])
def test_bad_sampling_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_prompt_longer_than_max_model_len():
    small = LLM("smollm2-135m", num_gpu_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 80 tokens; max_model_len is 64"):
        small.generate([[5] * 80], OK)
    out = small.generate([[5] * 20], OK)[0]
    assert len(out.outputs[0].token_ids) == 4
    # generation stops at max_model_len rather than running past the position table
    long = small.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert long.outputs[0].finish_reason == "length"
    assert len(long.prompt_token_ids) + len(long.outputs[0].token_ids) == 64
    small.check_integrity()


def test_prompt_that_can_never_fit_the_pool_is_rejected_not_hung():
    tiny = LLM("smollm2-135m", num_gpu_blocks=4)  # 64 token slots in all
    with pytest.raises(ValueError, match=r"needs 6 KV blocks.*pool has only 4"):
        tiny.generate([[7] * 70], SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match=r"max_tokens=100"):
        tiny.generate([[7] * 10], SamplingParams(max_tokens=100))
    assert tiny.generate([[7] * 10], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    tiny.check_integrity()


def test_bad_request_does_not_disturb_requests_in_flight(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("The quick brown fox")
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].token_ids
    engine.add_request("good", prompt, SamplingParams(temperature=0, max_tokens=10))
    engine.step()
    for bad in ([], [10**6], [1] * 10_000):
        with pytest.raises(ValueError):
            engine.add_request("bad", bad, OK)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", prompt, OK)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["good"]
    assert outs[0].outputs[0].token_ids == expected
    llm.check_integrity()


def test_abort_frees_every_block(llm):
    engine = llm.engine
    before = llm.cache_stats()["num_free_blocks"]
    engine.add_request("to-abort", [5] * 100, SamplingParams(max_tokens=50, n=3, seed=1))
    for _ in range(3):
        engine.step()
    assert llm.cache_stats()["num_free_blocks"] < before
    assert engine.abort("to-abort")
    assert not engine.abort("to-abort")
    assert llm.cache_stats()["num_free_blocks"] == before
    llm.check_integrity()


@pytest.mark.parametrize("kwargs, match", [
    ({"model": "/no/such/model"}, "not found"),
    ({"model": "no-such-alias"}, "not found"),
    ({"block_size": 0}, "block_size"),
    ({"num_gpu_blocks": -1}, "num_gpu_blocks"),
    ({"dtype": "int3"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"max_model_len": 10**6}, "max_model_len"),
])
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


def test_chat_bad_messages(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"content": "no role"}], OK)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}], OK)
