"""A stateful model test of KVCacheManager: random schedules of add, prefill, decode, fork, finish,
preempt and evict over a tiny pool, with a small token alphabet so that prefixes collide and are
shared. The model keeps its own record of which tokens each block holds, and under which tenant
salt they were written (`shadow`), updated when a request computes into a block and carried over on
every BlockCopy, so a prefix hit or a missing copy-on-write that hands a request the wrong tokens
(or another tenant's) is caught, not only a miscount.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.worker.block_hash import HashContext, hash_block
from kvstrata.worker.kv_cache_manager import NO_COMPUTED_BLOCKS, KVCacheManager
from kvstrata.worker.request import Request
from kvstrata.worker.sampling_params import SamplingParams

NUM_BLOCKS = 16
BLOCK_SIZE = 4
MAX_LIVE = 8
SALT_TO_ROOT = {salt: HashContext("m", cache_salt=salt).root() for salt in ("", "tenant-b")}
ROOTS = list(SALT_TO_ROOT.values())
PREFIXES = [
    [1, 1, 1, 1, 2, 2, 2, 2],
    [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
    [1, 1, 1, 1, 3, 3, 3, 3],
    [2, 2, 2, 2],
    [1, 2],
]
SUFFIXES = st.one_of(st.just([]), st.lists(st.integers(1, 3), max_size=6))  # often block-aligned
PARAMS = SamplingParams(max_tokens=64)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0.125)  # admission keeps 2 blocks
        self.waiting: list[Request] = []  # no blocks, num_computed_tokens == 0
        self.running: list[Request] = []  # holding blocks, maybe mid-prefill
        self.shadow: dict[int, tuple[int, ...]] = {}  # block id -> tokens written into it
        self.shadow_tenant: dict[int, str] = {}  # block id -> cache salt of whoever wrote it
        self.tenant: dict[str, str] = {}  # request id -> cache salt
        self.family: dict[str, int] = {}  # forks share a family; only they may share uncached blocks
        self._family_ids = itertools.count()
        self.num_requests = 0
        self.history: list[tuple[tuple[int, ...], str]] = []  # earlier prompts and sequences, and salts

    # -- helpers ---------------------------------------------------------------------------------
    def _live(self) -> list[Request]:
        return self.waiting + self.running

    def _snapshot(self):
        pool = self.m.pool
        return (
            [b.ref_count for b in pool.blocks],
            list(pool.free_ids),
            pool.num_cached_unused,
            pool.num_evictions,
            sorted(pool.prefix_cache.hash_to_block),
            [(r.request_id, [b.block_id for b in r.block_table], r.num_computed_tokens,
              r.num_registered_blocks) for r in self._live()],
            list(self.m.pending_copies),
        )

    def _add(self, tokens: list[int], salt: str) -> None:
        self.num_requests += 1
        r = Request(f"r{self.num_requests}", tokens, PARAMS, hash_root=SALT_TO_ROOT[salt])
        self.tenant[r.request_id] = salt
        self.history.append((tuple(tokens), salt))
        self.waiting.append(r)

    @staticmethod
    def _pick(data, requests: list[Request]) -> Request:
        # draw an index, not the Request, so a failing example prints short
        return requests[data.draw(st.integers(0, len(requests) - 1), label="index")]

    def _apply_copies(self) -> None:
        for copy in self.m.drain_copies():
            self.shadow[copy.dst] = self.shadow[copy.src]
            self.shadow_tenant[copy.dst] = self.shadow_tenant[copy.src]

    def _write(self, r: Request, num_new: int) -> None:
        """Record that r computes tokens [num_computed, num_computed + num_new) into its blocks."""
        bs = BLOCK_SIZE
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + num_new):
            idx, off = divmod(pos, bs)
            block_id = r.block_table[idx].block_id
            held = self.shadow.get(block_id, ()) if off else ()
            assert held == tuple(r.token_ids[idx * bs : pos]), (
                f"{r.request_id} writes token {pos} into block {block_id}, which holds {held}"
            )
            self.shadow[block_id] = held + (r.token_ids[pos],)
            if not off:
                self.shadow_tenant[block_id] = self.tenant[r.request_id]
        r.num_computed_tokens += num_new

    def _compute(self, r: Request, num_new: int, computed=NO_COMPUTED_BLOCKS, watermark=False) -> bool:
        """allocate_slots, and on success compute the tokens and cache full blocks; all or nothing."""
        before = self._snapshot()
        ok = self.m.allocate_slots(r, num_new, computed, watermark=watermark)
        if not ok:
            assert self._snapshot() == before, "a failed allocate_slots changed state"
            return False
        self._apply_copies()
        self._write(r, num_new)
        self.m.cache_full_blocks(r)
        return True

    # -- rules -----------------------------------------------------------------------------------
    @precondition(lambda self: len(self._live()) < MAX_LIVE)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=SUFFIXES, salt=st.sampled_from(sorted(SALT_TO_ROOT)))
    def add_request(self, prefix, suffix, salt):
        self._add(prefix + suffix, salt)

    @precondition(lambda self: len(self._live()) < MAX_LIVE and self.history)
    @rule(data=st.data(), suffix=SUFFIXES)
    def add_follow_up(self, data, suffix):
        """A next turn: an earlier request's tokens (prompt and output) plus a few more."""
        tokens, salt = self.history[data.draw(st.integers(0, len(self.history) - 1), label="turn")]
        self._add(list(tokens) + suffix, salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def schedule(self, data, chunk):
        r = self._pick(data, self.waiting)
        computed = self.m.get_computed_blocks(r)
        n = len(computed.blocks)
        assert computed.num_tokens == n * BLOCK_SIZE
        assert n <= (r.num_tokens - 1) // BLOCK_SIZE, "the last token must be recomputed"
        for i, b in enumerate(computed.blocks):
            assert b.block_hash == r.block_hashes[i]
            assert self.shadow[b.block_id] == tuple(r.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), (
                f"prefix hit on block {b.block_id} for {r.request_id} holds other tokens"
            )
        num_new = min(chunk, r.num_tokens - computed.num_tokens)
        assert num_new >= 1
        if self._compute(r, num_new, computed, watermark=True):  # admission honours the watermark
            self.waiting.remove(r)
            self.running.append(r)
            self.family[r.request_id] = next(self._family_ids)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running))
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def prefill_more(self, data, chunk):
        r = self._pick(data, [r for r in self.running if r.num_computed_tokens < r.num_tokens])
        self._compute(r, min(chunk, r.num_tokens - r.num_computed_tokens))

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data(), tokens=st.lists(st.integers(1, 3), min_size=1, max_size=8))
    def decode(self, data, tokens):
        """A few decode steps of one request: append the sampled token, then compute it."""
        r = self._pick(data, [r for r in self.running if r.num_computed_tokens == r.num_tokens])
        for token in tokens:
            r.token_ids.append(token)
            if not self._compute(r, 1):
                r.token_ids.pop()
                break

    @precondition(lambda self: len(self._live()) < MAX_LIVE
                  and any(r.num_computed_tokens == r.num_tokens for r in self.running))
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, [r for r in self.running if r.num_computed_tokens == r.num_tokens])
        self.num_requests += 1
        child = Request(f"r{self.num_requests}", parent.prompt_token_ids, PARAMS, hash_root=parent.hash_root,
                        token_ids=list(parent.token_ids))
        self.m.fork(parent, child)
        self.running.append(child)
        self.family[child.request_id] = self.family[parent.request_id]
        self.tenant[child.request_id] = self.tenant[parent.request_id]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        r = self._pick(data, self.running)
        self.m.free(r)
        self.running.remove(r)
        self.history.append((tuple(r.token_ids), self.tenant[r.request_id]))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        """Preemption by recompute: release everything; the next schedule starts from prefix hits."""
        r = self._pick(data, self.running)
        self.m.free(r)
        r.num_computed_tokens = 0
        self.running.remove(r)
        self.waiting.append(r)

    @rule(k=st.integers(0, 3))
    def evict(self, k):
        pool = self.m.pool
        num_cached_unused, num_evictions = pool.num_cached_unused, pool.num_evictions
        num_free_list = len(pool.free_ids)
        assert pool.evict(k) == min(k, num_cached_unused)
        n = min(k, num_cached_unused)
        assert pool.num_evictions == num_evictions + n
        assert len(pool.free_ids) == num_free_list + n

    @precondition(lambda self: self.num_requests % 5 == 0)  # now and then, so the cache can fill
    @rule()
    def reset_prefix_cache(self):
        pool = self.m.pool
        num_cached_unused = pool.num_cached_unused
        assert pool.reset_prefix_cache() == num_cached_unused
        assert all(b.ref_count > 0 for b in pool.prefix_cache.hash_to_block.values())

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.m.check_integrity(self._live())
        assert not self.m.pending_copies

    @invariant()
    def accounting(self):
        pool = self.m.pool
        assert pool.num_free_blocks + pool.num_used_blocks == NUM_BLOCKS
        unused_cached = [b for b in pool.blocks if b.is_cached and b.ref_count == 0]
        assert pool.num_free_blocks == len(pool.free_ids) + len(unused_cached)

    @invariant()
    def free_blocks_are_really_reusable(self):
        """Every cached, unreferenced block counted as free can be evicted eventually: none has a
        descendant that a request still holds (otherwise can_allocate over-promises)."""

        def in_use_below(b) -> bool:
            return any(c.ref_count > 0 or in_use_below(c) for c in b.children.values())

        for b in self.m.pool.blocks:
            if b.is_cached and b.ref_count == 0:
                assert not in_use_below(b), (
                    f"block {b.block_id} counts as free but has an in-use cached descendant"
                )

    @invariant()
    def tables_match_computed_tokens(self):
        for r in self.waiting:
            assert r.block_table == [] and r.num_computed_tokens == 0
        for r in self.running:
            assert 0 < r.num_computed_tokens <= r.num_tokens
            assert len(r.block_table) == self.m.blocks_for(r.num_computed_tokens)

    @invariant()
    def sharing_only_of_cached_or_forked_blocks(self):
        holders: dict[int, list[Request]] = {}
        for r in self.running:
            for b in r.block_table:
                holders.setdefault(b.block_id, []).append(r)
        for block_id, rs in holders.items():
            b = self.m.pool.blocks[block_id]
            if len(rs) > 1 and not b.is_cached:
                assert len({self.family[r.request_id] for r in rs}) == 1, (
                    f"uncached block {block_id} shared by unrelated requests {[r.request_id for r in rs]}"
                )

    @invariant()
    def blocks_hold_the_requests_tokens(self):
        bs = BLOCK_SIZE
        for r in self.running:
            for i, b in enumerate(r.block_table):
                expected = tuple(r.token_ids[i * bs : min((i + 1) * bs, r.num_computed_tokens)])
                assert self.shadow.get(b.block_id) == expected, (
                    f"{r.request_id} block {i} (id {b.block_id}) holds "
                    f"{self.shadow.get(b.block_id)}, expected {expected}"
                )
                assert self.shadow_tenant[b.block_id] == self.tenant[r.request_id], (
                    f"{r.request_id} holds block {b.block_id}, written under another tenant's salt"
                )
                if b.is_cached:
                    assert b.block_hash == r.block_hashes[i]

    @invariant()
    def cached_hashes_match_contents(self):
        for h, b in self.m.pool.prefix_cache.hash_to_block.items():
            tokens = self.shadow[b.block_id]
            assert len(tokens) == BLOCK_SIZE, f"cached block {b.block_id} is not full"
            if b.parent is not None:
                assert h == hash_block(b.parent.block_hash, tokens)
            else:
                assert h in {hash_block(root, tokens) for root in ROOTS}


KVCacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    # no Phase.explain: it reruns a failure many times over and can take a minute
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheManagerStateful = KVCacheMachine.TestCase
