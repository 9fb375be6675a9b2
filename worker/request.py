"""A request (one sample of a generation) as the scheduler and the KV cache manager see it.

The token-count invariant drives everything: `num_computed_tokens` catches up to `num_tokens`.

    token_ids:  [ prompt ............................ | output ...... ]
                [ computed (KV in cache)  | to compute this step | ...]
                                          ^ num_computed_tokens          ^ num_tokens

A prefix hit, a prefill chunk, a decode step, a preemption (back to 0) and, later, a swap-in all
move that one counter. Under a token eviction policy the cache holds only some of the computed
tokens: `num_kv_tokens` entries, and `num_evicted_tokens` more were dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.worker.block_hash import hash_blocks
from kvstrata.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvstrata.worker.prefix_cache import KVBlock
    from kvstrata.worker.speculative import NgramIndex
    from kvstrata.worker.token_eviction import EvictionState
    from kvstrata.worker.tokenizer import Detokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FORK_PENDING = "fork_pending"  # sample i > 0 of an n > 1 request, waiting for sample 0's prefill
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class Teacher:
    """Teacher forcing: each step appends the next of `token_ids` and records its log-probability."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_root: bytes
    arrival: int = 0
    sample_index: int = 0
    group_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[KVBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_pinned_tokens: int = 0  # prompt tokens covered by this request's cache pins
    num_tier_waits: int = 0  # scheduler steps spent waiting for blocks to load from NVMe
    # set while preempted by swap: the DRAM keys of its blocks and the tokens they hold
    swapped: tuple[list[bytes], int] | None = None
    generator: torch.Generator | None = None
    detokenizer: Detokenizer | None = None
    logprobs: list[dict[int, float]] | None = None
    forks: list[Request] = field(default_factory=list)
    eviction: EvictionState | None = None  # set when the request runs under a token eviction policy
    num_evicted_tokens: int = 0  # computed tokens whose KV the policy dropped
    teacher: Teacher | None = None  # set: the output is forced (perplexity), not sampled
    ngram: NgramIndex | None = None  # speculative decoding's lookup of its own tokens (worker/speculative.py)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Cache entries the request holds: its computed tokens less those evicted."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Lower runs first: priority, then arrival (FCFS), then sample index."""
        return (self.params.priority, self.arrival, self.sample_index)

    def reset_eviction(self) -> None:
        """Its KV is gone (preemption by recompute): start over with nothing evicted."""
        self.num_evicted_tokens = 0
        if self.eviction is not None:
            self.eviction.reset()

    def update_block_hashes(self, block_size: int) -> None:
        """Extend block_hashes to cover every full block of token_ids."""
        have = len(self.block_hashes)
        if (len(self.token_ids) // block_size) > have:
            parent = self.block_hashes[-1] if have else None
            self.block_hashes.extend(
                hash_blocks(self.hash_root, self.token_ids, block_size, start_block=have, parent=parent)
            )
