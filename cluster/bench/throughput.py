"""`kvstrata bench throughput`: one workload through kvstrata's `LLM` and, side by side, HF transformers.

All requests arrive at t = 0 (an offline batch), decode greedily and ignore EOS, so every engine
produces exactly the requested output tokens. A request's latency is the time from t = 0 until its
last token. The HF baseline is the faster of `generate` over left-padded static batches and
`generate_batch` (transformers' continuous batching), on the same weights and dtype (hf_baseline.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstrata.cluster.bench.workloads import Workload


DECODE_ROW_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, None))


@dataclass(frozen=True)
class StepProfile:
    """Where a run's engine steps went: the steps that computed prompt tokens (prefill chunks, with
    whatever decodes ran beside them), and the decode-only steps by how many rows they decoded. A
    decode-only step of a few rows reads every weight for a few tokens, so a long tail of them is
    memory-bound however fast each step is; this is what separates a workload's wall time from a
    bound that assumes every weight read overlaps with useful compute."""

    steps: list[tuple[float, int, int]] = field(repr=False)  # (seconds, decode rows, prefill tokens)
    # with a StageClock: per kind of step ("with_prompt_tokens", "decode_only"), seconds a stage
    stage_seconds: dict[str, dict[str, float]] | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        prefill = [s for s in self.steps if s[2] > 0]
        decode = [s for s in self.steps if s[2] == 0]
        buckets = []
        for lo, hi in DECODE_ROW_BUCKETS:
            times = [t for t, rows, _ in decode if rows >= lo and (hi is None or rows <= hi)]
            if times:
                label = str(lo) if lo == hi else f"{lo}-{hi}" if hi else f"{lo}+"
                buckets.append({"rows": label, "steps": len(times), "seconds": round(sum(times), 3),
                                "ms_per_step_p50": round(percentile(times, 50) * 1e3, 2)})
        out = {
            "steps": len(self.steps),
            "seconds": round(sum(t for t, _, _ in self.steps), 3),
            "with_prompt_tokens": {"steps": len(prefill), "seconds": round(sum(t for t, _, _ in prefill), 3),
                                   "prompt_tokens": sum(p for _, _, p in prefill)},
            "decode_only": buckets,
        }
        if self.stage_seconds is not None:
            out["stages_ms_per_step"] = {kind: self._stages_per_step(steps, self.stage_seconds[kind])
                                         for kind, steps in (("with_prompt_tokens", prefill), ("decode_only", decode))
                                         if steps}
        return out

    @staticmethod
    def _stages_per_step(steps: list[tuple[float, int, int]], seconds: dict[str, float]) -> dict[str, float]:
        """ms a step of each stage, and of the rest of those steps (sampling, scheduling, Python)."""
        n = len(steps)
        ms = {name: round(1e3 * s / n, 3) for name, s in seconds.items()}
        ms["rest"] = round(1e3 * (sum(t for t, _, _ in steps) - sum(seconds.values())) / n, 3)
        return ms


@dataclass(frozen=True)
class RunResult:
    engine: str
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    latencies_s: list[float] = field(repr=False)
    prefix_hit_rate: float | None = None
    step_profile: StepProfile | None = None  # kvstrata's own steps
    # kvstrata's speculative decoding: draft tokens computed, and those the model agreed with
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def latency_percentile(self, q: float) -> float:
        return percentile(self.latencies_s, q)

    def summary(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "wall_s": round(self.wall_s, 3),
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "total_tokens_per_s": round(self.total_tokens_per_s, 2),
            "latency_p50_s": round(self.latency_percentile(50), 3),
            "latency_p90_s": round(self.latency_percentile(90), 3),
            "latency_p99_s": round(self.latency_percentile(99), 3),
            "prefix_hit_rate": None if self.prefix_hit_rate is None else round(self.prefix_hit_rate, 4),
            **({} if self.step_profile is None else {"step_profile": self.step_profile.summary()}),
            **({"draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens}
               if self.draft_tokens else {}),
        }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Progress:
    """A one-line progress counter on stderr; silent when stderr is not a terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None = None):
        self.label, self.total, self.done = label, total, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            print(f"\r{self.label}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)
            if self.done >= self.total:
                print(file=sys.stderr)


@dataclass(frozen=True)
class Decoding:
    """How every request of a run picks its tokens: greedy (temperature 0, the default), or sampled
    at a temperature with top_p, request i seeded with i so that a run repeats."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def describe(self) -> str:
        if not self.sampled:
            return "greedy"
        return f"sampled at temperature {self.temperature:g}" + (f", top_p {self.top_p:g}" if self.top_p < 1 else "")

    def request_fields(self, index: int) -> dict[str, Any]:
        """Request `index`'s sampling fields, as SamplingParams and the OpenAI API both name them."""
        if not self.sampled:
            return {"temperature": 0.0}
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": index}

    def hf_kwargs(self) -> dict[str, Any]:
        """The same choice for HF `generate`: no top-k (HF's default keeps 50), the same top_p."""
        if not self.sampled:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


GREEDY = Decoding()


def submit_requests(engine: Any, workload: Workload, prefix: str, decoding: Decoding = GREEDY) -> None:
    """Every request of `workload`, ignoring EOS so each yields exactly its max_tokens."""
    from kvstrata.worker.sampling_params import SamplingParams

    for i, req in enumerate(workload.requests):
        sp = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, **decoding.request_fields(i))
        engine.add_request(f"{prefix}-{i}", list(req.prompt_token_ids), sp)


