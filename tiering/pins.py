"""Prompt-cache pins: the blocks of a prefix up to a `cache_control` breakpoint, kept until their TTL.

A pinned block may move down the tiers but is never dropped, so all pins together must fit the
lowest tier: the table holds at most `max_blocks` (the tier manager gives it half of that tier),
and each tenant at most `quota_blocks`. Pinning a block again extends its TTL (never shortens it)
and keeps the tenant that pinned it first. Expiry is lazy: a heap of (expiry, block) is popped up
to the clock whenever pins are looked at.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable


class PinTable:
    def __init__(self, max_blocks: int, quota_blocks: int | None, block_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        self.max_blocks = max(1, max_blocks)
        self.quota_blocks = min(quota_blocks or self.max_blocks, self.max_blocks)
        self.block_bytes = block_bytes
        self.clock = clock
        self._entries: dict[bytes, tuple[float, str]] = {}  # block hash -> (expiry, tenant)
        self._heap: list[tuple[float, bytes]] = []

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, hashes: list[bytes], ttl_s: float, tenant: str) -> None:
        """Pin these blocks for ttl_s seconds from now (expired pins dropped first). ValueError, naming
        cache_control, where the tenant's quota or the table would overflow; nothing is pinned then."""
        now = self.clock()
        self.expire(now)
        new = [h for h in hashes if h not in self._entries]
        mine = self.count(tenant) + len(new)
        if mine > self.quota_blocks:
            raise ValueError(f"cache_control: tenant {tenant or 'default'!r} would pin {mine * self.block_bytes} "
                             f"bytes of KV, over its quota of {self.quota_blocks * self.block_bytes}")
        if len(self._entries) + len(new) > self.max_blocks:
            raise ValueError(f"cache_control: the server's pinned KV is full ({self.max_blocks * self.block_bytes} "
                             "bytes); retry later or without cache_control")
        expiry = now + ttl_s
        for h in hashes:
            old = self._entries.get(h)
            if old is None or old[0] < expiry:
                self._entries[h] = (expiry, tenant if old is None else old[1])
                heapq.heappush(self._heap, (expiry, h))

    def expire(self, now: float | None = None) -> bool:
        """Drop the pins whose TTL has passed; whether any was dropped."""
        now = self.clock() if now is None else now
        changed = False
        while self._heap and self._heap[0][0] <= now:
            expiry, h = heapq.heappop(self._heap)
            if self._entries.get(h, (None,))[0] == expiry:  # else pinned again since, for longer
                del self._entries[h]
                changed = True
        return changed

    def count(self, tenant: str | None = None) -> int:
        """Blocks pinned, by `tenant` or by anyone."""
        return sum(1 for _, t in self._entries.values() if tenant is None or t == tenant)

    def clear(self) -> None:
        self._entries.clear()
        self._heap.clear()

    def snapshot(self) -> frozenset[bytes]:
        """The pinned blocks as of now, in a set that is never changed afterwards (IO threads read it)."""
        return frozenset(self._entries)
