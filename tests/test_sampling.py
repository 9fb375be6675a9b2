"""Sampling: the batched `Sampler` on synthetic logits, the engine's sampling knobs on the real model,
and `SamplingParams` validation."""

from __future__ import annotations

import math

import pytest
import torch

from kvstrata.worker.cpu_kernels import load_cpu_kernels
from kvstrata.worker.request import Request
from kvstrata.worker.sampler import Sampler
from kvstrata.worker.sampling_params import SamplingParams

# -- Sampler on synthetic logits ------------------------------------------------------------------


def _req(i: int = 0, generator: torch.Generator | None = None, **params) -> Request:
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(**params), hash_root=b"x")
    r.generator = generator
    return r


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_picks_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    res = Sampler(0).sample(logits, [_req(i, temperature=0.0) for i in range(5)])
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.logprobs is None


def test_picks_on_the_logits_device_give_what_the_host_path_gives():
    """On a GPU, batches pick their tokens (and log-probs) where the logits are and copy only those
    to the host. The same function on CPU tensors must agree with the host path exactly: tokens,
    the chosen token's log-prob, and each row's own top-k (rows asking for none, 0, 3, 5)."""
    from kvstrata.worker.sampler import _picked_on_device

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    asks = [None, 0, 3, 5, None]
    reqs = [_req(i, temperature=0.0, logprobs=k) for i, k in enumerate(asks)]
    host = Sampler(0).sample(logits, reqs)
    here = _picked_on_device(logits, logits.argmax(-1), [r.params for r in reqs])
    assert here.token_ids == host.token_ids == logits.argmax(-1).tolist()
    assert here.logprobs == host.logprobs
    assert [len(lp) for lp in here.logprobs] == [0, 1, 3, 5, 0]  # greedy: the chosen token is the top one
    plain = _picked_on_device(logits, logits.argmax(-1), [_req(i, temperature=0.0).params for i in range(5)])
    assert plain.token_ids == host.token_ids and plain.logprobs is None
    # sampled rows: the host's tokens, their log-probs beside each row's top ones
    sampled = [_req(i, generator=torch.Generator().manual_seed(i), temperature=1.0, logprobs=k)
               for i, k in enumerate(asks)]
    host = Sampler(0).sample(logits, sampled)
    here = _picked_on_device(logits, torch.tensor(host.token_ids), [r.params for r in sampled])
    assert here.logprobs == host.logprobs and here.token_ids == host.token_ids


def test_the_torch_sampling_path_keeps_to_the_logits_device():
    """Sampling on a GPU runs `_sample_torch` there; on the meta device any tensor made on the host
    by mistake fails the call, so this runs without a GPU."""
    from kvstrata.worker.sampler import _sample_torch

    meta = torch.device("meta")
    rows = [{"temperature": 0.7}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.1}, {"temperature": 0.0}]
    settings = [t.to(meta) for t in _settings(rows, 100)]
    keys = torch.randint(0, 1 << 53, (4,)).to(meta)
    out = _sample_torch(torch.empty(4, 100, device=meta), *settings, keys, filters=True, min_ps=True)
    assert out.device == meta and out.shape == (4,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_samples_on_a_gpu_match_the_host():
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(5)) * 3
    kinds = [{"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.7, "top_k": 40},
             {"temperature": 1.0, "min_p": 0.05}]

    def reqs():
        return [_req(i, generator=torch.Generator().manual_seed(i), **kinds[i % 4]) for i in range(16)]

    host = Sampler(0).sample(logits, reqs()).token_ids
    gpu = Sampler(0).sample(logits.cuda(), reqs()).token_ids
    assert gpu == host


def test_greedy_row_in_a_random_batch_still_picks_argmax():
    logits = torch.zeros(2, 50)
    logits[:, 7] = 0.5  # a mild favourite: a random row often misses it, a greedy row never does
    for seed in range(20):
        res = Sampler(seed).sample(logits, [_req(0, temperature=0.0), _req(1, temperature=1.0)])
        assert res.token_ids[0] == 7


def test_extreme_temperature_and_top_k_cannot_break_a_batch():
    # a temperature so small that logits / t overflows is greedy; a top_k beyond the vocabulary (or
    # beyond int64) means no top-k; neither may fail the step for the other rows
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 30
    rows = [_req(0, temperature=1e-300), _req(1, temperature=1.0, top_k=10**30), _req(2, temperature=0.7, top_k=5)]
    res = Sampler(0).sample(logits, rows)
    assert res.token_ids[0] == int(logits[0].argmax())
    assert all(0 <= t < 40 for t in res.token_ids)
    assert res.token_ids[2] in logits[2].topk(5).indices.tolist()


def test_top_k_1_equals_greedy():
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(1))
    res = Sampler(3).sample(logits, [_req(i, temperature=1.5, top_k=1) for i in range(64)])
    assert res.token_ids == logits.argmax(-1).tolist()