def run_kvstrata(llm: Any, workload: Workload, clock: Callable[[], float] = time.perf_counter,
                 decoding: Decoding = GREEDY, stage_clock: Any = None) -> RunResult:
    """With an entered step_stages.StageClock, each step's stages are added up by kind of step."""
    engine = llm.engine
    _warm_up_kvstrata(llm)
    queried0, hit0 = engine.kv.num_prompt_tokens_queried, engine.kv.num_prompt_tokens_hit
    drafted0, accepted0 = engine.stats.num_draft_tokens, engine.stats.num_accepted_draft_tokens
    progress = Progress(f"kvstrata {workload.name}", len(workload.requests))
    start = clock()
    submit_requests(engine, workload, "bench", decoding)
    latencies: list[float] = []
    steps: list[tuple[float, int, int]] = []
    output_tokens = 0
    stats = engine.stats
    stage_seconds = None if stage_clock is None else {kind: dict.fromkeys(stage_clock.NAMES, 0.0)
                                                      for kind in ("with_prompt_tokens", "decode_only")}
    while engine.has_unfinished_requests():
        marks = stage_clock.read() if stage_clock is not None else None
        num_steps, t0 = stats.num_steps, clock()
        finished = engine.step()
        if stats.num_steps > num_steps:  # a batch ran (not a step spent waiting for tier loads)
            steps.append((clock() - t0, stats.last_step_decodes, stats.last_step_prefill_tokens))
            if stage_seconds is not None:
                totals = stage_seconds["with_prompt_tokens" if stats.last_step_prefill_tokens else "decode_only"]
                for name, a, b in zip(stage_clock.NAMES, marks, stage_clock.read()):
                    totals[name] += b - a
        for out in finished:
            latencies.append(clock() - start)
            output_tokens += len(out.outputs[0].token_ids)
            progress.advance()
    wall = clock() - start
    queried = engine.kv.num_prompt_tokens_queried - queried0
    hit = engine.kv.num_prompt_tokens_hit - hit0
    return RunResult("kvstrata", wall, len(workload.requests), workload.num_prompt_tokens, output_tokens,
                     latencies, hit / queried if queried else 0.0, StepProfile(steps, stage_seconds),
                     stats.num_draft_tokens - drafted0, stats.num_accepted_draft_tokens - accepted0)


