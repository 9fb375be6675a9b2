"""The router's prefix index: which worker holds which block-hash chain, and in which tier.

Block hashes are chained (each covers its parent's hash and its own tokens), so a hash names a
whole prefix, and the index is a radix tree whose nodes are keyed by hash, one block per edge:

    root ─ h0 ─ h1 ─ h2        worker A: h0 h1 h2 in HBM
             └─ h1' ─ h2'      worker B: h0 in DRAM, h1' h2' on NVMe

A request's prefix on a worker is the run of the request's own hashes, from the first, that the
worker holds in some tier. The index is advisory: it steers placement, and each worker's own prefix
cache decides what is really reused, so a stale entry costs a miss, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.protos.v1 import kv_events_pb2 as ev

HBM, DRAM, NVME = ev.TIER_HBM, ev.TIER_DRAM, ev.TIER_NVME
TIERS = (HBM, DRAM, NVME)  # best first
_BIT = {HBM: 1, DRAM: 2, NVME: 4}


@dataclass
class _Node:
    parent: bytes | None
    holders: dict[str, int] = field(default_factory=dict)  # worker -> bitmask of tiers


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """Leading blocks of a request one worker holds, by the best tier it holds each in."""

    hbm_blocks: int = 0
    dram_blocks: int = 0
    nvme_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.hbm_blocks + self.dram_blocks + self.nvme_blocks


class PrefixIndex:
    def __init__(self) -> None:
        self._nodes: dict[bytes, _Node] = {}
        self._by_worker: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def workers(self) -> list[str]:
        return sorted(w for w, blocks in self._by_worker.items() if blocks)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    # -- updates ------------------------------------------------------------------------------------
    def store(self, worker_id: str, hashes: list[bytes], parent: bytes | None, tier: int) -> None:
        """A chain segment (each hash's parent is the one before it) now held in `tier`."""
        mine = self._by_worker.setdefault(worker_id, set())
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                node = self._nodes[h] = _Node(parent)
            node.holders[worker_id] = node.holders.get(worker_id, 0) | _BIT[tier]
            mine.add(h)
            parent = h

    def remove(self, worker_id: str, hashes: list[bytes], tier: int) -> None:
        for h in hashes:
            node = self._nodes.get(h)
            if node is None or worker_id not in node.holders:
                continue
            bits = node.holders[worker_id] & ~_BIT[tier]
            if bits:
                node.holders[worker_id] = bits
            else:
                self._forget(worker_id, h, node)

    def move(self, worker_id: str, hashes: list[bytes], from_tier: int, to_tier: int) -> None:
        for h in hashes:
            node = self._nodes.get(h)
            if node is None or worker_id not in node.holders:
                continue  # a move of a block we never saw stored: nothing to say where it came from
            node.holders[worker_id] = (node.holders[worker_id] & ~_BIT[from_tier]) | _BIT[to_tier]

    def clear_worker(self, worker_id: str) -> int:
        """Forget everything a worker holds (it restarted, died or reset); returns how many blocks."""
        blocks = self._by_worker.pop(worker_id, set())
        for h in blocks:
            node = self._nodes.get(h)
            if node is not None:
                node.holders.pop(worker_id, None)
                if not node.holders:
                    del self._nodes[h]
        return len(blocks)

    def _forget(self, worker_id: str, h: bytes, node: _Node) -> None:
        del node.holders[worker_id]
        self._by_worker[worker_id].discard(h)
        if not node.holders:
            del self._nodes[h]

    def apply(self, worker_id: str, event: ev.KVEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            s = event.stored
            self.store(worker_id, list(s.block_hashes), s.parent_hash or None, s.tier)
        elif kind == "removed":
            self.remove(worker_id, list(event.removed.block_hashes), event.removed.tier)
        elif kind == "tier_changed":
            t = event.tier_changed
            self.move(worker_id, list(t.block_hashes), t.from_tier, t.to_tier)
        elif kind == "cleared":
            self.clear_worker(worker_id)

    # -- queries -----------------------------------------------------------------------------------
    def match(self, hashes: list[bytes], workers: list[str] | None = None) -> dict[str, WorkerMatch]:
        """For each worker (or those given), the leading blocks of `hashes` it holds, by best tier."""
        counts: dict[str, list[int]] = {}
        alive = set(workers) if workers is not None else None
        still: set[str] | None = None
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                break
            holders = node.holders if alive is None else {w: b for w, b in node.holders.items() if w in alive}
            still = set(holders) if still is None else still & holders.keys()
            if not still:
                break
            for w in still:
                bits = holders[w]
                c = counts.setdefault(w, [0, 0, 0])
                c[0 if bits & 1 else 1 if bits & 2 else 2] += 1
        names = workers if workers is not None else list(counts)
        return {w: WorkerMatch(*counts.get(w, (0, 0, 0))) for w in names}

    def tiers_of(self, worker_id: str, h: bytes) -> set[int]:
        node = self._nodes.get(h)
        bits = node.holders.get(worker_id, 0) if node is not None else 0
        return {t for t in TIERS if bits & _BIT[t]}

    def parent_of(self, h: bytes) -> bytes | None:
        node = self._nodes.get(h)
        return node.parent if node is not None else None

    def blocks_of(self, worker_id: str) -> list[bytes]:
        return list(self._by_worker.get(worker_id, ()))

    def put_entry(self, worker_id: str, h: bytes, parent: bytes | None, tiers: set[int]) -> None:
        """Set exactly which tiers a worker holds a block in (a snapshot entry)."""
        node = self._nodes.get(h)
        if node is not None and worker_id in node.holders:
            self._forget(worker_id, h, node)
        for t in tiers:
            self.store(worker_id, [h], parent, t)

    def check_integrity(self) -> None:
        for w, blocks in self._by_worker.items():
            for h in blocks:
                assert w in self._nodes[h].holders, f"{w} lists {h.hex()[:12]} but the node does not"
        for h, node in self._nodes.items():
            assert node.holders, f"node {h.hex()[:12]} has no holder"
            for w, bits in node.holders.items():
                assert bits and h in self._by_worker.get(w, ()), f"{w} holds {h.hex()[:12]} unlisted"
