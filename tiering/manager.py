"""Moves KV blocks between the device pool and the tiers below it.

    device pool (HBM) --evict--> DRAM (HostTier) --evict--> NVMe (NvmeTier)
          ^                          |   ^                      |
          +------- promote ----------+   +------- load ---------+  (IO threads; the step loop never waits)

- Demotion: when the device pool reuses cached blocks, their data is gathered in one copy into DRAM,
  and whatever DRAM evicts to make room is written to NVMe. DRAM and the device are exclusive (a block
  is promoted out of DRAM); NVMe is inclusive, so a warm NVMe tier survives a restart.
- Admission: every block the device pool evicts is copied into DRAM (a memcpy is cheap, and DRAM is
  where a conversation's newest blocks wait for its next turn). A disk write costs bandwidth and
  wear, so once NVMe is full, a DRAM eviction is written there only if it earned it (see
  `AdmissionPolicy`): a block that displaces another must have been asked for twice.
- Lookup: a request's chain continues from the device into DRAM, then NVMe. Blocks in DRAM are
  promoted (one scatter) when the request is admitted. Blocks only on NVMe are first loaded into
  DRAM by the tier's IO threads while the request waits; a failed read (a corrupt file) ends the
  chain there, and the rest is recomputed (tier_loads.py, which TierManager inherits).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from kvstrata.tiering.admission import AdmissionPolicy
from kvstrata.tiering.block_copy import copy_to_device, copy_to_host
from kvstrata.tiering.host import HostTier
from kvstrata.tiering.pins import PinTable
from kvstrata.tiering.rank_mirror import CLEAR, SPILL, TO_DEVICE, TO_HOST, TierOp, encode_hashes
from kvstrata.tiering.tier_loads import DRAM, HBM, NVME, TierLoads
from kvstrata.worker.kv_cache_manager import SWAP_PREFIX
from kvstrata.worker.prefix_cache import EvictedBlock


@dataclass
class TierCounters:
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    spilled_to_nvme: int = 0
    loaded_from_nvme: int = 0
    failed_loads: int = 0
    demote_bytes: int = 0
    demote_seconds: float = 0.0  # in the copies themselves: bytes / seconds is the transfer rate
    demote_overhead_seconds: float = 0.0  # the rest of a demotion or swap-out: the tier's bookkeeping
    promote_bytes: int = 0
    promote_seconds: float = 0.0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_fallbacks: int = 0  # swaps whose blocks DRAM could not keep: recomputed instead
    spill_drops: int = 0  # DRAM evictions not written to NVMe because too many writes were queued
    admission_rejects: int = 0  # DRAM evictions the admission policy kept off a full NVMe tier
    spill_refreshes: int = 0  # DRAM evictions NVMe held already: refreshed there, with no copy made


class TierManager(TierLoads):
    def __init__(self, kv_cache: torch.Tensor, host: HostTier, nvme=None, max_load_blocks: int | None = None,
                 pin_quota_blocks: int | None = None, admission: AdmissionPolicy | None = None,
                 clock=time.monotonic):
        self.kv_cache = kv_cache
        self.host = host
        self.nvme = nvme
        self.admission = admission or AdmissionPolicy()
        # how many times each recently computed block hash was computed (a bounded, oldest-first
        # record): the admission policy's evidence of a block that missed and was asked for again
        self._computed: OrderedDict[bytes, int] = OrderedDict()
        nvme_blocks = nvme.capacity_bytes // nvme.file_bytes if nvme is not None else 0
        self.max_tracked_hashes = 4 * (host.num_blocks + nvme_blocks)
        host.has_lower_tier = nvme is not None
        if nvme is not None:  # a block DRAM evicts is copied straight into a write buffer of the tier
            host.copy_out = nvme.staged_copy
            host.lower_has = nvme.__contains__  # a block on NVMe leaves DRAM without a copy: a refresh
        # prompt-cache pins, which must all fit the lowest tier: half of it, and a quota per tenant
        self.pins = PinTable((nvme_blocks or host.num_blocks) // 2, pin_quota_blocks, host.block_bytes, clock)
        # one-pass block copies between the pool and DRAM when both are in host memory
        self.kernels = None
        if kv_cache.device.type == "cpu" and kv_cache.is_contiguous():
            from kvstrata.worker.cpu_kernels import load_cpu_kernels

            self.kernels = load_cpu_kernels()
        self.counters = TierCounters()
        # on CUDA, copies to and from pinned DRAM are queued on a copy stream (cuda_copy.py); the CPU
        # waits for them only before it touches DRAM slots itself
        self.cuda = None
        if kv_cache.is_cuda:
            from kvstrata.tiering.cuda_copy import CudaBlockCopier

            self.cuda = CudaBlockCopier(kv_cache, host.storage, self.counters)
            host.wait_copies = self.cuda.wait
        # a request takes at most this many blocks from the tiers, and at most this many are in
        # flight from NVMe, so that loads cannot push each other (or a request's own chain) out of DRAM
        self.max_load_blocks = max_load_blocks or max(1, host.num_blocks // 2)
        # DRAM evictions queued for NVMe at most; beyond, unpinned ones are dropped (backpressure)
        self.max_pending_writes = 256
        self.recorder = None  # KV events for the shared index (an EventRecorder), when published
        # with tensor parallelism: the tier ops rank 0 made, for the other ranks to repeat (None: not
        # recorded); how many blocks of each NVMe load every rank has read (rank_mirror.py); and how
        # to ask the ranks when no step is running
        self.copy_log: list[TierOp] | None = None
        self.group_reads: dict[int, int] | None = None
        self.sync_group: Callable[[], None] | None = None
        self._init_loads()

    # -- device -> DRAM -> NVMe ------------------------------------------------------------------
    def demote(self, evicted: list[EvictedBlock]) -> None:
        """Keep device blocks the pool is about to reuse, leaf first."""
        if not evicted:
            return
        keys = [e.block_hash for e in evicted]
        spilled, mark = self._put_from_pool(keys, [e.parent_hash for e in evicted], [e.block_id for e in evicted],
                                            [e.hits for e in evicted])
        c = self.counters
        c.demoted_blocks += len(evicted)
        if self.recorder is not None:
            kept = [k for k in keys if k in self.host]
            self.recorder.moved(kept, HBM, DRAM)
            self.recorder.removed([k for k in keys if k not in self.host], HBM)
        self._spill(spilled, mark)

    def _put_from_pool(self, keys: list[bytes], parents: list[bytes | None], block_ids: list[int],
                       hits: list[int] | None = None) -> tuple[list, int]:
        """Store pool blocks in DRAM under keys, copied straight into the tier's slots; returns what
        DRAM evicted, and where in the copy log its spills go. The copy and the bookkeeping around it
        are timed apart (transfer rate, and overhead)."""
        c = self.counters
        copy_seconds = 0.0

        def fill(rows: list[int], slots: list[int]) -> None:
            nonlocal copy_seconds
            src = [block_ids[r] for r in rows]
            if self.cuda is not None:  # queued: its bytes and seconds count once the copy stream is done
                self.cuda.to_host(src, slots)
            else:
                t = time.perf_counter()
                copy_to_host(self.kv_cache, src, self.host.storage, slots, self.kernels)
                copy_seconds = time.perf_counter() - t
                c.demote_bytes += len(src) * self.host.block_bytes
            if self.copy_log is not None:
                self.copy_log.append((TO_HOST, src, slots))

        t0 = time.perf_counter()
        mark = self._log_mark()
        spilled = self.host.put(keys, parents, fill=fill, hits=hits)
        c.demote_seconds += copy_seconds
        c.demote_overhead_seconds += time.perf_counter() - t0 - copy_seconds
        return spilled, mark

    def drain_copy_log(self) -> list[TierOp]:
        """The tier ops made since the last drain, in order: what other tensor-parallel ranks must
        repeat on their own shards (rank_mirror.py)."""
        log, self.copy_log = self.copy_log or [], ([] if self.copy_log is not None else None)
        return log

    def _log_mark(self) -> int:
        """Where the copy log stands before a DRAM put: the put's evictions are spilled from their
        slots before the put's own copies overwrite them, so their SPILL ops go here."""
        return len(self.copy_log) if self.copy_log is not None else 0

    # -- pins (prompt-cache breakpoints with a TTL) -------------------------------------------------
    def attach_events(self, recorder) -> None:
        """Record KV events for the shared index: what enters and leaves DRAM and NVMe."""
        self.recorder = recorder
        if self.nvme is not None:
            self.nvme.on_evict = lambda hashes: recorder.removed(hashes, NVME)

    def pin(self, hashes: list[bytes], ttl_s: float, tenant: str) -> None:
        """Keep these blocks (a prefix chain) for ttl_s seconds: they may be demoted, never dropped.
        Pinning again extends the TTL. ValueError (naming cache_control) past a quota (pins.py)."""
        self.pins.add(hashes, ttl_s, tenant)
        self._publish_pins()

    def expire_pins(self, now: float | None = None) -> None:
        if self.pins.expire(now):
            self._publish_pins()

    def pinned_blocks(self, tenant: str | None = None) -> int:
        return self.pins.count(tenant)

    def _publish_pins(self) -> None:
        snapshot = self.pins.snapshot()  # read by the NVMe IO threads: replaced, never mutated
        self.host.pinned = snapshot
        if self.nvme is not None:
            self.nvme.pinned = snapshot

    # -- swap ------------------------------------------------------------------------------------
    def swap_out(self, keys: list[bytes], block_ids: list[int]) -> bool:
        """Copy a preempted request's blocks into DRAM under private keys, in one gather. False
        (and nothing kept) when DRAM cannot hold them all: the request is recomputed instead."""
        if len(keys) > self.host.num_blocks:
            self.counters.swap_fallbacks += 1
            return False
        spilled, mark = self._put_from_pool(keys, [None] * len(keys), block_ids)
        c = self.counters
        self._spill(spilled, mark)
        if not self.has_all(keys):  # DRAM is smaller than the request: keep nothing
            self.host.discard(keys)
            c.swap_fallbacks += 1
            return False
        c.swapped_out_blocks += len(keys)
        return True

    def note_computed(self, hashes: list[bytes]) -> None:
        """Blocks a request has just computed (and cached): the admission policy counts them."""
        seen = self._computed
        for h in hashes:
            seen[h] = seen.pop(h, 0) + 1
        while len(seen) > self.max_tracked_hashes:
            seen.popitem(last=False)

    def has_all(self, keys: list[bytes]) -> bool:
        return all(k in self.host for k in keys)

    def hits(self, keys: list[bytes]) -> list[int]:
        """The reuse counts DRAM holds for these blocks (all must be there)."""
        return [self.host.entries[k].hits for k in keys]

    def discard(self, keys: list[bytes]) -> None:
        self.host.discard(keys)

    def _spill(self, spilled: list, mark: int) -> None:
        """Blocks DRAM evicted go to NVMe; swap blocks (private keys) are not worth a disk write.
        `mark`: where in the copy log the other ranks' SPILL ops go (see _log_mark)."""
        rec = self.recorder
        if self.nvme is None:
            if rec is not None:
                rec.removed([e.block_hash for e in spilled if not e.block_hash.startswith(SWAP_PREFIX)], DRAM)
            return
        nvme = self.nvme
        puts = []  # queued together, so that the IO threads share the burst out in large writes
        new_writes = 0  # of those, blocks not on NVMe yet (a put of one that is only refreshes it)
        for ev in spilled:
            if ev.block_hash.startswith(SWAP_PREFIX):
                nvme.release_staged(ev.data)
                continue
            if rec is not None:  # leaves DRAM; NVMe may keep it (its write may still fail: advisory)
                rec.removed([ev.block_hash], DRAM)
            pinned = ev.block_hash in self.pins
            on_disk = ev.block_hash in nvme
            if ev.data is None and not on_disk:  # on NVMe as DRAM let it go (no copy made), evicted since
                continue
            pending = nvme.num_pending_writes + new_writes
            disk_full = nvme.used_bytes + (pending + 1) * nvme.file_bytes > nvme.capacity_bytes
            times_computed = self._computed.get(ev.block_hash, 0)
            if not self.admission.admits(ev.hits, times_computed, pinned, disk_full) and not on_disk:
                self.counters.admission_rejects += 1
                nvme.release_staged(ev.data)
                continue
            if pending >= self.max_pending_writes and not pinned:
                self.counters.spill_drops += 1  # the disk is behind: drop rather than queue without bound
                nvme.release_staged(ev.data)
                continue
            puts.append((ev.block_hash, ev.parent_hash, ev.data))
            new_writes += not on_disk
            self.counters.spill_refreshes += ev.data is None
            if self.copy_log is not None:
                hashes = encode_hashes([ev.block_hash, ev.parent_hash or b""])
                self.copy_log.insert(mark, (SPILL, [ev.slot], hashes))
                mark += 1
            self.counters.spilled_to_nvme += 1
            if rec is not None:
                rec.stored([ev.block_hash], ev.parent_hash, NVME)
        if puts:
            nvme.put_many(puts)

    # -- promotion --------------------------------------------------------------------------------
    def bring_back(self, keys: list[bytes], allocate: Callable[[int], list], swap: bool = False) -> list:
        """Move blocks (all in DRAM) into fresh pool blocks from allocate(n), in one copy; returns
        those blocks. The DRAM slots stay reserved until the copy is done, because the allocation
        may demote other blocks into DRAM. `swap`: a swap-in, not a cache hit, in the counters."""
        slots = self.host.detach(keys)
        if self.recorder is not None and not swap:
            self.recorder.removed(keys, DRAM)  # the pool records them stored in HBM as it caches them
        blocks = allocate(len(keys))  # not timed: it may demote other blocks, which count as demotion
        t0 = time.perf_counter()
        ids = [b.block_id for b in blocks]
        c = self.counters
        if self.cuda is not None:  # queued before the forward pass; counted once done (settle)
            self.cuda.to_device(slots, ids)
        else:
            copy_to_device(self.host.storage, slots, self.kv_cache, ids, self.kernels)
            c.promote_bytes += len(keys) * self.host.block_bytes
            c.promote_seconds += time.perf_counter() - t0
        if self.copy_log is not None:
            self.copy_log.append((TO_DEVICE, slots, ids))
        self.host.release(slots)
        if swap:
            c.swapped_in_blocks += len(keys)
        else:
            c.promoted_blocks += len(keys)
        return blocks

    # -- upkeep ----------------------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every block in DRAM and on NVMe; returns how many."""
        self._cancel_loads()
        if self.copy_log is not None:
            self.copy_log.append((CLEAR, [], []))
        self.pins.clear()  # an operator's flush overrides pins
        self._publish_pins()
        if self.recorder is not None:
            self.recorder.removed([h for h in self.host.entries if not h.startswith(SWAP_PREFIX)], DRAM)
        n = self.host.clear()
        if self.nvme is not None:
            self.nvme.flush()
            gone = [h for h in self.nvme.hashes() if self.nvme.discard(h)]
            n += len(gone)
            if self.recorder is not None:
                self.recorder.removed(gone, NVME)
        return n

    def close(self) -> None:
        if self.nvme is not None:
            self.nvme.close()

    def stats(self) -> dict:
        if self.cuda is not None:
            self.cuda.settle()
        c = self.counters
        out = {
            "pinned_blocks": len(self.pins),
            "dram": {**self.host.stats(), "promoted_blocks": c.promoted_blocks, "demoted_blocks": c.demoted_blocks,
                     "swapped_out_blocks": c.swapped_out_blocks, "swapped_in_blocks": c.swapped_in_blocks,
                     "swap_fallbacks": c.swap_fallbacks,
                     "swapped_out_bytes": c.swapped_out_blocks * self.host.block_bytes,
                     "swapped_in_bytes": c.swapped_in_blocks * self.host.block_bytes,
                     # cumulative, for rates over any window (bytes over seconds in the copies themselves)
                     "demote_bytes": c.demote_bytes, "demote_seconds": round(c.demote_seconds, 6),
                     "promote_bytes": c.promote_bytes, "promote_seconds": round(c.promote_seconds, 6),
                     "demote_gb_per_s": _rate(c.demote_bytes, c.demote_seconds),
                     "demote_overhead_s": round(c.demote_overhead_seconds, 6),
                     "promote_gb_per_s": _rate(c.promote_bytes, c.promote_seconds)},
        }
        if self.nvme is not None:
            out["nvme"] = {**self.nvme.stats(), "spilled_blocks": c.spilled_to_nvme, "spill_drops": c.spill_drops,
                           "spill_refreshes": c.spill_refreshes,
                           "admission": self.admission.mode, "admission_rejects": c.admission_rejects,
                           "loaded_blocks": c.loaded_from_nvme, "failed_loads": c.failed_loads,
                           "loads_in_flight": len(self.loading)}
        return out

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.nvme is not None:
            assert self.nvme.num_staged == 0, "a block staged for NVMe was neither put nor released"
            self.nvme.flush()
            self.nvme.check_integrity()



def _rate(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0
