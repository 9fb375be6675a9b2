"""kvstrata's metrics on Ray (`ray.util.metrics`): the Ray dashboard and each node's Prometheus endpoint
show them, with Ray's prefix (`ray_kvstrata_kv_usage`, counters ending in `_total`).

A worker's gauges and cache counters come from its engine's `cache_stats()`, read by a thread of the
worker actor every second or so (never by the step loop); its latency histograms and token counters
are fed per request where the actor streams items. A router counts its decisions and reports its
index size. Ray counters only go up, so the engine's cumulative counts are turned into increments.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

TIERS = ("hbm", "dram", "nvme")
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
REFRESH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class TierUsage:
    tier: str  # hbm | dram | nvme
    used_blocks: int
    total_blocks: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


def tier_usage(stats: dict[str, Any]) -> list[TierUsage]:
    """Blocks used and held per configured tier, from an engine's `cache_stats()`: HBM blocks in use
    by requests, and the blocks the DRAM and NVMe tiers hold out of their capacity."""
    out = [TierUsage("hbm", stats["num_used_blocks"], stats["num_total_blocks"])]
    tiers = stats.get("tiers") or {}
    dram = tiers.get("dram")
    if dram is not None:
        out.append(TierUsage("dram", dram["blocks"], dram["capacity_blocks"]))
    nvme = tiers.get("nvme")
    if nvme is not None:
        out.append(TierUsage("nvme", nvme["blocks"], nvme["slots"]))
    return out


def _ray_metrics():
    from ray.util import metrics

    return metrics


class _Cumulative:
    """A Ray counter fed from a count that only grows, except when its source restarts from zero."""

    def __init__(self, counter, tags: dict[str, str]):
        self.counter = counter
        self.tags = tags
        self.last = 0

    def set(self, total: int) -> None:
        delta = total - self.last if total >= self.last else total
        self.last = total
        if delta > 0:
            self.counter.inc(delta, tags=self.tags)


class WorkerMetrics:
    """The Ray metrics of one worker, tagged worker=<its actor name>. `metrics` (default
    `ray.util.metrics`) and `clock` are injectable."""

    def __init__(self, worker_id: str, metrics=None, clock: Callable[[], float] = time.monotonic):
        m = metrics or _ray_metrics()
        self.worker_id = worker_id
        self.clock = clock
        self.tags = {"worker": worker_id}
        w, wt = ("worker",), ("worker", "tier")
        self.blocks_used = m.Gauge("kvstrata_kv_blocks_used", "KV blocks in use (HBM) or held (DRAM, NVMe).", wt)
        self.blocks_total = m.Gauge("kvstrata_kv_blocks_total", "KV blocks the tier can hold.", wt)
        self.usage = m.Gauge("kvstrata_kv_usage", "Fraction of the tier's KV blocks used, 0..1.", wt)
        self.hit_rate = m.Gauge("kvstrata_prefix_hit_rate", "Prompt tokens found in the prefix cache (any tier) "
                                "over those looked up, since the worker started.", w)
        self.queue = m.Gauge("kvstrata_queue_depth", "Requests waiting for admission or running.", ("worker", "state"))
        self.tokens_per_s = m.Gauge("kvstrata_tokens_per_second", "Tokens generated per second over the last "
                                    "refresh interval.", w)
        self.queries = _Cumulative(m.Counter("kvstrata_prefix_cache_queries", "Prompt tokens looked up in the "
                                             "prefix cache.", w), self.tags)
        self.hits = _Cumulative(m.Counter("kvstrata_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                          "(any tier).", w), self.tags)
        self.generation_tokens = m.Counter("kvstrata_generation_tokens", "Tokens generated.", w)
        self.prompt_tokens = m.Counter("kvstrata_prompt_tokens", "Prompt tokens of requests that started "
                                       "generating.", w)
        self.ttft = m.Histogram("kvstrata_ttft_seconds", "Time from the request reaching the worker to its first "
                                "token.", TTFT_BUCKETS, w)
        self.itl = m.Histogram("kvstrata_itl_seconds", "Time between successive streamed outputs of a request.",
                               ITL_BUCKETS, w)
        self._lock = threading.Lock()
        self._num_generated = 0  # since the worker started
        self._rate_mark: tuple[float, int] | None = None  # (time, tokens generated) at the last refresh

    # -- per request (the actor's event loop) ------------------------------------------------------
    def request(self, num_prompt_tokens: int) -> RequestLatency:
        return RequestLatency(self, num_prompt_tokens)

    def _generated(self, num_tokens: int) -> None:
        with self._lock:
            self._num_generated += num_tokens
        self.generation_tokens.inc(num_tokens, tags=self.tags)

    # -- periodic (the refresh thread) -------------------------------------------------------------
    def refresh(self, stats: dict[str, Any], num_running: int, num_waiting: int) -> None:
        """Set the gauges and counters from the engine's `cache_stats()` and the worker's queue."""
        for t in tier_usage(stats):
            tags = {"worker": self.worker_id, "tier": t.tier}
            self.blocks_used.set(t.used_blocks, tags=tags)
            self.blocks_total.set(t.total_blocks, tags=tags)
            self.usage.set(t.usage, tags=tags)
        self.hit_rate.set(stats["prefix_hit_rate"], tags=self.tags)
        self.queries.set(stats["prefix_cache_queries"])
        self.hits.set(stats["prefix_cache_hits"])
        self.queue.set(num_waiting, tags={"worker": self.worker_id, "state": "waiting"})
        self.queue.set(num_running, tags={"worker": self.worker_id, "state": "running"})
        now = self.clock()
        with self._lock:
            generated = self._num_generated
        if self._rate_mark is not None and now > self._rate_mark[0]:
            self.tokens_per_s.set((generated - self._rate_mark[1]) / (now - self._rate_mark[0]), tags=self.tags)
        self._rate_mark = (now, generated)


class RequestLatency:
    """TTFT and inter-token latency of one request, observed as its items are streamed."""

    def __init__(self, metrics: WorkerMetrics, num_prompt_tokens: int):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start = metrics.clock()
        self.last: float | None = None

    def item(self, num_tokens: int) -> None:
        """An item with num_tokens new tokens is about to be streamed; items without tokens do not count."""
        if not num_tokens:
            return
        m = self.metrics
        now = m.clock()
        if self.last is None:
            m.ttft.observe(now - self.start, tags=m.tags)
            if self.num_prompt_tokens:
                m.prompt_tokens.inc(self.num_prompt_tokens, tags=m.tags)
        else:
            m.itl.observe(now - self.last, tags=m.tags)
        self.last = now
        m._generated(num_tokens)


class RouterMetrics:
    """The Ray metrics of one router, tagged router=<its actor name>."""

    def __init__(self, router_id: str, metrics=None, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = REFRESH_INTERVAL_S):
        m = metrics or _ray_metrics()
        self.router_id = router_id
        self.clock = clock
        self.interval_s = interval_s
        self.tags = {"router": router_id}
        self.decisions = m.Counter("kvstrata_routing_decisions", "Requests this router placed, by worker.",
                                   ("router", "worker"))
        self.index_blocks = m.Gauge("kvstrata_router_index_blocks", "Blocks in this router's prefix index, "
                                    "summed over the workers.", ("router",))
        self._last_refresh: float | None = None

    def decision(self, worker_id: str) -> None:
        self.decisions.inc(1, tags={"router": self.router_id, "worker": worker_id})

    def due(self) -> bool:
        """True at most once per interval: time to `refresh`."""
        now = self.clock()
        if self._last_refresh is not None and now - self._last_refresh < self.interval_s:
            return False
        self._last_refresh = now
        return True

    def refresh(self, router_stats: dict[str, Any]) -> None:
        self.index_blocks.set(sum(router_stats["index_blocks"].values()), tags=self.tags)
