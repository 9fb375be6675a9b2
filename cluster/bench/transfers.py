"""The transfer rows of `kvstrata bench tiering`: each tier's rate against its reference bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.cluster.bench.bandwidth import DiskRates
from kvstrata.cluster.bench.chat_lockstep import ChatReference
from kvstrata.cluster.bench.dram_probe import DramProbe
from kvstrata.cluster.bench.tier_probe import TierProbe


@dataclass(frozen=True, slots=True)
class Transfer:
    name: str
    gb_per_s: float | None  # None: the run moved no such bytes
    reference: str
    reference_gb_per_s: float
    target: bool = True  # False: reported beside the targets, to tell where the time goes, not judged

    @property
    def ratio(self) -> float | None:
        return None if self.gb_per_s is None else self.gb_per_s / self.reference_gb_per_s


def nvme_transfers(nvme: dict[str, Any], disk: DiskRates) -> list[Transfer]:
    """The NVMe tier's write and read rates (bytes over the wall time with any such IO in flight,
    across its IO threads) against one thread's sequential IO on the same disk, in the tier's mode."""
    direct = bool(nvme.get("direct_io")) and disk.write_direct is not None
    if direct:
        write_ref, read_ref = ("sequential O_DIRECT write", disk.write_direct), ("sequential O_DIRECT read",
                                                                                 disk.read_direct)
    else:
        warm = disk.read_warm >= disk.read_cold
        write_ref = ("sequential buffered write", disk.write)
        read_ref = ("sequential read, " + ("page cache" if warm else "from disk"), max(disk.read_warm, disk.read_cold))
    rates = _chat_rates(nvme)
    return [Transfer("NVMe write", rates["write"], write_ref[0], write_ref[1] / 1e9),
            Transfer("NVMe read", rates["read"], read_ref[0], read_ref[1] / 1e9)]


def chat_lockstep_transfers(nvme: dict[str, Any], ref: ChatReference | None) -> list[Transfer]:
    """The NVMe tier's write and read rates in the chat (as nvme_transfers) against one thread's
    sequential O_DIRECT IO of each turn's bytes right after the turn (chat_lockstep.py); none
    without a reference, or where the filesystem has no O_DIRECT. With C IO threads, each row comes
    again over the tier's time in syscalls only, beside the targets."""
    if ref is None:
        return []
    rows, where = [], []
    disk = _chat_rates(nvme, "io")
    for kind, rate in _chat_rates(nvme).items():
        if (reference := ref.gb_per_s(kind)) is None:
            continue
        name, against = f"NVMe {kind} in the chat", f"O_DIRECT {kind}s of each turn's bytes, lockstep"
        rows.append(Transfer(name, rate, against, reference))
        if disk[kind] is not None:  # timed as the reference times its own IO: the busy clock less the
            # thread wake-ups, the reaper, its callbacks and the GIL (C IO threads only)
            where.append(Transfer(f"{name}, its IO in syscalls only", disk[kind], against, reference, target=False))
    return rows + where


def probe_transfers(probe: TierProbe | None) -> list[Transfer]:
    """The tier alone against the O_DIRECT IO taken in lockstep with it, each row from the round
    whose ratio is the median (a round's two rates share the disk's moments; medians taken column
    by column would pair rounds that did not); none without a probe, or where the filesystem has no
    O_DIRECT to compare with."""
    if probe is None or not probe.direct_io:
        return []
    rows = []
    for name, kind, reference in (("NVMe write alone, new space", "write_new", "O_DIRECT extending writes"),
                                  ("NVMe write alone, reused slots", "write_reused", "O_DIRECT overwrites"),
                                  ("NVMe read alone", "read", "O_DIRECT reads")):
        pairs = sorted((getattr(r, kind) / ref, getattr(r, kind), ref) for r in probe.rounds
                       if (ref := getattr(r, "raw_" + kind)) is not None)
        if not pairs:
            return []
        _, rate, ref = pairs[len(pairs) // 2]
        rows.append(Transfer(name, rate / 1e9, reference + ", lockstep", ref / 1e9))
    return rows


def dram_probe_transfers(probe: DramProbe | None) -> list[Transfer]:
    """The DRAM tier's copies alone against the memcpy taken in lockstep with them, each row from the
    round whose ratio is the median; none without a probe."""
    if probe is None:
        return []
    rows = []
    for name, kind in (("DRAM demote alone", "demote"), ("DRAM promote alone", "promote")):
        _, rate, ref = sorted((getattr(r, kind) / r.memcpy, getattr(r, kind), r.memcpy) for r in probe.rounds)[
            len(probe.rounds) // 2]
        rows.append(Transfer(f"{name}, bursts of {probe.burst_blocks} blocks", rate / 1e9, "memcpy, lockstep",
                             ref / 1e9))
    return rows


def _chat_rates(nvme: dict[str, Any], clock: str = "busy") -> dict[str, float | None]:
    """The NVMe tier's write and read GB/s in the chat, from its stats, over its busy clocks or (clock
    "io") its IO threads' time in syscalls (None: no such bytes moved, or no such clock)."""
    return {"write": _rate(nvme.get("bytes_written", 0), nvme.get(f"write_{clock}_seconds") or 0),
            "read": _rate(nvme.get("bytes_read", 0), nvme.get(f"read_{clock}_seconds") or 0)}


def _rate(num_bytes: int, seconds: float) -> float | None:
    return num_bytes / seconds / 1e9 if num_bytes and seconds > 0 else None
