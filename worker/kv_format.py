"""How K and V are stored in the paged cache: full precision, or quantized with scales in the block.

Every format keeps the pool's layout `[L, 2, num_blocks, block_size, Hkv, row_width]`, so a block is
still one index along dim 2 (prefix sharing, copy-on-write, the DRAM and NVMe tiers and tensor
parallelism move blocks without knowing the format). A quantized row holds one token's codes for
one head followed by that row's share of the scales:

    int8, fp8:  [ D codes (1 byte each) | fp16 scale ]                     one scale per token per head
    int4:       [ D/2 bytes (two codes each) | E bytes of scales ]
                  V: the E bytes are fp16 scales, one per group of `v_group` channels of this token
                  K: the E bytes of the block's rows, taken together, are the block's fp16 scale
                     per channel (row t holds channels t*E/2 .. t*E/2 + E/2 - 1)

Keys have outlier channels, so int4 keys share a scale per channel over the tokens of a block; a
write that raises a channel's range re-quantizes that block's earlier codes to the new scale.
Values are scaled per token. Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES, int4_row_extra_bytes, int4_value_group

# fp8 codes and the value a row's largest magnitude maps to. e5m2 could reach 57344, but its precision
# is the same anywhere in its normal range, and 448 keeps every fp16 scale a normal number.
_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 448.0)}
_PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CacheSpec:
    row_width: int  # last dimension of the pool
    dtype: torch.dtype  # element type of the pool


class KVFormat(ABC):
    """One storage format, bound to a head size, block size and the model's compute dtype."""

    name: str

    def __init__(self, head_dim: int, block_size: int, compute_dtype: torch.dtype):
        self.head_dim = head_dim
        self.block_size = block_size
        self.compute_dtype = compute_dtype

    @abstractmethod
    def spec(self) -> CacheSpec: ...

    @abstractmethod
    def write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, key: bool) -> None:
        """cache: one layer's K or V [N, bs, Hkv, W]; x: [T, Hkv, D]; slots [T] long."""

    @abstractmethod
    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, key: bool) -> torch.Tensor:
        """Whole blocks, dequantized: [n] block ids -> [n * bs, Hkv, D] in the compute dtype."""

    @property
    def is_plain(self) -> bool:
        """Stored as plain floats: attention may read the pool directly."""
        return False

    @property
    def kernel_readable(self) -> bool:
        """The C decode kernel reads this pool in place: fp32 or bf16 rows, or one-byte codes."""
        return self.code_table is not None

    @property
    def code_table(self) -> torch.Tensor | None:
        """For one-byte codes with a row scale: each code's value [256] float32 (the C decode kernel
        reads such rows in place); None for other formats."""
        return None

    def bytes_per_token_head(self) -> int:
        """Bytes of one token's K (or V) for one head, scales included."""
        spec = self.spec()
        return spec.row_width * torch.empty((), dtype=spec.dtype).element_size()

    def move_slots(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy token slots src[i] -> dst[i] in every layer of the pool (reads all before writing).
        A row that carries its own scales moves as bytes, exactly."""
        flat = kv_cache.view(kv_cache.shape[0], 2, -1, *kv_cache.shape[4:])
        flat[:, :, dst] = flat[:, :, src]


class PlainFormat(KVFormat):
    """Floats, in the model's dtype ("auto") or another float dtype (converted on write and read)."""

    def __init__(self, head_dim: int, block_size: int, compute_dtype: torch.dtype, dtype: torch.dtype):
        super().__init__(head_dim, block_size, compute_dtype)
        self.dtype = dtype

    def spec(self) -> CacheSpec:
        return CacheSpec(self.head_dim, self.dtype)

    @property
    def is_plain(self) -> bool:
        return self.dtype == self.compute_dtype

    @property
    def kernel_readable(self) -> bool:
        return self.dtype in (torch.float32, torch.bfloat16)

    def write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, key: bool) -> None:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(self.dtype))

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, key: bool) -> torch.Tensor:
        # index_select copies whole blocks; advanced indexing (cache[ids]) is several times slower on CPU
        return cache.index_select(0, block_ids).flatten(0, 1).to(self.compute_dtype)


