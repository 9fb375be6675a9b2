"""KVCacheManager: on-demand block tables, prefix hits, copy-on-write forks and release order.

Requests are driven the way the scheduler drives them: get_computed_blocks, allocate_slots, then
num_computed_tokens catches up and cache_full_blocks offers the full blocks to the prefix cache.
"""

from __future__ import annotations

import pytest

from kvstrata.worker.block_hash import HashContext
from kvstrata.worker.kv_cache_manager import NO_COMPUTED_BLOCKS, BlockCopy, KVCacheManager
from kvstrata.worker.request import Request
from kvstrata.worker.sampling_params import SamplingParams

ROOT = HashContext("m").root()


def make_request(rid: str, tokens: list[int], root: bytes = ROOT) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), hash_root=root)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def refs(m: KVCacheManager) -> list[int]:
    return [b.ref_count for b in m.pool.blocks]


def prefill(m: KVCacheManager, r: Request) -> int:
    """Schedule the whole prompt in one step; returns the number of prefix-hit tokens."""
    computed = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - computed.num_tokens, computed)
    r.num_computed_tokens = r.num_tokens
    m.cache_full_blocks(r)
    return computed.num_tokens


def decode(m: KVCacheManager, r: Request, token: int) -> bool:
    r.token_ids.append(token)
    if not m.allocate_slots(r, 1):
        r.token_ids.pop()
        return False
    r.num_computed_tokens += 1
    m.cache_full_blocks(r)
    return True


def snapshot(m: KVCacheManager, *requests: Request):
    return (
        refs(m),
        list(m.pool.free_ids),
        m.pool.num_cached_unused,
        sorted(m.pool.prefix_cache.hash_to_block),
        [(ids(r.block_table), r.num_computed_tokens, r.num_registered_blocks) for r in requests],
        list(m.pending_copies),
    )


# -- growth on demand ----------------------------------------------------------------------------


def test_table_grows_on_demand_not_to_max_length():
    m = KVCacheManager(8, 16, watermark=0)
    r = make_request("r", range(20))
    r.params.max_tokens = 100  # a reserving allocator would take ceil(120 / 16) = 8 blocks
    prefill(m, r)
    assert ids(r.block_table) == [0, 1]
    assert m.num_free_blocks == 6
    m.check_integrity([r])
    # decode fills the partial block before taking a new one
    for t in range(20, 32):
        assert decode(m, r, t)
        assert ids(r.block_table) == [0, 1]
    assert r.num_computed_tokens == 32
    assert decode(m, r, 32)
    assert ids(r.block_table) == [0, 1, 2]
    m.check_integrity([r])


def test_allocate_slots_lookahead_and_chunks():
    m = KVCacheManager(8, 4, watermark=0)
    r = make_request("r", range(10))
    assert m.allocate_slots(r, 3)  # a first chunk of 3 tokens: one block
    assert ids(r.block_table) == [0]
    r.num_computed_tokens = 3
    assert m.allocate_slots(r, 1)  # the 4th token fits in block 0
    assert ids(r.block_table) == [0]
    r.num_computed_tokens = 4
    assert m.allocate_slots(r, 6)  # tokens 4..9: two more blocks
    assert ids(r.block_table) == [0, 1, 2]
    r.num_computed_tokens = 10
    m.cache_full_blocks(r)
    assert ids(m.pool.prefix_cache.hash_to_block.values()) == [0, 1]
    m.check_integrity([r])


