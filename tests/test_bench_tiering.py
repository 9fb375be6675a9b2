"""`kvstrata bench tiering`: the chat's arithmetic, the targets' verdicts, and the --quick run on the real
model (each tier adds hits, NVMe serves blocks, greedy outputs do not change), through the library and
the command."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstrata.cluster.bench.bandwidth import DiskRates, References
from kvstrata.cluster.bench.tiering import (
    ChatShape,
    ConfigResult,
    TieringReport,
    TieringSettings,
    TurnResult,
    ideal_hit_rate,
    run_tiering_bench,
)
from kvstrata.cluster.bench.tiering_cli import add_bench_tiering_parser, format_report, settings_from_args
from kvstrata.cluster.bench.workloads import multi_turn
from kvstrata.cluster.cli import main
from tests.conftest import needs_model


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_tiering_parser(parser.add_subparsers())
    return parser.parse_args(["tiering", *argv])


# -- arithmetic -----------------------------------------------------------------------------------

def test_user_messages_with_the_synthetic_answers_put_back_are_the_multi_turn_prompts():
    shape = ChatShape(num_conversations=3, num_turns=3, system_len=8, user_len=4, answer_len=2, seed=5)
    messages = shape.user_messages()
    prompts = multi_turn(3, 3, user_turn_len=4, assistant_turn_len=2, system_prompt_len=8, seed=5).requests
    for c in range(3):
        assert [len(m) for m in messages[c]] == [12, 4, 4]
        history: list[int] = []
        for t in range(3):
            history += messages[c][t]
            assert history == prompts[t * 3 + c].prompt_token_ids
            if t < 2:  # the next prompt holds this turn's synthetic answer right after it
                history += prompts[(t + 1) * 3 + c].prompt_token_ids[len(history):len(history) + 2]
    assert shape.history_len == 8 + 3 * (4 + 2)


def _turn(conv: int, turn: int, prompt: int, cached: int, ttft: float, answer: int = 4) -> TurnResult:
    return TurnResult(conv, turn, prompt, cached, ttft, ttft + 0.1, tuple(range(answer)))


def test_ideal_hit_rate_counts_full_blocks_of_the_previous_prompt_and_answer():
    # turn 1 may hit (20 + 4 - 1) // 16 = 1 block of the 23 computed tokens; turn 2 (40 + 4 - 1) // 16 = 2
    turns = [_turn(0, 0, 20, 0, 1.0), _turn(0, 1, 40, 0, 1.0), _turn(0, 2, 60, 0, 1.0)]
    assert ideal_hit_rate(turns) == pytest.approx((16 + 32) / 120)


def _report(demote_gb_per_s: float, nvme_loaded: int) -> TieringReport:
    chat = ChatShape(1, 2, 16, 16, 4)
    base = ConfigResult("device", "device pool", None, None, 1.0,
                        [_turn(0, 0, 32, 0, 0.2), _turn(0, 1, 52, 0, 0.4)])
    dram = ConfigResult("dram", "+ DRAM", 8, None, 1.0, [_turn(0, 0, 32, 0, 0.2), _turn(0, 1, 52, 32, 0.1)],
                        {"dram": {"demote_gb_per_s": demote_gb_per_s, "promote_gb_per_s": 9.0}})
    nvme = ConfigResult("nvme", "+ DRAM + NVMe", 2, 8, 1.0, [_turn(0, 0, 32, 0, 0.2), _turn(0, 1, 52, 0, 0.4)],
                        {"dram": {}, "nvme": {"loaded_blocks": nvme_loaded, "bytes_read": 0, "read_busy_seconds": 0.0,
                                              "bytes_written": 10**9, "write_busy_seconds": 1.0, "direct_io": True}})
    refs = References(memcpy=10e9, disk=DiskRates(write=2e9, write_fsync=1e9, read_cold=1e9, read_warm=5e9,
                                                  write_direct=1.2e9, read_direct=0.9e9))
    return TieringReport(TieringSettings(chat, 4), 1000, refs, [base, dram, nvme])


def test_targets_report_misses_as_missed():
    targets = {t.name: t.met for t in _report(demote_gb_per_s=9.0, nvme_loaded=0).targets()}
    assert targets["+ DRAM raises the hit rate"] is True
    assert targets["+ DRAM + NVMe raises the hit rate"] is False
    assert targets["NVMe serves what the small DRAM tier lost"] is False
    assert targets["TTFT improves on a hit (+ DRAM)"] is True  # 0.4 s on a miss, 0.1 s on the hit
    assert targets["TTFT improves on a hit (+ DRAM + NVMe)"] is None  # it never hit: nothing to judge
    assert targets["DRAM demote >= 80% of memcpy"] is True  # 9 of 10 GB/s
    assert targets["NVMe write >= 80% of sequential O_DIRECT write"] is True  # 1 of 1.2 GB/s
    assert targets["NVMe read >= 80% of sequential O_DIRECT read"] is None  # read nothing
    slow = _report(demote_gb_per_s=7.0, nvme_loaded=3)
    assert {t.name: t.met for t in slow.targets()}["DRAM demote >= 80% of memcpy"] is False
    text = format_report(slow)
    assert "[MISSED] DRAM demote >= 80% of memcpy: 7.00 GB/s = 70% of memcpy (10.00 GB/s)" in text


def test_a_buffered_nvme_tier_is_judged_against_buffered_io():
    r = _report(demote_gb_per_s=9.0, nvme_loaded=0)
    r.configs[2].tiers["nvme"]["direct_io"] = False
    targets = {t.name: t.met for t in r.targets()}
    assert targets["NVMe write >= 80% of sequential buffered write"] is False  # 1 of 2 GB/s


# -- the --quick run on the real model ------------------------------------------------------------

@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_tiering_bench(settings_from_args(_parse("--quick")), tmp_path_factory.mktemp("nvme"))


@pytest.mark.slow
@needs_model
def test_quick_run_each_tier_adds_hits(report):
    device, dram, nvme = report.configs
    assert [c.name for c in report.configs] == ["device", "dram", "nvme"]
    assert nvme.hit_rate > dram.hit_rate > device.hit_rate
    # the NVMe tier holds the whole chat, so it serves every block an unbounded cache would
    assert nvme.hit_rate == pytest.approx(report.ideal_hit_rate)
    assert dram.tiers["dram"]["promoted_blocks"] > 0 and device.tiers is None


@pytest.mark.slow
@needs_model
def test_quick_run_loads_blocks_from_nvme(report):
    nvme = report.config("nvme").tiers["nvme"]
    assert nvme["loaded_blocks"] > 0 and nvme["bytes_read"] > 0 and nvme["writes"] > 0
    assert nvme["failed_loads"] == 0 and nvme["checksum_failures"] == 0


@pytest.mark.slow
@needs_model
def test_quick_run_moves_the_nvme_tiers_bytes_through_the_disk_in_lockstep(report):
    nvme = report.config("nvme")
    ref = nvme.chat_reference
    assert ref is not None and report.config("dram").chat_reference is None
    assert ref.write_bytes == nvme.tiers["nvme"]["bytes_written"] > 0
    assert ref.read_bytes == nvme.tiers["nvme"]["bytes_read"] > 0
    if nvme.tiers["nvme"]["direct_io"]:
        assert ref.write_seconds > 0 and ref.read_seconds > 0
        rows = {t.name for t in report.transfers()}
        assert {"NVMe write in the chat", "NVMe read in the chat"} <= rows


@pytest.mark.slow
@needs_model
def test_quick_run_probes_the_nvme_tier_alone_on_the_chat_layout(report):
    probe = report.tier_probe
    assert probe is not None and probe.num_blocks >= 2 and len(probe.rounds) == 3
    assert probe.slot_bytes >= report.block_bytes  # the chat's own block, plus its header
    assert all(r.write_new > 0 and r.write_reused > 0 and r.read > 0 for r in probe.rounds)
    assert report.to_json()["tier_probe"]["num_blocks"] == probe.num_blocks


@pytest.mark.slow
@needs_model
def test_quick_run_probes_the_dram_tier_alone_on_the_chat_layout(report):
    probe = report.dram_probe
    assert probe is not None and probe.block_bytes == report.block_bytes and len(probe.rounds) == 3
    assert probe.burst_blocks == 4  # --quick's memcpy reference is under 64 MB
    names = [t.name for t in report.transfers()]
    assert "DRAM demote alone, bursts of 4 blocks" in names and "DRAM promote alone, bursts of 4 blocks" in names
    assert report.to_json()["dram_probe"]["burst_blocks"] == 4


@pytest.mark.slow
@needs_model
def test_quick_run_greedy_outputs_do_not_depend_on_the_tiers(report):
    answers = [[t.output_token_ids for t in c.turns] for c in report.configs]
    assert answers[0] == answers[1] == answers[2] and report.outputs_identical
    assert all(len(a) == report.settings.chat.answer_len for a in answers[0])
    # the answers are fed back, so equal answers mean every config saw the same prompts
    assert len({c.num_prompt_tokens for c in report.configs}) == 1


@pytest.mark.slow
@needs_model
def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "tiering.json", tmp_path / "tiering.png"
    rc = main(["bench", "tiering", "--quick", "--conversations", "4", "--dram-blocks", "1", "--gpu-blocks", "6", "--memcpy-mb", "8", "--disk-probe-mb", "4",
               "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out), "--plot", str(png)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "targets:" in stdout
    data = json.loads(out.read_text())
    assert [c["name"] for c in data["configs"]] == ["device", "dram", "nvme"]
    nvme_stats = data["configs"][2]["tiers"]["nvme"]  # the loads' read run sizes and their rates, reported
    if nvme_stats["c_io"]:
        assert [r["slots"] for r in nvme_stats["read_run_rates"]] == [1, 5]  # 1 and 4 MB of 0.74 MB slots
        assert f"read runs (chosen from their own rates): {nvme_stats['read_run_slots']} slots now" in stdout
    assert len(data["configs"][0]["turns"]) == 4 * 2 and data["outputs_identical"] is True
    assert {t["name"] for t in data["transfers"]} >= {"DRAM demote", "NVMe read"}
    assert data["references_gb_per_s"]["memcpy"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no block left behind: the tier, reopened, finds nothing of its own layout and nothing foreign
    import torch

    from kvstrata.tiering.nvme import NvmeTier
    from kvstrata.worker.loader import load_config

    assert data["configs"][2]["tiers"]["nvme"]["writes"] > 0  # the tier did write there
    c = load_config("smollm2-135m")
    with NvmeTier(tmp_path / "nvme" / "kvstrata-bench-tiering", 1 << 30, (c.num_layers, 2, 16, c.num_kv_heads,
                                                                          c.head_dim), torch.float32,
                  layout_tag=f"{c.model_id}/torch.float32/bs16") as reopened:
        assert len(reopened) == 0 and reopened.stats()["foreign_files"] == 0


@pytest.mark.slow
@needs_model
def test_admission_study_runs_each_mode_on_the_same_chat(tmp_path, capsys):
    out = tmp_path / "admission.json"
    rc = main(["bench", "tiering", "--quick", "--admission-study", "--conversations", "4",
               "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out)])
    assert rc == 0
    assert "admission study" in capsys.readouterr().out
    data = json.loads(out.read_text())
    modes = {m["mode"]: m for m in data["modes"]}
    assert set(modes) == {"all", "reuse"} and data["outputs_identical"] is True
    assert modes["all"]["admission_rejects"] == 0 and modes["all"]["nvme_blocks_written"] > 0
    # the one-shot prompts overflow the half-chat disk; under reuse they are kept off it
    assert modes["reuse"]["admission_rejects"] > 0
    assert modes["reuse"]["nvme_blocks_written"] < modes["all"]["nvme_blocks_written"]
    assert data["nvme_blocks"] == data["chat_blocks"] // 2


def test_admission_study_has_no_plot(capsys):
    assert main(["bench", "tiering", "--quick", "--admission-study", "--plot", "x.png"]) == 2
    assert "--plot" in capsys.readouterr().err


# -- bad flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["--gpu-blocks", "0"], "--gpu-blocks"),
    (["--turns", "-2"], "--turns"),
    (["--kv-ratio", "0"], "--kv-ratio"),
    (["--kv-ratio", "nan"], "--kv-ratio"),
    (["--answer-len", "many"], "--answer-len"),
    (["--system-len", "-1"], "--system-len"),
    (["--dram-blocks", "0"], "--dram-blocks"),
    (["--one-shot-len", "0"], "--one-shot-len"),
    (["--dtype", "fp8"], "--dtype"),
])
def test_cli_rejects_bad_flag_values_with_status_2(args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "tiering", *args])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("args, flag", [
    (["--gpu-blocks", "8"], "--gpu-blocks"),  # the default chat's last turn needs 38 blocks
    (["--quick", "--json", "/no/such/dir/report.json"], "--json"),
])
def test_cli_rejects_bad_combinations_before_loading_the_model(args, flag, capsys):
    assert main(["bench", "tiering", *args]) == 2
    assert flag in capsys.readouterr().err
