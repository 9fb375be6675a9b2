"""`kvstrata bench routing`: the command and its output (the text report and the plot); the simulation
itself is in `kvstrata.cluster.bench.routing`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvstrata.cluster.argtypes import integer, non_negative_int, positive_int, positive_number
from kvstrata.cluster.bench.routing import (
    DEFAULT_DRAM_BLOCKS,
    DEFAULT_HBM_BLOCKS,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_NUM_WORKERS,
    DEFAULT_TIME_SCALE,
    RoutingReport,
    RoutingSettings,
    check_prefix_ids,
    run_routing_bench,
)
from kvstrata.cluster.bench.trace import TRACE_BLOCK_TOKENS, find_trace, load_trace
from kvstrata.router.placement import POLICIES

_DESCRIPTION = """\
Replay the production trace against simulated workers (continuous batching on an H100 roofline, a
Llama-3-8B-shaped model, HBM and DRAM prefix caches of 512-token blocks) under each placement policy,
and report the prefix hit rate, the load imbalance, TTFT p50/p99 and throughput, against an oracle
cache with the whole fleet's capacity. See docs/benchmarks.md."""


# -- output ---------------------------------------------------------------------------------------

def format_report(r: RoutingReport) -> str:
    s = r.settings
    first = r.results[0]
    lines = [
        (f"trace {r.trace}: {first.num_requests:,} requests, {first.num_prompt_tokens / 1e6:.1f}M prompt and "
         f"{first.num_output_tokens / 1e6:.2f}M output tokens, arrivals {s.time_scale:g}x faster than recorded"),
        (f"{s.num_workers} workers, each caching {s.hbm_blocks} HBM + {s.dram_blocks} DRAM blocks of "
         f"{TRACE_BLOCK_TOKENS} tokens; a {s.time_model.model.num_params / 1e9:.2f}B-parameter model on the "
         f"roofline of {s.time_model.hardware.flops_per_s / 1e12:.0f} TFLOP/s, "
         f"{s.time_model.hardware.hbm_bytes_per_s / 1e12:.2f} TB/s"),
        (f"{'policy':<14}{'hit rate':>9}{'(DRAM)':>8}{'imbalance':>11}{'TTFT p50':>10}{'p99':>9}"
         f"{'out tok/s':>11}{'req/s':>8}{'prefill busy':>14}"),
    ]
    for p in r.results:
        lines.append(f"{p.policy:<14}{p.hit_rate:>9.1%}{p.num_dram_hit_tokens / p.num_prompt_tokens:>8.1%}"
                     f"{p.imbalance:>11.3f}{p.ttft_ms(50):>10.0f}{p.ttft_ms(99):>9.0f}"
                     f"{p.output_tokens_per_s:>11,.0f}{p.num_requests / p.makespan_s:>8.2f}"
                     f"{p.prefill_utilization:>14.0%}")
    lines += [
        (f"{'oracle':<14}{r.oracle_hit_rate:>9.1%}   one cache of {s.num_workers * s.hbm_blocks} HBM + "
         f"{s.num_workers * s.dram_blocks} DRAM blocks, requests one at a time (hit rate only)"),
        "hit rate: prompt tokens served from HBM or DRAM / prompt tokens; (DRAM): the part served from DRAM",
        "imbalance: the most prefill-busy worker's time in steps that prefill, over the mean; TTFT in ms",
        "prefill busy: the mean worker's time in steps that prefill, over the makespan",
        "targets:",
    ]
    for t in r.targets():
        mark = {True: "met", False: "MISSED", None: "n/a"}[t.met]
        lines.append(f"  [{mark:>6}] {t.name}: {t.detail}")
    return "\n".join(lines)


def plot_report(r: RoutingReport, path: Path) -> None:
    """Hit rate per policy against the oracle, and TTFT p50 / p99 per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.policy for p in r.results]
    xs = range(len(names))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    ax_hit.bar(names, [100 * p.hit_rate for p in r.results], color="#2a7")
    ax_hit.axhline(100 * r.oracle_hit_rate, color="k", ls="--", lw=1, label="oracle")
    ax_hit.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax_hit.legend()
    width = 0.38
    ax_ttft.bar([x - width / 2 for x in xs], [p.ttft_ms(50) for p in r.results], width, label="p50")
    ax_ttft.bar([x + width / 2 for x in xs], [p.ttft_ms(99) for p in r.results], width, label="p99")
    ax_ttft.set_xticks(list(xs), names)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.legend()
    for ax in (ax_hit, ax_ttft):
        ax.tick_params(axis="x", labelsize=8)
    s = r.settings
    fig.suptitle(f"routing: {r.results[0].num_requests:,} trace requests on {s.num_workers} simulated workers, "
                 f"arrivals {s.time_scale:g}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------------

def add_bench_routing_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "routing", help="placement policies on the production trace, in a simulated fleet",
        description=_DESCRIPTION)
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="trace JSONL file (default: $KVSTRATA_TRACE, else shared/traces/ above the repo)")
    p.add_argument("--workers", type=positive_int, default=DEFAULT_NUM_WORKERS,
                   help=f"simulated workers (default {DEFAULT_NUM_WORKERS})")
    p.add_argument("--policy", choices=list(POLICIES), nargs="+", action="extend", default=None, metavar="P",
                   help=f"policies to compare, in order (default all: {' '.join(POLICIES)})")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="replay only the first N trace requests (default: all)")
    p.add_argument("--hbm-blocks", type=positive_int, default=DEFAULT_HBM_BLOCKS,
                   help=f"HBM blocks of {TRACE_BLOCK_TOKENS} tokens a worker keeps for cached prefixes "
                        f"(default {DEFAULT_HBM_BLOCKS})")
    p.add_argument("--dram-blocks", type=non_negative_int, default=DEFAULT_DRAM_BLOCKS,
                   help=f"DRAM blocks a worker keeps; 0: no DRAM tier (default {DEFAULT_DRAM_BLOCKS})")
    p.add_argument("--time-scale", type=positive_number, default=DEFAULT_TIME_SCALE,
                   help=f"arrivals this many times faster than recorded (default {DEFAULT_TIME_SCALE:g})")
    p.add_argument("--max-batched-tokens", type=positive_int, default=DEFAULT_MAX_BATCHED_TOKENS,
                   help=f"tokens a worker's step may hold (default {DEFAULT_MAX_BATCHED_TOKENS})")
    p.add_argument("--seed", type=integer, default=0, help="seed of power_of_two's draws (default 0)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report as one JSON object")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE", help="write a PNG (needs matplotlib)")
    p.set_defaults(func=run_bench_routing)
    return p


def run_bench_routing(args: argparse.Namespace) -> int:
    """The command; a bad flag value or trace is a ValueError naming the flag (exit status 2)."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():  # fail now, not after the simulation
            raise ValueError(f"{flag}: directory {path.parent} does not exist")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    try:
        trace_path = find_trace(args.trace)
        trace = load_trace(trace_path, limit=args.num_requests)
        check_prefix_ids(trace)
    except (OSError, ValueError) as e:
        raise ValueError(f"--trace: {e}") from None
    settings = RoutingSettings(num_workers=args.workers, hbm_blocks=args.hbm_blocks, dram_blocks=args.dram_blocks,
                               time_scale=args.time_scale, max_batched_tokens=args.max_batched_tokens,
                               seed=args.seed)
    policies = list(dict.fromkeys(args.policy)) if args.policy else list(POLICIES)
    report = run_routing_bench(trace, settings, policies, trace_name=str(trace_path))
    print(format_report(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if args.plot is not None:
        plot_report(report, args.plot)
    return 0
