"""A step's index tensors: the decode-only fast path against the general per-token path."""

from __future__ import annotations

import torch

from kvstrata import SamplingParams


def test_decode_only_steps_index_the_pool_as_the_general_path_does(llm, monkeypatch):
    engine = llm.engine
    runner = engine.runner
    batches = []
    real_prepare = runner._prepare

    def spy(batch):
        out = real_prepare(batch)
        reqs = batch.requests
        if batch.num_decodes == len(reqs):
            starts, kv_starts = [r.num_computed_tokens for r in reqs], [r.num_kv_tokens for r in reqs]
            batches.append(starts)
            table, bs = runner._block_table(reqs), runner.block_size
            general = runner._token_rows(table, [1] * len(reqs), starts, kv_starts, bs)
            fast = runner._decode_rows(reqs, starts, kv_starts, bs)
            for g, f in zip(general, fast):
                assert g.dtype == f.dtype and torch.equal(g, f)
            _, positions, meta, last_rows = out
            assert torch.equal(positions, fast[0]) and torch.equal(meta.slot_mapping, fast[1])
            assert torch.equal(last_rows, torch.arange(len(reqs)))
            assert meta.decode_seq_lens.tolist() == [k + 1 for k in kv_starts]
            assert meta.decode_block_tables.shape[1] == -(-max(meta.decode_seq_lens.tolist()) // runner.block_size)
        return out

    monkeypatch.setattr(runner, "_prepare", spy)
    # prompt lengths across block boundaries, so that tables differ in width and slots in offset
    prompts = [[17 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((5, 16, 31, 33, 64))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [20] * 5
    assert len(batches) >= 10 and max(len(b) for b in batches) == 5
