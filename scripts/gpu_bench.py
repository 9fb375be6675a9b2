"""kvstrata against HF transformers on one CUDA GPU, in bf16, on random-weight Llama checkpoints of real
models' shapes that transformers builds here (GPU machines reach no model hub):

    python scripts/gpu_bench.py [--shapes smollm2-135m,llama-1b] [--json FILE]

For each shape: the engine's decode step at several batch sizes (256-token prompts, every sequence
decoding), then one batch of identical-length requests (256-token prompts, 128 output tokens, EOS
ignored) through kvstrata's `LLM.generate` and through HF `generate` with the whole batch padded to
one static batch (no padding is needed: equal lengths), reporting output tokens/s of each. Random
weights change no timing: the work per token depends on the shapes alone.
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
from tests.checkpoints import word_tokenizer  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}
PROMPT, OUTPUT = 256, 128


def build(shape: str, out: Path):
    import transformers

    kw = SHAPES[shape]
    cfg = transformers.LlamaConfig(**kw, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    tok = word_tokenizer(out / "tok", kw["vocab_size"])
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tok / f).read_bytes())
    return model


def decode_steps(llm, batch: int, vocab: int, steps: int = 20, profile: bool = False, sampled: bool = False) -> float:
    """Median ms of an engine step with `batch` sequences all decoding (outputs reach the host each step);
    with `profile`, torch.profiler's table of those steps is printed too; `sampled`: every sequence
    samples at temperature 0.7 with top_p 0.9 (seeded), on the device, instead of greedy."""
    from kvstrata import SamplingParams

    decoding = {"temperature": 0.7, "top_p": 0.9} if sampled else {"temperature": 0.0}

    engine = llm.engine
    g = torch.Generator().manual_seed(batch)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, torch.randint(3, vocab, (PROMPT,), generator=g).tolist(),
                           SamplingParams(max_tokens=steps + 64, ignore_eos=True, seed=i if sampled else None,
                                          **decoding))
    running = engine.scheduler.running
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in running):
        engine.step()
    engine.step()
    times = []
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
        prof.__enter__()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            print(prof.key_averages(group_by_input_shape=key.endswith("cuda_time_total")).table(
                sort_by=key, row_limit=12, max_name_column_width=40, max_shapes_column_width=60), flush=True)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def throughput(llm, hf, batch: int, vocab: int) -> dict:
    from kvstrata import SamplingParams

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    ours = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == OUTPUT for o in outs)
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=OUTPUT, min_new_tokens=OUTPUT,
              eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:2], **{**kw, "attention_mask": kw["attention_mask"][:2], "max_new_tokens": 4,
                                "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, **kw)
        torch.cuda.synchronize()
        theirs = time.perf_counter() - t0
    tokens = batch * OUTPUT
    return {"batch": batch, "kvstrata_out_tok_s": tokens / ours, "hf_out_tok_s": tokens / theirs,
            "ratio": theirs / ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--throughput-batch", type=int, default=64)
    ap.add_argument("--profile", help="batch sizes whose decode steps torch.profiler also reports")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU")
    from kvstrata import LLM

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        with tempfile.TemporaryDirectory() as d:
            hf = build(shape, Path(d))
            llm = LLM(model=d, device="cuda", dtype="bfloat16", kv_cache_bytes=16 << 30)
            vocab = SHAPES[shape]["vocab_size"]
            profiled = set((args.profile or "").split(","))
            steps = {b: decode_steps(llm, int(b), vocab, profile=b in profiled) for b in args.batches.split(",")}
            sampled = {b: decode_steps(llm, int(b), vocab, sampled=True) for b in args.batches.split(",")}
            tp = throughput(llm, hf, args.throughput_batch, vocab)
            report["shapes"][shape] = {"decode_step_ms": steps, "sampled_decode_step_ms": sampled, "throughput": tp}
            print(shape, "decode step ms:", {b: round(v, 2) for b, v in steps.items()}, flush=True)
            print(shape, "sampled (0.7, top_p 0.9) decode step ms:", {b: round(v, 2) for b, v in sampled.items()},
                  flush=True)
            print(shape, f"batch {tp['batch']}: kvstrata {tp['kvstrata_out_tok_s']:.0f} out tok/s, "
                  f"HF generate {tp['hf_out_tok_s']:.0f}, ratio {tp['ratio']:.2f}x", flush=True)
            del llm, hf
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
