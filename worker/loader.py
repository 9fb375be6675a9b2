"""Load a model (config, weights, tokenizer) from an HF directory, a GGUF file or an alias."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.worker.config import ModelConfig
from kvstrata.worker.gguf_loader import converted_dir, gguf_config
from kvstrata.worker.model import LlamaModel
from kvstrata.worker.model_source import ModelSource, resolve_model
from kvstrata.worker.tensor_parallel import TPShard, shard_slices, slice_for
from kvstrata.worker.tokenizer import Tokenizer

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    source: ModelSource


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def load_config(model: str) -> ModelConfig:
    """Only the config (no weights): for sizing and validation."""
    src = resolve_model(model)
    if src.kind == "gguf":
        return ModelConfig.from_hf_dict(gguf_config(src.path), model_id=src.model_id)
    return ModelConfig.from_json_file(src.path / "config.json", model_id=src.model_id)


def read_safetensors(path: Path, slices: dict[str, tuple[int, list[tuple[int, int]]]] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; with `slices` (a tensor-parallel rank's), the sharded ones
    are read as that slice only, straight from the file, so no rank holds the whole model."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                cut = slice_for(name, slices) if slices else None
                if cut is None:
                    weights[name] = st.get_tensor(name)
                    continue
                dim, ranges = cut
                part = st.get_slice(name)
                pieces = [part[a:b] if dim == 0 else part[:, a:b] for a, b in ranges]
                weights[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
    return weights


def load_model(model: str, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
               shard: TPShard | None = None, all_reduce=None) -> LoadedModel:
    """With `shard`, only that tensor-parallel rank's slices are read (see `LlamaModel`)."""
    src = resolve_model(model)
    hf_dir = converted_dir(src.path) if src.kind == "gguf" else src.path
    config = ModelConfig.from_json_file(hf_dir / "config.json", model_id=src.model_id)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    weights = read_safetensors(hf_dir, shard_slices(config, shard) if shard is not None else None)
    llama = LlamaModel(config, weights, torch_dtype, dev, shard=shard, all_reduce=all_reduce)
    del weights
    return LoadedModel(config, llama, Tokenizer.from_dir(hf_dir), src)
