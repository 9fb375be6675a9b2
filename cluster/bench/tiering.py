"""`kvstrata bench tiering`: what the DRAM and NVMe tiers buy on a chat whose KV outgrows the device pool.

Conversations take turns round-robin, turn by turn, so by the time one comes back its history has
left the device pool. Each turn resends the whole history, the engine's own answers included, plus a
new user message, and is submitted alone once the previous turn has finished:

    turn t of conversation c:  [ system | user 0 | answer 0 | ... | user t-1 | answer t-1 | user t ]
                                 ^ cacheable: full blocks of turn t-1's prompt + answer (minus the last token)

The same chat runs on three fresh engines with the same device pool: the pool alone; + a small DRAM
tier; + the same DRAM over an NVMe tier that holds everything, so that each run adds one tier. Greedy
answers of fixed length make the three runs the same workload. TTFT is the time from `add_request` to
the end of the step that samples the first token. Transfer rates come from the tiers' own counters and
are compared with a memcpy and with sequential file writes and reads on the NVMe tier's disk, in the
tier's own IO mode (O_DIRECT where the filesystem has it), measured first. Then the NVMe tier runs
alone on the chat's block layout, round by round beside the disk (tier_probe.py).

The admission study (`kvstrata.cluster.bench.admission`) runs the NVMe config once per NVMe
admission mode, with one-shot prompts mixed into the chat and a disk that holds only part of it.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.cluster.bench.bandwidth import MB, References, measure_references
from kvstrata.cluster.bench.chat_lockstep import ChatLockstep, ChatReference
from kvstrata.cluster.bench.dram_probe import DramProbe, probe_dram_tier
from kvstrata.cluster.bench.throughput import Progress, percentile
from kvstrata.cluster.bench.tier_probe import TierProbe, probe_nvme_tier
from kvstrata.cluster.bench.transfers import (Transfer, chat_lockstep_transfers, dram_probe_transfers, nvme_transfers,
                                              probe_transfers)
from kvstrata.cluster.bench.workloads import multi_turn
from kvstrata.worker.model_source import DEFAULT_MODEL

BLOCK_SIZE = 16  # the engine's default
TARGET_BANDWIDTH_RATIO = 0.8
NVME_FILE_OVERHEAD = 4096  # a block file's header, with room to spare, for sizing the NVMe tier
CONFIGS = ("device", "dram", "nvme")  # run in this order; "device" is the baseline of the others


# -- the chat -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChatShape:
    num_conversations: int
    num_turns: int
    system_len: int
    user_len: int
    answer_len: int  # every answer's exact length (greedy, EOS ignored)
    seed: int = 0

    @property
    def history_len(self) -> int:
        """Tokens of one conversation at the end: its last prompt plus its last answer."""
        return self.system_len + self.num_turns * (self.user_len + self.answer_len)

    def user_messages(self) -> list[list[list[int]]]:
        """[conversation][turn]: the tokens each turn adds before the answer (turn 0 has the system
        prompt). They are the `multi_turn` workload's prompts with its synthetic assistant turns cut
        out; here the engine's own answers take their place."""
        c, a = self.num_conversations, self.answer_len
        w = multi_turn(c, self.num_turns, self.user_len, a, self.system_len, self.seed)
        messages: list[list[list[int]]] = [[] for _ in range(c)]
        for i, req in enumerate(w.requests):  # turn by turn: request i is turn i // c of conversation i % c
            turn, conv = divmod(i, c)
            start = len(w.requests[i - c].prompt_token_ids) + a if turn else 0
            messages[conv].append(req.prompt_token_ids[start:])
        return messages


