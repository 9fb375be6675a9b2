"""GGUF to HF-directory conversion, done once and cached.

A GGUF file is read with the `gguf` package, its tensors dequantized to float32, and written as an
HF-style directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) under the
cache directory. Every later load goes through the HF-directory loader, so there is one weight path.

llama.cpp's converter interleaves the rotary halves of q and k rows; `_unpermute` restores the HF
order so the model code uses one RoPE convention:

    HF rows per head:   [x0 x1 ... x31 | y0 y1 ... y31]      (rotate_half pairs i with i+32)
    GGUF rows per head: [x0 y0 x1 y1 ... x31 y31]            (pairs are adjacent)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

CONVERTER_VERSION = "1"
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE_DIR", Path.home() / ".cache" / "kvstrata"))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config_dict(reader: Any) -> dict[str, Any]:
    """HF config.json equivalent of a GGUF file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    p = arch + "."
    num_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    d: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scale = _field(reader, p + "rope.scaling.factor")
    if scale and _field(reader, p + "rope.scaling.type") == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(scale)}
    return d


def gguf_tokenizer_files(reader: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """tokenizer.json and tokenizer_config.json contents for a byte-level BPE GGUF vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ttype == TOKEN_TYPE_CONTROL,
        }
        for i, (tok, ttype) in enumerate(zip(tokens, types))
        if ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": list(merges),
        },
    }

    def token_text(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    tokenizer_config = {
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
        "eos_token": token_text("tokenizer.ggml.eos_token_id"),
        "pad_token": token_text("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tokenizer_json, tokenizer_config


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # w: [n_head * head_dim, ...] in GGUF's interleaved rotary order -> HF half-split order
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def gguf_state_dict(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    config = gguf_config_dict(reader)
    tokenizer_json, tokenizer_config = gguf_tokenizer_files(reader)
    state = gguf_state_dict(reader, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))


def gguf_config(gguf_path: Path) -> dict[str, Any]:
    """Metadata only, without dequantizing (for sizing)."""
    from gguf import GGUFReader

    return gguf_config_dict(GGUFReader(str(gguf_path)))


def converted_dir(gguf_path: Path) -> Path:
    """The cached HF directory for a GGUF file, converting it on first use.

    The key covers the file's identity (path, size, mtime) and the converter version. The
    conversion is written to a temporary directory and renamed into place, so a crash mid-way
    never leaves a half-written cache entry behind.
    """
    st = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()
    ).hexdigest()[:24]
    target = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another process
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
