"""The state of every slot of the NVMe tier, so that no two operations ever use one slot at once.
Plain data, no IO and no lock: NvmeTier holds its lock around every call.

    free --allocate--> writing --commit--> indexed --reuse (evicted for a write)--> writing
     ^                    |                   |
     |                 release             release --(reads of it running)--> erase_after_read
     |                    v                   v                                      | last read ends
     +----- erased ---- erasing <-------------+--------------------------------------+
"""

from __future__ import annotations

import heapq


class FreeSlots:
    """The free slots, handed out lowest first, so the tier fills its slabs in order and never
    creates a slab past the highest slot it has used.

        slots: [ used, or freed into the heap  | never used      ]
               0                               fresh             num_slots
    """

    def __init__(self, num_slots: int, used: set[int]):
        self.num_slots = num_slots
        self.fresh = max(used, default=-1) + 1
        self._heap = [s for s in range(self.fresh) if s not in used]  # ascending: already a heap

    def __len__(self) -> int:
        return len(self._heap) + self.num_slots - self.fresh

    def can_allocate(self) -> bool:
        return len(self) > 0

    def allocate(self) -> int:
        if self._heap:
            return heapq.heappop(self._heap)
        assert self.fresh < self.num_slots, "no free slot"
        self.fresh += 1
        return self.fresh - 1

    def free(self, slot: int) -> None:
        heapq.heappush(self._heap, slot)

    def slots(self) -> list[int]:
        """Every free slot, for checks."""
        return [*self._heap, *range(self.fresh, self.num_slots)]


class SlotTable:
    """Which slots are free, being written, being erased or waiting for reads to end; the rest
    are indexed (the index knows which block each holds). Reads are counted on indexed slots and
    on those waiting for them."""

    def __init__(self, num_slots: int, indexed: set[int]):
        self.num_slots = num_slots
        self._free = FreeSlots(num_slots, indexed)
        self.writing: set[int] = set()
        self.erasing: set[int] = set()
        self.erase_after_read: set[int] = set()
        self._num_readers: dict[int, int] = {}

    def can_allocate(self) -> bool:
        return self._free.can_allocate()

    def allocate(self) -> int:
        """free -> writing."""
        slot = self._free.allocate()
        self.writing.add(slot)
        return slot

    def reuse(self, slot: int) -> None:
        """indexed (just evicted) -> writing: the write replaces the header, so no erase first."""
        assert slot not in self._num_readers, "reusing a slot being read"
        self.writing.add(slot)

    def commit(self, slot: int) -> None:
        """writing -> indexed."""
        self.writing.remove(slot)

    def release(self, slot: int) -> bool:
        """writing or indexed -> erasing; True if the caller must erase it now, False if the last
        read of it will (it waits in erase_after_read)."""
        self.writing.discard(slot)
        if slot in self._num_readers:
            self.erase_after_read.add(slot)
            return False
        self.erasing.add(slot)
        return True

    def is_being_read(self, slot: int) -> bool:
        return slot in self._num_readers

    def begin_read(self, slot: int) -> None:
        self._num_readers[slot] = self._num_readers.get(slot, 0) + 1

    def end_read(self, slot: int) -> bool:
        """True if this was the last read of a released slot, which the caller must now erase."""
        self._num_readers[slot] -= 1
        if self._num_readers[slot]:
            return False
        del self._num_readers[slot]
        if slot not in self.erase_after_read:
            return False
        self.erase_after_read.remove(slot)
        self.erasing.add(slot)
        return True

    def erased(self, slot: int) -> None:
        """erasing -> free."""
        self.erasing.remove(slot)
        self._free.free(slot)

    def free_slots(self) -> list[int]:
        return self._free.slots()

    def check(self, indexed: set[int]) -> None:
        """Every slot in exactly one state, and reads only of slots that hold a block."""
        free = self._free.slots()
        assert len(set(free)) == len(free), "a slot freed twice"
        states = [indexed, set(free), self.writing, self.erasing, self.erase_after_read]
        assert sum(map(len, states)) == self.num_slots, "a slot lost or in two states"
        assert set().union(*states) == set(range(self.num_slots)), "a slot lost or in two states"
        assert self.erase_after_read <= set(self._num_readers), "an erase waits for no read"
        assert set(self._num_readers) <= indexed | self.erase_after_read, "a read of a slot not held"
