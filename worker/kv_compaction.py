"""Compaction: after a policy picks which cache entries of a request survive, pack them into as few
blocks as they fit and say which blocks to free and which token slots to move.

Attention over the cached context does not depend on the order of its entries (each key carries its
position in its RoPE phase, and new tokens always come after the cached ones), so survivors need
not keep their order. Compaction keeps the blocks that already hold the most survivors and fills
their holes from the others, which moves as few tokens as possible. Block size 4, survivors `x`:

    before:  block 7 [x x x x]  block 2 [x . x x]  block 9 [x . . .]     9 entries, 7 survive
    after:   block 7 [x x x x]  block 2 [x x x x]                         block 9 freed; 1 move: 9.0 -> 2.1
             entries  0..3        4..7

Blocks that are shared (protected) must be full of survivors: they are kept where they are, first,
and nothing is ever written into them. A sliding window (survivors are a suffix that starts on a
block boundary) compacts with no move at all: its leading blocks are simply freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """retained: old block-table indices, in their new order; dropped: old indices to free.
    src/dst: token slots (block_id * block_size + offset) to move. new_order[j]: the old cache entry
    that new entry j holds."""

    retained: list[int]
    dropped: list[int]
    src: torch.Tensor  # [M] long
    dst: torch.Tensor  # [M] long
    new_order: torch.Tensor  # [K] long, K = survivors

    @property
    def num_moves(self) -> int:
        return self.src.numel()


def plan_compaction(keep: torch.Tensor, block_ids: list[int], protected: list[bool],
                    block_size: int) -> CompactionPlan | None:
    """keep: [L] bool over cache entries (entry j lives in block_ids[j // block_size] at j % block_size).
    None when there is nothing to do (no entry dropped) or nothing may be done (a protected block is
    the partly filled last one, so survivors cannot be packed without writing into it)."""
    bs = block_size
    num_entries = keep.numel()
    num_blocks = len(block_ids)
    assert num_blocks == -(-num_entries // bs), "the block table must cover exactly the cache entries"
    num_kept = int(keep.sum())
    if num_kept == num_entries:
        return None
    padded = torch.zeros(num_blocks * bs, dtype=torch.bool)
    padded[:num_entries] = keep
    per_block = padded.view(num_blocks, bs).sum(1).tolist()
    for i in range(num_blocks):
        if protected[i] and per_block[i] != bs:
            return None  # a shared block that is partly filled (a fork's tail) or, never, partly dropped
    num_retained = -(-num_kept // bs)
    # shared blocks first, then the fullest, then the earliest
    ranked = sorted(range(num_blocks), key=lambda i: (not protected[i], -per_block[i], i))
    chosen = set(ranked[:num_retained])
    retained = [i for i in range(num_blocks) if i in chosen and protected[i]]
    retained += [i for i in range(num_blocks) if i in chosen and not protected[i]]
    dropped = [i for i in range(num_blocks) if i not in chosen]

    # the old entry index behind each new entry, before filling holes
    offsets = torch.arange(bs)
    target = (torch.tensor(retained, dtype=torch.long)[:, None] * bs + offsets).view(-1)[:num_kept]
    holds = padded[target]  # [K] True where a survivor already sits in its new place
    in_place = torch.zeros(num_blocks * bs, dtype=torch.bool)
    in_place[target[holds]] = True
    sources = torch.nonzero(padded & ~in_place).view(-1)  # survivors that must move, in cache order
    holes = torch.nonzero(~holds).view(-1)  # new entries without a survivor yet
    assert sources.numel() == holes.numel()
    new_order = target.clone()
    new_order[holes] = sources
    ids = torch.tensor(block_ids, dtype=torch.long)
    src = ids[sources // bs] * bs + sources % bs
    hole_old = target[holes]  # the old entry index of each hole's slot (same block, same offset)
    dst = ids[hole_old // bs] * bs + hole_old % bs
    return CompactionPlan(retained, dropped, src, dst, new_order)
