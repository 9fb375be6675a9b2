"""The NVMe tier's file format: a checksummed binary header, then the block's raw tensor bytes.
Nothing in a tier file is unpickled or executed; `BlockHeader.read` verifies before it trusts."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVSBLOCK"
FORMAT_VERSION = 1
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
MAX_HASH_BYTES = 64
MAX_HEADER_BYTES = 1 << 16
_PREFIX = struct.Struct("<8sHI")  # magic, format version, header length (payload offset)
_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The header of a tier file; all integers little-endian.

        off  size  field
        0    8     magic b"KVSBLOCK"
        8    2     format version (1)
        10   4     header length L = offset of the payload
        14   2+n   block hash (u16 length, bytes)
        ..   2+n   parent hash (u16 length, bytes; empty for a first block)
        ..   2+n   layout tag (u16 length, UTF-8)
        ..   1+n   dtype name (u8 length, ASCII, e.g. "bfloat16")
        ..   1+8k  shape (u8 ndim k, u64 each)
        ..   8     payload length
        ..   4     payload CRC-32
        L-4  4     CRC-32 of header bytes [0, L-4)
        L    ...   payload: the tensor's bytes, C order
    """

    block_hash: bytes
    parent_hash: bytes
    layout_tag: str
    dtype_name: str
    shape: tuple[int, ...]
    payload_len: int
    payload_crc: int

    def pack(self) -> bytes:
        tag, dtype = self.layout_tag.encode(), self.dtype_name.encode()
        body = b"".join([
            _U16.pack(len(self.block_hash)), self.block_hash,
            _U16.pack(len(self.parent_hash)), self.parent_hash,
            _U16.pack(len(tag)), tag,
            _U8.pack(len(dtype)), dtype,
            _U8.pack(len(self.shape)), *(_U64.pack(d) for d in self.shape),
            _U64.pack(self.payload_len), _U32.pack(self.payload_crc),
        ])
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, _PREFIX.size + len(body) + _U32.size) + body
        return head + _U32.pack(zlib.crc32(head))

    @classmethod
    def read(cls, f) -> BlockHeader:
        """Read and verify a header from the start of a file; ValueError if it is not a valid one."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            raise ValueError("truncated header")
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise ValueError(f"not a version-{FORMAT_VERSION} block file")
        if not _PREFIX.size + _U32.size < header_len <= MAX_HEADER_BYTES:
            raise ValueError(f"bad header length {header_len}")
        raw = prefix + f.read(header_len - _PREFIX.size)
        if len(raw) != header_len:
            raise ValueError("truncated header")
        if zlib.crc32(raw[:-4]) != _U32.unpack_from(raw, header_len - 4)[0]:
            raise ValueError("header checksum mismatch")
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
            header = cls(block_hash, parent_hash, tag, dtype_name, shape, take(_U64), take(_U32))
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"malformed header: {e}") from None
        if pos != header_len - 4:
            raise ValueError("header length disagrees with its fields")
        return header
