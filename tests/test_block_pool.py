"""BlockPool: allocation order, ref counts, the free list, and leaf-first LRU eviction.

Every scenario asserts exact block ids and ends with `check_integrity()`, and the last tests
corrupt a pool on purpose to show that the checker itself can fail.
"""

from __future__ import annotations

import hashlib

import pytest

from kvstrata.worker.block_pool import BlockPool
from kvstrata.worker.prefix_cache import KVBlock


def h(name: str) -> bytes:
    """A stand-in block hash; the pool only needs distinct, stable bytes."""
    return hashlib.sha256(name.encode()).digest()


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- allocation and the free list ---------------------------------------------------------------


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_hands_out_ids_in_order():
    pool = BlockPool(6)
    assert ids(pool.allocate(2)) == [0, 1]
    assert ids(pool.allocate(1)) == [2]
    assert ids(pool.allocate(3)) == [3, 4, 5]
    assert all(b.ref_count == 1 and not b.is_cached for b in pool.blocks)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 6
    pool.check_integrity()


def test_allocate_zero_blocks_is_a_no_op():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert list(pool.free_ids) == [0, 1]
    pool.check_integrity()


def test_free_returns_uncached_blocks_to_the_tail_fifo():
    pool = BlockPool(5)
    a = pool.allocate(3)  # 0 1 2; free list: 3 4
    pool.free([a[2], a[0]])
    assert list(pool.free_ids) == [3, 4, 2, 0]
    # FIFO: never-used blocks first, then the freed ones in the order they were freed
    assert ids(pool.allocate(3)) == [3, 4, 2]
    pool.free([a[1]])
    assert list(pool.free_ids) == [0, 1]
    assert ids(pool.allocate(2)) == [0, 1]
    pool.check_integrity()


def test_can_allocate_and_over_allocation():
    pool = BlockPool(3)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)
    with pytest.raises(MemoryError):
        pool.allocate(4)
    # the failed call took nothing
    assert list(pool.free_ids) == [0, 1, 2]
    assert all(b.ref_count == 0 for b in pool.blocks)
    pool.allocate(2)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert list(pool.free_ids) == [2]
    pool.check_integrity()


def test_touch_and_free_count_references():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.cache(b, h("A"), None) is b
    pool.touch([b])
    pool.touch([b])
    assert b.ref_count == 3
    pool.free([b])
    pool.free([b])
    assert b.ref_count == 1 and pool.num_used_blocks == 1
    pool.check_integrity()
    pool.free([b])
    # cached with ref 0: reusable, counted as free, but not on the free list
    assert b.ref_count == 0 and b.is_cached
    assert list(pool.free_ids) == [1, 2]
    assert pool.num_free_blocks == 3 and pool.num_cached_unused == 1 and pool.num_used_blocks == 0
    pool.check_integrity()
    # a prefix hit brings it back into use
    assert pool.get_cached([h("A")]) == [b]
    pool.touch([b])
    assert b.ref_count == 1 and pool.num_free_blocks == 2 and pool.num_cached_unused == 0
    pool.check_integrity()


def test_free_of_unreferenced_block_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_touch_of_free_uncached_block_asserts():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.touch([pool.blocks[0]])


def test_cached_unused_blocks_are_reused_only_when_free_list_is_empty():
    pool = BlockPool(3)
    (b0,) = pool.allocate(1)
    pool.cache(b0, h("A"), None)
    pool.free([b0])
    assert pool.num_free_blocks == 3
    # the free list goes first; the cached block survives
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.num_evictions == 0 and h("A") in pool.prefix_cache
    pool.check_integrity()
    # now only eviction can serve
    (again,) = pool.allocate(1)
    assert again is b0
    assert pool.num_evictions == 1
    assert h("A") not in pool.prefix_cache and not b0.is_cached and b0.ref_count == 1
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_cache_of_duplicate_hash_returns_existing_block():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    assert pool.cache(first, h("A"), None) is first
    assert pool.cache(second, h("A"), None) is first
    assert not second.is_cached
    assert pool.prefix_cache.hash_to_block == {h("A"): first}
    # caching an already cached block again is idempotent
    assert pool.cache(first, h("A"), None) is first
    pool.check_integrity()
    # the duplicate stays private: freeing it returns it to the free list, not the cache
    pool.free([second])
    assert list(pool.free_ids) == [2, 3, 1]
    assert pool.num_cached_unused == 0
    pool.check_integrity()


def test_cache_requires_an_in_use_block():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.cache(pool.blocks[0], h("A"), None)


