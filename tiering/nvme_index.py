"""The NVMe tier's index: block hash -> slot, parent and recency, with the prefix cache's eviction
rule, least recently used leaf first: a block whose child is on the tier goes after the child.
Plain data, no IO and no lock; NvmeTier holds its lock around every call."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class IndexEntry:
    parent_hash: bytes | None
    slot: int
    seq: int  # the write sequence number in the slot's header
    last_access: int


class BlockIndex:
    def __init__(self):
        self.entries: dict[bytes, IndexEntry] = {}
        self.parent_to_children: dict[bytes, set[bytes]] = {}  # only children in the index
        self._leaf_heap: list[tuple[int, bytes]] = []  # (last_access, hash), validated lazily
        self._tick = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: bytes) -> IndexEntry | None:
        return self.entries.get(block_hash)

    def insert(self, block_hash: bytes, parent_hash: bytes | None, slot: int, seq: int,
               tick: int | None = None) -> IndexEntry:
        """Add a block as the most recently used, or as used at `tick` (from next_tick, taken earlier)."""
        entry = IndexEntry(parent_hash, slot, seq, self.next_tick() if tick is None else tick)
        self.entries[block_hash] = entry
        if parent_hash is not None:
            self.parent_to_children.setdefault(parent_hash, set()).add(block_hash)
        if block_hash not in self.parent_to_children:
            self._push_leaf(block_hash, entry)
        return entry

    def remove(self, block_hash: bytes) -> IndexEntry:
        """Remove a block; its parent may become a leaf."""
        entry = self.entries.pop(block_hash)
        parent_hash = entry.parent_hash
        if parent_hash is not None:
            siblings = self.parent_to_children[parent_hash]
            siblings.discard(block_hash)
            if not siblings:
                del self.parent_to_children[parent_hash]
                parent = self.entries.get(parent_hash)
                if parent is not None:
                    self._push_leaf(parent_hash, parent)
        return entry

    def touch(self, block_hash: bytes, entry: IndexEntry) -> None:
        entry.last_access = self.next_tick()
        if block_hash not in self.parent_to_children:
            self._push_leaf(block_hash, entry)

    def lru_leaf(self, skip: Callable[[bytes, IndexEntry], bool]) -> bytes | None:
        """The least recently used leaf that `skip` lets go (pinned, being read), or None if every
        leaf is skipped. Without any leaf (only a parent cycle, impossible with chained SHA-256,
        gets here) the least recently used block that is not skipped."""
        skipped = []
        found = None
        while self._leaf_heap:
            tick, block_hash = heapq.heappop(self._leaf_heap)
            entry = self.entries.get(block_hash)
            if entry is None or entry.last_access != tick or block_hash in self.parent_to_children:
                continue  # stale: removed, touched since, or no longer a leaf
            if skip(block_hash, entry):
                skipped.append((tick, block_hash))
                continue
            found = block_hash
            heapq.heappush(self._leaf_heap, (tick, block_hash))  # still a leaf until it is removed
            break
        for item in skipped:
            heapq.heappush(self._leaf_heap, item)
        if found is not None or skipped:
            return found
        candidates = [h for h, e in self.entries.items() if not skip(h, e)]
        return min(candidates, key=lambda h: self.entries[h].last_access) if candidates else None

    def check(self) -> None:
        children: dict[bytes, set[bytes]] = {}
        for h, e in self.entries.items():
            if e.parent_hash is not None:
                children.setdefault(e.parent_hash, set()).add(h)
        assert children == self.parent_to_children, "child links disagree with parent hashes"
        heap = set(self._leaf_heap)
        for h, e in self.entries.items():
            assert h in children or (e.last_access, h) in heap, f"leaf {h.hex()} not evictable"
        slots = [e.slot for e in self.entries.values()]
        assert len(set(slots)) == len(slots), "two blocks in one slot"

    def _push_leaf(self, block_hash: bytes, entry: IndexEntry) -> None:
        heapq.heappush(self._leaf_heap, (entry.last_access, block_hash))
        if len(self._leaf_heap) > 4 * len(self.entries) + 64:
            self._leaf_heap = [(e.last_access, h) for h, e in self.entries.items()
                               if h not in self.parent_to_children]
            heapq.heapify(self._leaf_heap)

    def next_tick(self) -> int:
        """A recency later than every one given so far."""
        self._tick += 1
        return self._tick
