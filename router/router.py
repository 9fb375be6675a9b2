"""The router: for each request, the prompt's block hashes, each worker's share of them in the prefix
index, and each worker's load, weighed by a placement policy.

A plain class; `kvstrata.cluster.router_actor` puts it in a Ray actor. Loads are what this router
itself has sent and not yet seen finish, refreshed with the workers' own counts every few hundred ms.
When the index is unhealthy (Redis down), matches are empty and the policy places by load alone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, Protocol

from kvstrata.router.index import WorkerMatch
from kvstrata.router.placement import Decision, Policy, PrefixMatch, RoutingRequest, WorkerLoad
from kvstrata.worker.block_hash import HashContext, hash_blocks

log = logging.getLogger(__name__)


class IndexSource(Protocol):
    healthy: bool

    def match(self, hashes: list[bytes], workers: list[str] | None = None) -> dict[str, WorkerMatch]: ...


class Router:
    def __init__(self, workers: list[str], index: IndexSource, policy: Policy, model_id: str, block_size: int = 16,
                 kv_dtype: str = "auto"):
        if not workers:
            raise ValueError("a router needs at least one worker")
        self.workers = list(workers)
        self.index = index
        self.policy = policy
        self.model_id = model_id
        self.block_size = block_size
        self.kv_dtype = kv_dtype  # the workers' KV format: part of every block hash
        self._roots: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._loads = {w: WorkerLoad(w, 0, 0, 0) for w in workers}
        self._mine: dict[str, dict[str, int]] = {w: {} for w in workers}  # request id -> prefill tokens owed
        self.decisions: dict[str, int] = {w: 0 for w in workers}

    def hashes(self, prompt_token_ids: list[int], cache_salt: str) -> list[bytes]:
        """The request's cacheable full blocks, hashed as its worker will (the last token is always computed)."""
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = HashContext(model_id=self.model_id, cache_salt=cache_salt,
                                                                kv_dtype=self.kv_dtype).root()
        n = (len(prompt_token_ids) - 1) // self.block_size
        return hash_blocks(root, prompt_token_ids[:n * self.block_size], self.block_size)

    def route(self, request_id: str, prompt_token_ids: list[int], cache_salt: str = "", tenant: str = "") -> Decision:
        hashes = self.hashes(prompt_token_ids, cache_salt)
        bs = self.block_size
        matches: dict[str, PrefixMatch] = {}
        if self.index.healthy and hashes:
            for w, m in self.index.match(hashes, self.workers).items():
                matches[w] = PrefixMatch(m.hbm_blocks * bs, m.dram_blocks * bs, m.nvme_blocks * bs)
        with self._lock:
            loads = [self._load(w) for w in self.workers]
            request = RoutingRequest(len(prompt_token_ids), tenant, tuple(hashes), bs)
            decision = self.policy.choose(request, loads, matches)
            w = decision.worker_id
            m = matches.get(w, PrefixMatch())
            self._mine[w][request_id] = max(0, len(prompt_token_ids) - m.hbm_tokens - m.dram_tokens - m.nvme_tokens)
            self.decisions[w] += 1
        log.debug("request %s -> %s: %s", request_id, w, decision.reason)
        return decision

    def first_output(self, worker_id: str, request_id: str) -> None:
        """The request's prefill is done: it no longer owes prefill tokens."""
        with self._lock:
            if request_id in self._mine.get(worker_id, {}):
                self._mine[worker_id][request_id] = 0

    def done(self, worker_id: str, request_id: str) -> None:
        with self._lock:
            if self._mine.get(worker_id, {}).pop(request_id, None) is not None:
                # the last reported count still has it: take it off until the next report
                r = self._loads[worker_id]
                self._loads[worker_id] = replace(r, num_running=max(0, r.num_running - 1))

    def update_load(self, worker_id: str, num_running: int, num_waiting: int, healthy: bool = True) -> None:
        """The worker's own counts (which include other routers' requests)."""
        with self._lock:
            if worker_id in self._loads:
                self._loads[worker_id] = WorkerLoad(worker_id, num_running, num_waiting, 0, healthy)

    def _load(self, w: str) -> WorkerLoad:
        """The worker's reported load, raised to what this router alone has in flight there."""
        reported = self._loads[w]
        mine = self._mine[w]
        in_flight = len(mine)
        return replace(reported, num_running=max(reported.num_running, in_flight - reported.num_waiting),
                       pending_prefill_tokens=sum(mine.values()))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.policy.name, "index_healthy": self.index.healthy,
                    "index_workers": len(getattr(self.index, "incarnations", ())),
                    "incarnations": dict(getattr(self.index, "incarnations", {})),
                    "index_blocks": {w: self.index.index.num_blocks(w) for w in self.workers},
                    "healthy_workers": [w for w in self.workers if self._loads[w].healthy],
                    "decisions": dict(self.decisions),
                    "in_flight": {w: len(m) for w, m in self._mine.items()}}
