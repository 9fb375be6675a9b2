"""The NVMe tier probe of `kvstrata bench tiering`: real IO through a tier on a tiny layout, the
medians it reports, and how its rows enter the transfer table and the targets."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cluster.bench.bandwidth import DiskRates, References
from kvstrata.cluster.bench.tier_probe import PROBE_DIR, ProbeRound, TierProbe, probe_nvme_tier
from kvstrata.cluster.bench.tiering import ChatShape, ConfigResult, TieringReport, TieringSettings
from kvstrata.cluster.bench.transfers import probe_transfers

SHAPE = (2, 2, 4, 2, 32)  # 4 KB of float32: one payload page


def test_probe_moves_real_blocks_and_leaves_nothing_behind(tmp_path):
    probe = probe_nvme_tier(tmp_path, SHAPE, torch.float32, 64 * 4096, rounds=2)
    assert probe.num_blocks == 64 and probe.slot_bytes == 2 * 4096  # a header page, a payload page
    assert len(probe.rounds) == 2
    for r in probe.rounds:
        assert r.write_new > 0 and r.write_reused > 0 and r.read > 0
        assert (r.raw_write_new is None) == (r.raw_write_reused is None) == (r.raw_read is None)
        assert (r.raw_read is None) == (not probe.direct_io)
    assert not (tmp_path / PROBE_DIR).exists() and list(tmp_path.iterdir()) == []
    gb = probe.to_json()["median_gb_per_s"]
    assert gb["read"] == pytest.approx(probe.median("read") / 1e9, abs=1e-3)


def test_the_reference_moves_each_chunk_of_a_call_through_memory_of_its_own(tmp_path):
    """RawFile with a span of two chunks: a call's chunks 0, 1, 2 come from (and go to) the buffer's
    chunks 0, 1, 0, so a segment's bytes move through as much memory as the tier's burst holds, not
    through one buffer warm in the caches."""
    from kvstrata.cluster.bench.tier_probe import _CHUNK, RawFile

    raw = RawFile(tmp_path / "raw", lambda: 0.0, span=_CHUNK + 1)
    try:
        if raw.move("w", 0, 3 * _CHUNK) is None:
            pytest.skip("no O_DIRECT in the test's directory")
        assert raw.chunks == 2 and raw.buf.numel() == 2 * _CHUNK
        data = (tmp_path / "raw").read_bytes()
        buf = raw.buf.numpy().tobytes()
        assert data == buf[:_CHUNK] + buf[_CHUNK:] + buf[:_CHUNK]
        raw.buf.zero_()
        assert raw.move("r", _CHUNK, 2 * _CHUNK) is not None  # file chunks 1, 2 into buffer chunks 0, 1
        assert raw.buf.numpy().tobytes() == data[_CHUNK:]
    finally:
        raw.close()
    one = RawFile(tmp_path / "one", lambda: 0.0)
    assert one.chunks == 1
    one.close()


def test_probe_of_a_quantized_layout(tmp_path):
    probe = probe_nvme_tier(tmp_path, (2, 2, 4, 40), torch.uint8, 10 * 640, rounds=1)
    assert probe.num_blocks == 10 and probe.rounds[0].read > 0


def test_probe_rejects_zero_rounds(tmp_path):
    with pytest.raises(ValueError, match="rounds"):
        probe_nvme_tier(tmp_path, SHAPE, torch.float32, 4096, rounds=0)
    with pytest.raises(ValueError, match="segments"):
        probe_nvme_tier(tmp_path, SHAPE, torch.float32, 4096, segments=0)


def test_probe_times_the_tier_and_the_disk_in_lockstep(tmp_path):
    """Each side's time is the sum of its own segments, taken alternately: a clock that charges each
    call one unit shows every segment of both sides was timed, and that the rates are bytes over
    those sums (a reference measured once before the tier would have two ticks, not `segments`)."""
    ticks = iter(range(10**6))
    probe = probe_nvme_tier(tmp_path, SHAPE, torch.float32, 40 * 4096, rounds=1, segments=4,
                            clock=lambda: float(next(ticks)))
    r = probe.rounds[0]
    total = 40 * probe.slot_bytes
    assert probe.segments == 4
    # each segment: start and end ticks, one unit apart for each side
    assert r.write_new == r.write_reused == r.read == pytest.approx(total / 4)
    if probe.direct_io:
        assert r.raw_write_new == r.raw_write_reused == r.raw_read == pytest.approx(total / 4)


def _probe(direct: bool, raw_read: float | None = 2e9) -> TierProbe:
    rounds = [ProbeRound(1e9, 3e9, 1.5e9, 2e9, 6e9, raw_read), ProbeRound(2e9, 1e9, 1.9e9, 4e9, 4e9, raw_read),
              ProbeRound(1.5e9, 2e9, 1.7e9, 3e9, 2e9, raw_read)]
    return TierProbe(10, 8192, direct, 4, rounds)


def test_probe_rows_come_from_the_round_with_the_median_ratio():
    """Rates are paired within a round: new space ratios are 1/2, 2/4 and 1.5/3 (all 0.5); reused
    3/6, 1/4, 2/2 (0.5, 0.25, 1: the median round is the first); reads 1.5/2, 1.9/2, 1.7/2."""
    rows = {t.name: t for t in probe_transfers(_probe(direct=True))}
    assert set(rows) == {"NVMe write alone, new space", "NVMe write alone, reused slots", "NVMe read alone"}
    assert rows["NVMe write alone, new space"].ratio == pytest.approx(0.5)
    reused = rows["NVMe write alone, reused slots"]
    assert (reused.gb_per_s, reused.reference_gb_per_s) == (pytest.approx(3.0), pytest.approx(6.0))
    assert rows["NVMe read alone"].gb_per_s == pytest.approx(1.7)
    assert rows["NVMe read alone"].ratio == pytest.approx(1.7 / 2)


def test_no_probe_rows_without_o_direct_to_compare_with():
    assert probe_transfers(None) == []
    assert probe_transfers(_probe(direct=False)) == []
    assert probe_transfers(_probe(direct=True, raw_read=None)) == []


def test_probe_rows_are_judged_as_targets():
    chat = ChatShape(1, 2, 16, 16, 4)
    configs = [ConfigResult(name, name, None, None, 1.0, []) for name in ("device", "dram", "nvme")]
    refs = References(10e9, DiskRates(2e9, 1e9, 1e9, 5e9, 1.2e9, 0.9e9))
    report = TieringReport(TieringSettings(chat, 4), 1000, refs, configs, _probe(direct=True))
    met = {t.name: t.met for t in report.transfer_targets()}
    assert met["NVMe read alone >= 80% of O_DIRECT reads, lockstep"] is True  # 85%
    assert met["NVMe write alone, new space >= 80% of O_DIRECT extending writes, lockstep"] is False  # 50%
