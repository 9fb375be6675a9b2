"""The shared prefix index in Redis: workers publish KV events, routers mirror them.

Keys, under a per-deployment prefix P:

    P:workers          hash   worker id -> WorkerRecord (its current incarnation, hash-spec version)
    P:alive:<worker>   string the live incarnation, with a TTL the worker keeps refreshing
    P:blocks:<worker>  hash   block hash -> IndexEntry (every tier the worker holds it in, its parent)
    P:events           stream one KVEventBatch per entry (field "b"), trimmed to about max_stream_len

A publisher keeps its worker's own holdings in memory, and each publish is one MULTI: the changed
entries of P:blocks:<worker>, the batch on P:events and the heartbeat. So the hash is always a
snapshot and the stream says what changed since. A follower (one per router; index_follower.py)
loads a snapshot (the stream's last id, then the workers and their hashes), then reads the stream
from that id; replaying a batch already in the snapshot is harmless, because stored and removed are
idempotent.

Stale data: batches of an incarnation other than the registered one are dropped; a gap in a
worker's sequence numbers, or a `cleared` event, reloads that worker's hash; a worker whose heartbeat
expired is forgotten. When Redis is unreachable the publisher keeps recording and the follower
reports itself unhealthy (routing falls back to load); on reconnect the publisher rewrites its whole
hash and the follower reloads everything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

from kvstrata.protos.v1 import kv_events_pb2 as ev
from kvstrata.router.background import BackgroundLoop
from kvstrata.router.events import EventRecorder, encode_batch, encode_entry
from kvstrata.router.index import PrefixIndex
from kvstrata.worker.block_hash import HASH_SPEC_VERSION

log = logging.getLogger(__name__)

STREAM_FIELD = b"b"


@dataclass(frozen=True)
class RedisSettings:
    """Where the index lives and how to reach it. TLS: a rediss:// URL (and tls_ca for a private CA)."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvstrata"
    username: str | None = None
    password: str | None = None  # AUTH; or in the URL
    tls_ca: str | None = None
    socket_timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    max_connections: int = 8

    def __post_init__(self):
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"redis prefix must be a non-empty word, got {self.prefix!r}")

    def client(self):
        import redis

        kwargs = dict(socket_timeout=self.socket_timeout_s, socket_connect_timeout=self.connect_timeout_s,
                      max_connections=self.max_connections, health_check_interval=5)
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.url.startswith("rediss://") and self.tls_ca:
            kwargs["ssl_ca_certs"] = self.tls_ca
        return redis.Redis(connection_pool=redis.ConnectionPool.from_url(self.url, **kwargs))

    # -- keys ----------------------------------------------------------------------------------
    @property
    def events_key(self) -> str:
        return f"{self.prefix}:events"

    @property
    def workers_key(self) -> str:
        return f"{self.prefix}:workers"

    def blocks_key(self, worker_id: str) -> str:
        return f"{self.prefix}:blocks:{worker_id}"

    def alive_key(self, worker_id: str) -> str:
        return f"{self.prefix}:alive:{worker_id}"


def redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