def test_allocate_slots_all_or_nothing():
    m = KVCacheManager(4, 4, watermark=0)
    a = make_request("a", range(8))
    prefill(m, a)
    assert ids(a.block_table) == [0, 1]
    # b shares a's two full blocks and needs 3 more: only 2 are free
    b = make_request("b", list(range(8)) + [50] * 9)
    computed = m.get_computed_blocks(b)
    assert ids(computed.blocks) == [0, 1] and computed.num_tokens == 8
    before = snapshot(m, a, b)
    assert not m.allocate_slots(b, b.num_tokens - 8, computed)
    assert snapshot(m, a, b) == before
    assert refs(m) == [1, 1, 0, 0]
    m.check_integrity([a, b])
    # with a finished, the hit blocks are cached and unreferenced: touching them uses them up
    m.free(a)
    computed = m.get_computed_blocks(b)
    assert ids(computed.blocks) == [0, 1]
    before = snapshot(m, b)
    assert not m.allocate_slots(b, b.num_tokens - 8, computed)
    assert snapshot(m, b) == before
    assert m.num_free_blocks == 4
    m.check_integrity([b])
    # a 16-token prompt fits: 2 hit blocks + 2 new ones
    c = make_request("c", list(range(8)) + [50] * 8)
    assert prefill(m, c) == 8
    assert ids(c.block_table) == [0, 1, 2, 3]
    assert m.num_free_blocks == 0 and m.pool.num_evictions == 0
    m.check_integrity([b, c])
    # a decode step past the last block fails and changes nothing
    before = snapshot(m, c)
    assert not decode(m, c, 7)
    assert snapshot(m, c) == before
    m.check_integrity([b, c])


def test_watermark_keeps_a_reserve():
    m = KVCacheManager(20, 4, watermark=0.1)
    assert m.watermark_blocks == 2
    big = make_request("big", range(19 * 4))  # 19 blocks would leave 1 < 2
    before = snapshot(m, big)
    assert not m.allocate_slots(big, big.num_tokens, watermark=True)
    assert snapshot(m, big) == before
    ok = make_request("ok", range(18 * 4))  # 18 blocks leave exactly the reserve
    assert m.allocate_slots(ok, ok.num_tokens, watermark=True)
    assert ids(ok.block_table) == list(range(18))
    small = make_request("small", range(100, 104))
    assert not m.allocate_slots(small, 4, watermark=True)
    assert small.block_table == []
    # running requests (no watermark) may dip into the reserve
    assert m.allocate_slots(small, 4)
    assert ids(small.block_table) == [18]
    m.check_integrity([ok, small, big])


# -- prefix hits ---------------------------------------------------------------------------------


def test_prefix_hit_returns_exact_cached_blocks():
    m = KVCacheManager(16, 4, watermark=0)
    a = make_request("a", range(10))
    assert prefill(m, a) == 0
    assert ids(a.block_table) == [0, 1, 2]
    assert ids(m.pool.prefix_cache.hash_to_block.values()) == [0, 1]  # the partial block is not cached

    b = make_request("b", list(range(8)) + [50, 51, 52])
    computed = m.get_computed_blocks(b)
    assert ids(computed.blocks) == [0, 1] and computed.num_tokens == 8
    assert m.allocate_slots(b, 3, computed)
    assert ids(b.block_table) == [0, 1, 3]
    assert b.num_computed_tokens == 8 and b.num_registered_blocks == 2
    assert refs(m)[:4] == [2, 2, 1, 1]
    b.num_computed_tokens = 11
    m.cache_full_blocks(b)
    m.check_integrity([a, b])


@pytest.mark.parametrize(
    "num_tokens, expected_hit",
    [
        (8, [0]),  # fully cached prompt: the last block is recomputed for its logits
        (9, [0, 1]),
        (5, [0]),
        (4, []),  # a one-block prompt never hits
        (12, [0, 1]),
    ],
)
def test_prefix_hit_is_capped_at_num_tokens_minus_one(num_tokens, expected_hit):
    m = KVCacheManager(16, 4, watermark=0)
    a = make_request("a", range(12))
    prefill(m, a)
    assert ids(m.pool.prefix_cache.hash_to_block.values()) == [0, 1, 2]
    b = make_request("b", range(num_tokens))
    computed = m.get_computed_blocks(b)
    assert ids(computed.blocks) == expected_hit
    assert computed.num_tokens == 4 * len(expected_hit)
    assert len(computed.blocks) <= (num_tokens - 1) // 4
    m.check_integrity([a])


