"""The DRAM tier under a CUDA device pool, on a random-weight Llama checkpoint of a real model's shape:

    python scripts/gpu_tiering.py [--shape llama-1b] [--conversations 24] [--prompt 2048] [--json FILE]

First this machine's pinned host<->device copy rate (256 MB each way, CUDA events, median of five).
Then two engines whose device pools hold about a sixth of the conversations' KV, one with a DRAM tier
holding all of it: each conversation's first turn (a long prompt), then each second turn (that prompt,
its answer and a new message), one request at a time. It reports the second turns' hit rate and
median time to first token, with and without the tier, beside an engine whose pool holds everything
(every second turn a device hit), and the tier's demote and promote rates as ratios to the copy rate;
and the same tier again with its copies made in the step loop, blocking (block_copy.py's plain path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.gpu_bench import SHAPES, build  # noqa: E402

MB = 1 << 20


def copy_rate(num_bytes: int = 256 * MB, repeats: int = 5) -> dict:
    """Median GB/s of one pinned host -> device copy and one device -> host copy."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        rates = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(num_bytes / (start.elapsed_time(end) / 1e3) / 1e9)
        out[name] = statistics.median(rates[1:])
    return out


def conversations(n: int, prompt: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(n)]


def run(llm, firsts: list[list[int]], vocab: int, profile: bool = False) -> dict:
    """First turns, then second turns; the second turns' hit rate and median time to first token.
    `profile`: torch.profiler's table (CPU time) of the last three second turns is printed."""
    from kvstrata import SamplingParams

    answer = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(9)
    replies = [llm.generate([p], answer)[0].outputs[0].token_ids for p in firsts]
    seconds, hit, total = [], 0, 0
    prof = None
    for i, (p, reply) in enumerate(zip(firsts, replies)):
        if profile and i == len(firsts) - 3:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        follow = p + list(reply) + torch.randint(3, vocab, (64,), generator=g).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate([follow], first_token)[0]
        seconds.append(time.perf_counter() - t0)
        hit += out.num_cached_tokens
        total += len(follow)
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50),
              flush=True)
    return {"hit_rate": hit / total, "ttft_ms_p50": statistics.median(seconds) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--profile", action="store_true", help="profile three second turns with the DRAM tier")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tiering needs a CUDA GPU")
    from kvstrata import LLM
    from kvstrata.worker.model_runner import ModelRunner

    ref = copy_rate()
    print(f"pinned copies: host->device {ref['h2d']:.1f} GB/s, device->host {ref['d2h']:.1f} GB/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "copy_gb_per_s": ref, "configs": {}}
    vocab = SHAPES[args.shape]["vocab_size"]
    firsts = conversations(args.conversations, args.prompt, vocab)
    with tempfile.TemporaryDirectory() as d:
        build(args.shape, Path(d))
        torch.cuda.empty_cache()
        per_conv = (args.prompt + 32 + 64 + 1) // 16 + 2
        small = max(per_conv + 4, args.conversations * per_conv // 6)
        configs = {"hbm (roomy)": dict(num_gpu_blocks=4 * args.conversations * per_conv),
                   "hbm": dict(num_gpu_blocks=small)}
        for name in ("hbm (roomy)", "hbm", "hbm+dram", "hbm+dram (copies in the step loop)"):
            kw = configs.get(name)
            if kw is None:
                probe = LLM(model=d, device="cuda", dtype="bfloat16", num_gpu_blocks=8)
                block = ModelRunner.kv_bytes_per_block(probe.engine.runner.model, 16)
                del probe
                kw = dict(num_gpu_blocks=small, cpu_kv_bytes=2 * args.conversations * per_conv * block)
            llm = LLM(model=d, device="cuda", dtype="bfloat16", **kw)
            if name.endswith("step loop)"):  # the plain path: a gather, then a blocking copy each way
                llm.engine.kv.tiers.cuda = None
            res = run(llm, firsts, vocab, profile=args.profile and name == "hbm+dram")
            dram = llm.cache_stats().get("tiers", {}).get("dram")
            if dram:
                res.update(demote_gb_per_s=dram["demote_gb_per_s"], promote_gb_per_s=dram["promote_gb_per_s"],
                           demote_ratio=dram["demote_gb_per_s"] / ref["d2h"],
                           promote_ratio=dram["promote_gb_per_s"] / ref["h2d"],
                           promoted_blocks=dram["promoted_blocks"], demoted_blocks=dram["demoted_blocks"],
                           demote_overhead_s=dram["demote_overhead_s"])
            llm.check_integrity()
            report["configs"][name] = {**kw, **res}
            print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}),
                  flush=True)
            del llm
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
