"""The prefix cache: a radix tree of cached full blocks, keyed by chained block hash.

Each node is one full block; its edge label is the block's tokens, folded into the hash. A chain
of hashes walks from a root down:

    root ── h0 ── h1 ── h2          request A: blocks h0 h1 h2
             └─── h1' ─ h2'         request B: shares h0, then diverges

Eviction is least-recently-used among *leaves* whose ref count is 0, so a block is never evicted
while a cached descendant remains (the chain stays matchable from the root). The tree only tracks
identity and order; ref counts and the free list belong to the BlockPool.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

HBM_TIER = 1  # kvstrata.v1.Tier.TIER_HBM, for KV events


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of the pool. `block_hash` is set only while the block is in the prefix cache."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent: KVBlock | None = None
    children: dict[bytes, KVBlock] = field(default_factory=dict)
    last_access: int = 0
    hits: int = 0  # later requests that reused it (in any tier), while cached

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.block_hash is not None and not self.children


class EvictedBlock(NamedTuple):
    """A cached block leaving the tree: what a lower tier needs to keep it and judge its worth."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    hits: int


class PrefixCache:
    def __init__(self) -> None:
        self.hash_to_block: dict[bytes, KVBlock] = {}
        self._roots: dict[bytes, KVBlock] = {}
        # (last_access, block_id) of blocks that were evictable when pushed; validated lazily
        self._leaf_heap: list[tuple[int, int]] = []
        self._id_to_block: dict[int, KVBlock] = {}
        # KV events for the shared index (an EventRecorder), when this worker publishes them
        self.recorder = None

    def __len__(self) -> int:
        return len(self.hash_to_block)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hash_to_block

    def match(self, block_hashes: list[bytes]) -> list[KVBlock]:
        """The longest cached chain that is a prefix of block_hashes."""
        out: list[KVBlock] = []
        for h in block_hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def insert(self, block: KVBlock, block_hash: bytes, parent: KVBlock | None) -> None:
        """Make `block` the cached node for `block_hash` under `parent` (None for a first block)."""
        assert block.block_hash is None and block_hash not in self.hash_to_block
        assert parent is None or parent.block_hash is not None, "parent must be cached first"
        block.block_hash = block_hash
        block.parent = parent
        (parent.children if parent is not None else self._roots)[block_hash] = block
        self.hash_to_block[block_hash] = block
        self._id_to_block[block.block_id] = block
        if self.recorder is not None:
            self.recorder.stored([block_hash], parent.block_hash if parent is not None else None, HBM_TIER)

    def remove(self, block: KVBlock, demoted: bool = False) -> None:
        """Drop a leaf from the tree; its parent may become an evictable leaf. `demoted`: a tier
        below takes it, and says so in the KV events itself."""
        assert block.block_hash is not None and not block.children, "only cached leaves are removed"
        h = block.block_hash
        parent = block.parent
        (parent.children if parent is not None else self._roots).pop(h)
        del self.hash_to_block[h]
        del self._id_to_block[block.block_id]
        block.block_hash = None
        block.parent = None
        block.hits = 0
        if self.recorder is not None and not demoted:
            self.recorder.removed([h], HBM_TIER)
        if parent is not None and parent.is_evictable:
            self.push_leaf(parent)

    def push_leaf(self, block: KVBlock) -> None:
        heapq.heappush(self._leaf_heap, (block.last_access, block.block_id))
        if len(self._leaf_heap) > 4 * len(self.hash_to_block) + 64:
            self._compact()

    def pop_lru_leaf(self, record: list | None = None) -> KVBlock | None:
        """The least-recently-used evictable leaf, removed from the tree; None if there is none.
        With `record`, appends the removed block's EvictedBlock to it."""
        while self._leaf_heap:
            tick, block_id = heapq.heappop(self._leaf_heap)
            block = self._id_to_block.get(block_id)
            if block is not None and block.is_evictable and block.last_access == tick:
                if record is not None:
                    parent_hash = block.parent.block_hash if block.parent is not None else None
                    record.append(EvictedBlock(block.block_id, block.block_hash, parent_hash, block.hits))
                self.remove(block, demoted=record is not None)
                return block
        return None

    def _compact(self) -> None:
        self._leaf_heap = [
            (b.last_access, b.block_id) for b in self.hash_to_block.values() if b.is_evictable
        ]
        heapq.heapify(self._leaf_heap)

    def eviction_order(self) -> list[int]:
        """Block ids in the order they would be evicted if nothing else changed (introspection)."""
        removed: set[int] = set()
        remaining = {b.block_id: len(b.children) for b in self.hash_to_block.values()}
        heap = [(b.last_access, b.block_id) for b in self.hash_to_block.values() if b.is_evictable]
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            _, block_id = heapq.heappop(heap)
            if block_id in removed:
                continue
            removed.add(block_id)
            order.append(block_id)
            parent = self._id_to_block[block_id].parent
            if parent is not None:
                remaining[parent.block_id] -= 1
                if remaining[parent.block_id] == 0 and parent.ref_count == 0:
                    heapq.heappush(heap, (parent.last_access, parent.block_id))
        return order

    def tree(self) -> list[dict]:
        """The cached tree as nested dicts: {block_id, hash, ref_count, children}."""

        def node(b: KVBlock) -> dict:
            return {
                "block_id": b.block_id,
                "hash": b.block_hash.hex()[:16] if b.block_hash else None,
                "ref_count": b.ref_count,
                "children": [node(c) for c in b.children.values()],
            }

        return [node(b) for b in self._roots.values()]

    def check_integrity(self) -> None:
        for h, b in self.hash_to_block.items():
            assert b.block_hash == h, f"block {b.block_id}: hash map disagrees with block"
            siblings = b.parent.children if b.parent is not None else self._roots
            assert siblings.get(h) is b, f"block {b.block_id}: not linked under its parent"
            if b.parent is not None:
                assert b.parent.block_hash in self.hash_to_block, f"block {b.block_id}: parent uncached"
            for c in b.children.values():
                assert c.parent is b
