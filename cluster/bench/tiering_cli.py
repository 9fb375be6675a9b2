"""`kvstrata bench tiering`: the command and its output (the text report and the plot); the
measurement itself is in `kvstrata.cluster.bench.tiering`."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvstrata.cluster.argtypes import integer, non_negative_int, positive_int, positive_number
from kvstrata.cluster.bench.admission import AdmissionReport, run_admission_study
from kvstrata.cluster.bench.bandwidth import MB
from kvstrata.cluster.bench.tiering import (
    BLOCK_SIZE,
    TARGET_BANDWIDTH_RATIO,
    ChatShape,
    TieringReport,
    TieringSettings,
    conversations_for,
    run_tiering_bench,
)
from kvstrata.worker.model_source import DEFAULT_MODEL


# -- output ---------------------------------------------------------------------------------------

def format_report(r: TieringReport) -> str:
    s, c = r.settings, r.settings.chat
    kv_mb = s.num_chat_blocks * r.block_bytes / 1e6
    lines = [
        (f"chat: {c.num_conversations} conversations x {c.num_turns} turns (system {c.system_len}, user "
         f"{c.user_len}, answer {c.answer_len} tokens), round-robin, one turn at a time; {s.model} {s.dtype}"),
        (f"KV of the chat: {s.num_chat_blocks} blocks of {BLOCK_SIZE} tokens ({kv_mb:.0f} MB), "
         f"{s.num_chat_blocks / s.gpu_blocks:.1f}x the device pool of {s.gpu_blocks} blocks"),
        (f"{'config':<36}{'hit rate':>9}{'TTFT p50':>10}{'p90':>8}{'hit p50':>9}{'miss p50':>10}"
         f"{'out tok/s':>11}{'total tok/s':>13}{'wall s':>8}"),
    ]
    for cr in r.configs:
        ms = [cr.ttft_ms(50), cr.ttft_ms(90), cr.ttft_ms(50, "hit"), cr.ttft_ms(50, "miss")]
        cells = ["-" if m is None else f"{m:.0f}" for m in ms]
        lines.append(f"{cr.label:<36}{cr.hit_rate:>9.1%}{cells[0]:>10}{cells[1]:>8}{cells[2]:>9}{cells[3]:>10}"
                     f"{cr.num_output_tokens / cr.wall_s:>11.1f}"
                     f"{(cr.num_prompt_tokens + cr.num_output_tokens) / cr.wall_s:>13.1f}{cr.wall_s:>8.1f}")
    lines.append("TTFT in ms; hit / miss: follow-up turns with some / no cached prompt tokens")
    lines.append(f"ideal hit rate (an unbounded cache): {r.ideal_hit_rate:.1%}; greedy outputs identical across "
                 f"configs: {'yes' if r.outputs_identical else 'NO'}")
    ref, disk = r.references, r.references.disk
    direct = ("O_DIRECT unsupported" if disk.write_direct is None else
              f"O_DIRECT write {disk.write_direct / 1e9:.2f}, read {disk.read_direct / 1e9:.2f}")
    lines.append(f"references: memcpy {ref.memcpy / 1e9:.2f} GB/s; file in the NVMe directory (best of 3): write "
                 f"{disk.write / 1e9:.2f} GB/s buffered, {disk.write_fsync / 1e9:.2f} with fsync; read "
                 f"{disk.read_cold / 1e9:.2f} from disk, {disk.read_warm / 1e9:.2f} from the page cache; {direct}")
    lines.append("NVMe rates are bytes over the wall time with IO of that kind in flight, across the IO threads")
    if (cref := r.config("nvme").chat_reference) is not None:
        lines.append(f"NVMe in the chat, lockstep: after each turn (the tier flushed), one thread's 8 MB O_DIRECT "
                     f"IO of the bytes the tier moved in that turn ({cref.write_bytes / 1e6:.0f} MB written, "
                     f"{cref.read_bytes / 1e6:.0f} MB read in all; the flush waited after {cref.turns_waited} turns); "
                     f"its time is left out of the wall")
    if r.tier_probe is not None:
        tp = r.tier_probe
        lines.append(f"NVMe tier alone: {tp.num_blocks} blocks ({tp.num_blocks * tp.slot_bytes / 1e6:.0f} MB) each way, "
                     f"{len(tp.rounds)} rounds in lockstep with one thread's 8 MB O_DIRECT IO of the same bytes; "
                     f"each row from the round with the median ratio")
    if r.dram_probe is not None:
        dp = r.dram_probe
        lines.append(f"DRAM tier alone: {len(dp.rounds)} rounds of {dp.segments} bursts of {dp.burst_blocks} random "
                     f"blocks each way, in lockstep with a {r.settings.dram_probe['memcpy_bytes'] // MB} MB memcpy, "
                     f"caches flushed before each copy; each row from the round with the median ratio")
    lines.append("targets:")
    for t in r.targets():
        mark = {True: "met", False: "MISSED", None: "n/a"}[t.met]
        lines.append(f"  [{mark:>6}] {t.name}: {t.detail}")
    if where := [t for t in r.transfers() if not t.target and t.ratio is not None]:
        lines.append("where the NVMe time goes (not targets):")
        lines += [f"  {t.name}: {t.gb_per_s:.2f} GB/s = {t.ratio:.0%} of {t.reference} "
                  f"({t.reference_gb_per_s:.2f} GB/s)" for t in where]
    if line := _read_runs_line(r):
        lines.append(line)
    return "\n".join(lines)


def _read_runs_line(r: TieringReport) -> str | None:
    """The chat's loads: the run size they took by the end, and each size's rate (tiering/run_sizes.py)."""
    nvme = (r.config("nvme").tiers or {}).get("nvme", {})
    rates = nvme.get("read_run_rates")
    if not rates:
        return None
    slot_mb = nvme["slot_bytes"] / 1e6
    sizes = "; ".join(f"{x['slots']} slots ({x['slots'] * slot_mb:.1f} MB): {x['gb_per_s']:.2f} GB/s over "
                      f"{x['bursts']} bursts" for x in rates)
    how = "chosen from their own rates" if len(rates) > 1 else "one size, KVSTRATA_NVME_READ_RUN_KB"
    return f"NVMe loads in the chat, read runs ({how}): {nvme['read_run_slots']} slots now; {sizes}"


def format_admission(r: AdmissionReport) -> str:
    s, c = r.settings, r.settings.chat
    lines = [
        (f"admission study: {c.num_conversations} conversations x {c.num_turns} turns, a one-shot prompt of "
         f"{r.one_shot_len} random tokens after every turn; device pool {s.gpu_blocks}, DRAM {r.dram_blocks}, "
         f"NVMe {r.nvme_blocks} blocks ({r.nvme_blocks / s.num_chat_blocks:.0%} of the chat's {s.num_chat_blocks})"),
        (f"{'mode':<8}{'chat hit rate':>14}{'follow-up TTFT p50':>20}{'blocks written':>16}{'rejected':>10}"
         f"{'loaded':>8}{'evicted':>9}{'wall s':>8}"),
    ]
    for m in r.results:
        x = m.summary()
        lines.append(f"{m.mode:<8}{m.hit_rate:>14.1%}{x['follow_up_ttft_p50_ms']:>17.0f} ms"
                     f"{x['nvme_blocks_written']:>16}{x['admission_rejects']:>10}{x['nvme_blocks_loaded']:>8}"
                     f"{x['nvme_evictions']:>9}{m.wall_s:>8.1f}")
    lines.append(f"greedy chat answers identical across modes: {'yes' if r.outputs_identical else 'NO'}")
    return "\n".join(lines)


def plot_report(r: TieringReport, path: Path) -> None:
    """Hit rate and TTFT per config, and each transfer's rate as a fraction of its reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.name for c in r.configs]
    fig, (ax_hit, ax_ttft, ax_bw) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_hit.bar(names, [100 * c.hit_rate for c in r.configs], color="#2a7")
    ax_hit.axhline(100 * r.ideal_hit_rate, color="k", ls="--", lw=1, label="ideal")
    ax_hit.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax_hit.legend()
    width = 0.38
    xs = range(len(names))
    ax_ttft.bar([x - width / 2 for x in xs], [c.ttft_ms(50) for c in r.configs], width, label="p50")
    ax_ttft.bar([x + width / 2 for x in xs], [c.ttft_ms(90) for c in r.configs], width, label="p90")
    ax_ttft.set_xticks(list(xs), names)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.legend()
    transfers = [t for t in r.transfers() if t.target]
    ax_bw.bar([t.name.replace(", ", "\n") for t in transfers], [100 * (t.ratio or 0) for t in transfers], color="#58a")
    ax_bw.axhline(100 * TARGET_BANDWIDTH_RATIO, color="k", ls="--", lw=1, label="target")
    ax_bw.set_ylabel("% of reference bandwidth")
    ax_bw.tick_params(axis="x", labelsize=8)
    ax_bw.legend()
    c = r.settings.chat
    fig.suptitle(f"tiering: {c.num_conversations} conversations x {c.num_turns} turns, KV "
                 f"{r.settings.num_chat_blocks / r.settings.gpu_blocks:.1f}x the device pool")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------------

