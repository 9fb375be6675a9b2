"""The shared prefix index: KV events and index entries as versioned protobuf, the router's radix
mirror, and publishers and followers on a real redis-server (restarts, stale incarnations, dead
workers, AUTH, key prefixes, and Redis killed and restarted mid-run)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvstrata.protos.v1 import kv_events_pb2 as ev
from kvstrata.router.events import EventRecorder, decode_batch, decode_entry, encode_batch, encode_entry
from kvstrata.router.index import DRAM, HBM, NVME, PrefixIndex, WorkerMatch

redis = pytest.importorskip("redis")
H = [bytes([i]) * 32 for i in range(12)]  # a chain h0, h1, ...


# -- encoding ---------------------------------------------------------------------------------------
def test_recorder_merges_a_chain_and_batches_round_trip():
    rec = EventRecorder()
    rec.stored(H[:2], None, HBM)
    rec.stored(H[2:4], H[1], HBM)  # continues the chain: merged
    rec.stored([H[9]], None, HBM)  # another chain: a new event
    rec.moved(H[2:4], HBM, DRAM)
    rec.removed([H[9]], HBM)
    events = rec.drain()
    assert [e.WhichOneof("kind") for e in events] == ["stored", "stored", "tier_changed", "removed"]
    assert list(events[0].stored.block_hashes) == H[:4] and len(rec) == 0
    batch = decode_batch(encode_batch("w0", "inc-1", 7, events, timestamp=1.5))
    assert (batch.worker_id, batch.incarnation, batch.sequence, batch.timestamp) == ("w0", "inc-1", 7, 1.5)
    assert list(batch.events) == events and batch.hash_spec_version >= 1


def test_unknown_versions_and_garbage_are_refused():
    with pytest.raises(ValueError, match="encoding version"):
        decode_batch(ev.KVEventBatch(encoding_version=99).SerializeToString())
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(b"\xff\xff\xff")
    entry = decode_entry(encode_entry({NVME, HBM}, H[0]))
    assert list(entry.tiers) == [HBM, NVME] and entry.parent_hash == H[0]
    with pytest.raises(ValueError, match="encoding version"):
        decode_entry(ev.IndexEntry(encoding_version=2).SerializeToString())


def test_cleared_drops_what_came_before():
    rec = EventRecorder()
    rec.stored(H[:3], None, HBM)
    rec.cleared()
    assert [e.WhichOneof("kind") for e in rec.drain()] == ["cleared"]


# -- the radix mirror -------------------------------------------------------------------------------
def test_match_counts_leading_blocks_by_best_tier():
    idx = PrefixIndex()
    idx.store("a", H[:4], None, HBM)
    idx.store("b", H[:2], None, DRAM)
    idx.store("b", H[2:3], H[1], NVME)
    idx.store("b", H[:1], None, NVME)  # NVMe also keeps a copy of block 0: DRAM is still the best
    idx.store("c", H[1:3], H[0], HBM)  # no block 0: no prefix at all
    got = idx.match(H[:5])
    assert got == {"a": WorkerMatch(4, 0, 0), "b": WorkerMatch(0, 2, 1)}
    assert idx.match(H[:5], ["c", "a"]) == {"c": WorkerMatch(), "a": WorkerMatch(4, 0, 0)}
    idx.move("a", H[2:4], HBM, DRAM)
    idx.remove("b", H[1:2], DRAM)  # a hole ends b's prefix
    assert idx.match(H[:5]) == {"a": WorkerMatch(2, 2, 0), "b": WorkerMatch(0, 1, 0)}
    assert idx.clear_worker("a") == 4 and idx.workers() == ["b", "c"]
    idx.check_integrity()


# -- Redis ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    """A redis-server of the test's own on a free loopback port; stop and start it again at will."""

    def __init__(self, directory: Path, password: str | None = None):
        self.port = _free_port()
        self.directory = directory
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisProc(tmp_path)
    yield server
    server.stop()


def _settings(server: RedisProc, prefix: str = "test", **kw):
    from kvstrata.router.redis_index import RedisSettings

    return RedisSettings(url=server.url, prefix=prefix, **kw)


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _publisher(settings, worker_id: str, **kw):
    from kvstrata.router.redis_index import KVEventPublisher

    rec = EventRecorder()
    return rec, KVEventPublisher(settings, worker_id, rec, interval_s=0.01, **kw).start()


def _follower(settings, **kw):
    from kvstrata.router.index_follower import IndexFollower

    f = IndexFollower(settings, block_ms=50, liveness_interval_s=0.1, **kw).start()
    assert f.wait_synced()
    return f


