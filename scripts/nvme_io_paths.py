"""The NVMe tier alone on its two IO paths, side by side: Python IO threads (KVSTRATA_NVME_C_IO=0)
against C IO threads (the default where the C kernels are built).

Each round runs `kvstrata bench tiering`'s tier probe (cluster/bench/tier_probe.py: bursts of new
space, reused slots and reads, each in lockstep with one thread's sequential O_DIRECT IO of the same
bytes) once on each path, alternating, so both see the same moments of the disk. Prints, per path,
the median and range of each ratio to its reference. Usage:

    python scripts/nvme_io_paths.py DIR [--rounds 5] [--mb 270]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from kvstrata.cluster.bench.tier_probe import ProbeRound, probe_nvme_tier
from kvstrata.tiering import nvme

BLOCK_SHAPE = (30, 2, 3, 16, 64)  # SmolLM2-135M's 16-token block: layers, k/v, kv heads, tokens, dim
KINDS = ("write_new", "write_reused", "read")


def ratios(r: ProbeRound) -> tuple[float, ...]:
    return tuple(getattr(r, k) / getattr(r, "raw_" + k) for k in KINDS)


def compare(directory: Path, rounds: int, num_bytes: int) -> dict[bool, list[tuple[float, ...]]]:
    """c_io -> each round's (new space, reused slots, reads) ratios to the lockstep reference."""
    real = nvme.NvmeTier
    out: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    try:
        for _ in range(rounds):
            for c_io in (False, True):
                nvme.NvmeTier = lambda *a, _c=c_io, **k: real(*a, c_io=_c, **k)
                probe = probe_nvme_tier(directory, BLOCK_SHAPE, torch.float32, num_bytes, rounds=1)
                if not probe.direct_io:
                    raise SystemExit(f"{directory} has no O_DIRECT: the probe has no reference to compare with")
                out[c_io].append(ratios(probe.rounds[0]))
    finally:
        nvme.NvmeTier = real
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, help="a directory on the disk to measure")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=int, default=270, help="bytes each way per round, in MiB (default 270)")
    args = ap.parse_args(argv)
    if args.rounds <= 0 or args.mb <= 0:
        ap.error("--rounds and --mb must be positive")
    args.directory.mkdir(parents=True, exist_ok=True)
    results = compare(args.directory, args.rounds, args.mb << 20)
    print("IO threads | new space | reused slots | reads   (ratio to the lockstep O_DIRECT reference: median, range)")
    for c_io, rows in results.items():
        cells = [f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})" for c in zip(*rows)]
        print(f"{'C' if c_io else 'Python':10s} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
