"""Speculative decoding by n-gram lookup: drafts from the request's own tokens, checked by the model.

A decode step reads every weight to produce one token per sequence; while a step is memory-bound,
more rows cost little. So the engine guesses a request's next few tokens and the step computes
them with the real one, as a short chunk:

    tokens:  ... a b c | d        (d: sampled last step, not yet computed)
    lookup:  the latest earlier "b c d" in the request's tokens was followed by "e f"
    step:    computes d e f (3 rows); the model's greedy choices after d, e and f are x, y, z
    verify:  x == e? then y == f? ... the accepted drafts, then one token of the model's own

If x == e and y == f, the step yields e, f and z: three tokens for one pass over the weights. If
x != e, it yields x, as a plain decode would. Every token is the model's own greedy choice given
the tokens before it, so the output is what greedy decoding gives, up to the last bits of the
logits (a chunk runs through the prefill attention kernel, a single token through the decode
one). Rejected drafts leave K/V in slots past the request's computed tokens, which the next tokens
overwrite; blocks only count once computed, so nothing of a draft reaches the prefix cache.

The lookup keeps, per request, a dict from each n-gram (n = 1 .. MAX_NGRAM) to the position of the
token that last followed it, updated as tokens arrive: one lookup per n per step, not a scan.
Outputs that repeat themselves (lists, code, the loops of a small model) draft well; fresh prose
drafts little, and a step without drafts is a plain decode step.

Sampled requests are checked the same way: each row is sampled as a plain step would sample it,
and a draft token is kept while it equals the row's sample. A draft is one token for certain, so
this is the speculative-sampling rule itself: the token is kept with the probability the model
gives it, and otherwise the row's sample, drawn from the distribution less that token, replaces
it. Every kept token is drawn from the model's distribution given the tokens before it, so the
output is distributed as plain sampling. The sampler draws a seeded request's noise key, one a
row, from the request's own generator (worker/sampler.py), and `rewind` puts the generator back
to where the kept rows leave it, so a seeded request gives the tokens it gives without drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvstrata.worker.kv_cache_manager import KVCacheManager
    from kvstrata.worker.model_runner import ScheduledBatch
    from kvstrata.worker.request import Request
    from kvstrata.worker.scheduler import SchedulerConfig

MAX_NGRAM = 3  # longest suffix matched; shorter ones are tried when it has no earlier occurrence
MIN_NGRAM = 1
# Below this share of its draft tokens accepted lately, a request that shares its step with others
# drafts one token a step, enough to notice when its output starts repeating, instead of spending
# the step's rows on guesses that fail. Alone in a step it drafts in full: on a 2-core Xeon a step
# of 5 rows took 24.9 ms against 24.1 for one row, so four guesses pay if one step in 30 keeps one.
LOW_ACCEPTANCE = 0.1
RATE_WEIGHT = 0.3  # weight of the latest step in the running share


class NgramIndex:
    """The position of the token that last followed each n-gram of a token list, kept up to date."""

    __slots__ = ("follows", "upto", "rate")

    def __init__(self) -> None:
        self.follows: dict[tuple[int, ...], int] = {}
        self.upto = 0  # tokens [0, upto) are indexed
        self.rate = 0.5  # running share of this request's draft tokens that the model accepted

    def record(self, drafted: int, accepted: int) -> None:
        self.rate += RATE_WEIGHT * (accepted / drafted - self.rate)

    def draft_length(self, k: int, alone: bool) -> int:
        """Tokens to draft now, k at most: all of them, or one while drafts keep failing in a
        step shared with other requests."""
        return k if alone or self.rate >= LOW_ACCEPTANCE else min(k, 1)

    def update(self, tokens: list[int]) -> None:
        """Index tokens[upto:]: each new position t is recorded as what follows the n-grams ending
        at t - 1 (a later occurrence replaces an earlier one)."""
        follows = self.follows
        for t in range(max(self.upto, 1), len(tokens)):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if t - n < 0:
                    break
                follows[tuple(tokens[t - n:t])] = t
        self.upto = len(tokens)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the list's suffix."""
        if k <= 0:
            return []
        self.update(tokens)
        end = len(tokens)
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            pos = self.follows.get(tuple(tokens[end - n:]))
            if pos is not None:
                return tokens[pos:min(pos + k, end)]
        return []


def add_drafts(batch: ScheduledBatch, kv: KVCacheManager, config: SchedulerConfig) -> dict[Request, list[int]]:
    """Give decodes of this batch drafts from their own tokens, while the step holds at most
    config.speculative_step_tokens tokens; each draft joins its request's tokens for this step (the
    engine takes it out again once the model has checked it) and the batch is reordered, one-token
    rows first. Requests with the most output to go draft first: a batch lasts as long as its
    longest request, and a token saved there saves a step."""
    room = config.speculative_step_tokens - batch.num_tokens
    if room <= 0:
        return {}
    candidates = []
    for i in range(batch.num_decodes):
        req = batch.requests[i]
        if (req.teacher is None and req.eviction is None and not req.forks
                and req.num_computed_tokens + 1 == req.num_tokens):
            candidates.append((req.params.max_tokens - req.num_output_tokens, i))
    candidates.sort(key=lambda c: -c[0])
    drafts: dict[Request, list[int]] = {}
    for _, i in candidates:
        if room <= 0:
            break
        req = batch.requests[i]
        if req.ngram is None:
            req.ngram = NgramIndex()
        # room for the accepted drafts and the model's own next token within both limits
        k = min(req.ngram.draft_length(config.speculative_tokens, len(batch.requests) == 1), room,
                req.params.max_tokens - req.num_output_tokens - 1, config.max_model_len - req.num_tokens - 1)
        draft = req.ngram.draft(req.token_ids, k) if k > 0 else []
        if not draft or not kv.allocate_slots(req, 1 + len(draft), watermark=True):
            continue
        req.token_ids.extend(draft)
        batch.num_new_tokens[i] += len(draft)
        drafts[req] = draft
        room -= len(draft)
    if drafts:  # one-token rows first: attention runs them as one batch
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] != 1)
        batch.requests = [batch.requests[i] for i in order]
        batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
    return drafts


def sample_rows(to_sample: list[Request], spans: list[int]) -> list[Request]:
    """The request of each logits row: a drafting request once per row of its span."""
    return [req for req, span in zip(to_sample, spans) for _ in range(span)]


def rewind(generator: torch.Generator, state: torch.Tensor, rows: int) -> None:
    """Set a seeded request's generator to where `rows` sampled rows leave it from `state`: the
    sampler draws one key a row from it (sampler.draw_key)."""
    from kvstrata.worker.sampler import draw_key

    generator.set_state(state)
    for _ in range(rows):
        draw_key(generator)
