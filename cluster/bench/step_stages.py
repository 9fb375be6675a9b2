"""Where a decode step's time goes: each stage of the engine's fused C layers, timed inside the
engine's own steps (csrc/layer.c's stage timers), the LM head (the final norm, the head's product and,
for greedy rows, the argmax the greedy head fuses with it), and the rest of the step (sampling,
scheduling, Python) as the step's wall time less those.

    step = qkv + rope_kv + decode_attention + o_proj + norms + gate_up + silu + down + convert
           + lm_head + rest

The projections and the decode attention also get the rate at which they moved the bytes they
must read (their weights; the K/V of every key attended), to set beside the machine's measured
read bandwidth: a stage well below it waits on something other than memory.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

from kvstrata.cluster.bench.roofline import ModelCost, time_decode_steps
from kvstrata.worker.cpu_kernels import LAYER_STAGES

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@dataclass(frozen=True)
class StageProfile:
    dtype: str
    batch: int
    context_len: int  # mean keys each sequence attends to
    step_ms: float  # mean of the timed steps
    stage_ms: dict[str, float]  # mean a step, LAYER_STAGES order
    stage_bytes: dict[str, float]  # bytes the stage must read a step (projections, decode attention)
    lm_head_ms: float = 0.0  # mean a step: the final norm, the head, a greedy head's argmax

    @property
    def layers_ms(self) -> float:
        return sum(self.stage_ms.values())

    @property
    def rest_ms(self) -> float:
        """The step outside the layers and the head: sampling, scheduling, Python."""
        return self.step_ms - self.layers_ms - self.lm_head_ms

    def gb_per_s(self, stage: str) -> float | None:
        ms = self.stage_ms[stage]
        return self.stage_bytes[stage] / ms / 1e6 if stage in self.stage_bytes and ms > 0 else None

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "batch": self.batch, "context_len": self.context_len,
                "step_ms": round(self.step_ms, 3), "lm_head_ms": round(self.lm_head_ms, 3),
                "rest_ms": round(self.rest_ms, 3),
                "stage_ms": {k: round(v, 3) for k, v in self.stage_ms.items()},
                "gb_per_s": {k: round(self.gb_per_s(k), 2) for k in self.stage_bytes if self.gb_per_s(k)}}


def stage_bytes(cost: ModelCost, keys: float) -> dict[str, float]:
    """Bytes each projection's weights and the decode attention's K/V take a step, `keys` attended in all."""
    out = {name: float(cost.config.num_layers * n * cost.elem) for name, n in cost.layer_params.items()}
    out["decode_attention"] = keys * cost.kv_bytes_per_token
    return out


class StageClock:
    """While entered: the fused layers' stage timers on (CpuKernels.time_layer_stages) and the model's
    two ways to the head (ModelRunner.execute calls one or both a step) timed by wrappers set on the
    model instance, removed on exit. `read()` gives the running totals in seconds, in NAMES order.
    ValueError where the engine's steps do not run through the fused C layers (no CPU kernels, a
    GPU): there is nothing to time. One clock at a time in a process."""

    NAMES = (*LAYER_STAGES, "lm_head")
    _HEAD_CALLS = ("greedy_tokens", "compute_logits")

    def __init__(self, llm):
        self._kernels, self._model = llm.engine.runner.cpu_kernels, llm.engine.runner.model
        if self._kernels is None or getattr(self._model, "fused_decode", None) is None:
            raise ValueError("stage timing needs the fused CPU layers (csrc/layer.c), which this engine does not run")
        self._seconds = (ctypes.c_double * len(LAYER_STAGES))()
        self._head = 0.0

    def read(self) -> list[float]:
        return [*self._seconds[:], self._head]

    def __enter__(self) -> StageClock:
        for name in self._HEAD_CALLS:
            setattr(self._model, name, self._timed(getattr(self._model, name)))
        self._kernels.time_layer_stages(self._seconds)
        return self

    def __exit__(self, *exc) -> None:
        self._kernels.time_layer_stages(None)
        for name in self._HEAD_CALLS:
            delattr(self._model, name)

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._head += time.perf_counter() - t0
        return call


def profile_decode_stages(llm, dtype: str, batch: int, prompt_len: int, num_steps: int) -> StageProfile:
    """`num_steps` decode steps of `batch` sequences (roofline.time_decode_steps), each stage of their
    layers timed (StageClock, whose ValueError it passes on)."""
    marks: list[list[float]] = []
    with StageClock(llm) as clock:
        steps = time_decode_steps(llm, batch, prompt_len, num_steps, between_steps=lambda: marks.append(clock.read()))
        marks.append(clock.read())
    *stage_s, head_s = (b - a for a, b in zip(marks[0], marks[-1]))
    if not any(stage_s):
        raise ValueError("the timed steps did not run through the fused CPU layers; nothing was timed")
    n = len(steps)
    keys = sum(k for _, k in steps) / n
    return StageProfile(dtype, batch, round(keys / batch), 1e3 * sum(s for s, _ in steps) / n,
                        {name: 1e3 * s / n for name, s in zip(LAYER_STAGES, stage_s)},
                        stage_bytes(ModelCost(llm.engine.config, dtype), keys), 1e3 * head_s / n)


def format_profiles(profiles: list[StageProfile]) -> list[str]:
    """A table of ms a step per stage (stages that took no time left out), then the streaming rates."""
    if not profiles:
        return []
    shown = [s for s in LAYER_STAGES if any(p.stage_ms[s] > 0 for p in profiles)]
    head = f"{'dtype':<10}{'batch':>6}{'step':>8}" + "".join(f"{s:>{max(8, len(s) + 1)}}" for s in shown)
    lines = [head + f"{'lm_head':>8}{'rest':>8}"]
    for p in profiles:
        row = f"{p.dtype:<10}{p.batch:>6}{p.step_ms:>8.2f}"
        row += "".join(f"{p.stage_ms[s]:>{max(8, len(s) + 1)}.2f}" for s in shown)
        lines.append(row + f"{p.lm_head_ms:>8.2f}{p.rest_ms:>8.2f}")
    lines.append("GB/s of the bytes each stage must read (weights; the K/V of every key attended):")
    for p in profiles:
        rates = ", ".join(f"{s} {p.gb_per_s(s):.1f}" for s in (*PROJECTIONS, "decode_attention") if p.gb_per_s(s))
        products_ms = sum(p.stage_ms[s] for s in PROJECTIONS)
        weights = sum(p.stage_bytes[s] for s in PROJECTIONS)
        lines.append(f"  {p.dtype} batch {p.batch}: {rates}; all products {weights / products_ms / 1e6:.1f}")
    return lines
