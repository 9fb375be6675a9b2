"""Reading the slots' headers: the NVMe tier's index rebuilt at open, and the disk half of its
check_integrity. A slot holds a block of this tier's layout, a block of another layout (free space
to this tier), nothing (no magic: zeros, or stray bytes), or a bad header; only the first counts.
At open, bad slots and the older copy of a block found twice are erased, blocks past the capacity
are evicted or moved inside it, and files of the old one-file-per-block layout are removed."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from kvstrata.tiering.block_file import ALIGN, LEGACY_BLOCK_SUFFIX, TEMP_SUFFIX, BlockHeader, has_magic, head_len
from kvstrata.tiering.disk_io import aligned_buffer, unlink
from kvstrata.tiering.nvme_index import BlockIndex, IndexEntry
from kvstrata.tiering.slab import SlabFiles
from kvstrata.tiering.slots import FreeSlots

IsOurs = Callable[[BlockHeader], bool]


class Head(enum.Enum):
    EMPTY = "no header"
    BAD = "bad header"


@dataclass(frozen=True, slots=True)
class _Found:
    header: BlockHeader
    slab: int
    offset: int


@dataclass(slots=True)
class Rebuilt:
    index: BlockIndex  # every block kept, inserted oldest write first, each in a slot of the geometry
    next_seq: int
    num_dropped: int = 0
    num_foreign: int = 0
    num_evicted: int = 0


def read_head(slabs: SlabFiles, k: int, offset: int, buf) -> BlockHeader | Head:
    """The verified header at (slab, offset); `buf` is an aligned [ALIGN] scratch buffer."""
    try:
        slabs.read_at(k, offset, buf)
        view = memoryview(buf.numpy())
        if not has_magic(view):
            return Head.EMPTY
        n = head_len(view)
        if n > ALIGN:  # a long layout tag
            big = aligned_buffer(n)  # [n]
            slabs.read_at(k, offset, big)
            view = memoryview(big.numpy())
        return BlockHeader.parse(view)
    except (OSError, ValueError):
        return Head.BAD


def rebuild(slabs: SlabFiles, executor: Executor, is_ours: IsOurs, num_threads: int) -> Rebuilt:
    """Open the slabs and index what they hold. Recency is the write order (the headers' sequence
    numbers), so what a restart over capacity evicts first is what was written longest ago."""
    geometry = slabs.geometry
    num_legacy = remove_legacy_files(slabs.directory)
    sizes = slabs.open_existing()
    places = [(k, offset) for k, size in sorted(sizes.items())
              for offset in range(0, size - ALIGN + 1, geometry.slot_bytes)]
    heads = _scan(slabs, executor, places, num_threads)
    best: dict[bytes, _Found] = {}
    to_erase: list[tuple[int, int]] = []
    out = Rebuilt(BlockIndex(), 0, num_legacy)
    for (k, offset), head in zip(places, heads, strict=True):
        if head is Head.EMPTY:
            continue
        if head is not Head.BAD and not is_ours(head):
            out.num_foreign += 1
            continue
        if head is Head.BAD or head.parent_hash == head.block_hash or offset + geometry.slot_bytes > sizes[k]:
            to_erase.append((k, offset))
            continue
        out.next_seq = max(out.next_seq, head.seq + 1)
        found, old = _Found(head, k, offset), best.get(head.block_hash)
        if old is not None:  # one block in two slots (a crash before an erase): keep the newer write
            keep, lose = (found, old) if head.seq > old.header.seq else (old, found)
            best[head.block_hash] = keep
            to_erase.append((lose.slab, lose.offset))
        else:
            best[head.block_hash] = found
    out.num_dropped += len(to_erase)
    for k, offset in to_erase:
        slabs.erase_at(k, offset)
    outside: dict[int, _Found] = {}  # stand-in slot numbers, past the last, for blocks outside the geometry
    for found in sorted(best.values(), key=lambda f: f.header.seq):
        slot = geometry.slot_at(found.slab, found.offset)
        if slot is None:
            slot = geometry.num_slots + len(outside)
            outside[slot] = found
        out.index.insert(found.header.block_hash, found.header.parent_hash or None, slot, found.header.seq)
    # no erase for what is evicted here: that leaves exactly num_slots blocks, so each slot freed
    # inside is overwritten by a block moved in (or erased if the move fails), and those outside go
    # with the truncation below
    while len(out.index) > geometry.num_slots:
        out.index.remove(out.index.lru_leaf(lambda h, e: False))
        out.num_evicted += 1
    out.num_dropped += _move_inside(slabs, out.index, outside)
    slabs.fit()
    return out


def _scan(slabs: SlabFiles, executor: Executor, places: list[tuple[int, int]], num_threads: int) -> list:
    """read_head at every place, in order, split into one contiguous run per IO thread."""
    size = -(-len(places) // num_threads) or 1
    runs = [places[i:i + size] for i in range(0, len(places), size)]

    def read_run(run: list[tuple[int, int]]) -> list[BlockHeader | Head]:
        buf = aligned_buffer(ALIGN)  # [ALIGN], reused: parse copies what it keeps
        return [read_head(slabs, k, offset, buf) for k, offset in run]

    return [head for part in executor.map(read_run, runs) for head in part]


def _move_inside(slabs: SlabFiles, index: BlockIndex, outside: dict[int, _Found]) -> int:
    """Copy each block still outside the geometry into a free slot, lowest first (one pread and one
    pwrite of the whole slot); returns how many could not be moved and were dropped."""
    geometry = slabs.geometry
    free = FreeSlots(geometry.num_slots, {e.slot for e in index.entries.values() if e.slot not in outside})
    buf = aligned_buffer(geometry.slot_bytes)  # [slot_bytes]
    num_dropped = 0
    for block_hash, entry in list(index.entries.items()):
        found = outside.get(entry.slot)
        if found is None:
            continue
        slot = free.allocate()
        try:
            slabs.read_at(found.slab, found.offset, buf)
            slabs.write(slot, memoryview(buf.numpy()))
            entry.slot = slot
        except (OSError, ValueError):
            index.remove(block_hash)
            num_dropped += 1
            try:
                slabs.erase(slot)
            except OSError:
                pass  # the slot stays free in memory; the next write to it overwrites it
    return num_dropped


def legacy_files(directory: Path) -> list[Path]:
    """Block and temp files of the old layout, `<dir>/<hh>/<hash>.kvb` and `<dir>/<hh>/.*.tmp`."""
    found = []
    for sub in os.scandir(directory):
        if len(sub.name) != 2 or not sub.is_dir() or any(c not in "0123456789abcdef" for c in sub.name):
            continue
        for f in os.scandir(sub.path):
            if f.name.endswith(LEGACY_BLOCK_SUFFIX) or (f.name.startswith(".") and f.name.endswith(TEMP_SUFFIX)):
                found.append(Path(f.path))
    return found


def remove_legacy_files(directory: Path) -> int:
    """Remove the old layout's files (a cache: nothing is lost) and their folders once empty."""
    files = legacy_files(directory)
    for f in files:
        unlink(f)
    for folder in {f.parent for f in files}:
        try:
            os.rmdir(folder)
        except OSError:  # something else lives there: not ours to remove
            pass
    return len(files)


