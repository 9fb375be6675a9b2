"""The NVMe tier's write path (NvmeTier inherits it; the state it works on is NvmeTier's): puts
queue blocks, each IO thread takes an even share of the queue, gives the blocks slots (evicting
where none is free) and writes each run of adjacent slots in one pwrite; with the C IO threads, the
caller queues every run on the IO pool and each run ends on its reaper. A block is indexed once its
slot is written; a write discarded or failed meanwhile has its slot erased.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvstrata.tiering.slot_io import SlotWrite


@dataclass(slots=True, eq=False)
class PendingWrite:
    """A put not yet indexed: queued, or taken by an IO thread and being written."""

    block_hash: bytes
    parent_hash: bytes | None
    data: torch.Tensor
    staged: torch.Tensor | None = None  # the write buffer `data` was staged in (slot_stage.py)
    future: Future = field(default_factory=Future)
    tick: int = 0  # the block's recency in the index, taken with its slot


def resolved(value) -> Future:
    """A future that already holds `value`."""
    future: Future = Future()
    future.set_result(value)
    return future


class NvmeWrites:
    """put, put_many and the staged copies they write from, then the IO threads' side of writing."""

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
                        futures.append(resolved(True))
                    else:
                        futures.append(pending.future if pending is not None else resolved(False))
                    continue
                if data is None:  # a refresh of a block the tier no longer holds: nothing to write
                    futures.append(resolved(False))
                    continue
                if self._pool is not None:  # the payload in its write buffer (_claim_or_stage)
                    data = self._staged.payload(buf, data)
                pending = PendingWrite(block_hash, parent_hash, data, buf)
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
        taken: list[tuple[PendingWrite, SlotWrite | None]] = []
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

    def _take(self, limit: int, taken: list[tuple[PendingWrite, SlotWrite | None]]) -> None:
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
        taken: list[tuple[PendingWrite, SlotWrite | None]] = []
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

    def _end_writes(self, taken: list[tuple[PendingWrite, SlotWrite | None]], written: set[int],
                    start: float) -> None:
        """Index what was written and is still wanted; erase the rest's slots; resolve the futures.
        A write stays in flight until its slot is erased, so flush waits for that too."""
        results: list[tuple[PendingWrite, bool]] = []
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
