"""The NVMe tier: KV blocks as checksummed files on a local disk, below the DRAM tier.

One file per block, `<dir>/<hh>/<hash-hex>.kvb`, holding a struct header and, at a 4096-byte
offset, the raw bytes of the tensor; nothing in a tier file is unpickled or executed. Files move in
one O_DIRECT read or write each where the file system allows it, so blocks skip the page cache
(the DRAM tier above already caches them) and IO runs at the disk's speed. A write goes to a 0600
temp file in the same folder and is renamed into place, so a crashed process leaves either no file
or a whole one.
Every read checks the header, the block's identity, the layout and a CRC-32 of the payload, and
anything wrong reads as a miss and drops the file. The index (hash -> size, parent, recency) lives
in memory under one lock, is rebuilt from headers alone on open, and evicts least-recently-used
leaves first, the prefix cache's rule: a block whose child is on this tier goes after the child.
"""

from __future__ import annotations

import fcntl
import heapq
import math
import operator
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy
import torch

from kvstrata.tiering.block_file import (
    ALIGN,
    BLOCK_SUFFIX,
    MAX_HASH_BYTES,
    TEMP_SUFFIX,
    BlockHeader,
    head_len,
    round_up,
)
from kvstrata.tiering.disk_io import O_DIRECT, BusyClock, aligned_buffer, supports_direct_io, unlink


@dataclass(slots=True, eq=False)
class _Entry:
    parent_hash: bytes | None
    size_bytes: int  # the whole file: header + pad + payload
    last_access: int


