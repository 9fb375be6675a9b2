"""The NVMe tier: KV blocks in checksummed slots of a few slab files on a local disk, below the DRAM tier.

Each block takes one fixed-size slot (slab.py): a struct header, at a 4096-byte offset the raw
bytes of the tensor, zeros to the slot's end; nothing in a slot is unpickled or executed. Writes
and reads move whole slots, O_DIRECT where the file system allows it, so blocks skip the page
cache (the DRAM tier above already caches them) and no file is created, renamed or removed per
block. Writes queue (put_many queues a DRAM eviction's spills together), and each IO thread takes
its share of the queue (an even split among the IO threads, at most 4 MB), gives the blocks slots
(free slots go lowest first, and a block is as recent as its take, so a burst lands in adjacent
slots and is later evicted in slot order) and writes each run of adjacent slots in one pwrite,
taking shares until the queue is empty; a batch of reads sorts its slots and reads each run in one
preadv (slot_io.py moves the bytes; this module keeps the index and which slot is free, written or
read). Blocks thus move in large IOs, four IO threads keeping four in flight (on one disk measured,
four threads moved 0.74 MB blocks 1.5-1.7x faster into new space, 1.2x into reused slots and
1.1-1.4x on reads than two; on another, 3.7 MB IOs from four threads wrote 1.2x faster than
0.74 MB ones). Every read checks the header, the block's identity, the layout and
a CRC-32 of the payload, and anything wrong reads as a miss and frees the slot. The index
(nvme_index.py) lives in memory, is rebuilt from the slots' headers at open, oldest write first
(each header carries a write sequence number), and evicts least-recently-used leaves first.
"""

from __future__ import annotations

import fcntl
import math
import operator
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvstrata.tiering.block_file import MAX_HASH_BYTES, MAX_HEADER_BYTES, max_head_len
from kvstrata.tiering.disk_io import (
    O_DIRECT,
    BusyClock,
    io_slice_us,
    read_run_bytes,
    request_short_slice,
    supports_direct_io,
)
from kvstrata.tiering.io_pool import nvme_pool
from kvstrata.tiering.nvme_index import BlockIndex, IndexEntry
from kvstrata.tiering.slab import SLAB_BYTES, SlabFiles, SlabGeometry
from kvstrata.tiering.slab_scan import check_disk, rebuild
from kvstrata.tiering.slot_io import ReadBuffers, SlotIO, SlotWrite
from kvstrata.tiering.slot_stage import StagedCopies
from kvstrata.tiering.slots import SlotTable

RUN_BYTES = 4 << 20  # the most one pwrite moves: adjacent slots go together up to this
# the most one preadv on the C IO threads moves. Against runs of up to 4 MB, reads of 1 MB (one
# float32 slot of the default model) ran at 0.86-0.90 of the lockstep reference instead of
# 0.77-0.84 on a 2-core Xeon's virtual disk, in the chat and alone; writes in 1 MB runs lost in the
# chat (more completions through Python), so they keep RUN_BYTES (docs/benchmarks.md).
# KVSTRATA_NVME_READ_RUN_KB sets another size.
READ_RUN_BYTES = 1 << 20
READ_BUFFER_BYTES = 256 << 20  # read buffers (an arena on huge pages, slot_io.ReadBuffers) kept for reuse
PREFAULT_READ_BYTES = 64 << 20  # of those, faulted in at open: about what loads have out at once
STAGED_BUFFER_BYTES = 64 << 20  # write buffers that blocks leaving DRAM are staged in (slot_stage.py)


@dataclass(slots=True, eq=False)
class _PendingWrite:
    block_hash: bytes
    parent_hash: bytes | None
    data: torch.Tensor
    staged: torch.Tensor | None = None  # the write buffer `data` was staged in (slot_stage.py)
    future: Future = field(default_factory=Future)
    tick: int = 0  # the block's recency in the index, taken with its slot


