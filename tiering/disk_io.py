"""Disk IO helpers of the NVMe tier: O_DIRECT support and aligned buffers, and a clock of the
time during which any IO was in flight (the tier's aggregate bandwidth)."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import threading
import time
from pathlib import Path

import torch

from kvstrata.tiering.block_file import ALIGN, TEMP_SUFFIX, round_up
from kvstrata.worker.huge_pages import HUGE_PAGE, empty_on_huge_pages, huge_pages_available

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


IO_SLICE_US = 100  # the scheduler slice the IO threads ask for; the kernel's shortest
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # syscall numbers


def io_slice_us() -> int:
    """KVSTRATA_NVME_IO_SLICE_US: the slice, in microseconds, that the NVMe tier's IO threads ask
    for (100 to 100000), or 0 to ask for none; IO_SLICE_US when unset."""
    env = os.environ.get("KVSTRATA_NVME_IO_SLICE_US")
    if env is None:
        return IO_SLICE_US
    if not env.isdigit() or not (int(env) == 0 or 100 <= int(env) <= 100_000):
        raise ValueError(f"KVSTRATA_NVME_IO_SLICE_US must be 0 or 100 to 100000, got {env!r}")
    return int(env)


def read_run_bytes() -> int | None:
    """KVSTRATA_NVME_READ_RUN_KB: the most one load's preadv on the C IO threads moves, in KiB
    (4 to 65536), fixed instead of chosen by the loads' rates (run_sizes.py); None when unset."""
    env = os.environ.get("KVSTRATA_NVME_READ_RUN_KB")
    if env is None:
        return None
    if not env.isdigit() or not 4 <= int(env) <= 65536:
        raise ValueError(f"KVSTRATA_NVME_READ_RUN_KB must be 4 to 65536, got {env!r}")
    return int(env) << 10


def request_short_slice(slice_us: int) -> bool:
    """Ask the scheduler for a short time slice for the calling thread (only it): sched_setattr with
    SCHED_OTHER, the thread's own nice value, and sched_runtime = the slice. No privilege is needed.

    An IO thread sleeps in the disk nearly all the time, then needs a core for a moment to finish
    the IO and start the next. Linux's EEVDF scheduler (6.6 on) lets a running thread finish its
    slice (1.4 ms on the 2-core VM measured) before a woken one of equal weight takes the core,
    unless the woken one asked for a shorter slice (6.12 on): with both cores in a forward pass, a
    write the disk had finished stayed in flight for milliseconds. Kernels that do not know the
    request, or systems without the call, leave the thread as it was: False then.
    """
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return False
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux, the calling thread's
        attr = ctypes.create_string_buffer(struct.pack("=IIQiIQQQ", 48, 0, 0, nice, 0, slice_us * 1000, 0, 0))
        return ctypes.CDLL(None, use_errno=True).syscall(number, 0, attr, 0) == 0
    except (OSError, AttributeError):
        return False


def io_buffer(n: int) -> torch.Tensor:
    """n bytes for O_DIRECT IO, ALIGN-aligned, on transparent huge pages where the host gives them
    (the mapping rounded up to whole 2 MB pages), else aligned_buffer(n).

    With O_DIRECT the disk moves bytes straight from or into the buffer, whose pages the kernel
    pins and lists one by one: a 0.74 MB buffer on 4 KB pages is 181 pieces, on a huge page one
    or two. On a 2-core VM with a virtual NVMe disk, reads of 0.74 MB blocks from four threads went
    from 1.23 to 3.21 GB/s and writes from 3.62 to 5.68 GB/s (medians of five rounds, both
    alternating), sequential 8 MB IO from 1.08 to 2.96 GB/s (reads) and 2.51 to 6.20 GB/s (writes),
    and each IO's CPU time fell by about half."""
    if n >= 0 and huge_pages_available():
        buf = empty_on_huge_pages(round_up(max(n, 1), HUGE_PAGE), torch.uint8)[:n]
        if buf.data_ptr() % ALIGN == 0:
            return buf
    return aligned_buffer(n)


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
