"""A burst of puts queued together (NvmeTier.put_many): the IO threads share it out evenly, each share
in runs of adjacent slots; blocks are as recent as their take, so a burst is evicted in slot order
and its slots are reused as runs; a bug in one share does not strand the rest of the queue; and the
tier manager spills each DRAM eviction as one burst."""

from __future__ import annotations

import random
import threading

import pytest

from kvstrata.tiering import nvme
from kvstrata.tiering.slab import SlabFiles
from tests.test_nvme_tier import SLOT, data_of, h, offset_of, same, tier_at


@pytest.fixture
def recorded_writes(monkeypatch):
    """Every pwrite of staged slots, as (first slot, slots)."""
    runs: list[tuple[int, int]] = []
    lock = threading.Lock()
    write = SlabFiles.write

    def recording(self, slot, data):
        with lock:
            runs.append((slot, len(data) // self.geometry.slot_bytes))
        return write(self, slot, data)

    monkeypatch.setattr(SlabFiles, "write", recording)
    return runs


def burst(names: list[str]) -> list:
    return [(h(n), None, data_of(n)) for n in names]


def test_the_io_threads_share_a_burst_out_evenly(tmp_path, recorded_writes):
    names = [f"b{i}" for i in range(16)]
    tier = tier_at(tmp_path / "nvme", capacity=32 * SLOT, num_io_threads=4, c_io=False)
    assert tier._io.max_run >= len(names)  # one thread could take the whole burst in one run
    futures = tier.put_many(burst(names))
    assert [f.result(timeout=10) for f in futures] == [True] * len(names)
    # each take is a quarter of what is queued, rounded up: 16 -> 4, 12 -> 3, 9 -> 3, 6 -> 2, then ones;
    # free slots go lowest first, so each take is one run of adjacent slots
    assert sorted(recorded_writes) == [(0, 4), (4, 3), (7, 3), (10, 2), (12, 1), (13, 1), (14, 1), (15, 1)]
    assert [offset_of(tier, h(n)) for n in names] == [i * SLOT for i in range(len(names))]
    assert all(same(got, data_of(n)) for n, got in zip(names, tier.get_many([h(n) for n in names]).result()))
    tier.check_integrity()
    tier.close()


def test_put_many_checks_every_block_before_it_queues_any(tmp_path):
    tier = tier_at(tmp_path / "nvme")
    staged = tier.staged_copy(data_of("a"))
    with pytest.raises(ValueError, match="data must be"):
        tier.put_many([(h("a"), None, staged), (h("b"), None, data_of("b")[:1])])
    with pytest.raises(ValueError, match="parent_hash"):
        tier.put_many([(h("a"), None, staged), (h("b"), h("b"), data_of("b"))])
    assert len(tier) == 0 and tier.num_pending_writes == 0 and tier.num_staged == 1  # still the caller's
    futures = tier.put_many([(h("a"), None, staged), (h("a"), None, data_of("a")), (h("b"), h("a"), data_of("b"))])
    assert [f.result(timeout=10) for f in futures] == [True, True, True]  # the second a is the first's write
    assert tier.num_staged == 0 and same(tier.get(h("a")).result(), data_of("a"))
    tier.check_integrity()
    tier.close()


def test_a_burst_is_as_recent_as_its_takes_not_its_ends(tmp_path, monkeypatch):
    """b0's write is held while the other thread writes b1-b3; b0 still goes first when the tier
    evicts, so the slots of a burst come back in slot order."""
    monkeypatch.setattr(nvme, "RUN_BYTES", SLOT)  # one block a take
    started, release = threading.Event(), threading.Event()
    write = SlabFiles.write

    def hold_slot_0(self, slot, data):
        if slot == 0:
            started.set()
            assert release.wait(10)
        return write(self, slot, data)

    monkeypatch.setattr(SlabFiles, "write", hold_slot_0)
    names = ["b0", "b1", "b2", "b3"]
    tier = tier_at(tmp_path / "nvme", capacity=4 * SLOT, num_io_threads=2, c_io=False)
    futures = tier.put_many(burst(names))
    assert started.wait(10)
    assert [f.result(timeout=10) for f in futures[1:]] == [True] * 3  # written while b0 waits
    release.set()
    assert futures[0].result(timeout=10) is True
    for i, name in enumerate(["x0", "x1"]):  # each evicts the least recently used block
        assert tier.put(h(name), None, data_of(name)).result(timeout=10) is True
        assert offset_of(tier, h(name)) == i * SLOT
    assert [h(n) in tier for n in names] == [False, False, True, True]
    tier.check_integrity()
    tier.close()


def test_a_bug_in_one_share_leaves_the_rest_of_the_queue_written(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "RUN_BYTES", SLOT)  # one block a take, all on the one IO thread
    names = [f"b{i}" for i in range(6)]
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, num_io_threads=1, c_io=False)
    write = tier._io.write

    def buggy(writes):
        if any(w.block_hash == h("b0") for w in writes):
            raise RuntimeError("injected bug")
        return write(writes)

    monkeypatch.setattr(tier._io, "write", buggy)
    futures = tier.put_many(burst(names))
    assert [f.result(timeout=10) for f in futures] == [False] + [True] * 5
    tier.flush()
    assert h("b0") not in tier and len(tier) == 5 and tier.num_pending_writes == 0
    tier.check_integrity()
    tier.close()


def test_the_manager_spills_each_dram_eviction_as_one_burst(llm, tmp_path):
    from tests.test_tiering import GREEDY, _nvme_llm

    tiered = _nvme_llm(llm, tmp_path)
    try:
        tier = tiered.engine.kv.tiers.nvme
        calls: list[int] = []
        put_many = tier.put_many

        def recording(blocks):
            calls.append(len(blocks))
            return put_many(blocks)

        tier.put_many = recording
        tiered.engine.kv.tiers.max_pending_writes = 4  # a burst counts against the bound as it is gathered
        rng = random.Random(11)
        prompts = [[rng.randrange(100, 40000) for _ in range(160)] for _ in range(6)]
        for p in prompts:
            tiered.generate([p], GREEDY)
        tier.flush()
        stats = tiered.cache_stats()["tiers"]["nvme"]
        assert calls and max(calls) > 1, calls  # several blocks in one call
        assert max(calls) <= 4 and sum(calls) == stats["spilled_blocks"]
        tiered.check_integrity()
    finally:
        tiered.close()


def test_refreshes_in_a_burst_do_not_count_against_the_pending_bound(tmp_path):
    """Of a burst of spills, only blocks not on NVMe yet are new writes: two blocks already there
    come first, and with room for one pending write the first new block is still queued."""
    import torch

    from kvstrata.tiering.block_copy import block_shape
    from kvstrata.tiering.host import Evicted, HostTier
    from kvstrata.tiering.manager import TierManager
    from kvstrata.tiering.nvme import NvmeTier

    kv = torch.randn(2, 2, 8, 4, 2, 8)
    shape = block_shape(kv)
    manager = TierManager(kv, HostTier(4, shape, kv.dtype), NvmeTier(tmp_path / "nvme", 1 << 22, shape, kv.dtype))
    try:
        nvme = manager.nvme
        blocks = {n: torch.randn(shape) for n in ("old0", "old1", "new0", "new1")}
        for n in ("old0", "old1"):
            assert nvme.put(h(n), None, blocks[n]).result(timeout=10) is True
        manager.max_pending_writes = 1
        manager._spill([Evicted(h(n), None, blocks[n].clone()) for n in blocks], 0)
        nvme.flush()
        assert manager.counters.spill_drops == 1  # new1 only: new0 was the one pending write
        assert [h(n) in nvme for n in blocks] == [True, True, True, False]
        manager.check_integrity()
    finally:
        manager.close()


def test_a_put_without_data_only_refreshes(tmp_path):
    """data None: a block the tier holds becomes the most recent (its future True, nothing written);
    one it does not hold is not stored (False), and nothing is queued for it."""
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, num_io_threads=1)
    try:
        assert all(f.result(timeout=10) for f in tier.put_many(burst(["a", "b"])))
        before = tier._index.get(h("a")).last_access
        refreshed, missing = tier.put_many([(h("a"), None, None), (h("z"), None, None)])
        assert refreshed.result(timeout=10) is True and missing.result(timeout=10) is False
        assert tier._index.get(h("a")).last_access > tier._index.get(h("b")).last_access > before
        tier.flush()
        assert h("z") not in tier and len(tier) == 2
        stats = tier.stats()
        assert (stats["writes"], stats["write_failures"]) == (2, 0)  # no write was tried for either
        assert same(tier.get(h("a")).result(timeout=10), data_of("a"))
        tier.check_integrity()
    finally:
        tier.close()


