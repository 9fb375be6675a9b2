"""Block copies between a CUDA device pool and pinned DRAM slots, on a copy stream of their own.

The step loop only enqueues. A demotion gathers its blocks on the compute stream, and the copy
stream moves each run of consecutive slots to pinned memory in one asynchronous copy, overlapping
the next forward passes; the pool's blocks may be reused at once, since the gather already read
them. Small demotions (a decode step's one new block) are held in a device buffer, gathered there
on the compute stream, until HOLD_BYTES of them are waiting: then they go together, in slot order,
so that their copies are long runs instead of one short copy each. A promotion copies runs of
slots to a device buffer on the copy stream, and the compute stream waits for it before scattering
the buffer into the pool, so the forward pass that needs the blocks runs after them.

DRAM slots are also read and written by the CPU (evictions copied out for NVMe, NVMe loads copied
in): `wait()` before any such access, so that it sees, and cannot be overwritten by, a queued copy.
Transfer rates come from CUDA events around each batch of copies on the copy stream, so they count
the PCIe (or C2C) transfer alone; the device-side gather and scatter run at HBM speed.
"""

from __future__ import annotations

import torch

HOLD_BYTES = 16 << 20  # small demotions wait on the device until this much is held


def slot_runs(slots: list[int], rows: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots, for slots already sorted;
    with `rows` (where each slot's data is), a run also needs consecutive rows."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot and (rows is None or rows[i - 1] + 1 == rows[i]):
            first, first_slot, n = runs[-1]
            runs[-1] = (first, first_slot, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on the device, copied from pinned memory without waiting: a copy from
    pageable memory would first wait for the stream's queued work."""
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


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
        # held demotions: a device buffer of hold_blocks blocks, the latest row for each DRAM slot,
        # and an event after which the copy stream has read the buffer (it may be refilled)
        self.hold_blocks = HOLD_BYTES // (storage[0].numel() * storage.element_size())
        self._held: torch.Tensor | None = None
        self._held_rows: dict[int, int] = {}
        self._held_used = 0
        self._held_read: torch.cuda.Event | None = None

    def to_host(self, block_ids: list[int], slots: list[int]) -> None:
        """Pool blocks into DRAM slots, queued; the pool blocks may be overwritten right after."""
        if not block_ids:
            return
        n = len(block_ids)
        if self._held_used + n > self.hold_blocks:
            self.flush()
        if n <= self.hold_blocks:
            self._hold(block_ids, slots)
            return
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots = [slots[i] for i in order]
        ids = device_index([block_ids[i] for i in order], self.kv_cache.device)
        compute = torch.cuda.current_stream(self.kv_cache.device)
        staged = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, lambda row, slot, n: self.storage[slot:slot + n].copy_(
                staged[row:row + n], non_blocking=self.pinned), demote=True)
        staged.record_stream(self.stream)  # its memory is not reused before the stream has read it

    def _hold(self, block_ids: list[int], slots: list[int]) -> None:
        dev = self.kv_cache.device
        compute = torch.cuda.current_stream(dev)
        if self._held is None:
            self._held = torch.empty((self.hold_blocks, *self.storage.shape[1:]), dtype=self.storage.dtype,
                                     device=dev)
        if self._held_read is not None:  # the last flush must have read the buffer before it is refilled
            compute.wait_event(self._held_read)
            self._held_read = None
        first = self._held_used
        ids = device_index(block_ids, dev)
        self._held[first:first + len(ids)].copy_(self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5))
        for k, slot in enumerate(slots):
            self._held_rows[slot] = first + k  # a slot reused since: its latest copy wins
        self._held_used += len(ids)

    def flush(self) -> None:
        """Queue the held demotions' copies, in slot order."""
        if not self._held_rows:
            return
        slots = sorted(self._held_rows)
        rows = [self._held_rows[s] for s in slots]
        held = self._held
        self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, lambda first, slot, n: self.storage[slot:slot + n].copy_(
                held[rows[first]:rows[first] + n], non_blocking=self.pinned), demote=True, rows=rows)
            self._held_read = self._last
        self._held_rows.clear()
        self._held_used = 0

    def to_device(self, slots: list[int], block_ids: list[int]) -> None:
        """DRAM slots into pool blocks, before anything later on the compute stream runs."""
        if not block_ids:
            return
        self.flush()  # a held demotion may be to one of these slots
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slots = [slots[i] for i in order]
        dev = self.kv_cache.device
        ids = device_index([block_ids[i] for i in order], dev)
        compute = torch.cuda.current_stream(dev)
        staged = torch.empty((len(slots), *self.storage.shape[1:]), dtype=self.storage.dtype, device=dev)
        self.stream.wait_stream(compute)  # staged's memory is free for the copy stream too
        with torch.cuda.stream(self.stream):
            self._copy_runs(slots, lambda row, slot, n: staged[row:row + n].copy_(
                self.storage[slot:slot + n], non_blocking=self.pinned), demote=False)
        compute.wait_event(self._last)
        self.kv_cache.index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4, 5))

    def _copy_runs(self, slots: list[int], copy, demote: bool, rows: list[int] | None = None) -> None:
        """copy(first, slot, n) for each run of slots (whose `rows`, if given, are consecutive too),
        timed on the copy stream."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for first, slot, n in slot_runs(slots, rows):
            copy(first, slot, n)
        end.record()
        self._last = end
        self._timed.append((start, end, len(slots) * self.storage[0].numel() * self.storage.element_size(), demote))
        if len(self._timed) >= 256:
            self.settle()

    def wait(self) -> None:
        """Block until every queued copy is done: before the CPU reads or writes DRAM slots."""
        self.flush()
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