def test_small_top_p_keeps_only_the_top_token():
    logits = torch.linspace(3.0, 0.0, 20).repeat(200, 1)  # top token has ~15% of the mass
    res = Sampler(4).sample(logits, [_req(i, temperature=1.0, top_p=0.05) for i in range(200)])
    assert set(res.token_ids) == {0}


def test_top_p_nucleus_boundary():
    # probs 0.4, 0.3, 0.2, 0.1: with top_p 0.5 the mass before token 1 (0.4) is below 0.5, so it
    # stays; the mass before token 2 (0.7) is not, so tokens 2 and 3 are dropped.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = probs.log().repeat(n, 1)
    res = Sampler(5).sample(logits, [_req(i, temperature=1.0, top_p=0.5) for i in range(n)])
    counts = _counts(res.token_ids, 4)
    assert counts[2] == 0 and counts[3] == 0
    assert _chi_square(counts[:2], torch.tensor([4 / 7, 3 / 7])) < 10.83  # df=1, p=0.001


def test_min_p_masks_tokens_below_min_p_times_max():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().repeat(n, 1)
    # threshold 0.4 * 0.5 = 0.2: tokens 2 and 3 go, 0 and 1 keep their 5:3 ratio
    res = Sampler(6).sample(logits, [_req(i, temperature=1.0, min_p=0.4) for i in range(n)])
    counts = _counts(res.token_ids, 4)
    assert counts[2] == 0 and counts[3] == 0
    assert _chi_square(counts[:2], torch.tensor([5 / 8, 3 / 8])) < 10.83


def test_temperature_sampling_matches_softmax_frequencies():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    temperature, n = 0.7, 20000
    res = Sampler(7).sample(logits.repeat(n, 1), [_req(i, temperature=temperature) for i in range(n)])
    counts = _counts(res.token_ids, 6)
    # df=5: 20.5 is the p=0.001 critical value; the seed is fixed, so this is deterministic
    assert _chi_square(counts, torch.softmax(logits / temperature, -1)) < 20.5
    # and the test can tell temperatures apart: the same draws are far from T=1
    assert _chi_square(counts, torch.softmax(logits, -1)) > 200


def _settings(rows: list[dict], vocab: int):
    temps = torch.tensor([r.get("temperature", 1.0) for r in rows])
    top_k = torch.tensor([r.get("top_k", 0) for r in rows])
    top_p = torch.tensor([r.get("top_p", 1.0) for r in rows])
    min_p = torch.tensor([r.get("min_p", 0.0) for r in rows])
    return temps, top_k, top_p, min_p


def test_race_noise_is_exponential_keyed_and_independent_across_tokens_and_keys():
    from kvstrata.worker.sampler import race_noise

    e = race_noise(torch.tensor([12345, 12346, 1 << 52]), 200_000).double()
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    for row in e:  # Exp(1): mean 1, variance 1, P(E > 1) = 1 / e, P(E > 5) = e^-5
        assert float(row.mean()) == pytest.approx(1.0, abs=0.01)
        assert float(row.var()) == pytest.approx(1.0, abs=0.03)
        assert float((row > 1).double().mean()) == pytest.approx(math.exp(-1), abs=0.005)
        assert float((row > 5).double().mean()) == pytest.approx(math.exp(-5), rel=0.1)
    # neighbouring keys and neighbouring tokens are uncorrelated
    assert abs(float(torch.corrcoef(e[:2])[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([e[0, :-1], e[0, 1:]]))[0, 1])) < 0.01


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_the_c_sampler_draws_what_the_torch_path_draws(vocab):
    from kvstrata.worker.sampler import _sample_torch

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(vocab)
    kinds = [{}, {"temperature": 0.7}, {"temperature": 1.3, "top_k": 5}, {"top_p": 0.9}, {"top_p": 0.5, "top_k": 50},
             {"min_p": 0.05}, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02}, {"temperature": 0.0}]
    kinds += [{"top_p": 0.0}, {"top_p": 1e-30, "top_k": 3}]  # a nucleus of the top token alone
    rows = [kinds[i % len(kinds)] for i in range(96)]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    keys = torch.randint(0, 1 << 53, (len(rows),), generator=g)
    settings = _settings(rows, vocab)
    c = kernels.sample(logits, *settings, keys)
    t = _sample_torch(logits, *settings, keys)
    assert c is not None and c.tolist() == t.tolist()
    # the draws cover more than one token a row kind, so the check has something to disagree on
    assert len(set(c.tolist())) > 10 if vocab > 7 else len(set(c.tolist())) > 3


