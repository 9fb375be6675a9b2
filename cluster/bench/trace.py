"""The production request trace: finding the file and reading it into typed records.

The trace is Mooncake's FAST'25 conversation trace (see `shared/traces/SOURCE.md`): one JSON object a
line with an arrival time, input and output lengths, and anonymised prefix block ids. Each id stands for
512 prompt tokens, and equal ids at the same position mean an equal prefix:

    input_length 1300:  [ hash 0 (512) | hash 46 (512) | hash 47 (276, partial) ]
    another request:    [ hash 0 (512) | hash 59 (512) | ...                    ]  -> shares 512 tokens

Bad input raises FileNotFoundError (no file) or ValueError naming the file and the 1-based line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # tokens behind one trace hash id
TRACE_ENV_VAR = "KVSTRATA_TRACE"
TRACE_RELATIVE_PATH = Path("shared/traces/mooncake_conversation_trace.jsonl")
# cluster/bench/trace.py -> the repository root is two folders up from this one
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace; `hash_ids[i]` names prompt tokens [512 i, 512 (i + 1))."""

    arrival_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def total_length(self) -> int:
        """Prompt plus output: the tokens the sequence holds in the KV cache when it finishes."""
        return self.input_length + self.output_length


def find_trace(path: str | Path | None = None, *, start: Path | None = None,
               environ: Mapping[str, str] | None = None) -> Path:
    """The trace file: `path` if given, else $KVSTRATA_TRACE, else the first
    `shared/traces/mooncake_conversation_trace.jsonl` found in `start` (the repository root) or above it.
    """
    if path is not None:
        return _existing(Path(path), "trace file")
    env = os.environ if environ is None else environ
    if env.get(TRACE_ENV_VAR):
        return _existing(Path(env[TRACE_ENV_VAR]), f"${TRACE_ENV_VAR}")
    root = (start or REPO_ROOT).resolve()
    for folder in (root, *root.parents):
        candidate = folder / TRACE_RELATIVE_PATH
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no trace found: looked for {TRACE_RELATIVE_PATH} in {root} and every folder above it; "
        f"pass a path or set ${TRACE_ENV_VAR}"
    )


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no such file: {path}")
    return path


def load_trace(path: str | Path | None = None, *, limit: int | None = None) -> list[TraceRequest]:
    """Read the trace (found as `find_trace` does), stopping after `limit` requests if given."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    file = find_trace(path)
    with file.open(encoding="utf-8") as f:
        return parse_trace(f, source=str(file), limit=limit)


def parse_trace(lines: Iterable[str], *, source: str = "<trace>", limit: int | None = None) -> list[TraceRequest]:
    """Parse JSON lines into records; blank lines are skipped, anything else malformed is a ValueError."""
    out: list[TraceRequest] = []
    for line_no, line in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            out.append(_parse_record(line))
        except ValueError as e:
            raise ValueError(f"{source}, line {line_no}: {e}") from None
    if not out and limit != 0:
        raise ValueError(f"{source}: the trace has no requests")
    return out


def _parse_record(line: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    arrival = _int_field(obj, "timestamp", lo=0)
    input_length = _int_field(obj, "input_length", lo=1)
    output_length = _int_field(obj, "output_length", lo=0)
    if "hash_ids" not in obj:
        raise ValueError("missing field 'hash_ids'")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise ValueError("'hash_ids' must be a list of non-negative integers")
    num_blocks = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(hash_ids) > num_blocks:
        raise ValueError(f"{len(hash_ids)} hash_ids, but input_length {input_length} spans only "
                         f"{num_blocks} blocks of {TRACE_BLOCK_TOKENS} tokens")
    return TraceRequest(arrival, input_length, output_length, tuple(hash_ids))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(obj: dict, name: str, lo: int) -> int:
    if name not in obj:
        raise ValueError(f"missing field {name!r}")
    value = obj[name]
    if not _is_int(value) or value < lo:
        raise ValueError(f"{name!r} must be an integer >= {lo}, got {value!r}")
    return value
