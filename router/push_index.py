"""The embedded index, without Redis: workers push their KV event batches straight to the routers
(one call per batch, off the step loop), and each router applies them to its own mirror.

The same rules as the Redis index: a batch of an unknown incarnation replaces the worker's entries,
a `cleared` event empties them (a full state follows it when a worker resends), and a router that
starts late asks every worker to resend its state.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

from kvstrata.protos.v1 import kv_events_pb2 as ev
from kvstrata.router.background import BackgroundLoop
from kvstrata.router.events import EventRecorder, decode_batch, encode_batch
from kvstrata.router.index import TIERS, PrefixIndex, WorkerMatch
from kvstrata.worker.block_hash import HASH_SPEC_VERSION

log = logging.getLogger(__name__)


class PushPublisher(BackgroundLoop):
    """A worker's side: drains its recorder every interval and hands each batch to `send`."""

    def __init__(self, worker_id: str, recorder: EventRecorder, send: Callable[[bytes], None],
                 interval_s: float = 0.05, incarnation: str | None = None):
        self.worker_id = worker_id
        self.incarnation = incarnation or uuid.uuid4().hex
        self.recorder = recorder
        self.send = send
        self.interval_s = interval_s
        self.mine = PrefixIndex()
        self._sequence = 0
        self._lock = threading.Lock()
        self._init_loop(f"kvstrata-kv-push-{worker_id}")

    def start(self) -> PushPublisher:
        self.resend_state()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop_loop()
        self.publish()

    def publish(self) -> None:
        """Send what was recorded since the last batch."""
        with self._lock:
            events = self.recorder.drain()
            for e in events:
                self.mine.apply(self.worker_id, e)
            if events:
                self._send(events)

    def resend_state(self) -> None:
        """Everything this worker holds, after a `cleared`: for a router that starts (or restarts)."""
        with self._lock:
            for e in self.recorder.drain():
                self.mine.apply(self.worker_id, e)
            events = [ev.KVEvent(cleared=True)]
            for tier in TIERS:
                hashes = [h for h in self.mine.blocks_of(self.worker_id) if tier in self.mine.tiers_of(self.worker_id, h)]
                events += [ev.KVEvent(stored=ev.BlockStored(block_hashes=[h], parent_hash=self.mine.parent_of(h) or b"",
                                                            tier=tier)) for h in hashes]
            self._send(events)

    def _send(self, events: list[ev.KVEvent]) -> None:
        self._sequence += 1
        try:
            self.send(encode_batch(self.worker_id, self.incarnation, self._sequence, events))
        except Exception as e:  # noqa: BLE001 - a router is gone; the next resend repairs it
            log.warning("pushing KV events from %s failed: %s", self.worker_id, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()


class PushedIndex:
    """A router's side: the mirror, fed by `apply_batch`."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.incarnations: dict[str, str] = {}
        self._last_seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stale_batches = self.gaps = 0

    healthy = True  # nothing to lose a connection to

    def apply_batch(self, data: bytes) -> None:
        batch = decode_batch(data)
        if batch.hash_spec_version != HASH_SPEC_VERSION:
            self.stale_batches += 1
            return
        w = batch.worker_id
        with self._lock:
            if self.incarnations.get(w) != batch.incarnation:
                self.index.clear_worker(w)  # a new incarnation: the old one's blocks went with it
                self.incarnations[w] = batch.incarnation
                self._last_seq.pop(w, None)
            last = self._last_seq.get(w)
            if last is not None and batch.sequence <= last:
                self.stale_batches += 1
                return
            if last is not None and batch.sequence != last + 1:
                self.gaps += 1  # lost batches: advisory data, so carry on; a resend repairs it
            self._last_seq[w] = batch.sequence
            for event in batch.events:
                self.index.apply(w, event)

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self.index.clear_worker(worker_id)
            self.incarnations.pop(worker_id, None)
            self._last_seq.pop(worker_id, None)

    def match(self, hashes: list[bytes], workers: list[str] | None = None) -> dict[str, WorkerMatch]:
        with self._lock:
            return self.index.match(hashes, workers)
