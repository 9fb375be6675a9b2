"""`kvstrata bench speculative`: speculative decoding by n-gram lookup against plain decoding.

Real chat prompts in English (an explanation, code, a summary, lists and tables to rewrite), each
greedy (or sampled at --temperature, prompt i with seed i, so that both ways draw alike), run by one
engine with speculation off and on in turn, the order swapped every round so that drift hits both
alike: first every prompt alone (a single user, the memory-bound case), then all at once as one
batch. Each figure is the median over the rounds; the report also checks that
both ways gave the same tokens, and counts the draft tokens the model accepted. With --baseline hf,
HF transformers runs each prompt alone too, with `generate` and with its own n-gram speculation
(`prompt_lookup_num_tokens`, for one sequence at a time), the same number of draft tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.cluster.argtypes import non_negative_float, positive_int
from kvstrata.worker.model_source import DEFAULT_MODEL

_PARAGRAPH = (
    "A serving engine keeps the keys and values of every token it has seen, so that each new token "
    "attends to them instead of recomputing them. Those keys and values live in fixed-size blocks; "
    "blocks that hold the same prompt prefix are shared between requests, and blocks that fall out "
    "of device memory move to host memory and then to disk, from where a later request can load "
    "them back instead of computing its prompt again."
)

PROMPTS = (
    "Explain in two sentences why a KV cache speeds up text generation.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and three doctests.",
    "Summarize this paragraph in two sentences:\n\n" + _PARAGRAPH,
    "Rewrite this paragraph for a ten-year-old, keeping every idea in it:\n\n" + _PARAGRAPH,
    "Repeat this list in reverse order: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon.",
    "Turn these names into a JSON array of objects with \"first\" and \"last\" fields: Ada Lovelace, Alan Turing, "
    "Grace Hopper, Edsger Dijkstra, Barbara Liskov, Donald Knuth.",
    "Write an HTML table with the columns name, age and city, and five rows of example data.",
    "Count from 1 to 30, one number per line.",
)


@dataclass
class PromptResult:
    prompt: str
    output_tokens: int
    plain_s: list[float] = field(default_factory=list)
    speculative_s: list[float] = field(default_factory=list)
    draft_tokens: int = 0  # over all rounds
    accepted_draft_tokens: int = 0
    identical: bool = True
    # each run's median time from the start to a request's last token (the batch's own users' wait)
    plain_latency_s: list[float] = field(default_factory=list)
    speculative_latency_s: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return statistics.median(self.plain_s) / statistics.median(self.speculative_s)

    @property
    def latency_speedup(self) -> float:
        return statistics.median(self.plain_latency_s) / statistics.median(self.speculative_latency_s)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": round(self.speedup, 3),
                "latency_speedup": round(self.latency_speedup, 3) if self.plain_latency_s else None}


@dataclass
class SpeculativeReport:
    speculative_tokens: int
    step_tokens: int
    alone: list[PromptResult]
    batch: PromptResult
    hf: list[PromptResult] | None = None  # HF transformers, each prompt alone: generate, prompt lookup
    temperature: float = 0.0  # 0: greedy

    @property
    def over_hf_lookup(self) -> float | None:
        """Median over the prompts of kvstrata's speculative tokens/s over HF's prompt lookup's."""
        if not self.hf:
            return None
        return statistics.median((k.output_tokens / statistics.median(k.speculative_s))
                                 / (h.output_tokens / statistics.median(h.speculative_s))
                                 for k, h in zip(self.alone, self.hf))

    @property
    def median_speedup_alone(self) -> float:
        return statistics.median(r.speedup for r in self.alone)

    def to_json(self) -> dict[str, Any]:
        return {"speculative_tokens": self.speculative_tokens, "speculative_step_tokens": self.step_tokens,
                "temperature": self.temperature,
                "median_speedup_alone": round(self.median_speedup_alone, 3),
                "alone": [r.to_json() for r in self.alone], "batch": self.batch.to_json(),
                "hf": None if self.hf is None else [r.to_json() for r in self.hf],
                "kvstrata_over_hf_prompt_lookup": None if self.hf is None else round(self.over_hf_lookup, 3)}


