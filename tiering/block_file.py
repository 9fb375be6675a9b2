"""The NVMe tier's slot format: a checksummed binary header, zero padding to a 4096-byte boundary,
then the block's raw tensor bytes, then zeros to the end of the slot. A slot is written with one
pwrite and read with one pread, O_DIRECT where the file system allows it. Nothing in a slot is
unpickled or executed; `BlockHeader.parse` verifies before it trusts."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVSBLOCK"
FORMAT_VERSION = 3  # 3: slots in slab files, with a write sequence number; 2 was one file per block
ALIGN = 4096  # the payload offset, and the unit of O_DIRECT IO (covers 512- and 4096-byte sectors)
LEGACY_BLOCK_SUFFIX = ".kvb"  # version-2 block files, one per block in `<hh>` folders; removed at open
TEMP_SUFFIX = ".tmp"
MAX_HASH_BYTES = 64
MAX_HEADER_BYTES = 1 << 16
_PREFIX = struct.Struct("<8sHI")  # magic, format version, header length
_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header at the start of a slot; all integers little-endian.

        off  size  field
        0    8     magic b"KVSBLOCK"
        8    2     format version (3)
        10   4     header length L
        14   2+n   block hash (u16 length, bytes)
        ..   2+n   parent hash (u16 length, bytes; empty for a first block)
        ..   2+n   layout tag (u16 length, UTF-8)
        ..   1+n   dtype name (u8 length, ASCII, e.g. "bfloat16")
        ..   1+8k  shape (u8 ndim k, u64 each)
        ..   8     payload length
        ..   4     payload CRC-32
        ..   8     write sequence number (the tier's recency order across restarts)
        L-4  4     CRC-32 of header bytes [0, L-4)
        L    P-L   zero bytes, up to P = payload_offset = round_up(L, 4096)
        P    ...   payload: the tensor's bytes, C order; zeros after it to the end of the slot

    The head is bytes [0, P): the header and its pad, what `pack` returns and `parse` reads.
    """

    block_hash: bytes
    parent_hash: bytes
    layout_tag: str
    dtype_name: str
    shape: tuple[int, ...]
    payload_len: int
    payload_crc: int
    seq: int = 0

    @property
    def payload_offset(self) -> int:
        return len(self.pack())

    def pack(self) -> bytes:
        """The head: the header, zero-padded to the payload offset."""
        return HeadPacker(self.layout_tag, self.dtype_name, self.shape, self.payload_len).pack(
            self.block_hash, self.parent_hash, self.payload_crc, self.seq)

    @classmethod
    def parse(cls, buf) -> BlockHeader:
        """Verify and decode the head at the start of `buf` (any bytes-like object, e.g. a memoryview
        of a whole slot read into memory); ValueError if it is not a valid one."""
        view = memoryview(buf).cast("B")
        header_len = _header_len(view)
        payload_offset = round_up(header_len)
        if len(view) < payload_offset:
            raise ValueError("truncated header")
        raw = view[:header_len].tobytes()
        if zlib.crc32(raw[:-4]) != _U32.unpack_from(raw, header_len - 4)[0]:
            raise ValueError("header checksum mismatch")
        if view[header_len:payload_offset].tobytes() != bytes(payload_offset - header_len):
            raise ValueError("nonzero bytes between the header and the payload")
        pos = _PREFIX.size

        def take(fmt: struct.Struct) -> int:
            nonlocal pos
            (value,) = fmt.unpack_from(raw, pos)  # struct.error past the end is caught below
            pos += fmt.size
            return value

        def take_bytes(n: int) -> bytes:
            nonlocal pos
            if pos + n > header_len - 4:
                raise ValueError("header field overruns the header")
            pos += n
            return raw[pos - n:pos]

        try:
            block_hash, parent_hash = take_bytes(take(_U16)), take_bytes(take(_U16))
            tag = take_bytes(take(_U16)).decode()
            dtype_name = take_bytes(take(_U8)).decode("ascii")
            shape = tuple(take(_U64) for _ in range(take(_U8)))
            header = cls(block_hash, parent_hash, tag, dtype_name, shape, take(_U64), take(_U32), take(_U64))
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"malformed header: {e}") from None
        if pos != header_len - 4:
            raise ValueError("header length disagrees with its fields")
        return header


class HeadPacker:
    """BlockHeader.pack for the blocks of one layout: the fields they share (layout tag, dtype, shape,
    payload length) are packed once, so a block's head costs about 2 us instead of 5."""

    _TAIL = struct.Struct("<IQ")  # payload CRC-32, write sequence number

    def __init__(self, layout_tag: str, dtype_name: str, shape: tuple[int, ...], payload_len: int):
        tag, dtype = layout_tag.encode(), dtype_name.encode()
        self._layout = b"".join([_U16.pack(len(tag)), tag, _U8.pack(len(dtype)), dtype,
                                 _U8.pack(len(shape)), *(_U64.pack(d) for d in shape), _U64.pack(payload_len)])
        # the header's length less its two hashes: prefix, the hashes' lengths, layout, tail, its CRC
        self._fixed = _PREFIX.size + 2 * _U16.size + len(self._layout) + self._TAIL.size + _U32.size
        self._pads: dict[int, bytes] = {}  # zero pads by header length

    def pack(self, block_hash: bytes, parent_hash: bytes, payload_crc: int, seq: int) -> bytes:
        header_len = self._fixed + len(block_hash) + len(parent_hash)
        head = b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION, header_len), _U16.pack(len(block_hash)), block_hash,
                         _U16.pack(len(parent_hash)), parent_hash, self._layout, self._TAIL.pack(payload_crc, seq)))
        pad = self._pads.get(header_len)
        if pad is None:
            pad = self._pads[header_len] = bytes(round_up(header_len) - header_len)
        return head + _U32.pack(zlib.crc32(head)) + pad


def head_len(buf) -> int:
    """The payload offset, from the fixed prefix at the start of `buf` (its first 14 bytes will do)."""
    return round_up(_header_len(buf))


def header_length(buf) -> int:
    """The header length L (before its zero pad), from the fixed prefix at the start of `buf`."""
    return _header_len(buf)


def max_head_len(layout_tag: str, dtype_name: str, shape: tuple[int, ...]) -> int:
    """The longest head a block of this layout can have: both hashes at their longest."""
    longest = bytes(MAX_HASH_BYTES)
    return BlockHeader(longest, longest, layout_tag, dtype_name, shape, 0, 0).payload_offset


def has_magic(buf) -> bool:
    """Whether `buf` starts like a header of any version: anything else is free space, not a bad block."""
    return bytes(buf[:len(MAGIC)]) == MAGIC


def _header_len(buf) -> int:
    """The header length from the fixed prefix at the start of `buf`, checked for magic, version and range."""
    if len(buf) < _PREFIX.size:
        raise ValueError("truncated header")
    magic, version, header_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"not a version-{FORMAT_VERSION} block header")
    if not _PREFIX.size + _U32.size < header_len <= MAX_HEADER_BYTES:
        raise ValueError(f"bad header length {header_len}")
    return header_len