class Backoff:
    def __init__(self, first: float = 0.2, most: float = 2.0):
        self.first, self.most, self.delay = first, most, first

    def failed(self) -> float:
        delay, self.delay = self.delay, min(self.most, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first


# -- the worker side --------------------------------------------------------------------------------

class KVEventPublisher(BackgroundLoop):
    """Publishes one worker's recorded events to Redis from a background thread."""

    def __init__(self, settings: RedisSettings, worker_id: str, recorder: EventRecorder,
                 incarnation: str | None = None, interval_s: float = 0.05, heartbeat_ttl_s: float = 10.0,
                 max_stream_len: int = 100_000):
        if not worker_id or ":" in worker_id:
            raise ValueError(f"worker_id must be non-empty without ':', got {worker_id!r}")
        self.settings = settings
        self.worker_id = worker_id
        self.incarnation = incarnation or uuid.uuid4().hex
        self.recorder = recorder
        self.interval_s = interval_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_stream_len = max_stream_len
        self.mine = PrefixIndex()  # what this worker holds, as its events say
        self._dirty: dict[bytes, None] = {}
        self._pending: list[ev.KVEvent] = []
        self._sequence = 0
        self._synced = False  # P:blocks:<worker> matches `mine` (else rewrite it whole)
        self._client = settings.client()
        self._wake = threading.Event()
        self._last_heartbeat = 0.0
        self._loops = 0  # passes of the thread, for flush
        self.num_batches = self.num_failures = 0
        self._init_loop(f"kvstrata-kv-events-{worker_id}")

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    @property
    def connected(self) -> bool:
        return self._synced

    def flush(self, timeout: float = 5.0) -> bool:
        """Publish what is recorded now; True once it is in Redis (False: Redis is unreachable)."""
        deadline = time.monotonic() + timeout
        start = self._loops
        while time.monotonic() < deadline:
            self._wake.set()
            # two whole passes of the thread after the call: the second began after everything recorded
            if self._loops >= start + 2 and self._synced and not self._pending and not self._dirty:
                return True
            time.sleep(0.01)
        return False

    def close(self, unregister: bool = True) -> None:
        """Stop; with unregister, remove this worker from the index (a clean shutdown)."""
        self._stop_loop(self._wake)
        if unregister:
            s = self.settings
            try:
                pipe = self._client.pipeline(transaction=True)
                pipe.hdel(s.workers_key, self.worker_id)
                pipe.delete(s.blocks_key(self.worker_id), s.alive_key(self.worker_id))
                pipe.execute()
            except redis_errors():
                pass
        self._client.close()

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            self._collect()
            try:
                if not self._synced:
                    self._resync()
                    backoff.reset()
                if self._pending or self._dirty or time.monotonic() - self._last_heartbeat > self.heartbeat_ttl_s / 3:
                    self._publish()
            except redis_errors() as e:
                self.num_failures += 1
                if self._synced:
                    log.warning("KV event publisher for %s lost Redis (%s); will resync", self.worker_id, e)
                self._synced = False
                self._loops += 1
                self._stop.wait(backoff.failed())
                continue
            self._loops += 1
            self._wake.wait(self.interval_s)
            self._wake.clear()
        self._collect()
        try:
            if self._synced and (self._pending or self._dirty):
                self._publish()
        except redis_errors():
            pass

    def _collect(self) -> None:
        for event in self.recorder.drain():
            self.mine.apply(self.worker_id, event)
            kind = event.WhichOneof("kind")
            if kind == "cleared":  # the engine dropped everything: rewrite (empty) the hash whole
                self._dirty.clear()
                self._pending.clear()
                self._synced = False
                continue
            self._pending.append(event)
            for h in getattr(event, kind).block_hashes:
                self._dirty[h] = None

    def _entry(self, h: bytes) -> bytes | None:
        tiers = self.mine.tiers_of(self.worker_id, h)
        return encode_entry(tiers, self.mine.parent_of(h)) if tiers else None

    def _resync(self) -> None:
        """Register this incarnation and rewrite the worker's whole hash from `mine`."""
        s, w = self.settings, self.worker_id
        record = ev.WorkerRecord(encoding_version=1, worker_id=w, incarnation=self.incarnation,
                                 hash_spec_version=HASH_SPEC_VERSION, started_at=time.time())
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(s.workers_key, w, record.SerializeToString())
        pipe.delete(s.blocks_key(w))
        blocks = self.mine.blocks_of(w)
        for i in range(0, len(blocks), 1000):
            pipe.hset(s.blocks_key(w), mapping={h: self._entry(h) for h in blocks[i:i + 1000]})
        self._sequence += 1
        pipe.xadd(s.events_key, {STREAM_FIELD: encode_batch(w, self.incarnation, self._sequence,
                                                            [ev.KVEvent(cleared=True)])},
                  maxlen=self.max_stream_len, approximate=True)
        pipe.set(s.alive_key(w), self.incarnation, px=int(self.heartbeat_ttl_s * 1000))
        pipe.execute()
        self._pending.clear()
        self._dirty.clear()
        self._synced = True
        self._last_heartbeat = time.monotonic()
        self.num_batches += 1

    def _publish(self) -> None:
        s, w = self.settings, self.worker_id
        pipe = self._client.pipeline(transaction=True)
        pipe.hexists(s.workers_key, w)  # gone if Redis restarted empty while this worker was quiet
        for h in self._dirty:
            entry = self._entry(h)
            if entry is None:
                pipe.hdel(s.blocks_key(w), h)
            else:
                pipe.hset(s.blocks_key(w), h, entry)
        if self._pending:
            self._sequence += 1
            pipe.xadd(s.events_key, {STREAM_FIELD: encode_batch(w, self.incarnation, self._sequence, self._pending)},
                      maxlen=self.max_stream_len, approximate=True)
        pipe.set(s.alive_key(w), self.incarnation, px=int(self.heartbeat_ttl_s * 1000))
        registered = pipe.execute()[0]
        self._last_heartbeat = time.monotonic()
        if self._pending:
            self.num_batches += 1
        self._pending = []
        self._dirty = {}
        if not registered:  # Redis lost this worker's state: rewrite it whole on the next pass
            log.warning("KV event publisher for %s: Redis forgot this worker; resyncing", w)
            self._synced = False
