"""Capacity planning: how many sequences fit in the KV cache of a GPU, contiguous versus paged.

Everything here is arithmetic on a `ModelConfig` and a `SizingParams`, so it can be tested without
model files or a GPU; `load_model_config` is the one function that touches the disk. The model is
the one the engine runs: every tensor-parallel rank holds its share of the KV heads for every
sequence, so a replica of `tp` GPUs holds as many sequences as one of its ranks does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstrata.worker.config import ModelConfig
from kvstrata.worker.kv_dtypes import int4_row_extra_bytes

GIB = 1 << 30


@dataclass(frozen=True)
class KVDtype:
    """How one head's K (or V) vector of `head_dim` values is stored for one token, as the engine does.

    int8 and fp8 rows end with one float16 scale per token per head (`scale_bytes`); int4 rows carry
    their share of the block's per-channel key scales and the token's per-group value scales.
    """

    name: str
    bits: int
    scale_bytes: int = 0
    block_scales: bool = False

    def bytes_per_head_vector(self, head_dim: int, block_size: int = 16) -> int:
        # Packed values round up to whole bytes: an odd head_dim in int4 still costs a full byte.
        data = math.ceil(head_dim * self.bits / 8)
        if self.block_scales:
            return data + int4_row_extra_bytes(head_dim, block_size)
        return data + self.scale_bytes


# A registry rather than if/elif chains over names; "auto" is resolved to the model dtype.
KV_DTYPES: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("fp32", 32),
        KVDtype("fp16", 16),
        KVDtype("bf16", 16),
        KVDtype("fp8_e4m3", 8, scale_bytes=2),
        KVDtype("fp8_e5m2", 8, scale_bytes=2),
        KVDtype("int8", 8, scale_bytes=2),
        KVDtype("int4", 4, block_scales=True),
    )
}
WEIGHT_BYTES_PER_PARAM: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
# HF `torch_dtype` spellings -> our names. GGUF files report float32 because the loader dequantizes.
_TORCH_DTYPE_NAMES: dict[str, str] = {
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
}  # fmt: skip


@dataclass(frozen=True)
class SizingParams:
    """What the operator asks about. `None` lengths and dtypes "auto" are resolved from the model."""

    gpu_mem_gib: float = 80.0
    tp: int = 1
    gpus: int | None = None
    max_seq_len: int | None = None
    mean_seq_len: int | None = None
    block_size: int = 16
    kv_dtype: str = "auto"
    model_dtype: str = "auto"
    overhead_frac: float = 0.10
    overhead_gib: float = 1.0

    def __post_init__(self) -> None:
        # Messages name the CLI option, since that is where every value comes from.
        positive_ints = ("tp", "gpus", "max_seq_len", "mean_seq_len", "block_size")
        for name in positive_ints:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{_opt(name)} must be a positive integer, got {value!r}")
        if not self.gpu_mem_gib > 0:
            raise ValueError(f"--gpu-mem-gib must be positive, got {self.gpu_mem_gib!r}")
        if not 0 <= self.overhead_frac < 1:
            raise ValueError(f"--overhead-frac must be in [0, 1), got {self.overhead_frac!r}")
        if not self.overhead_gib >= 0:
            raise ValueError(f"--overhead-gib must be >= 0, got {self.overhead_gib!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype {self.kv_dtype!r} is unknown; choose from {kv_dtype_choices()}")
        if self.model_dtype != "auto" and self.model_dtype not in WEIGHT_BYTES_PER_PARAM:
            raise ValueError(
                f"--model-dtype {self.model_dtype!r} is unknown; "
                f"choose from auto, {', '.join(WEIGHT_BYTES_PER_PARAM)}"
            )
        if self.gpus is not None and self.gpus % self.tp != 0:
            raise ValueError(f"--gpus ({self.gpus}) must be a multiple of --tp ({self.tp})")


@dataclass(frozen=True)
class CapacityPlan:
    """The answer. Byte counts are exact integers; `*_per_rank` is what one GPU of a replica holds.

    `kv_bytes_per_token` counts each KV head once (the model's own footprint); the per-rank figure
    includes heads that ranks replicate when tp > kv heads, which is why
    kv_bytes_per_token_per_rank * tp can exceed kv_bytes_per_token.
    """

    model_id: str
    num_parameters: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_dtype: str
    kv_dtype: str
    tp: int
    gpus: int
    num_replicas: int
    kv_heads_per_rank: int
    kv_head_replication: float
    max_seq_len: int
    mean_seq_len: int
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_per_rank: int
    gpu_mem_bytes: int
    weights_bytes: int
    weights_bytes_per_rank: int
    overhead_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_budget_bytes_total: int
    kv_blocks_per_gpu: int
    kv_tokens_per_replica: int
    max_seqs_contiguous_per_replica: int
    max_seqs_paged_per_replica: int
    max_seqs_contiguous: int
    max_seqs_paged: int
    paged_vs_contiguous_ratio: float | None  # None when not even one contiguous sequence fits

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelDoesNotFitError(ValueError):
    """Weights plus overhead leave no room for any KV cache on a GPU."""


def kv_dtype_choices() -> str:
    return ", ".join(["auto", *KV_DTYPES])


def _opt(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def resolve_model_dtype(config: ModelConfig, requested: str) -> str:
    if requested != "auto":
        return requested
    name = _TORCH_DTYPE_NAMES.get(config.torch_dtype.lower())
    if name is None:
        raise ValueError(
            f"model torch_dtype {config.torch_dtype!r} is not one of "
            f"{', '.join(WEIGHT_BYTES_PER_PARAM)}; pass --model-dtype"
        )
    return name


def kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    """KV heads each rank stores, as the engine shards them (`plan_shard`): an even split, or heads
    replicated as needed when the ranks do not split them evenly.

        kv_heads=4, tp=2:                rank0 [h0 h1]  rank1 [h2 h3]          -> 2 per rank, replication 1
        kv_heads=2, tp=4:                rank0 [h0] rank1 [h0] rank2 [h1] ...  -> 1 per rank, replication 2
        heads=12, kv_heads=3, tp=2:      rank0 [h0 h0 h1]  rank1 [h1 h2 h2]    -> 3 per rank, replication 2
    """
    from kvstrata.worker.tensor_parallel import local_kv_heads

    if config.num_heads % tp:
        raise ValueError(f"--tp ({tp}) must divide the number of query heads ({config.num_heads})")
    return len(local_kv_heads(config.num_heads, config.num_kv_heads, tp, 0))


def plan_capacity(config: ModelConfig, params: SizingParams) -> CapacityPlan:
    """Size the KV cache of `config` on the GPUs described by `params`.

    Per GPU:  | weights / tp | overhead (frac * mem + fixed) | KV budget ............ |
    Contiguous reserves max_seq_len slots per sequence; paged reserves whole blocks up to the
    mean length, ceil(mean / block) * block slots, so it wastes at most block_size - 1 each.
    """
    tp = params.tp
    if config.num_heads % tp != 0:
        raise ValueError(f"--tp ({tp}) must divide the number of query heads ({config.num_heads})")
    gpus = params.gpus if params.gpus is not None else tp
    num_replicas = gpus // tp
    max_seq_len = params.max_seq_len or config.max_position_embeddings
    mean_seq_len = params.mean_seq_len or max(1, max_seq_len // 4)
    if mean_seq_len > max_seq_len:
        raise ValueError(f"--mean-seq-len ({mean_seq_len}) must not exceed --max-seq-len ({max_seq_len})")

    model_dtype = resolve_model_dtype(config, params.model_dtype)
    kv_dtype_name = model_dtype if params.kv_dtype == "auto" else params.kv_dtype
    kv_dtype = KV_DTYPES[kv_dtype_name]

    heads_per_rank = kv_heads_per_rank(config, tp)
    replication = heads_per_rank * tp / config.num_kv_heads
    head_vector = kv_dtype.bytes_per_head_vector(config.head_dim, params.block_size)
    # 2 = K and V.
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * head_vector
    kv_per_token_rank = 2 * config.num_layers * heads_per_rank * head_vector

    gpu_mem = int(params.gpu_mem_gib * GIB)
    num_params = config.num_parameters()
    weights = num_params * WEIGHT_BYTES_PER_PARAM[model_dtype]
    # Norms and some embeddings are replicated in practice; weights / tp is the planning estimate.
    weights_rank = math.ceil(weights / tp)
    overhead = int(params.overhead_frac * gpu_mem) + int(params.overhead_gib * GIB)
    budget = gpu_mem - weights_rank - overhead
    if budget <= 0:
        raise ModelDoesNotFitError(
            f"model does not fit: {weights_rank / GIB:.2f} GiB of weights per GPU + "
            f"{overhead / GIB:.2f} GiB overhead >= {params.gpu_mem_gib:g} GiB of GPU memory "
            f"(try a larger --tp or --gpu-mem-gib)"
        )

    block_bytes = params.block_size * kv_per_token_rank
    kv_blocks = budget // block_bytes
    blocks_per_seq = math.ceil(mean_seq_len / params.block_size)
    contiguous = budget // (kv_per_token_rank * max_seq_len)
    paged = kv_blocks // blocks_per_seq
    return CapacityPlan(
        model_id=config.model_id,
        num_parameters=num_params,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        model_dtype=model_dtype,
        kv_dtype=kv_dtype_name,
        tp=tp,
        gpus=gpus,
        num_replicas=num_replicas,
        kv_heads_per_rank=heads_per_rank,
        kv_head_replication=replication,
        max_seq_len=max_seq_len,
        mean_seq_len=mean_seq_len,
        block_size=params.block_size,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_token_per_rank=kv_per_token_rank,
        kv_bytes_per_sequence=kv_per_token * max_seq_len,
        kv_bytes_per_sequence_per_rank=kv_per_token_rank * max_seq_len,
        gpu_mem_bytes=gpu_mem,
        weights_bytes=weights,
        weights_bytes_per_rank=weights_rank,
        overhead_bytes_per_gpu=overhead,
        kv_budget_bytes_per_gpu=budget,
        kv_budget_bytes_total=budget * gpus,
        kv_blocks_per_gpu=kv_blocks,
        kv_tokens_per_replica=budget // kv_per_token_rank,
        max_seqs_contiguous_per_replica=contiguous,
        max_seqs_paged_per_replica=paged,
        max_seqs_contiguous=contiguous * num_replicas,
        max_seqs_paged=paged * num_replicas,
        paged_vs_contiguous_ratio=paged / contiguous if contiguous else None,
    )


def load_model_config(model: str) -> ModelConfig:
    """A config from an alias, an HF directory, a .gguf file or a config.json path.

    Imports are local: resolving a GGUF pulls in numpy and the gguf reader, which a pure
    `plan_capacity` caller never needs. Only metadata is read, never the weights.
    """
    from kvstrata.worker.model_source import resolve_model

    path = Path(model).expanduser()
    try:
        if path.suffix == ".json" and path.is_file():
            return ModelConfig.from_json_file(path, model_id=path.name)
        source = resolve_model(model)
        if source.kind == "hf":
            return ModelConfig.from_json_file(source.path / "config.json", model_id=source.model_id)
        from kvstrata.worker.gguf_loader import gguf_config

        return ModelConfig.from_hf_dict(gguf_config(source.path), model_id=source.model_id)
    except KeyError as e:
        raise ValueError(f"model {model!r}: config is missing the field {e}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"model {model!r}: not a usable model config ({e})") from None
