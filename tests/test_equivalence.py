"""Greedy output is token-identical to HF transformers on the same GGUF, single and batched."""

from __future__ import annotations

import pytest
import torch

from kvstrata import SamplingParams
from tests.conftest import hf_greedy

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Color of the sky?"}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c), add_special_tokens=False) for c in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_reference, prompt_ids):
    return [hf_greedy(hf_reference, ids, MAX_TOKENS) for ids in prompt_ids]


def _greedy(n=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=n)


def _trim_at_eos(ids: list[int], eos: int = 2) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_single_prompts_match_hf(llm, prompt_ids, reference):
    for ids, ref in zip(prompt_ids, reference):
        out = llm.generate([ids], _greedy())[0]
        assert out.outputs[0].token_ids == _trim_at_eos(ref)
    llm.check_integrity()


def test_batched_prompts_match_hf_and_single(llm, prompt_ids, reference):
    outs = llm.generate(prompt_ids, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [_trim_at_eos(r) for r in reference]
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    llm.check_integrity()


def test_chat_api_uses_the_template(llm, prompt_ids, reference):
    outs = llm.chat(PROMPTS[:2], _greedy())
    assert [o.prompt_token_ids for o in outs] == prompt_ids[:2]
    assert outs[0].outputs[0].token_ids == _trim_at_eos(reference[0])
    assert "Paris" in outs[0].outputs[0].text


def test_chunked_prefill_matches_hf(prompt_ids, reference):
    """A token budget smaller than the prompt splits prefill over several steps."""
    from kvstrata import LLM

    small = LLM("smollm2-135m", num_gpu_blocks=64, max_num_batched_tokens=7)
    outs = small.generate(prompt_ids, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == [_trim_at_eos(r) for r in reference]
    small.check_integrity()


def test_bfloat16_engine_stays_close_to_float32(prompt_ids, reference):
    """bf16 is an option, not lossless: at each position of the float32 greedy answers, bf16's own
    greedy choice should agree almost everywhere. Teacher-forced (each position from float32's
    prefix), because bf16's logits are coarse: the France answer's first token is within one bf16
    step of a second choice, so a free-running answer goes elsewhere on some builds (an AVX2 one)
    from a rounding difference in attention, which would say nothing about the other positions."""
    import torch

    from kvstrata import LLM

    bf16 = LLM("smollm2-135m", num_gpu_blocks=96, dtype="bfloat16")
    assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    agree = positions = 0
    for ids, ref in zip(prompt_ids, reference):
        ref = _trim_at_eos(ref)
        outs = bf16.generate([ids + ref[:j] for j in range(len(ref))], _greedy(1))
        agree += sum(out.outputs[0].token_ids[0] == ref[j] for j, out in enumerate(outs))
        positions += len(ref)
    assert positions >= 40 and agree >= 0.9 * positions, (agree, positions)
    bf16.check_integrity()


def test_a_prompts_outputs_are_the_same_bits_alone_or_batched(llm, prompt_ids):
    """In float32 with the C kernels, every row of a step is computed apart from the others (the
    one-row GEMM sums in the tiles' order; attention runs per sequence and KV head), so greedy
    tokens and their log-probabilities do not depend on what else was in the batch."""
    from kvstrata.worker.cpu_kernels import load_cpu_kernels

    if llm.engine.runner.model.cpu_kernels is None or load_cpu_kernels() is None:
        pytest.skip("needs the CPU kernels")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt_ids[1]], params)[0].outputs[0]
    batched = llm.generate(prompt_ids[:3], params)[1].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs  # exact: dicts of floats, compared bit for bit
    assert len(alone.logprobs) == 12 and all(len(lp) >= 2 for lp in alone.logprobs)


