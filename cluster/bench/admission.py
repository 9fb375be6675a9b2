"""The admission study of `kvstrata bench tiering --admission-study`: the NVMe config once per
admission mode, on the chat with a one-shot prompt after every turn and a disk that holds only part
of it: what each mode keeps on a full disk, and what that is worth in hits."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.cluster.bench.tiering import (
    BLOCK_SIZE,
    TieringSettings,
    TurnResult,
    _tier_kwargs,
    run_chat,
    warm_up,
)
from kvstrata.cluster.bench.throughput import percentile


@dataclass
class AdmissionResult:
    mode: str  # an NVMe admission mode
    wall_s: float
    turns: list[TurnResult] = field(repr=False)  # the chat's turns; the one-shot prompts are not here
    tiers: dict

    @property
    def hit_rate(self) -> float:
        return sum(t.num_cached_tokens for t in self.turns) / sum(t.num_prompt_tokens for t in self.turns)

    @property
    def follow_up_ttft_p50_ms(self) -> float:
        return percentile([t.ttft_s for t in self.turns if t.turn], 50) * 1e3

    def summary(self) -> dict[str, Any]:
        nvme = self.tiers["nvme"]
        return {"mode": self.mode, "hit_rate": round(self.hit_rate, 4), "wall_s": round(self.wall_s, 3),
                "follow_up_ttft_p50_ms": round(self.follow_up_ttft_p50_ms, 2),
                "nvme_blocks_written": nvme["writes"], "nvme_bytes_written": nvme["bytes_written"],
                "admission_rejects": nvme["admission_rejects"], "nvme_blocks_loaded": nvme["loaded_blocks"],
                "nvme_evictions": nvme["evictions"]}


@dataclass
class AdmissionReport:
    settings: TieringSettings
    dram_blocks: int
    nvme_blocks: int
    one_shot_len: int
    results: list[AdmissionResult]

    @property
    def outputs_identical(self) -> bool:
        answers = [[t.output_token_ids for t in r.turns] for r in self.results]
        return all(a == answers[0] for a in answers[1:])

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {"chat": asdict(s.chat), "gpu_blocks": s.gpu_blocks, "dram_blocks": self.dram_blocks,
                "nvme_blocks": self.nvme_blocks, "chat_blocks": s.num_chat_blocks, "one_shot_len": self.one_shot_len,
                "outputs_identical": self.outputs_identical, "modes": [r.summary() for r in self.results]}


def run_admission_study(settings: TieringSettings, nvme_dir: Path, one_shot_len: int,
                        clock: Callable[[], float] = time.perf_counter) -> AdmissionReport:
    """The NVMe config (with `settings.nvme_blocks`, default half the chat) on the chat with a one-shot
    prompt of one_shot_len random tokens after every turn, once per admission mode."""
    import torch

    from kvstrata.cluster.sizing import load_model_config
    from kvstrata.tiering.admission import ADMISSION_MODES
    from kvstrata.worker.llm import LLM

    settings.check()
    itemsize = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    block_bytes = load_model_config(settings.model).kv_bytes_per_token(itemsize) * BLOCK_SIZE
    nvme_dir.mkdir(parents=True, exist_ok=True)
    dram_blocks, _ = settings.tier_blocks("dram")
    nvme_blocks = settings.nvme_blocks or max(1, settings.num_chat_blocks // 2)
    messages = settings.chat.user_messages()
    rng = random.Random(settings.chat.seed + 1)
    num_turns = settings.chat.num_conversations * settings.chat.num_turns
    one_shots = [[rng.randrange(100, 30000) for _ in range(one_shot_len)] for _ in range(num_turns)]
    results = []
    for mode in sorted(ADMISSION_MODES):
        llm = LLM(settings.model, num_gpu_blocks=settings.gpu_blocks, block_size=BLOCK_SIZE, dtype=settings.dtype,
                  nvme_admission=mode, **_tier_kwargs(dram_blocks, nvme_blocks, nvme_dir, block_bytes))
        try:
            warm_up(llm)
            wall, turns = run_chat(llm, messages, settings.chat.answer_len, clock, label=f"admission {mode}",
                                   one_shots=one_shots)
            results.append(AdmissionResult(mode, wall, turns, llm.cache_stats()["tiers"]))
            llm.reset_prefix_cache()
        finally:
            llm.close()
        del llm
        gc.collect()
    return AdmissionReport(settings, dram_blocks, nvme_blocks, one_shot_len, results)
