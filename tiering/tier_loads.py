"""The tier manager's loads from NVMe into DRAM (TierManager inherits them; the state they work on
is TierManager's): a request's lookup continues its chain from DRAM onto NVMe, whose IO threads
read the blocks it finds while the request waits; each step's poll moves finished loads into DRAM,
from where bring_back promotes them. A failed read ends the chain there (the rest is recomputed).
With tensor parallelism a load counts only as far as every rank has read it (rank_mirror.py).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass

from kvstrata.tiering.block_copy import copy_blocks_into
from kvstrata.tiering.rank_mirror import COMMIT, LOAD, encode_hashes, read_status

HBM, DRAM, NVME = 1, 2, 3  # kvstrata.v1.Tier, for KV events


@dataclass
class _Load:
    load_id: int
    hashes: list[bytes]
    parents: list[bytes | None]
    future: Future


class TierLoads:
    """lookup, poll and wait_for_loads, and what rank 0 asks of the other ranks about loads."""

    def _init_loads(self) -> None:
        self.loads: list[_Load] = []
        self._load_ids = itertools.count()
        self.loading: set[bytes] = set()  # blocks some load is reading

    def _cancel_loads(self) -> None:
        """Cancel every load, wait for those already reading, and forget them all."""
        for load in self.loads:
            load.future.cancel()
        for load in self.loads:
            try:
                load.future.result()
            except BaseException:  # noqa: S110 - cancelled or failed: dropped anyway
                pass
        self.loads.clear()
        self.loading.clear()
        if self.group_reads is not None:
            self.group_reads.clear()

    def lookup(self, hashes: list[bytes], allow_load: bool = True) -> tuple[int, bool]:
        """How many of `hashes` (the uncached rest of a request's chain) are in DRAM from the first,
        and whether more of the chain is on its way from NVMe (the request should wait for it).
        With allow_load False, NVMe is not consulted: the request takes what DRAM has now."""
        self.poll()
        self.expire_pins()
        n = min(self.host.match(hashes), self.max_load_blocks)
        rest = hashes[n:]
        if not rest or self.nvme is None or not allow_load:
            return n, False
        if rest[0] in self.loading:
            return n, True
        k = 0
        budget = min(self.max_load_blocks - n, self.max_load_blocks - len(self.loading))
        while k < len(rest) and k < budget and rest[k] in self.nvme:
            k += 1
        if not k:
            return n, False
        wanted = rest[:k]
        parents = [self.nvme.parent_of(h) for h in wanted]
        load = _Load(next(self._load_ids), wanted, parents, self.nvme.get_many(wanted))
        self.loads.append(load)
        self.loading.update(wanted)
        if self.copy_log is not None:
            self.copy_log.append((LOAD, [load.load_id], encode_hashes(wanted)))
        return n, True

    def poll(self) -> None:
        """Move finished NVMe loads into DRAM (engine thread only); with tensor parallelism, only
        loads every rank has read, and only as many blocks as every rank read."""
        if not self.loads:
            return
        still = []
        for load in self.loads:
            good = read_status(load.future)
            if self.group_reads is not None and good >= 0:
                good = min(good, self.group_reads.get(load.load_id, -1))
            if good < 0:
                still.append(load)
                continue
            self.loading.difference_update(load.hashes)
            self.counters.failed_loads += len(load.hashes) - good
            self._commit(load, good)
        self.loads = still

    def _commit(self, load: _Load, good: int) -> None:
        """The first `good` blocks of a finished load into DRAM; the other ranks copy theirs into the
        same slots."""
        read_here = read_status(load.future)  # blocks read on this rank: `good`, or more with other ranks
        if self.group_reads is not None:
            self.group_reads.pop(load.load_id, None)
            for h in load.hashes[good:read_here]:  # another rank missed them: write them anew next time
                self.nvme.discard(h)
        hashes, rows, slots = load.hashes[:good], [], []
        if good:
            blocks = load.future.result()
            was_here = [h in self.host for h in hashes]
            mark = self._log_mark()
            # a block read back from NVMe is being reused: it counts one hit
            def fill(rows: list[int], slots: list[int]) -> None:
                self.host.wait_copies()
                copy_blocks_into(self.host.storage, slots, [blocks[r] for r in rows])

            spilled = self.host.put(hashes, load.parents[:good], hits=[1] * good, fill=fill)
            self._spill(spilled, mark)
            rows = [i for i, h in enumerate(hashes) if not was_here[i] and h in self.host]
            slots = [self.host.entries[hashes[i]].slot for i in rows]
            if self.recorder is not None:
                for h, parent in zip(hashes, load.parents[:good]):
                    if h in self.host:
                        self.recorder.stored([h], parent, DRAM)
            self.counters.loaded_from_nvme += good
        if read_here > 0:  # copied out, or not wanted: their read buffers are read into again
            self.nvme.recycle(load.future.result())
        if self.copy_log is not None:
            self.copy_log.append((COMMIT, [load.load_id, *rows], slots))

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to timeout for one NVMe load (used when nothing else can run); with tensor
        parallelism, then ask the ranks how far they have read."""
        if not self.loads:
            return
        try:
            self.loads[0].future.result(timeout=timeout)
        except Exception:  # noqa: S110 - reported by poll()
            pass
        if self.sync_group is not None:
            before = len(self.loads)
            self.sync_group()
            self.poll()
            if len(self.loads) == before:
                time.sleep(min(timeout, 0.002))  # the ranks are still reading: do not spin on them
            return
        self.poll()

    # -- tensor-parallel loads -------------------------------------------------------------------
    def pending_load_ids(self) -> list[int]:
        """The loads whose group status rank 0 needs: those not yet read by every rank."""
        return [load.load_id for load in self.loads]

    def load_statuses(self, load_ids: list[int]) -> list[int]:
        """Rank 0's own read status of each load (rank_mirror.read_status)."""
        futures = {load.load_id: load.future for load in self.loads}
        return [read_status(futures.get(i)) for i in load_ids]

    def note_group_reads(self, load_ids: list[int], statuses: list[int]) -> None:
        """The group's answer (the minimum over ranks) for these loads, for the next poll."""
        self.group_reads.update(zip(load_ids, statuses))