_ToRead = tuple[int, bytes, IndexEntry]  # (place in the answer, block, its entry when asked)


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0  # slot writes and erases that failed with an IO error
    evictions: int = 0
    discards: int = 0
    checksum_failures: int = 0  # every bad slot met by a read: checksum, header, identity, layout, IO
    dropped_at_open: int = 0  # bad slots and duplicates erased, and old per-block files removed, at open
    foreign_files: int = 0  # slots holding another layout's block at open: free space, overwritten when reused
    # bytes count hits and stored blocks, whole slots; seconds are summed over the threads and count
    # every read and write they did, bad slots, erases and writes discarded in flight included
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class NvmeTier:
    """Slab files of block slots with an LRU, leaf-first index; capacity_bytes // slot_bytes slots.

    Threading: the caller's threads run put/get/discard, which touch the index (and discard erases
    a slot); the tier's IO threads write, read and checksum. Every index and slot-state change
    happens under `_lock`; disk IO happens outside it, on a slot whose state (slots.py) keeps
    everyone else off it. A block is indexed only once its slot is written; a slot being read is
    neither evicted nor erased until the read ends, so no read meets another block's bytes (and
    every read checks the hash in the header anyway). An evicted block's slot goes straight to the
    write that evicted it, whose one pwrite replaces the header; a discarded or bad block's slot
    is erased (its first 4096 bytes zeroed) before it is reused, so it never comes back at a
    restart. One tier owns its directory (an flock on `<dir>/.lock`): slots of another layout
    (tag, dtype, shape) are free space to it.

    direct_io: None probes the directory at open and uses O_DIRECT where it works; True requires
    it (ValueError if the directory cannot); False goes through the page cache. The format is the
    same either way, so a directory can be reopened in either mode. slab_bytes caps one slab file.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, layout_tag: str = "", num_io_threads: int = 4,
                 direct_io: bool | None = None, slab_bytes: int = SLAB_BYTES, c_io: bool | None = None):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        try:
            shape = tuple(operator.index(d) for d in block_shape)
        except TypeError:
            shape = ()
        if not shape or min(shape) <= 0 or len(shape) > 255:
            raise ValueError(f"block_shape must be a non-empty tuple of positive ints, got {block_shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if num_io_threads <= 0:
            raise ValueError(f"num_io_threads must be positive, got {num_io_threads}")
        if direct_io not in (None, True, False):
            raise ValueError(f"direct_io must be None, True or False, got {direct_io!r}")
        if not isinstance(slab_bytes, int) or slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be a positive int, got {slab_bytes!r}")
        if c_io not in (None, True, False):
            raise ValueError(f"c_io must be None, True or False, got {c_io!r}")
        head_bytes = max_head_len(layout_tag, str(dtype).removeprefix("torch."), shape)
        if head_bytes > MAX_HEADER_BYTES:
            raise ValueError("layout_tag is too long for a block header")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.block_shape = shape
        self.dtype = dtype
        self.layout_tag = layout_tag
        self.num_io_threads = num_io_threads
        self.payload_bytes = math.prod(shape) * dtype.itemsize
        self.geometry = SlabGeometry.plan(capacity_bytes, head_bytes, self.payload_bytes, slab_bytes)
        self._lock = threading.Lock()
        self._erased = threading.Condition(self._lock)  # notified when an erase ends, for close
        # pinned blocks (prompt-cache breakpoints) are never evicted; replaced whole by the tier manager
        self.pinned: frozenset[bytes] = frozenset()
        # told (under the tier's lock, on the thread that takes a write or checks a read: an IO
        # thread, or with C IO put_many's caller and the reaper; keep it quick) which blocks left by
        # eviction or as bad data; the KV events of the shared index hang here
        self.on_evict: Callable[[list[bytes]], None] | None = None
        self._index = BlockIndex()
        self._pending: dict[bytes, _PendingWrite] = {}
        self._queue: deque[_PendingWrite] = deque()  # puts not yet taken by an IO thread, oldest first
        self._writes_in_flight: set[Future] = set()
        self._next_seq = 0
        self._counters = _Counters()
        self._read_clock = BusyClock()
        self._write_clock = BusyClock()
        self._closed = False
        self.io_slice_us = io_slice_us()
        read_run = read_run_bytes(READ_RUN_BYTES)
        self._short_slice_threads = 0
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self.directory} is already open in another NvmeTier") from None
        try:
            supported = direct_io is not False and supports_direct_io(self.directory)
            if direct_io and not supported:
                raise ValueError(f"direct_io=True, but {self.directory} does not support O_DIRECT")
            self.direct_io = supported
            self._slabs = SlabFiles(self.directory, self.geometry, O_DIRECT if supported else 0)
            self._read_buffers = ReadBuffers(self.geometry.slot_bytes, max(8, READ_BUFFER_BYTES // self.geometry.slot_bytes))
            self._read_buffers.prefault(min(self.geometry.num_slots, PREFAULT_READ_BYTES // self.geometry.slot_bytes))
            self._io = SlotIO(self._slabs, layout_tag, dtype, shape, self.payload_bytes,
                              max(1, RUN_BYTES // self.geometry.slot_bytes), self._read_buffers)
            self._max_read_run = max(1, read_run // self.geometry.slot_bytes)
            self._staged = StagedCopies(self.geometry.slot_bytes, head_bytes, dtype, shape, self.payload_bytes,
                                        max(8, STAGED_BUFFER_BYTES // self.geometry.slot_bytes))
            # writes and loads on C threads (io_pool.py) where the C kernels stage blocks, else on the executor
            self._pool = nvme_pool(c_io, self._staged.kernels if self._staged.enabled else None, num_io_threads,
                                   self.io_slice_us)
            self._executor = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvstrata-nvme",
                                                initializer=self._start_io_thread)
            # checks blocks an IO thread has read while it reads its next ones (_read_sorted)
            self._checker = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvstrata-nvme-check")
            try:
                self._open()
            except BaseException:
                self._executor.shutdown(wait=True)
                self._checker.shutdown(wait=True)
                if self._pool is not None:
                    self._pool.close()
                self._slabs.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- queries -----------------------------------------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def file_bytes(self) -> int:
        """What one block takes on disk and against the capacity: its slot."""
        return self.geometry.slot_bytes

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.geometry.slot_bytes

    @property
    def num_pending_writes(self) -> int:
        return len(self._pending)  # a len() of a dict is atomic; no lock needed for a gauge

    def hashes(self) -> list[bytes]:
        """The blocks in the index, as of now."""
        with self._lock:
            return list(self._index.entries)

    def parent_of(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            found = self._index.get(block_hash) or self._pending.get(block_hash)
            return found.parent_hash if found is not None else None

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._index), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes, "pending_writes": len(self._pending),
                    "direct_io": self.direct_io, "slots": self.geometry.num_slots,
                    "slab_files": self._slabs.num_files, "short_slice_io_threads": self._short_slice_threads + (
                        self._pool.short_slice_threads if self._pool is not None else 0),
                    "c_io": self._pool is not None,
                    "c_io_syscall_seconds": self._pool.io_seconds if self._pool is not None else 0.0,
                    # the disk's share of the busy clocks below: any IO of the kind in its syscall (C IO only)
                    "read_io_seconds": self._pool.busy_seconds(False) if self._pool is not None else None,
                    "write_io_seconds": self._pool.busy_seconds(True) if self._pool is not None else None,
                    **asdict(self._counters),
                    "read_busy_seconds": self._read_clock.seconds,
                    "write_busy_seconds": self._write_clock.seconds}

    # -- writes ------------------------------------------------------------------------------
    def put(self, block_hash: bytes, parent_hash: bytes | None, data: torch.Tensor) -> Future:
        """Store a block on the IO threads; the future resolves to True once it is in the index.

        False means not stored: no slot at all, none free and nothing evictable, an IO error, or
        discarded before the write finished. `data` is kept, not copied, until then (with the C IO
        threads, a block not staged by staged_copy is staged, so copied, here). Putting a
        stored block only refreshes its recency; putting one whose write is in flight returns
        that write's future.
        """
        return self.put_many([(block_hash, parent_hash, data)])[0]

    def put_many(self, blocks: list[tuple[bytes, bytes | None, torch.Tensor | None]]) -> list[Future]:
        """put for each (block_hash, parent_hash, data), queued together: the IO threads then share
        the burst out, each writing its share's adjacent slots in one pwritev. Every item is checked
        before any is queued. data None only refreshes a block the tier holds (its future: False
        where the tier does not hold it, or the write in flight where one is)."""
        for block_hash, parent_hash, data in blocks:
            self._check_hash(block_hash, "block_hash")
            if parent_hash is not None:
                self._check_hash(parent_hash, "parent_hash")
                if parent_hash == block_hash:
                    raise ValueError("parent_hash must differ from block_hash")
            if data is not None:
                self._check_data(data)
        staged = [None if data is None else self._claim_or_stage(data) for _, _, data in blocks]
        futures = []
        queued = 0
        with self._lock:
            try:
                self._check_open()
            except BaseException:
                self._staged.give([buf for buf in staged if buf is not None])
                raise
            for (block_hash, parent_hash, data), buf in zip(blocks, staged):
                entry = self._index.get(block_hash)
                pending = self._pending.get(block_hash)
                if entry is not None or pending is not None or self.geometry.num_slots == 0:
                    if buf is not None:
                        self._staged.give([buf])
                    if entry is not None:
                        self._index.touch(block_hash, entry)
                        futures.append(_done(True))
                    else:
                        futures.append(pending.future if pending is not None else _done(False))
                    continue
                if data is None:  # a refresh of a block the tier no longer holds: nothing to write
                    futures.append(_done(False))
                    continue
                if self._pool is not None:  # the payload in its write buffer (_claim_or_stage)
                    data = self._staged.payload(buf, data)
                pending = _PendingWrite(block_hash, parent_hash, data, buf)
                self._pending[block_hash] = pending
                self._queue.append(pending)
                self._writes_in_flight.add(pending.future)
                futures.append(pending.future)
                queued += 1
            # each call takes its share of the queue until it is empty (_write_queued)
            for _ in range(min(queued, self.num_io_threads) if self._pool is None else 0):
                self._executor.submit(self._write_queued)
        if self._pool is not None and queued:
            self._submit_queued()
        return futures

    def _claim_or_stage(self, data: torch.Tensor) -> torch.Tensor | None:
        """The write buffer data was staged in (staged_copy); with C IO, a block not staged yet is
        staged here, since the C threads write only from write buffers."""
        buf = self._staged.claim(data)
        if buf is None and self._pool is not None:
            buf = self._staged.claim(self._staged.copy(data.contiguous()))
        return buf

    def staged_copy(self, block: torch.Tensor) -> torch.Tensor:
        """A copy of a block about to be put, staged for its write where it can be (slot_stage.py):
        the copy a tier above makes of a block it evicts. Put it, or hand it to release_staged."""
        self._check_data(block)
        return self._staged.copy(block)

    def release_staged(self, data: torch.Tensor | None) -> None:
        """A staged copy that will not be put after all."""
        self._staged.release(data)

    @property
    def num_staged(self) -> int:
        """Staged copies neither put nor released yet."""
        return len(self._staged)

    def discard(self, block_hash: bytes) -> bool:
        """Drop a block (and any write of it in flight); False if the tier did not have it. The
        slot is erased here, or by the last read of it still running, before it is reused."""
        with self._lock:
            self._check_open()
            removed = self._pending.pop(block_hash, None) is not None
            slot = None
            if block_hash in self._index:
                slot = self._drop(block_hash)
                removed = True
            self._counters.discards += removed
        if slot is not None:
            self._erase(slot)
        return removed

    def flush(self) -> None:
        """Wait until every write submitted so far has finished (committed, failed or dropped)."""
        while True:
            with self._lock:
                writes = list(self._writes_in_flight)
            if not writes:
                return
            wait_all(writes)

    def close(self) -> None:
        """Finish the writes and reads, stop the IO threads and release the directory; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here on put, get and discard raise, so the flush below is final
        self.flush()
        if self._pool is not None:
            self._pool.close()
        self._executor.shutdown(wait=True)
        self._checker.shutdown(wait=True)  # idle by now: an IO thread's read waits for its checks
        with self._erased:
            self._erased.wait_for(lambda: not self._slots.erasing)  # a discard on another thread
        self._slabs.close()
        os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads -------------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> Future:
        """The block's tensor, or None for a miss (absent, or a bad slot, which is then dropped)."""
        with self._lock:
            self._check_open()
            found = self._begin_read(block_hash)
            if isinstance(found, IndexEntry):
                return self._executor.submit(self._read_one, block_hash, found)
        return _done(found)

    def _read_one(self, block_hash: bytes, entry: IndexEntry) -> torch.Tensor | None:
        out = [None]
        self._read_sorted([(0, block_hash, entry)], out, touch=True)
        return out[0]

    def get_many(self, hashes: list[bytes]) -> Future:
        """Like get for each hash. The disk reads go in slot order, each run of adjacent slots in one
        preadv: with C IO, each run queued here on the IO pool and checked on its reaper; else split
        into one share per Python IO thread, each run checked on a checker thread while the IO
        thread reads its next."""
        out: list[torch.Tensor | None] = [None] * len(hashes)
        to_read: list[tuple[int, bytes, IndexEntry]] = []
        with self._lock:
            self._check_open()
            for i, block_hash in enumerate(hashes):
                found = self._begin_read(block_hash)
                if isinstance(found, IndexEntry):
                    to_read.append((i, block_hash, found))
                else:
                    out[i] = found
            ordered = sorted(to_read, key=lambda r: r[2].slot)
            futures = []
            if self._pool is None:
                share = self._even_share(len(ordered))
                futures = [self._executor.submit(self._read_sorted, ordered[k:k + share], out, False)
                           for k in range(0, len(ordered), share)]
        if self._pool is not None and ordered:
            futures = self._submit_reads(ordered, out)
        if not futures:
            return _done(out)
        result: Future = Future()
        remaining = [len(futures)]
        countdown = threading.Lock()

        def one_done(_: Future) -> None:
            with countdown:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last:
                return
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:  # not a bad slot (those are misses) but a bug or MemoryError: surface it
                result.set_exception(errors[0])
                return
            with self._lock:  # touch in the order asked, not the order the threads finished
                for i, block_hash, entry in to_read:
                    if out[i] is not None and self._index.get(block_hash) is entry:
                        self._index.touch(block_hash, entry)
            result.set_result(out)

        for future in futures:
            future.add_done_callback(one_done)
        return result

    def recycle(self, blocks: list[torch.Tensor | None]) -> None:
        """Hand back blocks that get or get_many returned, once the caller has copied them out: their
        buffers are read into again. The caller must not touch them afterwards. Blocks from elsewhere
        (a write in flight returns a copy) are ignored."""
        bufs = [self._read_buffers.buffer_of(block) for block in blocks if block is not None]
        self._read_buffers.give([buf for buf in bufs if buf is not None])

    def _begin_read(self, block_hash: bytes) -> torch.Tensor | IndexEntry | None:
        """Under the lock: a tensor from a write in flight (a hit), the entry to read, or a miss."""
        pending = self._pending.get(block_hash)
        if pending is not None:
            self._counters.hits += 1
            return pending.data.clone()
        entry = self._index.get(block_hash)
        if entry is None:
            self._counters.misses += 1
        return entry

    def _begin_reads(self, batch: list[_ToRead]) -> list[_ToRead]:
        """Those of batch still indexed, each slot marked as being read; a block evicted or
        discarded since the lookup is a miss."""
        with self._lock:
            reading = []
            for item in batch:
                if self._index.get(item[1]) is item[2]:
                    self._slots.begin_read(item[2].slot)  # from here no eviction or erase of the slot
                    reading.append(item)
                else:
                    self._counters.misses += 1
        return reading

    def _submit_reads(self, batch: list[_ToRead], out: list) -> list[Future]:
        """With C IO, on the caller's thread: begin the reads and queue each run of adjacent slots on
        the IO pool as one preadv (as many runs as threads where the batch allows); a future per
        run, resolved on the reaper once the run is checked and its slots let go."""
        reading = self._begin_reads(batch)
        futures = []
        limit = self._run_limit(len(reading), self._max_read_run)
        for run in self._io.runs(reading, limit, slot_of=lambda r: r[2].slot):
            future: Future = Future()
            futures.append(future)
            start = self._read_clock.begin()

            def done(bufs: list[torch.Tensor], read_ok: list[bool], crcs: list[int] | None, run: list[_ToRead] = run,
                     start: float = start, future: Future = future) -> None:
                try:
                    self._check_run(run, bufs, read_ok, out, False, start, crcs)
                except BaseException as e:  # a bug in a check reaches the caller's future
                    future.set_exception(e)
                else:
                    future.set_result(None)

            try:
                self._io.submit_read([entry.slot for _, _, entry in run], self._pool, done)
            except BaseException as e:  # a bug or MemoryError: this run is let go as misses
                self._let_go(run, None, out, False, start)
                future.set_exception(e)
        return futures

    def _read_sorted(self, batch: list[_ToRead], out: list, touch: bool) -> None:
        """Read blocks in slot order into `out`: those still indexed, each run of adjacent slots in one
        preadv; a read that finds its block evicted or discarded since the lookup is a miss."""
        reading = self._begin_reads(batch)
        runs = self._io.runs(reading, slot_of=lambda r: r[2].slot)
        # each run but the last is checked by a checker thread while this thread reads the next
        checks: list[Future] = []
        done = 0
        try:
            for done, run in enumerate(runs, 1):
                check = self._read_run(run, out, touch, self._checker if done < len(runs) else None)
                if check is not None:
                    checks.append(check)
        finally:
            if done < len(runs):  # a bug or MemoryError on the way: the runs not read are let go too
                self._let_go([item for run in runs[done:] for item in run], None, out, touch, self._read_clock.begin())
            wait_all(checks)
        for check in checks:
            check.result()  # a bug in a check reaches the caller's future

    def _read_run(self, run: list[_ToRead], out: list, touch: bool,
                  checker: ThreadPoolExecutor | None) -> Future | None:
        """Adjacent slots, each marked as being read: read them, then check and let go of every one,
        here or (with a checker) on a checker thread, whose future this returns."""
        start = self._read_clock.begin()
        try:
            bufs, read_ok = self._io.read_raw([entry.slot for _, _, entry in run])
        except BaseException:  # a bug or MemoryError, which the caller's future then carries
            self._let_go(run, None, out, touch, start)
            raise
        if checker is None:
            self._check_run(run, bufs, read_ok, out, touch, start)
            return None
        return checker.submit(self._check_run, run, bufs, read_ok, out, touch, start)

    def _check_run(self, run: list[_ToRead], bufs: list[torch.Tensor], read_ok: list[bool], out: list,
                   touch: bool, start: float, crcs: list[int] | None = None) -> None:
        results = None
        try:
            results = self._io.check_run(bufs, read_ok, [h for _, h, _ in run], crcs)
        finally:  # also on a bug: the slots are let go
            self._let_go(run, results, out, touch, start)

    def _let_go(self, run: list[_ToRead], results: list[tuple[torch.Tensor | None, bool]] | None, out: list,
                touch: bool, start: float) -> None:
        """The end of a run's read (begun at `start`): its blocks into `out`, each (block, bad slot)
        of `results` counted, bad slots dropped and erased; no results: all misses, none bad."""
        seconds = self._read_clock.end() - start
        results = results or [(None, False)] * len(run)
        to_erase = []
        with self._lock:
            self._counters.read_seconds += seconds
            for (i, block_hash, entry), (data, bad) in zip(run, results):
                out[i] = data
                slot = self._end_read(block_hash, entry, data, bad, touch)
                if slot is not None:
                    to_erase.append(slot)
        for slot in to_erase:
            self._erase(slot)

    def _end_read(self, block_hash: bytes, entry: IndexEntry, data: torch.Tensor | None, bad: bool,
                  touch: bool) -> int | None:
        """Under the lock, after a read: count it, drop a bad block, and let go of the slot; the slot
        if the caller must now erase it."""
        to_erase = entry.slot if self._slots.end_read(entry.slot) else None
        if data is None:
            self._counters.misses += 1
            if bad and self._index.get(block_hash) is entry:  # still ours, so the slot is bad
                to_erase = self._drop(block_hash)
                self._counters.checksum_failures += 1
                if self.on_evict is not None:
                    self.on_evict([block_hash])
        else:
            self._counters.hits += 1
            self._counters.bytes_read += self.geometry.slot_bytes
            if touch and self._index.get(block_hash) is entry:
                self._index.touch(block_hash, entry)
        return to_erase

    # -- the write path (IO threads) ---------------------------------------------------------
    def _write_queued(self) -> None:
        """Until the queue is empty: take a share of the queued writes (an even split among the IO
        threads, at most a run), give each a slot (evicting where none is free), write each run of
        adjacent slots in one pwrite, then index the blocks still wanted."""
        try:
            while self._write_share():
                pass
        except BaseException:
            with self._lock:  # a bug: the writes this call would have taken still need a call
                if self._queue:
                    self._executor.submit(self._write_queued)
            raise

    def _write_share(self) -> bool:
        """One share of the queue written; False if the queue was empty."""
        taken: list[tuple[_PendingWrite, SlotWrite | None]] = []
        written: set[int] = set()
        with self._lock:
            if not self._queue:
                return False
            start = self._write_clock.begin()
        try:  # on a bug too, every write taken ends, committed or not, so flush does not hang
            with self._lock:
                self._take(min(self._io.max_run, self._even_share(len(self._queue))), taken)
            written = self._io.write([w for _, w in taken if w is not None])
            # no fsync: a slot torn by power loss fails its checksum and reads as a miss
        finally:
            self._end_writes(taken, written, start)
        return True

    def _take(self, limit: int, taken: list[tuple[_PendingWrite, SlotWrite | None]]) -> None:
        """Under the lock: up to limit queued writes, oldest first, onto taken, each with its slot
        write (None where it was discarded before its turn or no slot could be had)."""
        while self._queue and len(taken) < limit:
            p = self._queue.popleft()
            taken.append((p, None))
            if self._pending.get(p.block_hash) is p:  # else discarded before its turn
                slot = self._allocate()
                if slot is not None:
                    p.tick = self._index.next_tick()
                    taken[-1] = (p, SlotWrite(slot, p.block_hash, p.parent_hash, p.data, self._next_seq, p.staged))
                    self._next_seq += 1

    def _submit_queued(self) -> None:
        """With C IO, on the caller's thread: take every queued write, give each a slot, and queue
        its run of adjacent slots on the IO pool; each run ends on the pool's reaper thread."""
        taken: list[tuple[_PendingWrite, SlotWrite | None]] = []
        with self._lock:
            self._take(len(self._queue), taken)
        skipped = [(p, w) for p, w in taken if w is None]
        if skipped:
            self._end_writes(skipped, set(), self._write_clock.begin())
        writes = [(p, w) for p, w in taken if w is not None]
        runs = self._io.runs(writes, self._run_limit(len(writes)), slot_of=lambda t: t[1].slot)
        for k, run in enumerate(runs):
            start = self._write_clock.begin()

            def done(written: bool, run: list = run, start: float = start) -> None:
                self._end_writes(run, {w.slot for _, w in run} if written else set(), start)

            try:
                self._io.submit_run([w for _, w in run], self._pool, done)
            except BaseException:  # a bug or MemoryError: the runs not queued end as failed, so flush does not hang
                done(False)
                for rest in runs[k + 1:]:
                    self._end_writes(rest, set(), self._write_clock.begin())
                raise

    def _run_limit(self, n: int, most: int | None = None) -> int:
        """The longest run for a burst of n blocks on the C IO threads: as many runs as threads where
        the burst allows (one 3 MB write alone ran at 1.3 GB/s in the chat), and past max_run per
        thread, runs of even length in as few rounds of the threads as max_run allows, so that no
        thread is left with a last run alone (most: max_run by default; loads pass their own). The threads
        take runs as they come free:

            45 blocks, 4 threads, max_run 5:  runs of 5 -> 9 runs, rounds 4 + 4 + 1: 15 blocks a thread
                                              runs of 4 -> 12 runs, rounds 4 + 4 + 4: 12 (11.25 if even)
        """
        threads, most = self.num_io_threads, most or self._io.max_run
        rounds = max(1, -(-n // (threads * most)))
        return max(1, min(most, -(-n // (threads * rounds))))

    def _even_share(self, n: int) -> int:
        """Items per IO thread when n are split evenly among them (at least 1)."""
        return max(1, -(-n // self.num_io_threads))

    def _end_writes(self, taken: list[tuple[_PendingWrite, SlotWrite | None]], written: set[int],
                    start: float) -> None:
        """Index what was written and is still wanted; erase the rest's slots; resolve the futures.
        A write stays in flight until its slot is erased, so flush waits for that too."""
        results: list[tuple[_PendingWrite, bool]] = []
        to_erase: list[int] = []
        with self._lock:
            for p, w in taken:
                slot = w.slot if w is not None else None
                stored = False
                if self._pending.get(p.block_hash) is p:
                    del self._pending[p.block_hash]
                    stored = slot is not None and slot in written
                if stored:
                    self._slots.commit(slot)
                    # recent as of its take, not its end: blocks written together in slot order are
                    # evicted in that order, so their slots are reused as runs
                    self._index.insert(p.block_hash, p.parent_hash, slot, w.seq, p.tick)
                    self._counters.writes += 1
                    self._counters.bytes_written += self.geometry.slot_bytes
                elif slot is not None:  # discarded meanwhile, or failed: what reached the slot must not come back
                    self._slots.release(slot)
                    to_erase.append(slot)
                self._counters.write_failures += slot is not None and slot not in written
                results.append((p, stored))
            self._counters.write_seconds += self._write_clock.end() - start
        for slot in to_erase:
            self._erase(slot)
        self._staged.give([p.staged for p, _ in taken if p.staged is not None])
        for p, stored in results:
            p.future.set_result(stored)
        with self._lock:
            self._writes_in_flight.difference_update(p.future for p, _ in results)

    # -- slots (callers hold the lock, except for _erase) ------------------------------------
    def _allocate(self) -> int | None:
        """A slot for a write: a free one, else the least recently used evictable leaf's."""
        if self._slots.can_allocate():
            return self._slots.allocate()
        victim = self._index.lru_leaf(self._is_held)
        if victim is None:
            return None
        self._counters.evictions += 1
        if self.on_evict is not None:
            self.on_evict([victim])
        slot = self._index.remove(victim).slot
        self._slots.reuse(slot)
        return slot

    def _is_held(self, block_hash: bytes, entry: IndexEntry) -> bool:
        return block_hash in self.pinned or self._slots.is_being_read(entry.slot)

    def _drop(self, block_hash: bytes) -> int | None:
        """Remove a block from the index; its slot, if the caller must erase it now (else the last
        read of it will)."""
        slot = self._index.remove(block_hash).slot
        return slot if self._slots.release(slot) else None

    def _erase(self, slot: int) -> None:
        """Zero a slot's header (outside the lock; no one else uses an erasing slot), then free it."""
        start = self._write_clock.begin()
        failed = False
        try:
            self._slabs.erase(slot)
        except OSError:  # the next write to the slot overwrites it anyway; until then it may hold a block
            failed = True
        with self._erased:
            self._counters.write_seconds += self._write_clock.end() - start
            self._counters.write_failures += failed
            self._slots.erased(slot)
            self._erased.notify_all()

    def _start_io_thread(self) -> None:
        """Each IO thread, as it starts: a short scheduler slice, so that it runs as soon as its IO
        ends even while forward passes hold every core (disk_io.request_short_slice)."""
        if self.io_slice_us and request_short_slice(self.io_slice_us):
            with self._lock:
                self._short_slice_threads += 1

    # -- open and checks ---------------------------------------------------------------------
    def _open(self) -> None:
        found = rebuild(self._slabs, self._executor, self._io.is_our_layout, self.num_io_threads)
        self._index = found.index
        self._next_seq = found.next_seq
        self._counters.dropped_at_open = found.num_dropped
        self._counters.foreign_files = found.num_foreign
        self._counters.evictions = found.num_evicted
        self._slots = SlotTable(self.geometry.num_slots, {e.slot for e in self._index.entries.values()})

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NvmeTier is closed")

    @staticmethod
    def _check_hash(value: bytes, name: str) -> None:
        if not isinstance(value, bytes) or not 0 < len(value) <= MAX_HASH_BYTES:
            raise ValueError(f"{name} must be 1 to {MAX_HASH_BYTES} bytes, got {value!r:.80}")

    def _check_data(self, data: torch.Tensor) -> None:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
        if data.device.type != "cpu":
            raise ValueError(f"data must be on the CPU, got {data.device}")
        if tuple(data.shape) != self.block_shape or data.dtype != self.dtype:
            raise ValueError(f"data must be {self.dtype} {self.block_shape}, got {data.dtype} {tuple(data.shape)}")

    def check_integrity(self) -> None:
        """Slots and index, then index and disk: every slot in exactly one state, child links and
        leaves in order, every indexed block's header in its slot, no block of ours in a free slot,
        no slab file past the geometry and no file of the old per-block layout."""
        with self._lock:
            self._index.check()
            assert self.used_bytes <= self.capacity_bytes, f"{self.used_bytes} B used > capacity"
            self._slots.check({e.slot for e in self._index.entries.values()})
            assert all(p.future in self._writes_in_flight for p in self._pending.values()), "lost a write"
            check_disk(self._slabs, self._io.is_our_layout, self._index.entries, self._slots.free_slots())
