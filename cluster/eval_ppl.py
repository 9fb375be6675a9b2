"""Perplexity through the engine's own cache path, to measure what lossy KV settings cost.

The text's first token (or first few) is the prompt; every later token is teacher-forced as the
output of a decode step. So each token's log-probability comes from attention over K/V read back from the
paged pool, in whatever format it is stored and after whatever a token-eviction policy kept, just
as in serving (not from a separate full-attention pass).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from kvstrata.worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class PplResult:
    kv_dtype: str
    eviction: str | None
    num_tokens: int  # tokens scored (the text's tokens after the prompt)
    nll: float  # mean negative log-likelihood, nats per token
    ppl: float
    kv_bytes_per_token: int  # K and V of every layer, scales included, on this rank
    peak_kv_blocks: int  # the most blocks the sequence held at once
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_text_tokens(tokenizer: Any, path: Path, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of a UTF-8 text file; ValueError names the problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--text: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--text: {path} is not UTF-8 text") from None
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"--text: {path} has fewer than 2 tokens")
    return ids


def perplexity(llm: Any, token_ids: list[int], eviction: str | None = None, prompt_tokens: int = 1,
               on_token: Callable[[], None] | None = None) -> PplResult:
    """Score token_ids[prompt_tokens:] given everything before each, one decode step per token. The
    first prompt_tokens are a prompt, prefilled (a policy such as SnapKV acts at its end)."""
    if not 1 <= prompt_tokens < len(token_ids):
        raise ValueError(f"prompt_tokens must be between 1 and {len(token_ids) - 1}, got {prompt_tokens}")
    engine = llm.engine
    scored = token_ids[prompt_tokens:]
    params = SamplingParams(max_tokens=len(scored), temperature=0.0, ignore_eos=True, kv_eviction=eviction)
    request_id = f"ppl-{time.monotonic_ns()}"
    engine.add_request(request_id, token_ids[:prompt_tokens], params, teacher_ids=scored)
    request = engine.groups[request_id].samples[0]
    peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(request.block_table))
        if on_token is not None:
            on_token()
    seconds = time.perf_counter() - start
    logprobs = request.teacher.logprobs
    if len(logprobs) != len(scored):
        raise RuntimeError(f"scored {len(logprobs)} of {len(scored)} tokens")
    nll = -math.fsum(logprobs) / len(logprobs)
    runner = engine.runner
    return PplResult(kv_dtype=llm.kv_dtype, eviction=eviction, num_tokens=len(logprobs), nll=nll,
                     ppl=math.exp(nll), kv_bytes_per_token=runner.kv_bytes_per_token, peak_kv_blocks=peak,
                     seconds=seconds)
