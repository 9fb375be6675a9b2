"""KV events on the worker side: recorded as the engine caches, evicts and moves blocks, then
encoded into versioned protobuf batches (`kvstrata.v1.KVEventBatch`) for the shared index.

Recording is a list append on the step loop; encoding and sending happen on a publisher's thread.
Consecutive events of the same kind and tier are merged, so a prefill of 100 blocks is one event.
"""

from __future__ import annotations

import threading
import time

from kvstrata.protos.v1 import kv_events_pb2 as ev
from kvstrata.worker.block_hash import HASH_SPEC_VERSION

ENCODING_VERSION = 1


class EventRecorder:
    """Collects a worker's KV events between drains. Safe to call from one thread while another drains."""

    def __init__(self) -> None:
        self._events: list[ev.KVEvent] = []
        self._lock = threading.Lock()

    def stored(self, hashes: list[bytes], parent: bytes | None, tier: int) -> None:
        if not hashes:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if (last is not None and last.WhichOneof("kind") == "stored" and last.stored.tier == tier
                    and last.stored.block_hashes and last.stored.block_hashes[-1] == parent):
                last.stored.block_hashes.extend(hashes)  # the chain goes on
                return
            self._events.append(ev.KVEvent(stored=ev.BlockStored(block_hashes=hashes, parent_hash=parent or b"",
                                                                 tier=tier)))

    def removed(self, hashes: list[bytes], tier: int) -> None:
        if not hashes:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if last is not None and last.WhichOneof("kind") == "removed" and last.removed.tier == tier:
                last.removed.block_hashes.extend(hashes)
                return
            self._events.append(ev.KVEvent(removed=ev.BlockRemoved(block_hashes=hashes, tier=tier)))

    def moved(self, hashes: list[bytes], from_tier: int, to_tier: int) -> None:
        if not hashes:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if (last is not None and last.WhichOneof("kind") == "tier_changed"
                    and (last.tier_changed.from_tier, last.tier_changed.to_tier) == (from_tier, to_tier)):
                last.tier_changed.block_hashes.extend(hashes)
                return
            self._events.append(ev.KVEvent(tier_changed=ev.TierChanged(block_hashes=hashes, from_tier=from_tier,
                                                                       to_tier=to_tier)))

    def cleared(self) -> None:
        with self._lock:
            self._events = [ev.KVEvent(cleared=True)]  # earlier events no longer matter

    def drain(self) -> list[ev.KVEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def __len__(self) -> int:
        return len(self._events)


def encode_batch(worker_id: str, incarnation: str, sequence: int, events: list[ev.KVEvent],
                 timestamp: float | None = None) -> bytes:
    return ev.KVEventBatch(encoding_version=ENCODING_VERSION, worker_id=worker_id, incarnation=incarnation,
                           sequence=sequence, hash_spec_version=HASH_SPEC_VERSION,
                           timestamp=time.time() if timestamp is None else timestamp,
                           events=events).SerializeToString()


def decode_batch(data: bytes) -> ev.KVEventBatch:
    """ValueError for bytes that are not a batch of a known encoding version."""
    batch = ev.KVEventBatch()
    try:
        batch.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(f"not a KV event batch: {e}") from None
    if batch.encoding_version != ENCODING_VERSION:
        raise ValueError(f"KV event batch encoding version {batch.encoding_version}, expected {ENCODING_VERSION}")
    return batch


def encode_entry(tiers: set[int], parent: bytes | None) -> bytes:
    return ev.IndexEntry(encoding_version=ENCODING_VERSION, tiers=sorted(tiers),
                         parent_hash=parent or b"").SerializeToString()


def decode_entry(data: bytes) -> ev.IndexEntry:
    entry = ev.IndexEntry()
    try:
        entry.ParseFromString(data)
    except Exception as e:
        raise ValueError(f"not an index entry: {e}") from None
    if entry.encoding_version != ENCODING_VERSION:
        raise ValueError(f"index entry encoding version {entry.encoding_version}, expected {ENCODING_VERSION}")
    return entry
