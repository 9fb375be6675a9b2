"""Which way a call of greedy rows goes, chosen by timing the calls themselves (worker/greedy_head.py).

A bf16 model's greedy head has three ways to its tokens, all with the same bits: the int8 copy with
x's few largest values past a byte, the int8 copy with every value of x at 16 bits, and the model's
own bf16 head with its argmax. Which is fastest depends on the rows as much as on the host: each
token the copy's bound leaves costs a group of the model's GEMM (or, where the head's rows are kept,
a row of the head: csrc/greedy_head.c), and how many it leaves goes with how sure the model is. On a 2-core Zen 4 EPYC, 32 rows with the caches flushed: rows of chat
answers took 4.3-5.0 ms through the first way (12-19 tokens left a row), 5.5-5.9 through the
second (5-7) and 5.1-5.8 through the model's head; the first decode steps after random 256-token
prompts 18.7-21.0 ms (385-399 left a row), 8.3-9.0 (71-73) and 5.3, and the same sequences a
dozen steps on 3.8-4.3 (6-12), 5.1-5.5 (2-3) and 5.0-5.2. A timing at load, on rows made up
there, cannot know which rows the engine will serve.

So the calls choose: calls are grouped by row count (1, 2-3, 4-7, ... 32-63, 64), and in each group
every way is first taken `samples` times; from then on a call takes the way whose last `samples`
calls had the least median time a row. The other ways are looked at again, one call at a time, so
that a change in the rows (a new workload) moves the choice: each first `explore_every` calls after
the group's choice last changed (the others staggered), then after twice as many calls each time
it stays the slower, up to `explore_every` * MAX_BACKOFF. A look at a way 4x slower costs a call
that much; with looks backing off, a steady workload pays for few of them (fixed looks every 64
calls had cost the random-token workload 1.4% of its wall).
"""

from __future__ import annotations

import time
from collections import deque
from statistics import median
from typing import Callable

MAX_BACKOFF = 16  # the longest gap between looks at a way: explore_every times this


class HeadChoice:
    def __init__(self, ways: tuple[str, ...], samples: int = 3, explore_every: int = 64,
                 clock: Callable[[], float] = time.perf_counter):
        if not ways or len(set(ways)) != len(ways):
            raise ValueError("HeadChoice needs distinct ways")
        if samples < 1 or explore_every < 2:
            raise ValueError("HeadChoice needs samples >= 1 and explore_every >= 2")
        self.ways = ways
        self.samples = samples
        self.explore_every = explore_every
        self.clock = clock  # what the caller times its calls with
        self._times: dict[tuple[int, str], deque[float]] = {}  # (group, way) -> the last seconds a row
        self._calls: dict[int, int] = {}  # group -> calls chosen so far
        self._chosen: dict[int, str] = {}  # group -> the way its calls took last
        self._look: dict[tuple[int, str], tuple[int, int]] = {}  # (group, way) -> (next look's call, gap)
        self.taken = {way: 0 for way in ways}  # calls each way took (for tests and benchmarks)

    @staticmethod
    def group(rows: int) -> int:
        """The group of a call of `rows` rows: rows' bit length (1, 2-3, 4-7, ...)."""
        if rows < 1:
            raise ValueError(f"rows must be at least 1, not {rows}")
        return rows.bit_length()

    def pick(self, rows: int) -> str:
        """The way a call of `rows` rows takes; `record` its time after."""
        g = self.group(rows)
        calls = self._calls[g] = self._calls.get(g, 0) + 1
        way = self._unsampled(g)
        if way is None:
            way = self.best(rows)
            if self._chosen.get(g) != way:  # a new choice: every other way looked at again soon
                self._chosen[g] = way
                others = [w for w in self.ways if w != way]
                for i, w in enumerate(others):
                    self._look[(g, w)] = (calls + self.explore_every * (i + 1), self.explore_every)
            for w in self.ways:
                due, gap = self._look.get((g, w), (0, 0))
                if w != way and gap and calls >= due:
                    gap = min(2 * gap, self.explore_every * MAX_BACKOFF)
                    self._look[(g, w)] = (calls + gap, gap)
                    way = w
                    break
        self.taken[way] += 1
        return way

    def record(self, rows: int, way: str, seconds: float) -> None:
        """A call of `rows` rows took `seconds` the way `pick` gave."""
        if way not in self.ways:
            raise ValueError(f"no way {way!r}: {self.ways}")
        key = (self.group(rows), way)
        times = self._times.get(key)
        if times is None:
            times = self._times[key] = deque(maxlen=self.samples)
        times.append(seconds / rows)

    def best(self, rows: int) -> str:
        """The way with the least median time a row among the group's sampled ways (the first way while
        none is sampled)."""
        g = self.group(rows)
        sampled = [(median(self._times[(g, w)]), i) for i, w in enumerate(self.ways) if (g, w) in self._times]
        return self.ways[min(sampled)[1]] if sampled else self.ways[0]

    def _unsampled(self, g: int) -> str | None:
        """The first way with fewer than `samples` times in group g, if any."""
        for way in self.ways:
            times = self._times.get((g, way))
            if times is None or len(times) < self.samples:
                return way
        return None
