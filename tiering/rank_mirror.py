"""The tier operations that the other ranks of a tensor-parallel group repeat on their own shards.

Rank 0's TierManager decides every move. Every other rank holds its share of each DRAM slot and an
NVMe directory of its own, and repeats what rank 0 did, in rank 0's order, before its next forward
pass (the ops ride in the step message as int64 fields):

    op          rank 0 did                                     another rank does
    TO_HOST     pool blocks -> DRAM slots                      the same copy on its shard
    TO_DEVICE   DRAM slots -> pool blocks                      the same copy
    SPILL       wrote an evicted DRAM slot to NVMe as a hash   copies its share of the slot now (a later
                                                               op may reuse the slot) into an NVMe write
                                                               buffer, unless its NVMe holds the block
                                                               (a refresh); a run of SPILLs is put together
    LOAD        started reading a chain of hashes from NVMe    starts reading its shares of them
    COMMIT      put the first blocks of a load into DRAM slots copies what it read into the same slots
    CLEAR       dropped every NVMe block and load              the same

A load is committed only once every rank has read it. Each step (or a SYNC message, when nothing
can run) carries rank 0's pending load ids, and every rank answers in one all-reduce (MIN) with how
many blocks of each load, from the first, it read (-1 while still reading). A block that one rank
failed to read (a corrupt or evicted slot of its own) is a miss for the whole group, so no rank ever
runs on KV another rank lacks; rank 0 drops it from its NVMe, and the next demotion writes it anew.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy
import torch

from kvstrata.tiering.block_copy import block_shape, copy_blocks_into, copy_to_device, copy_to_host
from kvstrata.tiering.host import host_storage

TO_HOST, TO_DEVICE, SPILL, LOAD, COMMIT, CLEAR = 1, 2, 3, 4, 5, 6
READING = -1  # a load's status while some rank is still reading it

TierOp = tuple[int, list[int], list[int]]  # (kind, a, b); what a and b hold depends on the kind


def encode_hashes(hashes: list[bytes]) -> list[int]:
    """Hashes as int64 words for the step message: per hash its length, then its bytes, zero-padded
    to whole words.   b"\\x01..\\x20" (32 bytes) -> [32, w0, w1, w2, w3]"""
    out: list[int] = []
    for h in hashes:
        padded = h + bytes(-len(h) % 8)
        out.append(len(h))
        out.extend(numpy.frombuffer(padded, dtype="<i8").tolist())
    return out


def decode_hashes(words: list[int]) -> list[bytes]:
    """The inverse of encode_hashes."""
    out = []
    i = 0
    while i < len(words):
        n = words[i]
        k = -(-n // 8)
        out.append(numpy.array(words[i + 1:i + 1 + k], dtype="<i8").tobytes()[:n])
        i += 1 + k
    return out


def read_status(future: Future | None) -> int:
    """How many blocks of a load, from the first, were read: READING while in flight, 0 for a load
    this rank never started (it joined after a restart)."""
    if future is None:
        return 0
    if not future.done():
        return READING
    try:
        blocks = future.result()
    except Exception:  # noqa: BLE001 - an IO error is a miss, as on rank 0
        return 0
    good = 0
    while good < len(blocks) and blocks[good] is not None:
        good += 1
    return good


class RankTiers:
    """Another rank's DRAM shard and NVMe tier, driven by rank 0's ops (see the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, nvme=None, kernels=None):
        self.kv_cache = kv_cache
        self.storage = host_storage(num_host_blocks, block_shape(kv_cache), kv_cache.dtype, pin=kv_cache.is_cuda)
        self.nvme = nvme
        self.kernels = kernels
        self.loads: dict[int, Future] = {}

    def apply(self, ops: list[TierOp]) -> None:
        spills = []  # consecutive SPILL ops: copied out at once, put together as rank 0 puts them
        try:
            self._apply(ops, spills)
        except BaseException:
            for _, _, data in spills:  # copied out but not put: their write buffers go back
                self.nvme.release_staged(data)
            raise

    def _apply(self, ops: list[TierOp], spills: list) -> None:
        for kind, a, b in ops:
            if kind == SPILL:
                block_hash, parent = decode_hashes(b)
                # a block this rank's NVMe holds already is only refreshed, without a copy, as on rank 0
                data = None if block_hash in self.nvme else self.nvme.staged_copy(self.storage[a[0]])
                spills.append((block_hash, parent or None, data))
                continue
            if kind not in (TO_HOST, TO_DEVICE, LOAD, COMMIT, CLEAR):
                raise ValueError(f"unknown tier op {kind}")
            if spills:  # before any other op, which may read them back or reuse their DRAM slots
                self.nvme.put_many(spills)
                spills.clear()
            if kind == TO_HOST:
                copy_to_host(self.kv_cache, a, self.storage, b, self.kernels)
            elif kind == TO_DEVICE:
                copy_to_device(self.storage, a, self.kv_cache, b, self.kernels)
            elif kind == LOAD:
                self.loads[a[0]] = self.nvme.get_many(decode_hashes(b))
            elif kind == COMMIT:
                self._commit(a[0], a[1:], b)
            else:
                self._clear()
        if spills:
            self.nvme.put_many(spills)
            spills.clear()

    def statuses(self, load_ids: list[int]) -> list[int]:
        return [read_status(self.loads.get(i)) for i in load_ids]

    def _commit(self, load_id: int, rows: list[int], slots: list[int]) -> None:
        """Rows of load `load_id` (all read here: the group agreed) into DRAM slots; the load ends."""
        future = self.loads.pop(load_id, None)
        if read_status(future) <= 0:
            return
        blocks = future.result()
        copy_blocks_into(self.storage, slots, [blocks[r] for r in rows])
        self.nvme.recycle(blocks)  # copied out, or not wanted: their read buffers are read into again

    def _clear(self) -> None:
        for future in self.loads.values():
            future.cancel()
        for future in self.loads.values():
            try:
                future.result()
            except BaseException:  # noqa: S110 - cancelled or failed: dropped anyway
                pass
        self.loads.clear()
        if self.nvme is not None:
            self.nvme.flush()
            for h in self.nvme.hashes():
                self.nvme.discard(h)

    def close(self) -> None:
        if self.nvme is not None:
            self.nvme.close()
