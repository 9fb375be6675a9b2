"""The transfer rows of `kvstrata bench tiering`: each tier's rate against its reference bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.cluster.bench.bandwidth import DiskRates
from kvstrata.cluster.bench.tier_probe import TierProbe


@dataclass(frozen=True, slots=True)
class Transfer:
    name: str
    gb_per_s: float | None  # None: the run moved no such bytes
    reference: str
    reference_gb_per_s: float

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
    return [
        Transfer("NVMe write", _rate(nvme.get("bytes_written", 0), nvme.get("write_busy_seconds", 0)),
                 write_ref[0], write_ref[1] / 1e9),
        Transfer("NVMe read", _rate(nvme.get("bytes_read", 0), nvme.get("read_busy_seconds", 0)),
                 read_ref[0], read_ref[1] / 1e9),
    ]


def probe_transfers(probe: TierProbe | None) -> list[Transfer]:
    """The tier alone (medians over the probe's rounds) against the O_DIRECT IO of the same rounds;
    none without a probe, or where the filesystem has no O_DIRECT to compare with."""
    if probe is None or not probe.direct_io:
        return []
    raw_write, raw_read = probe.median("raw_write"), probe.median("raw_read")
    if raw_write is None or raw_read is None:
        return []
    rounds = "sequential O_DIRECT {}, same rounds"
    return [
        Transfer("NVMe write alone, new space", probe.median("write_new") / 1e9, rounds.format("write"),
                 raw_write / 1e9),
        Transfer("NVMe write alone, reused slots", probe.median("write_reused") / 1e9, rounds.format("write"),
                 raw_write / 1e9),
        Transfer("NVMe read alone", probe.median("read") / 1e9, rounds.format("read"), raw_read / 1e9),
    ]


def _rate(num_bytes: int, seconds: float) -> float | None:
    return num_bytes / seconds / 1e9 if num_bytes and seconds > 0 else None
