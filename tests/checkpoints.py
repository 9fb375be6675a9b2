"""Tiny random-weight checkpoints written as HF directories (config.json, safetensors, the SmolLM2
tokenizer), and HF transformers' greedy output on them: the references for loader and
tensor-parallel tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB = 49152  # the SmolLM2 tokenizer copied into every tiny checkpoint
MAX_NEW = 12
WEIGHT_STD = 0.3  # far above HF's 0.02 init, so greedy paths are well separated (no near-ties)
LOGPROB_TOL = 1e-3  # float32 both sides; observed differences are ~1e-5


def llama3_rope() -> dict:
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}


BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}
PROMPT_LENGTHS = (37, 16, 5)  # spans blocks, exactly one block, inside one block


def to_legacy_config(path: Path) -> None:
    """Rewrite config.json the way pre-v5 transformers (and most hub checkpoints) lay out RoPE."""
    d = json.loads(path.read_text())
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        d["rope_scaling"] = rope
    path.write_text(json.dumps(d, indent=1))


def build_checkpoint(out_dir: Path, tokenizer_dir: Path, family: str, kwargs: dict, legacy: bool, seed: int):
    """Save a random checkpoint with a tokenizer to out_dir; return the HF model."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**BASE, **kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # HF inits norms to ones: make a mix-up visible
            else:
                p.normal_(0.0, WEIGHT_STD)  # also the q/k/v biases, which HF inits to zero
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out_dir / f)
    if legacy:
        to_legacy_config(out_dir / "config.json")
        # HF must read the rewritten file exactly as the config it was built from
        assert transformers.AutoConfig.from_pretrained(out_dir).rope_parameters == model.config.rope_parameters
    return model


def random_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy_logprobs(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and per-step log-softmax of the raw logits, [MAX_NEW, V] (on the host), on the
    model's own device."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return tokens, logprobs.cpu()


def assert_matches_hf(llm, hf_model, prompts: list[list[int]]) -> None:
    """kvstrata's greedy outputs for `prompts`, batched, against HF's one prompt at a time: the same
    tokens, every log-prob returned within LOGPROB_TOL; then every block back in the pool."""
    from kvstrata import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3))
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf_greedy_logprobs(hf_model, prompt)
        ours = out.outputs[0]
        assert ours.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for step, lp in enumerate(ours.logprobs):
            for tok, val in lp.items():
                assert abs(val - float(ref_logprobs[step, tok])) < LOGPROB_TOL, (step, tok)
    llm.check_integrity()
    stats = llm.cache_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def word_tokenizer(out_dir: Path, vocab: int = VOCAB) -> Path:
    """A word-level tokenizer over `vocab` ids ("t0", "t1", ...), where no real one is at hand (the
    GPU machines have no model files); prompts here are token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({}))
    return out_dir
