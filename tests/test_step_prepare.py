"""A step's index tensors: the paths for steps of few tokens against the general per-token path."""

from __future__ import annotations

import torch

from kvstrata import SamplingParams


def _watch_prepare(runner, monkeypatch, check) -> None:
    """check(batch, out) on every step's _prepare and its result."""
    real_prepare = runner._prepare

    def spy(batch):
        out = real_prepare(batch)
        check(batch, out)
        return out

    monkeypatch.setattr(runner, "_prepare", spy)


def _rows_both_ways(runner, batch):
    """The batch's (positions, slot_mapping, ends) from the Python lists (_listed_rows) and from the
    per-token tensor arithmetic (_token_rows), checked equal; returns them."""
    reqs, counts = batch.requests, batch.num_new_tokens
    starts, kv_starts = [r.num_computed_tokens for r in reqs], [r.num_kv_tokens for r in reqs]
    general = runner._token_rows(runner._block_table(reqs), counts, starts, kv_starts, runner.block_size)
    listed = runner._listed_rows(reqs, counts, starts, kv_starts, runner.block_size)
    for g, f in zip(general, listed):
        assert g.dtype == f.dtype and torch.equal(g, f)
    return general


def test_decode_only_steps_index_the_pool_as_the_general_path_does(llm, monkeypatch):
    runner = llm.engine.runner
    batches = []

    def check(batch, out):
        reqs = batch.requests
        if batch.num_decodes == len(reqs):
            kv_starts = [r.num_kv_tokens for r in reqs]
            batches.append(kv_starts)
            positions_want, slots_want, _ = _rows_both_ways(runner, batch)
            _, positions, meta, last_rows = out
            assert torch.equal(positions, positions_want) and torch.equal(meta.slot_mapping, slots_want)
            assert torch.equal(last_rows, torch.arange(len(reqs)))
            assert meta.decode_seq_lens.tolist() == [k + 1 for k in kv_starts]
            assert meta.decode_block_tables.shape[1] == -(-max(meta.decode_seq_lens.tolist()) // runner.block_size)

    _watch_prepare(runner, monkeypatch, check)
    # prompt lengths across block boundaries, so that tables differ in width and slots in offset
    prompts = [[17 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((5, 16, 31, 33, 64))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [20] * 5
    assert len(batches) >= 10 and max(len(b) for b in batches) == 5


def test_prompt_chunks_beside_decodes_get_the_general_paths_rows_and_prefill_arrays(llm, monkeypatch):
    """Steps of few tokens build their rows from Python lists (_listed_rows), and steps with prompt
    chunks the C prefill kernel's arrays with the step's own table: the same as the per-token
    tensor arithmetic (_token_rows) and attention.prefill_arrays from the chunks."""
    from kvstrata.worker.attention import prefill_arrays
    from kvstrata.worker.model_runner import LISTED_ROWS

    engine = llm.engine
    runner = engine.runner
    mixed = []

    def check(batch, out):
        if batch.num_decodes < len(batch.requests) and sum(batch.num_new_tokens) <= LISTED_ROWS:
            general = _rows_both_ways(runner, batch)
            _, positions, meta, last_rows = out
            assert torch.equal(positions, general[0]) and torch.equal(meta.slot_mapping, general[1])
            assert torch.equal(last_rows, general[2] - 1)
            got, want = meta.prefill_arrays, prefill_arrays(meta.prefills)
            for name in ("starts", "counts", "ctxs"):
                assert torch.equal(getattr(got, name), getattr(want, name))
            for i, chunk in enumerate(meta.prefills):  # past a chunk's blocks the kernel reads nothing
                assert torch.equal(got.tables[i, : len(chunk.block_ids)], want.tables[i, : len(chunk.block_ids)])
            mixed.append(batch.num_decodes)

    _watch_prepare(runner, monkeypatch, check)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {f"mix-{i}": [17 + (5 * i + j) % 700 for j in range(n)] for i, n in enumerate((9, 40, 17, 70))}
    alone = {rid: out.outputs[0].token_ids for rid, out in zip(prompts, llm.generate(list(prompts.values()), params))}
    mixed.clear()
    for rid, prompt in prompts.items():  # each prompt arrives while the ones before it decode
        engine.add_request(rid, prompt, params)
        engine.step()
        engine.step()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
    assert finished == alone  # the same tokens as each prompt alone
    assert len(mixed) >= 3 and max(mixed) >= 2
