"""Batched sampling: one call for every row, whatever mix of parameters the rows use.

A random row draws one uniform number u and takes the token at which the running sum of its kept
probabilities (after temperature, top_k, top_p and min_p), in token-id order, passes u: the
inverse of the distribution's cumulative sum, which draws from it exactly. On CPU one C pass a row
does it (csrc/sample.c), without sorting the vocabulary for top_k or top_p; elsewhere, or where a
row holds a NaN, torch does the same arithmetic. Rows with a seed draw u from their own generator,
one number a row (`draw_uniform`), so a seeded request's samples do not depend on what else is in
the batch, and speculative decoding can set the generator back by rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.worker.cpu_kernels import load_cpu_kernels
from kvstrata.worker.request import Request


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row: {token_id: logprob}, sampled token included


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """logits: [N, V] float32, one row per request."""
        params = [r.params for r in requests]
        if logits.device.type != "cpu" and all(p.greedy for p in params):
            return _greedy_on_device(logits, params)
        logits = logits.cpu()  # random draws come from CPU generators, so a seed means the same everywhere
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if all(p.greedy for p in params):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample_random(logits, requests)
        token_list = tokens.tolist()
        out_logprobs = None
        if raw_logprobs is not None:
            out_logprobs = [
                _top_logprobs(raw_logprobs[i], token_list[i], p.logprobs) if p.logprobs is not None else {}
                for i, p in enumerate(params)
            ]
        return SampleResult(token_list, out_logprobs)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        n, vocab = logits.shape
        params = [r.params for r in requests]
        u = torch.rand(n, dtype=torch.float64, generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None and not params[i].greedy:
                u[i] = draw_uniform(r.generator)
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        kernels = load_cpu_kernels() if logits.dtype == torch.float32 else None
        if kernels is not None:
            out = kernels.sample(logits, temps, top_k, top_p, min_p, u)
            if out is not None:
                return out
        return _sample_torch(logits, temps, top_k, top_p, min_p, u)


def draw_uniform(generator: torch.Generator) -> float:
    """A seeded row's one random number in [0, 1): the only draw a sampled row makes."""
    return float(torch.rand(1, dtype=torch.float64, generator=generator))


def _sample_torch(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """csrc/sample.c's sampling in torch ops: the token where each row's kept probabilities, summed
    in id order, pass u of their total; rows with temperature 0 take their argmax."""
    vocab = logits.shape[1]
    greedy_rows = temps <= 0
    x = logits.float() / torch.where(greedy_rows, 1.0, temps)[:, None]
    top_k = torch.where(top_k > 0, top_k, vocab)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        x = _apply_top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)
    if bool((min_p > 0).any()):
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * max_p, 0.0)
    sums = probs.double().cumsum(dim=-1)
    sampled = torch.searchsorted(sums, (u * sums[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    return torch.where(greedy_rows, argmax_rows(logits), sampled)


def _greedy_on_device(logits: torch.Tensor, params: list) -> SampleResult:
    """Greedy rows on the logits' own device: only the chosen ids (and the log-probs asked for) cross to
    the host. Copying whole rows out cost more than the step itself at large batches: on an H200, a
    batch of 128 rows of a 128,256-token vocabulary took 38 ms a step to reach pageable host memory."""
    tokens = logits.argmax(dim=-1)
    wanted = [p.logprobs for p in params]
    if all(k is None for k in wanted):
        return SampleResult(tokens.tolist(), None)
    raw = torch.log_softmax(logits, dim=-1)
    most = max(k or 0 for k in wanted)
    chosen = raw.gather(1, tokens[:, None])[:, 0]
    vals, ids = raw.topk(most, dim=-1)  # most = 0: empty rows
    token_list, chosen, vals, ids = tokens.tolist(), chosen.tolist(), vals.tolist(), ids.tolist()
    out = []
    for i, k in enumerate(wanted):
        row = {}
        if k is not None:
            row[token_list[i]] = chosen[i]
            row.update(zip(ids[i][:k], vals[i][:k]))
        out.append(row)
    return SampleResult(token_list, out)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1), through the C kernel where it runs (float32 on CPU): about a tenth of
    torch's time for a batch of vocabulary-wide rows. Rows holding a NaN go to torch, whose rules for
    them it keeps."""
    kernels = load_cpu_kernels() if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 else None
    if kernels is not None and x.shape[1] > 0:
        out = kernels.argmax(x)
        if out is not None:
            return out
    return x.argmax(dim=-1)


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
    vocab = x.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_x.masked_fill(remove, float("-inf")), dim=-1)
    # drop a token when the mass of tokens strictly before it already reaches top_p
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False  # the top token always stays, whatever rounding did to a tiny top_p
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _top_logprobs(row: torch.Tensor, sampled: int, k: int) -> dict[int, float]:
    out = {sampled: float(row[sampled])}
    if k:
        vals, ids = row.topk(k)
        out.update(zip(ids.tolist(), vals.tolist()))
    return out