# -- leaf-first LRU eviction ---------------------------------------------------------------------


def build_tree(pool: BlockPool) -> tuple[dict[str, KVBlock], dict[str, list[KVBlock]]]:
    """Two requests' chains, A->B->C and A->D, cached in blocks 0,1,2,3 and still in use.

        A(0) ── B(1) ── C(2)        request "ABC" holds A B C
          └──── D(3)                request "AD"  holds A D   (a prefix hit on A: ref 2)

    As in the manager, whoever holds a cached block holds its whole chain.
    """
    a, b, c, d = pool.allocate(4)
    pool.cache(a, h("A"), None)
    pool.cache(b, h("AB"), a)
    pool.cache(c, h("ABC"), b)
    pool.cache(d, h("AD"), a)
    pool.touch([a])
    pool.check_integrity()
    return {"A": a, "B": b, "C": c, "D": d}, {"ABC": [a, b, c], "AD": [a, d]}


def evict_through_allocate(pool: BlockPool, n: int) -> list[int]:
    """Allocate one block at a time, checking eviction_order() predicts each victim."""
    out = []
    for _ in range(n):
        predicted = pool.prefix_cache.eviction_order()
        (blk,) = pool.allocate(1)
        assert predicted and predicted[0] == blk.block_id
        out.append(blk.block_id)
        pool.check_integrity()
    return out


@pytest.mark.parametrize(
    "releases, expected",
    [
        # tail first, ABC before AD: C B are the oldest, A waits for its child D
        ([["C", "B", "A"], ["D", "A"]], [2, 1, 3, 0]),
        # AD first: D is the LRU leaf; A is never a leaf before B is gone
        ([["D", "A"], ["C", "B", "A"]], [3, 2, 1, 0]),
        # head first: B has the oldest access, but C (its child) is the leaf and goes first
        ([["A", "B", "C"], ["A", "D"]], [2, 1, 3, 0]),
        # head first, AD first: A is older than B and C, yet is evicted last
        ([["A", "D"], ["A", "B", "C"]], [3, 2, 1, 0]),
    ],
)
def test_eviction_is_lru_among_leaves(releases, expected):
    pool = BlockPool(6)
    tree, _ = build_tree(pool)
    for names in releases:
        pool.free([tree[name] for name in names])
        pool.check_integrity()
    assert pool.prefix_cache.eviction_order() == expected
    assert pool.num_free_blocks == 6 and pool.num_cached_unused == 4
    # free list first (never-used blocks 4 and 5), with no eviction
    assert ids(pool.allocate(2)) == [4, 5]
    assert pool.num_evictions == 0
    assert evict_through_allocate(pool, 4) == expected
    assert pool.num_evictions == 4
    assert len(pool.prefix_cache) == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.check_integrity()


def test_parent_is_not_evicted_while_a_cached_child_remains():
    pool = BlockPool(4)
    tree, chains = build_tree(pool)
    a, b, c, d = (tree[n] for n in "ABCD")
    pool.free(chains["ABC"])  # head first: A stays held by AD, B gets an older tick than C
    assert pool.prefix_cache.eviction_order() == [2, 1]  # A is held by AD; B only after C
    pool.free(chains["AD"])
    assert b.last_access < c.last_access and a.last_access < d.last_access
    # LRU alone would pick B, then A; leaf first takes C, then B, then D before A
    assert evict_through_allocate(pool, 4) == [2, 1, 3, 0]
    pool.check_integrity()


def test_held_chain_is_never_evicted():
    pool = BlockPool(4)
    tree, chains = build_tree(pool)
    pool.free(chains["AD"][::-1])
    # only D is unreferenced; A is still held by the ABC request
    assert pool.prefix_cache.eviction_order() == [3]
    assert pool.num_free_blocks == 1
    assert evict_through_allocate(pool, 1) == [3]
    assert not pool.can_allocate(1)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    assert ids(pool.get_cached([h("A"), h("AB"), h("ABC")])) == [0, 1, 2]
    pool.check_integrity()


