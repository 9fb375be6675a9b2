"""One simulated worker's prefix cache for `kvstrata bench routing`: trace blocks in HBM over DRAM,
LRU and leaf first like the engine, with HBM evictions demoted to DRAM and DRAM hits promoted."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

HBM, DRAM = 0, 1


class TieredBlockCache:
    """Blocks named by trace hash ids, each in at most one tier. A block is evicted only when no cached
    descendant remains in its tier, so HBM holds a prefix-closed forest, and HBM + DRAM another:

        root -> a -> b -> c        HBM: a, b     DRAM: c       a prompt [a b c d]: 2 HBM + 1 DRAM hit
                  \\-> e            DRAM: e        evicting from HBM takes b (no HBM child), then a

    Verbs: `match` (read only), `fetch` (touch the hit, promote its DRAM part), `cache` (a prompt's full
    blocks, after its prefill), `evict` (an HBM leaf to DRAM, for room). The chain being fetched or cached
    is never evicted.
    """

    def __init__(self, hbm_blocks: int, dram_blocks: int):
        if hbm_blocks < 1 or dram_blocks < 0:
            raise ValueError(f"need hbm_blocks >= 1 and dram_blocks >= 0, got {hbm_blocks} and {dram_blocks}")
        self.capacity = (hbm_blocks, dram_blocks)
        self.block_to_tier: dict[int, int] = {}
        self.block_to_parent: dict[int, int | None] = {}
        self.block_to_tick: dict[int, int] = {}
        self.num_children: tuple[dict[int, int], dict[int, int]] = ({}, {})  # per tier: cached children there
        self.num_blocks = [0, 0]
        self._lru: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # lazy heaps of (tick, block)
        self._tick = 0
        self.num_promoted = self.num_demoted = self.num_dropped = 0

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(HBM blocks, DRAM blocks) of the longest cached prefix of `hashes`."""
        n_hbm = n_dram = 0
        for h in hashes:
            tier = self.block_to_tier.get(h)
            if tier is None:
                break
            if tier == HBM:
                n_hbm += 1
            else:
                n_dram += 1
        return n_hbm, n_dram

    def fetch(self, hashes: Sequence[int], num_blocks: int) -> None:
        """Use the first `num_blocks` of `hashes`, all cached (as `match` said): touch them, and promote
        the DRAM ones to HBM (HBM leaves are demoted to make room)."""
        protect = set(hashes[:num_blocks])
        for i in range(num_blocks):
            self._bring_to_hbm(hashes, i, protect)

    def cache(self, hashes: Sequence[int]) -> None:
        """Cache a prompt's full blocks in HBM, touching those already there; stops when HBM cannot take
        the chain's next block (it is longer than HBM)."""
        protect = set(hashes)
        for i in range(len(hashes)):
            if not self._bring_to_hbm(hashes, i, protect):
                return

    def _bring_to_hbm(self, hashes: Sequence[int], i: int, protect: set[int]) -> bool:
        block = hashes[i]
        tier = self.block_to_tier.get(block)
        if tier != HBM:
            if not self._make_room(protect):
                return False
            if tier == DRAM:
                self._unplace(block)
                self.num_promoted += 1
            self._place(block, hashes[i - 1] if i else None, HBM)
        self._touch(block)
        return True

    def _make_room(self, protect: set[int]) -> bool:
        while self.num_blocks[HBM] >= self.capacity[HBM]:
            victim = self._pop_lru(HBM, protect)
            if victim is None:
                return False
            self.evict(victim, protect)
        return True

    def evict(self, block: int, protect: set[int] = frozenset()) -> None:
        """Move an HBM leaf to DRAM, dropping DRAM's LRU leaf for room; drop it if DRAM keeps nothing
        else (then it has no DRAM child either: that child would be protected, and so would it)."""
        self._unplace(block)
        while self.num_blocks[DRAM] >= self.capacity[DRAM] > 0:
            victim = self._pop_lru(DRAM, protect)
            if victim is None:
                break
            self._unplace(victim)
            self._forget(victim)
        if self.num_blocks[DRAM] < self.capacity[DRAM]:
            self._place(block, self.block_to_parent[block], DRAM)
            self.num_demoted += 1
            if not self.num_children[DRAM].get(block):
                heapq.heappush(self._lru[DRAM], (self.block_to_tick[block], block))
        else:
            self._forget(block)

    def _place(self, block: int, parent: int | None, tier: int) -> None:
        self.block_to_tier[block] = tier
        self.block_to_parent[block] = parent
        self.num_blocks[tier] += 1
        if parent is not None:
            children = self.num_children[tier]
            children[parent] = children.get(parent, 0) + 1

    def _unplace(self, block: int) -> None:
        tier = self.block_to_tier.pop(block)
        self.num_blocks[tier] -= 1
        parent = self.block_to_parent[block]
        if parent is not None:
            children = self.num_children[tier]
            children[parent] -= 1
            if children[parent] == 0:
                del children[parent]
                if self.block_to_tier.get(parent) == tier:  # a leaf of its tier now
                    heapq.heappush(self._lru[tier], (self.block_to_tick[parent], parent))

    def _forget(self, block: int) -> None:
        del self.block_to_parent[block], self.block_to_tick[block]
        self.num_dropped += 1

    def _touch(self, block: int) -> None:
        self._tick += 1
        self.block_to_tick[block] = self._tick
        if not self.num_children[HBM].get(block):
            heapq.heappush(self._lru[HBM], (self._tick, block))

    def _pop_lru(self, tier: int, protect: set[int]) -> int | None:
        """The least recently used leaf of `tier` outside `protect`, or None; stale heap entries go."""
        heap, skipped, found = self._lru[tier], [], None
        while heap:
            tick, block = heapq.heappop(heap)
            if (self.block_to_tier.get(block) != tier or self.block_to_tick[block] != tick
                    or self.num_children[tier].get(block)):
                continue
            if block in protect:
                skipped.append((tick, block))
                continue
            found = block
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def check_integrity(self) -> None:
        """Counts agree and fit; every cached block's parent is cached, and in HBM for an HBM block."""
        counts = [0, 0]
        children: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for block, tier in self.block_to_tier.items():
            counts[tier] += 1
            parent = self.block_to_parent[block]
            if parent is not None:
                assert parent in self.block_to_tier, f"block {block} cached without its parent {parent}"
                assert tier == DRAM or self.block_to_tier[parent] == HBM, f"HBM block {block} under a DRAM parent"
                children[tier][parent] = children[tier].get(parent, 0) + 1
        assert counts == self.num_blocks, (counts, self.num_blocks)
        assert all(n <= cap for n, cap in zip(counts, self.capacity)), (counts, self.capacity)
        assert children == self.num_children, "child counts out of step"
        assert set(self.block_to_parent) == set(self.block_to_tier) == set(self.block_to_tick)
