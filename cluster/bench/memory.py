"""`kvstrata bench memory`: how much of a fixed KV budget holds tokens, paged versus contiguous.

A request mix (by default every trace request's input + output length, scaled so the longest is
`max_seq_len`) is replayed against a budget of token slots. Each sequence is held at its final length,
the most it ever needs: ceil(len / B) blocks of B slots under paging, `max_seq_len` slots under
contiguous preallocation, which must reserve for the longest possible sequence. Sequences are admitted
in order; when the next one does not fit, the budget is *full* and a snapshot is taken, then the oldest
sequences finish (FIFO) until it fits:

    slots:  [ seq 0 ......|.. ][ seq 1 ...|.... ][ seq 2 ..... ][ free < next ]    full: snapshot
             stored     ^ internal fragmentation (paged: < B a sequence; contiguous: max_seq_len - len)

    kv_utilization  = tokens stored / slots reserved, averaged over the snapshots
    wasted_fraction = 1 - kv_utilization
    max_seqs        = the most sequences held at once during the replay

The paged accounting runs on the engine's real `KVCacheManager` (with prefix caching off, so that
equal blocks of different sequences are not shared); the arithmetic `PagedAllocator` is the same model
without the engine, and the tests check that the two agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from kvstrata.cluster.argtypes import positive_int
from kvstrata.cluster.bench.trace import load_trace
from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.request import Request
from kvstrata.worker.sampling_params import SamplingParams

DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_MAX_SEQS_CONTIGUOUS = 64  # the default budget holds this many max-length sequences
DEFAULT_BLOCK_SIZES = (8, 16, 32, 64)
REFERENCE_BLOCK_SIZE = 16  # the engine's default, for the headline ratio
FIT_MODES = ("scale", "clip")

_DESCRIPTION = """\
Replay the production trace's sequence lengths (input + output) against a fixed KV budget, with paged
blocks at each block size and with contiguous max-length slabs, and report KV utilisation (tokens
stored / slots reserved when the budget is full), the most sequences held at once, and paged versus
contiguous."""


# -- the request mix ----------------------------------------------------------------------------

def fit_lengths(lengths: Sequence[int], max_seq_len: int, mode: str = "scale") -> list[int]:
    """Fit sequence lengths under `max_seq_len`.

    "scale" multiplies every length by max_seq_len / the longest (rounded up), which keeps the shape of
    the distribution; "clip" cuts lengths above max_seq_len, which piles the long tail at the limit.
    """
    if mode not in FIT_MODES:
        raise ValueError(f"fit mode must be one of {', '.join(FIT_MODES)}, got {mode!r}")
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive integers")
    if mode == "clip":
        return [min(n, max_seq_len) for n in lengths]
    longest = max(lengths)
    return [-(-n * max_seq_len // longest) for n in lengths]


# -- allocators: one per scheme, all-or-nothing like KVCacheManager.allocate_slots --------------

class SlotAllocator(Protocol):
    name: str
    block_size: int | None

    def allocate(self, seq_id: int, num_tokens: int) -> bool: ...
    def free(self, seq_id: int) -> None: ...
    @property
    def num_reserved_slots(self) -> int: ...


class ContiguousAllocator:
    """Every sequence reserves one slab of max_seq_len slots, whatever its length."""

    block_size = None

    def __init__(self, budget_tokens: int, max_seq_len: int):
        self.name = f"contiguous ({max_seq_len})"
        self.max_seq_len = max_seq_len
        self.num_slabs = budget_tokens // max_seq_len
        self.seq_ids: set[int] = set()

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        if num_tokens > self.max_seq_len:
            raise ValueError(f"a sequence of {num_tokens} tokens is longer than max_seq_len {self.max_seq_len}")
        if len(self.seq_ids) >= self.num_slabs:
            return False
        self.seq_ids.add(seq_id)
        return True

    def free(self, seq_id: int) -> None:
        self.seq_ids.remove(seq_id)

    @property
    def num_reserved_slots(self) -> int:
        return len(self.seq_ids) * self.max_seq_len


class PagedAllocator:
    """Paged blocks as arithmetic: a sequence of n tokens holds ceil(n / B) of budget // B blocks."""

    def __init__(self, budget_tokens: int, block_size: int):
        self.name = f"paged B={block_size}"
        self.block_size = block_size
        self.num_blocks = budget_tokens // block_size
        self.seq_to_num_blocks: dict[int, int] = {}
        self.num_used_blocks = 0

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size)
        if self.num_used_blocks + need > self.num_blocks:
            return False
        self.seq_to_num_blocks[seq_id] = need
        self.num_used_blocks += need
        return True

    def free(self, seq_id: int) -> None:
        self.num_used_blocks -= self.seq_to_num_blocks.pop(seq_id)

    @property
    def num_reserved_slots(self) -> int:
        return self.num_used_blocks * self.block_size