def _fused_matches_call_by_call(llm, prompt_ids, chunk: int = 0) -> list[tuple[int, int]]:
    """Steps run each layer as a few C calls (worker/fused_decode.py); switched off, the same kernels
    run one by one from Python. Tokens and log-probabilities must not move. chunk: prompts prefill
    in chunks of that many tokens, so that decodes and prefill chunks share steps. Returns each fused
    step's (decode rows, prefill chunks)."""
    import dataclasses

    model = llm.engine.runner.model
    fused = model.fused_decode
    if fused is None:
        pytest.skip("needs the CPU kernels and packed weights")
    calls = []
    original = fused.forward

    def counting(*args, **kwargs):
        meta = args[4]
        calls.append((meta.num_decodes, len(meta.prefills)))
        return original(*args, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    scheduler = llm.engine.scheduler
    config = scheduler.config
    fused.forward = counting
    try:
        scheduler.config = dataclasses.replace(config, long_prefill_token_threshold=chunk)
        # each run from an empty prefix cache, so that both compute the same prefills
        llm.reset_prefix_cache()
        with_fused = llm.generate(prompt_ids[:3], params)
        model.fused_decode = None
        llm.reset_prefix_cache()
        without = llm.generate(prompt_ids[:3], params)
    finally:
        scheduler.config = config
        model.fused_decode = fused
        del fused.forward  # back to the class's method
    assert (3, 0) in calls  # decode steps of all three sequences went through it
    for a, b in zip(with_fused, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    return calls


def test_fused_decode_layers_give_the_same_bits_as_the_call_by_call_path(llm, prompt_ids):
    calls = _fused_matches_call_by_call(llm, prompt_ids)
    assert any(prefills for _, prefills in calls)  # float32: the prompts' prefill steps too


def test_fused_layers_run_decodes_and_prefill_chunks_in_one_step_with_the_same_bits(llm, prompt_ids):
    """Prompts prefilled 8 tokens at a time: the first to finish decodes while the others still
    prefill, and those steps run fused as well (float32, K/V rows of floats)."""
    calls = _fused_matches_call_by_call(llm, prompt_ids, chunk=8)
    assert any(decodes and prefills for decodes, prefills in calls)


def test_fused_bf16_decode_layers_give_the_same_bits_as_the_call_by_call_path(prompt_ids):
    """bf16 runs a layer as one C call while a step's rows go to the packed GEMM (up to 8, or 64 on
    AMX tiles or bf16 dot products), prefill chunks included, with the same HF rounding points as the
    C kernels the call-by-call path runs; past that it stays off."""
    import torch

    from kvstrata import LLM

    bf16 = LLM("smollm2-135m", num_gpu_blocks=64, dtype="bfloat16")
    fused = bf16.engine.runner.model.fused_decode
    if fused is None:
        pytest.skip("needs the CPU kernels and packed bf16 weights")
    assert fused.dtype == torch.bfloat16
    if fused.max_tokens is not None:
        most = fused.max_tokens
        assert not fused.takes(_decode_meta(most + 1), most + 1) and fused.takes(_decode_meta(most), most)
    # chunks of 2 tokens: a decode beside two prompts' chunks stays within 8 rows
    calls = _fused_matches_call_by_call(bf16, prompt_ids, chunk=2)
    assert any(decodes and prefills for decodes, prefills in calls)  # prefill chunks beside decodes too
    bf16.check_integrity()


def _decode_meta(rows: int):
    """Just enough of a decode-only step's metadata for FusedDecode.takes."""
    from types import SimpleNamespace

    return SimpleNamespace(prefills=[], num_decodes=rows, cpu_kernels=object(), attention_observer=None,
                           decode_block_tables=object())


def test_fused_layers_take_prefill_chunks_only_in_shapes_the_prefill_kernel_takes(llm):
    """A step with prefill chunks runs fused only over K/V rows of floats in blocks the C prefill
    kernel takes (a multiple of its 16- or 8-key chunk), and with nobody watching the scores."""
    from types import SimpleNamespace

    fused = llm.engine.runner.model.fused_decode
    if fused is None:
        pytest.skip("needs the CPU kernels and packed weights")
    meta = _decode_meta(2)
    meta.prefills, meta.kv_format = [object()], None
    assert fused.takes(meta, 10, 16) and fused.takes(meta, 10, 32)
    assert not fused.takes(meta, 10, 12) and not fused.takes(meta, 10, None)
    meta.attention_observer = object()
    assert not fused.takes(meta, 10, 16)
    meta.attention_observer, meta.kv_format = None, SimpleNamespace(is_plain=False)
    assert not fused.takes(meta, 10, 16)  # quantized rows: prefills run call by call


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "int4"])
def test_fused_decode_layers_write_and_read_quantized_kv_with_the_same_bits(prompt_ids, kv_dtype):
    """float32 layers run fused over quantized pools too: RoPE in place, then the rows written by
    csrc/kv_write.c (the format's own bytes) and read by the decode kernel."""
    from kvstrata import LLM

    quantized = LLM("smollm2-135m", num_gpu_blocks=64, kv_dtype=kv_dtype)
    fused = quantized.engine.runner.model.fused_decode
    if fused is None:
        pytest.skip("needs the CPU kernels and packed weights")
    assert fused.kv_kind(quantized.engine.runner.kv_format, torch.uint8) is not None
    calls = _fused_matches_call_by_call(quantized, prompt_ids, chunk=8)
    assert not any(prefills for _, prefills in calls)  # quantized prefills run call by call
    quantized.check_integrity()
