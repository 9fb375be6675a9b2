"""One NVMe slot's bytes: a block staged for a write, and a block checked after a read.

    a slot: [ header | 0 pad | payload        | 0 tail ]
            0        L       P                P+len    slot_bytes
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import replace

import numpy
import torch

from kvstrata.tiering.block_file import BlockHeader, head_len, header_length


def _fast_crc():
    """The C kernels where their CRC-32 (the same values as zlib's) is the faster one, else None."""
    from kvstrata.worker.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    return kernels if kernels is not None and kernels.crc32_fast else None


def stage(slot: torch.Tensor, header: BlockHeader, data: torch.Tensor) -> None:
    """Fill a slot's buffer [slot_bytes] with the header (its CRC computed here) and the block's bytes."""
    head = header.pack()  # the payload CRC in it is filled in below
    offset = len(head)  # P
    end = offset + header.payload_len
    src = data.detach().contiguous().view(-1).view(torch.uint8)
    # the CRC is of the staged bytes, so a caller changing `data` meanwhile cannot tear the slot
    kernels = _fast_crc()
    if kernels is not None:  # the whole slot in one pass, without the GIL: the IO threads hold it little
        kernels.stage_slot(slot, head, header_length(head), src)
        return
    payload = slot[offset:end]  # [payload_len]
    numpy.copyto(payload.numpy(), src.numpy())  # one memcpy without the GIL (torch's would start an OpenMP team)
    crc = zlib.crc32(payload.numpy())
    slot[end:].zero_()  # another block's bytes must not reach this slot, even where no one reads
    memoryview(slot.numpy())[:offset] = replace(header, payload_crc=crc).pack()


def stash_crc(slot: torch.Tensor, crc: int) -> None:
    """Keep a block's payload CRC in the first bytes of a slot buffer whose head is not written yet
    (slot_stage.py); the head written over it carries the CRC in its proper place."""
    memoryview(slot.numpy())[:4] = crc.to_bytes(4, "little")


def stashed_crc(slot: torch.Tensor) -> int:
    return int.from_bytes(ctypes.string_at(slot.data_ptr(), 4), "little")  # a slice and .numpy() took ~4 us


def unstage(buf: torch.Tensor, block_hash: bytes, is_our_layout, dtype: torch.dtype,
            shape: tuple[int, ...], known_crc: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The block in a slot just read [slot_bytes], as a view of its payload; ValueError for a bad
    slot: no header, another block, another layout, or a payload that fails its checksum.
    known_crc (offset, length, crc): the CRC-32 of those bytes of buf, already taken (by a C IO
    thread right after its read); used where the header puts the payload exactly there."""
    view = memoryview(buf.numpy())
    header = BlockHeader.parse(view)
    if header.block_hash != block_hash:
        raise ValueError("identity mismatch: the slot holds another block")
    if not is_our_layout(header):
        raise ValueError("layout mismatch")
    offset = head_len(view)
    if offset + header.payload_len > len(view):
        raise ValueError("payload overruns the slot")
    payload = buf[offset:offset + header.payload_len]  # [payload_len]
    if known_crc is not None and known_crc[:2] == (offset, header.payload_len):
        crc = known_crc[2]
    else:
        kernels = _fast_crc()
        crc = kernels.crc32(payload) if kernels is not None else zlib.crc32(payload.numpy())
    if crc != header.payload_crc:
        raise ValueError("payload checksum mismatch")
    return payload.view(dtype).view(shape)
