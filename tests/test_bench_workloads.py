"""Benchmark workloads and the trace they replay: determinism, sharing structure, ideal prefix hits."""

from __future__ import annotations

import json

import pytest

from kvstrata.cluster.bench.trace import TRACE_ENV_VAR, TRACE_RELATIVE_PATH, TraceRequest, find_trace, load_trace
from kvstrata.cluster.bench.workloads import (
    FIRST_TOKEN_ID,
    WORKLOADS,
    BenchRequest,
    Workload,
    long_context,
    multi_turn,
    random_lengths,
    shared_prefix,
    trace_workload,
)

# hash ids stand for 512 tokens; at scale 32 each is 16 tokens
TINY_TRACE = [
    TraceRequest(0, 1300, 100, (1, 2, 3)),  # 41 tokens: block(1) | block(2) | block(3)[:9]
    TraceRequest(5, 1100, 1, (1, 2, 9)),  # 35 tokens: block(1) | block(2) | block(9)[:3]
    TraceRequest(9, 400, 0, (5,)),  # 13 tokens: block(5)[:13]
    TraceRequest(12, 1024, 64, (1, 7)),  # 32 tokens: block(1) | block(7)
]


@pytest.fixture(scope="module")
def real_trace() -> list[TraceRequest]:
    try:
        return load_trace(limit=64)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def ids(workload: Workload) -> list[list[int]]:
    return [r.prompt_token_ids for r in workload.requests]


# -- determinism --------------------------------------------------------------------------------