def test_dram_evicts_a_block_nvme_holds_without_copying_it(tmp_path):
    """A block that leaves DRAM while NVMe holds it is only refreshed there: DRAM makes no staged
    copy of it (none of its CRC either), and a block NVMe does not hold is still copied and written."""
    import torch

    from kvstrata.tiering.block_copy import block_shape
    from kvstrata.tiering.host import HostTier
    from kvstrata.tiering.manager import TierManager
    from kvstrata.tiering.nvme import NvmeTier

    kv = torch.randn(2, 2, 8, 4, 2, 8)
    shape = block_shape(kv)
    manager = TierManager(kv, HostTier(2, shape, kv.dtype), NvmeTier(tmp_path / "nvme", 1 << 22, shape, kv.dtype))
    try:
        nvme, host = manager.nvme, manager.host
        copies: list[int] = []
        staged_copy = host.copy_out
        host.copy_out = lambda block: copies.append(1) or staged_copy(block)
        blocks = {n: kv[:, :, i].contiguous() for i, n in enumerate(("on_disk", "fresh", "x", "y"))}
        assert nvme.put(h("on_disk"), None, blocks["on_disk"]).result(timeout=10) is True
        host.put([h("on_disk"), h("fresh")], [None, None], torch.stack([blocks["on_disk"], blocks["fresh"]]))
        manager._spill(host.put([h("x"), h("y")], [None, None], torch.stack([blocks["x"], blocks["y"]])), 0)
        nvme.flush()
        assert len(copies) == 1  # "fresh" only
        assert manager.counters.spill_refreshes == 1 and manager.counters.spilled_to_nvme == 2
        assert manager.stats()["nvme"]["spill_refreshes"] == 1
        for n in ("on_disk", "fresh"):
            assert same(nvme.get(h(n)).result(timeout=10), blocks[n])
        manager.check_integrity()
    finally:
        manager.close()


