"""Benchmark workloads: deterministic request mixes of synthetic token ids with a known sharing structure.

Every generator takes a seed and draws from its own `random.Random(seed)`, so equal arguments give
identical workloads in any process. Token ids lie in [FIRST_TOKEN_ID, vocab_size), clear of the special
ids 0..16. Where a structure promises "no sharing" or "differs after the prefix", the token at that
position is drawn without replacement, so the promise holds for every seed, not just by luck.

Requests are listed in the order a benchmark should submit them; `Workload.prefix_stats` counts what a
perfect prefix cache would serve in that order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.cluster.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

DEFAULT_VOCAB_SIZE = 49152  # SmolLM2
FIRST_TOKEN_ID = 17  # ids 0..16 are SmolLM2's special tokens


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to submit. `group` names its shared-prefix group or conversation, if any."""

    prompt_token_ids: list[int]
    max_tokens: int
    group: int | None = None
    arrival_ms: int | None = None  # only trace workloads carry an arrival time


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Prompt tokens, and those a perfect prefix cache serves (see `Workload.prefix_stats`)."""

    num_prompt_tokens: int
    num_hit_tokens: int
    hit_tokens_per_request: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests, in order."""
        return Workload(self.name, self.requests[:num_requests])

    def prefix_stats(self, block_size: int) -> PrefixStats:
        """What an unbounded prefix cache with blocks of `block_size` tokens would serve, in request order.

        A request hits the longest chain of its full prompt blocks that any earlier request's full
        prompt blocks already formed. As in the engine, the last prompt token is always computed (its
        logits are needed), so a prompt of n tokens hits at most (n - 1) // B blocks. B = 4:

            earlier:  a a a a | b b b b | c c              full blocks [aaaa] [bbbb] are cached
            this:     a a a a | b b b b | d d d d | e      hits 2 blocks = 8 of its 13 tokens
            again:    a a a a | b b b b                    hits 1 block: (8 - 1) // 4 = 1

        Output tokens are not counted: they are generated, not part of any later prompt here.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        # a trie of full blocks: each node maps a block's tokens to the node of the chain it ends
        root: dict[tuple[int, ...], dict] = {}
        hits: list[int] = []
        for req in self.requests:
            ids = req.prompt_token_ids
            max_hit_blocks = (len(ids) - 1) // block_size
            node = root
            hit = 0
            for i in range(len(ids) // block_size):
                key = tuple(ids[i * block_size : (i + 1) * block_size])
                child = node.get(key)
                if child is None:  # a miss: every later block of this request is new too
                    child = node[key] = {}
                elif i < max_hit_blocks:
                    hit += block_size
                node = child
            hits.append(hit)
        return PrefixStats(self.num_prompt_tokens, sum(hits), tuple(hits))

    def ideal_prefix_hit_rate(self, block_size: int) -> float:
        return self.prefix_stats(block_size).hit_rate


# -- token helpers ------------------------------------------------------------------------------

def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")


def _check_int(name: str, value: int, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def _distinct_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n different token ids: the first tokens of sequences that must not share a prefix."""
    if n > vocab_size - FIRST_TOKEN_ID:
        raise ValueError(f"need {n} distinct token ids, but vocab_size {vocab_size} has only "
                         f"{vocab_size - FIRST_TOKEN_ID} ordinary ones")
    return rng.sample(range(FIRST_TOKEN_ID, vocab_size), n)


# -- generators ---------------------------------------------------------------------------------

