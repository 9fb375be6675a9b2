"""Token eviction policies: which of a request's cached tokens to keep once it holds more than its budget.

A policy sees the request's cache entries (one per kept token, in cache order, not position order),
their original positions, the entries it must keep (those in blocks shared with other requests) and,
for H2O and SnapKV, one attention score per entry. It returns a keep mask. Every policy here is a
"recent window plus a ranked rest" rule:

    entries:  [ protected (shared) | candidates ranked by priority ...... | the newest `recent_tokens` ]
                always kept          the best fill up to `budget_tokens`    always kept

    sliding_window(W)          budget W,      recent W, whole blocks only (no compaction)
    streaming(sinks=S, window=W)  budget S + W, recent W, the earliest positions rank first (the sinks)
    h2o(heavy=H, recent=R)     budget H + R,  recent R, the highest accumulated attention ranks first
    snapkv(window=O, budget=B) budget B,      recent O, the prompt positions the last O prompt queries
                               attended to most rank first; acts only once the prompt is computed

Policies are small frozen dataclasses found through a registry by name, and `parse_eviction` reads the
spec strings that users type.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

POLICIES: dict[str, type[EvictionPolicy]] = {}
SNAPKV_POOL_KERNEL = 7  # SnapKV smooths the observation scores over neighbouring positions


def register(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    def add(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls

    return add


class EvictionPolicy(ABC):
    """The contract: `select` is pure (it reads its arguments and returns a new mask); the caller moves
    the KV, frees blocks and keeps the per-request state. A policy never changes once built, so one
    object may serve many requests at once."""

    name: ClassVar[str]
    needs_scores: ClassVar[bool] = False  # wants accumulated attention per cache entry
    whole_blocks: ClassVar[bool] = False  # frees whole blocks only, never moves a token
    whole_prompt: ClassVar[bool] = False  # computes the whole prompt before it evicts (SnapKV)

    @property
    @abstractmethod
    def budget_tokens(self) -> int:
        """Tokens a request keeps after an eviction (not counting shared blocks beyond it)."""

    @property
    @abstractmethod
    def recent_tokens(self) -> int:
        """The newest tokens, always kept."""

    @property
    def num_stable_tokens(self) -> int:
        """Leading positions this policy never evicts: their blocks may be offered to the prefix cache."""
        return 0

    def score_queries(self, num_prompt_tokens: int) -> tuple[int, int]:
        """[lo, hi): positions of the queries whose attention counts toward the scores."""
        return 0, 1 << 62

    def can_evict(self, num_computed_tokens: int, num_prompt_tokens: int) -> bool:
        return not self.whole_prompt or num_computed_tokens >= num_prompt_tokens

    def peak_tokens(self, num_prompt_tokens: int, block_size: int) -> int:
        """Most cache entries a request under this policy holds at once (with no shared prefix)."""
        kept = max(self.budget_tokens, num_prompt_tokens) if self.whole_prompt else self.budget_tokens
        return kept + block_size

    def priority(self, positions: torch.Tensor, scores: torch.Tensor | None, num_prompt_tokens: int) -> torch.Tensor:
        """[L] float: higher is kept first, among the entries neither protected nor recent. By
        default the newer first (a pure window never has room for more than its window)."""
        return positions.float()

    def select(self, positions: torch.Tensor, num_computed_tokens: int, protected: torch.Tensor,
               scores: torch.Tensor | None = None, num_prompt_tokens: int = 0) -> torch.Tensor:
        """positions [L] long (each entry's original position), protected [L] bool -> keep [L] bool.

        Keeps protected and recent entries, then the highest-priority others up to the budget; ties
        go to the entry earlier in the cache."""
        keep = protected | (positions >= num_computed_tokens - self.recent_tokens)
        room = min(self.budget_tokens - int(keep.sum()), int((~keep).sum()))
        if room > 0:
            rank = self.priority(positions, scores, num_prompt_tokens).float().masked_fill(keep, float("-inf"))
            order = torch.sort(rank, descending=True, stable=True).indices
            keep[order[:room]] = True
        return keep

    def spec(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"{self.name}({args})"

    def __str__(self) -> str:
        return self.spec()


@register("sliding_window")
@dataclass(frozen=True)
class SlidingWindow(EvictionPolicy):
    """The last `window` tokens. Only blocks wholly outside the window are freed, so nothing moves and
    the request holds up to one partly stale block more than the window."""

    window: int
    whole_blocks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_field(self, "window", 1)

    @property
    def budget_tokens(self) -> int:
        return self.window

    @property
    def recent_tokens(self) -> int:
        return self.window


@register("streaming")
@dataclass(frozen=True)
class StreamingLLM(EvictionPolicy):
    """StreamingLLM: the first `sinks` tokens (attention sinks) plus the last `window`."""

    sinks: int
    window: int

    def __post_init__(self) -> None:
        _check_field(self, "sinks", 0)
        _check_field(self, "window", 1)

    @property
    def budget_tokens(self) -> int:
        return self.sinks + self.window

    @property
    def recent_tokens(self) -> int:
        return self.window

    @property
    def num_stable_tokens(self) -> int:
        return self.sinks

    def priority(self, positions: torch.Tensor, scores: torch.Tensor | None, num_prompt_tokens: int) -> torch.Tensor:
        return -positions.float()


@register("h2o")
@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Heavy hitters: the `heavy` tokens with the highest attention accumulated over every query so
    far (summed over all layers and heads, since one block table serves them all), plus the last
    `recent`."""

    heavy: int
    recent: int
    needs_scores: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_field(self, "heavy", 0)
        _check_field(self, "recent", 1)

    @property
    def budget_tokens(self) -> int:
        return self.heavy + self.recent

    @property
    def recent_tokens(self) -> int:
        return self.recent

    def priority(self, positions: torch.Tensor, scores: torch.Tensor | None, num_prompt_tokens: int) -> torch.Tensor:
        return scores


@register("snapkv")
@dataclass(frozen=True)
class SnapKV(EvictionPolicy):
    """SnapKV: once the prompt is computed, keep the prompt positions the last `window` prompt queries
    attended to most (summed over those queries, layers and heads, then averaged over neighbouring
    positions), `budget` tokens in all with the observation window. Generated tokens then keep a
    sliding window of `window`, so the budget holds for the whole generation."""

    window: int
    budget: int
    needs_scores: ClassVar[bool] = True
    whole_prompt: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_field(self, "window", 1)
        _check_field(self, "budget", 1)
        if self.budget < self.window:
            raise ValueError(f"snapkv: budget ({self.budget}) must be at least the observation window ({self.window})")

    @property
    def budget_tokens(self) -> int:
        return self.budget

    @property
    def recent_tokens(self) -> int:
        return self.window

    def score_queries(self, num_prompt_tokens: int) -> tuple[int, int]:
        return num_prompt_tokens - self.window, num_prompt_tokens

    def priority(self, positions: torch.Tensor, scores: torch.Tensor | None, num_prompt_tokens: int) -> torch.Tensor:
        # pool along positions: entries are in cache order, which eviction may have permuted
        order = torch.argsort(positions)
        pooled = F.avg_pool1d(scores[order].float().view(1, 1, -1), SNAPKV_POOL_KERNEL, stride=1,
                              padding=SNAPKV_POOL_KERNEL // 2, count_include_pad=False).view(-1)
        rank = torch.empty_like(pooled)
        rank[order] = pooled
        # generated tokens leave with the sliding window: every prompt position ranks above them
        return rank.masked_fill(positions >= num_prompt_tokens, -1.0)


def _check_field(policy: EvictionPolicy, field_name: str, lo: int) -> None:
    value = getattr(policy, field_name)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        kind = "a positive integer" if lo >= 1 else "a non-negative integer"
        raise ValueError(f"{policy.name}: {field_name} must be {kind}, got {value!r}")


# -- specs --------------------------------------------------------------------------------------------

_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)
_ARG = re.compile(r"^\s*(?:([A-Za-z_][A-Za-z0-9_]*)\s*=\s*)?(\S.*?)\s*$", re.DOTALL)


def parse_eviction(spec: str, field_name: str = "kv_eviction") -> EvictionPolicy:
    """A policy from its spec: "name(v, ...)" or "name(field=v, ...)", positional arguments first, in
    field order. ValueError names `field_name`, and the policy field at fault.

        sliding_window(64)   sliding_window(window=64)   streaming(sinks=4, window=60)
        h2o(heavy=32, recent=32)   snapkv(window=16, budget=128)
    """
    if not isinstance(spec, str):
        raise ValueError(f"{field_name} must be a policy spec string, got {spec!r}")
    m = _SPEC.match(spec)
    if m is None:
        raise ValueError(f"{field_name}: expected a policy like h2o(heavy=32, recent=32), got {spec!r}")
    name, body = m.group(1), m.group(2)
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"{field_name}: unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    names = [f.name for f in fields(cls)]
    usage = f"{name}({', '.join(f'{n}=N' for n in names)})"
    values: dict[str, int] = {}
    named = False
    parts = [] if not body.strip() else body.split(",")
    for i, part in enumerate(parts):
        am = _ARG.match(part)
        if am is None:
            raise ValueError(f"{field_name}: {usage}: argument {i + 1} is empty")
        key, raw = am.group(1), am.group(2)
        if key is None:
            if named:
                raise ValueError(f"{field_name}: {usage}: a positional argument follows a named one")
            if i >= len(names):
                raise ValueError(f"{field_name}: {usage}: takes {len(names)} argument(s), got {len(parts)}")
            key = names[i]
        elif key not in names:
            raise ValueError(f"{field_name}: {usage}: unknown field {key!r}")
        else:
            named = True
        if key in values:
            raise ValueError(f"{field_name}: {usage}: {key} is given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"{field_name}: {usage}: {key} must be an integer, got {raw!r}") from None
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"{field_name}: {usage}: {', '.join(missing)} missing")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None


class KeepAll:
    """A request's explicit "none": no token eviction, whatever the engine's default policy."""

    __slots__ = ()

    def spec(self) -> str:
        return "none"

    def __repr__(self) -> str:
        return "KEEP_ALL"


KEEP_ALL = KeepAll()


def resolve_eviction(value: object, field_name: str = "kv_eviction") -> EvictionPolicy | KeepAll | None:
    """None, a policy, "none" (KEEP_ALL) or a spec string -> None, KEEP_ALL or a policy; ValueError
    naming field_name otherwise."""
    if value is None or isinstance(value, (EvictionPolicy, KeepAll)):
        return value
    if isinstance(value, str):
        return KEEP_ALL if value.strip() == "none" else parse_eviction(value, field_name)
    raise ValueError(f"{field_name} must be a policy or a spec string such as h2o(heavy=32, recent=32), got {value!r}")


# -- per-request state --------------------------------------------------------------------------------

@dataclass(slots=True)
class EvictionState:
    """What one request under a policy carries besides its block table.

    Cache entry j holds the KV of position `positions[j]` for j < len(positions); later entries were
    appended since the last eviction, in order, so they hold the newest computed positions:

        cache entries:  [ 0 .. len(positions) - 1 | appended since ]
        positions:      [ positions[...]          | N - appended .. N - 1 ]   N = num_computed_tokens
    """

    policy: EvictionPolicy
    positions: torch.Tensor | None = None  # [n] long; None: no eviction yet, entry j is position j
    scores: torch.Tensor | None = None  # [>= cache entries] float32 accumulated attention (H2O, SnapKV)

    def entry_positions(self, num_kv_tokens: int, num_computed_tokens: int) -> torch.Tensor:
        """[num_kv_tokens] long: the original position of each cache entry."""
        n = 0 if self.positions is None else self.positions.numel()
        tail = torch.arange(num_computed_tokens - (num_kv_tokens - n), num_computed_tokens)
        return tail if self.positions is None else torch.cat([self.positions, tail])

    def reserve_scores(self, num_entries: int, device: torch.device) -> torch.Tensor:
        """The score buffer, grown with zeros to at least num_entries."""
        s = self.scores
        if s is None or s.numel() < num_entries:
            grown = torch.zeros(max(num_entries, 2 * (0 if s is None else s.numel())), dtype=torch.float32,
                                device=device)
            if s is not None:
                grown[: s.numel()] = s
            self.scores = s = grown
        return s

    def max_chunk(self, num_kv_tokens: int, num_shared_tokens: int, num_computed_tokens: int,
                  num_prompt_tokens: int, block_size: int) -> int:
        """Most tokens the next step may add, so that the request holds at most one block more than
        it keeps after an eviction (its budget, or its shared prefix and recent window if larger);
        SnapKV computes its whole prompt first, since its scores need every prompt key."""
        p = self.policy
        if p.whole_prompt and num_computed_tokens < num_prompt_tokens:
            return num_prompt_tokens - num_computed_tokens  # ends the chunk at the prompt's end
        kept = max(p.budget_tokens, num_shared_tokens + p.recent_tokens)
        return max(1, kept + block_size - num_kv_tokens)

    def copy(self) -> EvictionState:
        """For a fork: the child's own copy of the parent's state."""
        return EvictionState(self.policy, None if self.positions is None else self.positions.clone(),
                             None if self.scores is None else self.scores.clone())

    def reset(self) -> None:
        """After a preemption by recompute: the KV is gone, and so is what was known about it."""
        self.positions = None
        self.scores = None