def test_no_hit_once_computation_started_or_when_disabled():
    m = KVCacheManager(16, 4, watermark=0)
    a = make_request("a", range(10))
    prefill(m, a)
    b = make_request("b", range(10))
    b.num_computed_tokens = 4
    assert m.get_computed_blocks(b) is NO_COMPUTED_BLOCKS

    off = KVCacheManager(16, 4, watermark=0, enable_prefix_caching=False)
    c = make_request("c", range(10))
    prefill(off, c)
    assert len(off.pool.prefix_cache) == 0
    d = make_request("d", range(10))
    assert off.get_computed_blocks(d) is NO_COMPUTED_BLOCKS
    prefill(off, d)
    assert ids(d.block_table) == [3, 4, 5]
    off.check_integrity([c, d])


@pytest.mark.parametrize(
    "context",
    [HashContext("m", cache_salt="tenant-b"), HashContext("other-model"), HashContext("m", adapter_id="x")],
)
def test_no_hit_across_salts_or_models(context):
    m = KVCacheManager(16, 4, watermark=0)
    a = make_request("a", range(10))
    prefill(m, a)
    b = make_request("b", range(10), root=context.root())
    assert m.get_computed_blocks(b) is NO_COMPUTED_BLOCKS
    prefill(m, b)
    assert ids(b.block_table) == [3, 4, 5]
    assert len(m.pool.prefix_cache) == 4
    m.check_integrity([a, b])


def test_hit_on_unreferenced_cached_blocks():
    m = KVCacheManager(8, 4, watermark=0)
    a = make_request("a", range(10))
    prefill(m, a)
    m.free(a)
    assert list(m.pool.free_ids) == [3, 4, 5, 6, 7, 2]
    assert m.num_free_blocks == 8 and m.pool.num_cached_unused == 2
    b = make_request("b", list(range(8)) + [9, 9])
    assert prefill(m, b) == 8
    assert ids(b.block_table) == [0, 1, 3]
    assert refs(m) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert m.num_free_blocks == 5 and m.pool.num_cached_unused == 0
    m.check_integrity([b])


def test_concurrent_prefill_of_same_prompt_shares_the_first_cached_blocks():
    m = KVCacheManager(8, 4, watermark=0)
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    for r in (a, b):  # both scheduled before either has cached anything
        computed = m.get_computed_blocks(r)
        assert computed is NO_COMPUTED_BLOCKS
        assert m.allocate_slots(r, r.num_tokens)
    assert ids(a.block_table) == [0, 1, 2] and ids(b.block_table) == [3, 4, 5]
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        m.cache_full_blocks(r)
    assert ids(m.pool.prefix_cache.hash_to_block.values()) == [0, 1]
    # b's full blocks were duplicates of a's: b now shares a's and its copies are free again
    assert ids(b.block_table) == [0, 1, 5]
    assert list(m.pool.free_ids) == [6, 7, 3, 4]
    assert refs(m) == [2, 2, 1, 0, 0, 1, 0, 0]
    m.check_integrity([a, b])
    m.free(b)
    assert list(m.pool.free_ids) == [6, 7, 3, 4, 5]
    m.free(a)
    assert m.pool.prefix_cache.eviction_order() == [1, 0]
    m.check_integrity([])


# -- fork and copy-on-write ----------------------------------------------------------------------


def fork(m: KVCacheManager, parent: Request, index: int) -> Request:
    child = Request(f"{parent.request_id}-{index}", parent.prompt_token_ids, parent.params,
                    hash_root=parent.hash_root, sample_index=index, token_ids=list(parent.token_ids))
    m.fork(parent, child)
    return child


def test_fork_shares_blocks_and_copies_partial_tail_on_first_write():
    m = KVCacheManager(8, 4, watermark=0)
    p = make_request("p", range(6))
    prefill(m, p)
    assert ids(p.block_table) == [0, 1]
    c = fork(m, p, 1)
    assert ids(c.block_table) == [0, 1] and c.num_computed_tokens == 6
    assert refs(m)[:3] == [2, 2, 0]
    m.check_integrity([p, c])
    # the child's first write goes into the shared partial block 1: it gets a copy
    assert decode(m, c, 100)
    assert ids(c.block_table) == [0, 2]
    assert m.pending_copies == [BlockCopy(src=1, dst=2)]
    assert refs(m)[:3] == [2, 1, 1]
    m.check_integrity([p, c])
    assert m.drain_copies() == [BlockCopy(1, 2)]
    assert m.drain_copies() == []
    # the parent is now the only holder of block 1 and writes in place
    assert decode(m, p, 200)
    assert ids(p.block_table) == [0, 1]
    assert m.pending_copies == []
    # both fill their blocks with different tokens and cache them separately
    assert decode(m, p, 201) and decode(m, c, 101)
    assert ids(m.pool.prefix_cache.hash_to_block.values()) == [0, 1, 2]
    assert m.pending_copies == []
    m.check_integrity([p, c])


