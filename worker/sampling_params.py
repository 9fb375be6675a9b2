"""Sampling parameters of one request, validated at construction so bad input fails early."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstrata.worker.token_eviction import EvictionPolicy, KeepAll, resolve_eviction

MAX_N = 64
MAX_LOGPROBS = 20
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    # a token eviction policy for this request (a policy, or a spec such as "h2o(heavy=32, recent=32)");
    # None: the model's (LLM(kv_eviction=...)), if any; "none" (KEEP_ALL): no eviction, whatever
    # the model's. Parsed into a policy at construction.
    kv_eviction: EvictionPolicy | KeepAll | str | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=-1)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _check_int("priority", self.priority)
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string")
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        for i, t in enumerate(ids):
            _check_int(f"stop_token_ids[{i}]", t, lo=0)
        self.stop_token_ids = ids
        self.kv_eviction = resolve_eviction(self.kv_eviction, "kv_eviction")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows float32; the answer is the argmax anyway
        return self.temperature < _MIN_TEMPERATURE


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
