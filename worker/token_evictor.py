"""The engine's side of token eviction: scores before a step's forward pass, eviction after it.

After every step, each request under a policy that holds more cache entries than its budget is cut
back to it: the policy picks the survivors, compaction packs them into fewer blocks (moving a few
token slots), and the freed blocks go back to the pool. Positions keep their original RoPE phase:
keys are cached after rotation at the position they were computed at, and new tokens get their true
positions, so a request's attention context is its cache entries, fewer than its position.

    request:  num_computed_tokens N (positions 0 .. N-1)  =  num_kv_tokens (in the cache)  +  num_evicted_tokens

Blocks shared with another request (ref count > 1, or in the prefix cache) are never written, moved
or freed here: they count as kept.
"""

from __future__ import annotations

import torch

from kvstrata.worker.attention_scores import AttentionScoreObserver, ScoreTarget
from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.kv_compaction import plan_compaction
from kvstrata.worker.model_runner import ModelRunner, ScheduledBatch
from kvstrata.worker.request import Request


class TokenEvictor:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner):
        self.kv = kv
        self.runner = runner
        self.block_size = kv.block_size
        self.num_evicted_tokens = 0  # over all requests, for stats
        self.num_moved_tokens = 0

    def observer(self, batch: ScheduledBatch) -> AttentionScoreObserver | None:
        """The scoring observer for this step's requests whose policy needs attention scores."""
        targets: list[ScoreTarget] = []
        row = 0
        bs = self.block_size
        device = self.runner.device
        for req, n in zip(batch.requests, batch.num_new_tokens):
            state = req.eviction
            if state is not None and state.policy.needs_scores:
                lo, hi = state.policy.score_queries(req.num_prompt_tokens)
                start = req.num_computed_tokens
                first, last = max(start, lo), min(start + n, hi)
                if first < last:
                    ctx = req.num_kv_tokens + n
                    ids = torch.tensor([b.block_id for b in req.block_table[: -(-ctx // bs)]], dtype=torch.long)
                    targets.append(ScoreTarget(row + first - start, last - first, req.num_kv_tokens + first - start,
                                               ids.to(device), ctx, state.reserve_scores(ctx, device)))
            row += n
        return AttentionScoreObserver(targets) if targets else None

    def after_step(self, batch: ScheduledBatch) -> None:
        for req in batch.requests:
            if req.eviction is not None:
                self.evict(req)

    def evict(self, req: Request) -> int:
        """Cut req back to its policy's budget if it holds more; returns the number of entries evicted."""
        state = req.eviction
        policy = state.policy
        bs = self.block_size
        num_kv = req.num_kv_tokens
        excess = num_kv - policy.budget_tokens
        if excess <= 0 or (policy.whole_blocks and excess < bs):
            return 0
        if not policy.can_evict(req.num_computed_tokens, req.num_prompt_tokens):
            return 0
        positions = state.entry_positions(num_kv, req.num_computed_tokens)
        shared = [b.ref_count > 1 or b.is_cached for b in req.block_table]
        protected = torch.tensor(shared, dtype=torch.bool).repeat_interleave(bs)[:num_kv]
        scores = state.reserve_scores(num_kv, self.runner.device)[:num_kv] if policy.needs_scores else None
        keep = policy.select(positions, req.num_computed_tokens, protected,
                             None if scores is None else scores.cpu(), req.num_prompt_tokens)
        if policy.whole_blocks:  # a block with any entry to keep is kept whole
            padded = torch.zeros(len(shared) * bs, dtype=torch.bool)
            padded[:num_kv] = keep
            keep = padded.view(-1, bs).any(1).repeat_interleave(bs)[:num_kv]
        plan = plan_compaction(keep, [b.block_id for b in req.block_table], shared, bs)
        if plan is None:
            return 0
        self.runner.move_slots(plan.src, plan.dst)
        self.kv.compact(req, plan)
        state.positions = positions[plan.new_order]
        if scores is not None:
            state.scores = scores[plan.new_order.to(scores.device)]
        num_evicted = num_kv - plan.new_order.numel()
        self.num_evicted_tokens += num_evicted
        self.num_moved_tokens += plan.num_moves
        return num_evicted
