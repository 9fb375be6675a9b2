"""Prometheus metrics of one serving process, under vLLM's metric names where an equivalent exists so
that existing dashboards work.

Latency histograms are observed per request by `EngineService`; engine gauges and counters (KV
usage, prefix cache, queue lengths, preemptions) are read from the engine's `cache_stats()` at
scrape time. Each `ServingMetrics` has its own registry, so several servers can live in one process.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series: they double the output and no dashboard reads them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Engine state as of the last `ServingMetrics.update_engine` call."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission.", s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s["kv_usage"])
        yield gauge("vllm:gpu_cache_usage_perc", "Older name of vllm:kv_cache_usage_perc.", s["kv_usage"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_cache_hits"])
        yield counter("vllm:num_preemptions", "Requests preempted to free KV blocks.", s["num_preemptions"])
        yield gauge("kvstrata:kv_utilization", "Fraction of the slots in used KV blocks that hold tokens.",
                    s["kv_utilization"])
        yield gauge("kvstrata:kv_blocks_total", "KV blocks in the pool.", s["num_total_blocks"])
        yield gauge("kvstrata:kv_blocks_free", "KV blocks free (not used and not cached).", s["num_free_blocks"])
        yield gauge("kvstrata:kv_blocks_cached", "KV blocks holding a cached prefix.", s["num_cached_blocks"])
        yield counter("kvstrata:kv_block_evictions", "Cached blocks evicted to make room.", s["num_evictions"])
        yield counter("kvstrata:kv_evicted_tokens", "KV entries dropped by token eviction policies (lossy).",
                      s["num_evicted_tokens"])
        if "tiers" in s:
            yield from _tier_metrics(self.model_name, s["tiers"])
        if "workers" in s:
            yield from _worker_metrics(self.model_name, s["workers"], s.get("requests_by_worker", {}))


def _worker_metrics(model_name: str, workers: dict[str, dict[str, Any]], requests: dict[str, int]) -> Iterator[Metric]:
    """A cluster's requests and prefix-cache lookups by worker, labelled worker="kvstrata-worker-<i>"."""
    names = ["model_name", "worker"]
    fams = [
        (CounterMetricFamily("kvstrata:worker_requests", "Requests routed to the worker.", labels=names),
         lambda w, st: requests.get(w, 0)),
        (CounterMetricFamily("kvstrata:worker_prefix_cache_queries", "Prompt tokens the worker looked up in its "
                             "prefix cache.", labels=names), lambda w, st: st["prefix_cache_queries"]),
        (CounterMetricFamily("kvstrata:worker_prefix_cache_hits", "Prompt tokens the worker found in its prefix "
                             "cache (any tier).", labels=names), lambda w, st: st["prefix_cache_hits"]),
        (GaugeMetricFamily("kvstrata:worker_kv_cache_usage_perc", "Fraction of the worker's KV blocks in use.",
                           labels=names), lambda w, st: st["kv_usage"]),
    ]
    for family, value in fams:
        for w, st in sorted(workers.items()):
            family.add_metric([model_name, w], value(w, st))
        yield family