def test_two_routers_see_the_same_index_and_a_restarted_one_rebuilds(redis_server):
    s = _settings(redis_server)
    rec_a, pub_a = _publisher(s, "w0")
    rec_b, pub_b = _publisher(s, "w1")
    f1, f2 = _follower(s), _follower(s)
    try:
        rec_a.stored(H[:4], None, HBM)
        rec_b.stored(H[:2], None, HBM)
        rec_b.moved(H[:2], HBM, DRAM)
        assert pub_a.flush() and pub_b.flush()
        want = {"w0": WorkerMatch(4, 0, 0), "w1": WorkerMatch(0, 2, 0)}
        for f in (f1, f2):
            _wait(lambda f=f: f.match(H[:6]) == want)
        rec_a.removed(H[3:4], HBM)
        assert pub_a.flush()
        _wait(lambda: f2.match(H[:6])["w0"] == WorkerMatch(3, 0, 0))
        f1.close()
        f3 = _follower(s)  # a router restart: snapshot, then the stream
        assert f3.match(H[:6]) == f2.match(H[:6]) == {"w0": WorkerMatch(3, 0, 0), "w1": WorkerMatch(0, 2, 0)}
        f3.index.check_integrity()
        f3.close()
    finally:
        for x in (pub_a, pub_b, f2):
            x.close()


def test_a_restarted_worker_replaces_its_old_incarnation(redis_server):
    s = _settings(redis_server)
    rec, pub = _publisher(s, "w0", incarnation="old")
    f = _follower(s)
    try:
        rec.stored(H[:3], None, HBM)
        assert pub.flush()
        _wait(lambda: f.match(H[:3]).get("w0") == WorkerMatch(3, 0, 0))
        pub.close(unregister=False)  # the process dies without a word
        rec2, pub2 = _publisher(s, "w0", incarnation="new")
        rec2.stored(H[5:7], None, HBM)
        assert pub2.flush()
        _wait(lambda: f.match(H[5:7]).get("w0") == WorkerMatch(2, 0, 0))
        assert f.match(H[:3]).get("w0", WorkerMatch()) == WorkerMatch()  # the old entries are gone
        # a late batch of the old incarnation is dropped
        before = f.counters.stale_batches
        client = redis.Redis(port=redis_server.port)
        client.xadd(s.events_key, {b"b": encode_batch("w0", "old", 99, [ev.KVEvent(
            stored=ev.BlockStored(block_hashes=H[:3], tier=HBM))])})
        _wait(lambda: f.counters.stale_batches > before)
        assert f.match(H[:3]).get("w0", WorkerMatch()) == WorkerMatch()
        pub2.close()
    finally:
        f.close()


def test_a_dead_workers_entries_disappear_when_its_heartbeat_expires(redis_server):
    s = _settings(redis_server)
    rec, pub = _publisher(s, "w0", heartbeat_ttl_s=0.5)
    f = _follower(s)
    try:
        rec.stored(H[:2], None, HBM)
        assert pub.flush()
        _wait(lambda: f.workers() == ["w0"] and f.match(H[:2])["w0"].num_blocks == 2)
        pub.close(unregister=False)  # no more heartbeats
        _wait(lambda: f.workers() == [], timeout=5)
        assert f.match(H[:2]) == {} and f.counters.dead_workers == 1
    finally:
        f.close()


def test_a_sequence_gap_reloads_the_worker(redis_server):
    s = _settings(redis_server)
    rec, pub = _publisher(s, "w0")
    f = _follower(s)
    try:
        rec.stored(H[:2], None, HBM)
        assert pub.flush()
        _wait(lambda: f.match(H[:2]).get("w0") == WorkerMatch(2, 0, 0))
        pub._sequence += 5  # as if batches were lost on the way
        rec.stored(H[2:3], H[1], HBM)
        assert pub.flush()
        _wait(lambda: f.counters.gaps == 1)
        assert f.match(H[:3])["w0"] == WorkerMatch(3, 0, 0)  # the reload read the hash, which has it all
    finally:
        pub.close()
        f.close()


def test_redis_killed_mid_run_then_back(redis_server):
    s = _settings(redis_server)
    rec, pub = _publisher(s, "w0")
    f = _follower(s)
    try:
        rec.stored(H[:2], None, HBM)
        assert pub.flush()
        _wait(lambda: f.match(H[:4]).get("w0") == WorkerMatch(2, 0, 0))
        redis_server.stop()
        _wait(lambda: not f.healthy and not pub.connected)
        rec.stored(H[2:4], H[1], HBM)  # recorded while Redis is down
        assert not pub.flush(timeout=0.3)
        redis_server.start()  # an empty Redis on the same port: everything must be rebuilt
        _wait(lambda: f.healthy and f.match(H[:4]).get("w0") == WorkerMatch(4, 0, 0), timeout=20)
        assert f.counters.failures > 0 and f.counters.resyncs >= 2
    finally:
        pub.close()
        f.close()


