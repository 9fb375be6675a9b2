"""`kvstrata bench ...`: argument parsing and printing for the benchmarks (the work is in the modules)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvstrata.cluster.argtypes import positive_int
from kvstrata.worker.model_source import DEFAULT_MODEL


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure the engine", description="Benchmarks; see docs/benchmarks.md.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _add_throughput(bench_sub)
    from kvstrata.cluster.bench.memory import add_bench_memory_parser

    add_bench_memory_parser(bench_sub)


def _add_throughput(bench_sub) -> None:
    from kvstrata.cluster.bench.workloads import WORKLOADS

    p = bench_sub.add_parser("throughput", help="kvstrata vs HF transformers on one workload",
                             description="Run one workload through kvstrata and, with --baseline hf, "
                                         "through HF transformers in the same run.")
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--num-requests", type=positive_int, default=None, help="default: the workload's own")
    p.add_argument("--baseline", choices=["hf"], default=None)
    p.add_argument("--hf-batch-size", type=positive_int, default=8, help="static batch size of the HF generate baseline")
    p.add_argument("--hf-modes", default="generate,generate_batch",
                   help="HF baselines to run; the faster one is the reference (default both)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the report as one JSON object")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart (needs matplotlib)")
    p.set_defaults(func=run_throughput_cmd)


def run_throughput_cmd(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.throughput import (
        ThroughputReport,
        format_report,
        load_hf_model,
        run_hf_continuous,
        run_hf_static,
        run_kvstrata,
    )
    from kvstrata.cluster.bench.workloads import WORKLOADS
    from kvstrata.worker.llm import LLM

    modes = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("generate", "generate_batch")]
    if bad:
        raise ValueError(f"--hf-modes: unknown mode(s) {', '.join(bad)}; choose generate, generate_batch")
    workload = WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype)
    report = ThroughputReport(workload.name, run_kvstrata(llm, workload))
    if args.baseline == "hf":
        hf = load_hf_model(args.model, args.dtype)
        if "generate" in modes:
            report.baselines.append(run_hf_static(hf, workload, batch_size=args.hf_batch_size))
        if "generate_batch" in modes:
            report.baselines.append(run_hf_continuous(hf, workload))
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    if args.plot:
        plot_throughput(report, args.plot)
    return 0


def plot_throughput(report, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    rows = [report.kvstrata, *report.baselines]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.engine for r in rows], [r.output_tokens_per_s for r in rows], color=["#2a7"] + ["#888"] * len(report.baselines))
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput, workload {report.workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
