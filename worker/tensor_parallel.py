"""Tensor parallelism inside one worker: how a model is cut across `tp` ranks, and what rank 0 sends
the others at every step. Plain torch.distributed; the Ray wiring lives in `kvstrata.cluster.tp_group`.

Each rank holds a slice of every layer (Megatron-style) and its share of the KV heads of every block:

    q/k/v, gate/up   column-parallel: rank r computes its heads / its slice of the MLP
    o, down          row-parallel: partial sums, then one all-reduce each per layer
    embedding, norms, LM head   replicated (only rank 0 computes logits)

    KV heads h = 4, tp = 2:  rank 0 [kv0 kv1 | q0..q3]   rank 1 [kv2 kv3 | q4..q7]
    KV heads h = 2, tp = 4:  rank r holds kv head r // 2, replicated on two ranks

Rank 0 owns the scheduler and the block manager. Block tables are the same on every rank, so a step
is only its batch tensors: rank 0 broadcasts them (int64 tensors, never pickle) and every rank runs
the same forward pass on its own heads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvstrata.worker.attention import AttentionMetadata, PrefillChunk
from kvstrata.worker.config import ModelConfig

STEP, STOP, SYNC = 1, 2, 3  # message kinds: a forward pass; the end; tier ops and load statuses alone


@dataclass(frozen=True, slots=True)
class TPShard:
    """What rank `rank` of `size` holds: [start, end) ranges of query heads and MLP columns, and the
    (global) KV head behind each of its local KV heads, in order; a head may appear on several ranks,
    or twice on one, when the heads do not split evenly."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, ...]
    intermediate: tuple[int, int]
    kv_replication: float  # KV memory over an even split's: 1 when the heads split evenly

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def plan_shard(config: ModelConfig, tp: int, rank: int) -> TPShard:
    """ValueError naming tensor_parallel_size when the model cannot be cut into tp equal slices.

    Each rank takes h / tp query heads. Its query heads fall into runs of g = gcd(h / tp, h / h_kv)
    consecutive heads that share one KV head and never straddle a rank, and the rank holds one local
    KV head per run. So each local KV head serves g query heads (plain GQA on every rank):

        h = 8, h_kv = 4, tp = 2:   g = 2   rank 0: kv (0, 1)      rank 1: kv (2, 3)        even split
        h = 8, h_kv = 2, tp = 4:   g = 2   ranks: kv (0,) (0,) (1,) (1,)                   replicated x2
        h = 12, h_kv = 3, tp = 2:  g = 2   rank 0: kv (0, 0, 1)   rank 1: kv (1, 2, 2)     replicated x2
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    h, hkv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {h} attention heads")
    if inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's intermediate size {inter}")
    q = h // tp
    kv = local_kv_heads(h, hkv, tp, rank)
    i = inter // tp
    return TPShard(rank, tp, (rank * q, (rank + 1) * q), kv, (rank * i, (rank + 1) * i), len(kv) * tp / hkv)


def local_kv_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, ...]:
    """The global KV head behind each of rank `rank`'s local KV heads (see plan_shard); tp must
    divide num_heads."""
    q, per_kv = num_heads // tp, num_heads // num_kv_heads
    run = math.gcd(q, per_kv)
    return tuple((rank * q + j * run) // per_kv for j in range(q // run))


def shard_slices(config: ModelConfig, shard: TPShard) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Checkpoint tensor name suffix -> (dim, [start, end) ranges to concatenate) of this rank's
    slice; names absent are loaded whole."""
    d = config.head_dim
    q = [(shard.q_heads[0] * d, shard.q_heads[1] * d)]
    kv = [(k * d, (k + 1) * d) for k in shard.kv_heads]
    mlp = [shard.intermediate]
    return {
        "self_attn.q_proj.weight": (0, q), "self_attn.q_proj.bias": (0, q),
        "self_attn.k_proj.weight": (0, kv), "self_attn.k_proj.bias": (0, kv),
        "self_attn.v_proj.weight": (0, kv), "self_attn.v_proj.bias": (0, kv),
        "self_attn.o_proj.weight": (1, q),
        "mlp.gate_proj.weight": (0, mlp), "mlp.up_proj.weight": (0, mlp),
        "mlp.down_proj.weight": (1, mlp),
    }