def shared_prefix(num_groups: int = 4, requests_per_group: int = 8, system_prompt_len: int = 256,
                  question_len: int = 32, output_len: int = 64, seed: int = 0,
                  vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Groups of requests that share a system prompt, each followed by its own question.

        group g, request j:  [ system prompt of g (system_prompt_len) | question (g, j) (question_len) ]

    Requests are interleaved across groups (request i belongs to group i % num_groups), as concurrent
    tenants would send them. Each system prompt starts with its own token and each question with its
    own token, so groups share nothing and requests of a group share exactly the system prompt.
    """
    _check_int("num_groups", num_groups, 1)
    _check_int("requests_per_group", requests_per_group, 1)
    _check_int("system_prompt_len", system_prompt_len, 0)
    _check_int("question_len", question_len, 1)
    _check_int("output_len", output_len, 1)
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    num_requests = num_groups * requests_per_group
    heads = _distinct_tokens(rng, num_groups + num_requests, vocab_size)
    systems = [heads[g : g + 1] + _tokens(rng, system_prompt_len - 1, vocab_size) if system_prompt_len else []
               for g in range(num_groups)]
    requests = []
    for i in range(num_requests):
        g = i % num_groups
        question = [heads[num_groups + i]] + _tokens(rng, question_len - 1, vocab_size)
        requests.append(BenchRequest(systems[g] + question, output_len, group=g))
    return Workload("shared-prefix", requests)


def multi_turn(num_conversations: int = 4, num_turns: int = 4, user_turn_len: int = 32,
               assistant_turn_len: int = 32, system_prompt_len: int = 64, seed: int = 0,
               vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Chats in which every turn resends the whole history plus a new user message.

        turn 0:  [ system | user 0 ]
        turn 1:  [ system | user 0 | assistant 0 | user 1 ]                 turn 0's prompt is its prefix
        turn 2:  [ system | user 0 | assistant 0 | user 1 | assistant 1 | user 2 ]

    The assistant turns are synthetic tokens of `assistant_turn_len` (which is also each request's
    max_tokens), not what a model would generate: a benchmark that feeds these prompts to an engine
    shares the prompt prefix only, never the engine's own cached output. Requests are ordered turn by
    turn (every conversation's turn 0, then every turn 1, ...); `group` is the conversation.
    """
    _check_int("num_conversations", num_conversations, 1)
    _check_int("num_turns", num_turns, 1)
    _check_int("user_turn_len", user_turn_len, 1)
    _check_int("assistant_turn_len", assistant_turn_len, 1)
    _check_int("system_prompt_len", system_prompt_len, 0)
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    heads = _distinct_tokens(rng, num_conversations, vocab_size)
    prompts: list[list[list[int]]] = []  # [conversation][turn]
    for c in range(num_conversations):
        history = [heads[c]] + _tokens(rng, system_prompt_len + user_turn_len - 1, vocab_size)
        turns = [list(history)]
        for _ in range(1, num_turns):
            history += _tokens(rng, assistant_turn_len + user_turn_len, vocab_size)
            turns.append(list(history))
        prompts.append(turns)
    requests = [BenchRequest(prompts[c][t], assistant_turn_len, group=c)
                for t in range(num_turns) for c in range(num_conversations)]
    return Workload("multi-turn", requests)


def random_lengths(num_requests: int = 32, mean_input: int = 128, mean_output: int = 64, seed: int = 0,
                   max_input: int = 1024, max_output: int = 512, sigma: float = 1.0,
                   vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Unrelated requests with long-tailed lengths and no shared prefix.

    Lengths are lognormal with the given means (mu = ln(mean) - sigma^2 / 2), rounded and clipped to
    [1, max]; clipping makes the realised means a little lower. Each prompt starts with its own token.
    """
    _check_int("num_requests", num_requests, 1)
    for name, value in (("mean_input", mean_input), ("mean_output", mean_output),
                        ("max_input", max_input), ("max_output", max_output)):
        _check_int(name, value, 1)
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    heads = _distinct_tokens(rng, num_requests, vocab_size)

    def draw(mean: int, hi: int) -> int:
        return min(hi, max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))))

    requests = []
    for head in heads:
        n_in, n_out = draw(mean_input, max_input), draw(mean_output, max_output)
        requests.append(BenchRequest([head] + _tokens(rng, n_in - 1, vocab_size), n_out))
    return Workload("random", requests)


def long_context(num_requests: int = 4, min_input: int = 2048, max_input: int = 4096, output_len: int = 32,
                 seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Unrelated long prompts (documents to read, say), each min_input..max_input tokens (uniform),
    with a short answer. Prefill dominates, and in it attention over thousands of keys: at 4,096
    tokens the attention scores and sums are about two fifths of SmolLM2's prompt arithmetic. Each
    prompt starts with its own token, so nothing is shared."""
    _check_int("num_requests", num_requests, 1)
    _check_int("min_input", min_input, 1)
    _check_int("max_input", max_input, min_input)
    _check_int("output_len", output_len, 1)
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    heads = _distinct_tokens(rng, num_requests, vocab_size)
    requests = [BenchRequest([head] + _tokens(rng, rng.randint(min_input, max_input) - 1, vocab_size), output_len)
                for head in heads]
    return Workload("long-context", requests)


def trace_workload(trace: Sequence[TraceRequest], num_requests: int = 32, scale: int = 32,
                   block_size: int = 16, seed: int = 0, sample: bool = False, max_input: int | None = None,
                   vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """Replay the trace's lengths and prefix sharing at 1/scale of its size, small enough for a CPU.

    Input and output lengths are divided by `scale` (rounded up; the trace's mean input of about 12,000
    tokens becomes about 380 at scale 32). Each trace hash id stands for 512 / scale synthetic tokens
    drawn from a generator seeded by (seed, hash id), so equal hash ids give equal tokens and trace
    requests that share a prefix share it here too. A final partial hash block takes the leading tokens
    of its id's block. Prompt tokens the hash ids do not cover get request-unique tokens.

        trace:   [ hash 0 (512)  | hash 46 (512)  | hash 47 (276) ]     input_length 1300
        scale 32 [ block(0): 16  | block(46): 16  | block(47)[:9] ]     41 tokens

    512 / scale must be a multiple of `block_size`, so that a shared hash block is whole KV blocks.
    By default the first `num_requests` requests are taken, which keeps the real arrival order and the
    sharing between neighbours; `sample=True` takes a seeded random sample instead, in arrival order.
    `max_input` truncates longer prompts. `group` is the request's first hash id.
    """
    _check_int("num_requests", num_requests, 1)
    _check_int("scale", scale, 1)
    _check_int("block_size", block_size, 1)
    _check_vocab(vocab_size)
    if max_input is not None:
        _check_int("max_input", max_input, 1)
    if TRACE_BLOCK_TOKENS % scale or (TRACE_BLOCK_TOKENS // scale) % block_size:
        raise ValueError(f"scale {scale} must divide {TRACE_BLOCK_TOKENS} into blocks of a multiple of "
                         f"block_size {block_size} tokens")
    if num_requests > len(trace):
        raise ValueError(f"num_requests {num_requests} exceeds the trace's {len(trace)} requests")
    rng = random.Random(seed)
    if sample:
        chosen = [trace[i] for i in sorted(rng.sample(range(len(trace)), num_requests))]
    else:
        chosen = list(trace[:num_requests])
    hash_block_len = TRACE_BLOCK_TOKENS // scale
    hash_to_tokens: dict[int, list[int]] = {}

    def hash_block(hash_id: int) -> list[int]:
        if hash_id not in hash_to_tokens:
            # a str seed is hashed with SHA-512, so this is the same in every process
            block_rng = random.Random(f"kvstrata-trace:{seed}:{hash_id}")
            hash_to_tokens[hash_id] = _tokens(block_rng, hash_block_len, vocab_size)
        return hash_to_tokens[hash_id]

    requests = []
    for tr in chosen:
        n_in = -(-tr.input_length // scale)
        if max_input is not None:
            n_in = min(n_in, max_input)
        prompt: list[int] = []
        for hash_id in tr.hash_ids:
            if len(prompt) >= n_in:
                break
            prompt += hash_block(hash_id)[: n_in - len(prompt)]
        prompt += _tokens(rng, n_in - len(prompt), vocab_size)
        group = tr.hash_ids[0] if tr.hash_ids else None
        requests.append(BenchRequest(prompt, max(1, -(-tr.output_length // scale)), group, tr.arrival_ms))
    return Workload("trace", requests)


# -- registry -----------------------------------------------------------------------------------

WorkloadBuilder = Callable[..., Workload]  # (num_requests: int | None = None, seed: int = 0) -> Workload


def _build_shared_prefix(num_requests: int | None = None, seed: int = 0) -> Workload:
    if num_requests is None:
        return shared_prefix(seed=seed)
    _check_int("num_requests", num_requests, 1)
    return shared_prefix(num_groups=-(-num_requests // 8), requests_per_group=8, seed=seed).head(num_requests)


def _build_multi_turn(num_requests: int | None = None, seed: int = 0) -> Workload:
    if num_requests is None:
        return multi_turn(seed=seed)
    _check_int("num_requests", num_requests, 1)
    return multi_turn(num_conversations=-(-num_requests // 4), num_turns=4, seed=seed).head(num_requests)


def _build_random(num_requests: int | None = None, seed: int = 0) -> Workload:
    return random_lengths(seed=seed) if num_requests is None else random_lengths(num_requests, seed=seed)


def _build_long_context(num_requests: int | None = None, seed: int = 0) -> Workload:
    return long_context(seed=seed) if num_requests is None else long_context(num_requests, seed=seed)


def _build_trace(num_requests: int | None = None, seed: int = 0) -> Workload:
    n = 32 if num_requests is None else num_requests
    _check_int("num_requests", n, 1)
    return trace_workload(load_trace(limit=n), num_requests=n, seed=seed)


# The CLI looks names up here: WORKLOADS[name](num_requests=N, seed=0). With num_requests, shared-prefix
# uses groups of 8 and multi-turn conversations of 4 turns, as many as needed, cut to N requests.
WORKLOADS: dict[str, WorkloadBuilder] = {
    "shared-prefix": _build_shared_prefix,
    "multi-turn": _build_multi_turn,
    "random": _build_random,
    "long-context": _build_long_context,
    "trace": _build_trace,
}
