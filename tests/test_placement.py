"""Placement policies on hand-built loads and matches: each policy's exact choice, the prefix-aware cost,
its least-loaded fallback, its burst memory on an injected clock, health, and the registry."""

from __future__ import annotations

import logging
import random

import pytest

from kvstrata.router.placement import (
    DEFAULT_DECODE_TOKEN_COST,
    DEFAULT_POLICY,
    POLICIES,
    NoHealthyWorker,
    PrefixAware,
    PrefixMatch,
    RoutingRequest,
    WorkerLoad,
    load_tokens,
    make_policy,
)


def idle(*ids: str) -> list[WorkerLoad]:
    return [WorkerLoad(i, num_running=0, num_waiting=0, pending_prefill_tokens=0) for i in ids]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


REQ = RoutingRequest(num_prompt_tokens=8000)


# -- the simple policies ----------------------------------------------------------------------------

def test_round_robin_cycles_over_healthy_workers_only():
    policy = make_policy("round_robin")
    workers = idle("a", "b", "c")
    workers[1] = WorkerLoad("b", 0, 0, 0, healthy=False)
    assert [policy.choose(REQ, workers, {}).worker_id for _ in range(5)] == ["a", "c", "a", "c", "a"]


def test_least_loaded_counts_pending_prefill_and_sequences():
    policy = make_policy("least_loaded")
    workers = [WorkerLoad("a", num_running=4, num_waiting=0, pending_prefill_tokens=0),  # 4 x 128 = 512
               WorkerLoad("b", num_running=0, num_waiting=1, pending_prefill_tokens=400),  # 400 + 128 = 528
               WorkerLoad("c", num_running=0, num_waiting=0, pending_prefill_tokens=600)]
    d = policy.choose(REQ, workers, {})
    assert d.worker_id == "a" and d.policy == "least_loaded"
    assert d.costs == {"a": 512.0, "b": 528.0, "c": 600.0}
    assert load_tokens(workers[1], DEFAULT_DECODE_TOKEN_COST) == 528.0


def test_ties_rotate_deterministically():
    # the search for a tied worker starts one further along at every decision: an idle fleet fills in turn
    for name in ("least_loaded", "prefix_aware"):
        policy = make_policy(name)
        assert [policy.choose(REQ, idle("z", "y", "x"), {}).worker_id for _ in range(4)] == ["z", "y", "x", "z"]
    # only exact ties rotate
    policy = make_policy("least_loaded")
    workers = [WorkerLoad("z", 0, 0, 1), *idle("y", "x")]
    assert [policy.choose(REQ, workers, {}).worker_id for _ in range(3)] == ["y", "y", "x"]


def test_power_of_two_takes_the_lesser_of_two_and_is_deterministic_with_a_seed():
    workers = [WorkerLoad(f"w{i}", 0, 0, pending_prefill_tokens=1000 * i) for i in range(8)]
    a, b = make_policy("power_of_two", seed=7), make_policy("power_of_two", seed=7)
    seq_a = [a.choose(REQ, workers, {}) for _ in range(20)]
    seq_b = [b.choose(REQ, workers, {}) for _ in range(20)]
    assert [d.worker_id for d in seq_a] == [d.worker_id for d in seq_b]
    for d in seq_a:  # two distinct workers drawn, the lighter wins
        assert len(d.costs) == 2 and d.costs[d.worker_id] == min(d.costs.values())
    # the draws are those of random.Random(7).sample
    rng = random.Random(7)
    expected = [min(rng.sample(workers, 2), key=lambda w: w.pending_prefill_tokens).worker_id for _ in range(20)]
    assert [d.worker_id for d in seq_a] == expected
    # an injected rng is used as is; with one healthy worker there is nothing to draw
    lone = make_policy("power_of_two", rng=random.Random(1))
    assert lone.choose(REQ, [workers[0], WorkerLoad("x", 0, 0, 0, healthy=False)], {}).worker_id == "w0"


# -- prefix_aware ---------------------------------------------------------------------------------

def test_prefix_aware_prefers_the_worker_holding_the_prefix():
    policy = PrefixAware(clock=FakeClock())
    workers = idle("a", "b", "c")
    d = policy.choose(REQ, workers, {"b": PrefixMatch(hbm_tokens=4096)})
    assert d.worker_id == "b" and d.policy == "prefix_aware"
    assert d.costs == {"a": 8000.0, "b": 8000.0 - 4096, "c": 8000.0}
    assert "credit 4096 of 8000" in d.reason and "(cache)" in d.reason