class KVCacheManagerAllocator:
    """Paged blocks from the engine's own KVCacheManager and BlockPool (no model, no tensors)."""

    def __init__(self, budget_tokens: int, block_size: int):
        self.name = f"paged B={block_size}"
        self.block_size = block_size
        self.manager = KVCacheManager(budget_tokens // block_size, block_size,
                                      enable_prefix_caching=False, watermark=0.0)
        self.seq_to_request: dict[int, Request] = {}

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        request = Request(str(seq_id), [0] * num_tokens, SamplingParams(max_tokens=1), hash_root=b"")
        if not self.manager.allocate_slots(request, num_tokens):
            return False
        self.seq_to_request[seq_id] = request
        return True

    def free(self, seq_id: int) -> None:
        self.manager.free(self.seq_to_request.pop(seq_id))

    @property
    def num_reserved_slots(self) -> int:
        return self.manager.pool.num_used_blocks * self.block_size

    def check_integrity(self) -> None:
        self.manager.check_integrity(list(self.seq_to_request.values()))


# -- the replay ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SchemeResult:
    scheme: str
    block_size: int | None  # None for contiguous preallocation
    kv_utilization: float  # tokens stored / slots reserved, mean over the moments the budget is full
    wasted_fraction: float  # 1 - kv_utilization: internal fragmentation and over-reservation
    max_seqs: int
    mean_seqs_at_full: float
    reserved_fraction_at_full: float  # slots reserved / budget when full; the rest is too small for the next
    num_full_events: int  # 0: the whole mix fit at once, and the figures describe the end state


def replay(lengths: Sequence[int], allocator: SlotAllocator, budget_tokens: int) -> SchemeResult:
    """Admit sequences in order; whenever the next does not fit, snapshot, then finish the oldest."""
    held: deque[tuple[int, int]] = deque()  # (seq_id, num_tokens), oldest first
    num_stored = max_seqs = 0
    snapshots: list[tuple[float, int, float]] = []  # (utilization, seqs, reserved / budget)

    def snapshot() -> None:
        reserved = allocator.num_reserved_slots
        snapshots.append((num_stored / reserved, len(held), reserved / budget_tokens))

    for seq_id, n in enumerate(lengths):
        if not allocator.allocate(seq_id, n):
            if held:
                snapshot()
            while not allocator.allocate(seq_id, n):
                if not held:
                    raise ValueError(f"{allocator.name}: a sequence of {n} tokens does not fit in an empty "
                                     f"budget of {budget_tokens} token slots")
                old_id, old_n = held.popleft()
                allocator.free(old_id)
                num_stored -= old_n
        held.append((seq_id, n))
        num_stored += n
        max_seqs = max(max_seqs, len(held))
    num_full = len(snapshots)
    if not snapshots:
        snapshot()
    utilization = sum(s[0] for s in snapshots) / len(snapshots)
    return SchemeResult(
        scheme=allocator.name,
        block_size=allocator.block_size,
        kv_utilization=utilization,
        wasted_fraction=1.0 - utilization,
        max_seqs=max_seqs,
        mean_seqs_at_full=sum(s[1] for s in snapshots) / len(snapshots),
        reserved_fraction_at_full=sum(s[2] for s in snapshots) / len(snapshots),
        num_full_events=num_full,
    )


@dataclass(frozen=True, slots=True)
class MemoryBenchResult:
    budget_tokens: int
    max_seq_len: int
    num_requests: int
    mean_seq_len: float
    schemes: tuple[SchemeResult, ...]  # paged by block size, then contiguous last

    @property
    def contiguous(self) -> SchemeResult:
        return self.schemes[-1]

    def paged(self, block_size: int) -> SchemeResult:
        for s in self.schemes:
            if s.block_size == block_size:
                return s
        raise KeyError(f"no paged result for block size {block_size}")

    @property
    def reference_block_size(self) -> int | None:
        """16 if it was measured, else the first block size (None with no paged scheme)."""
        sizes = [s.block_size for s in self.schemes if s.block_size is not None]
        return REFERENCE_BLOCK_SIZE if REFERENCE_BLOCK_SIZE in sizes else (sizes[0] if sizes else None)

    def max_seqs_ratio(self, block_size: int) -> float:
        """Sequences held at once, paged at `block_size` over contiguous."""
        return self.paged(block_size).max_seqs / self.contiguous.max_seqs

    def to_json(self) -> dict[str, Any]:
        ref = self.reference_block_size
        return {
            "budget_tokens": self.budget_tokens,
            "max_seq_len": self.max_seq_len,
            "num_requests": self.num_requests,
            "mean_seq_len": self.mean_seq_len,
            "schemes": [asdict(s) for s in self.schemes],
            "reference_block_size": ref,
            "max_seqs_ratio": None if ref is None else self.max_seqs_ratio(ref),
        }


