"""C kernels for the CPU hot path, built with the system C compiler on first use and called through ctypes.

Decode attention reads K/V in place from the block pool instead of gathering them into a padded
copy, which on CPU costs more than the attention itself. Projections multiply by weights packed
once at load into column groups sized for the CPU's vector registers: at decode shapes 1.3-2x
faster than oneDNN, which repacks on every call. float32 RMSNorm is fused with the residual add
before it. The shared object is built once per source, flags, compiler and CPU (kernel_build.py),
and links against the OpenMP runtime torch has already loaded, so both share one thread pool.
Without a compiler, or with
KVSTRATA_CPU_KERNELS=0, `load_cpu_kernels()` returns None and the engine runs on oneDNN and plain
torch. RoPE and the K/V write of a layer are one more C pass (csrc/rope.c).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import threading
from dataclasses import dataclass

import torch

from kvstrata.worker.block_kernels import BlockKernels
from kvstrata.worker.gemm_tuning import GemmTuning, stream_env, switch_env
from kvstrata.worker.kernel_build import build, find_compiler
from kvstrata.worker.kernel_signatures import declare

log = logging.getLogger(__name__)


# the fused layers' stages that time_layer_stages times, in csrc/layer.c's order (its Stage enum)
LAYER_STAGES = ("qkv", "rope_kv", "decode_attention", "prefill_attention", "o_proj", "norms", "gate_up", "silu",
                "down", "convert")


class CpuKernels(GemmTuning, BlockKernels):
    def __init__(self, lib: ctypes.CDLL):
        declare(lib)  # every entry point's argument and result types (kernel_signatures.py)
        self._lib = lib
        self.layers = lib.kvs_layers  # a step's layers in one call (csrc/layer.c)
        if lib.kvs_layers_num_stages() != len(LAYER_STAGES):
            raise RuntimeError(f"csrc/layer.c times {lib.kvs_layers_num_stages()} stages, "
                               f"LAYER_STAGES names {len(LAYER_STAGES)}")
        # bf16 weights on AMX tiles where the CPU and the kernel allow them (csrc/amx_gemm.c); asked
        # once, before anything is packed, since the packed layout follows
        self.amx = os.environ.get("KVSTRATA_AMX", "1") != "0" and bool(lib.kvs_amx_enable())
        # without tiles, bf16 weights in pairs for the CPU's bf16 dot products where it has them
        # (csrc/gemm.c); likewise chosen before anything is packed
        self.bf16_dot = (not self.amx and os.environ.get("KVSTRATA_BF16_DOT", "1") != "0"
                         and bool(lib.kvs_bf16_dot_enable(1)))
        self.gemm_group = lib.kvs_gemm_group()  # output columns per packed group: NR in csrc/gemm.c
        # decode attention's value passes pull the next chunk's keys ahead (csrc/dense_decode.c): on
        # by default except on Intel CPUs; KVSTRATA_DECODE_KEY_AHEAD=0 or 1 sets it
        ahead = switch_env("KVSTRATA_DECODE_KEY_AHEAD")
        if ahead is not None:
            lib.kvs_decode_set_key_ahead(int(ahead))
        self.key_ahead = bool(lib.kvs_decode_set_key_ahead(-1))  # -1 leaves it, returning it
        # how far ahead float32 rows are streamed where keys are pulled ahead: 32 KB, 12 KB on AMD
        # family 17h (Zen 1 and 2), whose prefetches all fill L1; KVSTRATA_DECODE_STREAM_KB sets it
        stream_kb = stream_env()
        if stream_kb is not None:
            lib.kvs_decode_set_stream_bytes(stream_kb << 10)
        self.decode_stream_bytes = lib.kvs_decode_set_stream_bytes(0)  # 0 leaves it, returning it
        self._sample_scratch = threading.local()  # kvs_sample_f32's room, kept between calls, one per thread
        # whether crc32 beats zlib's here (carry-less multiplies); without, the same values, slower
        self.crc32_fast = bool(lib.kvs_crc32_fast())

    def byte_code_decoding(self, code_table: torch.Tensor) -> str:
        """How decode attention reads byte-code rows with this table: "int8", "e4m3" or "e5m2" when
        the table holds that format's values (decoded by arithmetic in vector registers), else
        "table" (each code looked up)."""
        if code_table.dtype != torch.float32 or code_table.numel() != 256:
            raise ValueError("a byte-code table is 256 float32 values")
        table = code_table.contiguous()
        return ("table", "int8", "e4m3", "e5m2")[self._lib.kvs_codes_kind(ctypes.c_void_p(table.data_ptr()))]

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and num_heads % num_kv_heads == 0

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     code_table: torch.Tensor | None = None, int4_value_group: int | None = None) -> torch.Tensor:
        """q: [B, H, D]; caches: [num_blocks, bs, Hkv, D] (fp32 or bf16), byte-code rows [.., D + 2]
        (uint8: D codes and an fp16 scale) decoded through code_table [256] float32, or with
        int4_value_group, int4 rows [.., D/2 + E] (kv_format.py) whose scale bytes code_table decodes;
        block_tables: [B, W] int64; seq_lens: [B] int64."""
        batch, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode needs contiguous K/V caches")
        tables = _dense_int64(block_tables)
        lens = _dense_int64(seq_lens)
        # bf16 queries over bf16 K/V stay bf16 in and out (the fused bf16 layer's call: the same values
        # as the float32 entry's output rounded). Only pointers cross into C, so every buffer must be
        # dense, but q may skip rows: a view into the fused q/k projection is read in place.
        rows = q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
        in_place = q.stride(2) == 1 and q.stride(1) == head_dim
        if rows or q.dtype == torch.float32:
            qx = q if in_place else q.contiguous()
        else:
            qx = q.float().contiguous()
        out = torch.empty((batch, num_heads, head_dim), dtype=torch.bfloat16 if rows else torch.float32)
        common = (qx.data_ptr(), qx.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                  lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
                  tables.shape[1], scale)
        if rows:
            self._lib.kvs_paged_decode_bf16_rows(*common)
            return out
        if k_cache.dtype == torch.uint8:
            extra = _quantized_row_extra(k_cache, head_dim, code_table, int4_value_group)
            if extra:
                self._lib.kvs_paged_decode_int4(*common, code_table.contiguous().data_ptr(), extra, int4_value_group)
            else:
                self._lib.kvs_paged_decode_codes(*common, code_table.contiguous().data_ptr())
        elif k_cache.dtype == torch.bfloat16:
            self._lib.kvs_paged_decode_bf16(*common)
        else:
            self._lib.kvs_paged_decode_f32(*common)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def int4_write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor,
                   key: bool, value_group: int, starts_blocks: bool = True) -> None:
        """Int4Format.write in one C pass (csrc/kv_write.c), the same bytes: cache [N, bs, Hkv, W]
        uint8, dense; x [T, Hkv, D]; slots [T]; steps the 256 step codes' values, increasing."""
        _, bs, hkv, width = cache.shape
        head_dim = x.shape[-1]
        if not cache.is_contiguous() or cache.dtype != torch.uint8 or x.shape[1] != hkv or head_dim > 256:
            raise ValueError("int4_write needs a dense uint8 pool of the tokens' heads and head_dim <= 256")
        xf, ids, table = x.float().contiguous(), _dense_int64(slots), steps.contiguous()
        args = (xf.data_ptr(), hkv * head_dim, ids.data_ptr(), len(ids), table.data_ptr())
        if not key:
            self._lib.kvs_int4_write_values(cache.data_ptr(), hkv, head_dim, width, value_group, *args)
        elif self._lib.kvs_int4_write_keys(cache.data_ptr(), bs, hkv, head_dim, width, *args, int(starts_blocks)):
            raise MemoryError("int4_write: out of memory for a write's scratch")

    # ScaledRowFormat's codes, by name, for codes_write (csrc/kv_write.c)
    CODE_KINDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}

    def codes_write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, name: str,
                    max_code: float) -> None:
        """ScaledRowFormat.write in one C pass, the same bytes: cache [N, bs, Hkv, D + 2] uint8, dense;
        x [T, Hkv, D]; name "int8", "fp8_e4m3" or "fp8_e5m2"."""
        hkv, head_dim = x.shape[1:]
        if not cache.is_contiguous() or cache.dtype != torch.uint8 or cache.shape[-2:] != (hkv, head_dim + 2):
            raise ValueError("codes_write needs a dense uint8 pool of rows of the tokens' heads")
        xf, ids = x.float().contiguous(), _dense_int64(slots)
        self._lib.kvs_codes_write(cache.data_ptr(), hkv, head_dim, xf.data_ptr(), hkv * head_dim, ids.data_ptr(),
                                  len(ids), self.CODE_KINDS[name], max_code)

    def prefill_takes(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
        """Whether paged_prefill takes these shapes (head size 64 or 128; blocks a multiple of 16, or 8
        in an AVX2 build)."""
        return bool(self._lib.kvs_paged_prefill_takes(num_heads, num_kv_heads, head_dim, block_size))

    def paged_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      prefills: PrefillArrays, scale: float, code_table: torch.Tensor | None = None,
                      int4_value_group: int | None = None) -> bool:
        """Causal attention of prefill chunks (csrc/prefill_attention.c): K/V float32 read in place, bf16
        rows widened, or quantized rows (uint8, with code_table and for int4 int4_value_group, as
        paged_decode takes them).

        q: [T, H, D] float32 with dense heads (a view into the fused projection is fine); out: a
        dense [T, H, D] float32 whose prefill rows are written. False, with nothing written, when
        the shapes are not ones the kernel takes (head size 64 or 128; blocks a multiple of 16)."""
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        quantized = k_cache.dtype == torch.uint8 and v_cache.dtype == torch.uint8 and code_table is not None
        bf16 = k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16
        if ((k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32) and not quantized and not bf16
                or q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous()
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return False
        p = prefills
        args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), p.tables.data_ptr(),
                p.tables.shape[1], p.starts.data_ptr(), p.counts.data_ptr(), p.ctxs.data_ptr(), p.starts.numel(),
                out.data_ptr(), out.stride(0), num_heads, num_kv_heads, head_dim, block_size, scale)
        if bf16:
            return self._lib.kvs_paged_prefill_bf16(*args) == 0
        if not quantized:
            return self._lib.kvs_paged_prefill_f32(*args) == 0
        extra = _quantized_row_extra(k_cache, head_dim, code_table, int4_value_group)
        return self._lib.kvs_paged_prefill_quantized(*args, code_table.contiguous().data_ptr(), extra,
                                                     int4_value_group or 0) == 0

    def time_layer_stages(self, seconds: ctypes.Array | None) -> None:
        """From now on, add each stage's wall time in the fused layers (csrc/layer.c) to
        seconds[i] (a ctypes array of len(LAYER_STAGES) doubles, named by LAYER_STAGES), until called
        with None. The C side keeps one array for the process: one timer at a time, and the array must
        outlive its use."""
        if seconds is not None and len(seconds) != len(LAYER_STAGES):
            raise ValueError(f"seconds must hold {len(LAYER_STAGES)} doubles, not {len(seconds)}")
        self._lib.kvs_layers_time_stages(None if seconds is None else ctypes.addressof(seconds))

    def packed_numel(self, weight: torch.Tensor) -> int:
        """Elements of `weight` [N, K] once packed (what `pack` writes)."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
            raise ValueError(f"can only pack 2-D float32 or bfloat16 weights, not {weight.dtype} {tuple(weight.shape)}")
        return self._lib.kvs_packed_elems(*weight.shape, weight.element_size())

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> PackedWeight:
        """weight [N, K] (float32 or bfloat16) -> groups of `gemm_group` output columns, ready for `gemm`;
        into `out` (1-D, dense, of the weight's dtype and `packed_numel` elements) where given."""
        numel = self.packed_numel(weight)
        if out is None:
            out = torch.empty(numel, dtype=weight.dtype)
        elif out.dtype != weight.dtype or out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"pack: out must be a dense 1-D {weight.dtype} tensor of {numel} elements, "
                             f"not {out.dtype} {tuple(out.shape)}")
        w = weight.contiguous()
        n, k = w.shape
        self._lib.kvs_pack(w.data_ptr(), out.data_ptr(), n, k, w.element_size())
        return PackedWeight(out, n, k)

    def gemm(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
             to_float: bool = False) -> torch.Tensor:
        """x: [M, K] @ packed [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; with to_float, in float32
        holding those values (what `.float()` of the result gives; AMX tiles and bf16 dot products write
        them so at once)."""
        m, k = x.shape
        if k != weight.k:
            raise ValueError(f"x has {k} columns but the weight expects {weight.k}")
        # x and bf stay referenced across the call: C only gets their pointers
        bf = None if bias is None else bias.float().contiguous()
        bias_ptr = None if bf is None else bf.data_ptr()
        if (self.amx or self.bf16_dot) and weight.data.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
            # bf16 rows go to the tiles or the dot products as they are, not widened, and the kernel
            # rounds y to bf16 itself (for to_float leaving those values in float32): form 1 or 2
            xb = x.contiguous()
            y = torch.empty((m, weight.n), dtype=torch.float32 if to_float else torch.bfloat16)
            if m:
                form = 2 if to_float else 1
                if self.amx:
                    self._lib.kvs_amx_gemm(xb.data_ptr(), 1, weight.data.data_ptr(), bias_ptr, y.data_ptr(), form, m,
                                           weight.n, k)
                else:
                    self._lib.kvs_gemm_bf16x(xb.data_ptr(), k, weight.data.data_ptr(), bias_ptr, y.data_ptr(), form,
                                             m, weight.n, k)
            return y
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = torch.empty((m, weight.n), dtype=torch.float32)
        if m:
            fn = self._lib.kvs_gemm_bf16 if weight.data.dtype == torch.bfloat16 else self._lib.kvs_gemm_f32
            fn(xf.data_ptr(), weight.data.data_ptr(), bias_ptr, y.data_ptr(), m, weight.n, k)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.float() if to_float else y

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """torch.argmax(x, dim=-1) of float32 rows [N, V] (csrc/argmax.c): the first index of each row's
        largest value, as int64 [N]; None when a row holds a NaN (torch's rules for it are the caller's)."""
        x = _dense_f32(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError("argmax needs rows [N, V] with V >= 1")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if self._lib.kvs_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()):
            return None
        return out

    def sample(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """One sample from each float32 row of logits [N, V] (csrc/sample.c), as int64 [N]: the
        exponential race over the row's kept weights with noise from key[i], after temperature (<= 0:
        the row's first largest value), top_k (0: all), top_p and min_p; None when a row holds a NaN.
        temperature, top_p and min_p float32 [N], top_k int64 [N], key int64 [N] (53 bits)."""
        x = _dense_f32(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError("sample needs rows [N, V] with V >= 1")
        rows, vocab = x.shape
        args = [temperature.float(), top_k.long(), top_p.float(), min_p.float(), key.long()]
        if any(a.shape != (rows,) for a in args):
            raise ValueError(f"sample: every per-row setting needs shape ({rows},)")
        args = [a.contiguous() for a in args]
        need = self._lib.kvs_sample_scratch_bytes(vocab)  # a row's room per thread, not per row
        scratch = getattr(self._sample_scratch, "room", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._sample_scratch.room = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(rows, dtype=torch.int64)
        if self._lib.kvs_sample_f32(x.data_ptr(), rows, vocab, *(a.data_ptr() for a in args),
                                    scratch.data_ptr(), out.data_ptr()):
            return None
        return out

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                      signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """One layer's rotary embedding and K/V write (csrc/rope.c, csrc/bf16_ops.c): qkv [T, (H + 2 Hkv)
        * D] float32 or bfloat16, its queries and keys rotated in place; cos, signed_sin [T, D] (or [T,
        1, D]); caches [num_blocks, block_size, Hkv, D] of qkv's dtype get the rotated keys and the
        values at slot_mapping [T], which must be in range (the caller checks once per step, not per
        layer). bf16 rounds as HF's bf16 model does (see csrc/bf16_ops.c)."""
        tokens, head_dim, dtype = qkv.shape[0], k_cache.shape[-1], qkv.dtype
        if (dtype not in _LAYER_DTYPES or not qkv.is_contiguous()
                or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim):
            raise ValueError(f"qkv must be dense float32 or bfloat16 [T, {(num_heads + 2 * num_kv_heads) * head_dim}]")
        if head_dim % 2 or head_dim > 256 or k_cache.shape[-2] != num_kv_heads:
            raise ValueError(f"rope_write_kv needs an even head_dim up to 256 and {num_kv_heads} KV heads")
        for t in (k_cache, v_cache):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"rope_write_kv needs dense {dtype} K/V caches")
        cos, signed_sin = _dense(cos, dtype), _dense(signed_sin, dtype)
        if cos.numel() != tokens * head_dim or signed_sin.numel() != tokens * head_dim:
            raise ValueError(f"cos and sin must hold [{tokens}, {head_dim}] values")
        slots = _dense_int64(slot_mapping)
        if slots.numel() != tokens:
            raise ValueError(f"slot_mapping has {slots.numel()} entries for {tokens} tokens")
        fn = self._lib.kvs_rope_write_kv_f32 if dtype == torch.float32 else self._lib.kvs_rope_write_kv_bf16
        fn(qkv.data_ptr(), tokens, qkv.shape[1], num_heads, num_kv_heads, head_dim, cos.data_ptr(),
           signed_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """float32 or bfloat16 [T, 2I] (gate columns, then up) -> silu(gate) * up [T, I] of its dtype;
        bf16 rounded as HF's bf16 model rounds (csrc/bf16_ops.c), float32 within 2 ulps of the
        exact value (csrc/norm.c)."""
        dtype = torch.float32 if gate_up.dtype == torch.float32 else torch.bfloat16
        gate_up = _dense(gate_up, dtype)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError("silu_mul needs [T, 2I] rows")
        inter = gate_up.shape[1] // 2
        out = torch.empty((gate_up.shape[0], inter), dtype=dtype)
        fn = self._lib.kvs_silu_mul_f32 if dtype == torch.float32 else self._lib.kvs_silu_mul_bf16
        fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
        return out

    def gemm_silu(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """x [M, K] times a packed gate_up [2I, K] (the gate's I rows, then the up projection's) ->
        silu(gate) * up [M, I]: float32 x and weight, or bf16 both (bf16 out); the same bits as gemm and
        then silu_mul, the SiLU computed in the product's own pass where it can (csrc/gemm.c)."""
        m, k = x.shape
        if k != weight.k:
            raise ValueError(f"x has {k} columns but the weight expects {weight.k}")
        dtype = weight.data.dtype
        if dtype not in _LAYER_DTYPES or weight.n % 2 or x.dtype != dtype:
            raise ValueError("gemm_silu needs float32 or bf16 x and a packed gate_up of its dtype, 2I rows")
        inter = weight.n // 2
        if dtype == torch.bfloat16 and self.amx:  # the tiles: two calls
            return self.silu_mul(self.gemm(x, weight, None))
        xd = _dense(x, dtype)
        act = torch.empty((m, inter), dtype=dtype)
        if m:
            scratch = torch.empty((m, weight.n), dtype=dtype)  # untouched where the pass is one
            if dtype == torch.float32:
                self._lib.kvs_gemm_f32_silu(xd.data_ptr(), weight.data.data_ptr(), scratch.data_ptr(),
                                            act.data_ptr(), m, inter, k)
            else:
                self._lib.kvs_gemm_bf16x_silu(xd.data_ptr(), k, weight.data.data_ptr(), scratch.data_ptr(),
                                              act.data_ptr(), m, inter, k)
        return act

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, n] float32 or bfloat16, weight [n] of its dtype -> normalised and scaled copy (bf16
        rounded as HF's bf16 model rounds)."""
        x = _dense(x, x.dtype)
        weight = _dense(weight, x.dtype)
        out = torch.empty_like(x)
        fn = self._lib.kvs_rms_norm_f32 if x.dtype == torch.float32 else self._lib.kvs_rms_norm_bf16
        fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place (both [T, n] float32 or both bfloat16, residual dense); returns
        rms_norm(residual)."""
        if residual.dtype not in _LAYER_DTYPES or not residual.is_contiguous() or residual.shape != x.shape:
            raise ValueError("add_rms_norm needs a dense float32 or bfloat16 residual of x's shape")
        x = _dense(x, residual.dtype)
        weight = _dense(weight, residual.dtype)
        out = torch.empty_like(residual)
        fn = self._lib.kvs_add_rms_norm_f32 if x.dtype == torch.float32 else self._lib.kvs_add_rms_norm_bf16
        fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out


_LAYER_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes of the layer kernels (norms, RoPE)


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != dtype or dtype not in _LAYER_DTYPES:
        raise ValueError(f"expected {dtype} (float32 or bfloat16), got {t.dtype}")
    return t if t.is_contiguous() else t.contiguous()


def _dense_f32(t: torch.Tensor) -> torch.Tensor:
    return _dense(t, torch.float32)


@dataclass(frozen=True)
class PrefillArrays:
    """A step's prefill chunks for the C kernel: first row, new tokens, context (int64 [P] each),
    and block tables (int64 [P, W], rows padded with block 0)."""

    starts: torch.Tensor
    counts: torch.Tensor
    ctxs: torch.Tensor
    tables: torch.Tensor


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight in groups of CpuKernels.gemm_group columns (see csrc/gemm.c); `data` keeps its dtype."""

    data: torch.Tensor
    n: int
    k: int


def _quantized_row_extra(cache: torch.Tensor, head_dim: int, code_table: torch.Tensor | None,
                         int4_value_group: int | None) -> int:
    """Checks byte-code rows (uint8 [.., bs, Hkv, W]) against their table and head size; returns
    int4 rows' scale bytes E (W = D/2 + E), or 0 for one-byte codes (W = D + 2). ValueError otherwise."""
    if code_table is None or code_table.dtype != torch.float32 or code_table.numel() != 256:
        raise ValueError("byte-code K/V rows need a 256-entry float32 code table")
    block_size, width = cache.shape[-3], cache.shape[-1]
    if int4_value_group is None:
        if width != head_dim + 2:
            raise ValueError(f"byte-code rows hold head_dim + 2 bytes, got {width}")
        return 0
    extra = width - head_dim // 2
    if head_dim % 2 or extra <= 0 or head_dim % int4_value_group or 2 * head_dim > block_size * extra:
        raise ValueError(f"int4 rows of {width} bytes do not fit head_dim {head_dim}, "
                         f"block_size {block_size} and value group {int4_value_group}")
    return extra


def _dense_int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The compiled kernels, or None when they cannot be built here (the caller falls back to torch)."""
    if os.environ.get("KVSTRATA_CPU_KERNELS", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found; paged attention runs in plain torch")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(build(compiler))))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("could not build the CPU kernels (%s); paged attention runs in plain torch", detail)
        return None