GENERATORS = {
    "shared-prefix": lambda seed: shared_prefix(seed=seed),
    "multi-turn": lambda seed: multi_turn(seed=seed),
    "random": lambda seed: random_lengths(seed=seed),
    "trace": lambda seed: trace_workload(TINY_TRACE, num_requests=4, seed=seed),
    "long-context": lambda seed: long_context(num_requests=3, min_input=40, max_input=90, seed=seed),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_workload_other_seed_other_tokens(name):
    make = GENERATORS[name]
    a, b, c = make(0), make(0), make(1)
    assert a.name == name
    assert a == b
    assert ids(a) != ids(c)
    for prompt in ids(a):
        assert prompt and all(FIRST_TOKEN_ID <= t < 49152 for t in prompt)


# -- sharing structure --------------------------------------------------------------------------

def test_shared_prefix_groups_share_exactly_the_system_prompt():
    w = shared_prefix(num_groups=3, requests_per_group=5, system_prompt_len=48, question_len=7, output_len=9, seed=4)
    assert w.num_requests == 15
    assert [r.group for r in w.requests] == [i % 3 for i in range(15)]  # interleaved across groups
    assert all(len(p) == 55 and r.max_tokens == 9 for p, r in zip(ids(w), w.requests))
    for i, a in enumerate(w.requests):
        for b in w.requests[i + 1 :]:
            pa, pb = a.prompt_token_ids, b.prompt_token_ids
            if a.group == b.group:
                assert pa[:48] == pb[:48] and pa[48] != pb[48]
            else:
                assert pa[0] != pb[0]


def test_shared_prefix_without_system_prompt_shares_nothing():
    w = shared_prefix(num_groups=2, requests_per_group=4, system_prompt_len=0, seed=1)
    assert len({p[0] for p in ids(w)}) == 8


def test_multi_turn_each_turn_extends_the_previous_prompt():
    w = multi_turn(num_conversations=3, num_turns=4, user_turn_len=5, assistant_turn_len=6, system_prompt_len=10, seed=2)
    assert w.num_requests == 12
    assert [r.group for r in w.requests] == [0, 1, 2] * 4  # turn by turn
    assert all(r.max_tokens == 6 for r in w.requests)
    for c in range(3):
        turns = [r.prompt_token_ids for r in w.requests if r.group == c]
        assert [len(p) for p in turns] == [15, 26, 37, 48]
        for prev, cur in zip(turns, turns[1:]):
            assert cur[: len(prev)] == prev
    firsts = [w.requests[c].prompt_token_ids[0] for c in range(3)]
    assert len(set(firsts)) == 3  # conversations share nothing


def test_random_lengths_share_no_first_block_and_have_a_long_tail():
    w = random_lengths(num_requests=400, mean_input=100, mean_output=50, max_input=900, max_output=300, seed=3)
    firsts = {tuple(p[:16]) for p in ids(w)}
    assert len(firsts) == 400
    assert w.ideal_prefix_hit_rate(1) == 0.0  # not even one token is shared at the front
    n_in = sorted(len(p) for p in ids(w))
    n_out = [r.max_tokens for r in w.requests]
    assert 1 <= n_in[0] and n_in[-1] <= 900 and 1 <= min(n_out) and max(n_out) <= 300
    assert 80 <= sum(n_in) / 400 <= 120  # lognormal with the requested mean
    assert n_in[int(0.99 * 400)] > 3 * n_in[200]  # p99 far above the median


def test_long_context_prompts_are_long_unrelated_and_within_their_range():
    w = long_context(num_requests=30, min_input=200, max_input=260, output_len=5, seed=6)
    lengths = [len(p) for p in ids(w)]
    assert all(200 <= n <= 260 for n in lengths) and len(set(lengths)) > 10  # drawn, not fixed
    assert all(r.max_tokens == 5 for r in w.requests)
    assert w.ideal_prefix_hit_rate(1) == 0.0
    default = long_context()
    assert default.num_requests == 4 and all(2048 <= len(p) <= 4096 for p in ids(default))
    for field, bad in (("min_input", dict(min_input=0)), ("max_input", dict(min_input=20, max_input=10)),
                       ("output_len", dict(output_len=0)), ("num_requests", dict(num_requests=0))):
        with pytest.raises(ValueError, match=field):
            long_context(**bad)


def test_trace_workload_equal_hash_ids_give_equal_blocks():
    w = trace_workload(TINY_TRACE, num_requests=4, scale=32, block_size=16, seed=7)
    a, b, c, d = ids(w)
    assert [len(p) for p in (a, b, c, d)] == [41, 35, 13, 32]
    assert [r.max_tokens for r in w.requests] == [4, 1, 1, 2]  # ceil(output / 32), at least 1
    assert [r.arrival_ms for r in w.requests] == [0, 5, 9, 12]
    assert [r.group for r in w.requests] == [1, 1, 5, 1]
    assert a[:32] == b[:32]  # hash ids 1, 2
    assert a[32:35] != b[32:35]  # hash 3 vs 9
    assert d[:16] == a[:16] and d[16:] != a[16:32]  # hash 1, then 7 vs 2
    assert c != a[:13]  # hash 5 vs 1
    # a hash id's tokens depend on the seed and the id only, not on which requests were picked
    assert ids(trace_workload(TINY_TRACE, num_requests=1, seed=7))[0] == a
    assert ids(trace_workload(TINY_TRACE[2:], num_requests=2, seed=7)) == [c, d]
    assert w.prefix_stats(16).num_hit_tokens == 32 + 16  # b hits blocks 1, 2; d hits block 1


def test_trace_workload_sampling_and_validation():
    s1 = trace_workload(TINY_TRACE, num_requests=2, sample=True, seed=11)
    assert s1 == trace_workload(TINY_TRACE, num_requests=2, sample=True, seed=11)
    arrivals = [r.arrival_ms for r in s1.requests]
    assert arrivals == sorted(arrivals)
    truncated = trace_workload(TINY_TRACE, num_requests=1, max_input=20, seed=7)
    assert ids(truncated)[0] == ids(trace_workload(TINY_TRACE, num_requests=1, seed=7))[0][:20]
    with pytest.raises(ValueError, match="block_size"):
        trace_workload(TINY_TRACE, scale=32, block_size=32)  # 16-token hash blocks
    with pytest.raises(ValueError, match="num_requests"):
        trace_workload(TINY_TRACE, num_requests=5)


def test_trace_workload_on_the_real_trace_shares_the_root_block(real_trace):
    w = trace_workload(real_trace, num_requests=8, seed=0)
    assert all(tr.hash_ids[0] == 0 for tr in real_trace[:8])  # every one starts with hash 0
    first_blocks = {tuple(p[:16]) for p in ids(w)}
    second_blocks = {tuple(p[16:32]) for p in ids(w)}
    assert len(first_blocks) == 1 and len(second_blocks) == 8


# -- ideal prefix hits --------------------------------------------------------------------------

def test_ideal_prefix_hit_rate_on_a_hand_made_workload():
    r = lambda tokens: BenchRequest(list(tokens), max_tokens=1)  # noqa: E731
    w = Workload("tiny", [
        r(range(1, 11)),                         # 10 tokens, caches [1-4] [5-8]: no hit
        r([*range(1, 9), 20, 21, 22, 23, 24]),  # 13 tokens: hits [1-4] [5-8] = 8, caches [20-23]
        r(range(1, 9)),                          # 8 tokens: capped at (8 - 1) // 4 = 1 block = 4
        r([1, 2, 3, 99, 5, 6, 7, 8]),            # differs in block 0: no hit
        r([30, 31, 32, 33, 5, 6, 7, 8]),         # [5-8] under another parent: no hit
        r([*range(1, 9), 20, 21, 22, 23, 24]),  # 13 tokens again: 3 blocks = 12
    ])
    stats = w.prefix_stats(4)
    assert (stats.num_prompt_tokens, stats.num_hit_tokens) == (60, 24)
    assert w.ideal_prefix_hit_rate(4) == pytest.approx(0.4)
    assert w.prefix_stats(8).num_hit_tokens == 8 + 0 + 0 + 0 + 0 + 8  # one 8-token block; third is capped
    assert Workload("empty", []).ideal_prefix_hit_rate(4) == 0.0
    with pytest.raises(ValueError, match="block_size"):
        w.prefix_stats(0)


def test_ideal_prefix_hit_rate_of_the_generators_matches_their_structure():
    # 4 groups x 8 requests of 256 + 32 tokens: all but the first of each group hit the system prompt
    assert shared_prefix().ideal_prefix_hit_rate(16) == pytest.approx(4 * 7 * 256 / (32 * 288))
    # turn t hits the whole prompt of turn t - 1 (96, 160, 224 tokens) out of 96 + 160 + 224 + 288
    assert multi_turn().ideal_prefix_hit_rate(16) == pytest.approx(480 / 768)


# -- registry -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["shared-prefix", "multi-turn", "random", "long-context"])
def test_registry_builds_the_requested_number_of_requests(name):
    for n in (1, 13, 40):
        w = WORKLOADS[name](num_requests=n, seed=0)
        assert w.name == name and w.num_requests == n
    assert WORKLOADS[name](num_requests=None, seed=0) == WORKLOADS[name](seed=0)
    with pytest.raises(ValueError, match="num_requests"):
        WORKLOADS[name](num_requests=0, seed=0)


def test_registry_trace_reads_the_real_trace(real_trace):
    w = WORKLOADS["trace"](num_requests=10, seed=0)
    assert w == trace_workload(real_trace, num_requests=10, seed=0)
    assert set(WORKLOADS) == {"shared-prefix", "multi-turn", "random", "long-context", "trace"}


def test_generators_reject_bad_arguments():
    with pytest.raises(ValueError, match="question_len"):
        shared_prefix(question_len=0)
    with pytest.raises(ValueError, match="distinct"):
        random_lengths(num_requests=10, vocab_size=FIRST_TOKEN_ID + 5)
    with pytest.raises(ValueError, match="sigma"):
        random_lengths(sigma=0)


# -- trace loading ------------------------------------------------------------------------------

def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"timestamp": 3, "input_length": 600, "output_length": 7, "hash_ids": [4, 5]})