def add_bench_speculative_parser(bench_sub) -> None:
    p = bench_sub.add_parser("speculative", help="speculative decoding against plain decoding on real prompts",
                             description="Greedy generation of real chat prompts with speculative decoding off "
                                         "and on, side by side in one run: each prompt alone, then all at once.")
    p.add_argument("--speculative-tokens", type=positive_int, default=4, help="draft tokens a step (default 4)")
    p.add_argument("--speculative-step-tokens", type=positive_int, default=None,
                   help="drafts only while a step holds at most this many tokens (default: the engine's, 8 on CPU)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (the default): greedy; above 0, sampled, each prompt with its own seed")
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="output tokens per prompt at most (default 128)")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--num-prompts", type=positive_int, default=len(PROMPTS),
                   help=f"the first N of the built-in prompts (default all {len(PROMPTS)})")
    p.add_argument("--baseline", choices=["hf"], default=None,
                   help="also HF transformers, each prompt alone: generate, and generate with prompt lookup")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run_speculative_cmd)


def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user message in the model's chat template, as token ids."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]


def bench_speculative(llm: Any, prompts: list[str], speculative_tokens: int, max_tokens: int,
                      rounds: int, step_tokens: int | None = None, temperature: float = 0.0) -> SpeculativeReport:
    import dataclasses

    from kvstrata.worker.sampling_params import SamplingParams

    engine = llm.engine
    plain_config = engine.scheduler.config
    spec_config = dataclasses.replace(plain_config, speculative_tokens=speculative_tokens,
                                      speculative_step_tokens=step_tokens or plain_config.speculative_step_tokens)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i if temperature else None)
              for i in range(len(prompts))]
    ids = chat_ids(llm.tokenizer, prompts)
    llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4))  # one-time costs out of the figures

    def run(which: list[int], speculate: bool, result: PromptResult) -> list[list[int]]:
        engine.scheduler.config = spec_config if speculate else plain_config
        llm.reset_prefix_cache()  # both ways compute every prompt
        drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_draft_tokens
        done: dict[str, tuple[float, list[int]]] = {}  # request id: (seconds to its last token, tokens)
        names = [f"spec-{next(serial)}" for _ in which]
        try:
            t0 = time.perf_counter()
            for name, i in zip(names, which):
                engine.add_request(name, ids[i], params[i])
            while engine.has_unfinished_requests():
                for out in engine.step():
                    done[out.request_id] = (time.perf_counter() - t0, out.outputs[0].token_ids)
            (result.speculative_s if speculate else result.plain_s).append(time.perf_counter() - t0)
        finally:
            engine.scheduler.config = plain_config
        latency = statistics.median(done[name][0] for name in names)
        (result.speculative_latency_s if speculate else result.plain_latency_s).append(latency)
        result.draft_tokens += engine.stats.num_draft_tokens - drafted
        result.accepted_draft_tokens += engine.stats.num_accepted_draft_tokens - accepted
        return [done[name][1] for name in names]

    serial = itertools.count()
    alone = [PromptResult(p, 0) for p in prompts]
    together = PromptResult(f"all {len(prompts)} prompts at once", 0)
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for which, result in [([i], res) for i, res in enumerate(alone)] + [(list(range(len(ids))), together)]:
            tokens = {speculate: run(which, speculate, result) for speculate in order}
            result.identical &= tokens[False] == tokens[True]
            result.output_tokens = sum(len(t) for t in tokens[False])
    return SpeculativeReport(speculative_tokens, spec_config.speculative_step_tokens, alone, together,
                             temperature=temperature)


def bench_hf(model: Any, ids: list[list[int]], prompts: list[str], lookup_tokens: int, max_tokens: int,
             rounds: int) -> list[PromptResult]:
    """HF transformers on each prompt alone, greedy, with and without prompt lookup, alternating."""
    import torch

    def run(prompt_ids: list[int], lookup: bool, result: PromptResult) -> list[int]:
        x = torch.tensor([prompt_ids])
        extra = {"prompt_lookup_num_tokens": lookup_tokens} if lookup else {}
        t0 = time.perf_counter()
        with torch.no_grad():  # an explicit mask: this model's pad token is its EOS, which chat prompts hold
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, **extra)
        (result.speculative_s if lookup else result.plain_s).append(time.perf_counter() - t0)
        return out[0, len(prompt_ids):].tolist()

    results = [PromptResult(p, 0) for p in prompts]
    scratch = PromptResult("warm-up", 0)
    for lookup in (False, True):  # one-time costs out of the figures
        run(ids[0][:16], lookup, scratch)
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for prompt_ids, result in zip(ids, results):
            tokens = {lookup: run(prompt_ids, lookup, result) for lookup in order}
            result.identical &= tokens[False] == tokens[True]
            result.output_tokens = len(tokens[False])
    return results


