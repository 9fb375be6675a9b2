"""Block copies between a CUDA device pool and pinned DRAM slots, on a copy stream of their own.

The step loop only enqueues. A demotion gathers its blocks on the compute stream (in slot order,
so that consecutive slots are consecutive rows), and the copy stream moves each run of consecutive
slots to pinned memory in one asynchronous copy, overlapping the next forward passes; the pool's
blocks may be reused at once, since the gather already read them. A promotion copies runs of
slots to a device buffer on the copy stream, and the compute stream waits for it before scattering
the buffer into the pool, so the forward pass that needs the blocks runs after them.

DRAM slots are also read and written by the CPU (evictions copied out for NVMe, NVMe loads copied
in): `wait()` before any such access, so that it sees, and cannot be overwritten by, a queued copy.
Transfer rates come from CUDA events around each batch of copies on the copy stream, so they count
the PCIe (or C2C) transfer alone; the device-side gather and scatter run at HBM speed.
"""

from __future__ import annotations

import torch


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive slots, for slots already sorted."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, n = runs[-1]
            runs[-1] = (first_row, first_slot, n + 1)
        else:
            runs.append((row, slot, 1))
    return runs


class CudaBlockCopier:
    def __init__(self, kv_cache: torch.Tensor, storage: torch.Tensor, counters):
        """`counters`: a TierCounters, to which settled copies add their bytes and seconds."""
        if not kv_cache.is_cuda or storage.device.type != "cpu":
            raise ValueError("CudaBlockCopier needs a CUDA pool and host storage")
        self.kv_cache = kv_cache
        self.storage = storage
        self.pinned = storage.is_pinned()
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._last: torch.cuda.Event | None = None  # the latest copy queued on the stream
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int, bool]] = []
        self.counters = counters

    def to_host(self, block_ids: list[int], slots: list[int]) -> None:
        """Pool blocks into DRAM slots, queued; the pool blocks may be overwritten right after."""
        if not block_ids:
            return
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots = [slots[i] for i in order]
        ids = torch.tensor([block_ids[i] for i in order], device=self.kv_cache.device)
        compute = torch.cuda.current_stream(self.kv_cache.device)
        staged = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, lambda row, slot, n: self.storage[slot:slot + n].copy_(
                staged[row:row + n], non_blocking=self.pinned), demote=True)
        staged.record_stream(self.stream)  # its memory is not reused before the stream has read it

    def to_device(self, slots: list[int], block_ids: list[int]) -> None:
        """DRAM slots into pool blocks, before anything later on the compute stream runs."""
        if not block_ids:
            return
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots = [slots[i] for i in order]
        dev = self.kv_cache.device
        ids = torch.tensor([block_ids[i] for i in order], device=dev)
        compute = torch.cuda.current_stream(dev)
        staged = torch.empty((len(slots), *self.storage.shape[1:]), dtype=self.storage.dtype, device=dev)
        self.stream.wait_stream(compute)  # staged's memory is free for the copy stream too
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, lambda row, slot, n: staged[row:row + n].copy_(
                self.storage[slot:slot + n], non_blocking=self.pinned), demote=False)
        compute.wait_event(self._last)
        self.kv_cache.index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4, 5))

    def _copy_runs(self, slots: list[int], copy, demote: bool) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for row, slot, n in slot_runs(slots):
            copy(row, slot, n)
        end.record()
        self._last = end
        self._timed.append((start, end, len(slots) * self.storage[0].numel() * self.storage.element_size(), demote))
        if len(self._timed) >= 256:
            self.settle()

    def wait(self) -> None:
        """Block until every queued copy is done: before the CPU reads or writes DRAM slots."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None

    def settle(self) -> None:
        """Add the finished copies' bytes and seconds to the counters."""
        c, left = self.counters, []
        for start, end, num_bytes, demote in self._timed:
            if not end.query():
                left.append((start, end, num_bytes, demote))
                continue
            seconds = start.elapsed_time(end) / 1e3
            if demote:
                c.demote_bytes += num_bytes
                c.demote_seconds += seconds
            else:
                c.promote_bytes += num_bytes
                c.promote_seconds += seconds
        self._timed = left
