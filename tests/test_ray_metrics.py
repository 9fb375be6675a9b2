"""kvstrata's Ray metrics and `kvstrata status`, against a two-worker cluster of a tiny model on the
session's local Ray: requests go through the real HTTP front end, the metrics are read back from the
Ray node's Prometheus endpoint, and `kvstrata status` reads the same cluster."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvstrata.cluster.ray_metrics import RouterMetrics, WorkerMetrics
from tests.test_cluster import tiny_model  # noqa: F401 - the module's tiny checkpoint fixture

httpx = pytest.importorskip("httpx")

NUM_GPU_BLOCKS = 12  # two 7-block prompts do not fit: the second demotes the first to DRAM
CPU_KV_BYTES = 64 * 8192  # 64 blocks of the tiny model (2 layers, K and V, 16 tokens, 4 heads of 8, fp32)
MAX_TOKENS = 4


# -- the plain classes ------------------------------------------------------------------------------
class _Recorder:
    """Stands in for `ray.util.metrics`: remembers each series' value (gauges, counters) or observations."""

    def __init__(self):
        self.values: dict[tuple, float] = {}
        self.observed: dict[tuple, list[float]] = {}
        rec = self

        class _Metric:
            def __init__(self, name, description="", *rest):
                self.name = name
                self.tag_keys = rest[-1]

            def _key(self, tags):
                assert set(tags) == set(self.tag_keys), (self.name, tags)
                return (self.name, *sorted(tags.items()))

        class Gauge(_Metric):
            def set(self, value, tags):
                rec.values[self._key(tags)] = value

        class Counter(_Metric):
            def inc(self, value, tags):
                assert value > 0  # Ray refuses anything else
                key = self._key(tags)
                rec.values[key] = rec.values.get(key, 0) + value

        class Histogram(_Metric):
            def observe(self, value, tags):
                rec.observed.setdefault(self._key(tags), []).append(value)

        self.Gauge, self.Counter, self.Histogram = Gauge, Counter, Histogram

    def get(self, name: str, **tags) -> float | None:
        return self.values.get((name, *sorted(tags.items())))


def _stats(used: int, queried: int, hit: int, tiers: dict | None = None) -> dict:
    s = {"num_used_blocks": used, "num_total_blocks": 20, "prefix_hit_rate": hit / queried if queried else 0.0,
         "prefix_cache_queries": queried, "prefix_cache_hits": hit}
    return {**s, "tiers": tiers} if tiers is not None else s


def test_worker_metrics_from_engine_stats_and_streamed_items():
    rec, now = _Recorder(), [100.0]
    m = WorkerMetrics("kvstrata-worker-3", metrics=rec, clock=lambda: now[0])
    w = "kvstrata-worker-3"
    m.refresh(_stats(5, 32, 16), num_running=2, num_waiting=1)
    assert rec.get("kvstrata_kv_blocks_used", worker=w, tier="hbm") == 5
    assert rec.get("kvstrata_kv_blocks_total", worker=w, tier="hbm") == 20
    assert rec.get("kvstrata_kv_usage", worker=w, tier="hbm") == 0.25
    assert rec.get("kvstrata_kv_usage", worker=w, tier="dram") is None  # not configured: not reported
    assert rec.get("kvstrata_queue_depth", worker=w, state="running") == 2
    assert rec.get("kvstrata_queue_depth", worker=w, state="waiting") == 1
    assert rec.get("kvstrata_prefix_hit_rate", worker=w) == 0.5
    assert rec.get("kvstrata_tokens_per_second", worker=w) is None  # no interval yet

    r = m.request(num_prompt_tokens=10)  # 0.25 s to the first token, then two more items 0.5 s apart
    now[0] += 0.25
    r.item(1)
    now[0] += 0.5
    r.item(0)  # an item without tokens (a usage-only one) is no output
    r.item(2)
    assert rec.observed[("kvstrata_ttft_seconds", ("worker", w))] == [0.25]
    assert rec.observed[("kvstrata_itl_seconds", ("worker", w))] == [0.5]
    assert rec.get("kvstrata_generation_tokens", worker=w) == 3
    assert rec.get("kvstrata_prompt_tokens", worker=w) == 10

    now[0] += 0.25  # 1 s after the first refresh, 3 tokens later
    m.refresh(_stats(7, 48, 20, {"dram": {"blocks": 3, "capacity_blocks": 12},
                                 "nvme": {"blocks": 9, "slots": 90}}), num_running=0, num_waiting=0)
    assert rec.get("kvstrata_tokens_per_second", worker=w) == pytest.approx(3.0)
    assert rec.get("kvstrata_prefix_cache_queries", worker=w) == 48  # counters carry the engine's totals
    assert rec.get("kvstrata_prefix_cache_hits", worker=w) == 20
    assert rec.get("kvstrata_kv_usage", worker=w, tier="dram") == 0.25
    assert rec.get("kvstrata_kv_blocks_total", worker=w, tier="nvme") == 90
    assert rec.get("kvstrata_kv_usage", worker=w, tier="nvme") == pytest.approx(0.1)
    now[0] += 1.0  # the engine's counts restart (a new engine): the counters go on from there
    m.refresh(_stats(0, 8, 8), num_running=0, num_waiting=0)
    assert rec.get("kvstrata_prefix_cache_queries", worker=w) == 56
    assert rec.get("kvstrata_prefix_cache_hits", worker=w) == 28
    assert rec.get("kvstrata_tokens_per_second", worker=w) == 0.0


