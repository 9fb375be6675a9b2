"""Stage timers inside the fused C layers, and the decode step's breakdown built on them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvstrata.cluster.bench.roofline import ModelCost
from kvstrata.cluster.bench.step_stages import StageProfile, format_profiles, profile_decode_stages, stage_bytes
from kvstrata.worker.cpu_kernels import LAYER_STAGES
from kvstrata.worker.sampling_params import SamplingParams

PRODUCTS = ("qkv", "o_proj", "gate_up", "down")


def _kernels(llm):
    kernels = llm.engine.runner.cpu_kernels
    if kernels is None or llm.engine.runner.model.fused_decode is None:
        pytest.skip("the fused CPU layers do not run here")
    return kernels


def test_layer_stages_are_timed_only_while_an_array_is_set(llm):
    kernels = _kernels(llm)
    seconds = (ctypes.c_double * len(LAYER_STAGES))()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    kernels.time_layer_stages(seconds)
    try:
        llm.generate([list(range(20, 60))], params)  # one prompt step, then decode steps
    finally:
        kernels.time_layer_stages(None)
    timed = dict(zip(LAYER_STAGES, seconds[:]))
    # silu: the one-row decode steps' pass of its own (the prompt's rows take it in gate_up's pass)
    for stage in (*PRODUCTS, "rope_kv", "decode_attention", "prefill_attention", "norms", "silu"):
        assert timed[stage] > 0, stage
    assert timed["convert"] == 0  # float32 rows are read as they are
    before = seconds[:]
    llm.generate([list(range(20, 60))], params)
    assert seconds[:] == before
    assert not llm.engine.has_unfinished_requests()


def test_time_layer_stages_wants_one_double_per_stage(llm):
    kernels = _kernels(llm)
    with pytest.raises(ValueError, match="doubles"):
        kernels.time_layer_stages((ctypes.c_double * (len(LAYER_STAGES) - 1))())


@pytest.mark.slow
def test_profile_of_decode_steps_adds_up(llm):
    _kernels(llm)
    p = profile_decode_stages(llm, "float32", 2, 20, 3)
    assert p.batch == 2 and 20 < p.context_len <= 20 + 2 + 2 + 2
    assert p.stage_ms["prefill_attention"] == 0  # every timed step decodes only
    assert all(p.stage_ms[s] > 0 for s in (*PRODUCTS, "decode_attention"))
    assert p.lm_head_ms > 0 and p.rest_ms > 0  # the head and sampling run outside the layers
    assert p.layers_ms + p.lm_head_ms < p.step_ms
    model = llm.engine.runner.model
    assert "greedy_tokens" not in vars(model) and "compute_logits" not in vars(model)  # the head's timers are gone
    c = llm.engine.config
    assert p.stage_bytes["qkv"] == c.num_layers * c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * 4
    assert p.gb_per_s("down") == pytest.approx(p.stage_bytes["down"] / p.stage_ms["down"] / 1e6)
    assert not llm.engine.has_unfinished_requests()


def test_profile_refuses_an_engine_without_the_fused_layers(llm, monkeypatch):
    monkeypatch.setattr(llm.engine.runner, "cpu_kernels", None)
    with pytest.raises(ValueError, match="fused CPU layers"):
        profile_decode_stages(llm, "float32", 1, 8, 1)
    assert not llm.engine.has_unfinished_requests()


def test_stage_bytes_follow_the_model_shapes(llm):
    cost = ModelCost(llm.engine.config, "bfloat16")
    b = stage_bytes(cost, keys=1000)
    c = llm.engine.config
    assert b["gate_up"] == 2 * b["down"] == c.num_layers * 2 * c.hidden_size * c.intermediate_size * 2
    assert b["decode_attention"] == 1000 * cost.kv_bytes_per_token


def test_format_shows_the_stages_that_ran_and_their_rates():
    stage_ms = dict.fromkeys(LAYER_STAGES, 0.0)
    stage_ms.update(qkv=10.0, o_proj=5.0, gate_up=20.0, down=5.0, decode_attention=4.0, norms=1.0)
    byte_counts = {"qkv": 1e9, "o_proj": 1e8, "gate_up": 2e9, "down": 1e8, "decode_attention": 4e7}
    p = StageProfile("float32", 8, 300, 50.0, stage_ms, byte_counts, lm_head_ms=2.0)
    assert p.rest_ms == pytest.approx(3.0)
    lines = format_profiles([p])
    assert "prefill_attention" not in lines[0] and "convert" not in lines[0] and "decode_attention" in lines[0]
    assert lines[1].split()[-2:] == ["2.00", "3.00"]  # lm_head, rest
    rates = lines[-1]
    assert "qkv 100.0" in rates and "decode_attention 10.0" in rates
    assert rates.endswith(f"all products {3.2e9 / 40.0 / 1e6:.1f}")
    assert p.to_json()["gb_per_s"]["gate_up"] == 100.0


def test_float32_layers_take_the_silu_into_the_gate_up_pass_from_two_rows(llm):
    """A float32 layer of two rows or more computes silu(gate) * up in gate_up's own pass (nothing timed
    as silu); with that pass split in two (kvs_gemm_set_fused_silu(0)) the SiLU is timed on its own,
    and the tokens are the same either way."""
    kernels = _kernels(llm)
    if llm.engine.runner.model.dtype != torch.float32:
        pytest.skip("a float32 model's layers")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(20, 60)), list(range(70, 95))]
    outputs, silu = {}, {}
    restore = kernels._lib.kvs_gemm_set_fused_silu(1)
    try:
        for on in (1, 0):
            kernels._lib.kvs_gemm_set_fused_silu(on)
            seconds = (ctypes.c_double * len(LAYER_STAGES))()
            kernels.time_layer_stages(seconds)
            try:
                outputs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            finally:
                kernels.time_layer_stages(None)
            timed = dict(zip(LAYER_STAGES, seconds[:]))
            assert timed["gate_up"] > 0
            silu[on] = timed["silu"]
    finally:
        kernels._lib.kvs_gemm_set_fused_silu(restore)
    assert silu[1] == 0 and silu[0] > 0
    assert outputs[1] == outputs[0]