# Every engine gets one small untimed request first, so one-time costs (kernel builds and caches,
# first-touch page faults) stay out of the figures, for kvstrata and HF alike.
WARMUP_PROMPT = [17 + i for i in range(24)]
WARMUP_TOKENS = 4


def _warm_up_kvstrata(llm: Any) -> None:
    from kvstrata.worker.sampling_params import SamplingParams

    llm.generate([WARMUP_PROMPT], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True))


@dataclass(frozen=True)
class Bound:
    """The workload's roofline bound (see roofline.ModelCost.workload) on this machine."""

    seconds: float
    kind: str  # "compute" or "memory"
    flops: float
    bytes: float


@dataclass
class ThroughputReport:
    workload: str
    kvstrata: RunResult
    baselines: list[RunResult] = field(default_factory=list)
    bound: Bound | None = None
    scheduling: str = "fcfs"  # kvstrata's scheduling policy in the run
    decoding: Decoding = GREEDY

    @property
    def bound_ratio(self) -> float | None:
        """kvstrata's wall time over the workload's bound (1.0 = at the roofline)."""
        return self.kvstrata.wall_s / self.bound.seconds if self.bound else None

    @property
    def best_baseline(self) -> RunResult | None:
        return max(self.baselines, key=lambda r: r.output_tokens_per_s) if self.baselines else None

    def to_json(self) -> dict[str, Any]:
        best = self.best_baseline
        return {
            "workload": self.workload,
            "scheduling": self.scheduling,
            "temperature": self.decoding.temperature,
            "top_p": self.decoding.top_p,
            "kvstrata": self.kvstrata.summary(),
            "baselines": [b.summary() for b in self.baselines],
            "best_baseline": best.engine if best else None,
            "ratio_output_tokens_per_s": (
                round(self.kvstrata.output_tokens_per_s / best.output_tokens_per_s, 3) if best else None
            ),
            "bound": None if self.bound is None else {
                "seconds": round(self.bound.seconds, 4), "kind": self.bound.kind,
                "flops": self.bound.flops, "bytes": self.bound.bytes,
            },
            "bound_ratio": None if self.bound_ratio is None else round(self.bound_ratio, 3),
        }


def format_report(report: ThroughputReport) -> str:
    rows = [report.kvstrata, *report.baselines]
    lines = [f"workload: {report.workload}; kvstrata scheduling: {report.scheduling}; {report.decoding.describe()}",
             f"{'engine':<24}{'out tok/s':>11}{'total tok/s':>13}{'p50 s':>9}{'p90 s':>9}{'p99 s':>9}{'hit rate':>10}"]
    for r in rows:
        s = r.summary()
        hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.1%}"
        lines.append(f"{r.engine:<24}{s['output_tokens_per_s']:>11.1f}{s['total_tokens_per_s']:>13.1f}"
                     f"{s['latency_p50_s']:>9.2f}{s['latency_p90_s']:>9.2f}{s['latency_p99_s']:>9.2f}{hit:>10}")
    j = report.to_json()
    if j["ratio_output_tokens_per_s"] is not None:
        lines.append(f"kvstrata / {j['best_baseline']}: {j['ratio_output_tokens_per_s']:.2f}x output tokens/s")
    if report.bound is not None:
        lines.append(f"roofline bound: {report.bound.seconds:.2f} s ({report.bound.kind}); "
                     f"kvstrata wall {report.kvstrata.wall_s:.2f} s = {report.bound_ratio:.2f}x the bound")
    if report.kvstrata.step_profile is not None:
        lines += format_step_profile(report.kvstrata.step_profile.summary())
    k = report.kvstrata
    if k.draft_tokens:
        lines.append(f"speculative decoding: {k.draft_tokens} draft tokens, {k.accepted_draft_tokens} accepted "
                     f"({k.accepted_draft_tokens / k.draft_tokens:.1%})")
    return "\n".join(lines)


