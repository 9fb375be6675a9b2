"""The slot header's bytes, against the layout BlockHeader documents, built here field by field."""

from __future__ import annotations

import struct
import zlib

import pytest

from kvstrata.tiering.block_file import BlockHeader, HeadPacker, round_up


def documented_head(block_hash: bytes, parent_hash: bytes, tag: str, dtype: str, shape: tuple[int, ...],
                    payload_len: int, crc: int, seq: int) -> bytes:
    body = (struct.pack("<H", len(block_hash)) + block_hash + struct.pack("<H", len(parent_hash)) + parent_hash
            + struct.pack("<H", len(tag)) + tag.encode() + struct.pack("<B", len(dtype)) + dtype.encode()
            + struct.pack("<B", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<QIQ", payload_len, crc, seq))
    header_len = 8 + 2 + 4 + len(body) + 4
    head = b"KVSBLOCK" + struct.pack("<HI", 3, header_len) + body
    return head + struct.pack("<I", zlib.crc32(head)) + bytes(round_up(header_len) - header_len)


@pytest.mark.parametrize("block_hash, parent_hash", [(b"h" * 32, b""), (b"a" * 64, b"b" * 64), (b"x", b"p" * 7)])
def test_the_packer_writes_the_documented_head_for_every_hash_length(block_hash, parent_hash):
    shape = (30, 2, 3, 16, 64)
    packer = HeadPacker("llama-30x3x64", "bfloat16", shape, 368640)
    for crc, seq in ((0, 0), (0xDEADBEEF, 2**40 + 7)):  # the same packer twice: pads and layout reused
        head = packer.pack(block_hash, parent_hash, crc, seq)
        assert head == documented_head(block_hash, parent_hash, "llama-30x3x64", "bfloat16", shape, 368640, crc, seq)
        assert len(head) % 4096 == 0
        parsed = BlockHeader.parse(head)
        assert (parsed.block_hash, parsed.parent_hash, parsed.payload_crc, parsed.seq) == (block_hash, parent_hash,
                                                                                           crc, seq)
        assert parsed.shape == shape and parsed.payload_len == 368640 and parsed.dtype_name == "bfloat16"
    assert BlockHeader(block_hash, parent_hash, "t", "float32", (4,), 16, 1, 2).pack() == documented_head(
        block_hash, parent_hash, "t", "float32", (4,), 16, 1, 2)
