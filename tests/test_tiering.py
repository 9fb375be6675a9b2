"""KV tiers below the device pool: the DRAM tier on its own, and the engine with DRAM (and NVMe)
tiers keeping what a small device pool evicts, with outputs identical to a roomy pool."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.tiering.host import HostTier
from kvstrata.worker.sampling_params import SamplingParams
from tests.nvme_files import flip_every_payload

SHAPE = (2, 2, 4, 1, 3)  # (layers, K/V, block size, kv heads, head dim)


def _blocks(*values: float) -> torch.Tensor:
    return torch.stack([torch.full(SHAPE, float(v)) for v in values])


# -- the DRAM tier ----------------------------------------------------------------------------------
def test_host_tier_round_trip_and_chain_match():
    t = HostTier(4, SHAPE, torch.float32)
    assert t.put([b"a", b"b"], [None, b"a"], _blocks(1, 2)) == []
    assert t.match([b"a", b"b", b"c"]) == 2 and t.match([b"b"]) == 1 and t.match([b"x", b"a"]) == 0
    data = t.take([b"a", b"b"])
    assert torch.equal(data, _blocks(1, 2))
    assert len(t) == 0 and t.free_slots
    t.check_integrity()


def test_host_tier_evicts_least_recent_leaf_first():
    t = HostTier(3, SHAPE, torch.float32)
    t.has_lower_tier = True  # evictions carry their data down
    # the device pool demotes leaf first: a child arrives before its parent
    t.put([b"c", b"b"], [b"b", b"a"], _blocks(3, 2))
    t.put([b"a"], [None], _blocks(1))
    t.put([b"x"], [None], _blocks(9))[0]  # full: the oldest leaf, c, goes
    assert b"c" not in t and {b"a", b"b", b"x"} <= set(t.entries)
    spilled = t.put([b"y"], [None], _blocks(8))  # b is now the oldest leaf; a still has a child
    assert [e.block_hash for e in spilled] == [b"b"]
    assert torch.equal(spilled[0].data, _blocks(2)[0]) and spilled[0].parent_hash == b"a"
    t.check_integrity()


def test_host_tier_refreshes_duplicates_and_keeps_the_root_side_of_a_chain():
    t = HostTier(2, SHAPE, torch.float32)
    t.put([b"a"], [None], _blocks(1))
    t.put([b"a"], [None], _blocks(7))  # already here: refreshed, not overwritten or duplicated
    assert len(t) == 1 and torch.equal(t.storage[t.entries[b"a"].slot], _blocks(1)[0])
    # a chain of three, leaf first, into two slots: what stays is still matchable from its root
    spilled = t.put([b"z", b"y", b"x"], [b"y", b"x", None], _blocks(3, 2, 1))
    assert [e.block_hash for e in spilled] == [b"a"]  # z made room for its parents before it was ever stored
    assert set(t.entries) == {b"y", b"x"} and t.match([b"x", b"y", b"z"]) == 2
    assert all(e.data is None for e in spilled)  # no tier below: nothing is copied for it
    t.check_integrity()


def test_a_block_evicted_by_its_own_put_is_dropped_not_spilled_with_stale_data():
    t = HostTier(1, SHAPE, torch.float32)
    t.has_lower_tier = True
    t.put([b"old"], [None], _blocks(5))
    # leaf first into one slot: b goes in, then its parent a needs the slot; b's data was never copied in
    spilled = t.put([b"b", b"a"], [b"a", None], _blocks(2, 1))
    assert [e.block_hash for e in spilled] == [b"old"] and torch.equal(spilled[0].data, _blocks(5)[0])
    assert set(t.entries) == {b"a"} and torch.equal(t.storage[t.entries[b"a"].slot], _blocks(1)[0])
    t.check_integrity()


def test_the_cpu_waits_for_queued_device_copies_before_it_touches_dram():
    """On CUDA, copies into DRAM slots are queued on a stream: every CPU read or write of the
    storage (a put of data, an eviction carried down, a take) first waits for them."""
    t = HostTier(2, SHAPE, torch.float32)
    t.has_lower_tier = True
    waits = []
    t.wait_copies = lambda: waits.append(len(t.entries))
    t.put([b"a"], [None], _blocks(1))
    assert len(waits) == 1
    t.put([b"b"], [None], fill=lambda rows, slots: None)  # a device copy fills it: no wait
    assert len(waits) == 1
    t.put([b"c"], [None], _blocks(3))  # evicts a (copied out for NVMe), then writes c
    assert len(waits) == 3
    assert torch.equal(t.take([b"c"])[0], _blocks(3)[0]) and len(waits) == 4


def test_slot_runs_group_consecutive_slots():
    from kvstrata.tiering.cuda_copy import slot_runs

    assert slot_runs([]) == []
    assert slot_runs([0, 1, 2, 7, 8, 15]) == [(0, 0, 3), (3, 7, 2), (5, 15, 1)]
    assert slot_runs([4]) == [(0, 4, 1)]
    assert slot_runs([3, 4, 5, 6], rows=[0, 1, 5, 6]) == [(0, 3, 2), (2, 5, 2)]  # rows must follow too


def test_host_tier_storage_is_zeroed_and_on_huge_pages_where_the_host_has_them():
    from kvstrata.worker.huge_pages import HUGE_PAGE, huge_pages_available

    shape = (30, 2, 16, 3, 64)  # a SmolLM2 block, 0.74 MB: eight of them span several huge pages
    t = HostTier(8, shape, torch.float32)
    assert t.storage.shape == (8, *shape) and t.storage.dtype == torch.float32
    assert not t.storage.any()
    t.storage[7].fill_(1.0)  # the last slot's bytes are inside the mapping
    assert t.storage[7].all() and not t.storage[:7].any()
    if huge_pages_available():
        assert t.storage.data_ptr() % HUGE_PAGE == 0
    small = HostTier(1, SHAPE, torch.float32)  # under a huge page: plain memory, zeroed all the same
    assert not small.storage.any()


def test_host_tier_rejects_a_zero_capacity():
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(0, SHAPE, torch.float32)


# -- the engine with tiers --------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT_LEN = 160  # 10 blocks of 16; 9 can be hits (the last token is always computed)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(6)]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def _block_bytes(llm) -> int:
    from kvstrata.worker.model_runner import ModelRunner

    return ModelRunner.kv_bytes_per_block(llm.engine.runner.model, 16)


def test_dram_tier_keeps_what_a_small_pool_evicts(llm, prompts, expected):
    from kvstrata import LLM

    # 24 device blocks hold about two of the six prompts; the DRAM tier holds all of them
    tiered = LLM("smollm2-135m", num_gpu_blocks=24, cpu_kv_bytes=64 * _block_bytes(llm))
    plain = LLM("smollm2-135m", num_gpu_blocks=24)
    for round_ in range(2):
        for p, want in zip(prompts, expected):
            got, base = tiered.generate([p], GREEDY)[0], plain.generate([p], GREEDY)[0]
            assert got.outputs[0].token_ids == want
            if round_ == 1:
                assert got.num_cached_tokens == 144  # every full block but the last, from DRAM
                assert base.num_cached_tokens == 0  # without the tier, long gone
            tiered.check_integrity()
    stats = tiered.cache_stats()["tiers"]["dram"]
    assert stats["promoted_blocks"] >= 6 * 9 and stats["demoted_blocks"] > 0
    _check_tier_metrics(tiered.cache_stats(), stats)
    assert tiered.reset_prefix_cache() > 0
    assert tiered.cache_stats()["tiers"]["dram"]["blocks"] == 0
    assert tiered.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 0
    tiered.check_integrity()


def _metric_samples(cache_stats: dict) -> dict:
    """What /metrics would show for these stats: {(name, tier, direction): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstrata.cluster.metrics import ServingMetrics

    m = ServingMetrics("m")
    m.update_engine(cache_stats)
    return {(s.name, s.labels.get("tier"), s.labels.get("direction")): s.value
            for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}


def _check_tier_metrics(cache_stats: dict, dram: dict) -> None:
    """The same counters reach Prometheus, labelled by tier, with the bytes each direction moved and
    the seconds it took (their rates' ratio is the transfer rate)."""
    samples = _metric_samples(cache_stats)
    assert samples[("kvstrata:tier_blocks", "dram", None)] == dram["blocks"]
    assert samples[("kvstrata:tier_promotions_total", "dram", None)] == dram["promoted_blocks"]
    assert samples[("kvstrata:tier_demotions_total", "dram", None)] == dram["demoted_blocks"]
    assert 0 < samples[("vllm:cpu_cache_usage_perc", None, None)] <= 1
    block = dram["bytes"] // dram["blocks"]
    for direction, kind in (("down", "demote"), ("up", "promote")):
        moved = samples[("kvstrata:tier_transfer_bytes_total", "dram", direction)]
        # a block already in DRAM counts as demoted without a copy
        assert 0 < moved == dram[f"{kind}_bytes"] <= dram[f"{kind[:-1]}ed_blocks"] * block
        assert moved % block == 0
        assert samples[("kvstrata:tier_transfer_seconds_total", "dram", direction)] == dram[f"{kind}_seconds"] > 0
    assert samples[("kvstrata:swapped_out_bytes_total", None, None)] == dram["swapped_out_bytes"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"cpu_kv_bytes": 0}, "cpu_kv_bytes"),
    ({"cpu_kv_bytes": 10}, "holds no block"),
    ({"nvme_kv_dir": "/tmp/x", "nvme_kv_bytes": 1 << 20}, "needs cpu_kv_bytes"),
    ({"cpu_kv_bytes": 1 << 24, "nvme_kv_dir": "/tmp/x"}, "needs nvme_kv_bytes"),
    ({"nvme_kv_bytes": 1 << 20}, "needs nvme_kv_dir"),
    ({"pin_quota_bytes": 1 << 20}, "pin_quota_bytes needs cpu_kv_bytes"),
    ({"cpu_kv_bytes": 1 << 24, "pin_quota_bytes": -1}, "pin_quota_bytes"),
])
def test_bad_tier_arguments(kwargs, needle):
    from kvstrata import LLM

    with pytest.raises(ValueError, match=needle):
        LLM("smollm2-135m", num_gpu_blocks=16, **kwargs)


