"""Damage an NVMe tier's files from outside, as a failing disk would."""

from __future__ import annotations

from pathlib import Path


def flip_every_payload(directory: Path) -> int:
    """Flip a byte in the middle of every block payload stored under `directory`; returns how many."""
    from kvstrata.tiering.block_file import BlockHeader, round_up

    num_flipped = 0
    for slab in sorted(Path(directory).glob("slab-*.kvs")):
        with open(slab, "r+b") as f:
            size, offset = slab.stat().st_size, 0
            while offset < size:  # slots start 4096-aligned: find them by their headers
                f.seek(offset)
                try:
                    header = BlockHeader.parse(f.read(2 * 4096))
                except ValueError:
                    offset += 4096
                    continue
                middle = offset + header.payload_offset + header.payload_len // 2
                f.seek(middle)
                byte = f.read(1)[0]
                f.seek(middle)
                f.write(bytes([byte ^ 0xFF]))
                num_flipped += 1
                offset += header.payload_offset + round_up(header.payload_len)
    return num_flipped
