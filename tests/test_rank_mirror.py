"""Another tensor-parallel rank's tiers repeat rank 0's ops (tiering/rank_mirror.py): driven by the
ops a real TierManager logs, a mirror over the same KV ends with the same DRAM slots and NVMe blocks,
and a block the mirror could not read is a miss for both."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvstrata.tiering.host import HostTier
from kvstrata.tiering.block_copy import block_shape
from kvstrata.tiering.manager import TierManager
from kvstrata.tiering.nvme import NvmeTier
from kvstrata.tiering.rank_mirror import READING, SPILL, RankTiers, decode_hashes, encode_hashes, read_status
from kvstrata.worker.prefix_cache import EvictedBlock
from tests.nvme_files import flip_every_payload

NUM_BLOCKS, DRAM_SLOTS = 12, 4


def _hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _nvme(directory, kv: torch.Tensor) -> NvmeTier:
    return NvmeTier(directory, 1 << 22, block_shape(kv), kv.dtype, layout_tag="mirror-test")


@pytest.fixture
def pair(tmp_path):
    """(rank 0's TierManager, another rank's RankTiers), each over its own copy of the same KV."""
    kv = torch.randn(2, 2, NUM_BLOCKS, 4, 2, 8)
    manager = TierManager(kv, HostTier(DRAM_SLOTS, block_shape(kv), kv.dtype), _nvme(tmp_path / "rank-0", kv))
    manager.copy_log, manager.group_reads = [], {}
    mirror = RankTiers(kv.clone(), DRAM_SLOTS, _nvme(tmp_path / "rank-1", kv))
    yield manager, mirror
    manager.close()
    mirror.close()


def _same_tiers(manager: TierManager, mirror: RankTiers) -> None:
    for h, entry in manager.host.entries.items():
        assert torch.equal(manager.host.storage[entry.slot], mirror.storage[entry.slot]), h.hex()[:8]
    manager.nvme.flush()
    mirror.nvme.flush()
    assert sorted(manager.nvme.hashes()) == sorted(mirror.nvme.hashes())
    for h in manager.nvme.hashes():
        assert torch.equal(manager.nvme.get(h).result(), mirror.nvme.get(h).result())


def _demote_all(manager: TierManager, mirror: RankTiers) -> list[bytes]:
    """Every pool block down to DRAM, 4 at a time, in a chain: DRAM keeps the last 4, NVMe the rest."""
    hashes = [_hash(i) for i in range(NUM_BLOCKS)]
    for start in range(0, NUM_BLOCKS, 4):
        manager.demote([EvictedBlock(i, hashes[i], hashes[i - 1] if i else None, 0) for i in range(start, start + 4)])
        mirror.apply(manager.drain_copy_log())
    return hashes


def _agree(manager: TierManager, mirror: RankTiers) -> None:
    """What every step does: the group's read status of the pending loads is the least of the ranks'."""
    ids = manager.pending_load_ids()
    for future in [load.future for load in manager.loads] + list(mirror.loads.values()):
        future.result(timeout=10)
    mine = manager.load_statuses(ids)
    theirs = mirror.statuses(ids)
    manager.note_group_reads(ids, [min(a, b) for a, b in zip(mine, theirs)])


def test_hashes_round_trip_as_words():
    hashes = [_hash(1), b"", b"\x00" * 7, bytes(range(9))]
    words = encode_hashes(hashes)
    assert all(isinstance(w, int) for w in words) and words[0] == 32 and len(words) == 5 + 1 + 2 + 3
    assert decode_hashes(words) == hashes


def test_a_mirror_repeats_demotion_spills_loads_and_clear(pair):
    manager, mirror = pair
    hashes = _demote_all(manager, mirror)
    manager.nvme.flush()
    assert len(manager.nvme.hashes()) == NUM_BLOCKS - DRAM_SLOTS
    _same_tiers(manager, mirror)

    n, waiting = manager.lookup(hashes[:4])  # on NVMe only: a load starts on both ranks
    assert (n, waiting) == (0, True)
    mirror.apply(manager.drain_copy_log())
    assert manager.pending_load_ids() and not manager.host.match(hashes[:4])
    manager.poll()  # without the group's answer nothing is committed, however far rank 0 read
    assert manager.loads and not manager.host.match(hashes[:4])
    _agree(manager, mirror)
    manager.poll()
    mirror.apply(manager.drain_copy_log())
    k = manager.max_load_blocks  # a load takes at most half of DRAM
    assert k == 2 and manager.host.match(hashes[:4]) == k and not mirror.loads and not manager.loads
    assert manager.counters.loaded_from_nvme == k and manager.counters.failed_loads == 0
    _same_tiers(manager, mirror)  # the loaded blocks sit in the same slots on both; what they evicted spilled on both

    manager.clear()
    mirror.apply(manager.drain_copy_log())
    mirror.nvme.flush()
    assert not mirror.nvme.hashes() and not manager.nvme.hashes()


def test_a_block_the_other_rank_cannot_read_is_a_miss_for_both(pair, tmp_path):
    manager, mirror = pair
    hashes = _demote_all(manager, mirror)
    mirror.nvme.flush()
    mirror.nvme.close()
    assert flip_every_payload(tmp_path / "rank-1") > 0
    mirror.nvme = _nvme(tmp_path / "rank-1", mirror.kv_cache)  # reopened: its files are damaged
    manager.lookup(hashes[:4])
    mirror.apply(manager.drain_copy_log())
    _agree(manager, mirror)
    manager.poll()
    mirror.apply(manager.drain_copy_log())
    k = manager.max_load_blocks
    assert manager.host.match(hashes[:4]) == 0 and manager.counters.failed_loads == k
    assert not any(h in manager.nvme for h in hashes[:k]) and hashes[k] in manager.nvme  # rank 0 drops its copies: written anew next time


def test_read_status_counts_the_blocks_read_from_the_first():
    from concurrent.futures import Future

    pending, done, failed = Future(), Future(), Future()
    done.set_result([torch.zeros(1), torch.zeros(1), None, torch.zeros(1)])
    failed.set_exception(OSError("disk"))
    assert [read_status(f) for f in (pending, done, failed, None)] == [READING, 2, 0, 0]


def test_a_mirror_puts_each_run_of_spills_together_and_leaves_no_copy_behind(pair, monkeypatch):
    manager, mirror = pair
    calls: list[int] = []
    put_many = mirror.nvme.put_many

    def recording(blocks):
        calls.append(len(blocks))
        return put_many(blocks)

    monkeypatch.setattr(mirror.nvme, "put_many", recording)
    _demote_all(manager, mirror)  # the last two demotions each spill four blocks from DRAM
    assert calls == [4, 4] and mirror.nvme.num_staged == 0
    _same_tiers(manager, mirror)
    staged = mirror.nvme._staged
    if staged.enabled:  # the copies were staged in write buffers, all handed back once written
        assert len(staged.buffers) >= 4
    spill = (SPILL, [0], encode_hashes([_hash(100), b""]))  # DRAM slot 0 to NVMe, then an op no rank knows
    with pytest.raises(ValueError, match="unknown tier op"):
        mirror.apply([spill, (99, [], [])])
    mirror.nvme.flush()
    assert mirror.nvme.num_staged == 0 and _hash(100) not in mirror.nvme  # its copy went back, not put


def test_a_spill_of_a_block_the_rank_holds_on_nvme_refreshes_it_without_a_copy(pair, monkeypatch):
    manager, mirror = pair
    _demote_all(manager, mirror)
    mirror.nvme.flush()
    held = next(iter(mirror.nvme.hashes()))
    copies: list[int] = []
    staged_copy = mirror.nvme.staged_copy

    def counting(block):
        copies.append(1)
        return staged_copy(block)

    monkeypatch.setattr(mirror.nvme, "staged_copy", counting)
    mirror.apply([(SPILL, [0], encode_hashes([held, b""])), (SPILL, [1], encode_hashes([_hash(101), b""]))])
    mirror.nvme.flush()
    assert copies == [1]  # only the block the rank did not hold was copied out
    assert held in mirror.nvme and _hash(101) in mirror.nvme and mirror.nvme.num_staged == 0