def format_step_profile(p: dict[str, Any]) -> list[str]:
    pre = p["with_prompt_tokens"]
    cells = [f"{b['rows']} rows: {b['steps']} steps, {b['seconds']:.2f} s ({b['ms_per_step_p50']:.1f} ms p50)"
             for b in p["decode_only"]]
    lines = [f"kvstrata steps: {p['steps']} in {p['seconds']:.2f} s; with prompt tokens: {pre['steps']} steps, "
             f"{pre['seconds']:.2f} s ({pre['prompt_tokens']} tokens)",
             "  decode-only: " + ("; ".join(cells) if cells else "none")]
    for kind, ms in p.get("stages_ms_per_step", {}).items():
        lines.append(f"  {kind.replace('_', ' ')}, ms a step: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items() if v))
    return lines


@dataclass(frozen=True)
class AblationResult:
    """kvstrata with prefix caching on and off, on workloads with no sharing (0% hits)."""

    on_tokens_per_s: list[float]
    off_tokens_per_s: list[float]

    @property
    def ratios(self) -> list[float]:
        """on / off per workload; both ran the same steps interleaved, so machine drift cancels."""
        return [a / b for a, b in zip(self.on_tokens_per_s, self.off_tokens_per_s)]

    @property
    def cost(self) -> float:
        """Fraction of throughput that prefix caching costs: 1 - median(on / off)."""
        return 1.0 - statistics.median(self.ratios)

    def to_json(self) -> dict[str, Any]:
        return {"on_output_tokens_per_s": [round(x, 2) for x in self.on_tokens_per_s],
                "off_output_tokens_per_s": [round(x, 2) for x in self.off_tokens_per_s],
                "on_over_off": [round(x, 4) for x in self.ratios],
                "cost": round(self.cost, 4)}


def run_lockstep(llms: list[Any], workload: Workload, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Run `workload` through several engines step by step, alternately; returns each one's output tok/s.

    Each engine's time is the sum of its own steps. Their steps interleave (the first to go rotates),
    so a machine that slows down for a while slows every engine alike, and the ratio between them
    stays meaningful on a noisy host.
    """
    engines = [llm.engine for llm in llms]
    for engine in engines:
        submit_requests(engine, workload, "lockstep")
    busy = [0.0] * len(engines)
    tokens = [0] * len(engines)
    turn = 0
    while any(e.has_unfinished_requests() for e in engines):
        for k in range(len(engines)):
            j = (turn + k) % len(engines)
            if engines[j].has_unfinished_requests():
                t0 = clock()
                outs = engines[j].step()
                busy[j] += clock() - t0
                tokens[j] += sum(len(o.outputs[0].token_ids) for o in outs)
        turn += 1
    return [t / b if b else 0.0 for t, b in zip(tokens, busy)]


def share_model(source: Any, target: Any) -> None:
    """Make `target`'s engine run on `source`'s model (weights included), so that two engines compared
    in lockstep differ only in the setting under test.

    Each engine's own copy of the weights lies where the allocator put it, and that alone moved
    results: on a 2-core Xeon host, engines loaded one after another into one process ran 4-9% apart
    in lockstep (the first loaded the slowest, whatever its settings), and prefix caching at 0% hits
    measured a 5% cost with its engine loaded first and a 4% gain loaded second. With one copy
    shared, three engines ran within 0.5% of each other.
    """
    if source.engine.config != target.engine.config:
        raise ValueError("share_model needs two engines of the same model")
    target.engine.runner.model = source.engine.runner.model


def ablate_prefix_caching(llm_on: Any, llm_off: Any, workloads: list[Workload]) -> AblationResult:
    """Each workload through both engines in lockstep; output tok/s of each.

    The workloads must share nothing with each other or within themselves (use a fresh seed for
    each), so the engine with caching on pays for hashing and caching and never gets a hit.
    """
    on: list[float] = []
    off: list[float] = []
    for w in workloads:
        a, b = run_lockstep([llm_on, llm_off], w)
        on.append(a)
        off.append(b)
    return AblationResult(on, off)