def test_prefix_aware_weighs_a_hit_against_load():
    policy = PrefixAware(clock=FakeClock())  # load_weight 0.25
    cached = WorkerLoad("a", num_running=0, num_waiting=0, pending_prefill_tokens=16000)
    free = WorkerLoad("b", num_running=0, num_waiting=0, pending_prefill_tokens=0)
    small_hit = policy.choose(REQ, [cached, free], {"a": PrefixMatch(hbm_tokens=2048)})
    assert small_hit.costs == {"a": 8000 - 2048 + 0.25 * 16000, "b": 8000.0}
    assert small_hit.worker_id == "b"  # 9952 > 8000: the hit is not worth the queue
    big_hit = policy.choose(REQ, [cached, free], {"a": PrefixMatch(hbm_tokens=6144)})
    assert big_hit.worker_id == "a"  # 1856 + 4000 < 8000


def test_an_hbm_hit_beats_an_equal_dram_hit_and_nvme_counts_least():
    policy = PrefixAware(clock=FakeClock())
    matches = {"a": PrefixMatch(dram_tokens=4096), "b": PrefixMatch(hbm_tokens=4096),
               "c": PrefixMatch(nvme_tokens=4096)}
    d = policy.choose(REQ, idle("a", "b", "c"), matches)
    assert d.worker_id == "b"
    assert d.costs == {"a": 8000 - 0.8 * 4096, "b": 8000.0 - 4096, "c": 8000 - 0.5 * 4096}
    # a chain: HBM then DRAM on one worker beats the same tokens all in DRAM elsewhere
    chain = {"a": PrefixMatch(dram_tokens=6000), "b": PrefixMatch(hbm_tokens=2000, dram_tokens=4000)}
    assert policy.choose(REQ, idle("a", "b"), chain).worker_id == "b"
    # the credits are parameters
    flat = PrefixAware(clock=FakeClock(), dram_credit=1.0)
    assert flat.choose(REQ, idle("a", "b"), {"a": PrefixMatch(dram_tokens=4096), "b": PrefixMatch(hbm_tokens=4096)}
                       ).worker_id == "a"  # a tie now: the earlier worker


def test_prefix_aware_falls_back_to_least_loaded_when_out_of_balance(caplog):
    policy = PrefixAware(clock=FakeClock())  # imbalance_ratio 3, load_floor 4096
    prompt = RoutingRequest(num_prompt_tokens=100_000)
    workers = [WorkerLoad("a", 0, 0, pending_prefill_tokens=60_000)] + \
        [WorkerLoad(w, 0, 0, pending_prefill_tokens=p) for w, p in (("b", 500), ("c", 100), ("d", 100))]
    matches = {"a": PrefixMatch(hbm_tokens=99_840)}
    with caplog.at_level(logging.DEBUG, logger="kvstrata.router.placement"):
        d = policy.choose(prompt, workers, matches)
    # a is cheapest (160 + 15000 against 100000+), but its 60000 is over 3 x the mean 15175
    assert d.costs["a"] < min(d.costs[w] for w in "bcd")
    assert d.worker_id == "c"  # the least loaded; c and d tie, c comes first
    assert d.reason.startswith("imbalance:") and "least-loaded c" in d.reason
    assert any("prefix_aware -> c: imbalance" in r.getMessage() for r in caplog.records)
    # within the ratio, the cache wins
    assert PrefixAware(clock=FakeClock(), imbalance_ratio=4).choose(prompt, workers, matches).worker_id == "a"
    # with the mean load under the floor, nothing is "out of balance"
    light = [WorkerLoad("a", 0, 0, 3000)] + idle("b", "c", "d")
    assert policy.choose(prompt, light, matches).worker_id == "a"


def test_the_burst_memory_sends_a_fresh_shared_prefix_to_one_worker_until_it_expires():
    clock = FakeClock()
    policy = PrefixAware(clock=clock, burst_ttl_s=10.0)
    first = RoutingRequest(2048, block_hashes=("sys", "q1", "q2"), block_size=512)
    assert policy.choose(first, idle("a", "b", "c"), {}).worker_id == "a"  # no hit anywhere: the first
    assert policy.num_remembered == 3
    # a busy while later, a sibling sharing the first two blocks: nobody has them cached yet, and a is busy
    clock.now += 2.0
    sibling = RoutingRequest(2048, block_hashes=("sys", "q1", "other"), block_size=512)
    busy_a = [WorkerLoad("a", 0, 1, pending_prefill_tokens=2048)] + idle("b", "c")
    d = policy.choose(sibling, busy_a, {})
    assert d.worker_id == "a" and "(burst memory)" in d.reason
    assert d.costs["a"] == 2048 - 1024 + 0.25 * (2048 + 128)  # two remembered blocks count as HBM hits
    # another tenant's identical hashes are not this tenant's prefix
    other_tenant = RoutingRequest(2048, tenant="t2", block_hashes=("sys", "q1", "other"), block_size=512)
    assert policy.choose(other_tenant, busy_a, {}).worker_id != "a"
    # without the memory the sibling would have gone by load
    assert PrefixAware(clock=clock, burst_ttl_s=0).choose(sibling, busy_a, {}).worker_id == "b"
    # after the TTL the memory is gone and the same request goes by load
    clock.now += 10.0
    d = policy.choose(sibling, busy_a, {})
    assert d.worker_id != "a" and d.reason.startswith("weak match")
    assert policy.num_remembered == 3  # the last choice is remembered; the expired entries went


