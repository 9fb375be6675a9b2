"""How many adjacent slots one of the NVMe tier's load reads may take, chosen from the loads' own rates.

Disks differ in the read size they serve best. Measured with `kvstrata bench tiering` (the chat's
loads against one thread's sequential 8 MB `O_DIRECT` reads of the same bytes, docs/benchmarks.md):
a 2-core Xeon's virtual disk read 0.86-0.90 of the reference in 1 MB runs and 0.77-0.84 in 4 MB
runs, while a Zen 4 EPYC's faster disk read 0.57-0.62 in 1 MB runs and 0.69-0.75 in 4 MB runs. No
one size suits both, and a probe at start-up would measure the disk alone, not the loads as they
run beside forward passes on the same cores. So the tier tries each candidate on its own loads:

    bursts:  1 MB, 4 MB, 1 MB, 4 MB, ...  (until each size has MIN_SAMPLES timed bursts)
             then the faster size, and every EXPLORE_EVERY-th burst the other one, so that a
             disk whose behaviour changes is followed
    rate:    a size's bytes over its seconds, summed over its last WINDOW bursts

A burst is timed from its submission to the end of its last run's check, the clock the tier's read
rate is judged on. Only bursts in which the candidates would cut different runs are timed (a burst
no larger than the IO threads reads one slot a run whatever the size). The choice changes which
preadv reads a slot, never what is read, so it cannot change a block's bytes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 4  # timed bursts of each size before the faster one is taken
EXPLORE_EVERY = 8  # of the timed bursts after that, one in this many tries a size other than the faster
WINDOW = 16  # a size's rate is over its last this many timed bursts


@dataclass
class _Size:
    slots: int
    tried: int = 0  # timed bursts picked with this size (their records may still be on their way)
    explored_at: int = 0  # the pick that last took this size although another was faster
    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (bytes, seconds)

    def rate(self) -> float:
        seconds = sum(s for _, s in self.samples)
        return sum(b for b, _ in self.samples) / seconds if seconds > 0 else 0.0


class RunSizeChooser:
    """pick() the slots a run may take for the next timed burst, then record() how it went; best()
    where a burst is not timed. Thread-safe: bursts are picked on the caller's thread and recorded
    on the IO pool's reaper."""

    def __init__(self, candidates: list[int]):
        slots = sorted(set(candidates))
        if not slots or slots[0] < 1:
            raise ValueError(f"run sizes must be positive slot counts, got {candidates!r}")
        self._sizes = [_Size(n) for n in slots]
        self._lock = threading.Lock()
        self._picked = 0  # timed bursts picked since every size had MIN_SAMPLES

    @property
    def candidates(self) -> list[int]:
        return [s.slots for s in self._sizes]

    def best(self) -> int:
        """The size with the highest rate so far (the smallest among equals, and before any timing)."""
        with self._lock:
            return self._best().slots

    def pick(self) -> int:
        with self._lock:
            fewest = min(self._sizes, key=lambda s: s.tried)
            if fewest.tried < MIN_SAMPLES:
                chosen = fewest
            else:
                self._picked += 1
                chosen = self._best()
                if len(self._sizes) > 1 and self._picked % EXPLORE_EVERY == 0:  # the other size tried longest ago
                    chosen = min((s for s in self._sizes if s is not chosen), key=lambda s: s.explored_at)
                    chosen.explored_at = self._picked
            chosen.tried += 1
            return chosen.slots

    def record(self, slots: int, num_bytes: int, seconds: float) -> None:
        """A timed burst of `slots` read num_bytes in `seconds` (ignored when nothing was read)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            for size in self._sizes:
                if size.slots == slots:
                    size.samples.append((num_bytes, seconds))
                    return
        raise ValueError(f"{slots} is not one of the run sizes {self.candidates}")

    def stats(self) -> dict:
        """The size loads take now, and each size's rate in GB/s with how many bursts it rests on."""
        with self._lock:
            return {"read_run_slots": self._best().slots,
                    "read_run_rates": [{"slots": s.slots, "gb_per_s": round(s.rate() / 1e9, 3),
                                        "bursts": len(s.samples)} for s in self._sizes]}

    def _best(self) -> _Size:
        if any(not s.samples for s in self._sizes):
            return self._sizes[0]
        return max(self._sizes, key=lambda s: (s.rate(), -s.slots))
