"""The "offline" scheduling policy: the longest output first, prompt tokens riding in decode steps.

The scheduler runs here against a real KV cache manager, without a model: a small driver plays
the engine's part (computed tokens move on, a finished prompt or decode appends one token).
"""

from __future__ import annotations

import itertools
import math

import pytest

from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.request import FinishReason, Request
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.worker.scheduler import OFFLINE_DEADLINE_STEPS, SCHEDULING_POLICIES, Scheduler, SchedulerConfig


def _scheduler(policy: str, budget: int = 512, rows: int = 8) -> Scheduler:
    kv = KVCacheManager(4096, 16, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, policy=policy, offline_step_rows=rows), kv)


_arrivals = itertools.count()


def _request(sched: Scheduler, name: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    arrival = next(_arrivals)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority)
    ids = [(7 * arrival + i) % 1000 + 1 for i in range(prompt_len)]
    req = Request(name, ids, params, hash_root=name.encode(), arrival=arrival)
    sched.add_request(req)
    return req


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    """One scheduler step, played through: (request id, tokens computed) for each scheduled row."""
    batch = sched.schedule().batch
    rows = list(zip(batch.requests, batch.num_new_tokens))
    for req, n in rows:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:  # a prompt finished or a decode ran: one token out
            req.token_ids.append(1)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, FinishReason.LENGTH)
    return [(r.request_id, n) for r, n in rows]


def _run(sched: Scheduler) -> list[list[tuple[str, int]]]:
    steps = []
    while sched.running or sched.num_waiting:
        steps.append(_step(sched))
        assert len(steps) < 10_000
    return steps


def test_offline_admits_the_longest_output_first_within_a_priority():
    order = {}
    for policy in SCHEDULING_POLICIES:
        sched = _scheduler(policy, budget=16)  # one 16-token prompt a step
        _request(sched, "short", 16, 3)
        _request(sched, "long", 16, 40)
        _request(sched, "mid", 16, 12)
        _request(sched, "urgent", 16, 2, priority=-1)
        admitted = []
        for step in _run(sched):
            admitted += [rid for rid, n in step if n > 1 and rid not in admitted]
        order[policy] = admitted
    assert order["fcfs"] == ["urgent", "short", "long", "mid"]
    assert order["offline"] == ["urgent", "long", "mid", "short"]


def test_offline_prompt_tokens_ride_in_decode_steps_up_to_the_row_cap():
    steps = {}
    for policy in SCHEDULING_POLICIES:
        sched = _scheduler(policy, budget=16, rows=8)
        long = _request(sched, "long", 16, 100)
        for i in range(4):
            _request(sched, f"q{i}", 16, 4)
        steps[policy] = _run(sched)
        assert steps[policy][0] == [("long", 16)]  # nothing decodes yet: the full budget
        assert sum(n for step in steps[policy] for _, n in step) == 16 * 5 + 99 + 4 * 3  # prompts, then decodes
        assert len(steps[policy]) == long.params.max_tokens  # the others finished within the longest's decode
    for step in steps["offline"][1:]:
        assert sum(n for _, n in step) <= 8, step  # decodes and prompt tokens
    assert steps["offline"][1] == [("long", 1), ("q0", 7)]
    assert steps["fcfs"][1] == [("long", 1), ("q0", 15)]  # fcfs fills the budget


def test_offline_takes_more_rows_when_prompts_would_end_after_the_longest_decode():
    sched = _scheduler("offline", budget=64, rows=4)
    long = _request(sched, "long", 64, 12)
    waiting = [_request(sched, f"p{i}", 64, 5) for i in range(4)]  # 256 prompt tokens, 5 outputs each
    steps = _run(sched)
    assert steps[0] == [("long", 64)]
    # 11 decode steps left for "long"; each prompt must be done 5 before the end: 256 / 6 = 43 a step
    first_ride = steps[1]
    assert sum(n for _, n in first_ride if n > 1) == 43
    assert len(steps) == long.params.max_tokens
    assert all(r.is_finished for r in waiting)


def test_offline_gives_the_full_budget_to_a_waiting_request_that_outlasts_the_running_ones():
    sched = _scheduler("offline", budget=16, rows=4)
    _request(sched, "first", 16, 10, priority=-1)
    _request(sched, "longer", 200, 50)
    steps = _run(sched)
    assert steps[0] == [("first", 16)]
    assert steps[1] == [("first", 1), ("longer", 15)]  # not capped at 4 rows: it decodes past "first"


