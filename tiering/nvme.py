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
read, and nvme_writes.py and nvme_reads.py hold the two paths). Blocks thus move in large IOs,
four IO threads keeping four in flight (on one disk measured, four threads moved 0.74 MB blocks
1.5-1.7x faster into new space, 1.2x into reused slots and 1.1-1.4x on reads than two; on
another, 3.7 MB IOs from four threads wrote 1.2x faster than 0.74 MB ones). Every read checks
the header, the block's identity, the layout and a CRC-32 of the payload, and anything wrong
reads as a miss and frees the slot. The index (nvme_index.py) lives in memory, is rebuilt from
the slots' headers at open, oldest write first (each header carries a write sequence number), and
evicts least-recently-used leaves first.
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
from dataclasses import asdict, dataclass
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
from kvstrata.tiering.nvme_reads import NvmeReads
from kvstrata.tiering.nvme_writes import NvmeWrites, PendingWrite
from kvstrata.tiering.run_sizes import RunSizeChooser
from kvstrata.tiering.slab import SLAB_BYTES, SlabFiles, SlabGeometry
from kvstrata.tiering.slab_scan import check_disk, rebuild
from kvstrata.tiering.slot_io import ReadBuffers, SlotIO
from kvstrata.tiering.slot_stage import StagedCopies
from kvstrata.tiering.slots import SlotTable

RUN_BYTES = 4 << 20  # the most one pwrite moves: adjacent slots go together up to this
# the most one preadv on the C IO threads moves, chosen among these by the loads' own rates
# (run_sizes.py: a Xeon's disk read fastest in 1 MB runs, a Zen 4 EPYC's in 4 MB runs); writes in
# 1 MB runs lost in the chat (more completions through Python), so they keep RUN_BYTES
# (docs/benchmarks.md). KVSTRATA_NVME_READ_RUN_KB sets one size instead.
READ_RUN_SIZES = (1 << 20, 4 << 20)
READ_BUFFER_BYTES = 256 << 20  # read buffers (an arena on huge pages, slot_io.ReadBuffers) kept for reuse
PREFAULT_READ_BYTES = 64 << 20  # of those, faulted in at open: about what loads have out at once
STAGED_BUFFER_BYTES = 64 << 20  # write buffers that blocks leaving DRAM are staged in (slot_stage.py)


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


class NvmeTier(NvmeWrites, NvmeReads):
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
        self._pending: dict[bytes, PendingWrite] = {}
        self._queue: deque[PendingWrite] = deque()  # puts not yet taken by an IO thread, oldest first
        self._writes_in_flight: set[Future] = set()
        self._next_seq = 0
        self._counters = _Counters()
        self._read_clock = BusyClock()
        self._write_clock = BusyClock()
        self._closed = False
        self.io_slice_us = io_slice_us()
        read_run = read_run_bytes()
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
            self._read_runs = RunSizeChooser([max(1, b // self.geometry.slot_bytes)
                                              for b in ((read_run,) if read_run else READ_RUN_SIZES)])
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
                    "slot_bytes": self.geometry.slot_bytes,
                    "slab_files": self._slabs.num_files, "short_slice_io_threads": self._short_slice_threads + (
                        self._pool.short_slice_threads if self._pool is not None else 0),
                    "c_io": self._pool is not None,
                    "c_io_syscall_seconds": self._pool.io_seconds if self._pool is not None else 0.0,
                    # the disk's share of the busy clocks below: any IO of the kind in its syscall (C IO only)
                    "read_io_seconds": self._pool.busy_seconds(False) if self._pool is not None else None,
                    "write_io_seconds": self._pool.busy_seconds(True) if self._pool is not None else None,
                    **asdict(self._counters),
                    # the read run size C IO's loads take now, and each candidate's rate; the Python threads' is fixed
                    **(self._read_runs.stats() if self._pool is not None else
                       {"read_run_slots": self._io.max_run, "read_run_rates": []}),
                    "read_busy_seconds": self._read_clock.seconds,
                    "write_busy_seconds": self._write_clock.seconds}

    # -- dropping, flushing and closing ----------------------------------------------------
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