def test_router_metrics_count_decisions_and_refresh_once_per_interval():
    rec, now = _Recorder(), [0.0]
    m = RouterMetrics("kvstrata-router-1", metrics=rec, clock=lambda: now[0], interval_s=1.0)
    for w in ("kvstrata-worker-0", "kvstrata-worker-1", "kvstrata-worker-0"):
        m.decision(w)
    assert rec.get("kvstrata_routing_decisions", router="kvstrata-router-1", worker="kvstrata-worker-0") == 2
    assert rec.get("kvstrata_routing_decisions", router="kvstrata-router-1", worker="kvstrata-worker-1") == 1
    assert m.due() and not m.due()
    now[0] = 0.9
    assert not m.due()
    now[0] = 1.0
    assert m.due()
    m.refresh({"index_blocks": {"kvstrata-worker-0": 6, "kvstrata-worker-1": 4}})
    assert rec.get("kvstrata_router_index_blocks", router="kvstrata-router-1") == 10


# -- `kvstrata status` without a cluster ------------------------------------------------------------
class _Handle:
    """An actor handle whose methods answer `results[method]` (an exception: the call fails)."""

    def __init__(self, **results):
        for method, result in results.items():
            setattr(self, method, type("Method", (), {"remote": staticmethod(lambda r=result: r)})())


