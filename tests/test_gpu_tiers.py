"""The tiers under a CUDA device pool (skipped where there is none): block copies queued on the copy
stream land where they should even when the pool is overwritten right after, and DRAM, swap and
NVMe give the same tokens as a roomy pool, with pinned DRAM and transfer rates counted."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata import SamplingParams
from tests.checkpoints import build_checkpoint, word_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LEN = 160  # ten blocks of 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gpu-tiers")
    build_checkpoint(d / "ckpt", word_tokenizer(d / "tok"), "llama", dict(num_key_value_heads=2), False, seed=3)
    return str(d / "ckpt")


def _llm(ckpt, **kw):
    from kvstrata import LLM

    return LLM(model=ckpt, device="cuda", dtype="float32", **kw)


def _block_bytes(llm) -> int:
    from kvstrata.worker.model_runner import ModelRunner

    return ModelRunner.kv_bytes_per_block(llm.engine.runner.model, 16)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(6)]


@pytest.fixture(scope="module")
def expected(ckpt, prompts):
    roomy = _llm(ckpt, num_gpu_blocks=256)
    return [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY)]


def test_queued_copies_land_even_when_the_pool_is_overwritten_at_once():
    from kvstrata.tiering.cuda_copy import CudaBlockCopier
    from kvstrata.tiering.manager import TierCounters

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn((3, 2, 32, 16, 2, 8), generator=g, device="cuda").to(torch.bfloat16)
    original = kv.clone()
    storage = torch.zeros((20, 3, 2, 16, 2, 8), dtype=torch.bfloat16, pin_memory=True)
    counters = TierCounters()
    copier = CudaBlockCopier(kv, storage, counters)
    ids, slots = [5, 3, 9, 10, 11, 2, 30], [7, 8, 9, 0, 1, 15, 19]  # three runs of slots, out of order
    copier.to_host(ids, slots)
    kv.zero_()  # the compute stream reuses those blocks at once: the gather has already read them
    copier.wait()
    for i, s in zip(ids, slots):
        assert torch.equal(storage[s], original[:, :, i].cpu())
    back = [20, 21, 22, 23, 24, 25, 26]
    copier.to_device(slots, back)
    got = kv[:, :, back].cpu()  # on the compute stream: after the copy it waited for
    assert torch.equal(got, original[:, :, ids].cpu())
    torch.cuda.synchronize()
    copier.settle()
    block = storage[0].numel() * storage.element_size()
    assert counters.demote_bytes == counters.promote_bytes == 7 * block
    assert counters.demote_seconds > 0 and counters.promote_seconds > 0


def test_held_and_long_demotions_to_a_reused_slot_land_in_order():
    """Small demotions wait on the device; a slot demoted into twice keeps the later block, whether
    the later copy is held too or long enough to go at once; a promotion sees held copies."""
    from kvstrata.tiering.cuda_copy import CudaBlockCopier
    from kvstrata.tiering.manager import TierCounters

    kv = torch.arange(2 * 2 * 16 * 4 * 1 * 4, dtype=torch.float32, device="cuda").reshape(2, 2, 16, 4, 1, 4)
    original = kv.clone().cpu()
    storage = torch.zeros((8, 2, 2, 4, 1, 4), pin_memory=True)
    copier = CudaBlockCopier(kv, storage, TierCounters())
    copier.hold_blocks = 3
    copier.to_host([1], [4])
    copier.to_host([2], [4])  # held as well: the later copy wins
    copier.to_host([3], [5])
    copier.to_device([4, 5], [10, 11])  # flushes the held copies first
    assert torch.equal(kv[:, :, 10].cpu(), original[:, :, 2]) and torch.equal(kv[:, :, 11].cpu(), original[:, :, 3])
    copier.to_host([6], [0])
    copier.to_host([7, 8, 9, 12], [0, 1, 2, 3])  # longer than the hold: the held one goes first
    copier.wait()
    for block, slot in ((7, 0), (8, 1), (9, 2), (12, 3), (2, 4), (3, 5)):
        assert torch.equal(storage[slot], original[:, :, block]), (block, slot)


def test_dram_tier_on_cuda_keeps_what_a_small_pool_evicts(ckpt, prompts, expected):
    # 24 device blocks hold about two of the six prompts; the DRAM tier holds all of them
    probe = _llm(ckpt, num_gpu_blocks=8)
    tiered = _llm(ckpt, num_gpu_blocks=24, cpu_kv_bytes=64 * _block_bytes(probe))
    assert tiered.engine.kv.tiers.host.storage.is_pinned()
    for round_ in range(2):
        for p, want in zip(prompts, expected):
            got = tiered.generate([p], GREEDY)[0]
            assert got.outputs[0].token_ids == want
            if round_:
                assert got.num_cached_tokens == PROMPT_LEN - 16  # every full block but the last, from DRAM
            tiered.check_integrity()
    dram = tiered.cache_stats()["tiers"]["dram"]
    assert dram["promoted_blocks"] >= 6 * 9 and dram["demoted_blocks"] > 0
    assert dram["demote_gb_per_s"] > 0 and dram["promote_gb_per_s"] > 0


def test_swap_on_preemption_on_cuda_gives_the_same_outputs(ckpt):
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    roomy = _llm(ckpt, num_gpu_blocks=256)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    small = _llm(ckpt, num_gpu_blocks=12, cpu_kv_bytes=64 * _block_bytes(roomy))
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == want
    stats = small.cache_stats()
    assert stats["num_preemptions"] > 0 and stats["num_swaps"] == stats["num_preemptions"]
    dram = stats["tiers"]["dram"]
    assert dram["swapped_out_blocks"] == dram["swapped_in_blocks"] > 0
    small.check_integrity()


def test_nvme_tier_on_cuda_brings_blocks_back(ckpt, prompts, expected, tmp_path):
    probe = _llm(ckpt, num_gpu_blocks=8)
    bb = _block_bytes(probe)
    # 24 device blocks and 20 DRAM blocks hold well under the 6 prompts' 60 blocks; NVMe holds all
    llm = _llm(ckpt, num_gpu_blocks=24, cpu_kv_bytes=20 * bb, nvme_kv_dir=str(tmp_path), nvme_kv_bytes=200 * bb)
    try:
        for round_ in range(2):
            for p, want in zip(prompts, expected):
                got = llm.generate([p], GREEDY)[0]
                assert got.outputs[0].token_ids == want
                if round_:
                    assert got.num_cached_tokens == PROMPT_LEN - 16
            llm.check_integrity()
        nvme = llm.cache_stats()["tiers"]["nvme"]
        assert nvme["loaded_blocks"] > 0 and nvme["checksum_failures"] == 0
    finally:
        llm.close()