@dataclass(slots=True, eq=False)
class _PendingWrite:
    block_hash: bytes
    parent_hash: bytes | None
    data: torch.Tensor
    size_bytes: int
    future: Future | None = None


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0
    evictions: int = 0
    discards: int = 0
    checksum_failures: int = 0  # every bad file met by a read: checksum, header, identity, layout, length, IO
    dropped_at_open: int = 0  # temp files and bad files removed while rebuilding the index
    foreign_files: int = 0  # valid files of another layout found at open, left in place
    # bytes count hits and stored blocks; seconds are summed over the IO threads and count every
    # read and write they did, bad files and writes discarded in flight included
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class NvmeTier:
    """A directory of block files with an LRU, leaf-first, byte-capacity index.

    Threading: the caller's threads run put/get/discard, which only touch the index (and unlink on
    discard); the tier's IO threads write, read, checksum and rename. Every index change, rename and
    unlink happens under `_lock`, so a path is never replaced or removed behind an index decision.
    One tier owns its directory (an flock on `<dir>/.lock`). Files of another layout (tag, dtype,
    shape) are foreign: never returned, not counted, and left in place.

    direct_io: None probes the directory at open and uses O_DIRECT where it works; True requires
    it (ValueError if the directory cannot); False goes through the page cache. The file format
    is the same either way, so a directory can be reopened in either mode.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, layout_tag: str = "", num_io_threads: int = 2,
                 direct_io: bool | None = None):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        try:
            shape = tuple(operator.index(d) for d in block_shape)
        except TypeError:
            shape = ()
        if not shape or min(shape) <= 0 or len(shape) > 255:
            raise ValueError(f"block_shape must be a non-empty tuple of positive ints, got {block_shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if len(layout_tag.encode()) > 0xFFFF:
            raise ValueError("layout_tag must encode to at most 65535 bytes")
        if num_io_threads <= 0:
            raise ValueError(f"num_io_threads must be positive, got {num_io_threads}")
        if direct_io not in (None, True, False):
            raise ValueError(f"direct_io must be None, True or False, got {direct_io!r}")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.block_shape = shape
        self.dtype = dtype
        self.layout_tag = layout_tag
        self.num_io_threads = num_io_threads
        self.payload_bytes = math.prod(shape) * dtype.itemsize
        self._dtype_name = str(dtype).removeprefix("torch.")
        self._lock = threading.Lock()
        # pinned blocks (prompt-cache breakpoints) are never evicted; replaced whole by the tier manager
        self.pinned: frozenset[bytes] = frozenset()
        self._entries: dict[bytes, _Entry] = {}
        self._parent_to_children: dict[bytes, set[bytes]] = {}  # only children in the index
        self._leaf_heap: list[tuple[int, bytes]] = []  # (last_access, hash), validated lazily
        self._pending: dict[bytes, _PendingWrite] = {}
        self._inflight_writes: set[Future] = set()
        self._used_bytes = 0
        self._tick = 0
        self._counters = _Counters()
        self._read_clock = BusyClock()
        self._write_clock = BusyClock()
        self._thread_local = threading.local()  # each IO thread's staging buffer
        self._closed = False
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self.directory} is already open in another NvmeTier") from None
        try:
            supported = direct_io is not False and supports_direct_io(self.directory)
            if direct_io and not supported:
                raise ValueError(f"direct_io=True, but {self.directory} does not support O_DIRECT")
            self.direct_io = supported
            self._o_direct = O_DIRECT if supported else 0
            self._load_index()
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._executor = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvstrata-nvme")

    # -- queries -----------------------------------------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_pending_writes(self) -> int:
        return len(self._pending)  # a len() of a dict is atomic; no lock needed for a gauge

    def hashes(self) -> list[bytes]:
        """The blocks in the index, as of now."""
        with self._lock:
            return list(self._entries)

    def parent_of(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            found = self._entries.get(block_hash) or self._pending.get(block_hash)
            return found.parent_hash if found is not None else None

    @property
    def file_bytes(self) -> int:
        """What one block (with a 32-byte hash and parent) takes against the capacity."""
        return self._file_size(bytes(32), bytes(32))

    def _file_size(self, block_hash: bytes, parent_hash: bytes | None) -> int:
        """Bytes a block's file takes on disk, and against the capacity."""
        header = BlockHeader(block_hash, parent_hash or b"", self.layout_tag, self._dtype_name,
                             self.block_shape, self.payload_bytes, 0)
        return len(header.pack()) + self.payload_bytes

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._entries), "used_bytes": self._used_bytes,
                    "capacity_bytes": self.capacity_bytes, "pending_writes": len(self._pending),
                    "direct_io": self.direct_io, **asdict(self._counters),
                    "read_busy_seconds": self._read_clock.seconds,
                    "write_busy_seconds": self._write_clock.seconds}

    # -- writes ------------------------------------------------------------------------------
    def put(self, block_hash: bytes, parent_hash: bytes | None, data: torch.Tensor) -> Future:
        """Store a block on the IO threads; the future resolves to True once it is in the index.

        False means not stored: bigger than the whole capacity, an IO error, or discarded before
        the write finished. `data` is kept, not copied, until then. Putting a stored block only
        refreshes its recency; putting one whose write is in flight returns that write's future.
        """
        self._check_hash(block_hash, "block_hash")
        if parent_hash is not None:
            self._check_hash(parent_hash, "parent_hash")
            if parent_hash == block_hash:
                raise ValueError("parent_hash must differ from block_hash")
        self._check_data(data)
        with self._lock:
            self._check_open()
            entry = self._entries.get(block_hash)
            if entry is not None:
                self._touch(block_hash, entry)
                return _done(True)
            pending = self._pending.get(block_hash)
            if pending is not None:
                return pending.future
            size = self._file_size(block_hash, parent_hash)
            if size > self.capacity_bytes:
                return _done(False)
            pending = _PendingWrite(block_hash, parent_hash, data, size)
            pending.future = self._executor.submit(self._write, pending)
            self._pending[block_hash] = pending
            self._inflight_writes.add(pending.future)
            return pending.future

    def discard(self, block_hash: bytes) -> bool:
        """Drop a block (and any write of it in flight); False if the tier did not have it."""
        with self._lock:
            removed = self._pending.pop(block_hash, None) is not None
            if block_hash in self._entries:
                self._drop(block_hash)
                removed = True
            self._counters.discards += removed
            return removed

    def flush(self) -> None:
        """Wait until every write submitted so far has finished (committed, failed or dropped)."""
        while True:
            with self._lock:
                writes = list(self._inflight_writes)
            if not writes:
                return
            wait_all(writes)

    def close(self) -> None:
        """Finish the writes, stop the IO threads and release the directory; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here on put and get raise, so the flush below is final
        self.flush()
        self._executor.shutdown(wait=True)
        os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads -------------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> Future:
        """The block's tensor, or None for a miss (absent, or a bad file, which is then dropped)."""
        with self._lock:
            self._check_open()
            found = self._begin_read(block_hash)
            if isinstance(found, _Entry):
                return self._executor.submit(self._read, block_hash, found)
        return _done(found)

    def get_many(self, hashes: list[bytes]) -> Future:
        """Like get for each hash, with the disk reads split into one batch per IO thread."""
        out: list[torch.Tensor | None] = [None] * len(hashes)
        to_read: list[tuple[int, bytes, _Entry]] = []
        with self._lock:
            self._check_open()
            for i, block_hash in enumerate(hashes):
                found = self._begin_read(block_hash)
                if isinstance(found, _Entry):
                    to_read.append((i, block_hash, found))
                else:
                    out[i] = found
            num_batches = min(self.num_io_threads, len(to_read))
            batches = [to_read[k::num_batches] for k in range(num_batches)]
            futures = [self._executor.submit(self._read_batch, batch, out) for batch in batches]
        if not futures:
            return _done(out)
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
            if errors:  # not a bad file (those are misses) but a bug or MemoryError: surface it
                result.set_exception(errors[0])
                return
            with self._lock:  # touch in the order asked, not the order the threads finished
                for i, block_hash, entry in to_read:
                    if out[i] is not None and self._entries.get(block_hash) is entry:
                        self._touch(block_hash, entry)
            result.set_result(out)

        for future in futures:
            future.add_done_callback(one_done)
        return result

    def _begin_read(self, block_hash: bytes) -> torch.Tensor | _Entry | None:
        """Under the lock: a tensor from a write in flight (a hit), the entry to read, or a miss."""
        pending = self._pending.get(block_hash)
        if pending is not None:
            self._counters.hits += 1
            return pending.data.clone()
        entry = self._entries.get(block_hash)
        if entry is None:
            self._counters.misses += 1
        return entry

    def _read_batch(self, batch: list[tuple[int, bytes, _Entry]], out: list) -> None:
        for i, block_hash, entry in batch:
            out[i] = self._read(block_hash, entry, touch=False)

    def _read(self, block_hash: bytes, entry: _Entry, touch: bool = True) -> torch.Tensor | None:
        start = self._read_clock.begin()
        try:
            data = self._read_file(block_hash, entry.size_bytes)
        except (OSError, ValueError):
            data = None
        finally:
            seconds = self._read_clock.end() - start
        with self._lock:
            self._counters.read_seconds += seconds
            if data is None:
                self._counters.misses += 1
                if self._entries.get(block_hash) is entry:  # still our file, so the file is bad
                    self._drop(block_hash)
                    self._counters.checksum_failures += 1
                # else: evicted or discarded while we read; an ordinary miss
                return None
            self._counters.hits += 1
            self._counters.bytes_read += entry.size_bytes
            if touch and self._entries.get(block_hash) is entry:
                self._touch(block_hash, entry)
        return data

    def _read_file(self, block_hash: bytes, size: int) -> torch.Tensor:
        """The whole file in one read into a fresh aligned buffer; the block is a view of its payload.

            buf: [ header | 0 pad | payload      | (read slack) ]
                 0        L       P              size           round_up(size)
        """
        fd = os.open(self._path(block_hash), os.O_RDONLY | self._o_direct)
        try:
            if os.fstat(fd).st_size != size:  # checked first, so a padded file allocates nothing
                raise ValueError("file size disagrees with the index")
            buf = aligned_buffer(round_up(size))  # [round_up(size)]
            if os.preadv(fd, [memoryview(buf.numpy())], 0) != size:
                raise ValueError("short read")
        finally:
            os.close(fd)
        header = BlockHeader.parse(memoryview(buf.numpy()))
        if header.block_hash != block_hash:
            raise ValueError("identity mismatch: the file holds another block")
        if not self._is_our_layout(header):
            raise ValueError("layout mismatch")
        offset = header.payload_offset
        if size != offset + header.payload_len:
            raise ValueError("payload length mismatch")
        payload = buf[offset:size]  # [payload_bytes]
        if zlib.crc32(payload.numpy()) != header.payload_crc:
            raise ValueError("payload checksum mismatch")
        return payload.view(self.dtype).view(self.block_shape)

    # -- the write path (IO threads) ---------------------------------------------------------
    def _write(self, p: _PendingWrite) -> bool:
        start = self._write_clock.begin()
        path = self._path(p.block_hash)
        tmp: str | None = None
        io_ok = True
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            tmp = self._write_temp(p, path.parent)
            # no fsync: rename covers process crashes, and a file torn by power loss fails its
            # length or checksum check and reads as a miss, which a cache can afford
        except Exception:  # noqa: BLE001 - any failure must still clear the pending write below
            io_ok = False
        with self._lock:
            stored = False
            try:
                if io_ok and self._pending.get(p.block_hash) is p and self._make_room(p.size_bytes):
                    os.replace(tmp, path)
                    tmp = None
                    self._insert(p.block_hash, p.parent_hash, p.size_bytes, self._next_tick())
                    stored = True
            except OSError:
                io_ok = False
            finally:
                if tmp is not None:
                    unlink(tmp)
                if self._pending.get(p.block_hash) is p:
                    del self._pending[p.block_hash]
                self._inflight_writes.discard(p.future)
                if stored:
                    self._counters.writes += 1
                    self._counters.bytes_written += p.size_bytes
                self._counters.write_seconds += self._write_clock.end() - start
                self._counters.write_failures += not io_ok
        return stored

    def _write_temp(self, p: _PendingWrite, folder: Path) -> str:
        """The block's whole file, staged in this thread's aligned buffer and written to a new temp
        file in `folder` with one write; returns the temp file's path.

            staging: [ header | 0 pad | payload         | 0 tail ]   ftruncate drops the tail
                     0        L       P                 size      round_up(size)
        """
        offset = p.size_bytes - self.payload_bytes  # P: the head is the header and its pad
        staging = self._staging(round_up(p.size_bytes))  # [round_up(size)]
        payload = staging[offset:p.size_bytes]  # [payload_bytes]
        # numpy's copy is one memcpy without the GIL; torch's would start an OpenMP team in each IO thread
        numpy.copyto(payload.numpy(), p.data.detach().contiguous().view(-1).view(torch.uint8).numpy())
        staging[p.size_bytes:].zero_()  # the last write's bytes must not reach this file, even briefly
        view = memoryview(staging.numpy())
        # the CRC is of the staged bytes, so a caller changing `data` meanwhile cannot tear the file
        view[:offset] = BlockHeader(p.block_hash, p.parent_hash or b"", self.layout_tag, self._dtype_name,
                                    self.block_shape, self.payload_bytes, zlib.crc32(payload.numpy())).pack()
        tmp = str(folder / f".{os.urandom(8).hex()}{TEMP_SUFFIX}")  # `.*.tmp`: what the rebuild sweeps
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._o_direct, 0o600)
        try:
            if os.write(fd, view) != len(view):
                raise OSError("short write")
            os.ftruncate(fd, p.size_bytes)
        except BaseException:
            unlink(tmp)
            raise
        finally:
            os.close(fd)
        return tmp

    def _staging(self, n: int) -> torch.Tensor:
        """This IO thread's aligned staging buffer, grown to at least n bytes and reused after."""
        staging = getattr(self._thread_local, "staging", None)
        if staging is None or staging.numel() < n:
            staging = self._thread_local.staging = aligned_buffer(n)
        return staging[:n]  # [n]

    # -- the index (callers hold the lock) ---------------------------------------------------
    def _insert(self, block_hash: bytes, parent_hash: bytes | None, size: int, tick: int) -> None:
        entry = _Entry(parent_hash, size, tick)
        self._entries[block_hash] = entry
        self._used_bytes += size
        if parent_hash is not None:
            self._parent_to_children.setdefault(parent_hash, set()).add(block_hash)
        if block_hash not in self._parent_to_children:
            self._push_leaf(block_hash, entry)

    def _drop(self, block_hash: bytes) -> None:
        """Remove a block from the index and its file from disk; its parent may become a leaf."""
        entry = self._entries.pop(block_hash)
        self._used_bytes -= entry.size_bytes
        unlink(self._path(block_hash))
        parent_hash = entry.parent_hash
        if parent_hash is not None:
            siblings = self._parent_to_children[parent_hash]
            siblings.discard(block_hash)
            if not siblings:
                del self._parent_to_children[parent_hash]
                parent = self._entries.get(parent_hash)
                if parent is not None:
                    self._push_leaf(parent_hash, parent)

    def _touch(self, block_hash: bytes, entry: _Entry) -> None:
        entry.last_access = self._next_tick()
        if block_hash not in self._parent_to_children:
            self._push_leaf(block_hash, entry)

    def _make_room(self, size: int) -> bool:
        """Evict until `size` more bytes fit; False if only pinned blocks are left to evict."""
        while self._used_bytes + size > self.capacity_bytes and self._entries:
            victim = self._pop_lru_leaf()
            if victim is None:
                return False
            self._drop(victim)
            self._counters.evictions += 1
        return self._used_bytes + size <= self.capacity_bytes

    def _pop_lru_leaf(self) -> bytes | None:
        pinned = self.pinned
        skipped = []
        found = None
        while self._leaf_heap:
            tick, block_hash = heapq.heappop(self._leaf_heap)
            entry = self._entries.get(block_hash)
            if entry is not None and entry.last_access == tick and block_hash not in self._parent_to_children:
                if block_hash in pinned:
                    skipped.append((tick, block_hash))
                    continue
                found = block_hash
                break
        for item in skipped:
            heapq.heappush(self._leaf_heap, item)
        if found is not None or skipped:
            return found
        # no leaf: only a parent cycle (impossible with chained SHA-256) gets here; plain LRU then
        unpinned = [h for h in self._entries if h not in pinned]
        return min(unpinned, key=lambda h: self._entries[h].last_access) if unpinned else None

    def _push_leaf(self, block_hash: bytes, entry: _Entry) -> None:
        heapq.heappush(self._leaf_heap, (entry.last_access, block_hash))
        if len(self._leaf_heap) > 4 * len(self._entries) + 64:
            self._leaf_heap = [(e.last_access, h) for h, e in self._entries.items()
                               if h not in self._parent_to_children]
            heapq.heapify(self._leaf_heap)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # -- files -------------------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + BLOCK_SUFFIX)

    def _is_our_layout(self, header: BlockHeader) -> bool:
        return (header.layout_tag == self.layout_tag and header.dtype_name == self._dtype_name
                and header.shape == self.block_shape and header.payload_len == self.payload_bytes)

    def _block_files(self) -> tuple[list[os.DirEntry], list[os.DirEntry]]:
        """(block files, temp files) in the `<hh>` folders; anything else in the directory is ignored."""
        blocks, temps = [], []
        for sub in os.scandir(self.directory):
            if len(sub.name) != 2 or not sub.is_dir() or any(c not in "0123456789abcdef" for c in sub.name):
                continue
            for f in os.scandir(sub.path):
                if f.name.startswith(".") and f.name.endswith(TEMP_SUFFIX):
                    temps.append(f)
                elif f.name.endswith(BLOCK_SUFFIX):
                    blocks.append(f)
        return blocks, temps

    def _inspect(self, f: os.DirEntry) -> BlockHeader | None:
        """The header of one of our whole, correctly named files; None if foreign; ValueError if bad."""
        try:
            header, size = self._read_head(f.path)
        except OSError as e:
            raise ValueError(str(e)) from None
        if not self._is_our_layout(header):
            return None
        if Path(f.path) != self._path(header.block_hash) or header.parent_hash == header.block_hash:
            raise ValueError("file name disagrees with the block it holds")
        if size != header.payload_offset + header.payload_len:
            raise ValueError("truncated or padded payload")
        return header

    def _read_head(self, path: str) -> tuple[BlockHeader, int]:
        """A file's verified header and its size, reading the head alone, so that an open in direct
        mode brings neither payloads nor readahead into the page cache."""
        fd = os.open(path, os.O_RDONLY | self._o_direct)
        try:
            size = os.fstat(fd).st_size
            buf = aligned_buffer(ALIGN)  # [ALIGN]: a whole head unless the layout tag is long
            n = os.preadv(fd, [memoryview(buf.numpy())], 0)
            if n == ALIGN and head_len(buf.numpy()) > ALIGN:
                buf = aligned_buffer(head_len(buf.numpy()))  # [head_len]
                n = os.preadv(fd, [memoryview(buf.numpy())], 0)
        finally:
            os.close(fd)
        return BlockHeader.parse(memoryview(buf.numpy())[:n]), size

    def _load_index(self) -> None:
        """Rebuild the index from headers: recency from mtime, bad and temp files removed."""
        blocks, temps = self._block_files()
        for f in temps:  # a crashed writer's; this tier owns the directory, so no live writer's
            unlink(f.path)
        self._counters.dropped_at_open += len(temps)
        found = []  # (mtime_ns, hash, parent, size)
        for f in blocks:
            try:
                header = self._inspect(f)
            except ValueError:
                unlink(f.path)
                self._counters.dropped_at_open += 1
                continue
            if header is None:
                self._counters.foreign_files += 1
                continue
            st = f.stat()
            found.append((st.st_mtime_ns, header.block_hash, header.parent_hash or None, st.st_size))
        for _, block_hash, parent_hash, size in sorted(found):
            self._insert(block_hash, parent_hash, size, self._next_tick())
        self._make_room(0)

    # -- checks ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NvmeTier is closed")

    @staticmethod
    def _check_hash(value: bytes, name: str) -> None:
        if not isinstance(value, bytes) or not 0 < len(value) <= MAX_HASH_BYTES:
            raise ValueError(f"{name} must be 1 to {MAX_HASH_BYTES} bytes, got {value!r:.80}")

    def _check_data(self, data: torch.Tensor) -> None:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
        if data.device.type != "cpu":
            raise ValueError(f"data must be on the CPU, got {data.device}")
        if tuple(data.shape) != self.block_shape or data.dtype != self.dtype:
            raise ValueError(f"data must be {self.dtype} {self.block_shape}, got {data.dtype} {tuple(data.shape)}")

    def check_integrity(self) -> None:
        """Index <-> disk: every entry's file exists with its size, every file of our layout is
        indexed, bytes add up within capacity, child links and leaves agree, and no temp file
        outlives the writes in flight."""
        with self._lock:
            assert self._used_bytes == sum(e.size_bytes for e in self._entries.values()), "used_bytes drifted"
            assert self._used_bytes <= self.capacity_bytes, f"{self._used_bytes} B used > capacity"
            children: dict[bytes, set[bytes]] = {}
            for h, e in self._entries.items():
                if e.parent_hash is not None:
                    children.setdefault(e.parent_hash, set()).add(h)
            assert children == self._parent_to_children, "child links disagree with parent hashes"
            heap = set(self._leaf_heap)
            for h, e in self._entries.items():
                assert h in children or (e.last_access, h) in heap, f"leaf {h.hex()} not evictable"
            blocks, temps = self._block_files()
            on_disk = {Path(f.path): f for f in blocks}
            for h, e in self._entries.items():
                f = on_disk.pop(self._path(h), None)
                assert f is not None, f"block {h.hex()} indexed but has no file"
                assert f.stat().st_size == e.size_bytes, f"block {h.hex()}: file size != indexed size"
            for path, f in on_disk.items():
                try:
                    header = self._inspect(f)
                except ValueError as e:
                    raise AssertionError(f"{path}: unindexed bad file ({e})") from None
                assert header is None, f"{path}: a block of our layout that is not indexed"
            assert self._inflight_writes or not temps, f"temp files left: {[t.name for t in temps]}"
            assert all(p.future in self._inflight_writes for p in self._pending.values()), "lost a write"