class ScaledRowFormat(KVFormat):
    """int8 and fp8: one byte per value and one fp16 scale per token per head, at the end of the row."""

    def __init__(self, head_dim: int, block_size: int, compute_dtype: torch.dtype, name: str):
        super().__init__(head_dim, block_size, compute_dtype)
        self.name = name
        self.fp8, self.max_code = _FP8[name] if name in _FP8 else (None, 127.0)
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        self._table = (codes.view(torch.int8) if self.fp8 is None else codes.view(self.fp8)).float()

    def spec(self) -> CacheSpec:
        return CacheSpec(self.head_dim + 2, torch.uint8)

    @property
    def code_table(self) -> torch.Tensor:
        return self._table

    def write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, key: bool) -> None:
        xf = x.float()  # [T, Hkv, D]
        scale = (xf.abs().amax(-1, keepdim=True) / self.max_code).half()  # [T, Hkv, 1]
        inv = _inverse(scale.float())
        if self.fp8 is None:
            codes = (xf * inv).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            codes = (xf * inv).clamp_(-self.max_code, self.max_code).to(self.fp8).view(torch.uint8)
        rows = torch.cat([codes, scale.view(torch.uint8)], dim=-1)  # [T, Hkv, D + 2]
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, key: bool) -> torch.Tensor:
        d = self.head_dim
        rows = cache.index_select(0, block_ids).flatten(0, 1)  # [n * bs, Hkv, D + 2]
        scale = rows[..., d:].contiguous().view(torch.float16).float()  # [n * bs, Hkv, 1]
        codes = rows[..., :d]
        values = codes.view(torch.int8).float() if self.fp8 is None else codes.contiguous().view(self.fp8).float()
        return (values * scale).to(self.compute_dtype)