def test_fork_at_block_boundary_needs_no_copy():
    m = KVCacheManager(8, 4, watermark=0)
    p = make_request("p", range(8))
    prefill(m, p)
    c = fork(m, p, 1)
    assert refs(m)[:2] == [2, 2]
    assert decode(m, c, 100)
    assert ids(c.block_table) == [0, 1, 2]
    assert decode(m, p, 200)
    assert ids(p.block_table) == [0, 1, 3]
    assert m.drain_copies() == []
    assert refs(m)[:4] == [2, 2, 1, 1]
    m.check_integrity([p, c])


def test_fork_three_ways_copies_once_per_early_writer():
    m = KVCacheManager(8, 4, watermark=0)
    p = make_request("p", range(5))
    prefill(m, p)
    c1, c2 = fork(m, p, 1), fork(m, p, 2)
    assert refs(m)[:2] == [3, 3]
    assert decode(m, c1, 1) and decode(m, c2, 2) and decode(m, p, 3)
    assert m.drain_copies() == [BlockCopy(1, 2), BlockCopy(1, 3)]
    assert ids(p.block_table) == [0, 1] and ids(c1.block_table) == [0, 2] and ids(c2.block_table) == [0, 3]
    assert refs(m)[:4] == [3, 1, 1, 1]
    m.check_integrity([p, c1, c2])


def test_copy_on_write_fails_cleanly_without_a_free_block():
    m = KVCacheManager(2, 4, watermark=0)
    p = make_request("p", range(6))
    prefill(m, p)
    c = fork(m, p, 1)
    before = snapshot(m, p, c)
    assert not decode(m, c, 9)
    assert snapshot(m, p, c) == before
    m.check_integrity([p, c])
    m.free(p)
    # now c holds block 1 alone and may write in place
    assert decode(m, c, 9)
    assert ids(c.block_table) == [0, 1] and m.drain_copies() == []
    m.check_integrity([c])


# -- release -------------------------------------------------------------------------------------


def test_free_releases_tail_first_so_tail_is_evicted_first():
    m = KVCacheManager(3, 4, watermark=0)
    a = make_request("a", range(12))
    prefill(m, a)
    assert ids(a.block_table) == [0, 1, 2]
    m.free(a)
    assert a.block_table == [] and a.num_registered_blocks == 0
    assert m.pool.prefix_cache.eviction_order() == [2, 1, 0]
    m.check_integrity([a])
    b = make_request("b", range(100, 112))
    assert prefill(m, b) == 0
    assert ids(b.block_table) == [2, 1, 0]
    assert m.pool.num_evictions == 3
    m.check_integrity([b])


def test_free_returns_uncached_blocks_tail_first():
    m = KVCacheManager(4, 4, enable_prefix_caching=False, watermark=0)
    a = make_request("a", range(12))
    prefill(m, a)
    assert ids(a.block_table) == [0, 1, 2]
    m.free(a)
    assert list(m.pool.free_ids) == [3, 2, 1, 0]
    m.check_integrity([a])


def test_free_partial_tail_goes_to_free_list():
    m = KVCacheManager(4, 4, watermark=0)
    a = make_request("a", range(10))
    prefill(m, a)
    m.free(a)
    assert list(m.pool.free_ids) == [3, 2]
    assert m.pool.prefix_cache.eviction_order() == [1, 0]
    m.check_integrity([])


def test_preempted_request_rehits_its_own_blocks():
    m = KVCacheManager(8, 4, watermark=0)
    r = make_request("r", range(6))
    prefill(m, r)
    for t in (6, 7, 8):
        assert decode(m, r, t)
    assert ids(r.block_table) == [0, 1, 2]
    m.free(r)
    r.num_computed_tokens = 0
    assert prefill(m, r) == 8
    assert ids(r.block_table) == [0, 1, 3]
    m.check_integrity([r])