def test_a_copyless_spill_of_a_block_nvme_has_lost_since_is_dropped(tmp_path):
    """DRAM made no copy because NVMe held the block; if NVMe evicted it before the spill, there is
    nothing to put: no put, no refresh counted, nothing recorded as stored."""
    import torch

    from kvstrata.tiering.block_copy import block_shape
    from kvstrata.tiering.host import Evicted, HostTier
    from kvstrata.tiering.manager import TierManager
    from kvstrata.tiering.nvme import NvmeTier

    kv = torch.randn(2, 2, 8, 4, 2, 8)
    shape = block_shape(kv)
    manager = TierManager(kv, HostTier(2, shape, kv.dtype), NvmeTier(tmp_path / "nvme", 1 << 22, shape, kv.dtype))
    try:
        calls: list[int] = []
        put_many = manager.nvme.put_many
        manager.nvme.put_many = lambda blocks: calls.append(len(blocks)) or put_many(blocks)
        manager._spill([Evicted(h("gone"), None, None)], 0)
        assert calls == [] and h("gone") not in manager.nvme
        c = manager.counters
        assert (c.spilled_to_nvme, c.spill_refreshes, c.spill_drops, c.admission_rejects) == (0, 0, 0, 0)
        manager.check_integrity()
    finally:
        manager.close()