def test_swap_on_preemption_gives_the_same_outputs(llm):
    from kvstrata import LLM

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # 12 blocks cannot hold six sequences of 68 tokens: running requests are preempted
    small = LLM("smollm2-135m", num_gpu_blocks=12, cpu_kv_bytes=64 * _block_bytes(llm))
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = small.cache_stats()
    assert stats["num_preemptions"] > 0 and stats["num_swaps"] == stats["num_preemptions"]
    dram = stats["tiers"]["dram"]
    assert dram["swapped_out_blocks"] == dram["swapped_in_blocks"] > 0
    assert not any(k.startswith(b"swap:") for k in small.engine.kv.tiers.host.entries)
    small.check_integrity()


def test_abort_while_swapped_out_leaks_nothing(llm):
    from kvstrata import LLM

    small = LLM("smollm2-135m", num_gpu_blocks=12, cpu_kv_bytes=64 * _block_bytes(llm))
    engine = small.engine
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [300 + i] * 20, params)
    swapped = None
    for _ in range(200):
        engine.step()
        swapped = next((s for g in engine.groups.values() for s in g.samples if s.swapped), None)
        if swapped is not None:
            break
    assert swapped is not None, "no request was swapped out"
    keys = swapped.swapped[0]
    assert all(k in engine.kv.tiers.host for k in keys)
    engine.abort(swapped.group_id)
    assert not any(k in engine.kv.tiers.host for k in keys)
    for rid in list(engine.groups):
        engine.abort(rid)
    assert engine.kv.pool.num_used_blocks == 0
    assert not any(k.startswith(b"swap:") for k in engine.kv.tiers.host.entries)
    small.check_integrity()


