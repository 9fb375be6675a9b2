"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over one flattened batch of tokens.

Every step runs on [T, hidden] where T mixes decode tokens and prefill chunks of many requests;
attention alone knows the request boundaries (through AttentionMetadata). q/k/v and gate/up are
fused into one matmul each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvstrata.worker.attention import AttentionMetadata, paged_attention, write_kv
from kvstrata.worker.config import ModelConfig
from kvstrata.worker.cpu_kernels import PackedWeight
from kvstrata.worker import greedy_head
from kvstrata.worker.linear import select_linear
from kvstrata.worker.rope import RotaryEmbedding
from kvstrata.worker.tensor_parallel import TPShard

# the greedy head's row limit (GreedyHead.tune) by head shape, timed once per process
_GREEDY_HEAD_ROWS: dict[tuple, int | None] = {}  # by (head shape, dtype)


@dataclass(slots=True)
class LayerWeights:
    """Projection weights are as the linear backend prepared them (a tensor, or packed panels)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Any  # [(H + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Any  # [hidden, H * D]
    post_norm: torch.Tensor
    gate_up: Any  # [2 * inter, hidden]
    down: Any  # [hidden, inter]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused kernel; in float32 it rounds like the reference below
        return F.rms_norm(x, weight.shape, weight, eps)
    # HF's operation order for 16-bit types (normalise in float32, round, then scale), so greedy
    # outputs stay token-identical to the reference
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """With `shard`, one tensor-parallel rank's slice: `weights` hold only that rank's rows and
    columns of the sharded projections, and `all_reduce` sums the row-parallel partial outputs."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, linear_backend: str = "auto", shard: TPShard | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.shard = shard
        self.all_reduce = all_reduce
        c = config
        self.num_heads = shard.num_heads if shard is not None else c.num_heads
        self.num_kv_heads = shard.num_kv_heads if shard is not None else c.num_kv_heads

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        linear = self.linear = select_linear(device, dtype, linear_backend)
        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        if self.embed.shape[0] != c.vocab_size or self.embed.shape[1] != c.hidden_size:
            raise ValueError(f"embedding shape {tuple(self.embed.shape)} does not match the config")
        head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        projections = ("qkv", "o_proj", "gate_up", "down")
        raw: list[torch.Tensor] = []  # every layer's projections, then the head: a step's reading order
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if c.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            qkv = torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")])
            if qkv.shape[0] != (self.num_heads + 2 * self.num_kv_heads) * c.head_dim:
                raise ValueError(f"layer {i}: q/k/v weights have {qkv.shape[0]} rows, expected "
                                 f"{(self.num_heads + 2 * self.num_kv_heads) * c.head_dim}")
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            raw += [qkv, w(a + "o_proj.weight"), gate_up, w(p + "mlp.down_proj.weight")]
            self.layers.append(LayerWeights(input_norm=w(p + "input_layernorm.weight"), qkv=None, qkv_bias=bias,
                                            o_proj=None, post_norm=w(p + "post_attention_layernorm.weight"),
                                            gate_up=None, down=None))
        flat = linear.prepare_all(raw + [head])
        del raw
        for i, layer in enumerate(self.layers):
            for j, n in enumerate(projections):
                setattr(layer, n, flat[i * len(projections) + j])
        self.lm_head = flat[-1]
        panels = [w[0] if isinstance(w, tuple) else w for w in flat[:-1]]  # the projections' packed panels
        panels = [w for w in panels if isinstance(w, PackedWeight)]
        if panels:  # once per process: how the packed GEMM runs fastest on this host (timed, cpu_kernels.py)
            from kvstrata.worker.cpu_kernels import load_cpu_kernels

            kernels = load_cpu_kernels()
            # the gate_up products run with their SiLU in the same pass: timed so where it matters
            gate_ups = [g[0] if isinstance(g, tuple) else g for g in (layer.gate_up for layer in self.layers)]
            if dtype == torch.float32 or not kernels.amx:  # (bf16 on AMX tiles does not use it)
                kernels.tune_prefetch(panels)
            if dtype == torch.float32:  # and whether 9-32-row products take turns (float32 only)
                kernels.tune_turns(panels)
            kernels.tune_two_groups(panels)  # and how one row streams (AVX2 builds)
            kernels.tune_short_panels(panels, joined=gate_ups)  # and how a prompt chunk's row blocks share weights
            if dtype == torch.bfloat16:  # and whether widened bf16 blocks multiply a float32 copy
                kernels.tune_wide_copy(panels, joined=gate_ups)
        self.greedy_head = self._make_greedy_head(head, dtype, shard)
        self.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta,
                                    c.rope_scaling, dtype, device)
        self.scale = c.head_dim**-0.5
        # C norms, RoPE and (bf16) SiLU gate on CPU; bf16 rounds where HF's bf16 model rounds
        # (csrc/bf16_ops.c), as rms_norm below does in torch
        self.cpu_kernels = None
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from kvstrata.worker.cpu_kernels import load_cpu_kernels

            self.cpu_kernels = load_cpu_kernels()
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        from kvstrata.worker.fused_decode import FusedDecode

        self.fused_decode = FusedDecode.build(self)  # steps, with their prefill chunks, one C call a layer

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, 2, num_blocks, block_size, Hkv, D] -> hidden [T, hidden]
        (Hkv: this rank's KV heads)."""
        c = self.config
        linear = self.linear
        # the residual stream: every sub-layer's output is added to it in place, fused with the
        # norm that follows (one C pass in float32 on CPU)
        residual = F.embedding(input_ids, self.embed)  # [T, hidden], a fresh tensor
        num_tokens = residual.shape[0]
        qk_size = self.q_size + self.kv_size
        fused_rope = self._fused_rope(kv_cache, meta)
        x = self._rms_norm(residual, self.layers[0].input_norm)
        if (self.fused_decode is not None and self.all_reduce is None  # set after load at TP
                and kv_cache.is_contiguous() and self.fused_decode.takes(meta, num_tokens, kv_cache.shape[3])
                and (fused_rope or self._quantized_rows_in_c(kv_cache, meta))):
            self.fused_decode.forward(residual, x, *self.rope.rows(positions), meta, kv_cache)
            return residual
        cos, sin = self.rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            qkv = linear(x, layer.qkv, layer.qkv_bias)  # [T, (H + 2 Hkv) * D]
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            if fused_rope:  # rotated in place and written to the pool in one C pass
                self.cpu_kernels.rope_write_kv(qkv, self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache,
                                               meta.slot_mapping)
                q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, c.head_dim)
            else:
                # queries and keys rotate together: [T, H + Hkv, D]
                qk = self.rope.rotate(qkv[:, :qk_size].view(num_tokens, -1, c.head_dim), cos, sin)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
                v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, c.head_dim)
                write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kv_format)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, H, D]
            if meta.attention_observer is not None:
                meta.attention_observer(i, q, k_cache, meta)
            attn = linear(o.reshape(num_tokens, self.q_size), layer.o_proj, None)
            if self.all_reduce is not None:
                self.all_reduce(attn)  # row-parallel: sum the ranks' partial outputs
            x = self._add_rms_norm(attn, residual, layer.post_norm)
            mlp = linear(self._gate_up_act(x, layer.gate_up), layer.down, None)
            if self.all_reduce is not None:
                self.all_reduce(mlp)
            if i + 1 < len(self.layers):
                x = self._add_rms_norm(mlp, residual, self.layers[i + 1].input_norm)
            else:
                residual.add_(mlp)
        return residual

    def _fused_rope(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step rotates and writes K/V through the C kernel: float32 or bf16 on CPU with
        the kernels, K/V rows of the model's dtype, a head size it takes. Its slots are checked here, once a step."""
        if (self.cpu_kernels is None or kv_cache.dtype != self.dtype or self.config.head_dim % 2
                or self.config.head_dim > 256 or (meta.kv_format is not None and not meta.kv_format.is_plain)):
            return False
        return self._slots_checked(kv_cache, meta)

    def _quantized_rows_in_c(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a fused decode step can rotate, write and read this pool's quantized rows in C
        (FusedDecode.kv_kind); its slots are checked here."""
        if (self.cpu_kernels is None or self.config.head_dim % 2 or self.config.head_dim > 256
                or self.fused_decode.kv_kind(meta.kv_format, kv_cache.dtype) is None):
            return False
        return self._slots_checked(kv_cache, meta)

    @staticmethod
    def _slots_checked(kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        slots = meta.slot_mapping
        capacity = kv_cache.shape[2] * kv_cache.shape[3]
        if slots.numel() and not (0 <= int((bounds := torch.aminmax(slots)).min) and int(bounds.max) < capacity):
            raise ValueError(f"slot_mapping holds slots outside the pool's {capacity}")
        return True

    def _gate_up_act(self, x: torch.Tensor, gate_up: Any) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T): a packed float32 weight's product and SiLU in one C call."""
        if self.cpu_kernels is not None and x.dtype == torch.float32 and isinstance(gate_up, PackedWeight):
            return self.cpu_kernels.gemm_silu(x, gate_up)
        return self._silu_mul(self.linear(x, gate_up, None))

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate) * up [T, I]."""
        if self.cpu_kernels is not None and gate_up.dtype in (torch.float32, torch.bfloat16):
            return self.cpu_kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return self.cpu_kernels.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """residual += x (in place, as HF's `residual + x`), then the norm of the new residual."""
        if self.cpu_kernels is not None:
            return self.cpu_kernels.add_rms_norm(x, residual, weight, self.config.rms_norm_eps)
        residual.add_(x)
        return rms_norm(residual, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (only the rows that are sampled) -> logits [N, V] in float32."""
        x = self._rms_norm(hidden, self.norm)
        return self.linear.to_float(x, self.lm_head, None)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> each row's greedy token, int64 [N]: the first index of the largest of
        compute_logits' row, from the greedy head (worker/greedy_head.py); None without one, for more
        rows than it takes, or where a row holds a non-finite value."""
        if self.greedy_head is None or not self.greedy_head.takes(hidden.shape[0]):
            return None
        return self.greedy_head.tokens(self._rms_norm(hidden, self.norm))

    def _make_greedy_head(self, head: torch.Tensor, dtype: torch.dtype,
                          shard: TPShard | None) -> greedy_head.GreedyHead | None:
        """The greedy head for a whole float32 or bf16 head that the packed GEMM multiplies, where this
        build gives its bits and KVSTRATA_GREEDY_HEAD allows (for bf16, with the int8 copy, and only
        for the rows the packed GEMM or the AMX tiles take: oneDNN computes a bf16 head's logits
        beyond them); else None."""
        from kvstrata.worker.cpu_kernels import load_cpu_kernels

        packed, limit = self.lm_head, None
        if isinstance(packed, tuple) and dtype == torch.bfloat16:  # HybridLinear: (packed, oneDNN)
            packed, limit = packed[0], self.linear.max_packed_rows
        if dtype not in (torch.float32, torch.bfloat16) or shard is not None or not isinstance(packed, PackedWeight):
            return None
        kernels = load_cpu_kernels()
        if not greedy_head.wanted() or kernels is None or not greedy_head.available(kernels):
            return None
        if dtype == torch.bfloat16 and greedy_head.chosen_copy(kernels) != "int8":
            return None
        made = greedy_head.GreedyHead(kernels, head, packed, kept=head is self.embed)
        made.row_limit = limit
        # up to how many rows it pays, where the copy multiplies no faster than the model's head
        # (timed once per process, head shape and dtype, as the GEMM's switches are); none: not kept
        shape = (tuple(head.shape), dtype)
        if greedy_head.ROWS_ENV in os.environ:
            made.tune()  # the setting, untimed, and not kept for later loads
        elif shape in _GREEDY_HEAD_ROWS:
            made.max_rows = _GREEDY_HEAD_ROWS[shape]
        else:
            _GREEDY_HEAD_ROWS[shape] = made.tune()
        return None if made.max_rows == 0 else made
