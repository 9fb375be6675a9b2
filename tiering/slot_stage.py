"""Blocks copied out of DRAM straight into NVMe slot buffers.

A block that DRAM evicts towards NVMe is copied out anyway, since its DRAM slot is reused at once.
`StagedCopies.copy` makes that copy into a slot-sized, 4096-aligned write buffer, at the payload's
place, computing the payload's CRC-32 on the way (one pass, in C, without the GIL), and returns
the payload as a block-shaped tensor. When that tensor is put into the tier, the IO thread only
fills in the header and writes the buffer: no second copy of the block and no second pass over it
for the checksum, the two things that took most of an IO thread's CPU time.

    write buffer: [ head (filled in by the write; the CRC waits in its first 4 bytes) | payload | 0 ]
                  0                                                                   P         P+n

Used only where every header of the layout fits one 4096-byte head (so the payload offset P is
the same for every block) and the C CRC is available; elsewhere `copy` is a plain clone and the
IO thread stages the block as before. A buffer goes back to the pool once its write is done, or
when its block is not put after all (`release`); one never handed back is only lost to reuse.
"""

from __future__ import annotations

import threading

import torch

from kvstrata.tiering.block_file import ALIGN
from kvstrata.tiering.slot_codec import stash_crc
from kvstrata.tiering.slot_io import ReadBuffers


class StagedCopies:
    def __init__(self, slot_bytes: int, head_bytes: int, dtype: torch.dtype, block_shape: tuple[int, ...],
                 payload_bytes: int, limit: int):
        from kvstrata.worker.cpu_kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        self.kernels = kernels if kernels is not None and kernels.crc32_fast else None
        self.enabled = self.kernels is not None and head_bytes == ALIGN
        self.offset = head_bytes  # P
        self.dtype = dtype
        self.block_shape = block_shape
        self.payload_bytes = payload_bytes
        self.buffers = ReadBuffers(slot_bytes, limit)
        self._out: dict[int, torch.Tensor] = {}  # a staged payload's address -> its slot buffer
        self._lock = threading.Lock()

    def copy(self, block: torch.Tensor) -> torch.Tensor:
        """A copy of `block` (dtype and shape of the tier's layout), staged in a write buffer when
        enabled, else a plain clone."""
        if not self.enabled or not block.is_contiguous():
            return block.clone()
        buf = self.buffers.take()  # [slot_bytes] uint8
        p, n = self.offset, self.payload_bytes
        payload = buf[p:p + n]
        crc = self.kernels.copy_crc32(block.view(-1).view(torch.uint8), payload)
        if p + n < buf.numel():
            buf[p + n:].zero_()
        stash_crc(buf, crc)
        staged = self.payload(buf)
        with self._lock:
            self._out[staged.data_ptr()] = buf
        return staged

    def payload(self, buf: torch.Tensor, staged: torch.Tensor | None = None) -> torch.Tensor:
        """The block staged in a write buffer, as a view of it: `staged` itself where it is that view
        already (what copy returned, of the block's shape and dtype), which saves making it again
        (about 5 us of a put's 15-20 a block)."""
        if staged is not None and staged.data_ptr() == buf.data_ptr() + self.offset and staged.is_contiguous():
            return staged
        return buf[self.offset:self.offset + self.payload_bytes].view(self.dtype).view(self.block_shape)

    def claim(self, data: torch.Tensor) -> torch.Tensor | None:
        """The write buffer `data` was staged in (now the caller's to write and give back), or None
        for any other tensor."""
        with self._lock:
            buf = self._out.get(data.data_ptr())
            if buf is None or data.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                return None
            del self._out[data.data_ptr()]
        return buf

    def release(self, data: torch.Tensor | None) -> None:
        """A staged block that will not be written: its buffer goes back to the pool."""
        if data is not None:
            buf = self.claim(data)
            if buf is not None:
                self.buffers.give([buf])

    def give(self, bufs: list[torch.Tensor]) -> None:
        self.buffers.give(bufs)

    def __len__(self) -> int:
        """Staged blocks not yet claimed."""
        return len(self._out)