# (full run, --quick): every size flag's default
DEFAULTS = {
    "gpu_blocks": (48, 12), "turns": (6, 2), "system_len": (128, 32), "user_len": (64, 16), "answer_len": (16, 2),
    "kv_ratio": (10.0, 2.5), "memcpy_mb": (512, 32), "disk_probe_mb": (256, 16),
    "one_shot_len": (256, 96),
}


def add_bench_tiering_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "tiering", help="hit rate, TTFT and transfer bandwidth with DRAM and NVMe KV tiers",
        description="Run one multi-turn chat whose KV is about --kv-ratio times the device pool on the pool "
                    "alone, + a DRAM tier, and + the same DRAM tier over an NVMe tier; report hit rate, TTFT, "
                    "throughput and the tiers' transfer rates against memcpy and the disk. With --admission-study, "
                    "compare the NVMe admission modes instead. See docs/benchmarks.md.")
    full = {k: v[0] for k, v in DEFAULTS.items()}
    p.add_argument("--gpu-blocks", type=positive_int, default=None,
                   help=f"device pool blocks (default {full['gpu_blocks']})")
    p.add_argument("--conversations", type=positive_int, default=None,
                   help="default: enough that the chat's KV is --kv-ratio times the device pool")
    p.add_argument("--kv-ratio", type=positive_number, default=None, help=f"default {full['kv_ratio']:g}")
    p.add_argument("--turns", type=positive_int, default=None, help=f"turns per conversation (default {full['turns']})")
    p.add_argument("--system-len", type=non_negative_int, default=None,
                   help=f"system prompt tokens (default {full['system_len']})")
    p.add_argument("--user-len", type=positive_int, default=None,
                   help=f"tokens per user message (default {full['user_len']})")
    p.add_argument("--answer-len", type=positive_int, default=None,
                   help=f"tokens per answer (default {full['answer_len']})")
    p.add_argument("--dram-blocks", type=positive_int, default=None,
                   help="DRAM tier of the tiered configs, in blocks (default: half the chat's blocks)")
    p.add_argument("--nvme-dir", type=Path, default=None,
                   help="directory for the NVMe tier and the disk probe (default: a temporary directory); "
                        "the tier uses its subfolder kvstrata-bench-tiering")
    p.add_argument("--nvme-blocks", type=positive_int, default=None,
                   help="NVMe tier capacity, in blocks (default: room for the whole chat; half of it in the "
                        "admission study)")
    p.add_argument("--admission-study", action="store_true",
                   help="instead of the three configs: the NVMe config under each admission mode, on the chat "
                        "with a one-shot prompt after every turn")
    p.add_argument("--one-shot-len", type=positive_int, default=None,
                   help=f"tokens of each one-shot prompt in the admission study (default {full['one_shot_len']})")
    p.add_argument("--memcpy-mb", type=positive_int, default=None,
                   help=f"memcpy probe buffer (default {full['memcpy_mb']})")
    p.add_argument("--disk-probe-mb", type=positive_int, default=None,
                   help=f"sequential file probe size (default {full['disk_probe_mb']})")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=integer, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (smaller defaults), not a figure")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE", help="write a PNG (needs matplotlib)")
    p.set_defaults(func=run_bench_tiering)
    return p


