"""The DRAM tier probe of `kvstrata bench tiering`: the tier's own copy path on a tiny layout, timed
in lockstep with a memcpy, and how its rows enter the transfer table and the targets."""

from __future__ import annotations

import pytest
import torch

import kvstrata.tiering.block_copy as block_copy
from kvstrata.cluster.bench.bandwidth import DiskRates, References
from kvstrata.cluster.bench.dram_probe import DramProbe, DramRound, probe_dram_tier
from kvstrata.cluster.bench.tiering import ChatShape, ConfigResult, TieringReport, TieringSettings
from kvstrata.cluster.bench.transfers import dram_probe_transfers

SHAPE = (2, 2, 4, 2, 8)  # (layers, K/V, block size, KV heads, head dim): 1 KB of float32
MB = 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_moves_real_blocks(dtype):
    probe = probe_dram_tier(SHAPE, dtype, burst_blocks=3, rounds=2, segments=2, flush_bytes=MB, memcpy_bytes=MB)
    assert (probe.burst_blocks, probe.segments, len(probe.rounds)) == (3, 2, 2)
    assert probe.block_bytes == 256 * dtype.itemsize
    assert all(r.demote > 0 and r.promote > 0 and r.memcpy > 0 for r in probe.rounds)
    assert probe.to_json()["median_gb_per_s"]["memcpy"] == pytest.approx(probe.median("memcpy") / 1e9, abs=1e-3)


def test_probe_checks_the_bytes_its_copies_moved(monkeypatch):
    def lossy(storage, slots, kv_cache, block_ids, kernels=None):  # promotes every block but the last
        block_copy_device(storage, slots[:-1], kv_cache, block_ids[:-1], kernels)

    block_copy_device = block_copy.copy_to_device
    monkeypatch.setattr(block_copy, "copy_to_device", lossy)
    with pytest.raises(RuntimeError, match="wrong bytes"):
        probe_dram_tier(SHAPE, torch.float32, burst_blocks=2, rounds=1, segments=1, flush_bytes=MB, memcpy_bytes=MB)


def test_probe_times_the_tier_and_the_memcpy_in_lockstep():
    """A clock that charges each call one unit: every segment of each side was timed on its own
    (start and end), so each rate is a segment's bytes per unit."""
    ticks = iter(range(10**6))
    probe = probe_dram_tier(SHAPE, torch.float32, burst_blocks=2, rounds=1, segments=3, flush_bytes=MB,
                            memcpy_bytes=MB, clock=lambda: float(next(ticks)))
    r = probe.rounds[0]
    assert r.demote == r.promote == pytest.approx(2 * probe.block_bytes)
    assert r.memcpy == pytest.approx(MB)


@pytest.mark.parametrize("kwargs, name", [({"burst_blocks": 0}, "burst_blocks"), ({"rounds": 0}, "rounds"),
                                          ({"segments": -1}, "segments")])
def test_probe_rejects_non_positive_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        probe_dram_tier(SHAPE, torch.float32, **kwargs)


def _probe() -> DramProbe:
    # demote/memcpy: 8/10, 19/20, 17/20 (the median round: the third, 0.85); promote 12/10, 10/20, 7/20
    # (the second, 0.5)
    rounds = [DramRound(8e9, 12e9, 10e9), DramRound(19e9, 10e9, 20e9), DramRound(17e9, 7e9, 20e9)]
    return DramProbe(16, 1000, 8, rounds)


def test_probe_rows_come_from_the_round_with_the_median_ratio():
    rows = {t.name: t for t in dram_probe_transfers(_probe())}
    demote = rows["DRAM demote alone, bursts of 16 blocks"]
    assert demote.ratio == pytest.approx(0.85)
    assert (demote.gb_per_s, demote.reference_gb_per_s) == (pytest.approx(17.0), pytest.approx(20.0))
    promote = rows["DRAM promote alone, bursts of 16 blocks"]
    assert (promote.gb_per_s, promote.ratio) == (pytest.approx(10.0), pytest.approx(0.5))
    assert dram_probe_transfers(None) == []


def test_probe_rows_are_judged_as_targets():
    chat = ChatShape(1, 2, 16, 16, 4)
    configs = [ConfigResult(name, name, None, None, 1.0, []) for name in ("device", "dram", "nvme")]
    refs = References(10e9, DiskRates(2e9, 1e9, 1e9, 5e9, 1.2e9, 0.9e9))
    report = TieringReport(TieringSettings(chat, 4), 1000, refs, configs, None, _probe())
    met = {t.name: t.met for t in report.transfer_targets()}
    assert met["DRAM demote alone, bursts of 16 blocks >= 80% of memcpy, lockstep"] is True  # 85%
    assert met["DRAM promote alone, bursts of 16 blocks >= 80% of memcpy, lockstep"] is False  # 50%
