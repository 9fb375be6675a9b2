"""The simulated worker of `kvstrata bench routing` (routing.py runs the fleet): a decoder's shape, the
hardware's roofline clock, and a worker that runs continuous batching over its own tiered prefix cache.

    step:   [ decode 1 token for each running request | prefill chunk(s), FIFO, up to the token budget ]
    time:   max(2 x params x tokens / FLOP/s, (weights + K/V of running contexts) / HBM B/s)
            + DRAM-hit blocks x block bytes / PCIe B/s
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvstrata.cluster.bench.block_cache import TieredBlockCache
from kvstrata.cluster.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from kvstrata.router.placement import PrefixMatch, WorkerLoad


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-3-8B-shaped decoder in bf16 by default."""

    num_params: float = 8.03e9
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True, slots=True)
class Hardware:
    """One H100 SXM by default: dense bf16 FLOP/s, HBM3 bandwidth, and host-to-device copies over PCIe."""

    flops_per_s: float = 989e12
    hbm_bytes_per_s: float = 3.35e12
    host_bytes_per_s: float = 50e9


@dataclass(frozen=True, slots=True)
class TimeModel:
    model: ModelShape = ModelShape()
    hardware: Hardware = Hardware()

    def step_s(self, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int,
               num_copy_tokens: int = 0) -> float:
        """One engine step: `num_decodes` sequences with `num_context_tokens` of K/V between them decode a
        token each, `num_prefill_tokens` prompt tokens are computed, and DRAM hits are copied back first."""
        m, hw = self.model, self.hardware
        compute = 2 * m.num_params * (num_prefill_tokens + num_decodes) / hw.flops_per_s
        memory = (m.weight_bytes + m.kv_bytes_per_token * num_context_tokens) / hw.hbm_bytes_per_s
        copy = num_copy_tokens * m.kv_bytes_per_token / hw.host_bytes_per_s
        return max(compute, memory) + copy


# -- one simulated worker ---------------------------------------------------------------------------

@dataclass(slots=True)
class SimRequest:
    index: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hashes: tuple[int, ...]  # its full prompt blocks: what it caches
    num_matchable: int  # leading blocks a hit may cover: (prompt - 1) // block, so one token is computed
    remaining: int = 0  # prefill tokens left; the router's estimate until the first chunk
    started: bool = False
    num_hit_tokens: int = 0
    num_dram_hit_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @classmethod
    def from_trace(cls, index: int, r: TraceRequest, time_scale: float) -> SimRequest:
        block = TRACE_BLOCK_TOKENS
        return cls(index, r.arrival_ms / 1000 / time_scale, r.input_length, r.output_length,
                   r.hash_ids[:r.input_length // block], (r.input_length - 1) // block)


class SimWorker:
    """A worker's queue, running batch and cache, stepped by the simulation's event loop: `begin_step`
    plans a step and returns its duration, `end_step` applies it."""

    def __init__(self, worker_id: str, cache: TieredBlockCache, time_model: TimeModel, max_batched_tokens: int):
        self.worker_id, self.cache, self.time_model = worker_id, cache, time_model
        self.max_batched_tokens = max_batched_tokens
        self.queue: deque[SimRequest] = deque()  # waiting, FIFO; the head may be part-way through its prefill
        self.pending_prefill_tokens = 0
        self.num_running = 0
        self.num_context_tokens = 0  # K/V tokens of the running sequences
        self.step_to_finished: dict[int, list[SimRequest]] = {}
        self.num_steps = 0
        self.busy_s = 0.0  # in any step
        self.prefill_busy_s = 0.0  # in steps that prefill: what delays a new request's first token
        self.num_prefilled_tokens = 0
        self.num_requests = 0
        self._stepping = False
        self._num_decodes = 0
        self._prefilled: list[SimRequest] = []  # whose prompt the current step finishes

    @property
    def has_work(self) -> bool:
        return bool(self.queue) or self.num_running > 0

    @property
    def stepping(self) -> bool:
        return self._stepping

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, self.num_running, len(self.queue), self.pending_prefill_tokens)

    def match(self, req: SimRequest) -> PrefixMatch:
        n_hbm, n_dram = self.cache.match(req.hashes[:req.num_matchable])
        return PrefixMatch(hbm_tokens=n_hbm * TRACE_BLOCK_TOKENS, dram_tokens=n_dram * TRACE_BLOCK_TOKENS)

    def enqueue(self, req: SimRequest, estimated_prefill_tokens: int) -> None:
        req.remaining = estimated_prefill_tokens
        self.pending_prefill_tokens += estimated_prefill_tokens
        self.queue.append(req)
        self.num_requests += 1

    def begin_step(self) -> float:
        """Plan one step: every running sequence decodes, the queue's head prefills within the budget."""
        budget = self.max_batched_tokens - self.num_running
        num_prefill = num_copy = 0
        for req in self.queue:
            if budget <= 0:
                break
            if not req.started:
                num_copy += self._start(req)
            take = min(budget, req.remaining)
            req.remaining -= take
            budget -= take
            num_prefill += take
            if req.remaining == 0:
                self._prefilled.append(req)
        self.pending_prefill_tokens -= num_prefill
        self.num_prefilled_tokens += num_prefill
        self._num_decodes = self.num_running
        self._stepping = True
        duration = self.time_model.step_s(num_prefill, self.num_running, self.num_context_tokens, num_copy)
        self.busy_s += duration
        if num_prefill:
            self.prefill_busy_s += duration
        return duration

    def _start(self, req: SimRequest) -> int:
        """Match the prompt now, when its first chunk is scheduled; the DRAM-hit tokens to copy back."""
        n_hbm, n_dram = self.cache.match(req.hashes[:req.num_matchable])
        self.cache.fetch(req.hashes, n_hbm + n_dram)
        req.num_hit_tokens = (n_hbm + n_dram) * TRACE_BLOCK_TOKENS
        req.num_dram_hit_tokens = n_dram * TRACE_BLOCK_TOKENS
        self.pending_prefill_tokens += req.num_prompt_tokens - req.num_hit_tokens - req.remaining
        req.remaining = req.num_prompt_tokens - req.num_hit_tokens
        req.started = True
        return req.num_dram_hit_tokens

    def end_step(self, now: float) -> list[SimRequest]:
        """Apply the step that ends at `now`; the requests that finished in it."""
        step = self.num_steps
        self.num_steps += 1
        self._stepping = False
        self.num_context_tokens += self._num_decodes
        done = self.step_to_finished.pop(step, [])
        for req in done:
            req.finish_s = now
            self.num_running -= 1
            self.num_context_tokens -= req.num_prompt_tokens + req.num_output_tokens - 1
        for req in self._prefilled:
            head = self.queue.popleft()
            assert head is req, "a step finishes prompts at the head of the queue, in order"
            req.first_token_s = now
            self.cache.cache(req.hashes)
            if req.num_output_tokens <= 1:
                req.finish_s = now
                done.append(req)
            else:  # decodes in steps step + 1 .. step + output - 1
                self.num_running += 1
                self.num_context_tokens += req.num_prompt_tokens
                self.step_to_finished.setdefault(step + req.num_output_tokens - 1, []).append(req)
        self._prefilled = []
        return done

    def check_integrity(self) -> None:
        assert self.pending_prefill_tokens == sum(r.remaining for r in self.queue), "pending tokens out of step"
        assert self.num_running == sum(map(len, self.step_to_finished.values())), "running count out of step"
        assert self.num_running or self.num_context_tokens == 0, self.num_context_tokens
        self.cache.check_integrity()