class Int4Format(KVFormat):
    """Two 4-bit codes per byte. Keys: asymmetric (min + code * step, codes 0..15) per channel over the
    tokens of a block. Values: symmetric (codes -8..7) per group of channels of each token. See the
    module docstring for the row layout."""

    name = "int4"

    def __init__(self, head_dim: int, block_size: int, compute_dtype: torch.dtype):
        super().__init__(head_dim, block_size, compute_dtype)
        if head_dim % 2:
            raise ValueError(f"kv_dtype int4 needs an even head_dim, got {head_dim}")
        self.v_group = int4_value_group(head_dim)
        self.extra = int4_row_extra_bytes(head_dim, block_size)

    def spec(self) -> CacheSpec:
        return CacheSpec(self.head_dim // 2 + self.extra, torch.uint8)

    def move_slots(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Keys share their block's scales, so moved tokens are dequantized and written again."""
        bs = self.block_size
        src_blocks, inverse = torch.unique(src // bs, return_inverse=True)
        rows = inverse * bs + src % bs
        for layer in range(kv_cache.shape[0]):
            for kv in (0, 1):
                cache = kv_cache[layer, kv]
                x = self.read(cache, src_blocks, key=kv == 0)[rows]  # [len(src), Hkv, D]
                self.write(cache, x, dst, key=kv == 0)

    def write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, key: bool) -> None:
        if key:
            self._write_keys(cache, x, slots)
        else:
            self._write_values(cache, x, slots)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, key: bool) -> torch.Tensor:
        blocks = cache.index_select(0, block_ids)  # [n, bs, Hkv, W]
        codes = _unpack(blocks[..., : self.head_dim // 2])  # [n, bs, Hkv, D], 0..15
        if key:
            step, low = self._key_params(blocks)  # [n, Hkv, D] each
            values = torch.addcmul(low[:, None], codes, step[:, None])
        else:
            values = (codes - 8) * self._value_scales(blocks)
        return values.flatten(0, 1).to(self.compute_dtype)

    def _value_scales(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., W] -> per-channel scales [..., D] (each group's scale repeated)."""
        groups = self.head_dim // self.v_group
        half = self.head_dim // 2
        scale = rows[..., half : half + 2 * groups].contiguous().view(torch.float16).float()
        return scale.repeat_interleave(self.v_group, dim=-1)

    def _write_values(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        t, hkv, d = x.shape
        xf = x.float().view(t, hkv, d // self.v_group, self.v_group)
        scale = (xf.abs().amax(-1, keepdim=True) / 7).half()  # [T, Hkv, G, 1]
        codes = (xf * _inverse(scale.float())).round_().clamp_(-8, 7).view(t, hkv, d) + 8
        rows = torch.zeros((t, hkv, cache.shape[-1]), dtype=torch.uint8, device=x.device)
        rows[..., : d // 2] = _pack(codes)
        rows[..., d // 2 : d // 2 + scale.numel() // (t * hkv) * 2] = scale.view(t, hkv, -1).view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)

    def _key_params(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [n, bs, Hkv, W] -> each block's per-channel key step and minimum, [n, Hkv, D] each."""
        n, bs, hkv, _ = blocks.shape
        d = self.head_dim
        extra = blocks[..., d // 2 :].permute(0, 2, 1, 3).contiguous()  # [n, Hkv, bs, E]
        params = extra.view(n, hkv, bs * self.extra).view(torch.float16)[..., : 2 * d].float()
        return params[..., :d], params[..., d:]

    def _write_keys(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        bs, d = self.block_size, self.head_dim
        blocks, inverse = torch.unique(slots // bs, return_inverse=True)  # U touched blocks
        offsets = slots % bs
        old = cache.index_select(0, blocks)  # [U, bs, Hkv, W]
        old_step, old_low = self._key_params(old)  # [U, Hkv, D]
        old_high = old_low + 15 * old_step
        # a write at offset 0 starts a block: whatever its rows held belongs to an earlier owner
        fresh = torch.zeros(len(blocks), dtype=torch.bool, device=x.device)
        fresh[inverse[offsets == 0]] = True
        old_low[fresh] = float("inf")
        old_high[fresh] = float("-inf")
        xf = x.float()
        index = inverse[:, None, None].expand(x.shape)
        low = old_low.scatter_reduce(0, index, xf, "amin").half().float()  # the range only ever widens
        high = old_high.scatter_reduce(0, index, xf, "amax")
        step = ((high - low) / 15).half().float()
        inv = _inverse(step)
        # re-quantize what the blocks hold to the (possibly wider) range, then add the new tokens
        held = torch.addcmul(old_low[:, None], _unpack(old[..., : d // 2]), old_step[:, None])
        held[fresh] = 0
        codes = ((held - low[:, None]) * inv[:, None]).round_().clamp_(0, 15)
        codes[inverse, offsets] = ((xf - low[inverse]) * inv[inverse]).round_().clamp_(0, 15)
        new = torch.empty_like(old)
        new[..., : d // 2] = _pack(codes)
        u, _, hkv, _ = old.shape
        params = torch.zeros((u, hkv, bs * self.extra // 2), dtype=torch.float16, device=x.device)
        params[..., :d] = step.half()
        params[..., d : 2 * d] = low.half()
        new[..., d // 2 :] = params.view(torch.uint8).view(u, hkv, bs, self.extra).permute(0, 2, 1, 3)
        cache.index_copy_(0, blocks, new)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 where the scale is 0 (an all-zero group quantizes to zeros)."""
    return torch.where(scale > 0, 1.0 / scale.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(scale))


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., D] (float) -> bytes [..., D/2]: channel 2j in the low nibble, 2j+1 in the high."""
    u = codes.to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., D/2] -> codes 0..15 [..., D] as float32."""
    lo = (packed & 0xF).float()
    hi = (packed >> 4).float()
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def make_kv_format(kv_dtype: str, head_dim: int, block_size: int, compute_dtype: torch.dtype) -> KVFormat:
    """The format for `kv_dtype` ("auto" = the model's dtype); ValueError names the field."""
    if kv_dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}; got {kv_dtype!r}")
    if kv_dtype == "auto":
        fmt: KVFormat = PlainFormat(head_dim, block_size, compute_dtype, compute_dtype)
    elif kv_dtype in _PLAIN:
        fmt = PlainFormat(head_dim, block_size, compute_dtype, _PLAIN[kv_dtype])
    elif kv_dtype == "int4":
        fmt = Int4Format(head_dim, block_size, compute_dtype)
    else:
        fmt = ScaledRowFormat(head_dim, block_size, compute_dtype, kv_dtype)
    fmt.name = kv_dtype
    return fmt
