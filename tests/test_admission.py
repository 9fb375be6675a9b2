"""The NVMe admission policy: reuse counts follow a block through the tiers, and a full NVMe tier
takes only blocks that were reused (or pinned) under `reuse`, everything under `all`."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.tiering.admission import AdmissionPolicy
from kvstrata.tiering.host import HostTier
from kvstrata.worker.block_pool import BlockPool
from kvstrata.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.mark.parametrize(("mode", "hits", "computed", "pinned", "full", "admitted"), [
    ("reuse", 0, 1, False, False, True),  # room on the disk: everything goes
    ("reuse", 0, 1, False, True, False),  # full, computed once, never reused: kept off
    ("reuse", 1, 1, False, True, True),  # reused
    ("reuse", 0, 2, False, True, True),  # missed once and computed again
    ("reuse", 0, 0, True, True, True),  # pins are never dropped
    ("all", 0, 1, False, True, True),
])
def test_admission_rule(mode, hits, computed, pinned, full, admitted):
    assert AdmissionPolicy(mode).admits(hits, computed, pinned, full) is admitted


def test_an_unknown_mode_names_the_option():
    with pytest.raises(ValueError, match="nvme_admission"):
        AdmissionPolicy("sometimes")


def test_the_pool_counts_hits_and_reports_them_on_eviction():
    pool = BlockPool(2)
    evicted = []
    pool.on_evict = evicted.extend
    a, b = pool.allocate(2)
    pool.cache(a, b"a", None)
    pool.cache(b, b"b", a)
    a.hits, b.hits = 3, 1
    pool.free([b, a])
    pool.allocate(2)  # reuses both cached blocks, leaf first
    assert [(e.block_hash, e.parent_hash, e.hits) for e in evicted] == [(b"b", b"a", 1), (b"a", None, 3)]
    assert a.hits == b.hits == 0  # a reused block starts over


def test_the_dram_tier_carries_hits_down_and_keeps_the_larger_count():
    host = HostTier(1, (2,), torch.float32)
    host.put([b"a"], [None], torch.ones(1, 2), hits=[2])
    host.put([b"a"], [None], torch.ones(1, 2), hits=[1])  # a refresh never lowers it
    assert host.entries[b"a"].hits == 2
    (out,) = host.put([b"b"], [None], torch.zeros(1, 2))
    assert (out.block_hash, out.hits) == (b"a", 2)


# -- the engine: a reused conversation against a flood of one-shot prompts ----------------------------
def _block_bytes(llm) -> int:
    from kvstrata.worker.model_runner import ModelRunner

    return ModelRunner.kv_bytes_per_block(llm.engine.runner.model, 16)


def _run(llm, ids):
    return llm.generate([ids], GREEDY)[0]


@pytest.mark.parametrize("mode", ["reuse", "all"])
def test_a_full_disk_keeps_reused_blocks_under_reuse_only(llm, tmp_path, mode):
    from kvstrata import LLM

    bb = _block_bytes(llm)
    # 16 device blocks, 16 in DRAM (a request loads at most half of it from disk), 40 on disk
    tiered = LLM("smollm2-135m", num_gpu_blocks=16, cpu_kv_bytes=16 * bb, nvme_kv_dir=str(tmp_path),
                 nvme_kv_bytes=40 * bb, nvme_admission=mode)
    try:
        rng = random.Random(11)
        history = [rng.randrange(100, 40000) for _ in range(113)]  # 7 full blocks; 7 can be hits
        assert _run(tiered, history).num_cached_tokens == 0
        assert _run(tiered, history).num_cached_tokens == 112  # a reuse: its blocks now count one hit
        for _ in range(14):  # one-shot prompts: 112 blocks, never reused, far more than every tier holds
            _run(tiered, [rng.randrange(100, 40000) for _ in range(113)])
        tiered.engine.kv.tiers.nvme.flush()
        again = _run(tiered, history)
        nvme = tiered.cache_stats()["tiers"]["nvme"]
        assert nvme["admission"] == mode
        if mode == "reuse":
            assert again.num_cached_tokens == 112 and nvme["admission_rejects"] > 0
        else:
            assert again.num_cached_tokens == 0 and nvme["admission_rejects"] == 0
        tiered.check_integrity()
    finally:
        tiered.close()


def test_llm_rejects_an_unknown_admission_mode():
    from kvstrata import LLM

    with pytest.raises(ValueError, match="nvme_admission"):
        LLM("smollm2-135m", num_gpu_blocks=16, nvme_admission="maybe")


def test_a_block_computed_twice_earns_a_place_on_a_full_disk(tmp_path):
    from kvstrata.tiering.manager import TierManager
    from kvstrata.tiering.nvme import NvmeTier
    from kvstrata.worker.prefix_cache import EvictedBlock

    kv = torch.zeros(1, 2, 4, 1, 1, 2)  # [layers, K/V, blocks, block size, heads, head dim]
    shape = (1, 2, 1, 1, 2)
    host = HostTier(1, shape, torch.float32)
    nvme = NvmeTier(tmp_path, 2 * 4096, shape, torch.float32)  # room for one slot: header, then payload
    tiers = TierManager(kv, host, nvme)
    try:
        def demote(h: bytes) -> None:  # DRAM holds one block, so each demotion spills the one before
            tiers.demote([EvictedBlock(0, h, None, 0)])
            nvme.flush()

        demote(b"a")
        demote(b"b")  # spills a: the disk had room
        assert b"a" in nvme
        demote(b"c")  # spills b, computed once and never reused: kept off the full disk
        assert b"b" not in nvme and tiers.counters.admission_rejects == 1
        tiers.note_computed([b"c", b"c"])  # c missed and was computed again
        demote(b"d")
        assert b"c" in nvme and b"a" not in nvme  # c took a's place
        tiers.check_integrity()
    finally:
        tiers.close()
