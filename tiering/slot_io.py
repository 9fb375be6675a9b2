"""Whole NVMe slots of one block layout, moved in runs: adjacent slots are staged one after another
and written in one pwrite, or read in one preadv and checked block by block (slot_codec.py).

No index and no lock here: the tier (nvme.py) decides which slots move, keeps every other operation
off them meanwhile, and does the bookkeeping before and after.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.tiering.block_file import ALIGN, BlockHeader, HeadPacker
from kvstrata.tiering.disk_io import aligned_buffer, io_buffer
from kvstrata.tiering.io_pool import IoPool
from kvstrata.tiering.slab import SlabFiles
from kvstrata.tiering.slot_codec import stage, stashed_crc, unstage


class ReadBuffers:
    """Aligned slot-sized buffers for reads, handed back after use and read into again. On the VM
    measured, a fresh 0.74 MB buffer cost about 234 us of page faults before the first byte was
    read: about as long as reading it.

    The first `limit` buffers are slices of one arena on huge pages (disk_io.io_buffer), made on
    the first take: O_DIRECT reads into them run 2-3x faster than into buffers on 4 KB pages. Past
    those (all out at once), buffers are fresh, and at most `limit` of them wait here once handed
    back, arena buffers included; others go to the GC. An arena buffer never handed back is only
    lost to reuse."""

    def __init__(self, slot_bytes: int, limit: int):
        self.slot_bytes = slot_bytes
        self.limit = limit
        self._arena: torch.Tensor | None = None  # [limit * slot_bytes], made on the first take
        self._arena_used = 0  # arena buffers handed out so far at least once: 0 .. _arena_used - 1
        self._arena_free: list[int] = []  # of those, the ones handed back, by index
        self._free: dict[int, torch.Tensor] = {}  # others, by address: one handed back twice waits here once
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            self._make_arena()
            if self._arena_free or self._arena_used < self.limit:
                if self._arena_free:
                    i = self._arena_free.pop()
                else:
                    i, self._arena_used = self._arena_used, self._arena_used + 1
                return self._arena[i * self.slot_bytes:(i + 1) * self.slot_bytes]
            if self._free:
                return self._free.popitem()[1]
        return aligned_buffer(self.slot_bytes)  # [slot_bytes]

    def prefault(self, num_buffers: int) -> None:
        """Make the arena now and write its first num_buffers buffers (those the first takes hand
        out), so that the first reads into them do not fault their pages in. On 2-core VMs, a fresh
        huge page cost 1-6 ms to fault in, inside an O_DIRECT read or here: a fresh tier's first loads in
        `kvstrata bench tiering` ran at 0.1-1.1 GB/s until about 42 MB of buffers had been used once,
        and mostly at 1.4-2.3 after. Nothing if the arena is there already: its buffers may be in use."""
        with self._lock:
            if self._arena is None:
                self._make_arena()
                # numpy's fill on this thread: torch's zero_ would start an OpenMP team of threads
                self._arena[:min(num_buffers, self.limit) * self.slot_bytes].numpy().fill(0)

    def _make_arena(self) -> None:
        if self._arena is None:
            self._arena = io_buffer(self.limit * self.slot_bytes)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for buf in bufs:
                i = self._arena_index(buf)
                if i is not None:
                    if i not in self._arena_free:
                        self._arena_free.append(i)
                elif len(self._arena_free) + len(self._free) < self.limit:
                    self._free[buf.data_ptr()] = buf

    def buffer_of(self, block: torch.Tensor) -> torch.Tensor | None:
        """The read buffer a block returned by a read is a view of, or None for any other tensor
        (an arena slice, or aligned_buffer: one storage of slot_bytes + ALIGN bytes, the buffer at
        its aligned start)."""
        if block.device.type != "cpu":
            return None
        i = self._arena_index(block)
        if i is not None:
            return self._arena[i * self.slot_bytes:(i + 1) * self.slot_bytes]
        storage = block.untyped_storage()
        if storage.nbytes() != self.slot_bytes + ALIGN:
            return None
        start = -storage.data_ptr() % ALIGN
        return torch.empty(0, dtype=torch.uint8).set_(storage, start, (self.slot_bytes,))

    def _arena_index(self, t: torch.Tensor) -> int | None:
        """Which arena buffer `t` lies in (a whole buffer or a view into one), or None."""
        arena = self._arena
        if arena is None or t.untyped_storage().data_ptr() != arena.untyped_storage().data_ptr():
            return None
        offset = t.data_ptr() - arena.data_ptr()
        return offset // self.slot_bytes if 0 <= offset < arena.numel() else None

    def __len__(self) -> int:
        """Buffers handed back and waiting to be read into again."""
        return len(self._arena_free) + len(self._free)


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """One block to write into one slot."""

    slot: int
    block_hash: bytes
    parent_hash: bytes | None
    data: torch.Tensor
    seq: int  # the write's sequence number, in its header
    staged: torch.Tensor | None = None  # the slot buffer `data` was staged in (slot_stage.py), if it was


class SlotIO:
    """Runs of at most max_run adjacent slots (and never across a slab) per IO."""

    def __init__(self, slabs: SlabFiles, layout_tag: str, dtype: torch.dtype, block_shape: tuple[int, ...],
                 payload_bytes: int, max_run: int, buffers: ReadBuffers):
        self.slabs = slabs
        self.layout_tag = layout_tag
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.block_shape = block_shape
        self.payload_bytes = payload_bytes
        self.max_run = max_run
        self.buffers = buffers
        self._thread_local = threading.local()  # each IO thread's staging buffer
        self._heads = HeadPacker(layout_tag, self.dtype_name, block_shape, payload_bytes)

    def is_our_layout(self, header: BlockHeader) -> bool:
        return (header.layout_tag == self.layout_tag and header.dtype_name == self.dtype_name
                and header.shape == self.block_shape and header.payload_len == self.payload_bytes)

    # -- writes ----------------------------------------------------------------------------------
    def runs(self, items: list, limit: int | None = None, slot_of: Callable = lambda w: w.slot) -> list[list]:
        """Items (SlotWrites, or anything with slot_of) in slot order, cut into runs of adjacent
        slots (at most limit, default max_run, and within one slab)."""
        items = sorted(items, key=slot_of)
        slots = [slot_of(x) for x in items]
        out = []
        i = 0
        while i < len(items):
            n = self.slabs.run_length(slots, i, limit or self.max_run)
            out.append(items[i:i + n])
            i += n
        return out

    def write(self, writes: list[SlotWrite]) -> set[int]:
        """Write every block into its slot, each run of adjacent slots in one pwrite; the slots
        written. An IO error fails its own run's writes, not the others'."""
        written: set[int] = set()
        for run in self.runs(writes):
            try:
                self._write_run(run)
                written.update(w.slot for w in run)
            except Exception:  # noqa: BLE001 - whatever went wrong, these slots may hold anything now
                pass
        return written

    def submit_run(self, run: list[SlotWrite], pool: IoPool, done: Callable[[bool], None]) -> None:
        """Queue a run (see runs) of blocks all staged in their own write buffers on the IO pool, as
        one pwritev; done(written) on the pool's reaper thread, or here if it cannot be queued."""
        size = self.slabs.geometry.slot_bytes
        self._heads_into_staged(run)
        fd, offset = self.slabs.fd_at(run[0].slot)
        try:
            pool.submit(fd, True, offset, [(w.staged.data_ptr(), size) for w in run], lambda err: done(err == 0))
        except OSError:
            done(False)

    def _heads_into_staged(self, run: list[SlotWrite]) -> None:
        """Each staged block's head, its payload CRC taken from where staging stashed it."""
        for w in run:
            head = self._heads.pack(w.block_hash, w.parent_hash or b"", stashed_crc(w.staged), w.seq)
            ctypes.memmove(w.staged.data_ptr(), head, len(head))  # into the slot's first bytes (its write buffer)

    def _write_run(self, run: list[SlotWrite]) -> None:
        """Adjacent slots, staged one after another in this thread's aligned buffer, in one pwrite;
        slots all staged as they left DRAM are written from their own buffers, in one pwritev.

            staging: [ slot (slot_codec.py) ][ next slot ] ...
                     0                        S             2S
        """
        if all(w.staged is not None for w in run):  # staged as they left DRAM: only the headers are left
            self._heads_into_staged(run)
            self.slabs.write_run(run[0].slot, [memoryview(w.staged.numpy()) for w in run])
            return
        size = self.slabs.geometry.slot_bytes  # S
        staging = self._staging()  # [max_run * S]
        for k, w in enumerate(run):
            stage(staging[k * size:(k + 1) * size], self._header(w, 0), w.data)
        self.slabs.write(run[0].slot, memoryview(staging[:len(run) * size].numpy()))

    def _header(self, w: SlotWrite, payload_crc: int) -> BlockHeader:
        return BlockHeader(w.block_hash, w.parent_hash or b"", self.layout_tag, self.dtype_name, self.block_shape,
                           self.payload_bytes, payload_crc, w.seq)

    def _staging(self) -> torch.Tensor:
        """This IO thread's aligned staging buffer, a run of slots long, reused for every write."""
        staging = getattr(self._thread_local, "staging", None)
        if staging is None:
            staging = io_buffer(self.max_run * self.slabs.geometry.slot_bytes)
            self._thread_local.staging = staging
        return staging  # [max_run * slot_bytes]

    # -- reads -----------------------------------------------------------------------------------
    def read_raw(self, slots: list[int]) -> tuple[list[torch.Tensor], list[bool]]:
        """Adjacent slots (see run_length) in one preadv, unchecked: a buffer [slot_bytes] each, and
        whether it was read. If the preadv fails, the slots are read one by one, so that only a bad
        slot is lost."""
        bufs = [self.buffers.take() for _ in slots]  # the blocks will be views of them
        try:
            self.slabs.read_run(slots[0], bufs)
            return bufs, [True] * len(slots)
        except (OSError, ValueError):
            return bufs, self.read_each(slots, bufs)

    def submit_read(self, slots: list[int], pool: IoPool,
                    done: Callable[[list[torch.Tensor], list[bool], list[int] | None], None]) -> None:
        """read_raw on the IO pool: adjacent slots in one preadv, queued; done(bufs, read_ok, crcs) on
        the pool's reaper thread (or here, if it cannot be queued), crcs being each slot's payload
        CRC as its IO thread took it right after the read (see check_run), or None. If the preadv
        fails, the slots are read one by one there, so that only a bad slot is lost."""
        bufs = [self.buffers.take() for _ in slots]
        fd, offset = self.slabs.fd_at(slots[0])
        crcs = (ctypes.c_uint32 * len(slots))()

        def ended(err: int) -> None:
            if err == 0:
                done(bufs, [True] * len(slots), list(crcs))
            else:
                done(bufs, self.read_each(slots, bufs), None)

        try:
            pool.submit(fd, False, offset, [(b.data_ptr(), b.numel()) for b in bufs], ended, crcs, self.crc_span)
        except OSError:
            ended(1)

    @property
    def crc_span(self) -> tuple[int, int]:
        """(offset, length) of the payload in a slot whose header takes its first ALIGN bytes, as in
        every slot the C IO threads write (they need the C staging, slot_stage.py): what their reads
        checksum."""
        return ALIGN, self.payload_bytes

    def read_each(self, slots: list[int], bufs: list[torch.Tensor]) -> list[bool]:
        """Each slot in its own pread; whether each was read."""
        return [self._try_read(slot, buf) for slot, buf in zip(slots, bufs)]

    def check_run(self, bufs: list[torch.Tensor], read_ok: list[bool], hashes: list[bytes],
                  crcs: list[int] | None = None) -> list[tuple[torch.Tensor | None, bool]]:
        """For buffers read_raw filled: (block, False) for each good one, a view of its buffer, and
        (None, True) for a bad one (IO error, no header, another block or layout, a failed
        checksum), whose buffer goes back to the pool. crcs: each buffer's CRC over crc_span, taken
        after the read, which the check compares where the header puts the payload exactly there
        (else it takes its own)."""
        crcs = crcs or [None] * len(bufs)
        out = [self._check(buf, block_hash, crc) if ok else (None, True)
               for buf, block_hash, ok, crc in zip(bufs, hashes, read_ok, crcs)]
        self.buffers.give([buf for buf, (block, _) in zip(bufs, out) if block is None])
        return out

    def _try_read(self, slot: int, buf: torch.Tensor) -> bool:
        try:
            self.slabs.read(slot, buf)
            return True
        except (OSError, ValueError):
            return False

    def _check(self, buf: torch.Tensor, block_hash: bytes, crc: int | None = None) -> tuple[torch.Tensor | None, bool]:
        try:
            known = None if crc is None else (*self.crc_span, crc)
            return unstage(buf, block_hash, self.is_our_layout, self.dtype, self.block_shape, known), False
        except ValueError:
            return None, True
