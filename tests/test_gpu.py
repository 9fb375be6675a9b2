"""The engine on a CUDA GPU (skipped where there is none): tiny random checkpoints against HF
transformers on the same device, and a batch of SmolLM2-135M-shaped bf16 requests that must leave
the pool as it found it."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import VOCAB, assert_matches_hf, build_checkpoint, random_prompts, word_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_tiny_checkpoint_on_cuda_matches_transformers_on_cuda(tmp_path, kv_heads):
    """float32 on both sides (TF32 off, torch's default for matmuls): the same greedy tokens and
    log-probabilities within LOGPROB_TOL, for prompts across and inside KV blocks, batched."""
    from kvstrata import LLM

    assert not torch.backends.cuda.matmul.allow_tf32
    tok_dir = word_tokenizer(tmp_path / "tok")
    hf = build_checkpoint(tmp_path / "ckpt", tok_dir, "llama",
                          dict(num_key_value_heads=kv_heads, tie_word_embeddings=kv_heads != 4), False, seed=kv_heads)
    hf = hf.to("cuda")
    llm = LLM(model=str(tmp_path / "ckpt"), device="cuda", dtype="float32", num_gpu_blocks=64)
    assert llm.engine.runner.kv_cache.is_cuda
    assert_matches_hf(llm, hf, random_prompts(kv_heads))


def test_smollm2_shaped_bf16_batch_on_cuda_decodes_and_frees_its_blocks(tmp_path):
    """SmolLM2-135M's shapes (30 layers, GQA 9/3, 49,152 tokens) with random bf16 weights: 48
    requests with a shared prefix decode together, every token is in the vocabulary, the prefix is
    hit, and every block comes back."""
    from kvstrata import LLM, SamplingParams

    tok_dir = word_tokenizer(tmp_path / "tok")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ckpt" / f).write_bytes((tok_dir / f).read_bytes())
    llm = LLM(model=str(tmp_path / "ckpt"), device="cuda", dtype="bfloat16", num_gpu_blocks=2048)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (200,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (24,), generator=g).tolist() for _ in range(48)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)
    assert llm.engine.kv.num_prompt_tokens_hit >= 47 * 192  # the shared prompt's full blocks, after the first
    llm.check_integrity()
    stats = llm.cache_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
