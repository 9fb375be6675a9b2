"""Disk IO helpers of the NVMe tier: O_DIRECT support and aligned buffers, and a clock of the
time during which any IO was in flight (the tier's aggregate bandwidth)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from kvstrata.tiering.block_file import ALIGN, TEMP_SUFFIX

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux only; elsewhere every tier is buffered


class BusyClock:
    """Seconds during which at least one operation was in progress: the union of their intervals,
    so bytes / busy seconds is the rate of all the IO threads together, where bytes / summed
    seconds is the rate of one. `begin` and `end` return their stamps, so an operation's own
    duration comes from the same clock. The clock is injected for tests.

        op 1   |=======|
        op 2        |=========|          busy = t3 - t0 (one interval), summed = (t1-t0) + (t3-t2)
        op 3                       |==|  busy += t5 - t4
               t0   t2 t1     t3   t4 t5
    """

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._since = 0.0
        self._seconds = 0.0

    def begin(self) -> float:
        with self._lock:
            now = self._clock()
            if self._num_in_flight == 0:
                self._since = now
            self._num_in_flight += 1
            return now

    def end(self) -> float:
        with self._lock:
            now = self._clock()
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._seconds += now - self._since
            return now

    @property
    def seconds(self) -> float:
        """Busy seconds so far, counting an interval still open (a steady stream never goes idle)."""
        with self._lock:
            return self._seconds + (self._clock() - self._since if self._num_in_flight else 0.0)


def aligned_buffer(n: int) -> torch.Tensor:
    """n bytes starting at an ALIGN-aligned address, as O_DIRECT needs; views of it keep it alive."""
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)  # [n + ALIGN]
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + n]  # [n]


def supports_direct_io(directory: Path) -> bool:
    """Whether files in `directory` take O_DIRECT: some file systems refuse at the open, some only
    at the first write, so the probe does both with one aligned block, then removes its file."""
    if not O_DIRECT:
        return False
    path = directory / f".direct-io-probe{TEMP_SUFFIX}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        return os.write(fd, memoryview(aligned_buffer(ALIGN).numpy())) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        unlink(path)


def unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone, or not ours to remove (a directory): the index forgets it either way
        pass
