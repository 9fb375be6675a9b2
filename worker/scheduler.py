"""Continuous batching: every step, fill a token budget with running requests, then new ones.

    step budget (max_num_batched_tokens)
    [ running: decodes (1 token each) and unfinished prefill chunks | waiting: admitted FCFS ]
                                                                      only if free blocks allow,
                                                                      above a small watermark

When a running request cannot get a block, the lowest-priority, latest-arrived running request is
preempted by recompute: its blocks are freed and `num_computed_tokens` goes back to 0 (its prefix
blocks usually come straight back from the prefix cache). No new request is admitted in a step that
preempted, so a preempted request is never overtaken by a newer one of the same priority.

The "offline" policy is for batch jobs judged by their total time, where every request's
max_tokens is known up front. Among requests of equal priority, the one with the most output
tokens to go is admitted first (and preempted last), so that the longest decode starts early.
While requests decode, a step takes prompt tokens up to an even share of the rows still to compute
over the decode steps that must run anyway, so that no step is much dearer than the others; at
least `offline_step_rows` rows in all (prompt tokens ride nearly free in a memory-bound decode
step), and more where prompts due soon would otherwise end their own decodes after the longest
running request (see _offline_budget). A step with no decodes takes the full budget.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.model_runner import ScheduledBatch
from kvstrata.worker.request import FinishReason, Request, RequestStatus


SCHEDULING_POLICIES = ("fcfs", "offline")
# the "offline" policy meets the deadlines of prompts due within this many steps at an even rate
# (the rest ride on the even spread of rows; see Scheduler._offline_budget)
OFFLINE_DEADLINE_STEPS = 32


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk per step; 0 = budget
    policy: str = "fcfs"  # or "offline" (see the module's docstring)
    offline_step_rows: int = 12  # the "offline" policy's rows in a step with decodes
    # speculative decoding (worker/speculative.py): drafts of up to speculative_tokens a
    # request, added while the step holds at most speculative_step_tokens tokens; 0: off
    speculative_tokens: int = 0
    speculative_step_tokens: int = 8  # LLM's CPU default (256 on GPU)

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.policy!r}")
        if isinstance(self.offline_step_rows, bool) or not isinstance(self.offline_step_rows, int) \
                or self.offline_step_rows < 1:
            raise ValueError(f"offline_step_rows must be a positive integer; got {self.offline_step_rows!r}")
        for name, least in (("speculative_tokens", 0), ("speculative_step_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")


@dataclass
class SchedulerOutput:
    batch: ScheduledBatch
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.batch.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self._waiting: list[tuple[tuple[int, int, int], int, Request]] = []  # heap by sort key
        self._num_waiting = 0
        self.running: list[Request] = []  # kept sorted by sort_key
        self._push_seq = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        self._offline = config.policy == "offline"
        # the "offline" policy's view of the waiting prompts, (tokens, max_tokens) in admission
        # order, rebuilt only when a request joins or leaves the queue
        self._waiting_prompts: list[tuple[int, int]] | None = None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _key(self, request: Request) -> tuple[int, ...]:
        """Lower runs first (and is preempted last)."""
        if self._offline:  # the longest output first, within a priority
            p = request.params
            return (p.priority, -p.max_tokens, request.arrival, request.sample_index)
        return request.sort_key

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._push_seq += 1
        heapq.heappush(self._waiting, (self._key(request), self._push_seq, request))
        self._num_waiting += 1
        self._waiting_prompts = None

    def add_running(self, request: Request) -> None:
        """Insert an already-prepared request (a fork sharing its parent's blocks) as running."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._key)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request wherever it is and free its blocks (finish or abort)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped lazily
            self._waiting_prompts = None
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        budget = self._offline_budget() if self._offline else self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, req,
                            req.num_computed_tokens, self.kv.num_shared_tokens(req) if req.eviction else 0)
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n

        # Block hashes that prefills in this step will compute. A waiting request whose next
        # uncached block is among them waits one step and then hits the cache instead of
        # computing the same prefix a second time (groups of requests sharing a system prompt).
        inflight: set[bytes] = set()
        for req, n in scheduled:
            if n > 1:
                inflight.update(self._hashes_computed(req, n))
        deferred: list[tuple[tuple[int, int, int], int, Request]] = []
        while not preempted and budget and len(self.running) < self.config.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                break
            if req.swapped is not None:
                n = self._chunk(req.num_tokens - req.swapped[1], budget, req, req.swapped[1], 0)
                resumed = self.kv.swap_in(req, n, watermark=True)
                if resumed is False:
                    break
                if resumed:
                    self._admit(req, n, scheduled)
                    budget -= n
                    continue
                # None: DRAM lost its blocks; recompute below
            computed = self.kv.get_computed_blocks(req)
            first_uncached = len(computed.blocks) + len(computed.tier_hashes)
            if computed.pending or (req.num_computed_tokens == 0 and first_uncached < len(req.block_hashes)
                                    and req.block_hashes[first_uncached] in inflight):
                # wait a step: for its blocks to arrive from NVMe, or for a prefill to cache them
                deferred.append(heapq.heappop(self._waiting))
                continue
            n = self._chunk(req.num_tokens - req.num_computed_tokens - computed.num_tokens, budget, req,
                            req.num_computed_tokens + computed.num_tokens, computed.num_tokens)
            if not self.kv.allocate_slots(req, n, computed, watermark=True):
                break
            if req.num_cached_tokens is None:
                req.num_cached_tokens = computed.num_tokens
                self.kv.record_prefix_query(req.num_prompt_tokens, computed.num_tokens)
            self._admit(req, n, scheduled)
            budget -= n
            inflight.update(self._hashes_computed(req, n))
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        if not scheduled and self.kv.tiers is not None:
            self.kv.tiers.wait_for_loads(timeout=0.05)  # nothing to run until blocks arrive from NVMe

        # decodes (one query token) first: attention runs them as one padded batch
        scheduled.sort(key=lambda rn: rn[1] != 1)
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        batch = ScheduledBatch(
            requests=[r for r, _ in scheduled],
            num_new_tokens=[n for _, n in scheduled],
            num_decodes=num_decodes,
            block_copies=self.kv.drain_copies(),
        )
        return SchedulerOutput(batch, preempted)

    def _offline_budget(self) -> int:
        """The "offline" policy's budget while requests decode. The running requests will take S
        more decode steps anyway (the most output tokens any of them still has to go), and the job
        has R rows still to compute: every prompt token, and a row for each output token after a
        request's first. A step takes about R / S rows, so that the rows spread evenly over the
        steps that must run anyway: a step's products cost the same below about a dozen rows and
        more for every row above, so an even spread costs the least. Two more floors: a prompt
        whose decodes would otherwise end after the longest running request has a deadline (S less
        its own output tokens), and those due within OFFLINE_DEADLINE_STEPS are taken at an even
        rate that meets each of them; and at least offline_step_rows rows (those ride nearly free).
        At most the full budget."""
        full = self.config.max_num_batched_tokens
        decodes = 0
        steps_left = 0
        rows_left = 0
        prompts: list[tuple[int, int]] = []  # (tokens to compute, output tokens to go), in running order
        for req in self.running:
            todo = req.num_tokens - req.num_computed_tokens
            outputs_left = req.params.max_tokens - req.num_output_tokens
            steps_left = max(steps_left, outputs_left)
            if todo == 1:
                decodes += 1
                rows_left += outputs_left
            else:
                prompts.append((todo, outputs_left))
        if decodes == 0:
            return full
        if self._waiting_prompts is None:
            self._waiting_prompts = [(req.num_tokens - req.num_computed_tokens,
                                      req.params.max_tokens - req.num_output_tokens)
                                     for _, _, req in sorted(self._waiting) if req.status is RequestStatus.WAITING]
        prompts += self._waiting_prompts
        rate = 0.0
        queued = 0
        for todo, outputs_left in prompts:
            queued += todo
            rows_left += todo + outputs_left - 1  # its prompt, then a decode row for each output after the first
            slack = steps_left - outputs_left
            if slack <= 0:
                return full  # it outlasts every running request: start it now
            if slack <= OFFLINE_DEADLINE_STEPS:
                rate = max(rate, queued / slack)
        even = math.ceil(rows_left / max(1, steps_left))
        return min(full, max(self.config.offline_step_rows, decodes + math.ceil(rate), even))

    def _admit(self, req: Request, n: int, scheduled: list[tuple[Request, int]]) -> None:
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        self._waiting_prompts = None
        self.add_running(req)
        scheduled.append((req, n))

    def _hashes_computed(self, req: Request, n: int) -> list[bytes]:
        """Hashes of the full blocks that computing n more tokens of req completes."""
        if not self.kv.enable_prefix_caching:
            return []
        bs = self.kv.block_size
        start = (req.num_computed_tokens - n) // bs if req.status is RequestStatus.RUNNING else 0
        end = min((req.num_computed_tokens + n) // bs, self.kv.num_cacheable_blocks(req))
        req.update_block_hashes(bs)
        return req.block_hashes[max(0, start):end]

    def _chunk(self, remaining: int, budget: int, req: Request, num_computed: int, num_shared: int) -> int:
        """Tokens of req to compute this step. num_computed: its computed tokens once admitted, of
        which num_shared sit in shared blocks (a token eviction policy keeps those)."""
        cap = self.config.long_prefill_token_threshold or budget
        n = min(remaining, budget, cap)
        if req.eviction is not None:  # stay within the policy's budget plus one block
            n = min(n, req.eviction.max_chunk(num_computed - req.num_evicted_tokens, num_shared, num_computed,
                                              req.num_prompt_tokens, self.kv.block_size))
        return n

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            req = self._waiting[0][2]
            if req.status is RequestStatus.WAITING:
                return req
            heapq.heappop(self._waiting)
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.kv.swap_out(request):  # its blocks wait in DRAM; otherwise it is recomputed
            self.num_swaps += 1
        self.kv.free(request)
        if request.swapped is None:
            request.reset_eviction()  # recomputed from scratch; a swapped request keeps its count
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add_request(request)
