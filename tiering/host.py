"""The DRAM tier: host copies of KV blocks, keyed by block hash, below the device pool.

Storage is one tensor `[num_blocks, *block_shape]`, block-major, so that one block is one contiguous
run of bytes (what the NVMe tier writes) and many blocks move in one `index_copy_` / `index_select`.
On a CUDA device it is pinned, so copies to and from the device can run asynchronously; on a CPU
it lies on transparent huge pages where the host gives them (`host_storage`).

Each entry remembers its parent's hash. Eviction is least-recently-used among entries with no child
in this tier (leaf first), as in the device pool, so what stays is always a matchable chain.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvstrata.worker.huge_pages import empty_on_huge_pages


@dataclass(slots=True)
class HostEntry:
    slot: int
    parent_hash: bytes | None
    last_access: int
    hits: int = 0  # reuses so far, carried from the tier above (the admission policy's signal)


@dataclass(frozen=True, slots=True)
class Evicted:
    """A block pushed out of a tier: what a lower tier needs to keep it."""

    block_hash: bytes
    parent_hash: bytes | None
    data: torch.Tensor | None  # one block, contiguous, on the CPU; None when no tier below wants it, or
    # when the tier below holds it already
    hits: int = 0
    slot: int | None = None  # the DRAM slot it left (other tensor-parallel ranks copy their share from it)


class HostTier:
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"cpu tier: num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.storage = host_storage(num_blocks, self.block_shape, dtype, pin)
        self.entries: dict[bytes, HostEntry] = {}
        self._kids: dict[bytes, int] = {}  # parent hash -> entries here under it (the parent may not be here)
        self.free_slots = list(range(num_blocks - 1, -1, -1))
        self._heap: list[tuple[int, bytes]] = []  # (last_access, hash) of leaves; validated lazily
        self._tick = 0
        self.puts = self.evictions = 0
        # pinned blocks (prompt-cache breakpoints): never evicted from here unless a lower tier
        # takes them; replaced as a whole by the tier manager
        self.pinned: frozenset[bytes] = frozenset()
        # with a tier below, evictions carry their data down (a copy) and pinned blocks may leave
        self.has_lower_tier = False
        # called before the CPU reads or writes storage: on CUDA, waits for queued device copies
        self.wait_copies: Callable[[], None] = _nothing
        # copies an evicted block out for the tier below (which may stage it for its write)
        self.copy_out: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.clone
        # whether the tier below holds a block already: then an eviction carries no copy (data
        # None), and the tier below only refreshes the block
        self.lower_has: Callable[[bytes], bool] = _never

    @property
    def block_bytes(self) -> int:
        return self.storage[0].numel() * self.storage.element_size()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def match(self, block_hashes: list[bytes]) -> int:
        """How many of block_hashes, from the first, are here."""
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.entries:
            n += 1
        return n

    def put(self, hashes: list[bytes], parents: list[bytes | None], data: torch.Tensor | None = None,
            fill: Callable[[list[int], list[int]], None] | None = None,
            hits: list[int] | None = None) -> list[Evicted]:
        """Store blocks, oldest first: their data as a tensor [n, *block_shape], or through
        fill(rows, slots), which copies those source rows into those slots (straight from the
        device pool, one pass); `hits` gives each block's reuse count. Returns what had to be
        evicted to make room, for the tier below. Hashes already here are refreshed, not stored twice."""
        evicted: list[Evicted] = []
        rows, slots = [], []
        new: dict[bytes, int] = {}  # stored by this call (their data is copied in after the loop) -> position
        for i, (h, parent) in enumerate(zip(hashes, parents)):
            n = hits[i] if hits is not None else 0
            entry = self.entries.get(h)
            if entry is not None:
                entry.hits = max(entry.hits, n)
                self._touch(h, entry)
                continue
            if not self.free_slots:
                victim = self._pop_leaf(protect=set(hashes[i:]), unfilled=new)
                if victim is None:
                    break  # everything left is a parent of what is being stored; keep the chain's root
                k = new.pop(victim.block_hash, None)
                if k is None:
                    evicted.append(victim)
                else:  # stored by this very call and not copied in yet: it is simply not stored
                    rows[k] = slots[k] = None
            slot = self.free_slots.pop()
            self.entries[h] = HostEntry(slot, parent, self._next_tick(), n)
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
            if not self._kids.get(h):
                heapq.heappush(self._heap, (self.entries[h].last_access, h))
            new[h] = len(rows)
            rows.append(i)
            slots.append(slot)
            self.puts += 1
        rows = [r for r in rows if r is not None]
        slots = [s for s in slots if s is not None]
        if rows and fill is not None:
            fill(rows, slots)
        elif rows:
            self.wait_copies()
            idx = torch.tensor(slots)
            self.storage.index_copy_(0, idx, data[torch.tensor(rows)] if len(rows) < len(data) else data)
        return evicted

    def detach(self, hashes: list[bytes]) -> list[int]:
        """Remove blocks (all must be here) but keep their slots, and data, until `release`:
        for promotion, whose allocation may demote other blocks into this tier meanwhile."""
        slots = [self.entries[h].slot for h in hashes]
        for h in reversed(hashes):  # children first, so parents become leaves in turn
            self._remove(h, free_slot=False)
        return slots

    def release(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)

    def take(self, hashes: list[bytes]) -> torch.Tensor:
        """Remove blocks (all must be here) and return their data [n, *block_shape], in order."""
        slots = self.detach(hashes)
        self.wait_copies()
        data = self.storage.index_select(0, torch.tensor(slots))
        self.release(slots)
        return data

    def discard(self, hashes: list[bytes]) -> int:
        """Drop whichever of these blocks are here; returns how many were."""
        present = [h for h in hashes if h in self.entries]
        for h in reversed(present):
            self._remove(h)
        return len(present)

    def clear(self) -> int:
        n = len(self.entries)
        self.entries.clear()
        self._kids.clear()
        self._heap.clear()
        self.free_slots = list(range(self.num_blocks - 1, -1, -1))
        return n

    def _remove(self, h: bytes, free_slot: bool = True) -> HostEntry:
        entry = self.entries.pop(h)
        p = entry.parent_hash
        if p is not None:
            self._kids[p] -= 1
            if not self._kids[p]:
                del self._kids[p]
                parent = self.entries.get(p)
                if parent is not None:  # now a leaf
                    heapq.heappush(self._heap, (parent.last_access, p))
        if free_slot:
            self.free_slots.append(entry.slot)
        return entry

    def _pop_leaf(self, protect: set[bytes], unfilled: dict[bytes, int] | None = None) -> Evicted | None:
        """The least recently used unprotected leaf, removed; its data is copied out for a tier below
        unless it is `unfilled` (stored by the running put, whose copy has not happened yet) or the
        tier below holds it already."""
        skipped = []
        victim = None
        while self._heap:
            tick, h = heapq.heappop(self._heap)
            entry = self.entries.get(h)
            if entry is None or entry.last_access != tick or self._kids.get(h):
                continue  # stale
            if h in protect or (not self.has_lower_tier and h in self.pinned):
                skipped.append((tick, h))
                continue
            keep = self.has_lower_tier and not (unfilled and h in unfilled) and not self.lower_has(h)
            if keep:
                self.wait_copies()
            data = self.copy_out(self.storage[entry.slot]) if keep else None
            victim = Evicted(h, entry.parent_hash, data, entry.hits, entry.slot)
            self._remove(h)
            self.evictions += 1
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return victim

    def _touch(self, h: bytes, entry: HostEntry) -> None:
        entry.last_access = self._next_tick()
        if not self._kids.get(h):
            heapq.heappush(self._heap, (entry.last_access, h))

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def stats(self) -> dict:
        return {"blocks": len(self.entries), "capacity_blocks": self.num_blocks,
                "bytes": len(self.entries) * self.block_bytes, "capacity_bytes": self.num_blocks * self.block_bytes,
                "puts": self.puts, "evictions": self.evictions}

    def check_integrity(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self.free_slots), "a host slot is both used and free"
        assert len(slots) + len(self.free_slots) == self.num_blocks, "host slots leaked"
        kids: dict[bytes, int] = {}
        for e in self.entries.values():
            if e.parent_hash is not None:
                kids[e.parent_hash] = kids.get(e.parent_hash, 0) + 1
        assert kids == self._kids, "host child counts are off"


def host_storage(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeroed storage for num_blocks blocks: pinned for a CUDA device; else on huge pages where the
    host has them. A block copy between the pool and DRAM is one piece per layer's K or V (60 pieces
    of 12 KB for SmolLM2); on 4 KB pages that is a page walk every 4 KB on the DRAM side, on 2 MB
    pages one walk for a few blocks."""
    shape = (num_blocks, *block_shape)
    if pin:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return empty_on_huge_pages(math.prod(shape), dtype).view(shape).zero_()


def _never(block_hash: bytes) -> bool:
    return False


def _nothing() -> None:
    pass
