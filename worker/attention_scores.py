"""Attention scores for token eviction (H2O, SnapKV), accumulated per cache entry of a request.

The normal attention path never materialises its probabilities (SDPA, the C decode kernel), so this
observer recomputes them in torch, after each layer's attention, for the few requests whose policy
needs them. Per request and layer, for its query rows that count (all of them for H2O; for SnapKV
those in the prompt's last `window` positions):

    p = softmax(q k^T * scale)   over the request's cached keys, causal     # [rows, H, ctx]
    scores[:ctx] += p summed over rows and heads

and layers add up too: a paged cache has one block table per request, shared by every layer and
head, so a request keeps one set of tokens, ranked by their attention summed over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.worker.attention import AttentionMetadata, read_blocks

QUERY_CHUNK = 128  # query rows scored at once, which bounds the [rows, H, ctx] probabilities


@dataclass(frozen=True, slots=True)
class ScoreTarget:
    """One request in a step: its query rows [first_row, first_row + num_rows) in the flattened batch
    count; row first_row sits at cache entry `first_entry` and attends to the entries before it."""

    first_row: int
    num_rows: int
    first_entry: int
    block_ids: torch.Tensor  # [ceil(ctx / block_size)] long, on the model's device
    context_len: int  # cache entries after this step's new ones are written
    scores: torch.Tensor  # [>= context_len] float32, the request's accumulator


class AttentionScoreObserver:
    """Called as observer(layer, q [T, H, D], k_cache, meta); adds each target's scores in place."""

    def __init__(self, targets: list[ScoreTarget]):
        self.targets = targets

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        for t in self.targets:
            keys = read_blocks(k_cache, t.block_ids, meta.kv_format)[: t.context_len]  # [ctx, Hkv, D]
            for start in range(0, t.num_rows, QUERY_CHUNK):
                n = min(QUERY_CHUNK, t.num_rows - start)
                rows = q[t.first_row + start : t.first_row + start + n]
                t.scores[: t.context_len] += attention_mass(rows, keys, t.first_entry + start)


def attention_mass(q: torch.Tensor, k: torch.Tensor, first_entry: int) -> torch.Tensor:
    """q: [n, H, D] queries at cache entries first_entry .. first_entry + n - 1; k: [ctx, Hkv, D].
    -> [ctx] float32: each key's attention probability, summed over the queries and heads."""
    n, num_heads, head_dim = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.float().view(n, num_kv_heads, group, head_dim)  # [n, Hkv, G, D]
    logits = torch.einsum("nkgd,ckd->nkgc", qg, k.float()) * head_dim**-0.5  # [n, Hkv, G, ctx]
    # query i sees keys 0 .. first_entry + i
    visible = torch.arange(ctx, device=q.device)[None, :] <= (first_entry + torch.arange(n, device=q.device))[:, None]
    logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
    return logits.softmax(-1).sum((0, 1, 2))
