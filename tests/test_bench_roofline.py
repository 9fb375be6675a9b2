"""`kvstrata bench roofline`: the work model's arithmetic, the peak measurements, and a tiny CLI run."""

from __future__ import annotations

import json

import pytest

from kvstrata.cluster.bench.roofline import (
    MachinePeaks,
    MatmulPeak,
    ModelCost,
    Work,
    decode_tokens_needed,
    measure_bandwidth,
    measure_matmul,
    median_time,
    time_decode_steps,
)
from kvstrata.cluster.bench.workloads import BenchRequest, Workload
from kvstrata.worker.config import ModelConfig


def _config(**over) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    base.update(over)
    return ModelConfig(**base)


def _peaks(flops: float, bw: float) -> MachinePeaks:
    return MachinePeaks({"float32": MatmulPeak("float32", flops, {"engine": flops})}, bw, bw)


def test_model_cost_counts_parameters_and_kv():
    cost = ModelCost(_config(), "float32")
    # per layer: qkv 8*(8+2*4) + o 8*8 + gate/up/down 3*8*16 = 128 + 64 + 384 = 576
    assert cost.projection_params == 2 * 576
    assert cost.head_params == 100 * 8
    assert cost.weight_bytes == (2 * 576 + 800) * 4
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 2 * 4  # layers * (K, V) * kv heads * head_dim * 4 bytes
    assert cost.attention_flops_per_key == 4 * 2 * 4 * 2
    assert ModelCost(_config(), "bfloat16").kv_bytes_per_token == cost.kv_bytes_per_token // 2


def test_decode_step_work():
    cost = ModelCost(_config(), "float32")
    w = cost.decode_step(batch=3, context_len=10)
    assert w.flops == 3 * (2 * 1152 + 2 * 800) + 30 * 64
    assert w.bytes == cost.weight_bytes + 30 * cost.kv_bytes_per_token


def test_workload_work_skips_prefix_hits():
    """Two requests with the same 8-token prompt, block size 4: the second hits (8 - 1) // 4 = 1 block."""
    cost = ModelCost(_config(), "float32")
    prompt = list(range(20, 28))
    wl = Workload("w", [BenchRequest(prompt, 3), BenchRequest(prompt, 2)])
    w = cost.workload(wl, block_size=4)
    per_key, proj, head = 64, 2 * 1152, 2 * 800
    # request 1: 8 prefill tokens (keys 1..8 = 36) + 2 decode tokens (keys 9 + 10) + 3 sampled
    r1 = (8 + 2) * proj + (36 + 19) * per_key + 3 * head
    # request 2: hits 4, computes tokens 4..7 (keys 5..8 = 26) + 1 decode token (9 keys) + 2 sampled
    r2 = (4 + 1) * proj + (26 + 9) * per_key + 2 * head
    assert w.flops == r1 + r2
    assert w.bytes == 3 * cost.weight_bytes + (19 + 9) * cost.kv_bytes_per_token


def test_bound_is_the_larger_of_compute_and_memory():
    w = Work(flops=1e9, bytes=1e6)
    assert w.bound_s(_peaks(1e9, 1e9), "float32") == pytest.approx(1.0)
    assert w.bound_kind(_peaks(1e9, 1e9), "float32") == "compute"
    assert w.bound_s(_peaks(1e12, 1e5), "float32") == pytest.approx(10.0)
    assert w.bound_kind(_peaks(1e12, 1e5), "float32") == "memory"
    assert (w + w).flops == 2e9


def test_median_time_uses_the_injected_clock():
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])
    assert median_time(lambda: None, repeats=3, warmup=0, clock=lambda: next(ticks)) == 2.0


def test_peak_measurements_are_positive_and_name_their_backends():
    m = measure_matmul("float32", sizes=(128,), repeats=1)
    assert m.flops_per_s > 0 and "torch.matmul" in m.by_backend and set(m.by_backend) <= {"torch.matmul", "onednn", "packed"}
    assert m.flops_per_s == max(m.by_backend.values())
    read, copy = measure_bandwidth(8 << 20, repeats=1)
    assert read > 0 and copy > 0


