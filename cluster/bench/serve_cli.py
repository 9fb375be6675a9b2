"""`kvstrata bench serve`: the command and its output (the text report and the plot); the
measurement itself is in `kvstrata.cluster.bench.serve`."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstrata.cluster.argtypes import integer, non_negative_float, positive_int, positive_number, unit_interval
from kvstrata.cluster.bench.serve import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_TPOT_SLO_MS,
    DEFAULT_TTFT_SLO_MS,
    PERCENTILES,
    ServeBenchError,
    ServeConfig,
    ServeReport,
    Slo,
    list_models,
    run_serve_bench,
    warm_up,
)
from kvstrata.cluster.bench.throughput import Decoding
from kvstrata.cluster.bench.workloads import Workload

_DESCRIPTION = """\
Send a workload to an OpenAI-compatible server (POST /v1/completions, streamed) at Poisson arrivals and
report TTFT, TPOT, ITL and end-to-end latency (mean, p50/p90/p99), throughput, the prefix cache hit
fraction the server reports (usage.prompt_tokens_details.cached_tokens / prompt_tokens), and goodput:
completed requests per second that met both --ttft-slo-ms and --tpot-slo-ms. One small untimed request
goes first. See docs/benchmarks.md."""


# -- output ---------------------------------------------------------------------------------------

def format_report(report: ServeReport) -> str:
    s, c = report.summary(), report.config
    arrivals = "all at once" if math.isinf(c.request_rate) else f"Poisson at {c.request_rate:g} req/s"
    if c.decoding.sampled:
        arrivals += f"; {c.decoding.describe()}"
    if c.max_concurrency:
        arrivals += f", at most {c.max_concurrency} in flight"
    failures = ", ".join(f"{k}: {v}" for k, v in s["failures"].items())
    hit = "-" if s["prefix_cache_hit_rate"] is None else f"{s['prefix_cache_hit_rate']:.1%}"
    lines = [
        f"workload {report.workload}, {s['num_requests']} requests to {c.target} (model {c.model}), {arrivals}",
        f"{'completed':<22}{s['num_completed']}",
        f"{'failed':<22}{s['num_failed']}" + (f" ({failures})" if failures else ""),
        f"{'duration':<22}{s['duration_s']:.2f} s",
        f"{'request throughput':<22}{s['request_throughput']:.2f} req/s",
        (f"{'goodput':<22}{s['goodput']:.2f} req/s ({s['num_good']} requests with TTFT <= {c.slo.ttft_ms:g} ms "
         f"and TPOT <= {c.slo.tpot_ms:g} ms)"),
        f"{'output tokens/s':<22}{s['output_tokens_per_s']:.1f}",
        f"{'total tokens/s':<22}{s['total_tokens_per_s']:.1f}",
        f"{'prefix cache hits':<22}{hit} of prompt tokens",
        f"{'ms':<8}" + "".join(f"{h:>10}" for h in ("mean", *(f"p{q}" for q in PERCENTILES))),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = s[f"{name}_ms"]
        cells = ["-"] * (1 + len(PERCENTILES)) if stats is None else [f"{v:.1f}" for v in stats.values()]
        lines.append(f"{name.upper():<8}" + "".join(f"{x:>10}" for x in cells))
    return "\n".join(lines)


def plot_report(report: ServeReport, path: Path) -> None:
    """TTFT and TPOT histograms against their SLOs, and a timeline of every request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo, done = report.config.slo, report.completed
    fig, (ax_ttft, ax_tpot, ax_time) = plt.subplots(1, 3, figsize=(14, 4))
    for ax, values, limit, name in ((ax_ttft, [r.ttft_s * 1e3 for r in done], slo.ttft_ms, "TTFT"),
                                    (ax_tpot, [r.tpot_s * 1e3 for r in done if r.tpot_s is not None],
                                     slo.tpot_ms, "TPOT")):
        if values:  # bins over the whole axis, so the SLO line does not squeeze them into one bar
            ax.hist(values, bins=40, range=(0, 1.05 * max(*values, limit)), color="#58a")
        ax.axvline(limit, color="#c33", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
        ax.legend()
    for r in report.records:
        if not r.ok:
            ax_time.plot([r.send_s], [r.index], "x", color="#c33")
            continue
        first = r.send_s + r.ttft_s
        ax_time.plot([r.send_s, first], [r.index] * 2, color="#aaa")
        ax_time.plot([first, r.send_s + r.e2e_s], [r.index] * 2, color="#2a7" if slo.met_by(r) else "#e90")
    ax_time.set_title("grey: to first text; green: within SLO, orange: not; x: failed", fontsize=9)
    ax_time.set_xlabel("time since start (s)")
    ax_time.set_ylabel("request")
    s = report.summary()
    fig.suptitle(f"{report.workload}: {s['num_completed']}/{s['num_requests']} completed, "
                 f"goodput {s['goodput']:.2f} req/s of {s['request_throughput']:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------------

def _request_rate(text: str) -> float:
    return positive_number(text, allow_inf=True)


def _base_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected a base URL like http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def add_bench_serve_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    from kvstrata.cluster.bench.workloads import WORKLOADS

    p = bench_subparsers.add_parser("serve", help="online serving: latency, throughput and goodput over HTTP",
                                    description=_DESCRIPTION)
    p.add_argument("--target", type=_base_url, required=True, metavar="URL",
                   help="the server's base URL, without /v1 (e.g. http://127.0.0.1:8000)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix",
                   help="default shared-prefix")
    p.add_argument("--num-requests", type=positive_int, metavar="N", default=None,
                   help="default: the workload's own (32)")
    p.add_argument("--request-rate", type=_request_rate, metavar="RATE", default=math.inf,
                   help="mean requests/s of the Poisson arrivals; inf sends all at once (default inf)")
    p.add_argument("--max-concurrency", type=positive_int, metavar="N", default=None,
                   help="most requests in flight at once (default: no cap)")
    p.add_argument("--seed", type=integer, metavar="N", default=0,
                   help="seeds the workload and the arrival times (default 0)")
    p.add_argument("--temperature", type=non_negative_float, metavar="T", default=0.0,
                   help="0 (the default): greedy; above 0, request i is sampled at T with seed i")
    p.add_argument("--top-p", type=unit_interval, metavar="P", default=1.0,
                   help="with --temperature: the nucleus, in (0, 1] (default 1)")
    p.add_argument("--model", default=None, help="default: the first model GET /v1/models lists")
    p.add_argument("--api-key", default=os.environ.get("KVSTRATA_API_KEY"), metavar="KEY",
                   help="sent as Authorization: Bearer KEY (default: $KVSTRATA_API_KEY)")
    p.add_argument("--ttft-slo-ms", type=positive_number, metavar="MS", default=DEFAULT_TTFT_SLO_MS,
                   help=f"time-to-first-token SLO for goodput (default {DEFAULT_TTFT_SLO_MS:g}, for a CPU host)")
    p.add_argument("--tpot-slo-ms", type=positive_number, metavar="MS", default=DEFAULT_TPOT_SLO_MS,
                   help=f"time-per-output-token SLO for goodput (default {DEFAULT_TPOT_SLO_MS:g}, for a CPU host)")
    p.add_argument("--timeout", type=positive_number, metavar="S", default=DEFAULT_TIMEOUT_S,
                   help=f"seconds one request may take in all before it counts as failed "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the summary and every request's record as one JSON object")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE",
                   help="write a PNG of the TTFT and TPOT distributions and the request timeline (needs matplotlib)")
    p.set_defaults(func=run_bench_serve)
    return p


def _error(message: str) -> int:
    print("kvstrata bench serve: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


async def _run(args: argparse.Namespace, workload: Workload) -> ServeReport:
    model = args.model
    if model is None:
        models = await list_models(args.target, args.api_key)
        if not models:
            raise ServeBenchError(f"GET {args.target}/v1/models lists no model; pass --model")
        model = models[0]
    config = ServeConfig(args.target, model, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                         seed=args.seed, api_key=args.api_key, timeout_s=args.timeout,
                         slo=Slo(args.ttft_slo_ms, args.tpot_slo_ms), decoding=Decoding(args.temperature, args.top_p))
    await warm_up(config)
    return await run_serve_bench(config, workload)


def run_bench_serve(args: argparse.Namespace) -> int:
    from kvstrata.cluster.bench.workloads import WORKLOADS

    if importlib.util.find_spec("httpx") is None:
        return _error("bench serve needs httpx, which is not installed (pip install httpx)")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        return _error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    workload = WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed)
    try:
        report = asyncio.run(_run(args, workload))
    except ServeBenchError as e:
        return _error(str(e))
    print(format_report(report), flush=True)
    try:
        if args.json is not None:
            args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
        if args.plot is not None:
            plot_report(report, args.plot)
    except OSError as e:
        return _error(str(e))
    if not report.completed:
        return _error(f"no request completed ({', '.join(f'{k}: {v}' for k, v in report.failures().items())})")
    return 0
