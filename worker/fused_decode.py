"""Decode steps on CPU, a layer in one C call (csrc/layer.c), with the prefill chunks that share the
step where K/V rows are of the model's dtype: float32, and bf16 while the step's rows go to the
packed GEMM (up to 8, or 64).

A step's layer is otherwise about ten Python-level calls (projections, RoPE and K/V write,
attention, norms), each with its checks and its ctypes or torch dispatch: about 30-40 us a layer,
a fifth of a batch-1 step on a 2-core host, and about half of a step of 8 decodes beside an
8-token prompt chunk. Here the same kernels run from C on the same buffers in the same order, so
the hidden states are the same bits as the call-by-call path's. The pointers that stay for the
model's life are set up once; a step sets up its own once, for all layers.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.worker.attention import step_prefill_arrays
from kvstrata.worker.cpu_kernels import CpuKernels, PackedWeight
from kvstrata.worker.kv_format import Int4Format, KVFormat, ScaledRowFormat

if TYPE_CHECKING:
    from kvstrata.worker.attention import AttentionMetadata
    from kvstrata.worker.model import LlamaModel

_P = ctypes.c_void_p
SCRATCH_TOKENS = 64  # steps of up to this many tokens share one set of scratch buffers


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down", "next_norm")]


class _DecodeStep(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("tokens", "hidden", "qkv_n", "inter", "num_heads",
                                                     "num_kv_heads", "head_dim", "block_size", "table_width")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, _P) for name in ("cos", "ssin", "slots", "block_tables", "seq_lens", "residual", "x",
                                           "qkv", "attn", "o", "gate_up", "act", "wide_in", "wide_out")]
                + [("kv_kind", ctypes.c_int64), ("kv_table", _P), ("kv_extra", ctypes.c_int64),
                   ("kv_group", ctypes.c_int64), ("kv_max_code", ctypes.c_float)]
                + [("num_decodes", ctypes.c_int64), ("num_prefills", ctypes.c_int64)]
                + [(name, _P) for name in ("pf_tables", "pf_starts", "pf_counts", "pf_ctxs")]
                + [("pf_width", ctypes.c_int64)])


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _packed(weight: Any) -> Any:
    """The packed panels of a prepared weight (bf16 keeps them beside oneDNN's layout)."""
    return weight[0] if isinstance(weight, tuple) else weight


class FusedDecode:
    """Built for a model whose projections are packed float32 or bf16 weights (see `build`)."""

    def __init__(self, kernels: CpuKernels, model: LlamaModel):
        self._layers = kernels.layers
        c = model.config
        self.model = model
        self.dtype = model.dtype
        layers = model.layers
        self.inter = _packed(layers[0].gate_up).n // 2
        self.qkv_n = _packed(layers[0].qkv).n
        # bf16: only as many rows as the model's linear sends to the packed kernel (oneDNN beyond)
        self.max_tokens = getattr(model.linear, "max_packed_rows", None)
        norm = _f32 if self.dtype == torch.float32 else (lambda t: None if t is None else t.contiguous())
        self._keep: list[torch.Tensor] = []  # copies the C side points into
        self._weights = (_LayerWeights * len(layers))()
        for i, layer in enumerate(layers):
            bias, post = _f32(layer.qkv_bias), norm(layer.post_norm)
            nxt = norm(layers[i + 1].input_norm) if i + 1 < len(layers) else None
            self._keep += [t for t in (bias, post, nxt) if t is not None]
            ptr = [None if t is None else t.data_ptr() for t in (
                _packed(layer.qkv).data, bias, _packed(layer.o_proj).data, post, _packed(layer.gate_up).data,
                _packed(layer.down).data, nxt)]
            self._weights[i] = _LayerWeights(*ptr)
        self.eps, self.head_dim = c.rms_norm_eps, c.head_dim
        self._kept: tuple | None = None  # the scratch buffers of steps of few tokens (see _scratch)

    @staticmethod
    def build(model: LlamaModel) -> FusedDecode | None:
        """None unless every projection is a packed weight of the model's dtype (float32 or bf16) and
        the model has no ranks to sum."""
        kernels = model.cpu_kernels
        if kernels is None or model.all_reduce is not None or model.dtype not in (torch.float32, torch.bfloat16):
            return None
        weights = [_packed(w) for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        if not all(isinstance(w, PackedWeight) and w.data.dtype == model.dtype for w in weights):
            return None
        return FusedDecode(kernels, model)

    def kv_kind(self, fmt: KVFormat | None, cache_dtype: torch.dtype) -> int | None:
        """How the C layer writes and reads the pool (csrc/layer.c's kv_kind): 0 rows of the model's
        dtype; in float32 models also 1-3 one-byte codes (int8, fp8 e4m3, e5m2) and 4 int4; None
        for any other pool, which runs call by call."""
        if fmt is None or fmt.is_plain:
            return 0 if cache_dtype == self.dtype else None
        if self.dtype != torch.float32:
            return None
        if isinstance(fmt, Int4Format):
            return 4
        return CpuKernels.CODE_KINDS.get(fmt.name) if isinstance(fmt, ScaledRowFormat) else None

    def takes(self, meta: AttentionMetadata, num_tokens: int, block_size: int | None = None) -> bool:
        """A step whose attention runs in the C kernels, with nobody watching the scores: decodes only,
        or with prefill chunks over K/V rows of floats or bf16, in blocks of `block_size` that the
        prefill kernel takes (and, in bf16, few enough rows for the packed GEMM)."""
        if (meta.cpu_kernels is None or meta.attention_observer is not None
                or (meta.num_decodes and meta.decode_block_tables is None)
                or (self.max_tokens is not None and num_tokens > self.max_tokens)):
            return False
        if not meta.prefills:
            return meta.num_decodes == num_tokens
        return ((meta.kv_format is None or meta.kv_format.is_plain)
                and block_size is not None and self._prefill_takes(block_size))

    def _prefill_takes(self, block_size: int) -> bool:
        m = self.model
        return m.cpu_kernels.prefill_takes(m.num_heads, m.num_kv_heads, self.head_dim, block_size)

    def _scratch(self, tokens: int, hidden: int, q_size: int, bf16: bool) -> tuple:
        """The step's scratch buffers (qkv, attn, o, gate_up, act and, for bf16, the float32 wide_in
        and wide_out), which only the C layers read and write, each before it reads it, through
        their pointers with rows as wide as the step's: buffers of SCRATCH_TOKENS rows, made once,
        serve every step of as many tokens or fewer (seven allocations a step cost about as much
        as the step's own Python work at batch 1); a larger step gets its own."""
        if tokens <= SCRATCH_TOKENS and self._kept is not None:
            return self._kept
        rows = max(tokens, SCRATCH_TOKENS)

        def buf(width: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.empty(rows, width, dtype=dtype)

        made = (buf(self.qkv_n), buf(q_size), buf(hidden), buf(2 * self.inter), buf(self.inter),
                buf(max(hidden, self.inter, q_size), dtype=torch.float32) if bf16 else None,
                buf(max(self.qkv_n, 2 * self.inter), dtype=torch.float32) if bf16 else None)
        if tokens <= SCRATCH_TOKENS:
            self._kept = made
        return made

    def forward(self, residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> None:
        """residual [T, hidden] (updated in place to the last layer's output) and x its normed copy;
        kv_cache [L, 2, blocks, block_size, Hkv, W] of a kind `kv_kind` names, dense; the slots already checked."""
        m = self.model
        tokens, hidden = residual.shape
        q_size = m.num_heads * self.head_dim

        bf16 = self.dtype == torch.bfloat16
        qkv, attn, o, gate_up, act, wide_in, wide_out = self._scratch(tokens, hidden, q_size, bf16)
        if meta.num_decodes:
            tables = meta.decode_block_tables.to(torch.int64).contiguous()
            lens = meta.decode_seq_lens.to(torch.int64).contiguous()
        else:
            tables = lens = torch.zeros(1, 1, dtype=torch.int64)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        step = _DecodeStep(tokens, hidden, self.qkv_n, self.inter, m.num_heads, m.num_kv_heads, self.head_dim,
                           kv_cache.shape[3], tables.shape[1], self.eps, m.scale, cos.data_ptr(),
                           signed_sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                           residual.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), o.data_ptr(),
                           gate_up.data_ptr(), act.data_ptr(), None if wide_in is None else wide_in.data_ptr(),
                           None if wide_out is None else wide_out.data_ptr())
        step.num_decodes = meta.num_decodes
        if meta.prefills:
            p = step_prefill_arrays(meta)
            step.num_prefills, step.pf_width = len(meta.prefills), p.tables.shape[1]
            step.pf_tables, step.pf_starts = p.tables.data_ptr(), p.starts.data_ptr()
            step.pf_counts, step.pf_ctxs = p.counts.data_ptr(), p.ctxs.data_ptr()
        fmt = meta.kv_format
        step.kv_kind = self.kv_kind(fmt, kv_cache.dtype)
        if step.kv_kind:
            step.kv_table = fmt.code_table.data_ptr()  # a dense float32 table the format keeps
            if isinstance(fmt, Int4Format):
                step.kv_extra, step.kv_group = fmt.extra, fmt.v_group
            else:
                step.kv_max_code = fmt.max_code
        elt = kv_cache.element_size()
        failed = ctypes.c_int64(-1)
        rc = self._layers(ctypes.addressof(self._weights), len(self._weights), ctypes.addressof(step),
                          kv_cache.data_ptr(), kv_cache.stride(0) * elt, kv_cache.stride(1) * elt, int(bf16),
                          ctypes.addressof(failed))
        if rc == -1:
            raise MemoryError(f"fused decode: no memory for the int4 K/V write's scratch (layer {failed.value})")
        if rc:  # takes() checked the shapes
            raise RuntimeError(f"fused decode: the prefill kernel refused the step's shapes (layer {failed.value})")
