"""The `kvstrata` command: subcommands parse and print; the work happens in library classes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstrata.cluster.argtypes import integer, non_negative_float, non_negative_int, positive_int
from kvstrata.cluster.bench.cli import add_bench_parser
from kvstrata.cluster.client_cmd import add_client_parser
from kvstrata.cluster.serve_cmd import add_serve_parser, eviction_spec
from kvstrata.cluster.eval_cmd import add_eval_parser
from kvstrata.cluster.size_cmd import add_size_parser
from kvstrata.cluster.status_cmd import add_status_parser
from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES
from kvstrata.worker.model_source import DEFAULT_MODEL


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text in-process with the engine",
                       description="Generate completions in-process (no server, no Ray).")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, HF directory or .gguf file (default {DEFAULT_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompt-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=integer, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=non_negative_float, default=1.0)
    p.add_argument("--top-k", type=integer, default=0)
    p.add_argument("--seed", type=integer, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--block-size", type=integer, default=16)
    p.add_argument("--num-gpu-blocks", type=integer, default=None, help="cap the KV pool at this many blocks")
    p.add_argument("--max-model-len", type=integer, default=None)
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: this process and tp - 1 Ray actors (default 1)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default="auto",
                   help="KV cache storage: auto (the model's dtype), fp16, bf16, fp8_e4m3, fp8_e5m2, int8, int4")
    p.add_argument("--kv-eviction", type=eviction_spec, default=None, metavar="POLICY",
                   help="token eviction (lossy): sliding_window(W), streaming(sinks=S, window=W), "
                        "h2o(heavy=H, recent=R) or snapkv(window=O, budget=B)")
    p.add_argument("--speculative-tokens", type=non_negative_int, default=0,
                   help="draft up to this many tokens a step by n-gram lookup in the prompt and output, checked "
                        "by the model (the same output, faster on repetitive text); default 0: off")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, one per line")
    p.set_defaults(func=run_generate)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CliError("--prompt is empty")
        return [args.prompt]
    try:
        lines = args.prompt_file.read_text().splitlines()
    except OSError as e:
        raise CliError(f"--prompt-file: cannot read {args.prompt_file}: {e.strerror}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CliError(f"--prompt-file: {args.prompt_file} has no prompts")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from kvstrata.worker.llm import LLM
    from kvstrata.worker.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    llm = LLM(model=args.model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
              max_model_len=args.max_model_len, dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp,
              kv_dtype=args.kv_dtype, kv_eviction=args.kv_eviction, speculative_tokens=args.speculative_tokens)
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    finally:
        llm.close()
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({
                "prompt_token_ids": out.prompt_token_ids,
                "token_ids": c.token_ids,
                "text": c.text,
                "num_cached_tokens": out.num_cached_tokens,
                "finish_reason": c.finish_reason,
            }), flush=True)
        else:
            print(c.text, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description="kvstrata: LLM serving built around the KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_client_parser(sub)
    add_size_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    add_status_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError) as e:
        print(f"kvstrata {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
