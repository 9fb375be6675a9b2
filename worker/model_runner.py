"""The model runner: owns the KV cache tensor, turns a scheduled batch into tensors, runs the model.

KV cache layout, one tensor for the whole pool:

    kv_cache: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, row_width]

row_width is head_dim for plain floats; a quantized kv_dtype stores codes and scales in bytes
(worker/kv_format.py).

Per layer, K and V are contiguous [num_blocks, block_size, Hkv, D] views (the attention hot path),
and one block of every layer is a single gather along dim 2 (for copy-on-write now, tier copies
later). Tensor-parallel ranks hold the same layout with their share of the KV heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstrata.worker.attention import AttentionMetadata, PrefillChunk, prefill_columns
from kvstrata.worker.cpu_kernels import PrefillArrays, load_cpu_kernels
from kvstrata.worker.huge_pages import empty_on_huge_pages
from kvstrata.worker.kv_cache_manager import BlockCopy
from kvstrata.worker.kv_format import make_kv_format
from kvstrata.worker.model import LlamaModel
from kvstrata.worker.request import Request
from kvstrata.worker.tensor_parallel import STEP, SYNC, TPComm, pack_step, pack_tier_ops, unpack_step, unpack_tier_ops

LISTED_ROWS = 128  # steps of up to this many tokens build their positions and slots in Python (_listed_rows)


@dataclass(slots=True)
class ScheduledBatch:
    """What to run this step: requests in batch order (decodes first) and their new token counts."""

    requests: list[Request]
    num_new_tokens: list[int]
    num_decodes: int
    block_copies: list[BlockCopy]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: str = "auto"):
        c = model.config
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_format = make_kv_format(kv_dtype, c.head_dim, block_size, model.dtype)
        spec = self.kv_format.spec()
        shape = (c.num_layers, 2, num_blocks, block_size, model.num_kv_heads, spec.row_width)
        if self.device.type == "cpu":
            # huge pages: 1-2% off fp32 decode steps at 8 and 32 sequences (worker/huge_pages.py);
            # zeroed, which also maps every page at load, as torch.zeros did
            self.kv_cache = empty_on_huge_pages(math.prod(shape), spec.dtype).view(shape).zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=spec.dtype, device=model.device)
        kernels = load_cpu_kernels() if self.device.type == "cpu" and self.kv_format.kernel_readable else None
        if kernels is not None and not kernels.supports(model.dtype, model.num_heads, model.num_kv_heads):
            kernels = None
        self.cpu_kernels = kernels
        self.kv_format.use_kernels(kernels)
        # rank 0 of a tensor-parallel group: steps go to the other ranks through `comm`, and `group`
        # (a WorkerGroup) checks they are alive and names the rank that died when a step fails
        self.comm: TPComm | None = None
        self.group = None
        self.tiers = None  # rank 0 with tiers: its copy log goes to the other ranks with each step
        self.rank_tiers = None  # another rank's tiers (a RankTiers): its share of each block, rank 0's ops
        self.attention_observer = None  # set by the engine before a step whose requests need attention scores

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: str = "auto") -> int:
        """KV bytes of one block on this rank (its share of the KV heads), scales included."""
        c = model.config
        per_head = make_kv_format(kv_dtype, c.head_dim, block_size, model.dtype).bytes_per_token_head()
        return 2 * c.num_layers * model.num_kv_heads * per_head * block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token in this runner's pool (every layer, K and V, scales included)."""
        return 2 * self.model.config.num_layers * self.model.num_kv_heads * self.kv_format.bytes_per_token_head()

    def tp_stats(self) -> dict:
        """This rank's share of a tensor-parallel group's KV (every rank holds the same amount)."""
        shard = self.model.shard
        kv = self.kv_cache
        return {"size": shard.size, "kv_heads_per_rank": shard.num_kv_heads, "kv_replication": shard.kv_replication,
                "kv_bytes_per_rank": kv.numel() * kv.element_size(),
                "kv_bytes_per_block_per_rank": self.kv_bytes_per_block(self.model, self.block_size),
                "group": self.group.stats() if self.group is not None else None}

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of token slots src[i] -> dst[i] (slot = block_id * block_size + offset) in every
        layer. All sources are read before any destination is written, so the sets may overlap."""
        if src.numel() == 0:
            return
        self.kv_format.move_slots(self.kv_cache, src.to(self.device), dst.to(self.device))

    def execute(self, batch: ScheduledBatch, sample_rows: list[int], spans: list[int] | None = None,
                greedy: bool = False) -> torch.Tensor:
        """Run one step; returns float32 logits [len(sample_rows), V] for the given batch rows: each
        row's last token. With spans, spans[j] tokens of row sample_rows[j], its last ones in order
        (a speculative step's drafts), sum(spans) rows in all. With greedy, where the model picks
        greedy tokens without the float32 logits (LlamaModel.greedy_tokens), those instead: int64,
        one a row."""
        input_ids, positions, meta, last_token_rows = self._prepare(batch)
        if self.comm is None:
            self.copy_blocks(batch.block_copies)
            hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        else:
            self.group.check()
            try:
                src, dst = [c.src for c in batch.block_copies], [c.dst for c in batch.block_copies]
                tier_ops, loads = self._tier_messages()
                self.comm.send(STEP, pack_step(input_ids, positions, meta, src, dst, tier_ops, loads))
                self._agree_on_loads(loads)
                self.copy_blocks(batch.block_copies)
                hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
            except Exception as e:  # a collective failed: say which rank died, if one did
                raise self.group.failure(e) from e
        # a decode step samples every row, each its request's last token, in order: no gather there
        in_order = spans is None and hidden.shape[0] == len(batch.requests) and sample_rows == [*range(len(hidden))]
        if not in_order:
            rows = last_token_rows[sample_rows] if sample_rows else last_token_rows[:0]
            if spans is not None:
                rows = torch.tensor([r - i for r, n in zip(rows.tolist(), spans) for i in range(n - 1, -1, -1)],
                                    dtype=torch.long)
            hidden = hidden[rows if self.device.type == "cpu" else rows.to(self.device)]
        tokens = self.model.greedy_tokens(hidden) if greedy else None
        return tokens if tokens is not None else self.model.compute_logits(hidden)

    def sync_tiers(self) -> None:
        """Rank 0, when no step runs (requests wait for NVMe): send the tier ops so far and learn
        how far every rank has read the pending loads."""
        self.group.check()
        try:
            tier_ops, loads = self._tier_messages()
            self.comm.send(SYNC, pack_tier_ops(tier_ops, loads))
            self._agree_on_loads(loads)
        except Exception as e:
            raise self.group.failure(e) from e

    def _tier_messages(self) -> tuple[list, list[int]]:
        if self.tiers is None:
            return [], []
        return self.tiers.drain_copy_log(), self.tiers.pending_load_ids() if self.tiers.nvme is not None else []

    def _agree_on_loads(self, loads: list[int]) -> None:
        """Every rank's read status of these NVMe loads, the group's being the least (rank_mirror.py)."""
        if not loads:
            return
        if self.rank_tiers is not None:
            self.comm.all_reduce_min(self.rank_tiers.statuses(loads))
        else:
            self.tiers.note_group_reads(loads, self.comm.all_reduce_min(self.tiers.load_statuses(loads)))

    def follow(self, fields: list[torch.Tensor]) -> None:
        """Another rank's side of rank 0's `execute`: the same copies and forward pass, no logits."""
        step = unpack_step(fields, self.block_size, self.device, self.cpu_kernels, self.kv_format)
        self._follow_tiers(step.tier_ops, step.sync_loads)
        self.copy_blocks([BlockCopy(s, d) for s, d in step.block_copies])
        self.model.forward(step.input_ids, step.positions, step.meta, self.kv_cache)

    def follow_sync(self, fields: list[torch.Tensor]) -> None:
        """Another rank's side of rank 0's `sync_tiers`."""
        self._follow_tiers(*unpack_tier_ops(fields))

    def _follow_tiers(self, tier_ops: list, loads: list[int]) -> None:
        if tier_ops:  # rank 0 made these before its forward pass, in this order
            self.rank_tiers.apply(tier_ops)
        self._agree_on_loads(loads)

    @staticmethod
    def _block_table(reqs: list[Request]) -> torch.Tensor:
        """[R, max blocks] block ids, zero-padded, in one tensor call (one a request cost about 2 us each)."""
        width = max(len(r.block_table) for r in reqs)
        return torch.tensor([[b.block_id for b in r.block_table] + [0] * (width - len(r.block_table)) for r in reqs],
                            dtype=torch.long)

    @staticmethod
    def _listed_rows(reqs: list[Request], counts: list[int], starts: list[int], kv_starts: list[int], bs: int):
        """(positions, slot_mapping, ends) of a step of few tokens (LISTED_ROWS or fewer), as
        _token_rows gives them, from Python lists: the general path's per-token tensor arithmetic
        (about ten tensor calls) costs more than it saves at these sizes (`_prepare` took about 0.3
        ms a step at batch 1, and 0.6 ms a step with a prompt chunk beside the decodes, before)."""
        positions: list[int] = []
        slots: list[int] = []
        ends: list[int] = []
        for r, n, s, e in zip(reqs, counts, starts, kv_starts):
            table = r.block_table
            positions.extend(range(s, s + n))
            slots.extend(table[x // bs].block_id * bs + x % bs for x in range(e, e + n))
            ends.append(len(positions))
        return (torch.tensor(positions, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                torch.tensor(ends, dtype=torch.long))

    @staticmethod
    def _token_rows(table: torch.Tensor, counts: list[int], starts: list[int], kv_starts: list[int], bs: int):
        """(positions, slot_mapping, ends) of any step: each request's new tokens, rows in batch
        order; ends[i] is the exclusive end row of request i."""
        counts_t = torch.tensor(counts, dtype=torch.long)
        ends = counts_t.cumsum(0)  # [R] exclusive end row of each request
        req_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts_t)  # [T]
        offset_in_req = torch.arange(int(ends[-1])) - (ends - counts_t)[req_of_token]
        positions = torch.tensor(starts, dtype=torch.long)[req_of_token] + offset_in_req  # [T]
        entries = torch.tensor(kv_starts, dtype=torch.long)[req_of_token] + offset_in_req  # [T] cache entry of each
        slot_mapping = table[req_of_token, entries // bs] * bs + entries % bs  # [T]
        return positions, slot_mapping, ends

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        reqs, counts = batch.requests, batch.num_new_tokens
        starts = [r.num_computed_tokens for r in reqs]
        # cache entries before this step: fewer than the position once a policy evicted tokens, whose
        # keys keep their original RoPE phase (see worker/token_evictor.py)
        kv_starts = [r.num_kv_tokens for r in reqs]
        tokens: list[int] = []
        for r, s, n in zip(reqs, starts, counts):
            tokens.extend(r.token_ids[s : s + n])
        table = self._block_table(reqs)
        if len(tokens) <= LISTED_ROWS:
            positions, slot_mapping, ends = self._listed_rows(reqs, counts, starts, kv_starts, bs)
        else:
            positions, slot_mapping, ends = self._token_rows(table, counts, starts, kv_starts, bs)

        d = batch.num_decodes
        decode_tables = decode_mask = seq_lens = None
        if d:
            lens = [k + 1 for k in kv_starts[:d]]
            seq_lens = torch.tensor(lens, dtype=torch.long)
            width = -(-max(lens) // bs)
            # (each tensor call counts in a decode step of a few rows: none where the table is that already)
            decode_tables = table if table.shape == (d, width) else table[:d, :width].contiguous()
            if self.cpu_kernels is None:
                decode_mask = (torch.arange(width * bs)[None, :] < seq_lens[:, None]).view(d, 1, 1, width * bs)
        prefills = []
        row = sum(counts[:d])  # ends[d - 1], without a tensor call
        for i in range(d, len(reqs)):
            ctx = kv_starts[i] + counts[i]
            prefills.append(PrefillChunk(row, counts[i], ctx, table[i, : -(-ctx // bs)].to(self.device)))
            row += counts[i]
        arrays = None
        if prefills and self.cpu_kernels is not None:
            # the C prefill kernel's arrays (attention.prefill_arrays) in two tensor calls: the chunks'
            # rows of the step's table, as wide as its widest request (the kernel takes the width as a
            # row stride and reads only the blocks of each chunk's context), and their starts, counts
            # and contexts
            arrays = PrefillArrays(*prefill_columns(prefills), table[d:])

        dev = self.device

        def to_dev(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or dev.type == "cpu" else t.to(dev)

        meta = AttentionMetadata(
            slot_mapping=to_dev(slot_mapping),
            num_decodes=d,
            decode_block_tables=to_dev(decode_tables),
            decode_seq_lens=to_dev(seq_lens),
            decode_mask=to_dev(decode_mask),
            prefills=prefills,
            cpu_kernels=self.cpu_kernels,
            kv_format=self.kv_format,
            prefill_arrays=arrays,
            # the engine sets it for steps with H2O or SnapKV requests; a runner used alone has none
            attention_observer=self.attention_observer,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return input_ids, to_dev(positions), meta, ends - 1
