"""`kvstrata bench ...`: argument parsing and printing for the benchmarks (the work is in the modules)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from pathlib import Path

from kvstrata.cluster.argtypes import non_negative_float, non_negative_int, positive_int, unit_interval
from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES
from kvstrata.worker.model_source import DEFAULT_MODEL


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure the engine", description="Benchmarks; see docs/benchmarks.md.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _add_throughput(bench_sub)
    from kvstrata.cluster.bench.memory import add_bench_memory_parser

    add_bench_memory_parser(bench_sub)
    from kvstrata.cluster.bench.tiering_cli import add_bench_tiering_parser

    add_bench_tiering_parser(bench_sub)
    from kvstrata.cluster.bench.serve_cli import add_bench_serve_parser

    add_bench_serve_parser(bench_sub)
    from kvstrata.cluster.bench.routing_cli import add_bench_routing_parser

    add_bench_routing_parser(bench_sub)
    from kvstrata.cluster.bench.kv_decode import add_bench_kv_decode_parser

    add_bench_kv_decode_parser(bench_sub)
    from kvstrata.cluster.bench.speculative import add_bench_speculative_parser

    add_bench_speculative_parser(bench_sub)
    _add_roofline(bench_sub)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _dtype_list(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in ("float32", "bfloat16")]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"dtypes must be float32 and/or bfloat16, got {text!r}")
    return values


def _add_roofline(bench_sub) -> None:
    p = bench_sub.add_parser("roofline", help="machine peaks, and the decode step against its bound",
                             description="Measure matmul FLOP/s and memory bandwidth, then the engine's "
                                         "decode step at several batch sizes as a ratio to its roofline bound.")
    p.add_argument("--batches", type=_int_list, default=(1, 8, 32), help="decode batch sizes (default 1,8,32)")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=positive_int, default=16, help="timed decode steps per batch size")
    p.add_argument("--dtypes", type=_dtype_list, default=("float32", "bfloat16"))
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quick", action="store_true", help="small peak measurements (a smoke test, not a figure)")
    p.add_argument("--stages", action="store_true",
                   help="then time each stage of the decode steps' layers (CPU kernels only): where a step goes")
    p.add_argument("--json", type=Path, default=None, help="write the report as one JSON object")
    p.set_defaults(func=run_roofline_cmd)


def run_roofline_cmd(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.roofline import PeakProbe, bench_decode, decode_tokens_needed
    from kvstrata.cluster.bench.step_stages import format_profiles, profile_decode_stages
    from kvstrata.worker.llm import LLM

    peaks = _measure_peaks(args.dtypes, args.quick)
    print(f"memory bandwidth: read {peaks.read_bytes_per_s / 1e9:.1f} GB/s, copy {peaks.copy_bytes_per_s / 1e9:.1f} GB/s")
    for d, m in peaks.matmul.items():
        backends = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in m.by_backend.items())
        print(f"matmul {d}: {m.flops_per_s / 1e9:.0f} GFLOP/s ({backends})")
    print(f"{'dtype':<10}{'batch':>6}{'context':>9}{'step ms':>10}{'bound ms':>10}{'bound':>9}{'ratio':>8}")
    results, profiles = [], []
    max_batch = max(args.batches)
    for d in args.dtypes:
        max_len = args.prompt_len + decode_tokens_needed(max_batch, args.steps, args.prompt_len)
        blocks = max_batch * (-(-max_len // 16)) + 16
        llm = LLM(args.model, dtype=d, num_gpu_blocks=blocks)
        probe = PeakProbe(d, peaks.matmul[d].best_backend,
                          read_bytes=(16 << 20) if args.quick else (256 << 20),
                          matmul_size=256 if args.quick else 2048)
        for r in bench_decode(llm, d, args.batches, args.prompt_len, args.steps, probe):
            results.append(r)
            print(f"{d:<10}{r.batch:>6}{r.context_len:>9}{r.step_s * 1e3:>10.2f}{r.bound_s * 1e3:>10.2f}"
                  f"{r.bound_kind:>9}{r.ratio:>8.2f}")
        if args.stages:  # apart from the timings above, whose steps follow peak probes
            profiles += [profile_decode_stages(llm, d, b, args.prompt_len, args.steps) for b in args.batches]
        llm.close()
        del llm
        gc.collect()
    if profiles:
        print(f"where a decode step goes (ms a step, mean of {args.steps} steps back to back; lm_head: the final "
              f"norm, the head and a greedy head's argmax; rest: sampling, scheduling and Python):")
        print("\n".join(format_profiles(profiles)))
    if args.json:
        report = {"peaks": peaks.to_json(), "decode": [r.to_json() for r in results]}
        if profiles:
            report["stages"] = [p.to_json() for p in profiles]
        args.json.write_text(json.dumps(report, indent=1))
    return 0


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
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default="auto",
                   help="KV cache storage for kvstrata (auto: the model dtype; others are lossy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling", choices=["fcfs", "offline"], default="offline",
                   help="kvstrata's scheduling policy (default offline: every request arrives at once and only "
                        "the total time counts; fcfs: first come, first served, as an online server runs)")
    p.add_argument("--speculative-tokens", type=non_negative_int, default=0,
                   help="kvstrata drafts up to this many tokens a step by n-gram lookup in each request's own "
                        "tokens, checked by the model (greedy outputs unchanged); default 0: off")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (the default): greedy; above 0, every engine samples at it (kvstrata's request i "
                        "with seed i)")
    p.add_argument("--top-p", type=unit_interval, default=1.0,
                   help="with --temperature: the nucleus, in (0, 1] (default 1)")
    p.add_argument("--json", type=Path, default=None, help="write the report as one JSON object")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--no-bound", action="store_true", help="skip measuring the machine's peaks and the roofline bound")
    p.add_argument("--stages", action="store_true",
                   help="time each stage of kvstrata's steps (CPU kernels only), by prompt and decode-only steps")
    p.add_argument("--quick", action="store_true", help="small peak measurements (a smoke test, not a figure)")
    p.add_argument("--ablate-prefix-caching", action="store_true",
                   help="instead: run kvstrata with prefix caching on and off, in lockstep, on --repeats fresh "
                        "seeds of the workload and report what caching costs (use a workload with no sharing, "
                        "e.g. random)")
    p.add_argument("--repeats", type=positive_int, default=5, help="seeds for --ablate-prefix-caching")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run the whole comparison this many times (prefix cache reset each time) and report "
                        "the median ratios")
    p.set_defaults(func=run_throughput_cmd)


def run_throughput_cmd(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.hf_baseline import load_hf_model, run_hf_continuous, run_hf_static
    from kvstrata.cluster.bench.throughput import Decoding, ThroughputReport, format_report, run_kvstrata
    from kvstrata.cluster.bench.step_stages import StageClock
    from kvstrata.cluster.bench.workloads import WORKLOADS
    from kvstrata.worker.llm import LLM

    modes = [m.strip() for m in args.hf_modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("generate", "generate_batch")]
    if bad:
        raise ValueError(f"--hf-modes: unknown mode(s) {', '.join(bad)}; choose generate, generate_batch")
    decoding = Decoding(args.temperature, args.top_p)
    if args.ablate_prefix_caching:
        return _run_ablation(args)
    workload = WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, scheduling=args.scheduling,
              speculative_tokens=args.speculative_tokens)
    hf = None
    reports = []
    for _ in range(args.rounds):
        llm.reset_prefix_cache()  # every round starts cold, so hits come from the workload alone
        # peaks measured just before and just after the run; the bound uses the better of the two
        before = None if args.no_bound else _measure_peaks((args.dtype,), args.quick)
        with StageClock(llm) if args.stages else contextlib.nullcontext() as stage_clock:
            result = run_kvstrata(llm, workload, decoding=decoding, stage_clock=stage_clock)
        report = ThroughputReport(workload.name, result, scheduling=args.scheduling, decoding=decoding)
        if before is not None:
            report.bound = _workload_bound(llm, workload, args.dtype, [before, _measure_peaks((args.dtype,), args.quick)])
        if args.baseline == "hf" and hf is None:
            # loaded after the first kvstrata run: decode steps run right after transformers had
            # loaded the GGUF file took 1.3-1.4x as long (random workload, 2-4 rows, Zen 5 EPYC)
            hf = load_hf_model(args.model, args.dtype)
        if hf is not None:
            if "generate" in modes:
                report.baselines.append(run_hf_static(hf, workload, batch_size=args.hf_batch_size,
                                                      decoding=decoding))
            if "generate_batch" in modes:
                report.baselines.append(run_hf_continuous(hf, workload, decoding=decoding))
        print(format_report(report), flush=True)
        reports.append(report)
    summary = summarize_rounds(reports)
    if args.rounds > 1:
        print(f"over {args.rounds} rounds: median kvstrata / best HF "
              f"{_fmt(summary['median_ratio_output_tokens_per_s'], 'x')}, "
              f"median wall / bound {_fmt(summary['median_bound_ratio'], 'x')}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot_throughput(reports[-1], args.plot)
    return 0


def _fmt(value, unit: str) -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def summarize_rounds(reports: list) -> dict:
    """The last round's report, plus every round and the medians of the per-round ratios."""
    import statistics

    rounds = [r.to_json() for r in reports]
    ratios = [r["ratio_output_tokens_per_s"] for r in rounds if r["ratio_output_tokens_per_s"] is not None]
    bounds = [r["bound_ratio"] for r in rounds if r["bound_ratio"] is not None]
    return {**rounds[-1], "rounds": rounds,
            "median_ratio_output_tokens_per_s": round(statistics.median(ratios), 3) if ratios else None,
            "median_bound_ratio": round(statistics.median(bounds), 3) if bounds else None}


