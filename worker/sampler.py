"""Batched sampling: one call for every row, whatever mix of parameters the rows use.

A random row samples by the exponential race: the token with the largest p_i / E_i, E_i ~ Exp(1),
over its kept probabilities (after temperature, top_k, top_p and min_p), which draws from them
exactly. The row's noise comes from one 53-bit key: E_i = -ln U_i with U_i a counter-based hash of
(key, i). On CPU one C pass a row does it (csrc/sample.c), without sorting the vocabulary for
top_k or top_p; elsewhere, or where a row holds a NaN, torch does the same arithmetic, on the
logits' device (on a GPU only the chosen ids cross to the host). Rows with a seed draw their key
from their own generator, one key a row (`draw_key`), so a seeded request's samples do not depend
on what else is in the batch, and speculative decoding can set the generator back by rows. A race
moves only where two tokens nearly tie, so the last-bit differences between a chunk's logits and a
decode step's leave a seeded request's tokens as they are.
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
        if logits.device.type != "cpu":
            greedy = all(p.greedy for p in params)
            tokens = logits.argmax(dim=-1) if greedy else self._sample_random(logits, requests)
            return _picked_on_device(logits, tokens, params)
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
        keys = torch.randint(0, KEY_RANGE, (n,), generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None and not params[i].greedy:
                keys[i] = draw_key(r.generator)
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        on_cpu = logits.device.type == "cpu"
        kernels = load_cpu_kernels() if on_cpu and logits.dtype == torch.float32 else None
        if kernels is not None:
            out = kernels.sample(logits, temps, top_k, top_p, min_p, keys)
            if out is not None:
                return out
        # the keys come from CPU generators and the noise from them alone, so a seed means the same anywhere
        settings = [t.to(logits.device) for t in (temps, top_k, top_p, min_p, keys)]  # no copy on the host
        return _sample_torch(logits, *settings, filters=bool((top_k > 0).any() or (top_p < 1).any()),
                             min_ps=bool((min_p > 0).any()))


KEY_RANGE = 1 << 53  # a row's noise key: csrc/sample.c mixes its low 32 bits, then the rest


def draw_key(generator: torch.Generator) -> int:
    """A seeded row's noise key: the only draw a sampled row makes from its generator."""
    return int(torch.randint(0, KEY_RANGE, (1,), generator=generator))


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """E [N, V] float32: csrc/sample.c's exponential noise, -ln U with U from the hash of (key, i)."""
    mask = 0xFFFFFFFF

    def mul32(x: torch.Tensor, c: int) -> torch.Tensor:  # (x * c) mod 2^32 without int64 overflow
        return (x * (c & 0xFFFF) + ((x * (c >> 16)) << 16)) & mask

    def mix32(x: torch.Tensor) -> torch.Tensor:
        x = x ^ (x >> 16)
        x = mul32(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = mul32(x, 0x846CA68B)
        return x ^ (x >> 16)

    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    h = mix32(mix32(mul32(idx, 0x9E3779B9) ^ (keys[:, None] & mask)) ^ (keys[:, None] >> 32))
    u = (h >> 8).float() * 5.9604645e-8 + 2.9802322e-8
    return -torch.log(u)


def _sample_torch(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, keys: torch.Tensor, filters: bool | None = None,
                  min_ps: bool | None = None) -> torch.Tensor:
    """csrc/sample.c's sampling in torch ops, on the logits' device: the race over each row's kept
    probabilities with the row's noise; rows with temperature 0 take their argmax. filters / min_ps:
    whether any row has top_k or top_p / min_p (None: read off the tensors, a sync on a GPU)."""
    vocab = logits.shape[1]
    greedy_rows = temps <= 0
    x = logits.float() / torch.where(greedy_rows, 1.0, temps)[:, None]
    top_k = torch.where(top_k > 0, top_k, vocab)
    if filters if filters is not None else bool((top_k < vocab).any() or (top_p < 1.0).any()):
        x = _apply_top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)
    if min_ps if min_ps is not None else bool((min_p > 0).any()):
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * max_p, 0.0)
    sampled = argmax_rows(probs / race_noise(keys, vocab))
    return torch.where(greedy_rows, argmax_rows(logits), sampled)


def _picked_on_device(logits: torch.Tensor, tokens: torch.Tensor, params: list) -> SampleResult:
    """Tokens picked on the logits' own device (greedy, or sampled by `_sample_torch` there): only the
    ids (and the log-probs asked for) cross to the host. Copying whole rows out cost more than the
    step itself at large batches: on an H200, a batch of 128 rows of a 128,256-token vocabulary took
    38 ms a step to reach pageable host memory."""
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
    ranks = torch.arange(vocab, device=x.device)[None, :]
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
