"""Reference bandwidths for `kvstrata bench tiering`: a memcpy, and sequential file IO in the NVMe
tier's directory (buffered, with fsync, cold and warm reads, and O_DIRECT where the filesystem has it)."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_FILE = ".kvstrata-disk-probe"
MB = 1 << 20


@dataclass(frozen=True, slots=True)
class DiskRates:
    """Sequential bytes/s of one thread on a file in the NVMe directory."""

    write: float  # buffered writes, no fsync
    write_fsync: float  # the same plus fsync: the disk itself
    read_cold: float  # after dropping the file from the page cache
    read_warm: float  # the same file again, from the page cache
    write_direct: float | None = None  # O_DIRECT, past the page cache (None: the filesystem has none)
    read_direct: float | None = None


@dataclass(frozen=True, slots=True)
class References:
    memcpy: float  # bytes copied per second by torch (which may use every core)
    disk: DiskRates

    def to_json(self) -> dict[str, float | None]:
        disk = {f"disk_{k}": _round(v and v / 1e9, 3) for k, v in asdict(self.disk).items()}
        return {"memcpy": round(self.memcpy / 1e9, 3), **disk}


def measure_memcpy(num_bytes: int) -> float:
    from kvstrata.cluster.bench.roofline import measure_bandwidth

    _, copy = measure_bandwidth(num_bytes, repeats=3)
    return copy / 2  # measure_bandwidth counts read + write; a transfer counts its bytes once


def measure_disk(directory: Path, num_bytes: int, chunk: int = 8 * MB,
                 clock: Callable[[], float] = time.perf_counter) -> DiskRates:
    """Write a file of num_bytes in large buffered writes, fsync it, drop it from the page cache, and
    read it twice (from disk, then from the page cache)."""
    chunk = min(chunk, num_bytes)
    n = max(1, num_bytes // chunk)
    data = os.urandom(chunk)
    path = directory / PROBE_FILE
    try:
        with open(path, "wb") as f:
            t0 = clock()
            f.writelines(data for _ in range(n))
            f.flush()
            t1 = clock()
            os.fsync(f.fileno())
            t2 = clock()
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        reads = []
        buf = bytearray(chunk)
        for _ in range(2):
            with open(path, "rb", buffering=0) as f:
                t = clock()
                while f.readinto(buf):
                    pass
                reads.append(clock() - t)
    finally:
        path.unlink(missing_ok=True)
    total = n * chunk
    direct = measure_direct(directory, n, chunk, clock)
    return DiskRates(total / (t1 - t0), total / (t2 - t0), total / reads[0], total / reads[1], *direct)


def measure_direct(directory: Path, n: int, chunk: int,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float | None, float | None]:
    """(write, read) bytes/s of n sequential O_DIRECT chunks, from and into an aligned buffer on huge
    pages where the host gives them, as the NVMe tier's own (disk_io.io_buffer); Nones where the
    filesystem refuses O_DIRECT."""
    import torch

    from kvstrata.tiering.disk_io import io_buffer

    chunk = max(mmap.PAGESIZE, chunk // mmap.PAGESIZE * mmap.PAGESIZE)
    data = io_buffer(chunk)
    data.copy_(torch.frombuffer(bytearray(os.urandom(chunk)), dtype=torch.uint8))
    buf = memoryview(data.numpy())
    path = directory / PROBE_FILE
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except (OSError, AttributeError):
            return None, None
        try:
            t0 = clock()
            for i in range(n):
                os.pwritev(fd, [buf], i * chunk)
            t1 = clock()
            for i in range(n):
                os.preadv(fd, [buf], i * chunk)
            t2 = clock()
        except OSError:  # EINVAL on the first IO: open accepted the flag, the filesystem does not
            return None, None
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
        buf.release()
    return n * chunk / (t1 - t0), n * chunk / (t2 - t1)


def measure_references(directory: Path, memcpy_bytes: int, disk_bytes: int, repeats: int = 3) -> References:
    """The best of `repeats` disk probes, figure by figure: this VM's disk swings by 10x between runs,
    and a reference must not be flattered by one slow moment."""
    probes = [measure_disk(directory, disk_bytes) for _ in range(repeats)]

    def best(k: str) -> float | None:
        xs = [getattr(p, k) for p in probes if getattr(p, k) is not None]
        return max(xs) if xs else None

    return References(measure_memcpy(memcpy_bytes), DiskRates(*(best(k) for k in DiskRates.__slots__)))


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)
