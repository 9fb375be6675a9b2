"""The NVMe tier's rates in the chat of `kvstrata bench tiering`, beside the disk at the same moments.

The chat's NVMe rows used to compare the tier with a disk probe taken before the three configs ran,
minutes earlier. This VM's disk moves between about 0.6 and 3.9 GB/s over such spans, so that ratio
said more about the disk's moments than about the tier. Here the reference follows the chat turn by
turn: after each turn of the NVMe config, once the tier's writes have finished (flush), the bytes the
tier wrote and read during that turn move through a plain file in the same directory with one
thread's sequential O_DIRECT IO in 8 MB chunks (tier_probe.RawFile): extending writes of the bytes
written, then reads of the bytes read, taken from the end of what the file holds (the most recently
written, the case a disk cache favours most). Each side's rate is its bytes over its own seconds
summed over the chat: the tier's busy seconds (any IO of that kind in flight), the reference's
seconds in its IO calls.

    turn k:  [ tier IO, inside the turn ]  flush  [ reference: write dw_k, read dr_k ]  turn k + 1 ...

The reference's seconds are left out of the config's wall time; the flush is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.cluster.bench.tier_probe import RawFile

CHAT_RAW_FILE = ".kvstrata-chat-lockstep-raw"


@dataclass(frozen=True, slots=True)
class ChatReference:
    """The reference's totals over the chat; seconds None where the filesystem has no O_DIRECT."""

    write_bytes: int
    write_seconds: float | None
    read_bytes: int
    read_seconds: float | None
    turns_waited: int  # turns after which the tier still had writes in flight (the flush waited)

    def gb_per_s(self, kind: str) -> float | None:
        num_bytes, seconds = getattr(self, kind + "_bytes"), getattr(self, kind + "_seconds")
        return num_bytes / seconds / 1e9 if num_bytes and seconds else None

    def to_json(self) -> dict[str, Any]:
        return {"write_bytes": self.write_bytes, "write_seconds": self.write_seconds, "read_bytes": self.read_bytes,
                "read_seconds": self.read_seconds, "turns_waited": self.turns_waited,
                "write_gb_per_s": self.gb_per_s("write"), "read_gb_per_s": self.gb_per_s("read")}


class ChatLockstep:
    """Call after_turn after every turn of a chat on a tier (an NvmeTier); reference() at the end;
    close() removes the reference's file."""

    def __init__(self, tier: Any, directory: Path, clock: Callable[[], float] = time.perf_counter):
        self.tier = tier
        self.raw = RawFile(directory / CHAT_RAW_FILE, clock)
        stats = tier.stats()
        self._seen = (stats["bytes_written"], stats["bytes_read"])  # the tier's counters at the last turn's end
        self._file_bytes = 0  # what the reference has written so far (its file's size)
        self._bytes = {"w": 0, "r": 0}
        self._seconds: dict[str, float | None] = {"w": 0.0, "r": 0.0}
        self._turns_waited = 0

    def after_turn(self) -> float:
        """Flush the tier, then move this turn's bytes through the reference; the reference's seconds
        (to leave out of the wall time)."""
        self._turns_waited += self.tier.num_pending_writes > 0
        self.tier.flush()
        stats = self.tier.stats()
        written, read = stats["bytes_written"] - self._seen[0], stats["bytes_read"] - self._seen[1]
        self._seen = (stats["bytes_written"], stats["bytes_read"])
        spent = 0.0
        if written:
            spent += self._move("w", self._file_bytes, written)
            self._file_bytes += written
        read = min(read, self._file_bytes)  # every block read was written first, so this cuts nothing
        if read:
            spent += self._move("r", self._file_bytes - read, read)
        return spent

    def _move(self, op: str, offset: int, num_bytes: int) -> float:
        seconds = self.raw.move(op, offset, num_bytes)
        self._bytes[op] += num_bytes
        if seconds is None or self._seconds[op] is None:
            self._seconds[op] = None
            return 0.0
        self._seconds[op] += seconds
        return seconds

    def reference(self) -> ChatReference:
        return ChatReference(self._bytes["w"], self._seconds["w"], self._bytes["r"], self._seconds["r"],
                             self._turns_waited)

    def close(self) -> None:
        self.raw.close()