def test_top_k_top_p_and_min_p_together_match_their_distribution():
    # probs 0.35, 0.25, 0.2, 0.1, 0.06, 0.04: top_k 5 drops 0.04; top_p 0.8 of the rest (0.96) keeps
    # tokens while the mass before is under 0.768: 0, 1, 2 (0.8 before token 3); min_p 0.6 of 0.35
    # (0.21) drops token 2: 0 and 1 remain, 7:5
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    n = 6000
    res = Sampler(12).sample(probs.log().repeat(n, 1),
                             [_req(i, temperature=1.0, top_k=5, top_p=0.8, min_p=0.6) for i in range(n)])
    counts = _counts(res.token_ids, 6)
    assert counts[2:].sum() == 0
    assert _chi_square(counts[:2], torch.tensor([7 / 12, 5 / 12])) < 10.83  # df=1, p=0.001


def test_seeded_row_is_independent_of_the_rest_of_the_batch():
    vocab = 1000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 0.1  # nearly uniform
    noise = torch.Generator().manual_seed(9)

    def draws(seed: int, batched: bool, sampler_seed: int) -> list[int]:
        sampler = Sampler(sampler_seed)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for step in range(6):
            req = _req(1, generator=gen, temperature=1.0, top_p=0.9)
            if batched:
                others = torch.randn(2, vocab, generator=noise)
                logits = torch.stack([others[0], row, others[1]])
                reqs = [_req(0, temperature=0.8), req, _req(2, temperature=1.0, top_k=5)]
                out.append(sampler.sample(logits, reqs).token_ids[1])
            else:
                out.append(sampler.sample(row[None], [req]).token_ids[0])
        return out

    alone = draws(123, batched=False, sampler_seed=0)
    assert draws(123, batched=True, sampler_seed=42) == alone
    assert draws(124, batched=False, sampler_seed=0) != alone  # the seed does matter


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(10)) * 3
    reqs = [
        _req(0, temperature=0.5, logprobs=3),
        _req(1, temperature=0.0),
        _req(2, temperature=1.0, logprobs=0),
    ]
    res = Sampler(11).sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    lp0 = res.logprobs[0]
    top3 = set(ref[0].topk(3).indices.tolist())
    assert set(lp0) == top3 | {res.token_ids[0]}
    for tok, val in lp0.items():
        assert val == pytest.approx(float(ref[0, tok]), abs=1e-5)  # raw logits, not temperature-scaled
    assert res.logprobs[1] == {}
    assert list(res.logprobs[2]) == [res.token_ids[2]]
    assert res.logprobs[2][res.token_ids[2]] == pytest.approx(float(ref[2, res.token_ids[2]]), abs=1e-5)


# -- the engine on the real model -----------------------------------------------------------------