def test_auth_and_key_prefixes(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisProc(tmp_path, password="s3cret")
    try:
        good = _settings(server, password="s3cret")
        rec, pub = _publisher(good, "w0")
        rec.stored(H[:2], None, HBM)
        assert pub.flush()
        f = _follower(good)
        assert f.match(H[:2]) == {"w0": WorkerMatch(2, 0, 0)}
        other = _follower(_settings(server, prefix="other", password="s3cret"))
        assert other.match(H[:2]) == {}  # another deployment's prefix sees nothing
        from kvstrata.router.index_follower import IndexFollower

        denied = IndexFollower(_settings(server)).start()  # no password
        assert not denied.wait_synced(timeout=1.0) and denied.counters.failures > 0
        for x in (pub, f, other, denied):
            x.close()
    finally:
        server.stop()


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"url": "http://x"}, "redis url"),
    ({"prefix": "a b"}, "redis prefix"),
    ({"prefix": ""}, "redis prefix"),
])
def test_bad_settings_name_the_field(kwargs, needle):
    from kvstrata.router.redis_index import RedisSettings

    with pytest.raises(ValueError, match=needle):
        RedisSettings(**kwargs)


# -- the engine's events describe exactly what it holds ---------------------------------------------
def _truth(llm) -> dict[bytes, set[int]]:
    kv = llm.engine.kv
    held: dict[bytes, set[int]] = {h: {HBM} for h in kv.pool.prefix_cache.hash_to_block}
    tiers = kv.tiers
    for h in tiers.host.entries:
        held.setdefault(h, set()).add(DRAM)
    if tiers.nvme is not None:
        tiers.nvme.flush()
        for h in tiers.nvme.hashes():
            held.setdefault(h, set()).add(NVME)
    return held


def test_engine_events_mirror_every_tier(llm, tmp_path):
    import random

    from kvstrata import LLM, SamplingParams
    from kvstrata.worker.model_runner import ModelRunner

    bb = ModelRunner.kv_bytes_per_block(llm.engine.runner.model, 16)
    tiered = LLM("smollm2-135m", num_gpu_blocks=24, cpu_kv_bytes=20 * bb, nvme_kv_dir=str(tmp_path),
                 nvme_kv_bytes=400 * bb)
    rec = EventRecorder()
    tiered.engine.kv.attach_events(rec)
    mirror = PrefixIndex()
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(160)] for _ in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for round_ in range(2):  # evict to DRAM and NVMe, then promote back
            for p in prompts:
                tiered.generate([p], sp)
                for e in rec.drain():
                    mirror.apply("w", e)
                got = {h: mirror.tiers_of("w", h) for h in mirror.blocks_of("w")}
                assert got == _truth(tiered), f"round {round_}"
        assert tiered.cache_stats()["tiers"]["nvme"]["loaded_blocks"] > 0  # NVMe really served blocks
        tiered.reset_prefix_cache()
        for e in rec.drain():
            mirror.apply("w", e)
        assert mirror.blocks_of("w") == [] == list(_truth(tiered))
    finally:
        tiered.close()


def test_a_quiet_worker_notices_redis_came_back_empty(redis_server):
    s = _settings(redis_server)
    rec, pub = _publisher(s, "w0", heartbeat_ttl_s=0.6)
    f = _follower(s)
    try:
        rec.stored(H[:3], None, HBM)
        assert pub.flush()
        _wait(lambda: f.match(H[:3]).get("w0") == WorkerMatch(3, 0, 0))
        redis_server.stop()
        redis_server.start()  # back at once, empty; the publisher may never have seen an error
        _wait(lambda: f.healthy and f.match(H[:3]).get("w0") == WorkerMatch(3, 0, 0), timeout=20)
    finally:
        pub.close()
        f.close()


def test_pushed_index_replaces_an_old_incarnations_blocks():
    from kvstrata.router.push_index import PushedIndex

    idx = PushedIndex()
    idx.apply_batch(encode_batch("w0", "old", 1, [ev.KVEvent(stored=ev.BlockStored(block_hashes=H[:3], tier=HBM))]))
    assert idx.match(H[:3]) == {"w0": WorkerMatch(3, 0, 0)}
    idx.apply_batch(encode_batch("w0", "new", 1, [ev.KVEvent(stored=ev.BlockStored(block_hashes=H[5:6], tier=HBM))]))
    assert idx.match(H[:3]) == {} and idx.match(H[5:6]) == {"w0": WorkerMatch(1, 0, 0)}
    idx.apply_batch(encode_batch("w0", "new", 1, [ev.KVEvent(cleared=True)]))  # a replayed sequence number
    assert idx.stale_batches == 1 and idx.match(H[5:6]) == {"w0": WorkerMatch(1, 0, 0)}
