"""`kvstrata bench kv-decode`: the decode step at long context for each KV storage format.

Every format runs the same batch of sequences at the same context length in one process, format
after format, for several rounds (so a noisy neighbour hits them alike); each format's figure is
the median step over all its rounds, and its ratio is to the first format's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstrata.cluster.argtypes import kv_dtype_list, positive_int
from kvstrata.worker.model_source import DEFAULT_MODEL


@dataclass(frozen=True)
class KVDecodeResult:
    kv_dtype: str
    batch: int
    context_len: int
    kv_bytes_per_token: int  # K and V of every layer, scales included
    step_ms_median: float
    steps: int

    def to_json(self) -> dict:
        return asdict(self)


def add_bench_kv_decode_parser(bench_sub) -> None:
    p = bench_sub.add_parser("kv-decode", help="decode step time at long context for each KV format",
                             description="Decode steps of a batch at a long context, for each --kv-dtype, "
                                         "side by side in one run.")
    p.add_argument("--kv-dtypes", type=kv_dtype_list, default=("auto", "bf16", "int8", "fp8_e4m3", "int4"),
                   help="comma-separated formats; the first is the reference (default auto,bf16,int8,fp8_e4m3,int4)")
    p.add_argument("--context", type=positive_int, default=2048, help="prompt tokens per sequence (default 2048)")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=8, help="timed decode steps per round")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run_kv_decode_cmd)


def bench_kv_decode(model: str, kv_dtypes: tuple[str, ...], context: int, batch: int, steps: int,
                    rounds: int) -> list[KVDecodeResult]:
    from kvstrata.cluster.bench.roofline import decode_tokens_needed, time_decode_steps
    from kvstrata.worker.llm import LLM

    max_len = context + decode_tokens_needed(batch, steps, context) + 1
    blocks = batch * (-(-max_len // 16)) + 16
    llms = {d: LLM(model, kv_dtype=d, num_gpu_blocks=blocks, max_model_len=max_len + 16) for d in kv_dtypes}
    times: dict[str, list[float]] = {d: [] for d in kv_dtypes}
    for r in range(rounds):
        for d, llm in llms.items():
            times[d] += [s for s, _ in time_decode_steps(llm, batch, context, steps, seed=r)]
    results = []
    for d, llm in llms.items():
        per_token = llm.engine.runner.kv_bytes_per_token
        results.append(KVDecodeResult(d, batch, context, per_token, 1e3 * statistics.median(times[d]), len(times[d])))
    return results


def run_kv_decode_cmd(args: argparse.Namespace) -> int:
    results = bench_kv_decode(args.model, args.kv_dtypes, args.context, args.batch, args.steps, args.rounds)
    ref = results[0].step_ms_median
    print(f"decode steps of {args.batch} sequences at context {args.context}, median of {results[0].steps}")
    print(f"{'kv dtype':<10}{'KV B/token':>11}{'step ms':>10}{'vs ' + results[0].kv_dtype:>10}")
    for r in results:
        print(f"{r.kv_dtype:<10}{r.kv_bytes_per_token:>11}{r.step_ms_median:>10.2f}{r.step_ms_median / ref:>10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"results": [r.to_json() for r in results]}, indent=1) + "\n")
    return 0
