"""The engine of one worker: requests in, one scheduler step at a time, finished outputs out.

`add_request` validates and enqueues, `step` runs one batch (schedule -> model -> sample -> stop
checks -> cache full blocks), `abort` frees a request's blocks at once. A prompt of n > 1 samples is
one group: sample 0 prefills, and the other samples fork from it, sharing its blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvstrata.worker.block_hash import HashContext, hash_blocks
from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.model_runner import ModelRunner
from kvstrata.worker.outputs import CompletionOutput, RequestOutput
from kvstrata.worker.request import FinishReason, Request, RequestStatus, Teacher
from kvstrata.worker.sampler import SampleResult, Sampler
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.worker.scheduler import Scheduler, SchedulerConfig
from kvstrata.worker.speculative import add_drafts, rewind, sample_rows
from kvstrata.worker.token_eviction import KEEP_ALL, EvictionPolicy, EvictionState
from kvstrata.worker.token_evictor import TokenEvictor
from kvstrata.worker.tokenizer import Detokenizer, Tokenizer


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    samples: list[Request]
    num_finished: int = 0


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    # the last step's batch: rows that decoded their one next token, and every other token it
    # computed (prompt chunks, and tokens recomputed after a preemption)
    last_step_decodes: int = 0
    last_step_prefill_tokens: int = 0
    # speculative decoding (worker/speculative.py): draft tokens computed, and those the model agreed with
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, kv: KVCacheManager,
                 scheduler_config: SchedulerConfig, model_id: str, seed: int = 0, kv_dtype: str = "auto",
                 kv_eviction: EvictionPolicy | None = None):
        """kv_eviction: the token eviction policy of requests that name none (lossy; None: keep all)."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv = kv
        self.config = runner.model.config
        self.scheduler = Scheduler(scheduler_config, kv)
        self.sampler = Sampler(seed)
        self.kv_eviction = kv_eviction
        self.evictor = TokenEvictor(kv, runner)
        self.model_id = model_id
        self._num_teachers = 0  # unfinished teacher-forced requests: 0 keeps the step loop's fast path
        self.kv_dtype = kv_dtype  # part of every block's identity: blocks of different formats never mix
        self.eos_token_ids = set(self.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.groups: dict[str, RequestGroup] = {}
        self.stats = EngineStats()
        self._arrival = itertools.count()
        self._hash_roots: dict[str, bytes] = {}

    # -- requests --------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams, field_name: str = "prompt") -> None:
        if not prompt_token_ids:
            raise ValueError(f"{field_name} is empty")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field_name} contains token id {bad!r} outside the vocabulary [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"{field_name} has {len(prompt_token_ids)} tokens; max_model_len is {max_len} "
                f"(prompt plus at least one generated token must fit)"
            )
        policy = self.eviction_policy(params)
        if policy is not None and self.runner.comm is not None:
            raise ValueError("kv_eviction: token eviction does not work with tensor_parallel_size > 1 yet")
        needed = self._blocks_needed(len(prompt_token_ids), params)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"{field_name} needs {needed} KV blocks for {len(prompt_token_ids)} prompt tokens, "
                f"max_tokens={params.max_tokens} and n={params.n}, but the pool has only "
                f"{self.kv.pool.num_blocks}; shorten the prompt, lower max_tokens, or raise num_gpu_blocks"
            )

    def _blocks_needed(self, num_prompt: int, params: SamplingParams) -> int:
        # shared full prompt blocks, plus each sample's own tail up to its final length
        bs = self.kv.block_size
        total = min(num_prompt + params.max_tokens, self.scheduler_config.max_model_len)
        policy = self.eviction_policy(params)
        if policy is not None:  # each sample's cache stays within the policy's peak
            return params.n * self.kv.blocks_for(min(total, policy.peak_tokens(num_prompt, bs)))
        shared = num_prompt // bs
        return shared + params.n * self.kv.blocks_for(total - shared * bs)

    def eviction_policy(self, params: SamplingParams) -> EvictionPolicy | None:
        """The request's own token eviction policy, else the engine's; None for a request's "none"."""
        if params.kv_eviction is KEEP_ALL:
            return None
        return params.kv_eviction if params.kv_eviction is not None else self.kv_eviction

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str = "",
                    cache_pins: list[tuple[int, float]] | None = None, tenant: str = "",
                    teacher_ids: list[int] | None = None) -> None:
        """cache_pins: (prompt tokens, TTL seconds) breakpoints; each pins the prompt's full blocks up
        to it in the KV tiers, charged to `tenant`'s quota. teacher_ids: force these output tokens
        (params.max_tokens of them, n = 1) and record each one's log-probability (perplexity)."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        policy = self.eviction_policy(params)
        root = self._hash_root(cache_salt)
        pinned_tokens, prompt_hashes = self._pin(prompt_token_ids, root, cache_pins, tenant) if cache_pins else (0, [])
        arrival = next(self._arrival)
        samples = [
            Request(request_id=f"{request_id}#{i}" if params.n > 1 else request_id,
                    prompt_token_ids=prompt_token_ids, params=params, hash_root=root,
                    arrival=arrival, sample_index=i, group_id=request_id)
            for i in range(params.n)
        ]
        for s in samples:
            if params.seed is not None:
                s.generator = torch.Generator().manual_seed((params.seed * 1_000_003 + s.sample_index) % 2**63)
            if params.stop_strings:
                s.detokenizer = Detokenizer(self.tokenizer)
            if params.logprobs is not None:
                s.logprobs = []
            if policy is not None:
                s.eviction = EvictionState(policy)
        if teacher_ids is not None:
            if params.n != 1 or len(teacher_ids) != params.max_tokens:
                raise ValueError("teacher_ids needs n = 1 and exactly max_tokens tokens")
            samples[0].teacher = Teacher(list(teacher_ids))
            self._num_teachers += 1
        samples[0].num_pinned_tokens = pinned_tokens
        samples[0].block_hashes = prompt_hashes  # hashed once for the pins; extended as the request grows
        for child in samples[1:]:
            child.status = RequestStatus.FORK_PENDING
        samples[0].forks = samples[1:]
        self.groups[request_id] = RequestGroup(request_id, prompt, samples)
        self.scheduler.add_request(samples[0])
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def _pin(self, prompt_token_ids: list[int], root: bytes, pins: list[tuple[int, float]],
             tenant: str) -> tuple[int, list[bytes]]:
        """Pin each breakpoint's full prompt blocks; returns the pinned token count and the prompt's block hashes."""
        if self.kv.tiers is None:
            raise ValueError("cache_control: pinning needs a KV tier below the device pool (cpu_kv_bytes)")
        bs = self.kv.block_size
        hashes = hash_blocks(root, prompt_token_ids, bs)
        longest = 0
        for i, (num_tokens, ttl_s) in enumerate(pins):
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 < num_tokens <= len(
                    prompt_token_ids):
                raise ValueError(f"cache_control[{i}]: the breakpoint must be within the prompt, got {num_tokens}")
            if not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= 24 * 3600:
                raise ValueError(f"cache_control[{i}]: ttl must be between 0 and 24 hours, got {ttl_s}")
            longest = max(longest, num_tokens // bs * bs)
        for num_tokens, ttl_s in sorted(pins, key=lambda p: p[1]):
            self.kv.tiers.pin(hashes[:num_tokens // bs], ttl_s, tenant)  # ValueError past a quota
        return longest, hashes

    def _hash_root(self, cache_salt: str) -> bytes:
        root = self._hash_roots.get(cache_salt)
        if root is None:
            root = HashContext(model_id=self.model_id, cache_salt=cache_salt, kv_dtype=self.kv_dtype).root()
            self._hash_roots[cache_salt] = root
        return root

    def abort(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            if s.teacher is not None and len(s.teacher.logprobs) < len(s.teacher.token_ids):
                self._num_teachers -= 1
            if s.status is RequestStatus.FORK_PENDING:
                s.status = RequestStatus.FINISHED
                s.finish_reason = FinishReason.ABORT
            elif not s.is_finished:
                self.scheduler.finish(s, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's config: one copy, so that a config swapped in there holds everywhere."""
        return self.scheduler.config

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs of groups that finished in this step."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        batch = out.batch
        drafts = add_drafts(batch, self.kv, self.scheduler.config) if self.scheduler.config.speculative_tokens else {}
        rows: list[int] = []
        to_sample: list[Request] = []
        spans: list[int] = []  # logits rows of each sampled row: 1, or a draft's length + 1
        num_decodes = 0
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            num_decodes += (n == 1 or req in drafts) and req.num_computed_tokens >= req.num_prompt_tokens
            if req.num_computed_tokens + n == req.num_tokens:
                rows.append(i)
                to_sample.append(req)
                spans.append(n if req in drafts else 1)
                for child in req.forks:  # n > 1: all samples draw from the prompt's last logits
                    rows.append(i)
                    to_sample.append(child)
                    spans.append(1)
        self.runner.attention_observer = self.evictor.observer(batch)  # H2O and SnapKV scores, if any
        # greedy rows without log-probs or teachers need only each row's argmax (the runner may pick
        # them without the float32 logits: worker/greedy_head.py)
        greedy = bool(to_sample) and not self._num_teachers and all(
            r.params.greedy and r.params.logprobs is None for r in to_sample)
        logits = self.runner.execute(batch, rows, spans if drafts else None, greedy=greedy)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        self.evictor.after_step(batch)  # before forks, so that samples share the evicted cache
        self.stats.num_steps += 1
        self.stats.last_step_decodes = num_decodes
        num_drafted = sum(len(d) for d in drafts.values())
        self.stats.last_step_prefill_tokens = sum(batch.num_new_tokens) - num_decodes - num_drafted
        rows_of = sample_rows(to_sample, spans) if drafts else to_sample  # the request of each logits row
        seeded = {req: req.generator.get_state() for req in drafts
                  if req.generator is not None and not req.params.greedy}  # rewound to the kept rows
        if logits.dtype == torch.int64:  # the greedy tokens themselves
            result = SampleResult(logits.tolist(), None)
        else:
            result = self.sampler.sample(logits, rows_of) if rows_of else None
        if self._num_teachers and result is not None:
            self._force(logits, rows_of, result.token_ids)
        finished: list[RequestOutput] = []
        for req in batch.requests:
            if req.forks:
                for child in req.forks:
                    self.kv.fork(req, child)
                    self.scheduler.add_running(child)
                req.forks = []
            if req not in drafts:
                self.kv.cache_full_blocks(req)
        row = 0
        for req, span in zip(to_sample, spans):
            lps = result.logprobs[row:row + span] if result.logprobs is not None else [None] * span
            if req in drafts:
                kept = self._accept(req, drafts[req], result.token_ids[row:row + span], lps)
                if req in seeded and kept < span:
                    rewind(req.generator, seeded[req], kept)
            else:
                self._append_token(req, result.token_ids[row], lps[0])
            self._note_finished(req, finished)
            row += span
        return finished

    def _note_finished(self, req: Request, finished: list[RequestOutput]) -> None:
        if req.is_finished:
            group = self.groups[req.group_id]
            group.num_finished += 1
            if group.num_finished == len(group.samples):
                finished.append(self._finish_group(group))

    # -- speculative decoding (worker/speculative.py) --------------------------------------------
    def _accept(self, req: Request, draft: list[int], tokens: list[int],
                logprobs: list[dict[int, float] | None]) -> int:
        """The draft's leading tokens that match the model's samples at their rows (its greedy
        choices, for a greedy request), then the next row's sample, become the request's output;
        the rest of the draft is dropped. K/V computed for the dropped tokens sit past
        num_computed_tokens, where the next tokens overwrite them. Returns the rows kept."""
        accepted = 0
        while accepted < len(draft) and tokens[accepted] == draft[accepted]:
            accepted += 1
        del req.token_ids[len(req.token_ids) - len(draft):]
        req.num_computed_tokens -= len(draft) - accepted
        self.stats.num_draft_tokens += len(draft)
        self.stats.num_accepted_draft_tokens += accepted
        req.ngram.record(len(draft), accepted)
        for token, lp in zip(tokens[:accepted + 1], logprobs):
            self._append_token(req, token, lp)
            if req.is_finished:
                return accepted + 1
        self.kv.cache_full_blocks(req)
        return accepted + 1

    def _force(self, logits: torch.Tensor, to_sample: list[Request], token_ids: list[int]) -> None:
        """Replace teacher-forced rows' samples with the teacher's tokens, recording their log-probs."""
        for j, req in enumerate(to_sample):
            t = req.teacher
            if t is None:
                continue
            token = t.token_ids[req.num_output_tokens]
            t.logprobs.append(float(torch.log_softmax(logits[j], dim=-1)[token]))
            token_ids[j] = token
            if len(t.logprobs) == len(t.token_ids):
                self._num_teachers -= 1

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None) -> None:
        req.token_ids.append(token)
        self.stats.num_generation_tokens += 1
        if req.logprobs is not None:
            req.logprobs.append(logprobs or {})
        reason = self._check_stop(req, token)
        if reason is not None:
            self.scheduler.finish(req, reason)

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if req.detokenizer is not None:
            delta = req.detokenizer.step(req.output_token_ids)
            if delta and self._truncate_at_stop(req, len(delta)):
                return FinishReason.STOP
        if token in self.eos_token_ids and not p.ignore_eos:
            req.stop_reason = None
            return FinishReason.STOP
        if token in p.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.scheduler_config.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _truncate_at_stop(req: Request, delta_len: int) -> bool:
        det = req.detokenizer
        longest = max(len(s) for s in req.params.stop_strings)
        window_start = max(0, len(det.text) - delta_len - longest + 1)
        hits = [(det.text.find(s, window_start), s) for s in req.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        det.text = det.text[:idx]
        req.stop_reason = s
        return True

    def _finish_group(self, group: RequestGroup) -> RequestOutput:
        del self.groups[group.request_id]
        self.stats.num_requests_finished += 1
        first = group.samples[0]
        outputs = []
        for s in group.samples:
            # only a stop string truncates; otherwise the whole output decodes at once
            stopped_by_string = s.detokenizer is not None and isinstance(s.stop_reason, str)
            text = s.detokenizer.text if stopped_by_string else self.tokenizer.decode(s.output_token_ids)
            outputs.append(CompletionOutput(
                index=s.sample_index, token_ids=s.output_token_ids, text=text,
                finish_reason=s.finish_reason.value if s.finish_reason else None,
                stop_reason=s.stop_reason, logprobs=s.logprobs,
            ))
        cached = first.num_cached_tokens or 0
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, cached, outputs,
                             num_cache_write_tokens=max(0, first.num_pinned_tokens - cached))

    # -- introspection ---------------------------------------------------------------------
    def live_requests(self) -> list[Request]:
        return [s for g in self.groups.values() for s in g.samples if s.block_table]

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.live_requests())

    def cache_stats(self) -> dict:
        pool = self.kv.pool
        bs = self.kv.block_size
        filled: dict[int, int] = {}
        for r in self.live_requests():
            for idx, b in enumerate(r.block_table):
                n = min(bs, max(0, r.num_kv_tokens - idx * bs))
                filled[b.block_id] = max(filled.get(b.block_id, 0), n)
        used = pool.num_used_blocks
        queried = self.kv.num_prompt_tokens_queried
        return {
            "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_cached_blocks": len(pool.prefix_cache),
            "num_cached_unused_blocks": pool.num_cached_unused,
            "num_used_blocks": used,
            "block_size": bs,
            "kv_usage": used / pool.num_blocks,
            "kv_utilization": (sum(filled.values()) / (used * bs)) if used else 1.0,
            "prefix_hit_rate": (self.kv.num_prompt_tokens_hit / queried) if queried else 0.0,
            "prefix_cache_queries": queried,
            "prefix_cache_hits": self.kv.num_prompt_tokens_hit,
            "num_evictions": pool.num_evictions,
            "num_evicted_tokens": self.evictor.num_evicted_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps": self.scheduler.num_swaps,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            **({"tiers": self.kv.tiers.stats()} if self.kv.tiers is not None else {}),
            **({"speculative": {"draft_tokens": self.stats.num_draft_tokens,
                                "accepted_draft_tokens": self.stats.num_accepted_draft_tokens}}
               if self.scheduler.config.speculative_tokens else {}),
            **({"tensor_parallel": self.runner.tp_stats()} if self.runner.model.shard is not None else {}),
        }
