"""The chat's lockstep disk reference in `kvstrata bench tiering` (chat_lockstep.py): after each turn
it waits for the tier's writes, moves the same bytes through a plain O_DIRECT file, and keeps its own
seconds out of the chat's wall time; its rows enter the transfer table and the targets."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstrata.cluster.bench.bandwidth import DiskRates, References
from kvstrata.cluster.bench.chat_lockstep import CHAT_RAW_FILE, ChatLockstep, ChatReference
from kvstrata.cluster.bench.tiering import (
    ChatShape,
    ConfigResult,
    TieringReport,
    TieringSettings,
    TurnResult,
    run_chat,
)
from kvstrata.cluster.bench.tiering_cli import format_report
from kvstrata.cluster.bench.transfers import chat_lockstep_transfers
from kvstrata.tiering.block_file import ALIGN, round_up
from kvstrata.tiering.disk_io import supports_direct_io
from kvstrata.tiering.nvme import NvmeTier

SHAPE = (2, 2, 4, 2, 8)
SLOT = ALIGN + round_up(math.prod(SHAPE) * 4)


class FakeTier:
    """The counters a turn moves, and a flush that records that it ran."""

    def __init__(self):
        self.written = self.read = 0
        self.num_pending_writes = 0
        self.flushes = 0

    def stats(self) -> dict:
        return {"bytes_written": self.written, "bytes_read": self.read}

    def flush(self) -> None:
        self.flushes += 1
        self.num_pending_writes = 0


def _needs_direct(path: Path) -> None:
    if not supports_direct_io(path):
        pytest.skip(f"{path} does not support O_DIRECT")


def test_each_turn_moves_the_tiers_bytes_through_the_reference_and_times_only_that(tmp_path):
    _needs_direct(tmp_path)
    ticks = iter(range(10**6))
    tier = FakeTier()
    tier.written = 5 * 4096  # before the chat: not the chat's
    lockstep = ChatLockstep(tier, tmp_path, clock=lambda: float(next(ticks)))
    tier.written += 3 * 4096
    tier.read += 2 * 4096
    tier.num_pending_writes = 1
    assert lockstep.after_turn() == pytest.approx(2.0)  # one tick for the write, one for the read
    assert (tmp_path / CHAT_RAW_FILE).stat().st_size == 3 * 4096
    assert lockstep.after_turn() == 0.0  # nothing moved: nothing timed
    tier.written += 4096
    assert lockstep.after_turn() == pytest.approx(1.0)
    ref = lockstep.reference()
    assert tier.flushes == 3
    assert (ref.write_bytes, ref.read_bytes, ref.turns_waited) == (4 * 4096, 2 * 4096, 1)
    assert (ref.write_seconds, ref.read_seconds) == (pytest.approx(2.0), pytest.approx(1.0))
    assert ref.gb_per_s("write") == pytest.approx(4 * 4096 / 2 / 1e9)
    lockstep.close()
    assert list(tmp_path.iterdir()) == []


def test_a_real_tiers_turn(tmp_path):
    tier = NvmeTier(tmp_path / "nvme", 8 * SLOT, SHAPE, torch.float32, layout_tag="lockstep")
    if not tier.direct_io:
        tier.close()
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    lockstep = ChatLockstep(tier, tmp_path)
    try:
        blocks = [torch.full(SHAPE, float(i)) for i in range(3)]
        tier.put_many([(bytes([i]) * 16, None, b) for i, b in enumerate(blocks)])  # the flush waits for them
        lockstep.after_turn()
        assert all(torch.equal(a, b) for a, b in zip(tier.get_many([bytes([i]) * 16 for i in range(3)]).result(),
                                                       blocks))
        lockstep.after_turn()
        ref = lockstep.reference()
        stats = tier.stats()
        assert ref.write_bytes == stats["bytes_written"] == 3 * SLOT
        assert ref.read_bytes == stats["bytes_read"] == 3 * SLOT
        assert ref.write_seconds > 0 and ref.read_seconds > 0
    finally:
        lockstep.close()
        tier.close()
    assert not (tmp_path / CHAT_RAW_FILE).exists()


def test_without_o_direct_the_reference_has_no_seconds(tmp_path, monkeypatch):
    tier = FakeTier()
    lockstep = ChatLockstep(tier, tmp_path)
    lockstep.raw.fd = None  # as where the filesystem refused O_DIRECT
    tier.written = tier.read = 4096
    assert lockstep.after_turn() == 0.0
    ref = lockstep.reference()
    assert ref.write_seconds is None and ref.gb_per_s("read") is None
    assert chat_lockstep_transfers({"bytes_written": 4096, "write_busy_seconds": 1.0}, ref) == []
    lockstep.close()


def _fake_llm(clock_box: list[float]) -> SimpleNamespace:
    """An engine whose every request takes one step of 1 second and answers two tokens."""
    groups: dict = {}

    def add_request(rid, prompt, params):
        groups[rid] = SimpleNamespace(samples=[SimpleNamespace(num_output_tokens=0)])

    def step():
        clock_box[0] += 1.0
        rid = next(iter(groups))
        groups.pop(rid).samples[0].num_output_tokens = 2
        return [SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(token_ids=[1, 2])])]

    return SimpleNamespace(engine=SimpleNamespace(add_request=add_request, step=step, groups=groups))


def test_run_chat_leaves_the_hooks_seconds_out_of_the_wall():
    clock_box = [0.0]
    calls = []

    def after_turn() -> float:
        clock_box[0] += 10.0  # the reference's IO
        calls.append(clock_box[0])
        return 10.0

    messages = [[[5, 6], [7]], [[8, 9], [10]]]  # 2 conversations x 2 turns
    wall, turns = run_chat(_fake_llm(clock_box), messages, 2, clock=lambda: clock_box[0], after_turn=after_turn)
    assert len(calls) == len(turns) == 4
    assert wall == pytest.approx(4.0)  # four 1-second turns; the 40 s of reference IO left out
    wall, _ = run_chat(_fake_llm(clock_box), messages, 2, clock=lambda: clock_box[0])
    assert wall == pytest.approx(4.0)


def _report(reference: ChatReference | None, **io_seconds: float | None) -> TieringReport:
    turns = [TurnResult(0, 0, 32, 0, 0.2, 0.3, (1, 2, 3, 4)), TurnResult(0, 1, 52, 0, 0.4, 0.5, (1, 2, 3, 4))]
    configs = [ConfigResult(name, name, None, None, 1.0, turns) for name in ("device", "dram")]
    nvme = {"bytes_written": 2 * 10**9, "write_busy_seconds": 2.0, "bytes_read": 3 * 10**9,
            "read_busy_seconds": 1.0, "direct_io": True, **io_seconds}
    configs.append(ConfigResult("nvme", "nvme", 2, 8, 1.0, turns, {"nvme": nvme}, reference))
    refs = References(10e9, DiskRates(2e9, 1e9, 1e9, 5e9, 4e9, 6e9))
    return TieringReport(TieringSettings(ChatShape(1, 2, 16, 16, 4), 4), 1000, refs, configs)


def test_lockstep_rows_are_judged_as_targets():
    # the tier: writes 1 GB/s, reads 3 GB/s; the reference: writes 1.1 GB/s (91%), reads 5 GB/s (60%)
    report = _report(ChatReference(11 * 10**8, 1.0, 10**9, 0.2, 0))
    met = {t.name: t.met for t in report.transfer_targets()}
    assert met["NVMe write in the chat >= 80% of O_DIRECT writes of each turn's bytes, lockstep"] is True
    assert met["NVMe read in the chat >= 80% of O_DIRECT reads of each turn's bytes, lockstep"] is False
    # the probe taken before the chat is still reported beside them: 1 of 4 GB/s, 3 of 6
    assert met["NVMe write >= 80% of sequential O_DIRECT write"] is False
    assert report.to_json()["chat_reference"]["read_gb_per_s"] == pytest.approx(5.0)
    assert "NVMe in the chat, lockstep" in format_report(report)


def test_no_lockstep_rows_without_a_reference():
    report = _report(None)
    assert not [t for t in report.transfers() if "lockstep" in t.reference and "chat" in t.name]
    assert report.to_json()["chat_reference"] is None
    assert "NVMe in the chat, lockstep" not in format_report(report)


def test_the_ios_time_in_syscalls_is_reported_beside_the_lockstep_rows_and_never_judged():
    # busy clocks: writes 1 GB/s (91% of 1.1), reads 3 GB/s (60% of 5); in syscalls only: 2 GB/s and 4 GB/s
    report = _report(ChatReference(11 * 10**8, 1.0, 10**9, 0.2, 0), write_io_seconds=1.0, read_io_seconds=0.75)
    rows = {t.name: t for t in report.transfers()}
    write = rows["NVMe write in the chat, its IO in syscalls only"]
    read = rows["NVMe read in the chat, its IO in syscalls only"]
    assert not write.target and not read.target
    assert write.gb_per_s == pytest.approx(2.0) and write.reference_gb_per_s == pytest.approx(1.1)
    assert read.ratio == pytest.approx(0.8)
    judged = {t.name for t in report.transfer_targets()}
    assert not any("syscalls" in name for name in judged)
    assert "NVMe read in the chat >= 80% of O_DIRECT reads of each turn's bytes, lockstep" in judged
    text = format_report(report)
    assert "where the NVMe time goes (not targets):" in text
    assert "NVMe read in the chat, its IO in syscalls only: 4.00 GB/s = 80% of" in text
    # Python IO threads have no such clock: no rows, no section
    plain = _report(ChatReference(11 * 10**8, 1.0, 10**9, 0.2, 0), write_io_seconds=None, read_io_seconds=None)
    assert not [t for t in plain.transfers() if not t.target]
    assert "where the NVMe time goes" not in format_report(plain)
