"""The KV cache manager: requests' block tables on top of the block pool.

For one request, with block size B = 4:

    token_ids:     t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..
    block_table:   [ block 7   | block 2     | block 9     ]
                   [ prefix hit (cached)     | computed / new slots ]
                     ^ get_computed_blocks    ^ allocate_slots grows on demand, never to max length

Only the last block of a sequence is partly filled. Full blocks are immutable, so they can be
shared freely; the one shared partial block (after `fork`) is copied on the first write to it, and
the copy is recorded in `pending_copies` for the model runner to perform before the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.worker.block_pool import BlockPool
from kvstrata.worker.kv_compaction import CompactionPlan
from kvstrata.worker.prefix_cache import KVBlock
from kvstrata.worker.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvstrata.tiering.manager import TierManager

MAX_TIER_WAITS = 64  # scheduler steps a request may wait for its blocks to load from NVMe
SWAP_PREFIX = b"swap:"  # DRAM keys of swapped-out blocks (kvstrata.tiering.manager uses the same)


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """Blocks found in the prefix cache for a request, and the tokens they cover.

    `tier_hashes` continue the chain in DRAM (promoted on admission); `pending` means more of it is
    being loaded from NVMe, so the request had better wait a step."""

    blocks: list[KVBlock]
    num_tokens: int
    tier_hashes: tuple[bytes, ...] = ()
    pending: bool = False


NO_COMPUTED_BLOCKS = ComputedBlocks([], 0)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.pending_copies: list[BlockCopy] = []
        self.num_prompt_tokens_queried = 0
        self.num_prompt_tokens_hit = 0
        self.tiers: TierManager | None = None

    def attach_events(self, recorder) -> None:
        """Record KV events (stored, removed, moved between tiers) for the shared prefix index."""
        self.pool.prefix_cache.recorder = recorder
        if self.tiers is not None:
            self.tiers.attach_events(recorder)

    def attach_tiers(self, tiers: TierManager) -> None:
        """Keep evicted blocks in the tiers below, and look requests up in them."""
        self.tiers = tiers
        self.pool.on_evict = tiers.demote

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of a request that is not yet computed.

        At least the last token is always recomputed, because its logits are needed:
        a hit covers at most (num_tokens - 1) // B whole blocks.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return NO_COMPUTED_BLOCKS
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.pool.get_cached(request.block_hashes[:max_blocks])
        if self.tiers is not None and len(blocks) < max_blocks:
            # a request waits for NVMe a bounded number of steps, so that it cannot starve when
            # other loads keep pushing its blocks back out of DRAM
            allow_load = request.num_tier_waits < MAX_TIER_WAITS
            n, pending = self.tiers.lookup(request.block_hashes[len(blocks):max_blocks], allow_load)
            request.num_tier_waits += pending
            if n or pending:
                tier_hashes = tuple(request.block_hashes[len(blocks):len(blocks) + n])
                return ComputedBlocks(blocks, (len(blocks) + n) * self.block_size, tier_hashes, pending)
        return ComputedBlocks(blocks, len(blocks) * self.block_size) if blocks else NO_COMPUTED_BLOCKS

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = NO_COMPUTED_BLOCKS, watermark: bool = False) -> bool:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones.

        All or nothing: on False, nothing changed. `watermark` keeps a small reserve free so that
        newly admitted requests do not immediately force running ones out.
        """
        start = request.num_kv_tokens + computed.num_tokens
        num_promoted = len(computed.tier_hashes)
        num_held = len(request.block_table) + len(computed.blocks) + num_promoted
        num_new_blocks = max(0, self.blocks_for(start + num_new_tokens) - num_held)
        cow_block = self._shared_partial_block(request, start) if not computed.num_tokens else None
        num_needed = num_new_blocks + num_promoted + (cow_block is not None)
        # touching a cached, unreferenced block takes it out of the reusable count
        num_reused = sum(1 for b in computed.blocks if b.ref_count == 0)
        reserve = self.watermark_blocks if watermark else 0
        if self.pool.num_free_blocks - num_reused - num_needed < reserve:
            return False
        if computed.blocks:
            self.pool.touch(computed.blocks)
            for block in computed.blocks:
                block.hits += 1
            request.block_table.extend(computed.blocks)
        if num_promoted:
            self._promote(request, list(computed.tier_hashes))
        if computed.num_tokens:
            request.num_computed_tokens += computed.num_tokens
            request.num_registered_blocks = len(request.block_table)
        if cow_block is not None:
            self._copy_on_write(request, start // self.block_size)
        if num_new_blocks:
            request.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def _promote(self, request: Request, hashes: list[bytes]) -> None:
        """Bring blocks from DRAM into fresh device blocks and cache them, continuing the chain."""
        hits = self.tiers.hits(hashes)
        blocks = self.tiers.bring_back(hashes, self.pool.allocate)
        parent = request.block_table[-1] if request.block_table else None
        for block, h, n in zip(blocks, hashes, hits):
            cached = self.pool.cache(block, h, parent)
            if cached is not block:  # computed meanwhile by another request: share that one
                self.pool.touch([cached])
                self.pool.free([block])
            cached.hits += n + 1  # this promotion is a hit too
            request.block_table.append(cached)
            parent = cached

    def _shared_partial_block(self, request: Request, start: int) -> KVBlock | None:
        idx = start // self.block_size
        if start % self.block_size == 0 or idx >= len(request.block_table):
            return None
        block = request.block_table[idx]
        return block if block.ref_count > 1 else None

    def _copy_on_write(self, request: Request, idx: int) -> None:
        old = request.block_table[idx]
        (new,) = self.pool.allocate(1)
        self.pending_copies.append(BlockCopy(old.block_id, new.block_id))
        self.pool.free([old])
        request.block_table[idx] = new

    def cache_full_blocks(self, request: Request, computed: bool = True) -> None:
        """Offer the request's newly computed full blocks (or, with computed False, swapped-in
        ones) to the prefix cache. Under an eviction policy only the blocks it never touches."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, self.num_cacheable_blocks(request))
        if num_full <= request.num_registered_blocks:
            return
        request.update_block_hashes(self.block_size)
        first = request.num_registered_blocks
        # a request always holds its chain, so the cached parent is our own previous block
        parent = request.block_table[first - 1] if first else None
        for i in range(first, num_full):
            block = request.block_table[i]
            cached = self.pool.cache(block, request.block_hashes[i], parent)
            if cached is not block:
                # Another request cached the same tokens first. Share its block and drop our
                # duplicate: a cached block's parent must stay held by whoever holds the child,
                # or an unreferenced parent with an in-use child could never be evicted.
                self.pool.touch([cached])
                self.pool.free([block])
                request.block_table[i] = cached
            parent = cached
        if computed and self.tiers is not None:
            self.tiers.note_computed(request.block_hashes[first:num_full])
        request.num_registered_blocks = num_full

    def num_cacheable_blocks(self, request: Request) -> int:
        """Leading blocks of the request that may be in the prefix cache. Eviction rewrites a block so
        that it no longer holds the tokens its hash names, so a request under a policy offers only
        the blocks of positions the policy never evicts (StreamingLLM's sinks), and no others."""
        if request.eviction is None:
            return 1 << 62
        return request.eviction.policy.num_stable_tokens // self.block_size

    def num_shared_tokens(self, request: Request) -> int:
        """Cache entries in the request's leading shared blocks (held by others too, or cached)."""
        n = 0
        for block in request.block_table:
            if block.ref_count == 1 and not block.is_cached:
                break
            n += 1
        return min(n * self.block_size, request.num_kv_tokens)

    def compact(self, request: Request, plan: CompactionPlan) -> None:
        """After the model runner moved plan's token slots: keep the retained blocks, in their new
        order, and free the others. Only the request's own, uncached blocks are ever dropped."""
        table = request.block_table
        assert plan.retained[: request.num_registered_blocks] == list(range(request.num_registered_blocks))
        dropped = [table[i] for i in plan.dropped]
        assert all(b.ref_count == 1 and not b.is_cached for b in dropped), "compaction drops a shared block"
        request.block_table = [table[i] for i in plan.retained]
        self.pool.free(dropped[::-1])
        request.num_evicted_tokens = request.num_computed_tokens - plan.new_order.numel()

    def fork(self, parent: Request, child: Request) -> None:
        """Child shares every block of parent; the partial tail is copied on first write."""
        assert not child.block_table
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_evicted_tokens = parent.num_evicted_tokens
        if parent.eviction is not None:
            child.eviction = parent.eviction.copy()

    def free(self, request: Request) -> None:
        """Release all of a request's blocks at once (finish, abort or preemption)."""
        if request.swapped is not None and request.status is not RequestStatus.RUNNING:
            self.tiers.discard(request.swapped[0])  # finished or aborted while swapped out
            request.swapped = None
        self.pool.free(request.block_table[::-1])
        request.block_table = []
        request.num_registered_blocks = 0

    # -- swap --------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Before a preemption frees them: copy the request's computed blocks to DRAM. False when
        there is no DRAM tier, nothing to keep, or no room (the request is then recomputed)."""
        num_blocks = self.blocks_for(request.num_kv_tokens)
        if self.tiers is None or num_blocks == 0:
            return False
        keys = [b"%s%s:%d" % (SWAP_PREFIX, request.request_id.encode(), i) for i in range(num_blocks)]
        if not self.tiers.swap_out(keys, [b.block_id for b in request.block_table[:num_blocks]]):
            return False
        request.swapped = (keys, request.num_computed_tokens)
        return True

    def swap_in(self, request: Request, num_new_tokens: int, watermark: bool = False) -> bool | None:
        """Bring a swapped request's blocks back and give it slots for num_new_tokens more.
        True: done. False: no room now (nothing changed). None: DRAM lost some of its blocks, so
        the swap is dropped and the request is recomputed like any other."""
        keys, num_tokens = request.swapped
        if not self.tiers.has_all(keys):
            self.tiers.discard(keys)
            self.tiers.counters.swap_fallbacks += 1
            request.swapped = None
            request.reset_eviction()
            return None
        num_new_blocks = max(0, self.blocks_for(num_tokens - request.num_evicted_tokens + num_new_tokens) - len(keys))
        reserve = self.watermark_blocks if watermark else 0
        if self.pool.num_free_blocks - len(keys) - num_new_blocks < reserve:
            return False
        blocks = self.tiers.bring_back(keys, self.pool.allocate, swap=True)
        request.block_table = blocks
        request.num_computed_tokens = num_tokens
        request.num_registered_blocks = 0
        request.swapped = None
        if num_new_blocks:
            request.block_table.extend(self.pool.allocate(num_new_blocks))
        self.cache_full_blocks(request, computed=False)  # its full blocks join the prefix cache again
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every unused cached block, in the pool and in the tiers below; returns how many."""
        n = self.pool.reset_prefix_cache()
        if self.tiers is not None:
            n += self.tiers.clear()
        return n

    def record_prefix_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_prompt_tokens_queried += num_prompt_tokens
        self.num_prompt_tokens_hit += num_hit_tokens

    def drain_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self, requests: list[Request] = ()) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        if requests is not None:
            holders: dict[int, int] = {}
            for r in requests:
                for b in r.block_table:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
            for b in self.pool.blocks:
                assert b.ref_count == holders.get(b.block_id, 0), (
                    f"block {b.block_id}: ref_count {b.ref_count} but held by "
                    f"{holders.get(b.block_id, 0)} request(s)"
                )
