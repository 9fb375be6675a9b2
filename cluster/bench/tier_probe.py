"""The NVMe tier alone against the disk, for `kvstrata bench tiering`.

In the chat the tier's IO threads share the cores with forward passes, so its rates there mix the
disk with CPU contention. This probe moves the chat's own block layout through a fresh tier with
nothing else running: a burst of puts into new slab space, a second burst into the slots of the
first (each put evicts one), then get_many of the second burst, each timed from the first call to
the last block done. Each segment's blocks are first copied out into the tier's write buffers, as
DRAM copies the blocks it evicts, and then put together (put_many), as the tier manager puts an
eviction's spills; the copies are not timed (see _put_burst).

The disk's reference is one thread's sequential O_DIRECT IO of the same bytes in the same
directory, taken in **lockstep** with the tier: every burst is cut into segments, and before each
tier segment the same number of bytes moves through a plain file (8 MB chunks): extending writes
into a new file beside new slab space, overwrites of that file beside reused slots, and reads of it
beside the tier's reads. The chunks of a segment go from and to memory of their own, a buffer as
large as the segment, as the tier's blocks do (a burst holds all of its blocks at once): through
one 8 MB buffer, warm in the caches, this VM's disk read 5.0 GB/s against 4.07 into memory of
its own (alternating, 270 MB each), which had made the reference a faster disk than the tier's.
Each side's rate is its bytes over the sum of its own segments' times.
This VM's disk swings between about 0.6 and 3.9 GB/s from one second to the next, so a reference
taken before the tier, even moments before, was compared with another disk; in lockstep both sides
see the same moments. The report quotes, for each kind of IO, the round whose ratio is the median.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstrata.cluster.bench.bandwidth import MB

PROBE_DIR = "tier-probe"
RAW_FILE = ".kvstrata-tier-probe-raw"
_TAG = "probe"  # the probe tier's layout tag
_NUM_PATTERNS = 8  # distinct block contents cycled through the puts
_CHUNK = 8 * MB  # the reference's IO size


@dataclass(frozen=True, slots=True)
class ProbeRound:
    """Bytes/s of one round; raw_* (the lockstep reference) are None where the filesystem has no O_DIRECT."""

    write_new: float
    write_reused: float
    read: float
    raw_write_new: float | None  # extending writes into a new file
    raw_write_reused: float | None  # overwrites of that file
    raw_read: float | None


@dataclass(frozen=True)
class TierProbe:
    num_blocks: int
    slot_bytes: int
    direct_io: bool
    segments: int
    rounds: list[ProbeRound]

    def median(self, name: str) -> float | None:
        xs = [getattr(r, name) for r in self.rounds if getattr(r, name) is not None]
        return statistics.median(xs) if xs else None

    def to_json(self) -> dict:
        gb = {k: None if (m := self.median(k)) is None else round(m / 1e9, 3) for k in ProbeRound.__slots__}
        return {"num_blocks": self.num_blocks, "slot_bytes": self.slot_bytes, "direct_io": self.direct_io,
                "segments": self.segments, "median_gb_per_s": gb, "rounds": [asdict(r) for r in self.rounds]}


class RawFile:
    """The reference: sequential O_DIRECT IO on a plain file in 8 MB chunks, from and to a page-aligned
    buffer of random bytes, span bytes (rounded up to whole chunks): a call's chunk j uses the
    buffer's chunk j, wrapping around. Seconds per call; None throughout where the filesystem
    refuses O_DIRECT."""

    def __init__(self, path: Path, clock: Callable[[], float], span: int = _CHUNK):
        self.path = path
        self.clock = clock
        from kvstrata.tiering.disk_io import io_buffer

        # aligned, as O_DIRECT needs, and on huge pages as the tier's own buffers (disk_io.io_buffer)
        self.chunks = max(1, -(-span // _CHUNK))
        self.buf = io_buffer(self.chunks * _CHUNK)
        self.buf.copy_(torch.frombuffer(bytearray(os.urandom(self.chunks * _CHUNK)), dtype=torch.uint8))
        try:
            self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except (OSError, AttributeError):
            self.fd = None

    def move(self, op: str, offset: int, num_bytes: int) -> float | None:
        """op "w" or "r": num_bytes (a multiple of the page size) from offset, in chunks; the seconds taken."""
        if self.fd is None:
            return None
        start = self.clock()
        try:
            end, j = offset + num_bytes, 0
            while offset < end:
                n = min(_CHUNK, end - offset)
                at = j % self.chunks * _CHUNK
                view = memoryview(self.buf.numpy())[at:at + n]
                done = os.pwritev(self.fd, [view], offset) if op == "w" else os.preadv(self.fd, [view], offset)
                view.release()
                if done != n:
                    raise OSError(f"short {op} of the reference file at {offset}")
                offset += n
                j += 1
        except OSError:  # EINVAL on the first IO: open accepted the flag, the filesystem does not
            os.close(self.fd)
            self.fd = None
            return None
        return self.clock() - start

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.path.unlink(missing_ok=True)


def probe_nvme_tier(directory: Path, block_shape: tuple[int, ...], dtype: torch.dtype, num_bytes: int,
                    rounds: int = 3, segments: int = 8,
                    clock: Callable[[], float] = time.perf_counter) -> TierProbe:
    """`rounds` rounds of about num_bytes each way through a tier in directory/tier-probe (removed
    after), each burst in `segments` segments beside the reference's."""
    from kvstrata.tiering.block_file import max_head_len
    from kvstrata.tiering.nvme import NvmeTier
    from kvstrata.tiering.slab import SLAB_BYTES, SlabGeometry

    if rounds <= 0 or segments <= 0:
        raise ValueError(f"rounds and segments must be positive, got {rounds} and {segments}")
    payload = torch.Size(block_shape).numel() * dtype.itemsize
    head = max_head_len(_TAG, str(dtype).removeprefix("torch."), tuple(block_shape))
    slot_bytes = SlabGeometry.plan(0, head, payload, SLAB_BYTES).slot_bytes
    patterns = [torch.randint(0, 256, (payload,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                .view(dtype).view(block_shape) for i in range(_NUM_PATTERNS)]
    num_blocks = max(2, num_bytes // payload)
    segments = min(segments, num_blocks)
    parts = [range(num_blocks * s // segments, num_blocks * (s + 1) // segments) for s in range(segments)]
    tier_dir = directory / PROBE_DIR
    results, direct = [], False
    total = num_blocks * slot_bytes
    for r in range(rounds):
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = NvmeTier(tier_dir, total, block_shape, dtype, layout_tag=_TAG)
        raw = RawFile(directory / RAW_FILE, clock, span=max(len(part) for part in parts) * slot_bytes)
        try:
            direct = tier.direct_io
            assert tier.geometry.slot_bytes == slot_bytes, "the probe sized its tier by another slot"
            keys = [[f"{r}/{burst}/{i}".encode() for i in range(num_blocks)] for burst in range(2)]
            times: dict[str, list[float | None]] = {}

            def lockstep(name: str, op: str, tier_part: Callable[[range], float]) -> None:
                mine, ref = times.setdefault(name, []), times.setdefault("raw_" + name, [])
                for part in parts:
                    ref.append(raw.move(op, part.start * slot_bytes, len(part) * slot_bytes))
                    mine.append(tier_part(part))

            with _collector_paused():
                lockstep("write_new", "w", lambda part: _put_burst(tier, keys[0], part, patterns, clock))
                lockstep("write_reused", "w", lambda part: _put_burst(tier, keys[1], part, patterns, clock))
                lockstep("read", "r", lambda part: _get_burst(tier, keys[1], part, patterns, clock))
        finally:
            tier.close()
            raw.close()
            shutil.rmtree(tier_dir, ignore_errors=True)
        rate = {k: None if None in v else total / sum(v) for k, v in times.items()}
        results.append(ProbeRound(**rate))
    return TierProbe(num_blocks, slot_bytes, direct, segments, results)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """One garbage collection before a round and none during it: a collection in the middle of a
    burst would time the interpreter, not the tier. (A collection before every burst did the same,
    but each walks every object of the process: 50 ms in a bare one, hundreds in a test session.)"""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _put_burst(tier, keys: list[bytes], part: range, patterns: list[torch.Tensor],
               clock: Callable[[], float]) -> float:
    """Seconds from putting keys[part], together, to the last block stored; RuntimeError if one was
    not. As in the chat, where DRAM copies out the blocks it evicts (into write buffers where the
    tier stages them) and the tier manager then puts them as one burst, the copies come first,
    untimed: they are DRAM's work, in the step loop, and the chat's NVMe rate does not count them
    either."""
    staged = [tier.staged_copy(patterns[i % len(patterns)]) for i in part]
    start = clock()
    futures = tier.put_many([(keys[i], None, data) for i, data in zip(part, staged)])
    stored = [f.result() for f in futures]
    seconds = clock() - start
    if not all(stored):
        raise RuntimeError(f"the NVMe tier probe could not store {stored.count(False)} of {len(part)} blocks")
    return seconds


def _get_burst(tier, keys: list[bytes], part: range, patterns: list[torch.Tensor],
               clock: Callable[[], float]) -> float:
    """Seconds of one get_many of keys[part]; RuntimeError if a block came back wrong or missing.
    The blocks go back to the tier's read buffers afterwards, as the tier manager does."""
    start = clock()
    got = tier.get_many([keys[i] for i in part]).result()
    seconds = clock() - start
    if any(g is None or not torch.equal(g.view(torch.uint8), patterns[i % len(patterns)].view(torch.uint8))
           for i, g in zip(part, got)):
        raise RuntimeError(f"the NVMe tier probe read back wrong or missing blocks in {tier.directory}")
    tier.recycle(got)
    return seconds
