"""The HF transformers baselines of `kvstrata bench throughput`: the same requests through
`model.generate` over left-padded static batches, and through transformers' own continuous batching
(`generate_batch`), on the weights `load_hf_model` reads from the same GGUF file kvstrata serves.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvstrata.cluster.bench.throughput import GREEDY, WARMUP_PROMPT, WARMUP_TOKENS, Decoding, Progress, RunResult
from kvstrata.cluster.bench.workloads import Workload


def _warm_up_hf_static(model: Any) -> None:
    import torch

    ids = torch.tensor([WARMUP_PROMPT])
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=WARMUP_TOKENS,
                       min_new_tokens=WARMUP_TOKENS, do_sample=False, pad_token_id=0)


def run_hf_static(model: Any, workload: Workload, batch_size: int = 8,
                  clock: Callable[[], float] = time.perf_counter, decoding: Decoding = GREEDY) -> RunResult:
    """`model.generate` over left-padded batches in arrival order."""
    import torch

    pad = 0
    reqs = workload.requests
    _warm_up_hf_static(model)
    progress = Progress(f"hf-generate {workload.name}", len(reqs))
    latencies: list[float] = []
    output_tokens = 0
    start = clock()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n :] = 1
        new = max(r.max_tokens for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=pad, **decoding.hf_kwargs())
        done = clock() - start
        latencies += [done] * len(batch)
        output_tokens += sum(r.max_tokens for r in batch)  # only the tokens each request asked for
        progress.advance(len(batch))
    return RunResult(f"hf-generate(bs={batch_size})", clock() - start, len(reqs), workload.num_prompt_tokens,
                     output_tokens, latencies)


def run_hf_continuous(model: Any, workload: Workload, clock: Callable[[], float] = time.perf_counter,
                      decoding: Decoding = GREEDY) -> RunResult:
    """transformers' own continuous batching (`generate_batch`), one max_new_tokens for all."""
    from transformers import GenerationConfig

    reqs = workload.requests
    new = max(r.max_tokens for r in reqs)
    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
                           **decoding.hf_kwargs())
    warm = GenerationConfig(max_new_tokens=WARMUP_TOKENS, min_new_tokens=WARMUP_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=[list(WARMUP_PROMPT)], generation_config=warm, progress_bar=False)
    start = clock()
    model.generate_batch(inputs=[list(r.prompt_token_ids) for r in reqs], generation_config=cfg,
                         progress_bar=False)
    wall = clock() - start
    return RunResult("hf-generate_batch", wall, len(reqs), workload.num_prompt_tokens,
                     sum(r.max_tokens for r in reqs), [wall] * len(reqs))


def load_hf_model(model: str, dtype: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    from kvstrata.worker.model_source import resolve_model

    src = resolve_model(model)
    torch_dtype = torch.bfloat16 if dtype in ("bf16", "bfloat16") else torch.float32
    if src.kind == "gguf":
        m = AutoModelForCausalLM.from_pretrained(src.path.parent, gguf_file=src.path.name, dtype=torch_dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch_dtype)
    return m.eval()
