"""The packed GEMM's host-dependent options, chosen once per process by timing them on the model's
own weights (CpuKernels inherits these): where the weight prefetch starts, float32 tiles in turns,
one row two groups at a time, a widened copy of bf16 groups, and how a prompt chunk's row blocks
share panels. Each has an environment variable that sets it without timing, and none changes a
result: only when bytes arrive, or the order of the same tiles.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvstrata.worker.cpu_kernels import PackedWeight

log = logging.getLogger(__name__)


def switch_env(name: str) -> bool | None:
    """An on/off environment variable: None where unset, else 0 or 1 (anything else is an error naming it)."""
    value = os.environ.get(name)
    if value is not None and value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, not {value!r}")
    return None if value is None else value == "1"


def stream_env() -> int | None:
    """KVSTRATA_DECODE_STREAM_KB: how far ahead (KiB, 1 to 1024) decode attention streams float32
    rows; None where unset (the kernel's own choice), anything else an error naming it."""
    value = os.environ.get("KVSTRATA_DECODE_STREAM_KB")
    if value is None:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 1024:
        raise ValueError(f"KVSTRATA_DECODE_STREAM_KB must be a whole number of KiB from 1 to 1024, not {value!r}")
    return int(value)


def copy_threshold(gain4: float, gain8: float) -> int | None:
    """The fewest row tiles from which widened bf16 blocks should multiply a float32 copy, given what
    the copy saved a pass at 4 tiles (gain4, <= 0: it lost there) and at 8 (gain8): None where it did
    not win at 8 either, else the tile count (5 to 8) where the line through the two gains crosses
    zero, rounded up."""
    if gain8 <= 0:
        return None
    cross = 4 + 4 * -gain4 / (gain8 - gain4)
    return min(8, max(5, math.ceil(cross)))


class GemmTuning:
    """The timed choices, for a class that has the kernels' `_lib`, `gemm_group`, `amx`, `bf16_dot`,
    `gemm` and `gemm_silu` (CpuKernels). Each choice is None until made, then kept."""

    prefetch_rows: int | None = None  # set by tune_prefetch (the C default, 6, until then)
    turns: bool | None = None  # set by tune_turns (the C default, on with AVX-512, until then)
    two_groups: bool | None = None  # set by tune_two_groups (the C default, on where built, until then)
    wide_copy: bool | None = None  # set by tune_wide_copy (the C default, on, until then)
    wide_copy_tiles: int | None = None  # the fewest row tiles a block copies for, where wide_copy is on
    short_panels: bool | None = None  # set by tune_short_panels (the C default, off, until then)

    def tune_prefetch(self, weights: list[PackedWeight], rounds: int = 5) -> int:
        """The fewest rows from which the packed GEMM prefetches its weights, 2 or 6, chosen once per
        process by timing a pass over `weights` (a model's projections, larger than the caches) at
        4 rows both ways, alternating: the faster median wins (see csrc/gemm.c: it depends on the
        host). KVSTRATA_GEMM_PREFETCH_ROWS sets it without timing. Same results either way:
        prefetches change when bytes arrive, not the sums."""
        if self.prefetch_rows is not None:
            return self.prefetch_rows
        env = os.environ.get("KVSTRATA_GEMM_PREFETCH_ROWS")
        if env is not None:
            if not env.isdigit() or int(env) < 2:
                raise ValueError(f"KVSTRATA_GEMM_PREFETCH_ROWS must be an integer >= 2, not {env!r}")
            chosen = int(env)
        elif not weights:
            chosen = 6
        else:
            t = self._time_passes(weights, 4, self._lib.kvs_gemm_set_prefetch_rows, (2, 6), rounds)
            chosen = 2 if t[2] < t[6] else 6
            log.info("packed GEMM at 4 rows: %.1f ms prefetching, %.1f ms without; prefetching from %d rows",
                     t[2] * 1e3, t[6] * 1e3, chosen)
        self._lib.kvs_gemm_set_prefetch_rows(chosen)
        self.prefetch_rows = chosen
        return chosen

    def tune_turns(self, weights: list[PackedWeight], rounds: int = 5) -> bool:
        """Whether float32 blocks of 2-4 row tiles take turns on each group (csrc/gemm.c's TURN_K),
        chosen once per process by timing a pass over `weights` (a model's float32 projections,
        larger than the caches) at 16 rows both ways, alternating: the faster median wins. It depends
        on the host: on a 2-core Xeon with AMX, turns made such products 1.08-1.18x faster at 12-24
        rows; on a 2-core Zen 4 EPYC, whole decode steps at 16-32 rows 1.10-1.19x slower. Builds
        without AVX-512 keep them off without timing (on a Zen 3 EPYC with AVX2, steps of 12 and 16
        sequences 1.19x and 1.42x slower with them). KVSTRATA_GEMM_TURNS=0 or 1 sets it without
        timing. Same results either way: the same multiply-adds in the same order."""
        if self.turns is not None:
            return self.turns
        applies = self.gemm_group == 48 and bool(weights) and weights[0].data.dtype == torch.float32
        chosen = self._timed_switch("KVSTRATA_GEMM_TURNS", applies, weights, 16, self._lib.kvs_gemm_set_turns,
                                    "in turns", rounds)
        self._lib.kvs_gemm_set_turns(int(chosen))
        self.turns = chosen
        return chosen

    def tune_two_groups(self, weights: list[PackedWeight], rounds: int = 5) -> bool:
        """Whether one row (a decode step at batch 1) against float32 or widened bf16 weights takes two
        packed groups at a time in an AVX2 build (csrc/gemm.c's gemv_*_two_groups: six sums a step
        instead of three; for bf16, 256-bit unpacks instead of 128-bit halves), chosen once per process
        by timing a pass over `weights` (a model's projections) at one row both ways, alternating. On
        a 2-core Zen 3 EPYC two groups read a SmolLM2 step's weights from memory 1.13-1.15x faster in
        bf16 and 1.02-1.19x in float32 (more while the memory is fast), and four layers' from cache
        1.3-1.5x; the bf16 halves were written for cores with 128-bit vector units (Zen 1), where two
        groups are not measured. Builds without the path (AVX-512, or no AVX2), and bf16 weights on
        AMX tiles or dot products, keep it off without timing. KVSTRATA_GEMM_TWO_GROUPS=0 or 1 sets
        it without timing. Same results either way: each column's sum is the same chain of
        multiply-adds."""
        if self.two_groups is not None:
            return self.two_groups
        applies = (bool(self._lib.kvs_gemm_set_two_groups(1)) and bool(weights)
                   and not (weights[0].data.dtype == torch.bfloat16 and (self.amx or self.bf16_dot)))
        chosen = self._timed_switch("KVSTRATA_GEMM_TWO_GROUPS", applies, weights, 1,
                                    self._lib.kvs_gemm_set_two_groups, "two groups at a time", rounds)
        self.two_groups = bool(self._lib.kvs_gemm_set_two_groups(int(chosen)))
        return self.two_groups

    def tune_wide_copy(self, weights: list[PackedWeight], rounds: int = 5, joined: list[PackedWeight] = ()) -> bool:
        """Whether blocks of 4 row tiles or more against widened bf16 weights (no AMX tiles or bf16
        dot products) multiply a float32 copy of each group, widened once per block (csrc/gemm.c's
        WIDE_MIN_TILES), or widen the weights in every tile, chosen once per process by timing a
        pass over `weights` (a model's bf16 projections) at 4 tiles' rows both ways, alternating.
        The copy paid on a Zen 1 EPYC (128-bit vector units: 1.08-1.20x at 16-64 rows); on a Zen 3
        EPYC, whose AVX2 tiles widen with unpacks, it cost 1.19-1.23x at 16 rows. float32 weights
        and bf16 on tiles or dot products keep it as it is without timing.
        KVSTRATA_GEMM_WIDE_COPY=0 or 1 sets it without timing. Same results either way: the same
        multiply-adds of the same values in the same order. joined: those of `weights` that the model
        multiplies with its SiLU in the same pass (gate_up), timed so (gemm_silu): on a 2-core Zen 4
        EPYC without AVX-512, plain products at 16 rows ran even both ways, while batch-32 bf16 steps
        with the joined pass took 84.3 ms with the copy and 81.0 without.

        The copy's cost is a block's and its gain a tile's, so where it loses at 4 tiles a pass at 8
        tiles is timed too; if it wins there, blocks take it from the tile count where the two gains,
        drawn as a line, cross zero (5 to 8 tiles; wide_copy_tiles). On a 2-core Zen 2 EPYC it ran
        even at 16 rows (AVX2: 4 tiles) and 1.06-1.20x faster at 20-64 rows, where the timing at 16
        rows alone had turned it off for all. Set by the variable, or won at 4 tiles: from 4."""
        if self.wide_copy is not None:
            return self.wide_copy
        env = "KVSTRATA_GEMM_WIDE_COPY"
        applies = bool(weights) and weights[0].data.dtype == torch.bfloat16 and not (self.amx or self.bf16_dot)
        tiles, value = 4, switch_env(env)
        if value is not None or not applies:
            chosen = True if value is None else value  # untimed: as set, or the C default
        else:
            tile_rows = 8 if self.gemm_group == 48 else 4
            set_copy = self._lib.kvs_gemm_set_wide_copy
            self._lib.kvs_gemm_set_wide_min_tiles(4)
            t4 = self._time_passes(weights, 4 * tile_rows, set_copy, (1, 0), rounds, joined)
            chosen = t4[1] < t4[0]
            t8 = None
            if not chosen:
                t8 = self._time_passes(weights, 8 * tile_rows, set_copy, (1, 0), rounds, joined)
                tiles = copy_threshold(t4[0] - t4[1], t8[0] - t8[1])
                chosen = tiles is not None
            log.info("packed GEMM, widened bf16 at %d rows: %.1f ms with a float32 copy, %.1f ms without%s; %s",
                     4 * tile_rows, t4[1] * 1e3, t4[0] * 1e3,
                     "" if t8 is None else f"; at {8 * tile_rows} rows {t8[1] * 1e3:.1f} against {t8[0] * 1e3:.1f}",
                     f"on from {tiles} tiles" if chosen else "off")
        self.wide_copy = bool(self._lib.kvs_gemm_set_wide_copy(int(chosen)))
        self._lib.kvs_gemm_set_wide_min_tiles(tiles or 4)
        self.wide_copy_tiles = tiles if self.wide_copy else None
        return self.wide_copy

    def tune_short_panels(self, weights: list[PackedWeight], rounds: int = 3, joined: list[PackedWeight] = ()) -> bool:
        """Whether only a short last block of rows (32 or fewer) shares a panel, with the block before
        it, while the other blocks run block by block (csrc/gemm.c's tasks), or the row blocks of a
        prompt chunk share panels of as many as half the L2 holds, chosen once per process by timing
        a pass over the first eight of `weights` (a model's projections) at 256 rows both ways,
        alternating. On a 2-core Xeon with AMX the panels made prompt chunks' float32 products
        1.05-1.13x faster; on a 2-core Zen 4 EPYC without AVX-512 they ran 1.08-1.17x slower from 196
        to 512 rows, and only a short last block gained from them (1.13-1.52x at 66-130 rows). bf16
        weights on AMX tiles (which do not run these tasks) keep the panels without timing.
        KVSTRATA_GEMM_SHORT_PANELS=0 or 1 sets it without timing. Same results either way: the same
        tiles in another order. joined: as for tune_wide_copy (a model's gate_up, timed with its SiLU)."""
        if self.short_panels is not None:
            return self.short_panels
        applies = bool(weights) and not (weights[0].data.dtype == torch.bfloat16 and self.amx)
        chosen = self._timed_switch("KVSTRATA_GEMM_SHORT_PANELS", applies, weights[:8], 256,
                                    lambda on: self._lib.kvs_gemm_set_row_panels(2 if on else 1),
                                    "with panels for a short last block only", rounds, joined)
        self._lib.kvs_gemm_set_row_panels(2 if chosen else 1)
        self.short_panels = chosen
        return chosen

    def _timed_switch(self, env: str, applies: bool, weights: list[PackedWeight], rows: int, set_option,
                      what: str, rounds: int, joined: list[PackedWeight] = ()) -> bool:
        """An on/off choice of the packed GEMM: `env` (0 or 1) where set, else off where it does not
        apply, else whichever way a pass over `weights` at `rows` rows ran faster (_time_passes)."""
        value = switch_env(env)
        if value is not None:
            return value
        if not applies:
            return False
        t = self._time_passes(weights, rows, set_option, (1, 0), rounds, joined)
        chosen = t[1] < t[0]
        log.info("packed GEMM at %d rows: %.1f ms %s, %.1f ms without; %s", rows, t[1] * 1e3, what, t[0] * 1e3,
                 "on" if chosen else "off")
        return chosen

    def _time_passes(self, weights: list[PackedWeight], rows: int, set_option, options: tuple[int, int],
                     rounds: int, joined: list[PackedWeight] = ()) -> dict[int, float]:
        """Median seconds of a pass over `weights` at `rows` rows under each of two options, set
        through `set_option`, alternating so that both see the host alike; the first round only brings
        everything to the same state. Those in `joined` go through gemm_silu, as a model's gate_up."""
        import time

        k = max(w.k for w in weights)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(weights[0].data.dtype)
        xs = [x[:, : w.k].contiguous() for w in weights]
        with_silu = [any(w is j for j in joined) for w in weights]
        times: dict[int, list[float]] = {o: [] for o in options}
        for r in range(rounds + 1):
            for option in (options if r % 2 else options[::-1]):
                set_option(option)
                t0 = time.perf_counter()
                for xi, w, silu in zip(xs, weights, with_silu):
                    self.gemm_silu(xi, w) if silu else self.gemm(xi, w, None)
                if r:
                    times[option].append(time.perf_counter() - t0)
        return {o: sorted(ts)[len(ts) // 2] for o, ts in times.items()}