def format_report(report: SpeculativeReport) -> list[str]:
    lines = [f"speculative decoding, up to {report.speculative_tokens} draft tokens a request and "
             f"{report.step_tokens} tokens a step, "
             f"{f'sampled at temperature {report.temperature:g}' if report.temperature else 'greedy'}; median of "
             f"{len(report.batch.plain_s)} rounds each way",
             f"{'prompt':<42}{'tokens':>7}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'accepted':>10}"
             f"{'same':>6}"]
    for r in report.alone + [report.batch]:
        name = r.prompt.splitlines()[0]
        name = name if len(name) <= 40 else name[:37] + "..."
        acc = f"{r.accepted_draft_tokens / r.draft_tokens:.0%}" if r.draft_tokens else "-"
        lines.append(f"{name:<42}{r.output_tokens:>7}{r.output_tokens / statistics.median(r.plain_s):>13.1f}"
                     f"{r.output_tokens / statistics.median(r.speculative_s):>12.1f}{r.speedup:>8.2f}x{acc:>10}"
                     f"{'yes' if r.identical else 'NO':>6}")
    waits = (f", {report.batch.latency_speedup:.2f}x in its requests' median time to their last token"
             if report.batch.plain_latency_s else "")
    lines.append(f"median speedup, each prompt alone: {report.median_speedup_alone:.2f}x; "
                 f"all at once: {report.batch.speedup:.2f}x in total time{waits}")
    if report.hf:
        lines += ["HF transformers, each prompt alone: generate, and generate with prompt_lookup_num_tokens="
                  f"{report.speculative_tokens}",
                  f"{'prompt':<42}{'tokens':>7}{'plain tok/s':>13}{'lookup tok/s':>14}{'speedup':>9}{'same':>6}"]
        for r in report.hf:
            name = r.prompt.splitlines()[0]
            name = name if len(name) <= 40 else name[:37] + "..."
            lines.append(f"{name:<42}{r.output_tokens:>7}{r.output_tokens / statistics.median(r.plain_s):>13.1f}"
                         f"{r.output_tokens / statistics.median(r.speculative_s):>14.1f}{r.speedup:>8.2f}x"
                         f"{'yes' if r.identical else 'NO':>6}")
        lines.append(f"kvstrata speculative / HF prompt lookup, tokens/s, median over the prompts: "
                     f"{report.over_hf_lookup:.2f}x")
    return lines


def run_speculative_cmd(args: argparse.Namespace) -> int:
    from kvstrata.worker.llm import LLM

    if args.baseline == "hf" and args.temperature:
        raise ValueError("--baseline hf runs greedy only: leave --temperature at 0 to use it")
    prompts = list(PROMPTS[:args.num_prompts])
    llm = LLM(args.model, dtype=args.dtype)
    try:
        report = bench_speculative(llm, prompts, args.speculative_tokens, args.max_tokens, args.rounds,
                                   args.speculative_step_tokens, args.temperature)
        ids = chat_ids(llm.tokenizer, prompts)
    finally:
        llm.close()
    if args.baseline == "hf":
        from kvstrata.cluster.bench import hf_baseline

        hf = hf_baseline.load_hf_model(args.model, args.dtype)
        report.hf = bench_hf(hf, ids, prompts, args.speculative_tokens, args.max_tokens, args.rounds)
    same = all(r.identical for r in report.alone + [report.batch])
    lines = format_report(report)
    if not same and args.dtype != "float32":
        lines.append("in bfloat16 greedy tokens depend on how a step is batched (near-ties in coarse logits), "
                     "plain decoding's too: differences are reported, not an error")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0 if same or args.dtype != "float32" else 1
