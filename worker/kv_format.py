"""How K and V are stored in the paged cache: full precision, or quantized with scales in the block.

Every format keeps the pool's layout `[L, 2, num_blocks, block_size, Hkv, row_width]`, so a block is
still one index along dim 2 (prefix sharing, copy-on-write, the DRAM and NVMe tiers and tensor
parallelism move blocks without knowing the format). A quantized row holds one token's codes for
one head followed by that row's share of the scales:

    int8, fp8:  [ D codes (1 byte each) | fp16 scale ]                     one scale per token per head
    int4:       [ D/2 bytes (two codes each) | E bytes of scales ]         E = max(ceil(2D/bs), ceil(D/16))
                  V: one-byte scales, one per group of `v_group` channels of this token (D/E or more)
                  K: the E bytes of the block's rows, taken together, are the block's parameters,
                     2D bytes: a one-byte step per channel, then a one-byte zero point per channel

                     params:  [ step 0 .. step D-1 | zero 0 .. zero D-1 | padding ]
                     row t:              bytes t*E .. t*E + E - 1

Keys have outlier channels, so int4 keys share a step and zero point per channel over the tokens of
a block; a write that widens a channel's range re-fits it and re-quantizes the block's earlier
codes. Values are scaled per token. At D = 64 and blocks of 16, E = 8 (a row of 40 bytes, 0.3125x
of 16-bit); from blocks of 32, E = 4 (36 bytes, 0.28x). Everything here is plain torch and runs on any device.
"""

from __future__ import annotations