def test_offline_spreads_the_rows_evenly_over_the_longest_decode():
    """Long decodes admitted first pile up early; prompts due late wait for the decodes to thin
    out, so the steps stay near the job's average rows instead of peaking early and running thin
    at the end (a step's products cost about the same below a dozen rows, more for each above)."""
    sched = _scheduler("offline", budget=64, rows=4)
    mix = [(16, 200), (16, 180), (16, 150)] + [(48, 100 - 5 * i) for i in range(6)] \
        + [(64, 10 + 2 * i) for i in range(12)]
    reqs = [_request(sched, f"r{i}", p, m) for i, (p, m) in enumerate(mix)]
    steps = _run(sched)
    rows = [sum(n for _, n in step) for step in steps]
    assert rows[0] == 64  # nothing decodes yet: the full budget
    assert len(steps) == 200  # every other request ends within the longest's decode
    assert all(r.is_finished for r in reqs)
    # 11.7 rows a step on average after the first; the last steps hold the long decodes alone
    body = rows[1:-10]
    assert 11 <= min(body) and max(body) <= 15, body


def test_offline_meets_a_deadline_at_an_even_rate_only_once_it_is_near():
    sched = _scheduler("offline", budget=1024, rows=2)
    long = _request(sched, "long", 16, 101)
    assert _step(sched) == [("long", 16)]  # 100 decode steps left
    big = _request(sched, "big", 600, 60)

    def slack() -> int:  # the steps by which big must be computed to end its decodes with long's
        return (long.params.max_tokens - long.num_output_tokens) - big.params.max_tokens

    assert slack() == 40 > OFFLINE_DEADLINE_STEPS
    assert sched._offline_budget() == math.ceil((100 + 600 + 59) / 100)  # the even share, not 1 + 600 / 40
    while slack() > OFFLINE_DEADLINE_STEPS:
        _step(sched)
    todo = big.num_tokens - big.num_computed_tokens
    assert 0 < todo < 600
    assert sched._offline_budget() == 1 + math.ceil(todo / OFFLINE_DEADLINE_STEPS)  # now due: its rate


def test_offline_budget_follows_the_queue_as_requests_join_and_leave_it():
    sched = _scheduler("offline", budget=64, rows=4)
    _request(sched, "long", 64, 12)
    assert _step(sched) == [("long", 64)]  # 11 decode steps left
    p0 = _request(sched, "p0", 60, 5)  # due 6 steps from now: 10 a step
    assert sched._offline_budget() == 1 + 10
    p1 = _request(sched, "p1", 60, 5)  # both due then: 20 a step
    assert sched._offline_budget() == 1 + 20
    sched.finish(p1, FinishReason.ABORT)  # an abort while waiting
    assert sched._offline_budget() == 1 + 10
    sched.finish(p0, FinishReason.ABORT)
    assert sched._offline_budget() == 4  # nothing to compute: the decode and room to ride


def test_scheduling_config_names_the_bad_field():
    with pytest.raises(ValueError, match="scheduling"):
        SchedulerConfig(policy="lifo")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="offline_step_rows"):
            SchedulerConfig(policy="offline", offline_step_rows=bad)


def test_llm_rejects_a_bad_policy_before_loading_the_model():
    from kvstrata import LLM

    with pytest.raises(ValueError, match="scheduling"):
        LLM("no-such-model", scheduling="round-robin")
    with pytest.raises(ValueError, match="offline_step_rows"):
        LLM("no-such-model", scheduling="offline", offline_step_rows=0)


def test_bench_cli_offers_the_schedulers_policies():
    from kvstrata.cluster.cli import build_parser

    parser = build_parser()
    for policy in SCHEDULING_POLICIES:
        args = parser.parse_args(["bench", "throughput", "--workload", "random", "--scheduling", policy])
        assert args.scheduling == policy
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "throughput", "--workload", "random", "--scheduling", "lifo"])


def test_offline_llm_gives_fcfs_outputs_and_frees_every_block(llm):
    """The policy changes when tokens are computed, never which: greedy outputs match fcfs."""
    from kvstrata import LLM, SamplingParams

    offline = LLM("smollm2-135m", num_gpu_blocks=256, seed=0, scheduling="offline", offline_step_rows=6,
                  max_num_batched_tokens=32)
    assert offline.engine.scheduler_config.policy == "offline"
    prompts = [[(31 * i + 7 * j) % 4000 + 100 for j in range(20 + 9 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 17, 6, 24, 9)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = offline.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert offline.engine.stats.num_steps <= 24 + 2  # fcfs took 28: the longest request started 4th
    offline.check_integrity()
    assert offline.cache_stats()["num_free_blocks"] == offline.cache_stats()["num_total_blocks"]