def test_a_backend_far_slower_at_the_screen_skips_the_large_sizes(monkeypatch):
    """A backend with no native kernels for the dtype (torch's bf16 matmul on an AVX2 CPU took 58 s
    at 2048) is timed once at the screen size and keeps that rate; the others go on to every size."""
    import time

    import kvstrata.worker.linear as linear

    seen: list[int] = []

    class Slow:
        def prepare(self, w):
            return w

        def __call__(self, x, w, bias):
            seen.append(x.shape[0])
            time.sleep(0.2)  # a 384-product at well under a tenth of torch.matmul's rate
            return x @ w.T

    def fake_select(device, dtype, name):
        if name == "onednn":
            raise ValueError("not here")
        return Slow()

    monkeypatch.setattr(linear, "select_linear", fake_select)
    m = measure_matmul("float32", sizes=(64, 128), repeats=1)
    assert seen and set(seen) == {384}  # the screen only (a warm-up and one timing): never at 64 or 128
    assert set(m.by_backend) == {"torch.matmul", "packed"}
    assert m.by_backend["packed"] < m.by_backend["torch.matmul"] / 10
    assert m.flops_per_s == m.by_backend["torch.matmul"]


def test_decode_tokens_needed_covers_prompts_of_several_chunks():
    assert decode_tokens_needed(4, 8) == 8 + 4 + 2  # short prompts: one step each at most
    assert decode_tokens_needed(4, 8, prompt_len=512) == 8 + 4 + 2
    assert decode_tokens_needed(4, 8, prompt_len=2048) == 8 + 4 * 4 + 2  # four 512-token chunks each
    assert decode_tokens_needed(4, 8, prompt_len=2048, step_tokens=2048) == 8 + 4 + 2


@pytest.mark.slow
def test_decode_steps_keep_every_sequence_when_prompts_take_several_steps(llm):
    """Prompts longer than a step's budget are computed in chunks over several steps, while the
    sequences admitted first already decode: none may finish before the timed steps are over."""
    budget = llm.engine.scheduler.config.max_num_batched_tokens
    prompt_len = 3 * budget + 100  # four steps a prompt: the first sequence decodes through eight
    steps = time_decode_steps(llm, 3, prompt_len, 2)
    assert len(steps) == 2
    assert all(keys >= 3 * (prompt_len + 1) for _, keys in steps)  # all three sequences attended
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_bench_roofline_cli_tiny(tmp_path):
    from tests.test_cli import kvstrata

    out = tmp_path / "roofline.json"
    r = kvstrata("bench", "roofline", "--quick", "--batches", "1,2", "--prompt-len", "20", "--steps", "2",
                 "--dtypes", "float32", "--stages", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    stages = report["stages"]  # the layers' stages, timed in steps of their own
    assert [p["batch"] for p in stages] == [1, 2]
    assert all(p["stage_ms"]["decode_attention"] > 0 and p["lm_head_ms"] > 0 and p["step_ms"] > p["rest_ms"] > 0
               for p in stages)
    assert "where a decode step goes" in r.stdout
    assert report["peaks"]["read_bytes_per_s"] > 0
    rows = report["decode"]
    assert [row["batch"] for row in rows] == [1, 2]
    for row in rows:
        assert row["step_s"] > 0 and row["bound_s"] > 0
        assert row["ratio"] == pytest.approx(row["step_s"] / row["bound_s"], rel=1e-2)
        assert 20 < row["context_len"] <= 20 + 2 + 2 + row["batch"]
    assert "ratio" in r.stdout


def test_bench_roofline_rejects_bad_lists():
    from tests.test_cli import kvstrata

    r = kvstrata("bench", "roofline", "--batches", "1,x")
    assert r.returncode != 0 and "--batches" in r.stderr
    r = kvstrata("bench", "roofline", "--dtypes", "float16")
    assert r.returncode != 0 and "--dtypes" in r.stderr