def _tier_metrics(model_name: str, tiers: dict[str, Any]) -> Iterator[Metric]:
    """Per-tier gauges and counters, labelled tier="dram" or "nvme"."""
    names = ["model_name", "tier"]
    families = {
        "blocks": GaugeMetricFamily("kvstrata:tier_blocks", "KV blocks held in the tier.", labels=names),
        "bytes": GaugeMetricFamily("kvstrata:tier_bytes", "Bytes of KV held in the tier.", labels=names),
        "capacity": GaugeMetricFamily("kvstrata:tier_capacity_bytes", "The tier's capacity.", labels=names),
        "up": CounterMetricFamily("kvstrata:tier_promotions", "Blocks brought up out of the tier "
                                  "(DRAM to the device; NVMe to DRAM).", labels=names),
        "down": CounterMetricFamily("kvstrata:tier_demotions", "Blocks moved down into the tier.", labels=names),
    }
    dram, nvme = tiers.get("dram"), tiers.get("nvme")
    rows = []
    if dram is not None:
        rows.append(("dram", dram["blocks"], dram["bytes"], dram["capacity_bytes"], dram["promoted_blocks"],
                     dram["demoted_blocks"]))
    if nvme is not None:
        rows.append(("nvme", nvme["blocks"], nvme["used_bytes"], nvme["capacity_bytes"], nvme["loaded_blocks"],
                     nvme["spilled_blocks"]))
    for tier, blocks, used, capacity, up, down in rows:
        for key, value in (("blocks", blocks), ("bytes", used), ("capacity", capacity), ("up", up), ("down", down)):
            families[key].add_metric([model_name, tier], value)
    yield from families.values()
    if dram is not None:
        usage = GaugeMetricFamily("vllm:cpu_cache_usage_perc", "Fraction of the DRAM tier in use.",
                                  labels=["model_name"])
        usage.add_metric([model_name], dram["bytes"] / dram["capacity_bytes"])
        yield usage
        for name, key, doc in (("kvstrata:swapped_out_blocks", "swapped_out_blocks", "Blocks swapped out to DRAM."),
                               ("kvstrata:swapped_in_blocks", "swapped_in_blocks", "Blocks swapped back in."),
                               ("kvstrata:swap_fallbacks", "swap_fallbacks",
                                "Preemptions recomputed because DRAM could not keep the blocks."),
                               ("kvstrata:swapped_out_bytes", "swapped_out_bytes", "Bytes swapped out to DRAM."),
                               ("kvstrata:swapped_in_bytes", "swapped_in_bytes", "Bytes swapped back in.")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model_name], dram[key])
            yield c
    yield from _transfer_metrics(model_name, dram, nvme)
    if nvme is not None:
        for name, key, doc in (("kvstrata:tier_checksum_failures", "checksum_failures",
                                "Tier files that failed verification (read as misses)."),
                               ("kvstrata:tier_hits", "hits", "Blocks asked of the tier and found there."),
                               ("kvstrata:tier_misses", "misses", "Blocks asked of the tier and not found.")):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric([model_name, "nvme"], nvme[key])
            yield c


def _transfer_metrics(model_name: str, dram: dict | None, nvme: dict | None) -> Iterator[Metric]:
    """Bytes each tier moved and the seconds they took, by direction: rate(bytes) / rate(seconds) is
    the transfer rate over any window (DRAM: time in the copies; NVMe: wall time with IO in flight)."""
    labels = ["model_name", "tier", "direction"]
    moved = CounterMetricFamily("kvstrata:tier_transfer_bytes", "Bytes moved into (down) or out of (up) "
                                "the tier.", labels=labels)
    took = CounterMetricFamily("kvstrata:tier_transfer_seconds", "Seconds those transfers took.", labels=labels)
    rows = []
    if dram is not None:
        rows += [("dram", "down", dram["demote_bytes"], dram["demote_seconds"]),
                 ("dram", "up", dram["promote_bytes"], dram["promote_seconds"])]
    if nvme is not None:
        rows += [("nvme", "down", nvme["bytes_written"], nvme["write_busy_seconds"]),
                 ("nvme", "up", nvme["bytes_read"], nvme["read_busy_seconds"])]
    for tier, direction, num_bytes, seconds in rows:
        moved.add_metric([model_name, tier, direction], num_bytes)
        took.add_metric([model_name, tier, direction], seconds)
    if rows:
        yield moved
        yield took


class ServingMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between successive output tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._rejected = Counter("kvstrata:requests_rejected", "Requests refused before admission, by reason "
                                 "(invalid, overloaded, draining, unauthenticated).",
                                 ["model_name", "reason"], registry=r)
        self._engine = _EngineCollector(model_name)
        r.register(self._engine)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def update_engine(self, cache_stats: dict[str, Any]) -> None:
        self._engine.stats = dict(cache_stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
