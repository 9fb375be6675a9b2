"""The block and byte kernels the KV tiers use (CpuKernels inherits them): block copies between the
device pool and the DRAM tier in one pass, and CRC-32s, copies with them, and NVMe slots staged
for their writes, all in C without the GIL (csrc/block_copy.c, csrc/crc32.c).
"""

from __future__ import annotations

import ctypes
import functools

import torch


def _check_dense_cpu(t: torch.Tensor, what: str) -> None:
    if t.is_cuda or not t.is_contiguous():
        raise ValueError(f"{what} needs a dense CPU tensor")


class BlockKernels:
    """For a class that has the kernels' `_lib` (CpuKernels)."""

    def copy_blocks(self, src: torch.Tensor, src_dim: int, src_ids: list[int], dst: torch.Tensor, dst_dim: int,
                    dst_ids: list[int], streaming: bool = False) -> None:
        """Block dst_ids[i] of dst = block src_ids[i] of src, for every i, in one pass.

        Both are dense CPU tensors of one dtype; `*_dim` is the block dimension. Without it the two
        shapes must be equal. The dimensions before a non-zero block dimension (layers, K/V) are
        segments, the rest one piece: the pool [L, 2, N, B, H, D] (dim 2) and the block-major DRAM
        tier [N, L, 2, B, H, D] (dim 0) hold the same blocks. streaming: the destination is written
        past the caches (csrc/block_copy.c), for blocks that will not be read soon.

        A demotion of one block moves 0.7 MB (SmolLM2, float32) in about 40 us, so the call itself
        is kept short: the geometry of a pair of layouts is worked out once, and the ids go to C as
        ctypes arrays (two torch tensors cost about 5 us more)."""
        n = len(src_ids)
        if n != len(dst_ids):
            raise ValueError("copy_blocks needs as many destination blocks as source blocks")
        if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype or src.is_cuda or dst.is_cuda:
            raise ValueError("copy_blocks needs dense CPU tensors of one dtype")
        segments, piece_bytes, s_seg, s_block, d_seg, d_block = _block_geometry(
            tuple(src.shape), src_dim, tuple(dst.shape), dst_dim, src.element_size())
        if not n:
            return
        for ids, t, dim, name in ((src_ids, src, src_dim, "source"), (dst_ids, dst, dst_dim, "destination")):
            if min(ids) < 0 or max(ids) >= t.shape[dim]:
                raise ValueError(f"copy_blocks: a {name} block id is outside 0..{t.shape[dim] - 1}")
        ids_type = ctypes.c_int64 * n
        self._lib.kvs_copy_blocks(src.data_ptr(), dst.data_ptr(), ids_type(*src_ids), ids_type(*dst_ids), n,
                                  segments, piece_bytes, s_seg, s_block, d_seg, d_block, int(streaming))

    def crc32(self, data: torch.Tensor, init: int = 0) -> int:
        """zlib.crc32 of a dense CPU tensor's bytes (csrc/crc32.c), without the GIL."""
        _check_dense_cpu(data, "crc32")
        return self._lib.kvs_crc32(init, data.data_ptr(), data.numel() * data.element_size())

    def copy_crc32(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Copy src's bytes into dst (dense CPU tensors of the same byte size, not overlapping) in
        one pass that also computes their zlib.crc32, which it returns."""
        _check_dense_cpu(src, "copy_crc32")
        _check_dense_cpu(dst, "copy_crc32")
        n = src.numel() * src.element_size()
        if dst.numel() * dst.element_size() != n:
            raise ValueError(f"copy_crc32: {n} source bytes into {dst.numel() * dst.element_size()}")
        return self._lib.kvs_copy_crc32(0, src.data_ptr(), dst.data_ptr(), n)

    def stage_slot(self, slot: torch.Tensor, head: bytes, header_len: int, src: torch.Tensor) -> int:
        """An NVMe slot [slot_bytes] (uint8) staged in one pass without the GIL (csrc/crc32.c): the
        packed head, the payload (src's bytes, copied right after the head) and zeros to the end;
        the payload's CRC-32 and then the header's own are written into the header, whose last 16
        bytes are payload CRC, sequence number and header CRC. Returns the payload CRC."""
        _check_dense_cpu(slot, "stage_slot")
        _check_dense_cpu(src, "stage_slot")
        n, p = src.numel() * src.element_size(), len(head)
        if slot.dtype != torch.uint8 or not 16 <= header_len <= p or p + n > slot.numel():
            raise ValueError(f"stage_slot: a head of {p} bytes (header {header_len}) and {n} payload bytes "
                             f"do not fit a slot of {slot.numel()}")
        return self._lib.kvs_stage_slot(slot.data_ptr(), slot.numel(), head, p, header_len, src.data_ptr(), n)


@functools.lru_cache(maxsize=64)
def _block_geometry(src_shape: tuple[int, ...], src_dim: int, dst_shape: tuple[int, ...], dst_dim: int,
                    elt: int) -> tuple[int, int, int, int, int, int]:
    """copy_blocks' view of two dense layouts: (segments, piece bytes, source segment and block
    strides, destination segment and block strides), strides in bytes; ValueError where the two
    do not hold the same blocks, or the block dimension sits where copy_blocks cannot walk it."""
    rest = [d for i, d in enumerate(src_shape) if i != src_dim]
    if rest != [d for i, d in enumerate(dst_shape) if i != dst_dim]:
        raise ValueError("copy_blocks: the two layouts hold different blocks")
    k = max(src_dim, dst_dim)
    if src_dim not in (0, k) or dst_dim not in (0, k):
        raise ValueError("copy_blocks: the block dimension must come first or after the segments")
    segments = piece_bytes = 1
    for d in rest[:k]:
        segments *= d
    for d in rest[k:]:
        piece_bytes *= d
    piece_bytes *= elt

    def strides(shape: tuple[int, ...], dim: int) -> tuple[int, int]:  # (segment, block), of a dense layout
        block = elt
        for d in shape[dim + 1:]:
            block *= d
        return (block * shape[dim] if dim else piece_bytes), block

    return (segments, piece_bytes, *strides(src_shape, src_dim), *strides(dst_shape, dst_dim))
