"""Block identity (chained SHA-256) and the PrefixCache radix tree on its own."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstrata.worker.block_hash import HASH_SPEC_VERSION, HashContext, hash_block, hash_blocks
from kvstrata.worker.prefix_cache import KVBlock, PrefixCache
from kvstrata.worker.request import Request
from kvstrata.worker.sampling_params import SamplingParams

# Golden digests for HashContext("m") and tokens 1..8 at block size 4. If these change, every
# cached block and every router index entry changes meaning: bump HASH_SPEC_VERSION.
GOLDEN_ROOT = "e020efdcb49d30f557ac2478ba9266ab2ef186efeee719bafdb83a20c622b4bf"
GOLDEN_BLOCKS = [
    "b25de585f12788fd8a7df47e4867e54aae06b5fc0a1057d1905541e1c6246a4f",
    "e628acbb85b259137f3c6f976508fd5f00cb7b532832bcacfec98179b787aeb7",
]

TOKENS = list(range(1, 9))


# -- block hashing -------------------------------------------------------------------------------


def test_hash_spec_version_is_pinned():
    # the golden digests below were taken at this version
    assert HASH_SPEC_VERSION == 1


def test_golden_digests():
    root = HashContext("m").root()
    assert root.hex() == GOLDEN_ROOT
    assert [x.hex() for x in hash_blocks(root, TOKENS, 4)] == GOLDEN_BLOCKS


def test_root_follows_the_documented_layout():
    """root = sha256("kvstrata-block" | version | length-prefixed extra keys),
    h[i] = sha256(h[i-1] | tokens as little-endian int64)."""
    ref = hashlib.sha256(b"kvstrata-block")
    ref.update(HASH_SPEC_VERSION.to_bytes(4, "little"))
    for part in (b"m", b"", b"", b"auto"):
        ref.update(len(part).to_bytes(4, "little") + part)
    root = ref.digest()
    assert HashContext("m").root() == root
    h0 = hashlib.sha256(root + b"".join(t.to_bytes(8, "little") for t in TOKENS[:4])).digest()
    h1 = hashlib.sha256(h0 + b"".join(t.to_bytes(8, "little") for t in TOKENS[4:])).digest()
    assert hash_blocks(root, TOKENS, 4) == [h0, h1]


def test_digests_are_stable_across_processes():
    code = (
        "from kvstrata.worker.block_hash import HashContext, hash_blocks\n"
        "r = HashContext('m').root()\n"
        "print(r.hex())\n"
        "print(','.join(x.hex() for x in hash_blocks(r, list(range(1, 9)), 4)))\n"
    )
    for seed in ("0", "12345"):  # Python's hash() would differ between these
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == [GOLDEN_ROOT, ",".join(GOLDEN_BLOCKS)]


def test_hashing_is_deterministic_and_input_type_independent():
    root = HashContext("m").root()
    a = hash_blocks(root, TOKENS, 4)
    assert hash_blocks(root, list(TOKENS), 4) == a
    assert hash_block(root, np.array(TOKENS[:4], dtype=np.int32)) == a[0]
    assert hash_block(root, TOKENS[:4]) == a[0]


def test_chain_property():
    root = HashContext("m").root()
    tokens = list(range(16))
    base = hash_blocks(root, tokens, 4)
    assert len(base) == 4 and len(set(base)) == 4
    # a change in block 0 changes every later hash
    changed = hash_blocks(root, [99] + tokens[1:], 4)
    assert all(x != y for x, y in zip(base, changed))
    # a change in block 2 keeps blocks 0-1 and changes 2-3
    changed = hash_blocks(root, tokens[:9] + [99] + tokens[10:], 4)
    assert changed[:2] == base[:2]
    assert changed[2] != base[2] and changed[3] != base[3]
    # the same tokens in block 1 after a different block 0 hash differently (position matters)
    after_7 = hash_blocks(root, [7, 7, 7, 7, 1, 2, 3, 4], 4)[1]
    after_8 = hash_blocks(root, [8, 8, 8, 8, 1, 2, 3, 4], 4)[1]
    assert after_7 != after_8


def test_extra_keys_separate_chains():
    contexts = [
        HashContext("m"),
        HashContext("m", cache_salt="tenant-a"),
        HashContext("m", cache_salt="tenant-b"),
        HashContext("other-model"),
        HashContext("m", adapter_id="lora-1"),
        HashContext("m", kv_dtype="fp8"),
    ]
    roots = [c.root() for c in contexts]
    assert len(set(roots)) == len(roots)
    first_blocks = [hash_blocks(r, TOKENS, 4)[0] for r in roots]
    assert len(set(first_blocks)) == len(first_blocks)
    # the same context gives the same root
    assert HashContext("m", cache_salt="tenant-a").root() == roots[1]


def test_extra_keys_are_length_prefixed():
    # without length prefixes ("ab", "") and ("a", "b") would collide
    assert HashContext("ab").root() != HashContext("a", cache_salt="b").root()
    assert HashContext("m", cache_salt="x", adapter_id="").root() != HashContext("m", adapter_id="x").root()


@pytest.mark.parametrize("n, expected", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (9, 2)])
def test_only_full_blocks_are_hashed(n, expected):
    root = HashContext("m").root()
    assert len(hash_blocks(root, list(range(n)), 4)) == expected


def test_incremental_hashing_matches_full():
    root = HashContext("m").root()
    tokens = list(range(1, 14))
    full = hash_blocks(root, tokens, 4)
    assert len(full) == 3
    tail = hash_blocks(root, tokens, 4, start_block=1, parent=full[0])
    assert tail == full[1:]


def test_request_block_hashes_grow_with_tokens():
    root = HashContext("m").root()
    r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), hash_root=root)
    r.update_block_hashes(4)
    assert r.block_hashes == hash_blocks(root, [1, 2, 3, 4], 4)
    first = r.block_hashes[0]
    r.token_ids += [7, 8, 9]
    r.update_block_hashes(4)
    assert r.block_hashes[0] is first  # earlier hashes are kept, not recomputed
    assert r.block_hashes == hash_blocks(root, r.token_ids, 4)
    r.update_block_hashes(4)
    assert len(r.block_hashes) == 2


# -- the radix tree ------------------------------------------------------------------------------


def hx(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def cached_chain(cache: PrefixCache, names: list[str], first_id: int = 0,
                 parent: KVBlock | None = None) -> list[KVBlock]:
    out = []
    for i, name in enumerate(names):
        b = KVBlock(first_id + i, ref_count=1)
        cache.insert(b, hx(name), parent)
        out.append(b)
        parent = b
    return out


def test_match_returns_longest_cached_prefix():
    cache = PrefixCache()
    a, b, c = cached_chain(cache, ["A", "AB", "ABC"])
    assert cache.match([hx("A"), hx("AB"), hx("ABC"), hx("ABCD")]) == [a, b, c]
    assert cache.match([hx("A"), hx("AX"), hx("ABC")]) == [a]  # stops at the first miss
    assert cache.match([hx("X"), hx("AB")]) == []
    assert cache.match([]) == []
    assert len(cache) == 3 and hx("AB") in cache
    cache.check_integrity()


def test_insert_links_parents_and_children():
    cache = PrefixCache()
    a, b = cached_chain(cache, ["A", "AB"])
    (d,) = cached_chain(cache, ["AD"], first_id=5, parent=a)
    assert a.children == {hx("AB"): b, hx("AD"): d}
    assert b.parent is a and d.parent is a and a.parent is None
    tree = cache.tree()
    assert [n["block_id"] for n in tree] == [0]
    assert sorted(c["block_id"] for c in tree[0]["children"]) == [1, 5]
    cache.check_integrity()


def test_insert_rejects_duplicates_and_uncached_parents():
    cache = PrefixCache()
    (a,) = cached_chain(cache, ["A"])
    with pytest.raises(AssertionError):
        cache.insert(KVBlock(1, ref_count=1), hx("A"), None)
    with pytest.raises(AssertionError):
        cache.insert(KVBlock(2, ref_count=1), hx("B"), KVBlock(3, ref_count=1))
    with pytest.raises(AssertionError):
        cache.insert(a, hx("C"), None)  # already cached under another hash


def test_remove_only_leaves_and_parent_becomes_leaf():
    cache = PrefixCache()
    a, b = cached_chain(cache, ["A", "AB"])
    with pytest.raises(AssertionError):
        cache.remove(a)
    a.ref_count = b.ref_count = 0
    cache.remove(b)
    assert not b.is_cached and b.parent is None and a.children == {}
    assert cache.match([hx("A"), hx("AB")]) == [a]
    # a became an evictable leaf and was queued
    assert cache.pop_lru_leaf() is a
    assert len(cache) == 0 and cache.pop_lru_leaf() is None
    cache.check_integrity()


def test_pop_lru_leaf_skips_referenced_and_stale_entries():
    cache = PrefixCache()
    x = cached_chain(cache, ["X"], first_id=0)[0]
    y = cached_chain(cache, ["Y"], first_id=1)[0]
    x.ref_count = y.ref_count = 0
    x.last_access, y.last_access = 1, 2
    cache.push_leaf(x)
    cache.push_leaf(y)
    x.last_access = 3  # used again since it was queued; its old entry is stale
    cache.push_leaf(x)
    assert cache.eviction_order() == [1, 0]
    assert cache.pop_lru_leaf() is y
    x.ref_count = 1  # in use: not evictable whatever the heap says
    assert cache.pop_lru_leaf() is None
    assert len(cache) == 1
    cache.check_integrity()


def test_heap_compaction_keeps_order():
    cache = PrefixCache()
    blocks = [cached_chain(cache, [f"B{i}"], first_id=i)[0] for i in range(4)]
    for b in blocks:
        b.ref_count = 0
    # many re-pushes with fresh ticks force a compaction; only the newest tick counts
    tick = 0
    for _ in range(50):
        for b in reversed(blocks):
            tick += 1
            b.last_access = tick
            cache.push_leaf(b)
    assert len(cache._leaf_heap) <= 4 * len(cache) + 64
    assert cache.eviction_order() == [3, 2, 1, 0]
    assert [cache.pop_lru_leaf().block_id for _ in range(4)] == [3, 2, 1, 0]
    assert cache.pop_lru_leaf() is None


def test_check_integrity_catches_unlinked_block():
    cache = PrefixCache()
    a, b = cached_chain(cache, ["A", "AB"])
    cache.check_integrity()
    a.children.clear()
    with pytest.raises(AssertionError, match="not linked"):
        cache.check_integrity()