def run_memory_bench(lengths: Sequence[int], budget_tokens: int, max_seq_len: int,
                     block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES) -> MemoryBenchResult:
    """Replay already-fitted `lengths` under paging at each block size and under contiguous slabs."""
    if max(lengths) > max_seq_len:
        raise ValueError(f"a sequence of {max(lengths)} tokens is longer than max_seq_len {max_seq_len}")
    if budget_tokens < max_seq_len:
        raise ValueError(f"budget_tokens {budget_tokens} cannot hold even one sequence of max_seq_len "
                         f"{max_seq_len} contiguously")
    schemes = [replay(lengths, KVCacheManagerAllocator(budget_tokens, b), budget_tokens) for b in block_sizes]
    schemes.append(replay(lengths, ContiguousAllocator(budget_tokens, max_seq_len), budget_tokens))
    return MemoryBenchResult(budget_tokens, max_seq_len, len(lengths), sum(lengths) / len(lengths),
                             tuple(schemes))


# -- the command --------------------------------------------------------------------------------

def block_size_list(text: str) -> list[int]:
    """argparse type for "8,16,32,64"."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {text!r}")
    return sorted(set(sizes))


def configure_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=None,
                        help="trace JSONL file (default: $KVSTRATA_TRACE, else shared/traces/ above the repo)")
    parser.add_argument("--num-requests", type=positive_int, default=None,
                        help="replay only the first N trace requests (default: all)")
    parser.add_argument("--max-seq-len", type=positive_int, default=DEFAULT_MAX_SEQ_LEN,
                        help=f"longest sequence; contiguous slabs are this long (default: {DEFAULT_MAX_SEQ_LEN})")
    parser.add_argument("--fit", choices=FIT_MODES, default="scale",
                        help="scale all lengths so the longest is --max-seq-len, or clip the longer ones "
                             "(default: scale)")
    parser.add_argument("--budget-tokens", type=positive_int, default=None,
                        help=f"KV budget in token slots (default: {DEFAULT_MAX_SEQS_CONTIGUOUS} x --max-seq-len)")
    parser.add_argument("--block-sizes", type=block_size_list, default=list(DEFAULT_BLOCK_SIZES),
                        help="paged block sizes to compare (default: 8,16,32,64)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE",
                        help="also draw the results into an image (needs matplotlib)")


def add_bench_memory_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser(
        "memory", help="KV utilisation and capacity: paged blocks versus contiguous preallocation",
        description=_DESCRIPTION)
    configure_memory_arguments(parser)
    parser.set_defaults(func=run_bench_memory)
    return parser


def _error(message: str) -> int:
    print("kvstrata bench memory: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


def run_bench_memory(args: argparse.Namespace) -> int:
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    budget = args.budget_tokens or DEFAULT_MAX_SEQS_CONTIGUOUS * args.max_seq_len
    try:
        trace = load_trace(args.trace, limit=args.num_requests)
        lengths = fit_lengths([r.total_length for r in trace], args.max_seq_len, args.fit)
        result = run_memory_bench(lengths, budget, args.max_seq_len, args.block_sizes)
    except (ValueError, OSError) as e:
        return _error(str(e))
    print(format_result(result))
    try:
        if args.json is not None:
            args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        if args.plot is not None:
            plot_result(result, args.plot)
    except OSError as e:
        return _error(str(e))
    return 0


def format_result(r: MemoryBenchResult) -> str:
    lines = [f"{r.num_requests:,} sequences, mean {r.mean_seq_len:,.0f} tokens, max {r.max_seq_len:,}; "
             f"KV budget {r.budget_tokens:,} token slots",
             f"{'scheme':<20} {'kv util':>8} {'wasted':>8} {'max seqs':>9} {'seqs at full':>13} {'vs contig':>10}"]
    for s in r.schemes:
        ratio = s.max_seqs / r.contiguous.max_seqs
        lines.append(f"{s.scheme:<20} {s.kv_utilization:>8.1%} {s.wasted_fraction:>8.1%} {s.max_seqs:>9,} "
                     f"{s.mean_seqs_at_full:>13,.1f} {ratio:>9.2f}x")
    ref = r.reference_block_size
    if ref is not None:
        lines.append(f"paged B={ref} holds {r.max_seqs_ratio(ref):.2f}x the sequences of contiguous preallocation")
    if any(s.num_full_events == 0 for s in r.schemes):
        lines.append("note: the budget never filled for some schemes (figures are the end state); "
                     "replay more requests or lower --budget-tokens")
    return "\n".join(lines)


def plot_result(r: MemoryBenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.scheme for s in r.schemes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [100 * s.kv_utilization for s in r.schemes])
    left.set_ylabel("KV utilisation (%)")
    left.set_ylim(0, 100)
    right.bar(names, [s.max_seqs for s in r.schemes])
    right.set_ylabel("max sequences held")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"KV budget {r.budget_tokens:,} slots, {r.num_requests:,} trace sequences")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata bench memory", description=_DESCRIPTION)
    configure_memory_arguments(parser)
    return run_bench_memory(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
