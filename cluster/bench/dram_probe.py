"""The DRAM tier's copies alone against a memcpy, for `kvstrata bench tiering`.

In the chat, DRAM's rates are its copies' bytes over their seconds, judged against one memcpy
reference taken before the chat. On a shared host the memory bandwidth moves by half from one
minute to the next (memcpy probes of 15.5 to 28 GB/s within ten minutes on a 2-core Zen 4 EPYC), so
that ratio says as much about the moments as about the tier. This probe takes the tier's own copy
path (`copy_to_host` and `copy_to_device`, as the tier manager calls them) on the chat's block
layout, in **lockstep** with its reference: every segment is a burst of random pool blocks demoted
into random DRAM slots, the same slots promoted back into other pool blocks, and a memcpy from one
contiguous buffer of 64 MB into another on all cores, both on huge pages as the pool and the tier's
storage are (torch's `copy_`, which then writes past the caches as the tier's copies do; a memcpy of
a burst's few megabytes does not, and ran slower than the tier on a Zen 4 EPYC). Before each of the
three, a copy larger than the caches flushes them, as a block the pool evicts has usually left them.
Each side's rate is its bytes over the sum of its own segments' times; the report quotes the round
whose ratio is the median.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvstrata.cluster.bench.bandwidth import MB

_FLUSH_BYTES = 128 * MB  # copied before each timed copy: several times the last-level caches here
_MEMCPY_BYTES = 64 * MB  # the reference's copy


@dataclass(frozen=True, slots=True)
class DramRound:
    """Bytes/s of one round."""

    demote: float
    promote: float
    memcpy: float  # a large contiguous copy, in lockstep


@dataclass(frozen=True)
class DramProbe:
    burst_blocks: int
    block_bytes: int
    segments: int
    rounds: list[DramRound]

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.rounds)

    def to_json(self) -> dict:
        return {"burst_blocks": self.burst_blocks, "block_bytes": self.block_bytes, "segments": self.segments,
                "median_gb_per_s": {k: round(self.median(k) / 1e9, 3) for k in DramRound.__slots__},
                "rounds": [asdict(r) for r in self.rounds]}


def probe_dram_tier(block_shape: tuple[int, ...], dtype: torch.dtype, burst_blocks: int = 16, rounds: int = 3,
                    segments: int = 8, seed: int = 0, flush_bytes: int = _FLUSH_BYTES,
                    memcpy_bytes: int = _MEMCPY_BYTES,
                    clock: Callable[[], float] = time.perf_counter) -> DramProbe:
    """`rounds` rounds of `segments` bursts of `burst_blocks` blocks each way between a pool and a
    DRAM tier of block_shape (layers, K/V, block size, KV heads, head dim), each segment beside a
    memcpy of memcpy_bytes. RuntimeError if a copy moved the wrong bytes."""
    from kvstrata.tiering.block_copy import copy_to_device, copy_to_host
    from kvstrata.tiering.host import host_storage
    from kvstrata.worker.cpu_kernels import load_cpu_kernels
    from kvstrata.worker.huge_pages import empty_on_huge_pages

    for name, value in (("burst_blocks", burst_blocks), ("rounds", rounds), ("segments", segments)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    layers, two, block_size, heads, head_dim = block_shape
    num_pool = 4 * burst_blocks  # demote from one half, promote into the other
    pool_shape = (layers, two, num_pool, block_size, heads, head_dim)
    pool = empty_on_huge_pages(math.prod(pool_shape), dtype).view(pool_shape)  # as the device pool on a CPU
    pool_bytes = pool.view(torch.uint8)  # compared as bytes: random floats include NaNs
    pool_bytes.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    storage = host_storage(4 * burst_blocks, tuple(block_shape), dtype, pin=False)
    kernels = load_cpu_kernels()
    block_bytes = math.prod(block_shape) * dtype.itemsize
    num_bytes = burst_blocks * block_bytes
    # every buffer written once before the first timed copy: a first touch would time page faults;
    # the memcpy's on huge pages as the pool and the tier are (a copy on 4 KB pages times page walks
    # that the tier's copies do not pay)
    src = empty_on_huge_pages(memcpy_bytes, torch.uint8)
    dst = empty_on_huge_pages(memcpy_bytes, torch.uint8).zero_()
    src.random_(0, 256, generator=torch.Generator().manual_seed(seed + 1))
    flush_src = torch.ones(max(flush_bytes // 2, 1), dtype=torch.uint8)
    flush_dst = torch.zeros_like(flush_src)
    rng = random.Random(seed)

    def timed(copy: Callable[[], object]) -> float:
        flush_dst.copy_(flush_src)
        start = clock()
        copy()
        return clock() - start

    results = []
    for _ in range(rounds):
        times: dict[str, list[float]] = {"demote": [], "promote": [], "memcpy": []}
        for _ in range(segments):
            ids = rng.sample(range(num_pool // 2), burst_blocks)
            back = rng.sample(range(num_pool // 2, num_pool), burst_blocks)
            slots = rng.sample(range(storage.shape[0]), burst_blocks)
            times["memcpy"].append(timed(lambda: dst.copy_(src)))
            times["demote"].append(timed(lambda: copy_to_host(pool, ids, storage, slots, kernels)))
            times["promote"].append(timed(lambda: copy_to_device(storage, slots, pool, back, kernels)))
            if not (torch.equal(pool_bytes[:, :, back], pool_bytes[:, :, ids]) and torch.equal(dst, src)):
                raise RuntimeError("the DRAM tier probe's copies moved the wrong bytes")
        moved = {"demote": num_bytes, "promote": num_bytes, "memcpy": memcpy_bytes}
        results.append(DramRound(**{k: segments * moved[k] / sum(v) for k, v in times.items()}))
    return DramProbe(burst_blocks, block_bytes, segments, results)