def test_check_integrity_catches_mismatched_ref_count():
    m = KVCacheManager(8, 4, watermark=0)
    a = make_request("a", range(10))
    b = make_request("b", list(range(8)) + [1, 1])
    prefill(m, a)
    prefill(m, b)
    m.check_integrity([a, b])
    with pytest.raises(AssertionError, match="ref_count 2 but held by 1"):
        m.check_integrity([a])  # b's references are unaccounted for
    b.block_table.append(m.pool.blocks[7])  # a table entry without a reference
    with pytest.raises(AssertionError, match="block 7"):
        m.check_integrity([a, b])


# -- regression: a block cached under another request's twin ------------------------------------
#
# cache_full_blocks used to link a request's next full block under the *cached twin* of its
# previous block (`hash_to_block[block_hashes[first - 1]]`) while the request itself held a private
# duplicate. Once the twin's owner finished (or, after a preemption, the request's own earlier
# blocks were released), the twin had ref_count 0 but an in-use cached child: counted in
# num_free_blocks, never evictable. can_allocate() over-promised, allocate_slots() crashed in
# BlockPool._evict_one ("num_cached_unused > 0 but no evictable leaf") after taking blocks, and
# reset_prefix_cache() crashed. Trigger: a block-aligned prompt that is fully cached recomputes its
# last block, then decodes past the next block boundary. Found by test_kv_cache_stateful; the fix
# swaps the duplicate for the cached block.


def _twin_state_two_requests() -> tuple[KVCacheManager, Request]:
    m = KVCacheManager(6, 4, watermark=0)
    a = make_request("a", [1] * 4 + [2] * 4)
    prefill(m, a)
    assert ids(a.block_table) == [0, 1]
    b = make_request("b", [1] * 4 + [2] * 4)
    assert prefill(m, b) == 4  # block 0 hits; block 1 is recomputed into block 2, a duplicate
    assert ids(b.block_table) == [0, 1]  # ... which is dropped for the cached block 1
    assert list(m.pool.free_ids) == [3, 4, 5, 2]
    for t in (3, 3, 3, 3):  # b fills and caches a third block
        assert decode(m, b, t)
    assert ids(b.block_table) == [0, 1, 3]
    m.free(a)
    m.check_integrity([b])
    return m, b


def _twin_state_preemption() -> tuple[KVCacheManager, Request]:
    m = KVCacheManager(6, 4, watermark=0)
    b = make_request("b", [1] * 4 + [2] * 4)
    prefill(m, b)
    m.free(b)  # preempted: blocks 0 and 1 stay cached, unreferenced
    b.num_computed_tokens = 0
    assert prefill(m, b) == 4
    assert ids(b.block_table) == [0, 1]
    assert list(m.pool.free_ids) == [3, 4, 5, 2]
    for t in (3, 3, 3, 3):
        assert decode(m, b, t)
    assert ids(b.block_table) == [0, 1, 3]
    m.check_integrity([b])
    return m, b


TWIN_STATES = [_twin_state_two_requests, _twin_state_preemption]


@pytest.mark.parametrize("setup", TWIN_STATES)
def test_regression_all_free_blocks_can_be_allocated(setup):
    m, b = setup()
    assert m.num_free_blocks == 3
    c = make_request("c", range(100, 112))
    assert m.allocate_slots(c, c.num_tokens)
    assert ids(c.block_table) == [4, 5, 2]
    assert m.num_free_blocks == 0 and not m.pool.can_allocate(1)
    m.check_integrity([b, c])


@pytest.mark.parametrize("setup", TWIN_STATES)
def test_regression_reset_prefix_cache_after_duplicate(setup):
    m, b = setup()
    assert m.pool.reset_prefix_cache() == 0  # everything cached is held by b
    assert ids(m.pool.get_cached(b.block_hashes)) == [0, 1, 3]
    m.free(b)
    assert m.pool.prefix_cache.eviction_order() == [3, 1, 0]
    assert m.pool.reset_prefix_cache() == 3
    m.check_integrity([])