PROMPT = "Once upon a time"
OTHER_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture
def engine(llm):
    """The session model; after the test, no leaked block and a consistent pool."""
    yield llm
    llm.check_integrity()
    stats = llm.cache_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """Greedy continuation of PROMPT (ignoring EOS), the baseline for the stop tests."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    return out.token_ids, out.text


def test_same_seed_same_output_across_calls_and_batches(engine):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True)
    first = engine.generate(PROMPT, sp)[0].outputs[0].token_ids
    again = engine.generate(PROMPT, sp)[0].outputs[0].token_ids
    mixed = engine.generate(
        [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1]],
        [SamplingParams(temperature=1.0, max_tokens=3), sp, SamplingParams(temperature=0.0, max_tokens=6)],
    )
    assert len(first) == 6
    assert again == first
    assert mixed[1].outputs[0].token_ids == first


def test_different_seeds_give_different_outputs(engine):
    outs = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in (1, 2)],
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_n_samples_have_indices_and_are_reproducible_with_a_seed(engine):
    sp = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=4, ignore_eos=True)
    a = engine.generate(PROMPT, sp)[0].outputs
    b = engine.generate(PROMPT, sp)[0].outputs
    assert [o.index for o in a] == [0, 1, 2]
    assert all(len(o.token_ids) == 4 for o in a)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) > 1  # the samples are not three copies of one


def test_stop_string_truncates_text(engine, greedy_ref):
    tokens, text = greedy_ref
    # two stop strings that start inside the text, neither on a token boundary necessarily
    early, late = text[6:10], text[12:17]
    assert text.find(early) == 6 and text.find(late) == 12, text
    outs = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0.0, max_tokens=12, stop=late),
         SamplingParams(temperature=0.0, max_tokens=12, stop=[late, early])],
    )
    one, both = outs[0].outputs[0], outs[1].outputs[0]
    assert (one.text, one.finish_reason, one.stop_reason) == (text[:12], "stop", late)
    assert (both.text, both.finish_reason, both.stop_reason) == (text[:6], "stop", early)
    assert len(one.token_ids) < len(tokens)
    assert one.token_ids == tokens[: len(one.token_ids)]


def test_stop_token_ids_stop_on_that_token(engine, greedy_ref):
    tokens, _ = greedy_ref
    j = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    out = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[j]]))
    o = out[0].outputs[0]
    assert o.token_ids == tokens[: j + 1]
    assert o.finish_reason == "stop"
    assert o.stop_reason == tokens[j]


def test_stop_token_text_does_not_depend_on_unrelated_stop_strings(engine, greedy_ref):
    tokens, _ = greedy_ref
    j = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    plain, with_stop = engine.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[j]]),
         SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[j]], stop="\x00never")],
    )
    assert plain.outputs[0].token_ids == with_stop.outputs[0].token_ids
    assert plain.outputs[0].text == with_stop.outputs[0].text


def test_max_tokens_gives_length(engine, greedy_ref):
    tokens, _ = greedy_ref
    o = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert o.finish_reason == "length"
    assert o.stop_reason is None
    assert o.token_ids == tokens[:5]


def test_ignore_eos_keeps_generating(engine):
    conv = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
    eos = engine.tokenizer.eos_token_id
    stopped = engine.chat(conv, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids[-1] == eos and len(stopped.token_ids) < 6, stopped.token_ids
    n = len(stopped.token_ids) + 3
    kept = engine.chat(conv, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0]
    assert kept.finish_reason == "length"
    assert len(kept.token_ids) == n
    assert kept.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # went straight past EOS


def test_logprobs_per_output_token(engine, hf_reference):
    sp_greedy = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
    sp_random = SamplingParams(temperature=1.0, seed=3, max_tokens=3, logprobs=2, ignore_eos=True)
    greedy, random = (r.outputs[0] for r in engine.generate([PROMPT, PROMPT], [sp_greedy, sp_random]))
    for o in (greedy, random):
        assert len(o.logprobs) == len(o.token_ids) == 3
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp
            assert 2 <= len(lp) <= 3
            assert all(v <= 0.0 for v in lp.values())
    for tok, lp in zip(greedy.token_ids, greedy.logprobs):
        assert len(lp) == 2 and lp[tok] == max(lp.values())
    # the values are real log-probabilities: the first step matches HF on the same prompt
    _, model = hf_reference
    ids = torch.tensor([engine.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
    for tok, val in greedy.logprobs[0].items():
        assert val == pytest.approx(float(ref[tok]), abs=2e-3)


# -- SamplingParams validation --------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("max_tokens", "3"),
    ("temperature", -1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 2),
    ("n", 0),
    ("logprobs", 21),
    ("stop", [""]),
    ("seed", -1),
    ("stop_token_ids", [-1]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_good_sampling_params_pass():
    sp = SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, n=64, logprobs=20,
                        stop="x", seed=0, stop_token_ids=[0])
    assert sp.greedy and sp.stop_strings == ("x",)


@pytest.mark.parametrize("field", ["stop", "stop_token_ids"])
def test_non_list_stop_fields_raise_value_error(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: 5})