def test_swap_falls_back_to_recompute_when_dram_is_too_small(llm):
    from kvstrata import LLM

    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tiny = LLM("smollm2-135m", num_gpu_blocks=12, cpu_kv_bytes=2 * _block_bytes(llm))  # fewer than one request
    assert [o.outputs[0].token_ids for o in tiny.generate(prompts, params)] == want
    stats = tiny.cache_stats()
    assert stats["num_preemptions"] > 0 and stats["tiers"]["dram"]["swap_fallbacks"] > 0
    tiny.check_integrity()


# -- NVMe under DRAM --------------------------------------------------------------------------------
def _nvme_llm(llm, directory):
    from kvstrata import LLM

    bb = _block_bytes(llm)
    # 24 device blocks and 20 DRAM blocks hold well under the 6 prompts' 60 blocks; NVMe holds all
    return LLM("smollm2-135m", num_gpu_blocks=24, cpu_kv_bytes=20 * bb, nvme_kv_dir=str(directory),
               nvme_kv_bytes=200 * bb)


def test_nvme_tier_brings_blocks_back_and_survives_a_restart(llm, prompts, expected, tmp_path):
    first = _nvme_llm(llm, tmp_path)
    try:
        for round_ in range(2):
            for p, want in zip(prompts, expected):
                got = first.generate([p], GREEDY)[0]
                assert got.outputs[0].token_ids == want
                if round_:
                    assert got.num_cached_tokens == 144
                first.check_integrity()
        nvme = first.cache_stats()["tiers"]["nvme"]
        assert nvme["loaded_blocks"] > 0 and nvme["hits"] > 0 and nvme["checksum_failures"] == 0
        samples = _metric_samples(first.cache_stats())
        assert samples[("kvstrata:tier_hits_total", "nvme", None)] == nvme["hits"]
        assert samples[("kvstrata:tier_transfer_bytes_total", "nvme", "up")] == nvme["bytes_read"] > 0
        assert samples[("kvstrata:tier_transfer_bytes_total", "nvme", "down")] == nvme["bytes_written"] > 0
        assert samples[("kvstrata:tier_transfer_seconds_total", "nvme", "up")] == nvme["read_busy_seconds"] > 0
    finally:
        first.close()
    again = _nvme_llm(llm, tmp_path)  # a new process would do the same: the index comes from the files
    try:
        for p, want in zip(prompts, expected):
            got = again.generate([p], GREEDY)[0]
            assert got.outputs[0].token_ids == want and got.num_cached_tokens == 144
        assert again.cache_stats()["tiers"]["nvme"]["loaded_blocks"] >= 9
        again.check_integrity()
    finally:
        again.close()


