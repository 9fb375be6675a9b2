"""Which blocks leaving DRAM earn a place on a full NVMe tier (see `AdmissionPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass

ADMISSION_MODES = ("reuse", "all")


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Which blocks leaving DRAM are written to NVMe.

    `all`: every one. `reuse` (the default): every one while NVMe has room; once it is full (the
    steady state of a long-running server, where each write evicts an older block), only blocks that
    were asked for twice, and pinned ones. Asked for twice means reused (a prefix hit in any tier),
    or computed a second time after a miss: without the second case, a conversation whose newest
    blocks missed once would recompute them forever without ever earning its place on disk.
    Reuse predicts reuse: a one-shot prompt's blocks then cannot push a conversation's history or a
    shared system prompt off the disk, and access that cycles through more than the disk holds does
    not turn LRU into a miss on every block. A reuse is a hit on the block's whole prefix, so the rule
    does not keep a chain's tail without its head. `kvstrata bench tiering --admission-study`
    measures both modes.
    """

    mode: str = "reuse"

    def __post_init__(self):
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"nvme_admission must be one of {', '.join(ADMISSION_MODES)}, got {self.mode!r}")

    def admits(self, hits: int, times_computed: int, pinned: bool, disk_full: bool) -> bool:
        return self.mode == "all" or pinned or not disk_full or hits > 0 or times_computed > 1