def slice_for(name: str, slices: dict[str, tuple[int, list[tuple[int, int]]]]) -> tuple[int, list] | None:
    """The slice of a layer tensor `model.layers.<i>.<suffix>`, or None to load it whole."""
    if not name.startswith("model.layers."):
        return None
    suffix = name.split(".", 3)[3]
    return slices.get(suffix)


def rank_directory(directory: str, rank: int) -> str:
    """Each rank's NVMe tier keeps its share of every block in a directory of its own."""
    return os.path.join(directory, f"rank-{rank}")


def shard_layout_tag(layout_tag: str, shard: TPShard) -> str:
    """A rank's NVMe layout names its KV heads, so a directory reused at another tp (or by another
    rank) never serves one shard's bytes as another's."""
    return f"{layout_tag}/tp{shard.size}-kv{'.'.join(map(str, shard.kv_heads))}"


# -- the group --------------------------------------------------------------------------------------

class TPComm:
    """One rank's side of the group: all-reduce for the model, and the step broadcast from rank 0.

    A step is three broadcasts: [kind, number of fields], the fields' lengths, then all fields
    concatenated, every one an int64 tensor (on the GPU under NCCL, which moves only device tensors).
    """

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank = rank
        self.size = size
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    @staticmethod
    def init(backend: str, init_method: str, rank: int, size: int, timeout_s: float) -> None:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """The minimum of each value over the ranks (every rank calls it with as many values)."""
        x = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x.tolist()

    def send(self, kind: int, fields: list[torch.Tensor]) -> None:
        assert self.rank == 0, "only rank 0 sends steps"
        head = torch.tensor([kind, len(fields)], dtype=torch.long, device=self.device)
        dist.broadcast(head, 0)
        if not fields:
            return
        lengths = torch.tensor([f.numel() for f in fields], dtype=torch.long, device=self.device)
        dist.broadcast(lengths, 0)
        payload = torch.cat([f.reshape(-1).to(self.device, torch.long) for f in fields])
        if payload.numel():
            dist.broadcast(payload, 0)

    def receive(self) -> tuple[int, list[torch.Tensor]]:
        head = torch.empty(2, dtype=torch.long, device=self.device)
        dist.broadcast(head, 0)
        kind, n = (int(x) for x in head.tolist())
        if not n:
            return kind, []
        lengths = torch.empty(n, dtype=torch.long, device=self.device)
        dist.broadcast(lengths, 0)
        sizes = lengths.tolist()
        payload = torch.empty(sum(sizes), dtype=torch.long, device=self.device)
        if payload.numel():
            dist.broadcast(payload, 0)
        return kind, list(payload.split(sizes))


# -- the step message -------------------------------------------------------------------------------

def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              copies_src: list[int], copies_dst: list[int],
              tier_ops: list[tuple[int, list[int], list[int]]] = (), sync_loads: list[int] = ()) -> list[torch.Tensor]:
    """A scheduled step as int64 fields: what another rank needs to run the same forward pass, then
    pack_tier_ops' fields."""
    cpu = torch.device("cpu")
    d = meta.num_decodes
    width = meta.decode_block_tables.shape[1] if d else 0
    prefill_info = [x for p in meta.prefills for x in (p.token_start, p.num_tokens, p.context_len)]
    return [
        torch.tensor([d, width, len(meta.prefills)], dtype=torch.long),
        input_ids.to(cpu), positions.to(cpu), meta.slot_mapping.to(cpu),
        meta.decode_block_tables.to(cpu) if d else torch.empty(0, dtype=torch.long),
        meta.decode_seq_lens.to(cpu) if d else torch.empty(0, dtype=torch.long),
        torch.tensor(prefill_info, dtype=torch.long),
        torch.cat([p.block_ids.to(cpu) for p in meta.prefills]) if meta.prefills else torch.empty(0, dtype=torch.long),
        torch.tensor(copies_src, dtype=torch.long), torch.tensor(copies_dst, dtype=torch.long),
        *pack_tier_ops(tier_ops, sync_loads),
    ]