def test_a_weak_match_goes_by_load():
    # only the shared system prompt (512 of 8000 tokens) is cached, on a: no reason to pile onto a
    policy = PrefixAware(clock=FakeClock())  # min_match_fraction 0.2
    workers = [WorkerLoad("a", 2, 0, 0), *idle("b", "c")]
    d = policy.choose(REQ, workers, {"a": PrefixMatch(hbm_tokens=512)})
    assert d.worker_id == "b" and d.costs["a"] < d.costs["b"]
    assert d.reason == "weak match: the best credit is 512 of 8000 prompt tokens, under 20%; least-loaded b (0)"
    assert PrefixAware(clock=FakeClock(), min_match_fraction=0).choose(
        REQ, workers, {"a": PrefixMatch(hbm_tokens=512)}).worker_id == "a"
    # a fifth of the prompt is enough
    assert policy.choose(REQ, workers, {"a": PrefixMatch(hbm_tokens=1600)}).worker_id == "a"


def test_the_burst_memory_keeps_the_latest_worker_per_block():
    clock = FakeClock()
    policy = PrefixAware(clock=clock, burst_ttl_s=5.0)
    policy.choose(RoutingRequest(2048, block_hashes=("s", "x"), block_size=512), idle("a", "b"), {})  # -> a
    clock.now += 4.0
    busy_a = [WorkerLoad("a", 0, 0, 50_000), *idle("b")]
    policy.choose(RoutingRequest(2048, block_hashes=("s", "y"), block_size=512), busy_a, {})  # -> b, refreshes "s"
    clock.now += 2.0  # the first choice has expired, the second has not
    assert policy.remembered_blocks(RoutingRequest(2048, block_hashes=("s", "x"), block_size=512), clock()) == {"b": 1}
    policy.choose(RoutingRequest(100), idle("a", "b"), {})  # expired entries go at the next choice
    assert policy.num_remembered == 2  # "s" (refreshed) and "y"


# -- health and the registry ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(POLICIES))
def test_unhealthy_workers_are_never_chosen(name):
    params = {"seed": 3} if name == "power_of_two" else {}
    policy = make_policy(name, **params)
    sick = WorkerLoad("sick", 0, 0, 0, healthy=False)  # idle and holding the whole prompt
    workers = [sick, WorkerLoad("ok1", 5, 5, 9000), WorkerLoad("ok2", 6, 6, 9000)]
    matches = {"sick": PrefixMatch(hbm_tokens=7999)}
    for _ in range(10):
        d = policy.choose(REQ, workers, matches)
        assert d.worker_id in ("ok1", "ok2") and "sick" not in d.costs
    with pytest.raises(NoHealthyWorker, match="no healthy worker among 1"):
        policy.choose(REQ, [sick], matches)
    with pytest.raises(RuntimeError, match="no healthy worker among 0"):
        policy.choose(REQ, [], {})


def test_the_registry():
    assert DEFAULT_POLICY == "prefix_aware"
    assert list(POLICIES) == ["round_robin", "least_loaded", "power_of_two", "prefix_aware"]
    assert isinstance(make_policy(DEFAULT_POLICY), PrefixAware)
    with pytest.raises(ValueError, match=r"routing_policy: unknown policy 'fastest'; choose one of round_robin, "
                                         r"least_loaded, power_of_two, prefix_aware"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="routing_policy prefix_aware: .*hbm_weight"):
        make_policy("prefix_aware", hbm_weight=2.0)
    with pytest.raises(ValueError, match="dram_credit must be in"):
        make_policy("prefix_aware", dram_credit=1.5)
    with pytest.raises(ValueError, match="min_match_fraction must be in"):
        make_policy("prefix_aware", min_match_fraction=2)
    with pytest.raises(ValueError, match="imbalance_ratio must be >= 1"):
        make_policy("prefix_aware", imbalance_ratio=0.5)
    with pytest.raises(ValueError, match="load_weight must be >= 0"):
        make_policy("prefix_aware", load_weight=-1)
