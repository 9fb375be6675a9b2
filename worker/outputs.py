"""Results handed back to users: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # prompt tokens this request pinned (cache_control) that were not already cached: written
    num_cache_write_tokens: int = 0