def test_touch_refreshes_recency():
    pool = BlockPool(4)
    tree, chains = build_tree(pool)
    pool.free(chains["ABC"][::-1])
    pool.free(chains["AD"][::-1])
    assert pool.prefix_cache.eviction_order() == [2, 1, 3, 0]
    # a prefix hit on A->D makes that branch the most recent
    hit = pool.get_cached([h("A"), h("AD")])
    assert ids(hit) == [0, 3]
    pool.touch(hit)
    pool.free(hit[::-1])
    assert pool.prefix_cache.eviction_order() == [2, 1, 3, 0]
    # and a hit on A->B->C makes that branch the most recent instead
    hit = pool.get_cached([h("A"), h("AB"), h("ABC")])
    assert ids(hit) == [0, 1, 2]
    pool.touch(hit)
    pool.free(hit[::-1])
    assert pool.prefix_cache.eviction_order() == [3, 2, 1, 0]
    assert evict_through_allocate(pool, 4) == [3, 2, 1, 0]
    pool.check_integrity()


def test_stale_heap_entries_do_not_change_the_order():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    pool.cache(x, h("X"), None)
    pool.cache(y, h("Y"), None)
    pool.free([x])
    pool.free([y])
    pool.touch([x])  # x's heap entry is now stale
    pool.free([x])
    assert pool.prefix_cache.eviction_order() == [1, 0]
    assert ids(pool.allocate(1)) == [2]
    assert evict_through_allocate(pool, 2) == [1, 0]
    pool.check_integrity()


def test_evict_moves_lru_leaves_to_the_free_list():
    pool = BlockPool(6)
    tree, chains = build_tree(pool)
    pool.free(chains["ABC"][::-1])
    pool.free(chains["AD"][::-1])
    assert pool.evict(0) == 0
    assert pool.evict(2) == 2
    assert list(pool.free_ids) == [4, 5, 2, 1]
    assert pool.num_evictions == 2 and pool.num_cached_unused == 2
    assert pool.num_free_blocks == 6
    pool.check_integrity()
    # asking for more than there is evicts what there is
    assert pool.evict(10) == 2
    assert list(pool.free_ids) == [4, 5, 2, 1, 3, 0]
    assert pool.num_evictions == 4 and len(pool.prefix_cache) == 0
    assert pool.evict(1) == 0
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_unused_blocks():
    pool = BlockPool(6)
    tree, chains = build_tree(pool)
    pool.free(chains["AD"][::-1])
    assert pool.reset_prefix_cache() == 1
    assert list(pool.free_ids) == [4, 5, 3]
    # the in-use chain A->B->C stays cached and matchable
    assert ids(pool.get_cached([h("A"), h("AB"), h("ABC")])) == [0, 1, 2]
    pool.check_integrity()
    pool.free(chains["ABC"][::-1])
    assert pool.reset_prefix_cache() == 3
    assert list(pool.free_ids) == [4, 5, 3, 2, 1, 0]
    assert len(pool.prefix_cache) == 0 and pool.num_evictions == 4
    assert pool.reset_prefix_cache() == 0
    pool.check_integrity()


# -- the checker can fail -----------------------------------------------------------------------


def test_check_integrity_catches_negative_ref_count():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.check_integrity()
    pool.blocks[0].ref_count = -1
    with pytest.raises(AssertionError, match="negative ref count"):
        pool.check_integrity()


def test_check_integrity_catches_referenced_block_on_free_list():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free_ids.append(b.block_id)
    with pytest.raises(AssertionError, match="free but referenced"):
        pool.check_integrity()


def test_check_integrity_catches_cached_block_on_free_list():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, h("A"), None)
    pool.free([b])
    pool.check_integrity()
    pool.free_ids.append(b.block_id)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_duplicate_free_id():
    pool = BlockPool(3)
    pool.free_ids.append(0)
    with pytest.raises(AssertionError, match="twice"):
        pool.check_integrity()


def test_check_integrity_catches_leaked_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    b.ref_count = 0  # dropped without going through free()
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


def test_check_integrity_catches_wrong_cached_count():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, h("A"), None)
    pool.free([b])
    pool.num_cached_unused = 0
    with pytest.raises(AssertionError, match="cached-unused count"):
        pool.check_integrity()


def test_check_integrity_catches_broken_prefix_tree():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, h("A"), None)
    pool.cache(b, h("AB"), a)
    pool.check_integrity()
    b.block_hash = h("other")
    with pytest.raises(AssertionError, match="hash map disagrees"):
        pool.check_integrity()


def test_check_integrity_catches_unheld_cached_parent():
    # a cached block in use under an unreferenced cached parent: the parent counts as free but
    # can never be evicted, so can_allocate() would over-promise
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, h("A"), None)
    pool.cache(b, h("AB"), a)
    pool.check_integrity()
    pool.free([a])
    with pytest.raises(AssertionError, match="cached parent"):
        pool.check_integrity()
