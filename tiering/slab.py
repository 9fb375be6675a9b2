"""Slab files of the NVMe tier: fixed-size slots in a few preallocated files, so storing or loading a
block is one pwrite or one pread at a known offset, with no file created, renamed or removed. A slab
is created (and preallocated with posix_fallocate) when its first slot is first written, and slots
are handed out lowest first, so a tier takes disk space as it fills, one slab at a time.

    slot s lives in slab-<s // n>.kvs at byte (s % n) * S      n = slots_per_slab, S = slot_bytes

    slab-0.kvs: [ slot 0 | slot 1 | ... | slot n-1 ]    slab-1.kvs: [ slot n | ... ]  ...
    a slot:     [ header | 0 pad | payload        | 0 tail ]
                0        L       P                P+len    S = max head + round_up(payload)
"""

from __future__ import annotations

import errno
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.tiering.block_file import ALIGN, round_up
from kvstrata.tiering.disk_io import aligned_buffer

SLAB_BYTES = 1 << 30  # the most one slab file holds; the last slab holds what is left of the capacity
_SLAB_NAME = re.compile(r"slab-(0|[1-9][0-9]{0,8})\.kvs")


def slab_name(k: int) -> str:
    return f"slab-{k}.kvs"


@dataclass(frozen=True, slots=True)
class SlabGeometry:
    """Where each slot lives. Depends on the layout (through slot_bytes), the capacity and the slab size."""

    slot_bytes: int
    num_slots: int
    slots_per_slab: int

    @classmethod
    def plan(cls, capacity_bytes: int, head_bytes: int, payload_bytes: int, slab_bytes: int) -> SlabGeometry:
        slot_bytes = head_bytes + round_up(payload_bytes)
        return cls(slot_bytes, capacity_bytes // slot_bytes, max(1, slab_bytes // slot_bytes))

    @property
    def num_slabs(self) -> int:
        return -(-self.num_slots // self.slots_per_slab)

    def slab_size(self, k: int) -> int:
        """Bytes of slab k once created: whole slabs, then the rest; 0 past the last."""
        return max(0, min(self.slots_per_slab, self.num_slots - k * self.slots_per_slab)) * self.slot_bytes

    def locate(self, slot: int) -> tuple[int, int]:
        """(slab, byte offset) of a slot."""
        k, i = divmod(slot, self.slots_per_slab)
        return k, i * self.slot_bytes

    def slot_at(self, k: int, offset: int) -> int | None:
        """The slot at (slab, offset), or None if no slot of this geometry starts there."""
        i, rest = divmod(offset, self.slot_bytes)
        slot = k * self.slots_per_slab + i
        return slot if rest == 0 and i < self.slots_per_slab and slot < self.num_slots else None


class SlabFiles:
    """The slab files of one directory: one fd per slab (O_DIRECT when asked), kept open, and
    whole-slot reads and writes. pread and pwrite carry their offsets, so threads share the fds;
    only creating a slab takes a lock. Files are 0600."""

    def __init__(self, directory: Path, geometry: SlabGeometry, o_direct: int):
        self.directory = directory
        self.geometry = geometry
        self._o_direct = o_direct
        self._fds: dict[int, int] = {}
        self._create_lock = threading.Lock()
        self._zeros = aligned_buffer(ALIGN).zero_()  # [ALIGN], only ever read from

    @property
    def num_files(self) -> int:
        return len(self._fds)

    def open_slabs(self) -> list[int]:
        return sorted(self._fds)

    def path(self, k: int) -> Path:
        return self.directory / slab_name(k)

    def on_disk(self) -> list[int]:
        """The slab numbers with a file in the directory."""
        return sorted(int(m.group(1)) for e in os.scandir(self.directory) if (m := _SLAB_NAME.fullmatch(e.name)))

    def open_existing(self) -> dict[int, int]:
        """Open every slab file as it is; {slab: size in bytes}."""
        sizes = {}
        for k in self.on_disk():
            fd = self._open(k)
            self._fds[k] = fd
            sizes[k] = os.fstat(fd).st_size
        return sizes

    def fit(self) -> None:
        """Resize the open slabs to the geometry: remove those past the last slab, truncate or
        extend the others. For the open, after every block outside the geometry has moved in."""
        for k in sorted(self._fds):
            want = self.geometry.slab_size(k)
            if want == 0:
                os.close(self._fds.pop(k))
                os.unlink(self.path(k))
                continue
            size = os.fstat(self._fds[k]).st_size
            if size > want:
                os.ftruncate(self._fds[k], want)
            elif size < want:
                _preallocate(self._fds[k], size, want)

    def write(self, slot: int, data: memoryview) -> None:
        """One pwrite from an aligned buffer of whole slots, from `slot` on (a run of adjacent slots
        in one slab, see run_length); creates the slab on its first write."""
        k, offset = self.geometry.locate(slot)
        if os.pwrite(self._fd(k), data, offset) != len(data):
            raise OSError(errno.EIO, f"short write of slot {slot}")

    def write_run(self, slot: int, bufs: list[memoryview]) -> None:
        """One pwritev of adjacent slots from `slot` on (in one slab), each from its own aligned
        buffer of one slot."""
        k, offset = self.geometry.locate(slot)
        if os.pwritev(self._fd(k), bufs, offset) != sum(len(b) for b in bufs):
            raise OSError(errno.EIO, f"short write of slots from {slot}")

    def fd_at(self, slot: int) -> tuple[int, int]:
        """The open slab file holding a slot, and the slot's offset in it (the slab is created here
        on its first use), for IO done elsewhere (io_pool.py)."""
        k, offset = self.geometry.locate(slot)
        return self._fd(k), offset

    def read(self, slot: int, buf: torch.Tensor) -> None:
        """One pread of a whole slot into an aligned buffer [slot_bytes]."""
        k, offset = self.geometry.locate(slot)
        self.read_at(k, offset, buf)

    def read_run(self, slot: int, bufs: list[torch.Tensor]) -> None:
        """One preadv of adjacent slots, from `slot` on, each into its own aligned buffer [slot_bytes]."""
        if len(bufs) == 1:
            self.read(slot, bufs[0])
            return
        self.read_at(*self.geometry.locate(slot), *bufs)

    def run_length(self, slots: list[int], start: int, limit: int) -> int:
        """How many of slots[start:] (sorted) are adjacent to slots[start], in its slab, up to limit."""
        k = slots[start] // self.geometry.slots_per_slab
        n = 1
        while (n < limit and start + n < len(slots) and slots[start + n] == slots[start] + n
               and slots[start + n] // self.geometry.slots_per_slab == k):
            n += 1
        return n

    def read_at(self, k: int, offset: int, *bufs: torch.Tensor) -> None:
        """One preadv at (slab, offset) into the buffers, one after another."""
        fd = self._fds.get(k)
        if fd is None:
            raise OSError(errno.ENOENT, f"no slab {k}")
        if os.preadv(fd, [memoryview(b.numpy()) for b in bufs], offset) != sum(b.numel() for b in bufs):
            raise ValueError(f"short read at slab {k} offset {offset}")

    def erase(self, slot: int) -> None:
        """Zero the first 4096 bytes of a slot: no header, so no rebuild will find a block there."""
        self.erase_at(*self.geometry.locate(slot))

    def erase_at(self, k: int, offset: int) -> None:
        fd = self._fds.get(k)
        if fd is None:  # the slab was never created (its first write failed): nothing to erase
            return
        if os.pwrite(fd, memoryview(self._zeros.numpy()), offset) != ALIGN:
            raise OSError(errno.EIO, f"short write erasing slab {k} offset {offset}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, k: int) -> int:
        fd = self._fds.get(k)
        if fd is not None:
            return fd
        with self._create_lock:
            if k not in self._fds:
                fd = self._open(k)
                try:
                    _preallocate(fd, os.fstat(fd).st_size, self.geometry.slab_size(k))
                except BaseException:
                    os.close(fd)
                    raise
                self._fds[k] = fd
            return self._fds[k]

    def _open(self, k: int) -> int:
        fd = os.open(self.path(k), os.O_RDWR | os.O_CREAT | self._o_direct, 0o600)
        os.fchmod(fd, 0o600)
        return fd


def _preallocate(fd: int, start: int, end: int) -> None:
    """Grow a slab to `end` bytes, with blocks reserved where the file system can (no disk full later)."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, end)  # a sparse file: the first write to each slot allocates it