def check_disk(slabs: SlabFiles, is_ours: IsOurs, entries: dict[bytes, IndexEntry], free: list[int]) -> None:
    """Every indexed block's header in its slot, no block of ours in a free slot, no slab file
    past the geometry, none unopened, and no file of the old layout."""
    geometry = slabs.geometry
    on_disk = slabs.on_disk()
    assert all(k < geometry.num_slabs for k in on_disk), f"slab files past the capacity: {on_disk}"
    assert on_disk == slabs.open_slabs(), "a slab file the tier does not hold open"
    sizes = {k: os.stat(slabs.path(k)).st_size for k in on_disk}
    buf = aligned_buffer(ALIGN)  # [ALIGN]
    for block_hash, entry in entries.items():
        k, offset = geometry.locate(entry.slot)
        assert offset + geometry.slot_bytes <= sizes.get(k, 0), f"block {block_hash.hex()}: no slot on disk"
        head = read_head(slabs, k, offset, buf)
        assert isinstance(head, BlockHeader) and is_ours(head) and head.block_hash == block_hash \
            and head.seq == entry.seq and (head.parent_hash or None) == entry.parent_hash, \
            f"block {block_hash.hex()}: its slot {entry.slot} holds {head}"
    for slot in free:
        k, offset = geometry.locate(slot)
        if offset + ALIGN <= sizes.get(k, 0):
            head = read_head(slabs, k, offset, buf)
            assert not (isinstance(head, BlockHeader) and is_ours(head)), \
                f"free slot {slot} holds block {getattr(head, 'block_hash', b'').hex()}"
    assert not legacy_files(slabs.directory), "files of the one-file-per-block layout left"