def _measure_peaks(dtypes: tuple[str, ...], quick: bool):
    from kvstrata.cluster.bench.roofline import measure_peaks

    if quick:  # a smoke test's sizes, not a figure
        return measure_peaks(dtypes, matmul_sizes=(256,), bandwidth_bytes=64 << 20, repeats=2)
    return measure_peaks(dtypes)


def _workload_bound(llm, workload, dtype: str, measured: list):
    from kvstrata.cluster.bench.roofline import ModelCost, best_peaks
    from kvstrata.cluster.bench.throughput import Bound

    peaks = best_peaks(measured, dtype)
    work = ModelCost(llm.engine.config, dtype).workload(workload, llm.engine.kv.block_size)
    return Bound(work.bound_s(peaks, dtype), work.bound_kind(peaks, dtype), work.flops, work.bytes)


def _run_ablation(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.throughput import ablate_prefix_caching, share_model
    from kvstrata.cluster.bench.workloads import WORKLOADS
    from kvstrata.worker.llm import LLM

    workloads = [WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed + i)
                 for i in range(args.repeats)]
    hit = max(w.ideal_prefix_hit_rate(16) for w in workloads)
    if hit > 0:
        print(f"warning: workload {args.workload} shares prefixes (ideal hit rate up to {hit:.1%}); "
              f"the ablation measures caching at 0% hits only on a workload with no sharing")
    kv_bytes = 256 << 20
    on = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True, kv_cache_bytes=kv_bytes)
    off = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, kv_cache_bytes=kv_bytes)
    share_model(on, off)  # one copy of the weights: where each copy lies moved results by 4-9%
    result = ablate_prefix_caching(on, off, workloads)
    j = result.to_json()
    print(f"workload: {args.workload}, {args.repeats} seeds, both engines stepping in lockstep")
    print(f"prefix caching on,  output tok/s: {j['on_output_tokens_per_s']}")
    print(f"prefix caching off, output tok/s: {j['off_output_tokens_per_s']}")
    print(f"on / off per seed: {j['on_over_off']}")
    print(f"cost of prefix caching at 0% hits (1 - median on/off): {result.cost:.2%}")
    if args.json:
        args.json.write_text(json.dumps({"workload": args.workload, "ablation": j}, indent=1))
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
