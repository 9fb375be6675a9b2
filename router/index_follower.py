"""A router's mirror of the shared prefix index in Redis (the keys and the publisher: redis_index.py).

The follower loads a snapshot (the stream's last id, then the workers and their hashes), then reads
the stream from that id on a background thread; a batch of another incarnation or hash spec is
dropped, a gap in a worker's sequence or a `cleared` event reloads that worker's hash, and a worker
whose heartbeat expired is forgotten. While Redis is unreachable it reports itself unhealthy
(routing falls back to load) and reloads everything on reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvstrata.protos.v1 import kv_events_pb2 as ev
from kvstrata.router.background import BackgroundLoop
from kvstrata.router.events import decode_batch, decode_entry
from kvstrata.router.index import PrefixIndex, WorkerMatch
from kvstrata.router.redis_index import STREAM_FIELD, Backoff, RedisSettings, redis_errors
from kvstrata.worker.block_hash import HASH_SPEC_VERSION

log = logging.getLogger(__name__)

@dataclass
class FollowerCounters:
    resyncs: int = 0
    batches: int = 0
    stale_batches: int = 0  # an incarnation other than the registered one, or another hash spec
    bad_batches: int = 0  # undecodable
    gaps: int = 0  # a worker's sequence skipped: its hash was reloaded
    dead_workers: int = 0  # heartbeats that expired
    failures: int = 0  # Redis errors


class IndexFollower(BackgroundLoop):
    """A router's mirror of the shared index, kept current from Redis by a background thread."""

    def __init__(self, settings: RedisSettings, block_ms: int = 200, liveness_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.block_ms = block_ms
        self.liveness_interval_s = liveness_interval_s
        self._clock = clock
        self.index = PrefixIndex()
        self.incarnations: dict[str, str] = {}
        self._last_seq: dict[str, int] = {}
        self._last_id = b"0-0"
        self._lock = threading.Lock()
        self._client = settings.client()
        self._synced = False
        self._last_liveness = 0.0
        self.counters = FollowerCounters()
        self._init_loop("kvstrata-index-follower")

    def start(self) -> IndexFollower:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop_loop()
        self._client.close()

    @property
    def healthy(self) -> bool:
        """Synced with Redis: its matches are current. Unhealthy: route by load."""
        return self._synced

    def wait_synced(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._synced:
                return True
            time.sleep(0.01)
        return False

    def match(self, hashes: list[bytes], workers: list[str] | None = None) -> dict[str, WorkerMatch]:
        with self._lock:
            return self.index.match(hashes, workers)

    def workers(self) -> list[str]:
        with self._lock:
            return sorted(self.incarnations)

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self.resync()
                    backoff.reset()
                self._follow()
                if self._clock() - self._last_liveness >= self.liveness_interval_s:
                    self._check_liveness()
            except redis_errors() as e:
                self.counters.failures += 1
                if self._synced:
                    log.warning("prefix index lost Redis (%s); routing by load until it returns", e)
                self._synced = False
                self._stop.wait(backoff.failed())

    def resync(self) -> None:
        """A fresh snapshot: the stream position first, then the live workers' hashes."""
        s, r = self.settings, self._client
        last = r.xrevrange(s.events_key, count=1)
        last_id = last[0][0] if last else b"0-0"
        index = PrefixIndex()
        incarnations: dict[str, str] = {}
        for wid, raw in r.hgetall(s.workers_key).items():
            w = wid.decode()
            record = ev.WorkerRecord()
            try:
                record.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a corrupt record: that worker re-registers on its next resync
                continue
            if record.hash_spec_version != HASH_SPEC_VERSION:
                continue
            alive = r.get(s.alive_key(w))
            if alive is None or alive.decode() != record.incarnation:
                continue  # dead, or mid-restart: its next registration brings it back
            incarnations[w] = record.incarnation
            self._load_worker(index, w)
        with self._lock:
            self.index = index
            self.incarnations = incarnations
            self._last_seq = {}
            self._last_id = last_id
        self.counters.resyncs += 1
        self._synced = True
        self._last_liveness = self._clock()

    def _load_worker(self, index: PrefixIndex, w: str) -> None:
        for h, raw in self._client.hgetall(self.settings.blocks_key(w)).items():
            try:
                entry = decode_entry(raw)
            except ValueError:
                continue
            index.put_entry(w, h, entry.parent_hash or None, set(entry.tiers))

    def _reload_worker(self, w: str) -> None:
        fresh = PrefixIndex()
        self._load_worker(fresh, w)
        with self._lock:
            self.index.clear_worker(w)
            for h in fresh.blocks_of(w):
                self.index.put_entry(w, h, fresh.parent_of(h), fresh.tiers_of(w, h))

    def _follow(self) -> None:
        s = self.settings
        got = self._client.xread({s.events_key: self._last_id}, count=256, block=self.block_ms)
        for _, entries in got or ():
            for entry_id, fields in entries:
                self._last_id = entry_id
                self._apply(fields.get(STREAM_FIELD, b""))

    def _apply(self, data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except ValueError:
            self.counters.bad_batches += 1
            return
        if batch.hash_spec_version != HASH_SPEC_VERSION:
            self.counters.stale_batches += 1
            return
        w = batch.worker_id
        if self.incarnations.get(w) != batch.incarnation:
            if not self._adopt(w, batch.incarnation):
                self.counters.stale_batches += 1
                return
        self.counters.batches += 1
        last = self._last_seq.get(w)
        self._last_seq[w] = batch.sequence
        if last is not None and batch.sequence != last + 1:
            self.counters.gaps += 1
            self._reload_worker(w)
            return
        for event in batch.events:
            if event.WhichOneof("kind") == "cleared":
                self._reload_worker(w)  # a resync or a reset: the hash holds the whole truth now
                continue
            with self._lock:
                self.index.apply(w, event)

    def _adopt(self, w: str, incarnation: str) -> bool:
        """A batch from an incarnation we do not know: take it if Redis says it is the current one."""
        raw = self._client.hget(self.settings.workers_key, w)
        record = ev.WorkerRecord()
        if raw is None:
            return False
        record.ParseFromString(raw)
        if record.incarnation != incarnation:
            return False  # an old incarnation's late batch
        with self._lock:
            self.index.clear_worker(w)  # the previous incarnation's blocks are gone with it
            self.incarnations[w] = incarnation
        self._last_seq.pop(w, None)
        return True

    def _check_liveness(self) -> None:
        self._last_liveness = self._clock()
        s = self.settings
        for w, inc in list(self.incarnations.items()):
            alive = self._client.get(s.alive_key(w))
            if alive is None or alive.decode() != inc:
                with self._lock:
                    self.index.clear_worker(w)
                    self.incarnations.pop(w, None)
                self._last_seq.pop(w, None)
                self.counters.dead_workers += 1
