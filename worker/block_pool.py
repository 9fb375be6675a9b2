"""The block pool: ids, ref counts, the free list and the prefix cache of one KV tier.

Every block is in exactly one of three states:

    free    ref_count == 0, not cached      -> in the free deque (O(1) allocate and free)
    cached  ref_count == 0, cached          -> reusable on a prefix hit, evictable leaf first
    in use  ref_count  > 0 (maybe cached)   -> owned by one or more requests

and free + cached + in use == total at all times (`check_integrity`). The pool holds no tensors:
block ids index the KV tensors owned by the KV cache, so the same pool logic serves every tier.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from kvstrata.worker.prefix_cache import EvictedBlock, KVBlock, PrefixCache

# called with the cached blocks an allocation is about to reuse, leaf first
EvictHook = Callable[[list[EvictedBlock]], None]


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.prefix_cache = PrefixCache()
        self.num_cached_unused = 0  # cached blocks with ref_count == 0
        self.num_evictions = 0
        self._tick = 0
        # called with the cached blocks an allocation reuses, before anyone can write to them,
        # so a lower tier can keep their data
        self.on_evict: EvictHook | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached."""
        return len(self.free_ids) + self.num_cached_unused

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids) - self.num_cached_unused

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def get_cached(self, block_hashes: list[bytes]) -> list[KVBlock]:
        return self.prefix_cache.match(block_hashes)

    # -- lifecycle -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Fresh, uncached blocks with ref_count 1; evicts LRU cached leaves when the free list is empty."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        out = []
        evicted: list[EvictedBlock] = []
        for _ in range(num_blocks):
            if self.free_ids:
                block = self.blocks[self.free_ids.popleft()]
            else:
                block = self._evict_one(evicted if self.on_evict is not None else None)
            block.ref_count = 1
            block.last_access = self._next_tick()
            out.append(block)
        if evicted:
            self.on_evict(evicted)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (a hit)."""
        for block in blocks:
            if block.ref_count == 0:
                assert block.is_cached, f"block {block.block_id}: touching a free block"
                self.num_cached_unused -= 1
            block.ref_count += 1
            block.last_access = self._next_tick()

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a request's blocks tail first, so that of a released chain the tail gets the
        oldest access time and is evicted first.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id}: ref count would go negative"
            block.ref_count -= 1
            if block.ref_count:
                continue
            block.last_access = self._next_tick()
            if block.is_cached:
                self.num_cached_unused += 1
                if not block.children:
                    self.prefix_cache.push_leaf(block)
            else:
                self.free_ids.append(block.block_id)

    def cache(self, block: KVBlock, block_hash: bytes, parent: KVBlock | None) -> KVBlock:
        """Register a full, in-use block under its hash and return the cached block for that hash.

        If another block already holds the hash (two requests computed the same prefix at once), that
        block stays the cached one and `block` remains a private, uncached duplicate.
        """
        assert block.ref_count > 0, "only in-use blocks are cached"
        existing = self.prefix_cache.hash_to_block.get(block_hash)
        if existing is not None:
            return existing
        if block.is_cached:
            return block
        self.prefix_cache.insert(block, block_hash, parent)
        return block

    def evict(self, num_blocks: int) -> int:
        """Evict up to num_blocks cached, unused blocks to the free list; returns how many."""
        n = 0
        while n < num_blocks and self.num_cached_unused:
            block = self._evict_one()
            self.free_ids.append(block.block_id)
            n += 1
        return n

    def reset_prefix_cache(self) -> int:
        """Evict every unused cached block; returns how many were dropped."""
        return self.evict(self.num_cached_unused)

    def _evict_one(self, record: list | None = None) -> KVBlock:
        block = self.prefix_cache.pop_lru_leaf(record)
        assert block is not None, "num_cached_unused > 0 but no evictable leaf"
        self.num_cached_unused -= 1
        self.num_evictions += 1
        return block

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block id appears twice in the free list"
        num_cached = num_used = 0
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id}: negative ref count"
            if b.block_id in free:
                assert b.ref_count == 0 and not b.is_cached, f"block {b.block_id}: free but referenced or cached"
            elif b.ref_count == 0:
                assert b.is_cached, f"block {b.block_id}: unreferenced, uncached and not free (leaked)"
                num_cached += 1
            else:
                num_used += 1
                # whoever holds a cached block holds its whole chain, so every cached block with
                # ref 0 has only ref-0 descendants and stays evictable (leaf first)
                assert not b.is_cached or b.parent is None or b.parent.ref_count > 0, (
                    f"block {b.block_id}: in use, but its cached parent {b.parent.block_id} is not"
                )
        assert num_cached == self.num_cached_unused, (
            f"cached-unused count {self.num_cached_unused} != actual {num_cached}"
        )
        total = len(free) + num_cached + num_used
        assert total == self.num_blocks, f"free + cached + used = {total} != total {self.num_blocks}"
        self.prefix_cache.check_integrity()
