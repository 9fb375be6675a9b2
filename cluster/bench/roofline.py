"""The roofline: this machine's matmul FLOP/s and memory bandwidth, and the work a model step or a
whole workload cannot avoid, so that measured times can be quoted as a ratio to their lower bound.

    bound = max(FLOPs / peak FLOP/s, bytes read / bandwidth)

Peaks are measured, never assumed: the best of torch's own matmul and the engine's projection
backends (oneDNN, packed) on large square matrices, and a streaming read (a sum over a tensor far larger than the
last-level cache). The work model counts what any engine must do: every projection and attention
FLOP of the tokens it computes (prefix-cache hits are not computed), and, per forward pass, all
weights plus the KV cache of every decoding sequence read from memory.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from kvstrata.cluster.bench.workloads import Workload
from kvstrata.worker.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# -- machine peaks ------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatmulPeak:
    dtype: str
    flops_per_s: float  # the best of the backends below
    by_backend: dict[str, float]  # "torch.matmul" / "onednn" / "packed" -> FLOP/s at the best size

    @property
    def best_backend(self) -> str:
        return max(self.by_backend, key=self.by_backend.__getitem__)


@dataclass(frozen=True)
class MachinePeaks:
    matmul: dict[str, MatmulPeak]  # by dtype name
    read_bytes_per_s: float  # streaming read: the bandwidth bound
    copy_bytes_per_s: float  # read + write, reported for context

    def flops_per_s(self, dtype: str) -> float:
        return self.matmul[dtype].flops_per_s

    def to_json(self) -> dict:
        return {"matmul": {k: asdict(v) for k, v in self.matmul.items()},
                "read_bytes_per_s": self.read_bytes_per_s, "copy_bytes_per_s": self.copy_bytes_per_s}


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


SCREEN_SIZE = 384


def measure_matmul(dtype: str, sizes: tuple[int, ...] = (2048, 4096), repeats: int = 5) -> MatmulPeak:
    from kvstrata.worker.linear import select_linear

    td = DTYPES[dtype]
    cpu = torch.device("cpu")
    backends = {"torch.matmul": None}
    for name in ("onednn", "packed"):
        try:
            backends[name] = select_linear(cpu, td, name)
        except ValueError:  # not on this machine
            pass
    gen = torch.Generator().manual_seed(0)

    def rates(n: int, names: list[str], reps: int) -> dict[str, float]:
        a = torch.randn(n, n, generator=gen).to(td)
        b = torch.randn(n, n, generator=gen).to(td)
        out = {}
        for name in names:
            lin = backends[name]
            if lin is None:
                fn = lambda: torch.matmul(a, b)  # noqa: E731
            else:
                w = lin.prepare(b)
                fn = lambda: lin(a, w, None)  # noqa: E731
            out[name] = 2 * n**3 / median_time(fn, reps)
        return out

    # a screen at a small size first: a backend with no native kernels for the dtype here (torch's
    # bf16 matmul on an AVX2 CPU took 58 s at 2048) keeps its screened rate and skips the large sizes
    best = rates(SCREEN_SIZE, list(backends), 1)
    fast = [name for name, r in best.items() if r >= max(best.values()) / 10]
    for n in sizes:
        for name, r in rates(n, fast, repeats).items():
            best[name] = max(best[name], r)
    return MatmulPeak(dtype, max(best.values()), best)


def probe_buffer(num_bytes: int, value: float = 1.0) -> torch.Tensor:
    """A float32 buffer of num_bytes for a bandwidth probe, written once, on huge pages where the host
    has them, as the engine's weights, KV pool and DRAM tier are (worker/huge_pages.py).

    On 4 KB pages a probe times page walks that the engine does not pay: on a 2-core Zen 4 EPYC, torch's
    sum read 24.9 GB/s there against 32.2 on huge pages, while the packed GEMM streamed a step's
    weights at one row at 30.4 (lockstep), so the memory bound was no bound."""
    from kvstrata.worker.huge_pages import empty_on_huge_pages

    return empty_on_huge_pages(num_bytes // 4, torch.float32).fill_(value)


def measure_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """(streaming read, copy read+write) bytes/s over buffers far larger than the caches."""
    x = probe_buffer(num_bytes)
    read = num_bytes / median_time(lambda: x.sum(), repeats)
    y = probe_buffer(num_bytes, 0.0)
    copy = 2 * num_bytes / median_time(lambda: y.copy_(x), repeats)
    return read, copy


def measure_peaks(dtypes: tuple[str, ...] = ("float32", "bfloat16"), matmul_sizes: tuple[int, ...] = (2048, 4096),
                  bandwidth_bytes: int = 512 << 20, repeats: int = 5) -> MachinePeaks:
    matmul = {d: measure_matmul(d, matmul_sizes, repeats) for d in dtypes}
    read, copy = measure_bandwidth(bandwidth_bytes, repeats)
    return MachinePeaks(matmul, read, copy)


class PeakProbe:
    """Short peak measurements taken between timed steps, so each step is judged against the machine
    as it was at that moment (a shared host's bandwidth drifts by half from minute to minute).

    One probe: a streaming read of `read_bytes` and one square matmul of `matmul_size` through
    `backend`, which should be the fastest one `measure_matmul` found ("torch.matmul", "onednn" or
    "packed"), so that the bound never rests on a slower path than the machine offers.
    """

    def __init__(self, dtype: str, backend: str = "torch.matmul", read_bytes: int = 256 << 20,
                 matmul_size: int = 2048):
        from kvstrata.worker.linear import select_linear

        td = DTYPES[dtype]
        self.dtype = dtype
        self._buf = probe_buffer(read_bytes)
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(matmul_size, matmul_size, generator=gen).to(td)
        b = torch.randn(matmul_size, matmul_size, generator=gen).to(td)
        if backend == "torch.matmul":
            self._matmul = lambda: torch.matmul(a, b)
        else:
            linear = select_linear(torch.device("cpu"), td, backend)
            w = linear.prepare(b)
            self._matmul = lambda: linear(a, w, None)
        self._flops = 2 * matmul_size**3

    def measure(self) -> MachinePeaks:
        read = self._buf.numel() * 4 / median_time(lambda: self._buf.sum(), repeats=1, warmup=0)
        flops = self._flops / median_time(self._matmul, repeats=1, warmup=0)
        return MachinePeaks({self.dtype: MatmulPeak(self.dtype, flops, {"probe": flops})}, read, read)


# -- work model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def bound_s(self, peaks: MachinePeaks, dtype: str) -> float:
        return max(self.flops / peaks.flops_per_s(dtype), self.bytes / peaks.read_bytes_per_s)

    def bound_kind(self, peaks: MachinePeaks, dtype: str) -> str:
        compute = self.flops / peaks.flops_per_s(dtype)
        return "compute" if compute >= self.bytes / peaks.read_bytes_per_s else "memory"


class ModelCost:
    """FLOPs and bytes of a Llama-family model's forward passes (norms, rope and sampling left out).

    One token through the decoder costs 2 * P FLOPs (P = projection weights), and attending to c keys
    adds 4 * L * H * D * c (scores and weighted values). A sampled token adds 2 * V * hidden for the
    LM head. A forward pass reads every weight once, and each sequence's c cached keys and values.
    """

    def __init__(self, config: ModelConfig, dtype: str, kv_dtype: str | None = None):
        c = config
        self.config = c
        self.elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
        kv_elem = torch.empty((), dtype=DTYPES[kv_dtype or dtype]).element_size()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # one layer's parameters in each projection (the fused q/k/v and gate/up as the engine packs them)
        self.layer_params = {"qkv": c.hidden_size * (q + 2 * kv), "o_proj": q * c.hidden_size,
                             "gate_up": 2 * c.hidden_size * c.intermediate_size,
                             "down": c.intermediate_size * c.hidden_size}
        self.projection_params = c.num_layers * sum(self.layer_params.values())
        self.head_params = c.vocab_size * c.hidden_size
        self.attention_flops_per_key = 4 * c.num_layers * c.num_heads * c.head_dim
        self.kv_bytes_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_elem

    @property
    def weight_bytes(self) -> int:
        return (self.projection_params + self.head_params) * self.elem

    def token_flops(self, num_tokens: int, num_keys: int, num_sampled: int) -> float:
        """num_tokens through the decoder attending to num_keys keys in total; num_sampled through the head."""
        return (2.0 * self.projection_params * num_tokens + self.attention_flops_per_key * num_keys
                + 2.0 * self.head_params * num_sampled)

    def decode_step(self, batch: int, context_len: float) -> Work:
        """One decode step of `batch` sequences, each attending to `context_len` keys (its new one included)."""
        flops = self.token_flops(batch, batch * context_len, batch)
        return Work(flops, self.weight_bytes + batch * context_len * self.kv_bytes_per_token)

    def workload(self, workload: Workload, block_size: int) -> Work:
        """The least work to serve `workload` with a perfect prefix cache of `block_size`-token blocks.

        Per request of n prompt tokens, h of them cache hits, and m output tokens:

            prefill:  tokens h .. n-1 are computed; token p attends to p + 1 keys
            decode:   m - 1 more tokens; the k-th attends to n + k keys
            head:     m sampled tokens

        Bytes: the longest request needs max(m) sequential passes, each reading all weights, and each
        decode token reads its whole context's KV.
        """
        hits = workload.prefix_stats(block_size).hit_tokens_per_request
        flops = 0.0
        kv_bytes = 0.0
        for req, h in zip(workload.requests, hits):
            n, m = len(req.prompt_token_ids), req.max_tokens
            prefill_keys = (n * (n + 1) - h * (h + 1)) // 2  # sum of p + 1 for p in h .. n-1
            decode_keys = (m - 1) * n + (m - 1) * m // 2  # sum of n + k for k in 1 .. m-1
            flops += self.token_flops((n - h) + (m - 1), prefill_keys + decode_keys, m)
            kv_bytes += decode_keys * self.kv_bytes_per_token
        passes = max((r.max_tokens for r in workload.requests), default=0)
        return Work(flops, passes * self.weight_bytes + kv_bytes)


# -- the engine's decode step -------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeStepResult:
    dtype: str
    batch: int
    context_len: int  # mean keys each sequence attends to in the median step
    step_s: float  # the timed step whose ratio is the median
    bound_s: float  # its bound, from the peak probes taken around it
    bound_kind: str  # "compute" or "memory"

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


def time_decode_steps(llm, batch: int, prompt_len: int, num_steps: int, seed: int = 0,
                      clock: Callable[[], float] = time.perf_counter,
                      between_steps: Callable[[], object] | None = None) -> list[tuple[float, int]]:
    """(seconds, keys attended in total) of `num_steps` engine steps with `batch` sequences all decoding.

    Every sequence gets its own random prompt (no prefix sharing). The sequences admitted first
    start decoding while later ones still prefill, so contexts differ by a few tokens; each step's
    total is measured, not assumed. `between_steps` runs (untimed) before every timed step.
    """
    import random

    from kvstrata.worker.sampling_params import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("time_decode_steps needs an idle engine")
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    ids = [f"roofline-{batch}-{i}" for i in range(batch)]
    # every prefill step computes a chunk of at least one prompt, so none finishes before the timed steps end
    budget = engine.scheduler.config.max_num_batched_tokens
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens_needed(batch, num_steps, prompt_len, budget),
                            ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(17, vocab) for _ in range(prompt_len)], params)
    try:
        running = engine.scheduler.running
        while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in running):
            engine.step()
        engine.step()  # warm-up decode step
        steps = []
        for _ in range(num_steps):
            if len(running) != batch or engine.scheduler.num_waiting:
                raise RuntimeError(f"expected {batch} sequences decoding, found {len(running)}; "
                                   f"the KV pool is too small for this batch")
            keys = sum(r.num_tokens for r in running)  # each attends to its tokens, the new one included
            if between_steps is not None:
                between_steps()
            t0 = clock()
            engine.step()
            steps.append((clock() - t0, keys))
    finally:
        for rid in ids:
            engine.abort(rid)
    return steps


def decode_tokens_needed(batch: int, num_steps: int, prompt_len: int = 1, step_tokens: int = 512) -> int:
    """max_tokens that keeps every sequence decoding through the prefill, warm-up and timed steps.

    Each step computes a chunk of at least one prompt, of up to `step_tokens` (the engine's step
    budget; 512, the smallest default, bounds the others from above), so the prompts take at most
    batch x ceil(prompt_len / step_tokens) steps, in which the first sequence may already decode."""
    return num_steps + batch * max(1, -(-prompt_len // step_tokens)) + 2


def bench_decode(llm, dtype: str, batches: tuple[int, ...], prompt_len: int, num_steps: int,
                 probe: PeakProbe) -> list[DecodeStepResult]:
    """Each timed step is paired with a peak probe taken just before it; the step's bound uses the
    better of that probe and the next one. The result is the step with the median ratio."""
    cost = ModelCost(llm.engine.config, dtype)
    results = []
    for b in batches:
        probes: list[MachinePeaks] = []
        steps = time_decode_steps(llm, b, prompt_len, num_steps, between_steps=lambda: probes.append(probe.measure()))
        probes.append(probe.measure())
        rows = []
        for i, (step_s, keys) in enumerate(steps):
            peaks = best_peaks(probes[i : i + 2], dtype)
            work = cost.decode_step(b, keys / b)
            rows.append((step_s / work.bound_s(peaks, dtype), step_s, keys, work.bound_s(peaks, dtype),
                         work.bound_kind(peaks, dtype)))
        rows.sort()
        _, step_s, keys, bound_s, kind = rows[len(rows) // 2]
        results.append(DecodeStepResult(dtype, b, round(keys / b), step_s, bound_s, kind))
    return results


def best_peaks(measured: list[MachinePeaks], dtype: str) -> MachinePeaks:
    """The best FLOP/s and bandwidth among several measurements of one machine (a bound must be a bound)."""
    flops = max(m.flops_per_s(dtype) for m in measured)
    read = max(m.read_bytes_per_s for m in measured)
    copy = max(m.copy_bytes_per_s for m in measured)
    return MachinePeaks({dtype: MatmulPeak(dtype, flops, {"best": flops})}, read, copy)