def test_a_corrupt_nvme_file_is_recomputed_not_served(llm, prompts, expected, tmp_path):
    warm = _nvme_llm(llm, tmp_path)
    for p in prompts:
        warm.generate([p], GREEDY)
    warm.close()
    num_flipped = flip_every_payload(tmp_path)
    assert num_flipped > 0
    cold = _nvme_llm(llm, tmp_path)
    try:
        for p, want in zip(prompts, expected):
            got = cold.generate([p], GREEDY)[0]
            assert got.outputs[0].token_ids == want
        stats = cold.cache_stats()["tiers"]["nvme"]
        assert stats["checksum_failures"] > 0 and stats["failed_loads"] > 0
        cold.check_integrity()
    finally:
        cold.close()


def test_abort_while_blocks_load_from_nvme_leaks_nothing(llm, prompts, tmp_path):
    tiered = _nvme_llm(llm, tmp_path)
    try:
        for p in prompts:
            tiered.generate([p], GREEDY)
        tiered.engine.kv.tiers.host.clear()  # DRAM forgets, so the next hit must come from NVMe
        tiered.engine.kv.pool.reset_prefix_cache()
        engine = tiered.engine
        engine.add_request("loading", prompts[0], GREEDY)
        engine.step()  # starts the load; the request waits for it
        assert engine.kv.tiers.loading or engine.kv.tiers.host.entries
        assert engine.abort("loading")
        engine.kv.tiers.wait_for_loads(timeout=5)
        assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.tiers.loading
        tiered.check_integrity()
    finally:
        tiered.close()


# -- prompt-cache pins ------------------------------------------------------------------------------
def _run(engine, rid, ids, **kw):
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), **kw)
    while True:
        for out in engine.step():
            return out


def _flood(engine, rng, n=12):
    """Enough other prompts to push anything unpinned out of a 24-block pool and a 24-block DRAM tier."""
    for i in range(n):
        _run(engine, f"flood-{rng.random()}", [rng.randrange(100, 40000) for _ in range(160)])