def test_load_trace_reads_records_and_limit(tmp_path):
    f = write_lines(tmp_path / "t.jsonl", [GOOD, "", GOOD.replace("600", "20").replace("[4, 5]", "[4]")])
    assert load_trace(f) == [TraceRequest(3, 600, 7, (4, 5)), TraceRequest(3, 20, 7, (4,))]
    assert load_trace(f, limit=1) == [TraceRequest(3, 600, 7, (4, 5))]
    assert load_trace(f)[0].total_length == 607


@pytest.mark.parametrize("bad, needle", [
    ('{"timestamp": 0, "input_length": 5', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "'hash_ids'"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": []}', "'input_length'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "'hash_ids'"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}', "spans only 1"),
])
def test_malformed_trace_line_is_named(tmp_path, bad, needle):
    f = write_lines(tmp_path / "t.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(ValueError, match=needle) as e:
        load_trace(f)
    assert f"{f}, line 3:" in str(e.value)


def test_empty_trace_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_trace(write_lines(tmp_path / "t.jsonl", ["", "  "]))


def test_find_trace_order_and_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV_VAR, raising=False)
    explicit = write_lines(tmp_path / "mine.jsonl", [GOOD])
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_trace(tmp_path / "missing.jsonl")
    # walking up from a nested repository root
    found = tmp_path / TRACE_RELATIVE_PATH
    found.parent.mkdir(parents=True)
    write_lines(found, [GOOD])
    repo = tmp_path / "work" / "main"
    repo.mkdir(parents=True)
    assert find_trace(start=repo) == found
    assert find_trace(explicit, start=repo) == explicit
    monkeypatch.setenv(TRACE_ENV_VAR, str(explicit))
    assert find_trace(start=repo) == explicit
    monkeypatch.setenv(TRACE_ENV_VAR, str(tmp_path / "gone.jsonl"))
    with pytest.raises(FileNotFoundError, match=TRACE_ENV_VAR):
        find_trace(start=repo)
    monkeypatch.delenv(TRACE_ENV_VAR)
    found.unlink()
    with pytest.raises(FileNotFoundError, match="no trace found"):
        find_trace(start=repo)


def test_real_trace_first_record(real_trace):
    assert real_trace[0] == TraceRequest(0, 6758, 500, tuple(range(14)))
    assert len(real_trace) == 64
