"""`kvstrata eval ppl`: perplexity of a text through the engine's cache path, per KV setting."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvstrata.cluster.argtypes import kv_dtype_list, positive_int
from kvstrata.worker.model_source import DEFAULT_MODEL

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="measure model quality under lossy KV settings",
                        description="Quality measurements; see docs/benchmarks.md.")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    p = ev_sub.add_parser("ppl", help="perplexity through the engine's KV cache",
                          description="Perplexity of a text, teacher-forced one decode step per token, so every "
                                      "token attends to K/V as the pool stores them. The first setting is the "
                                      "reference the others are compared with.")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--text", type=Path, default=Path(DEFAULT_TEXT), help=f"a UTF-8 text (default {DEFAULT_TEXT})")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="tokens of the text to score (default 2048)")
    p.add_argument("--kv-dtype", type=kv_dtype_list, default=("auto",),
                   help="comma-separated KV formats, e.g. auto,int8,int4 (default auto)")
    p.add_argument("--eviction", action="append", default=None,
                   help='a token eviction policy, e.g. "streaming(sinks=4, window=252)"; repeat for several')
    p.add_argument("--no-reference", action="store_true",
                   help="do not add the full-precision, full-cache run the others are compared with")
    p.add_argument("--prompt-tokens", type=positive_int, default=1,
                   help="the text's first tokens form a prompt, prefilled and not scored (default 1); a policy "
                        "that acts at the end of prefill (snapkv) needs one")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--json", type=Path, default=None, help="write the results as one JSON object")
    p.set_defaults(func=run_ppl)


def settings(kv_dtypes: tuple[str, ...], evictions: list[str] | None, reference: bool) -> list[tuple[str, str | None]]:
    """Every (kv dtype, eviction) pair to run, the reference (auto, no eviction) first unless told not to."""
    runs = [(d, e) for d in kv_dtypes for e in (evictions or [None])]
    if reference and ("auto", None) not in runs:
        runs.insert(0, ("auto", None))
    runs.sort(key=lambda r: r != ("auto", None))
    return runs


def run_ppl(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.throughput import Progress
    from kvstrata.cluster.eval_ppl import perplexity, read_text_tokens
    from kvstrata.worker.llm import LLM
    from kvstrata.worker.token_eviction import resolve_eviction

    for spec in args.eviction or []:
        resolve_eviction(spec, "--eviction")  # ValueError naming the flag, before any model loads
    results = []
    tokens = None
    for kv_dtype, eviction in settings(args.kv_dtype, args.eviction, not args.no_reference):
        llm = LLM(model=args.model, kv_dtype=kv_dtype, block_size=args.block_size,
                  num_gpu_blocks=args.max_tokens // args.block_size + 4, max_model_len=args.max_tokens + 16)
        if tokens is None:
            tokens = read_text_tokens(llm.tokenizer, args.text, args.max_tokens)
        progress = Progress(f"ppl kv_dtype={kv_dtype} eviction={eviction}", len(tokens) - args.prompt_tokens)
        results.append(perplexity(llm, tokens, eviction, args.prompt_tokens, on_token=progress.advance))
        del llm
    ref = results[0].ppl
    print(f"{'kv dtype':<10} {'eviction':<34} {'tokens':>6} {'ppl':>9} {'vs ref':>8} {'KV B/token':>10} "
          f"{'peak blocks':>11} {'ms/token':>8}")
    for r in results:
        print(f"{r.kv_dtype:<10} {str(r.eviction or '-'):<34} {r.num_tokens:>6} {r.ppl:>9.4f} "
              f"{100 * (r.ppl / ref - 1):>+7.2f}% {r.kv_bytes_per_token:>10} {r.peak_kv_blocks:>11} "
              f"{1000 * r.seconds / r.num_tokens:>8.1f}")
    if args.json is not None:
        report = {"model": args.model, "text": str(args.text), "max_tokens": args.max_tokens,
                  "prompt_tokens": args.prompt_tokens,
                  "reference_ppl": ref, "results": [r.to_dict() | {"vs_reference": r.ppl / ref - 1} for r in results]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
