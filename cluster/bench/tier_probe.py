"""The NVMe tier alone against the disk, for `kvstrata bench tiering`.

In the chat the tier's IO threads share the cores with forward passes, so its rates there mix the
disk with CPU contention. This probe moves the chat's own block layout through a fresh tier with
nothing else running: a burst of puts into new slab space, a second burst into the slots of the
first (each put evicts one), then one get_many of the second burst, each timed from the first call
to the last block done. Every round measures one thread's sequential IO of the same bytes in the
same directory first (8 MB chunks, O_DIRECT where the tier uses it), so that each pair shares the
disk's moment; the report quotes the medians of the rounds.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvstrata.cluster.bench.bandwidth import MB, measure_direct

PROBE_DIR = "tier-probe"
_TAG = "probe"  # the probe tier's layout tag
_NUM_PATTERNS = 8  # distinct block contents cycled through the puts


@dataclass(frozen=True, slots=True)
class ProbeRound:
    """Bytes/s of one round; raw_* are None where the filesystem has no O_DIRECT."""

    write_new: float
    write_reused: float
    read: float
    raw_write: float | None
    raw_read: float | None


@dataclass(frozen=True)
class TierProbe:
    num_blocks: int
    slot_bytes: int
    direct_io: bool
    rounds: list[ProbeRound]

    def median(self, name: str) -> float | None:
        xs = [getattr(r, name) for r in self.rounds if getattr(r, name) is not None]
        return statistics.median(xs) if xs else None

    def to_json(self) -> dict:
        gb = {k: None if (m := self.median(k)) is None else round(m / 1e9, 3) for k in ProbeRound.__slots__}
        return {"num_blocks": self.num_blocks, "slot_bytes": self.slot_bytes, "direct_io": self.direct_io,
                "median_gb_per_s": gb, "rounds": [asdict(r) for r in self.rounds]}


def probe_nvme_tier(directory: Path, block_shape: tuple[int, ...], dtype: torch.dtype, num_bytes: int,
                    rounds: int = 3, clock: Callable[[], float] = time.perf_counter) -> TierProbe:
    """`rounds` rounds of about num_bytes each way through a tier in directory/tier-probe (removed after)."""
    from kvstrata.tiering.block_file import max_head_len
    from kvstrata.tiering.nvme import NvmeTier
    from kvstrata.tiering.slab import SLAB_BYTES, SlabGeometry

    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    payload = torch.Size(block_shape).numel() * dtype.itemsize
    head = max_head_len(_TAG, str(dtype).removeprefix("torch."), tuple(block_shape))
    slot_bytes = SlabGeometry.plan(0, head, payload, SLAB_BYTES).slot_bytes
    patterns = [torch.randint(0, 256, (payload,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                .view(dtype).view(block_shape) for i in range(_NUM_PATTERNS)]
    num_blocks = max(2, num_bytes // payload)
    tier_dir = directory / PROBE_DIR
    results, direct = [], False
    total = num_blocks * slot_bytes
    for r in range(rounds):
        shutil.rmtree(tier_dir, ignore_errors=True)
        raw_write, raw_read = measure_direct(directory, max(1, total // (8 * MB)), min(8 * MB, total), clock)
        tier = NvmeTier(tier_dir, total, block_shape, dtype, layout_tag=_TAG)
        try:
            direct = tier.direct_io
            assert tier.geometry.slot_bytes == slot_bytes, "the probe sized its tier by another slot"
            keys = [[f"{r}/{burst}/{i}".encode() for i in range(num_blocks)] for burst in range(2)]
            writes = [_put_burst(tier, burst, patterns, clock) for burst in keys]
            gc.collect()
            start = clock()
            got = tier.get_many(keys[1]).result()
            read_s = clock() - start
            if any(g is None or not torch.equal(g.view(torch.uint8), patterns[i % _NUM_PATTERNS].view(torch.uint8))
                   for i, g in enumerate(got)):
                raise RuntimeError(f"the NVMe tier probe read back wrong or missing blocks in {tier_dir}")
        finally:
            tier.close()
            shutil.rmtree(tier_dir, ignore_errors=True)
        results.append(ProbeRound(total / writes[0], total / writes[1], total / read_s, raw_write, raw_read))
    return TierProbe(num_blocks, slot_bytes, direct, results)


def _put_burst(tier, keys: list[bytes], patterns: list[torch.Tensor], clock: Callable[[], float]) -> float:
    """Seconds from the first put to the last block stored; RuntimeError if one was not."""
    gc.collect()  # a collection in the middle would time the interpreter, not the tier
    start = clock()
    futures = [tier.put(k, None, patterns[i % len(patterns)]) for i, k in enumerate(keys)]
    stored = [f.result() for f in futures]
    seconds = clock() - start
    if not all(stored):
        raise RuntimeError(f"the NVMe tier probe could not store {stored.count(False)} of {len(keys)} blocks")
    return seconds