def test_a_pinned_prefix_outlives_a_flood_until_its_ttl(llm):
    from kvstrata import LLM

    small = LLM("smollm2-135m", num_gpu_blocks=24, cpu_kv_bytes=24 * _block_bytes(llm))
    engine, tiers = small.engine, small.engine.kv.tiers
    now = [0.0]
    tiers.pins.clock = lambda: now[0]
    rng = random.Random(5)
    system = [rng.randrange(100, 40000) for _ in range(128)]
    first = _run(engine, "a", system + [1, 2, 3], cache_pins=[(128, 300.0)], tenant="t1")
    assert (first.num_cached_tokens, first.num_cache_write_tokens) == (0, 128)
    assert tiers.pinned_blocks("t1") == 8
    _flood(engine, rng)
    again = _run(engine, "b", system + [4, 5, 6])
    assert (again.num_cached_tokens, again.num_cache_write_tokens) == (128, 0)  # survived, read from cache
    small.check_integrity()
    # control: the same flood pushes out an unpinned prefix
    other = [rng.randrange(100, 40000) for _ in range(128)]
    _run(engine, "c", other + [1])
    _flood(engine, rng)
    assert _run(engine, "d", other + [2]).num_cached_tokens == 0
    # once the TTL has passed, the pin is gone and the flood wins
    now[0] = 301.0
    _flood(engine, rng)
    assert tiers.pinned_blocks() == 0
    assert _run(engine, "e", system + [7]).num_cached_tokens == 0
    small.check_integrity()


def test_pins_have_quotas_and_need_a_tier(llm):
    from kvstrata import LLM

    small = LLM("smollm2-135m", num_gpu_blocks=24, cpu_kv_bytes=24 * _block_bytes(llm),
                pin_quota_bytes=4 * _block_bytes(llm))
    rng0 = random.Random(9)
    five = [rng0.randrange(100, 40000) for _ in range(80)]  # 5 blocks: over this tenant's quota of 4
    with pytest.raises(ValueError, match="over its quota of"):
        small.engine.add_request("five", five, GREEDY, cache_pins=[(80, 60.0)], tenant="t0")
    small.engine.add_request("four", five, GREEDY, cache_pins=[(64, 60.0)], tenant="t0")  # 4 blocks: fine
    small.engine.abort("four")
    engine = small.engine
    rng = random.Random(6)
    prompt = [rng.randrange(100, 40000) for _ in range(208)]  # 13 blocks: over the 12-block limit
    with pytest.raises(ValueError, match="cache_control: tenant 't1' would pin"):
        engine.add_request("big", prompt, GREEDY, cache_pins=[(208, 60.0)], tenant="t1")
    assert not engine.has_unfinished_requests()  # refused whole
    for bad, needle in (((0, 60.0), "within the prompt"), ((300, 60.0), "within the prompt"),
                        ((16, 0), "ttl"), ((16, 10**9), "ttl")):
        with pytest.raises(ValueError, match=needle):
            engine.add_request("bad", prompt, GREEDY, cache_pins=[bad], tenant="t1")
    with pytest.raises(ValueError, match="cache_control: pinning needs a KV tier"):
        llm.engine.add_request("no-tier", prompt, GREEDY, cache_pins=[(16, 60.0)])
    assert not llm.engine.has_unfinished_requests()
    small.check_integrity()


def test_nvme_backpressure_drops_spills_instead_of_queueing_without_bound(llm, prompts, expected, tmp_path):
    tiered = _nvme_llm(llm, tmp_path)
    try:
        tiered.engine.kv.tiers.max_pending_writes = 0  # as if the disk could never keep up
        for p, want in zip(prompts, expected):
            assert tiered.generate([p], GREEDY)[0].outputs[0].token_ids == want
        nvme = tiered.cache_stats()["tiers"]["nvme"]
        assert nvme["spill_drops"] > 0 and nvme["spilled_blocks"] == 0 and nvme["blocks"] == 0
        tiered.check_integrity()
    finally:
        tiered.close()


def test_a_request_stops_waiting_for_nvme_after_a_bounded_number_of_steps(llm, prompts, expected, tmp_path):
    from concurrent.futures import Future

    tiered = _nvme_llm(llm, tmp_path)
    try:
        for p in prompts:
            tiered.generate([p], GREEDY)
        tiers = tiered.engine.kv.tiers
        tiers.host.clear()
        tiered.engine.kv.pool.reset_prefix_cache()
        never = Future()  # a load that never finishes
        tiers.nvme.get_many = lambda hashes: never
        got = tiered.generate([prompts[0]], GREEDY)[0]  # admitted after the bound, and recomputed
        assert got.outputs[0].token_ids == expected[0] and got.num_cached_tokens == 0
        assert tiers.loading  # the stuck load is still outstanding; it was not waited for forever
        never.set_result([None] * len(tiers.loads[0].hashes))
        tiers.poll()
        tiered.check_integrity()
    finally:
        tiered.close()
