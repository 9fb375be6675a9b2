"""Whole KV blocks between the device pool and a DRAM tier's slots, many blocks per copy."""

from __future__ import annotations

import torch


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """One block of a [L, 2, N, B, H, D] cache, block-major: (L, 2, B, H, D)."""
    num_layers, two, _, block_size, heads, head_dim = kv_cache.shape
    return (num_layers, two, block_size, heads, head_dim)


def copy_to_host(kv_cache: torch.Tensor, block_ids: list[int], storage: torch.Tensor, slots: list[int],
                 kernels=None) -> None:
    """Pool blocks [L, 2, N, B, H, D] (dim 2) into DRAM slots [S, L, 2, B, H, D] (dim 0): with the
    CPU kernel, one copy per piece, written past the caches (nothing reads a demoted or swapped-out
    block soon); otherwise a gather, then one copy (to pinned memory, on CUDA)."""
    if not block_ids:
        return
    if kernels is not None:
        kernels.copy_blocks(kv_cache, 2, block_ids, storage, 0, slots, streaming=True)
        return
    data = kv_cache.index_select(2, torch.tensor(block_ids, device=kv_cache.device)).permute(2, 0, 1, 3, 4, 5)
    storage.index_copy_(0, torch.tensor(slots), data.to(storage.device))


def copy_to_device(storage: torch.Tensor, slots: list[int], kv_cache: torch.Tensor, block_ids: list[int],
                   kernels=None) -> None:
    """DRAM slots back into pool blocks: the inverse of copy_to_host, also written past the caches
    with the CPU kernel (the next step reads them a layer at a time, long after the copy)."""
    if not block_ids:
        return
    if kernels is not None:
        kernels.copy_blocks(storage, 0, slots, kv_cache, 2, block_ids, streaming=True)
        return
    data = storage.index_select(0, torch.tensor(slots))
    dev = kv_cache.device
    kv_cache.index_copy_(2, torch.tensor(block_ids, device=dev), data.permute(1, 2, 0, 3, 4, 5).to(dev))


def copy_blocks_into(storage: torch.Tensor, slots: list[int], blocks: list[torch.Tensor]) -> None:
    """Separate blocks (each [*block_shape], as NVMe reads return them) into DRAM slots [S, ...],
    one copy each: stacking them first would allocate, and fault in, as much memory again."""
    for slot, block in zip(slots, blocks):
        storage[slot].copy_(block)