def pack_tier_ops(tier_ops: list[tuple[int, list[int], list[int]]], sync_loads: list[int]) -> list[torch.Tensor]:
    """The tier ops rank 0 made since the last step, (kind, a, b) in order (tiering/rank_mirror.py),
    and the NVMe loads whose read status every rank reports in an all-reduce after applying them.

        kinds [k0, k1]   a lengths [2, 1]   b lengths [2, 0]   a [a00 a01 a10]   b [b00 b01]   loads [...]
    """
    return [
        torch.tensor([k for k, _, _ in tier_ops], dtype=torch.long),
        torch.tensor([len(a) for _, a, _ in tier_ops], dtype=torch.long),
        torch.tensor([len(b) for _, _, b in tier_ops], dtype=torch.long),
        torch.tensor([i for _, a, _ in tier_ops for i in a], dtype=torch.long),
        torch.tensor([i for _, _, b in tier_ops for i in b], dtype=torch.long),
        torch.tensor(list(sync_loads), dtype=torch.long),
    ]


def unpack_tier_ops(fields: list[torch.Tensor]) -> tuple[list[tuple[int, list[int], list[int]]], list[int]]:
    """pack_tier_ops' fields back into (tier ops, load ids)."""
    kinds, a_lens, b_lens, a_all, b_all, loads = (f.tolist() for f in fields)
    ops = []
    i = j = 0
    for kind, na, nb in zip(kinds, a_lens, b_lens):
        ops.append((kind, a_all[i:i + na], b_all[j:j + nb]))
        i += na
        j += nb
    return ops, loads


@dataclass(slots=True)
class StepMessage:
    """One step as another rank receives it."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write copies, before the forward pass
    tier_ops: list[tuple[int, list[int], list[int]]]  # (kind, a, b): tier ops, first of all
    sync_loads: list[int]  # NVMe loads whose read status every rank reports after the tier ops


def unpack_step(fields: list[torch.Tensor], block_size: int, device: torch.device, cpu_kernels=None,
                kv_format=None) -> StepMessage:
    """pack_step's fields back into a step."""
    (counts, input_ids, positions, slots, tables, seq_lens, prefill_info, prefill_ids, src, dst) = fields[:10]
    d, width, num_prefills = (int(x) for x in counts.tolist())
    decode_tables = decode_mask = None
    if d:
        decode_tables = tables.view(d, width).to(device)
        if cpu_kernels is None:
            decode_mask = (torch.arange(width * block_size)[None, :] < seq_lens[:, None]).view(d, 1, 1, -1).to(device)
    prefills = []
    offset = 0
    for token_start, num_tokens, ctx in prefill_info.view(num_prefills, 3).tolist():
        n = -(-ctx // block_size)
        prefills.append(PrefillChunk(token_start, num_tokens, ctx, prefill_ids[offset:offset + n].to(device)))
        offset += n
    meta = AttentionMetadata(slot_mapping=slots.to(device), num_decodes=d, decode_block_tables=decode_tables,
                             decode_seq_lens=seq_lens.to(device) if d else None, decode_mask=decode_mask,
                             prefills=prefills, cpu_kernels=cpu_kernels, kv_format=kv_format)
    tier_ops, sync_loads = unpack_tier_ops(fields[10:])
    return StepMessage(input_ids.to(device), positions.to(device), meta, list(zip(src.tolist(), dst.tolist())),
                       tier_ops, sync_loads)
