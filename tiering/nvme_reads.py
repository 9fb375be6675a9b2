"""The NVMe tier's read path (NvmeTier inherits it; the state it works on is NvmeTier's): a batch of
reads sorts its slots and reads each run of adjacent slots in one preadv, on the C IO pool (checked
on its reaper) or split among the Python IO threads (checked on checker threads while the next run
reads). A slot being read is neither evicted nor erased until its read ends; a bad slot reads as a
miss and is dropped and erased.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import torch

from kvstrata.tiering.nvme_index import IndexEntry
from kvstrata.tiering.nvme_writes import resolved

_ToRead = tuple[int, bytes, IndexEntry]  # (place in the answer, block, its entry when asked)


class NvmeReads:
    """get, get_many and recycle, then the IO threads' side of reading."""

    def get(self, block_hash: bytes) -> Future:
        """The block's tensor, or None for a miss (absent, or a bad slot, which is then dropped)."""
        with self._lock:
            self._check_open()
            found = self._begin_read(block_hash)
            if isinstance(found, IndexEntry):
                return self._executor.submit(self._read_one, block_hash, found)
        return resolved(found)

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
        timed = None  # (run size, when submitted) of a burst whose rate the run size chooser takes
        if self._pool is not None and ordered:
            futures, timed = self._submit_reads(ordered, out)
        if not futures:
            return resolved(out)
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
            if timed is not None:
                read = sum(out[i] is not None for i, _, _ in to_read) * self.geometry.slot_bytes
                self._read_runs.record(timed[0], read, time.perf_counter() - timed[1])
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

    def _submit_reads(self, batch: list[_ToRead], out: list) -> tuple[list[Future], tuple[int, float] | None]:
        """With C IO, on the caller's thread: begin the reads and queue each run of adjacent slots on
        the IO pool as one preadv (as many runs as threads where the batch allows, each of at most
        the slots the run size chooser picks); a future per run, resolved on the reaper once the run
        is checked and its slots let go. Also (the size, when submitted) where the candidate sizes
        would cut this batch differently (a burst the chooser times; with one size, any burst of more
        blocks than threads, for its rate in stats), else None."""
        submitted = time.perf_counter()
        reading = self._begin_reads(batch)
        futures = []
        limits = {n: self._run_limit(len(reading), n) for n in self._read_runs.candidates}
        timed = len(set(limits.values())) > 1 or (len(limits) == 1 and len(reading) > self.num_io_threads)
        size = self._read_runs.pick() if timed else self._read_runs.best()
        limit = limits[size]
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
        return futures, (size, submitted) if timed else None

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