def settings_from_args(args: argparse.Namespace) -> TieringSettings:
    """Flags over the (full or --quick) defaults; ValueError naming the flag for a bad combination."""
    pick = {k: (getattr(args, k) if getattr(args, k) is not None else v[1 if args.quick else 0])
            for k, v in DEFAULTS.items()}
    conversations = args.conversations or conversations_for(
        pick["kv_ratio"], pick["gpu_blocks"], pick["turns"], pick["system_len"], pick["user_len"], pick["answer_len"])
    chat = ChatShape(conversations, pick["turns"], pick["system_len"], pick["user_len"], pick["answer_len"], args.seed)
    settings = TieringSettings(chat, pick["gpu_blocks"], args.model, args.dtype, args.dram_blocks,
                               args.nvme_blocks, pick["memcpy_mb"] * MB, pick["disk_probe_mb"] * MB)
    settings.check()
    return settings


def run_bench_tiering(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():  # fail now, not after minutes of measuring
            raise ValueError(f"{flag}: directory {path.parent} does not exist")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    if args.admission_study:
        if args.plot is not None:
            raise ValueError("--plot: the admission study has no plot; use --json")
        one_shot_len = args.one_shot_len or DEFAULTS["one_shot_len"][1 if args.quick else 0]

        def run(tier_dir: Path) -> AdmissionReport:
            return run_admission_study(settings, tier_dir, one_shot_len)

        fmt = format_admission
    else:
        run, fmt = (lambda tier_dir: run_tiering_bench(settings, tier_dir)), format_report
    if args.nvme_dir is None:
        root = Path(tempfile.mkdtemp(prefix="kvstrata-tiering-"))
        try:
            report = run(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        tier_dir = args.nvme_dir / "kvstrata-bench-tiering"
        try:
            tier_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--nvme-dir: cannot create {tier_dir}: {e.strerror}") from None
        report = run(tier_dir)
    print(fmt(report), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if args.plot is not None:
        plot_report(report, args.plot)
    return 0