def test_collect_status_groups_ranks_and_reports_what_did_not_answer():
    from kvstrata.cluster.status_cmd import collect_status

    stats = {**_stats(3, 64, 48, {"dram": {"blocks": 5, "capacity_blocks": 40}}), "num_total_blocks": 12}
    router = {"policy": "prefix_aware", "index_healthy": True, "index_blocks": {"kvstrata-worker-0": 4},
              "healthy_workers": ["kvstrata-worker-0"], "decisions": {"kvstrata-worker-0": 9}}
    handles = {"kvstrata-worker-0": _Handle(cache_stats=stats, load=(1, 2)),
               "kvstrata-worker-10": _Handle(cache_stats=RuntimeError("The actor died\ntraceback"), load=(0, 0)),
               "kvstrata-router-0": _Handle(stats=router)}
    named = [{"name": n, "namespace": "kvstrata"} for n in
             ("kvstrata-worker-10", "kvstrata-router-0", "kvstrata-worker-0-rank-1", "kvstrata-worker-0",
              "kvstrata-worker-ab12cd34-rank-1", "kvstrata-router-1", "someone-else")]

    def get_actor(name, namespace):
        if name not in handles:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return handles[name]

    def wait(ref):
        if isinstance(ref, Exception):
            raise ref
        return ref

    status = collect_status("10.0.0.1:6379", named, get_actor, wait)
    w0, w10 = status.workers
    assert (w0.name, w0.reachable, w0.ranks, w0.num_running, w0.num_waiting) == (
        "kvstrata-worker-0", True, ["kvstrata-worker-0-rank-1"], 1, 2)
    assert [(t.tier, t.used_blocks, t.total_blocks) for t in w0.tiers] == [("hbm", 3, 12), ("dram", 5, 40)]
    assert (w0.prefix_cache_hits, w0.prefix_cache_queries, w0.prefix_hit_rate) == (48, 64, 0.75)
    assert (w10.name, w10.reachable, w10.error) == ("kvstrata-worker-10", False, "RuntimeError: The actor died")
    r0, r1 = status.routers
    assert r0.healthy and r0.index_blocks == {"kvstrata-worker-0": 4} and r0.decisions == {"kvstrata-worker-0": 9}
    assert not r1.healthy and r1.error.startswith("ValueError: Failed to look up actor")
    assert status.stray_ranks == ["kvstrata-worker-ab12cd34-rank-1"]
    assert not status.ok
    report = status.to_json()
    assert report["workers"][0]["tiers"]["dram"] == {"used_blocks": 5, "total_blocks": 40, "usage": 0.125}
    assert report["routers"][0]["index_size_blocks"] == 4 and report["ok"] is False
    text = status.render()
    assert "kvstrata-worker-10  unreachable: RuntimeError: The actor died" in text
    assert "kvstrata-worker-0  running 1  waiting 2  prefix hits 75.0% (48/64 tokens)  tp ranks 2" in text
    with pytest.raises(ValueError, match="no kvstrata workers or routers in the Ray cluster at 10.0.0.1:6379"):
        collect_status("10.0.0.1:6379", named[4:5] + named[6:], get_actor, wait)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvstrata(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_status_with_no_ray_cluster_is_one_line_and_exit_2():
    address = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    r = _kvstrata("status", "--address", address)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"kvstrata status: error: no Ray cluster at {address}: Connection refused"
    assert r.stdout == "" and time.monotonic() - start < 60  # at once, not after Ray's minutes of retries


def test_status_with_no_kvstrata_actor_is_exit_2(ray_local, capsys):
    """Runs before this module's cluster starts (and every other suite stops its own)."""
    from kvstrata.cluster.cli import main

    address = ray_local.get_runtime_context().gcs_address
    assert main(["status", "--address", address]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip() == f"kvstrata status: error: no kvstrata workers or routers in the Ray cluster at {address}"


# -- a live cluster ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model):  # noqa: F811 - the imported fixture
    from kvstrata.cluster.cluster_service import ClusterSpec, start_cluster
    from tests.servers import LiveServer

    spec = ClusterSpec(2, {"model": tiny_model, "num_gpu_blocks": NUM_GPU_BLOCKS, "dtype": "float32",
                           "cpu_kv_bytes": CPU_KV_BYTES})
    server = LiveServer(None, model_names=(tiny_model,), service=start_cluster(spec))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traffic(cluster, tiny_model):  # noqa: F811
    """Four 96-token prefixes, each asked twice with a fresh suffix: what the workers served."""
    rng = random.Random(7)
    groups = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(4)]
    served = {"requests": 0, "completion_tokens": 0, "prompt_tokens": 0, "by_worker": {}}
    for _ in range(2):
        for prefix in groups:
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(8)]
            r = httpx.post(cluster.base_url + "/v1/completions", timeout=60,
                           json={"model": tiny_model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            worker = r.headers["x-kvstrata-worker"]
            served["requests"] += 1
            served["completion_tokens"] += usage["completion_tokens"]
            served["prompt_tokens"] += usage["prompt_tokens"]
            served["by_worker"][worker] = served["by_worker"].get(worker, 0) + 1
            time.sleep(0.3)  # the prefill's KV events reach the router
    assert served["completion_tokens"] == 8 * MAX_TOKENS
    return served


def _metrics_url(ray) -> str:
    ports = [n.get("MetricsExportPort", 0) for n in ray.nodes() if n["Alive"]]
    if not ports or ports[0] <= 0:
        pytest.skip("this Ray has no metrics agent (the dashboard dependencies of ray[default] are not installed)")
    return f"http://127.0.0.1:{ports[0]}/metrics"


def _scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample on the endpoint: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _actor_worker_ids(ray, handles) -> dict[str, str]:
    """Ray's WorkerId label of each actor's process: the series of this module's cluster, not an earlier one's."""
    return {name: ray.get(h.__ray_call__.remote(lambda self: __import__("ray").get_runtime_context().get_worker_id()))
            for name, h in handles.items()}


def test_metrics_reach_the_ray_prometheus_endpoint(ray_local, cluster, traffic):
    url = _metrics_url(ray_local)
    service = cluster.service
    workers = _actor_worker_ids(ray_local, service.workers)
    router = _actor_worker_ids(ray_local, {"kvstrata-router-0": service.routers[0]})["kvstrata-router-0"]
    stats = cluster.run(service.cache_stats())
    dram_capacity = {w: s["tiers"]["dram"]["capacity_blocks"] for w, s in stats["workers"].items()}
    assert all(c == 64 for c in dram_capacity.values())
    index = sum(cluster.run(service.router_stats())[0]["index_blocks"].values())

    def mine(samples, name: str, **tags) -> list[tuple[dict[str, str], float]]:
        """The samples of this cluster's actors that carry these tags."""
        ids = set(workers.values()) | {router}
        return [(labels, v) for labels, v in samples.get(name, [])
                if labels.get("WorkerId") in ids and all(labels.get(k) == t for k, t in tags.items())]

    def total(samples, name: str, **tags) -> float:
        return sum(v for _, v in mine(samples, name, **tags))

    def complete(samples) -> bool:
        """Everything the traffic caused has been exported (Ray reports every few seconds)."""
        return (total(samples, "ray_kvstrata_generation_tokens_total") >= traffic["completion_tokens"]
                and total(samples, "ray_kvstrata_ttft_seconds_count") >= traffic["requests"]
                and total(samples, "ray_kvstrata_routing_decisions_total") >= traffic["requests"]
                and total(samples, "ray_kvstrata_prefix_cache_hits_total") > 0
                and total(samples, "ray_kvstrata_router_index_blocks") == index > 0
                and len(mine(samples, "ray_kvstrata_kv_blocks_total")) == 4)  # 2 workers x (hbm, dram)

    deadline = time.monotonic() + 90
    samples = _scrape(url)
    while not complete(samples) and time.monotonic() < deadline:
        time.sleep(1.0)
        samples = _scrape(url)
    names = sorted(n for n in samples if "kvstrata" in n)
    assert complete(samples), names

    for name, wid in workers.items():
        def one(metric: str, **tags) -> float:
            found = mine(samples, metric, worker=name, **tags)
            assert len(found) == 1 and found[0][0]["WorkerId"] == wid, (metric, tags, found)
            return found[0][1]

        assert one("ray_kvstrata_kv_blocks_total", tier="hbm") == NUM_GPU_BLOCKS
        assert one("ray_kvstrata_kv_blocks_total", tier="dram") == dram_capacity[name]
        assert not mine(samples, "ray_kvstrata_kv_blocks_total", worker=name, tier="nvme")  # not configured
        for tier in ("hbm", "dram"):
            used = one("ray_kvstrata_kv_blocks_used", tier=tier)
            assert 0 <= used <= one("ray_kvstrata_kv_blocks_total", tier=tier)
            assert 0.0 <= one("ray_kvstrata_kv_usage", tier=tier) <= 1.0
        assert one("ray_kvstrata_queue_depth", state="running") == 0  # idle again
        assert one("ray_kvstrata_queue_depth", state="waiting") == 0
        assert 0.0 <= one("ray_kvstrata_prefix_hit_rate") <= 1.0
        assert one("ray_kvstrata_tokens_per_second") >= 0.0
        served = traffic["by_worker"].get(name, 0)
        assert one("ray_kvstrata_generation_tokens_total") == served * MAX_TOKENS
        assert one("ray_kvstrata_ttft_seconds_count") == served
        assert one("ray_kvstrata_itl_seconds_count") == served * (MAX_TOKENS - 1)
        assert one("ray_kvstrata_prompt_tokens_total") == served * 104
        assert one("ray_kvstrata_prefix_cache_queries_total") >= one("ray_kvstrata_prefix_cache_hits_total")
        ttft_buckets = mine(samples, "ray_kvstrata_ttft_seconds_bucket", worker=name)
        assert {labels["le"] for labels, _ in ttft_buckets} >= {"0.005", "1.0", "60.0", "+Inf"}
        assert total(samples, "ray_kvstrata_routing_decisions_total", router="kvstrata-router-0",
                     worker=name) == served
    assert total(samples, "ray_kvstrata_prompt_tokens_total") == traffic["prompt_tokens"]
    # the second round hit what the first cached, in HBM or (demoted) DRAM, on whichever worker
    assert total(samples, "ray_kvstrata_prefix_cache_hits_total") >= 4 * 96
    assert total(samples, "ray_kvstrata_kv_blocks_used", tier="dram") > 0
    assert total(samples, "ray_kvstrata_router_index_blocks", router="kvstrata-router-0") == index


# -- `kvstrata status` on the live cluster ----------------------------------------------------------
def test_status_prints_the_cluster(ray_local, cluster, traffic, capsys):
    from kvstrata.cluster.cli import main

    address = ray_local.get_runtime_context().gcs_address
    assert main(["status", "--address", address, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stats = cluster.run(cluster.service.cache_stats())["workers"]
    assert report["ok"] is True
    assert [w["name"] for w in report["workers"]] == ["kvstrata-worker-0", "kvstrata-worker-1"]
    for w in report["workers"]:
        s = stats[w["name"]]
        assert w["reachable"] and w["ranks"] == []
        assert w["tiers"]["hbm"] == {"used_blocks": s["num_used_blocks"], "total_blocks": NUM_GPU_BLOCKS,
                                     "usage": s["num_used_blocks"] / NUM_GPU_BLOCKS}
        dram = w["tiers"]["dram"]
        assert (dram["used_blocks"], dram["total_blocks"]) == (s["tiers"]["dram"]["blocks"], 64)
        assert "nvme" not in w["tiers"]
        hits = (w["prefix_cache_hits"], w["prefix_cache_queries"])
        assert hits == (s["prefix_cache_hits"], s["prefix_cache_queries"])
        assert (w["num_running"], w["num_waiting"]) == (0, 0)
    assert sum(w["prefix_cache_hits"] for w in report["workers"]) >= 4 * 96
    [router] = report["routers"]
    expected = cluster.run(cluster.service.router_stats())[0]
    assert router["name"] == "kvstrata-router-0" and router["healthy"] is True
    assert router["index_blocks"] == expected["index_blocks"] and router["index_size_blocks"] > 0
    assert sum(router["decisions"].values()) == traffic["requests"]

    assert main(["status", "--address", address]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"kvstrata cluster at {address}: 2 worker(s), 1 router(s)")
    lines = text.splitlines()
    for w in report["workers"]:
        row = next(i for i, line in enumerate(lines) if line.strip().startswith(w["name"] + " "))
        hits = f"({w['prefix_cache_hits']}/{w['prefix_cache_queries']} tokens)"
        assert hits in lines[row]
        assert lines[row + 1].split()[:4] == ["hbm", str(w["tiers"]["hbm"]["used_blocks"]), "/", str(NUM_GPU_BLOCKS)]
        assert lines[row + 2].split()[:4] == ["dram", str(w["tiers"]["dram"]["used_blocks"]), "/", "64"]
    assert f"kvstrata-router-0  healthy  index {router['index_size_blocks']} blocks" in text


def test_status_subprocess_joins_the_cluster(ray_local, cluster, traffic):
    """As an operator runs it: another process joins the Ray cluster and finds the actors by name."""
    r = _kvstrata("status", "--address", ray_local.get_runtime_context().gcs_address, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert [w["name"] for w in report["workers"]] == ["kvstrata-worker-0", "kvstrata-worker-1"]
    assert report["routers"][0]["healthy"] and sum(report["routers"][0]["decisions"].values()) == traffic["requests"]