import functools
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
        """The C decode kernel reads this pool in place: fp32 or bf16 rows, one-byte codes, or int4."""
        return self.code_table is not None

    @property
    def code_table(self) -> torch.Tensor | None:
        """For one-byte codes with a row scale: each code's value [256] float32; for int4, each
        scale byte's step. The C decode kernel reads such rows in place. None for other formats."""
        return None

    @property
    def int4_value_group(self) -> int | None:
        """Channels per int4 value scale, for the C decode kernel; None for other formats."""
        return None

    # the runner's CpuKernels: the quantized formats write a CPU pool through them (csrc/kv_write.c,
    # the same bytes as their torch code, which stays the reference and serves other devices)
    kernels = None

    def use_kernels(self, kernels) -> None:
        self.kernels = kernels

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
        if self.kernels is not None and cache.device.type == "cpu":
            return self.kernels.codes_write(cache, x, slots, self.name, self.max_code)
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
    """Two 4-bit codes per byte. Keys: asymmetric, step * (code - zero point) with codes 0..15, per
    channel over the tokens of a block. Values: symmetric, scale * code with codes -8..7, per group
    of channels of each token. Steps and scales are one-byte log codes (`_decode_step`), zero points
    one signed byte in half steps. See the module docstring for the row layout."""

    name = "int4"

    def __init__(self, head_dim: int, block_size: int, compute_dtype: torch.dtype):
        super().__init__(head_dim, block_size, compute_dtype)
        if head_dim % 2:
            raise ValueError(f"kv_dtype int4 needs an even head_dim, got {head_dim}")
        self.v_group = int4_value_group(head_dim, block_size)
        self.extra = int4_row_extra_bytes(head_dim, block_size)

    def use_kernels(self, kernels) -> None:
        self.kernels = kernels if self.head_dim <= 256 else None  # the C write's row buffers

    def spec(self) -> CacheSpec:
        return CacheSpec(self.head_dim // 2 + self.extra, torch.uint8)

    @property
    def code_table(self) -> torch.Tensor:
        return _STEP_TABLE

    @property
    def int4_value_group(self) -> int:
        return self.v_group

    def move_slots(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Values carry their scales in their own row and move as bytes. Keys share their block's
        parameters, so moved keys are dequantized and written into the receiving blocks, which keep
        the tokens they hold: compaction fills holes of blocks that hold survivors, at offset 0 too."""
        bs = self.block_size
        src_blocks, inverse = torch.unique(src // bs, return_inverse=True)
        rows = inverse * bs + src % bs
        values = kv_cache[:, 1].view(kv_cache.shape[0], -1, *kv_cache.shape[4:])  # [L, N * bs, Hkv, W]
        values[:, dst] = values[:, src]
        for layer in range(kv_cache.shape[0]):
            cache = kv_cache[layer, 0]
            x = self.read(cache, src_blocks, key=True)[rows]  # [len(src), Hkv, D]
            self._write_keys(cache, x, dst, starts_blocks=False)

    def write(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, key: bool) -> None:
        if key:
            self._write_keys(cache, x, slots, starts_blocks=True)
        else:
            self._write_values(cache, x, slots)

    def read(self, cache: torch.Tensor, block_ids: torch.Tensor, key: bool) -> torch.Tensor:
        blocks = cache.index_select(0, block_ids)  # [n, bs, Hkv, W]
        codes = _unpack(blocks[..., : self.head_dim // 2])  # [n, bs, Hkv, D], 0..15
        if key:
            step, zero = self._key_params(blocks)  # [n, Hkv, D] each
            values = (codes - zero[:, None]) * step[:, None]
        else:
            values = (codes - 8) * self._value_scales(blocks)
        return values.flatten(0, 1).to(self.compute_dtype)

    def _value_scales(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., W] -> per-channel scales [..., D] (each group's scale repeated)."""
        half = self.head_dim // 2
        scale = _decode_step(rows[..., half : half + self.head_dim // self.v_group])  # [..., D / group]
        return scale.repeat_interleave(self.v_group, dim=-1)

    def _write_values(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        if self.kernels is not None and cache.device.type == "cpu":
            return self.kernels.int4_write(cache, x, slots, _STEP_TABLE, False, self.v_group)
        t, hkv, d = x.shape
        xf = x.float().view(t, hkv, d // self.v_group, self.v_group)
        # codes -8..7 reach from -8.5 to 7.5 scales within half a step; the scale code rounds up
        code = _encode_step(torch.maximum(xf.amax(-1) / 7.5, xf.amin(-1) / -8.5))  # [T, Hkv, D / group]
        codes = (xf / _decode_step(code)[..., None]).round_().clamp_(-8, 7).view(t, hkv, d) + 8
        rows = torch.zeros((t, hkv, cache.shape[-1]), dtype=torch.uint8, device=x.device)
        rows[..., : d // 2] = _pack(codes)
        rows[..., d // 2 : d // 2 + code.shape[-1]] = code
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)

    def _key_param_bytes(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [n, bs, Hkv, W] -> [n, Hkv, 2D]: the block's D step codes, then its D zero points."""
        n, bs, hkv, _ = blocks.shape
        extra = blocks[..., self.head_dim // 2 :].permute(0, 2, 1, 3)  # [n, Hkv, bs, E]
        return extra.reshape(n, hkv, bs * self.extra)[..., : 2 * self.head_dim]

    def _key_params(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [n, bs, Hkv, W] -> each block's per-channel key step and zero point (in codes),
        [n, Hkv, D] float each."""
        d = self.head_dim
        params = self._key_param_bytes(blocks)
        return _decode_step(params[..., :d]), _decode_zero(params[..., d:])

    def _write_keys(self, cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, starts_blocks: bool) -> None:
        """starts_blocks: a write at offset 0 starts a fresh block (the engine's writes); without it,
        the written blocks keep the tokens they hold (moves)."""
        if self.kernels is not None and cache.device.type == "cpu":
            return self.kernels.int4_write(cache, x, slots, _STEP_TABLE, True, self.v_group, starts_blocks)
        bs, d = self.block_size, self.head_dim
        blocks, inverse = torch.unique(slots // bs, return_inverse=True)  # U touched blocks
        offsets = slots % bs
        old = cache.index_select(0, blocks)  # [U, bs, Hkv, W]
        old_params = self._key_param_bytes(old)  # [U, Hkv, 2D]
        step, zero = _decode_step(old_params[..., :d]), _decode_zero(old_params[..., d:])  # [U, Hkv, D]
        held = (_unpack(old[..., : d // 2]) - zero[:, None]) * step[:, None]  # [U, bs, Hkv, D]
        xf = x.float()
        fresh = torch.zeros(len(blocks), dtype=torch.bool, device=x.device)
        if starts_blocks:
            # A fresh block's rows belong to an earlier owner: they take the value of one of the new
            # tokens, so that every row of a block holds one of its own tokens and the rows' range is
            # the block's range (later writes and moves re-fit to it, never to stale bytes).
            fresh[inverse[offsets == 0]] = True
            num = torch.full((len(blocks),), len(slots), device=x.device)
            first = num.scatter_reduce(0, inverse, torch.arange(len(slots), device=x.device), "amin")
            held = torch.where(fresh[:, None, None, None], xf[first][:, None], held)
        held[inverse, offsets] = xf
        low, high = held.amin(1), held.amax(1)  # [U, Hkv, D]
        # A channel keeps its parameters, and so its earlier codes exactly, while its values are within
        # half a step of its grid; otherwise it is re-fitted and its earlier codes re-quantized.
        keep = ~fresh[:, None, None] & (low >= (-0.5 - zero) * step) & (high <= (15.5 - zero) * step)
        new_step, new_zero = _fit_key_params(low, high)
        params = torch.where(keep.repeat(1, 1, 2), old_params, torch.cat([new_step, _encode_zero(new_zero)], -1))
        step, zero = _decode_step(params[..., :d]), _decode_zero(params[..., d:])
        codes = (held / step[:, None] + zero[:, None]).round_().clamp_(0, 15)
        new = torch.empty_like(old)
        new[..., : d // 2] = _pack(codes)
        u, _, hkv, _ = old.shape
        extra = torch.zeros((u, hkv, bs * self.extra), dtype=torch.uint8, device=x.device)
        extra[..., : 2 * d] = params
        new[..., d // 2 :] = extra.view(u, hkv, bs, self.extra).permute(0, 2, 1, 3)
        cache.index_copy_(0, blocks, new)


# Steps and scales in one byte: step = 2^((code - 168) / 12), from 2^-14 to 2^7.25 (152) in steps of 6%.
# Twelve codes an octave measured best: 8 gave +2.50% perplexity at 2,048 tokens, 12 gave +0.82%.
_LOG_PER_OCTAVE = 12.0
_LOG_BIAS = 168.0
# Key zero points in half steps: a signed byte reaches 64 steps either side of 0.
_ZERO_UNITS = 2.0
_KEY_STEP_CANDIDATES = 3


# Each step code's step, increasing. Both directions go through this one table (here, in the C
# kernels, on any device), so that every path agrees to the bit.
_STEP_TABLE = torch.exp2((torch.arange(256, dtype=torch.float32) - _LOG_BIAS) / _LOG_PER_OCTAVE)


@functools.cache
def _step_table(device: torch.device) -> torch.Tensor:
    return _STEP_TABLE.to(device)


def _decode_step(code: torch.Tensor) -> torch.Tensor:
    """Step codes (uint8, or long) -> steps (float32)."""
    return _step_table(code.device)[code.long()]


def _encode_step(step: torch.Tensor) -> torch.Tensor:
    """The smallest code whose step is >= `step` (float32, >= 0; 255 at most), as uint8."""
    return torch.searchsorted(_step_table(step.device), step.contiguous()).clamp_(max=255).to(torch.uint8)


def _decode_zero(stored: torch.Tensor) -> torch.Tensor:
    """Zero-point bytes (int8 in half steps, stored as uint8) -> zero points in codes (float32)."""
    return stored.view(torch.int8).float() / _ZERO_UNITS


def _encode_zero(zero: torch.Tensor) -> torch.Tensor:
    """Zero points in codes, multiples of 1/_ZERO_UNITS within int8 reach -> bytes (uint8)."""
    return (zero * _ZERO_UNITS).round().to(torch.int8).view(torch.uint8)


def _fit_key_params(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's range [...] -> its step code (uint8) and zero point (float32 codes, in halves).

    The keys at a channel's ends give the largest and smallest q.k, which attention singles out, so
    the fit prefers a step that puts both ends near grid points. Each of the few smallest steps that
    cover the range puts n = round(range / step) <= 15 steps between the ends, centred in the 16
    codes (which leaves room to widen); the fit takes the one with the least error at the ends plus
    a quarter step (the mean error of the values in between). A channel far from 0 needs a wider step
    so that its zero point fits in a signed byte: at most 64 steps below 0 and 79 above.

        codes:  0   1   2   3   ...   12  13  14  15        n = 12: low at code (15 - 12) // 2 = 1
                    ^low                  ^high
    """
    reach_up, reach_down = 15.5 + 128 / _ZERO_UNITS, 127 / _ZERO_UNITS + 0.5
    need = torch.maximum((high - low) / 15, torch.maximum(high / reach_up, low / -reach_down))
    candidates = torch.arange(_KEY_STEP_CANDIDATES, device=low.device)
    code = (_encode_step(need).long()[..., None] + candidates).clamp_(max=255)  # [..., J]
    step = _decode_step(code)
    low, high = low[..., None], high[..., None]
    ratio = (high - low) / step
    n = ratio.round().clamp(max=15)
    first = ((15 - n) / 2).floor()  # the code at `low`
    zero = ((first - low / step - (ratio - n) / 2) * _ZERO_UNITS).round().clamp(-128, 127) / _ZERO_UNITS
    cost = torch.maximum(_grid_error(low, step, zero), _grid_error(high, step, zero)) + step / 4
    pick = cost.argmin(-1, keepdim=True)  # the first minimum: the smaller step on a tie
    return code.gather(-1, pick).squeeze(-1).to(torch.uint8), zero.gather(-1, pick).squeeze(-1)


def _grid_error(x: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """|x - its int4 key value| for codes 0..15 on the grid step * (code - zero)."""
    code = (x / step + zero).round().clamp(0, 15)
    return ((code - zero) * step - x).abs()


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