def conversations_for(kv_ratio: float, gpu_blocks: int, num_turns: int, system_len: int, user_len: int,
                      answer_len: int) -> int:
    """Enough conversations that their KV is about kv_ratio times the device pool."""
    per_conversation = -(-(system_len + num_turns * (user_len + answer_len)) // BLOCK_SIZE)
    return max(2, math.ceil(kv_ratio * gpu_blocks / per_conversation))


@dataclass(frozen=True)
class TieringSettings:
    chat: ChatShape
    gpu_blocks: int
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    dram_blocks: int | None = None  # the DRAM tier of both tiered configs; None: half the chat
    nvme_blocks: int | None = None  # None: room for every block of the chat
    memcpy_bytes: int = 512 * MB
    disk_probe_bytes: int = 256 * MB

    def check(self) -> None:
        """ValueError naming the flag, for combinations argparse cannot see."""
        need = -(-self.chat.history_len // BLOCK_SIZE)
        if need > self.gpu_blocks:
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold a conversation's last turn "
                             f"({self.chat.history_len} tokens = {need} blocks); raise --gpu-blocks or lower "
                             f"--turns, --system-len, --user-len or --answer-len")

    @property
    def dram_probe(self) -> dict[str, int]:
        """The DRAM probe's sizes (dram_probe.py), scaled with the memcpy reference: a full run's
        bursts of 16 blocks beside a 64 MB memcpy, --quick's of 4 beside a smaller one."""
        ref = min(self.memcpy_bytes, 64 * MB)
        return {"burst_blocks": 16 if ref >= 64 * MB else 4, "memcpy_bytes": ref, "flush_bytes": 2 * ref}

    @property
    def num_chat_blocks(self) -> int:
        """Full blocks the whole chat caches, at most: what a tier must hold to keep everything."""
        return self.chat.num_conversations * (self.chat.history_len // BLOCK_SIZE)

    def tier_blocks(self, config: str) -> tuple[int | None, int | None]:
        """(DRAM blocks, NVMe blocks) of one of CONFIGS."""
        dram = self.dram_blocks or max(1, self.num_chat_blocks // 2)
        if config == "dram":
            return dram, None
        if config == "nvme":
            return dram, self.nvme_blocks or self.num_chat_blocks
        return None, None


# -- one run --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: int
    turn: int
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    latency_s: float
    output_token_ids: tuple[int, ...]


@dataclass
class ConfigResult:
    name: str  # one of CONFIGS
    label: str
    dram_blocks: int | None
    nvme_blocks: int | None
    wall_s: float
    turns: list[TurnResult] = field(repr=False)
    tiers: dict | None = None  # cache_stats()["tiers"] after the run
    chat_reference: ChatReference | None = None  # the disk beside the NVMe tier, turn by turn (chat_lockstep.py)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(t.num_prompt_tokens for t in self.turns)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.output_token_ids) for t in self.turns)

    @property
    def hit_rate(self) -> float:
        return sum(t.num_cached_tokens for t in self.turns) / self.num_prompt_tokens

    def ttft_ms(self, q: float, kind: str = "all") -> float | None:
        """TTFT percentile over all turns, or over follow-up turns that hit ("hit") or missed ("miss")
        entirely; first turns can hit nothing, so they are in neither."""
        if kind == "all":
            xs = [t.ttft_s for t in self.turns]
        else:
            xs = [t.ttft_s for t in self.turns if t.turn and (t.num_cached_tokens > 0) == (kind == "hit")]
        return percentile(xs, q) * 1e3 if xs else None

    def summary(self) -> dict[str, Any]:
        follow = [t for t in self.turns if t.turn]
        return {
            "name": self.name, "label": self.label, "dram_blocks": self.dram_blocks,
            "nvme_blocks": self.nvme_blocks, "wall_s": round(self.wall_s, 3), "num_turns": len(self.turns),
            "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "output_tokens_per_s": round(self.num_output_tokens / self.wall_s, 2),
            "total_tokens_per_s": round((self.num_prompt_tokens + self.num_output_tokens) / self.wall_s, 2),
            **{f"ttft_{k}_p{q}_ms": _round(self.ttft_ms(q, k)) for k in ("all", "hit", "miss") for q in (50, 90)},
            "num_follow_up_hits": sum(1 for t in follow if t.num_cached_tokens),
            "num_follow_up_misses": sum(1 for t in follow if not t.num_cached_tokens),
            "tiers": self.tiers,
        }


def run_chat(llm: Any, messages: list[list[list[int]]], answer_len: int,
             clock: Callable[[], float] = time.perf_counter, label: str = "chat",
             one_shots: list[list[int]] | None = None,
             after_turn: Callable[[], float] | None = None) -> tuple[float, list[TurnResult]]:
    """Every turn of every conversation, round-robin, one request at a time; (wall seconds, turns).
    `one_shots[i]`, if given, runs after the i-th turn and is not among the turns returned.
    `after_turn`, if given, runs after every turn and returns seconds to leave out of the wall time."""
    from kvstrata.worker.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    num_turns = len(messages[0])
    histories: list[list[int]] = [[] for _ in messages]
    results: list[TurnResult] = []
    progress = Progress(label, num_turns * len(messages))
    left_out = 0.0
    start = clock()
    for turn in range(num_turns):
        for conv, turns in enumerate(messages):
            result = _run_turn(engine, conv, turn, histories[conv] + turns[turn], params, clock)
            if one_shots is not None:
                _run_turn(engine, -1, len(results), one_shots[len(results)], params, clock)
            results.append(result)
            histories[conv] += turns[turn] + list(result.output_token_ids)
            if after_turn is not None:
                left_out += after_turn()
            progress.advance()
    return clock() - start - left_out, results


def _run_turn(engine: Any, conv: int, turn: int, prompt: list[int], params: Any,
              clock: Callable[[], float]) -> TurnResult:
    """Submit one turn and step the engine until it finishes (nothing else is in flight)."""
    rid = f"c{conv}t{turn}"
    t0 = clock()
    engine.add_request(rid, prompt, params)
    sample = engine.groups[rid].samples[0]
    ttft = None
    finished = []
    while not finished:
        finished = engine.step()
        if ttft is None and sample.num_output_tokens:  # this step sampled the first token
            ttft = clock() - t0
    out = finished[0]
    return TurnResult(conv, turn, len(prompt), out.num_cached_tokens, ttft, clock() - t0,
                      tuple(out.outputs[0].token_ids))


def ideal_hit_rate(turns: list[TurnResult]) -> float:
    """What an unbounded prefix cache serves: each follow-up turn hits every full block of the
    previous turn's prompt and answer (its last token never computed), at most (n - 1) // B blocks."""
    prev: dict[int, int] = {}
    hit = 0
    for t in turns:
        if t.conversation in prev:
            hit += min((prev[t.conversation] - 1) // BLOCK_SIZE, (t.num_prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
        prev[t.conversation] = t.num_prompt_tokens + len(t.output_token_ids)
    return hit / sum(t.num_prompt_tokens for t in turns)


_WARMUP_LEN = 160  # a prefill of typical size and a few decode steps, so kernel setup is not timed


def warm_up(llm: Any) -> None:
    from kvstrata.worker.sampling_params import SamplingParams

    n = min(_WARMUP_LEN, (llm.engine.kv.pool.num_blocks - 1) * BLOCK_SIZE)
    llm.generate([[17 + i for i in range(n)]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.reset_prefix_cache()  # the chat starts cold in every tier


# -- the comparison -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PairedTTFT:
    """Follow-up turns that hit in a tiered config but missed on the device pool alone."""

    num_pairs: int
    median_speedup: float | None  # median over pairs of device TTFT / tiered TTFT


def paired_ttft(base: ConfigResult, tiered: ConfigResult) -> PairedTTFT:
    ratios = [b.ttft_s / t.ttft_s for b, t in zip(base.turns, tiered.turns)
              if t.turn and t.num_cached_tokens > 0 and b.num_cached_tokens == 0]
    return PairedTTFT(len(ratios), statistics.median(ratios) if ratios else None)


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    met: bool | None  # None: nothing to judge
    detail: str


@dataclass
class TieringReport:
    settings: TieringSettings
    block_bytes: int
    references: References
    configs: list[ConfigResult]
    tier_probe: TierProbe | None = None  # the NVMe tier alone, beside the disk
    dram_probe: DramProbe | None = None  # the DRAM tier's copies alone, beside a memcpy (CPU pools only)

    def config(self, name: str) -> ConfigResult:
        return next(c for c in self.configs if c.name == name)

    @property
    def outputs_identical(self) -> bool:
        answers = [[t.output_token_ids for t in c.turns] for c in self.configs]
        return all(a == answers[0] for a in answers[1:])

    @property
    def ideal_hit_rate(self) -> float:
        return ideal_hit_rate(self.configs[0].turns)

    def transfers(self) -> list[Transfer]:
        ref = self.references
        dram = (self.config("dram").tiers or {}).get("dram", {})
        nvme = (self.config("nvme").tiers or {}).get("nvme", {})
        return [
            Transfer("DRAM demote", dram.get("demote_gb_per_s") or None, "memcpy", ref.memcpy / 1e9),
            Transfer("DRAM promote", dram.get("promote_gb_per_s") or None, "memcpy", ref.memcpy / 1e9),
            *nvme_transfers(nvme, ref.disk),
            *chat_lockstep_transfers(nvme, self.config("nvme").chat_reference),
            *probe_transfers(self.tier_probe),
            *dram_probe_transfers(self.dram_probe),
        ]

    def targets(self) -> list[Target]:
        base, dram, nvme = (self.config(n) for n in CONFIGS)
        out = []
        for tiered, below, what in ((dram, base, "the device pool alone"), (nvme, dram, "DRAM alone")):
            out.append(Target(f"{tiered.label} raises the hit rate", tiered.hit_rate > below.hit_rate,
                              f"{tiered.hit_rate:.1%} vs {below.hit_rate:.1%} on {what}"))
        loaded = (nvme.tiers or {}).get("nvme", {}).get("loaded_blocks", 0)
        out.append(Target("NVMe serves what the small DRAM tier lost", loaded > 0,
                          f"{loaded} blocks loaded from NVMe = {loaded * BLOCK_SIZE / nvme.num_prompt_tokens:.1%} "
                          f"of prompt tokens"))
        for tiered in (dram, nvme):
            p = paired_ttft(base, tiered)
            met = None if p.median_speedup is None else p.median_speedup > 1
            detail = ("no follow-up turn hit here and missed on the device pool" if p.median_speedup is None else
                      f"median {p.median_speedup:.2f}x faster over {p.num_pairs} turns that missed on the device pool")
            out.append(Target(f"TTFT improves on a hit ({tiered.label})", met, detail))
        return out + self.transfer_targets()

    def transfer_targets(self) -> list[Target]:
        out = []
        for tr in self.transfers():
            if not tr.target:
                continue
            met = None if tr.ratio is None else tr.ratio >= TARGET_BANDWIDTH_RATIO
            detail = ("nothing moved" if tr.ratio is None else
                      f"{tr.gb_per_s:.2f} GB/s = {tr.ratio:.0%} of {tr.reference} ({tr.reference_gb_per_s:.2f} GB/s)")
            out.append(Target(f"{tr.name} >= {TARGET_BANDWIDTH_RATIO:.0%} of {tr.reference}", met, detail))
        return out

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "settings": {**{k: v for k, v in asdict(s).items() if k != "chat"}, "chat": asdict(s.chat),
                         "block_size": BLOCK_SIZE},
            "block_bytes": self.block_bytes,
            "chat_blocks": s.num_chat_blocks,
            "chat_blocks_over_pool": round(s.num_chat_blocks / s.gpu_blocks, 2),
            "references_gb_per_s": self.references.to_json(),
            "ideal_hit_rate": round(self.ideal_hit_rate, 4),
            "outputs_identical": self.outputs_identical,
            "configs": [{**c.summary(), "turns": [_turn_json(t) for t in c.turns]} for c in self.configs],
            "ttft_on_hit": {c.name: asdict(paired_ttft(self.configs[0], c)) for c in self.configs[1:]},
            "chat_reference": None if (c := self.config("nvme").chat_reference) is None else c.to_json(),
            "tier_probe": None if self.tier_probe is None else self.tier_probe.to_json(),
            "dram_probe": None if self.dram_probe is None else self.dram_probe.to_json(),
            "transfers": [{**asdict(t), "ratio": _round(t.ratio, 3)} for t in self.transfers()],
            "targets": [asdict(t) for t in self.targets()],
        }


def _turn_json(t: TurnResult) -> dict[str, Any]:
    return {"conversation": t.conversation, "turn": t.turn, "prompt_tokens": t.num_prompt_tokens,
            "cached_tokens": t.num_cached_tokens, "ttft_ms": round(t.ttft_s * 1e3, 2),
            "latency_ms": round(t.latency_s * 1e3, 2), "output_tokens": len(t.output_token_ids)}


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def run_tiering_bench(settings: TieringSettings, nvme_dir: Path,
                      clock: Callable[[], float] = time.perf_counter) -> TieringReport:
    """Measure the reference bandwidths in nvme_dir, then run the chat on the three configs.

    The NVMe tier lives in nvme_dir; whatever blocks of this model's layout are there are dropped
    before the run (every config starts cold) and after it."""
    from kvstrata.worker.llm import LLM
    from kvstrata.worker.model_runner import ModelRunner

    settings.check()
    nvme_dir.mkdir(parents=True, exist_ok=True)
    references = measure_references(nvme_dir, settings.memcpy_bytes, settings.disk_probe_bytes)
    messages = settings.chat.user_messages()
    results: list[ConfigResult] = []
    block_bytes = None
    layout = dram_layout = None  # the NVMe and DRAM tiers' block shape and dtype, for the probes
    for name in CONFIGS:
        dram_blocks, nvme_blocks = settings.tier_blocks(name)
        llm = LLM(settings.model, num_gpu_blocks=settings.gpu_blocks, block_size=BLOCK_SIZE, dtype=settings.dtype,
                  **_tier_kwargs(dram_blocks, nvme_blocks, nvme_dir, block_bytes))
        try:
            block_bytes = ModelRunner.kv_bytes_per_block(llm.engine.runner.model, BLOCK_SIZE)
            warm_up(llm)
            tiers = llm.engine.kv.tiers
            lockstep = None if tiers is None or tiers.nvme is None else ChatLockstep(tiers.nvme, nvme_dir, clock)
            try:
                wall, turns = run_chat(llm, messages, settings.chat.answer_len, clock, label=name,
                                       after_turn=None if lockstep is None else lockstep.after_turn)
            finally:
                if lockstep is not None:
                    lockstep.close()
            results.append(ConfigResult(name, _label(settings.gpu_blocks, dram_blocks, nvme_blocks), dram_blocks,
                                        nvme_blocks, wall, turns, llm.cache_stats().get("tiers"),
                                        None if lockstep is None else lockstep.reference()))
            if tiers is not None and tiers.nvme is not None:
                layout = (tiers.nvme.block_shape, tiers.nvme.dtype)
            if tiers is not None and tiers.kv_cache.device.type == "cpu":  # the probe takes the CPU copy path
                dram_layout = (tiers.host.block_shape, tiers.host.dtype)
            llm.reset_prefix_cache()  # every block gone from the tier (its slab files stay, headers zeroed)
        finally:
            llm.close()
        del llm
        gc.collect()
    probe = None if layout is None else probe_nvme_tier(nvme_dir, *layout, settings.disk_probe_bytes)
    dram = None if dram_layout is None else probe_dram_tier(*dram_layout, **settings.dram_probe)
    return TieringReport(settings, block_bytes, references, results, probe, dram)


def _tier_kwargs(dram_blocks: int | None, nvme_blocks: int | None, nvme_dir: Path,
                 block_bytes: int | None) -> dict[str, Any]:
    if dram_blocks is None:
        return {}
    assert block_bytes is not None, "the device-only config runs first and gives the block size in bytes"
    kwargs: dict[str, Any] = {"cpu_kv_bytes": dram_blocks * block_bytes}
    if nvme_blocks is not None:
        kwargs.update(nvme_kv_dir=str(nvme_dir), nvme_kv_bytes=nvme_blocks * (block_bytes + NVME_FILE_OVERHEAD))
    return kwargs


def _label(gpu_blocks: int, dram_blocks: int | None, nvme_blocks: int | None) -> str:
    if dram_blocks is None:
        return f"device pool ({gpu_blocks} blocks)"
    if nvme_blocks is None:
        return f"+ DRAM ({dram_blocks} blocks)"
    return f"+ DRAM ({dram_blocks}) + NVMe ({nvme_blocks} blocks)"
