"""`kvstrata size`: the command-line face of `kvstrata.cluster.sizing` (parsing and printing only).

`cluster/cli.py` mounts it with `add_size_parser(subparsers)`; `python -m kvstrata.cluster.size_cmd`
runs it on its own with the same options.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstrata.cluster.argtypes import non_negative_float, positive_int
from kvstrata.cluster.sizing import (
    GIB,
    KV_DTYPES,
    WEIGHT_BYTES_PER_PARAM,
    CapacityPlan,
    SizingParams,
    load_model_config,
    plan_capacity,
)
from kvstrata.worker.model_source import DEFAULT_MODEL

_DESCRIPTION = """\
Plan KV-cache capacity: bytes per token and per sequence, the KV budget left on each GPU after
weights and overhead, and how many sequences fit when each one preallocates --max-seq-len slots
(contiguous) versus when it takes blocks on demand up to --mean-seq-len (paged)."""

_EPILOG = """\
KV bytes per token = 2 (K, V) * layers * KV heads * bytes per head vector; query heads do not count
(GQA). With --tp N each rank holds KV heads / N of them, or, when they do not split evenly, heads
replicated as needed, as the engine shards them (the replication is printed).
KV dtype storage: fp32 4 B, fp16/bf16 2 B, fp8_e4m3/fp8_e5m2 1 B per value; int8 is 1 B per value
plus a float16 scale per (token, layer, head) for each of K and V; int4 is 4 bits per value plus
max(ceil(2 * head_dim / block size), ceil(head_dim / 16)) bytes per head vector: the block's one-byte
key step and zero point per channel, spread over its rows, and the token's one-byte value scales.
KV budget per GPU = GPU memory - weights / tp - (overhead-frac * GPU memory + overhead-gib)."""


def configure_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `size`, shared by the `kvstrata size` subcommand and `python -m`."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"alias, HF model directory, .gguf file or config.json (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--gpu-mem-gib", type=non_negative_float, default=80.0,
                        help="memory of one GPU in GiB (default: 80)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel ranks per replica (default: 1)")
    parser.add_argument("--gpus", type=positive_int, default=None,
                        help="GPUs in total, a multiple of --tp; replicas = gpus / tp (default: tp)")
    parser.add_argument("--max-seq-len", type=positive_int, default=None,
                        help="longest sequence, prompt + output (default: the model's context length)")
    parser.add_argument("--mean-seq-len", type=positive_int, default=None,
                        help="mean sequence length for paged sizing (default: max-seq-len / 4)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per KV block (default: 16)")
    parser.add_argument("--kv-dtype", choices=["auto", *KV_DTYPES], default="auto",
                        help="KV cache storage type; auto = model dtype (default: auto)")
    parser.add_argument("--model-dtype", choices=["auto", *WEIGHT_BYTES_PER_PARAM], default="auto",
                        help="weight dtype; auto = the config's torch_dtype (default: auto)")
    parser.add_argument("--overhead-frac", type=non_negative_float, default=0.10,
                        help="fraction of GPU memory kept for activations and runtime (default: 0.10)")
    parser.add_argument("--overhead-gib", type=non_negative_float, default=1.0,
                        help="fixed GiB kept per GPU on top of --overhead-frac (default: 1.0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_size_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "size",
        help="plan KV-cache capacity for a model on given GPUs",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_size_arguments(parser)
    parser.set_defaults(func=run_size)
    return parser


def _error(message: str) -> int:
    print("kvstrata size: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


def run_size(args: argparse.Namespace) -> int:
    try:
        params = SizingParams(
            gpu_mem_gib=args.gpu_mem_gib,
            tp=args.tp,
            gpus=args.gpus,
            max_seq_len=args.max_seq_len,
            mean_seq_len=args.mean_seq_len,
            block_size=args.block_size,
            kv_dtype=args.kv_dtype,
            model_dtype=args.model_dtype,
            overhead_frac=args.overhead_frac,
            overhead_gib=args.overhead_gib,
        )
        config = load_model_config(args.model)
        plan = plan_capacity(config, params)
    except (ValueError, OSError) as e:  # ModelDoesNotFitError is a ValueError
        return _error(str(e))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def _bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def format_plan(p: CapacityPlan) -> str:
    ratio = f"{p.paged_vs_contiguous_ratio:.2f}x" if p.paged_vs_contiguous_ratio is not None else "n/a"
    rows = [
        ("model", f"{p.model_id} ({p.num_parameters / 1e6:,.1f}M params, {p.model_dtype})"),
        ("layers / heads / kv heads / head dim",
         f"{p.num_layers} / {p.num_heads} / {p.num_kv_heads} / {p.head_dim}"),
        ("kv dtype", p.kv_dtype),
        ("gpus", f"{p.gpus} = {p.num_replicas} replica(s) x tp {p.tp}"),
        ("kv heads per rank", f"{p.kv_heads_per_rank} (replication x{p.kv_head_replication:g})"),
        ("kv per token", _bytes(p.kv_bytes_per_token)),
        ("kv per token per rank", _bytes(p.kv_bytes_per_token_per_rank)),
        (f"kv per sequence ({p.max_seq_len} tokens)", _bytes(p.kv_bytes_per_sequence)),
        ("kv per sequence per rank", _bytes(p.kv_bytes_per_sequence_per_rank)),
        ("gpu memory", _bytes(p.gpu_mem_bytes)),
        ("weights per rank", _bytes(p.weights_bytes_per_rank)),
        ("overhead per gpu", _bytes(p.overhead_bytes_per_gpu)),
        ("kv budget per gpu", _bytes(p.kv_budget_bytes_per_gpu)),
        (f"kv blocks per gpu ({p.block_size} tokens)", f"{p.kv_blocks_per_gpu:,}"),
        ("kv tokens per replica", f"{p.kv_tokens_per_replica:,}"),
        (f"max seqs, contiguous ({p.max_seq_len} each)",
         f"{p.max_seqs_contiguous:,} ({p.max_seqs_contiguous_per_replica:,} per replica)"),
        (f"max seqs, paged (mean {p.mean_seq_len})",
         f"{p.max_seqs_paged:,} ({p.max_seqs_paged_per_replica:,} per replica)"),
        ("paged vs contiguous", ratio),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    if p.max_seqs_contiguous_per_replica == 0:
        lines.append("note: not even one max-length sequence fits contiguously on a replica")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstrata size",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_size_arguments(parser)
    return run_size(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
