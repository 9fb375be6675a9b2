"""NvmeTier: round trips, leaf-first LRU by slots, bad slots as misses, restart, threads, the slot
and slab layout, O_DIRECT and busy-time accounting.

Every scenario ends with `check_integrity()`. The core scenarios run with O_DIRECT and through the
page cache. Bad slots are made by hand in the slab files (flipped bytes, zeroed or half-written
headers, truncated slabs, other blocks' bytes, foreign layouts, garbage, version-2 headers, torn
overwrites, a block in two slots, old per-block files), and a stateful test drives the tier against
a brute-force model of the eviction rule, restarts included.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import math
import mmap
import os
import random
import shutil
import stat
import tempfile
import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.tiering import nvme
from kvstrata.tiering.block_file import ALIGN, BlockHeader, round_up
from kvstrata.tiering.disk_io import BusyClock, supports_direct_io
from kvstrata.tiering.nvme import NvmeTier
from kvstrata.tiering.slab import SlabFiles

SHAPE = (2, 2, 4, 2, 8)  # [layers, k/v, block_size, kv_heads, head_dim]
TAG = "test-model/bs4"
PAYLOAD = math.prod(SHAPE) * 4  # float32
SLOT = ALIGN + round_up(PAYLOAD)  # a 4096-byte head, then the payload rounded up to 4096
THREE_BLOCKS = 3 * SLOT + SLOT - 1  # 3 slots, and a 4th does not fit


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def block(seed: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def data_of(name: str) -> torch.Tensor:
    return block(int.from_bytes(h(name)[:4], "little"))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaN payloads and -0.0 compare bit-exactly."""
    return t.contiguous().view(-1).view(torch.uint8)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def tier_at(path: Path, capacity: int = THREE_BLOCKS, dtype: torch.dtype = torch.float32, **kw) -> NvmeTier:
    return NvmeTier(path, capacity, SHAPE, dtype, layout_tag=kw.pop("layout_tag", TAG), **kw)


def put_all(tier: NvmeTier, *items: tuple[str, str | None]) -> None:
    """Put named blocks in order, each committed before the next, so recency follows the order."""
    for name, parent in items:
        assert tier.put(h(name), h(parent) if parent else None, data_of(name)).result() is True


def names_in(tier: NvmeTier, *names: str) -> set[str]:
    return {n for n in names if h(n) in tier}


# -- reading the slabs by hand ----------------------------------------------------------------------


def slabs(directory: Path) -> list[Path]:
    return sorted(directory.glob("slab-*.kvs"), key=lambda p: int(p.stem.removeprefix("slab-")))


def slab0(tier: NvmeTier) -> Path:
    return tier.directory / "slab-0.kvs"


def headers(path: Path, slot_bytes: int = SLOT) -> dict[int, BlockHeader]:
    """Byte offset -> the valid header there, of any layout, at every slot boundary of a slab."""
    raw = path.read_bytes()
    found = {}
    for offset in range(0, len(raw), slot_bytes):
        try:
            found[offset] = BlockHeader.parse(raw[offset:offset + slot_bytes])
        except ValueError:
            pass
    return found


def offset_of(tier: NvmeTier, block_hash: bytes) -> int:
    """Where in slab 0 the one slot naming the block starts."""
    offsets = [o for o, head in headers(slab0(tier), tier.file_bytes).items() if head.block_hash == block_hash]
    assert len(offsets) == 1, f"{len(offsets)} slots name the block"
    return offsets[0]


def slot_bytes(path: Path, offset: int, n: int = SLOT) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def rewrite_header(path: Path, offset: int, **changes) -> None:
    """Replace header fields of the slot at `offset`, with its CRC made valid again."""
    head = BlockHeader.parse(slot_bytes(path, offset))
    patch(path, offset, dataclasses.replace(head, **changes).pack())


def erased(path: Path, offset: int) -> bool:
    return slot_bytes(path, offset, ALIGN) == bytes(ALIGN)


def direct_io_works(directory: Path) -> bool:
    """O_DIRECT checked without the tier's probe: one page-aligned (mmap) block written."""
    path = directory / "direct-check"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGN) as buf:
            return os.write(fd, buf) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct_io(request, tmp_path) -> bool:
    if request.param and not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    return request.param


@pytest.fixture
def tier(tmp_path, direct_io):
    """O_DIRECT with writes on the C IO threads where the C kernels are built (the default), and
    through the page cache with writes on the Python IO threads: each write path in both suites."""
    t = tier_at(tmp_path / "nvme", direct_io=direct_io, c_io=None if direct_io else False)
    yield t
    t.close()


# -- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": -5}, "capacity_bytes"),
    ({"block_shape": ()}, "block_shape"),
    ({"block_shape": (4, 0)}, "block_shape"),
    ({"num_io_threads": 0}, "num_io_threads"),
    ({"direct_io": "yes"}, "direct_io"),
    ({"slab_bytes": 0}, "slab_bytes"),
    ({"c_io": "yes"}, "c_io"),
    ({"layout_tag": "t" * 65535}, "layout_tag"),
])
def test_bad_arguments_name_the_argument(tmp_path, kwargs, name):
    args = {"directory": tmp_path, "capacity_bytes": 1 << 20, "block_shape": SHAPE, "dtype": torch.float32}
    with pytest.raises(ValueError, match=name):
        NvmeTier(**{**args, **kwargs})
    with pytest.raises(TypeError, match="dtype"):
        NvmeTier(**{**args, "dtype": "float32"})


def test_bad_put_arguments(tier):
    with pytest.raises(TypeError, match="data"):
        tier.put(h("a"), None, [0.0] * 256)
    with pytest.raises(ValueError, match="data"):
        tier.put(h("a"), None, torch.zeros(3))
    with pytest.raises(ValueError, match="data"):
        tier.put(h("a"), None, block(0, torch.float16))
    with pytest.raises(ValueError, match="block_hash"):
        tier.put(b"", None, block(0))
    with pytest.raises(ValueError, match="parent_hash"):
        tier.put(h("a"), h("a"), block(0))
    assert len(tier) == 0


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype, direct_io):
    tier = tier_at(tmp_path / "nvme", dtype=dtype, capacity=1 << 20, direct_io=direct_io)
    assert tier.direct_io is direct_io and tier.stats()["direct_io"] is direct_io
    data = block(1, dtype)
    data.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")], dtype=dtype)
    strided = block(3, dtype, SHAPE[::-1]).permute(4, 3, 2, 1, 0)  # SHAPE, not contiguous
    assert tier.put(h("a"), None, data).result() is True
    assert tier.put(h("b"), h("a"), block(2, dtype)).result() is True
    assert tier.put(h("c"), h("b"), strided).result() is True
    tier.flush()
    assert same(tier.get(h("a")).result(), data)
    assert same(tier.get(h("b")).result(), block(2, dtype))
    assert same(tier.get(h("c")).result(), strided)
    assert tier.get(h("missing")).result() is None
    assert h("a") in tier and h("missing") not in tier and len(tier) == 3
    assert tier.parent_of(h("b")) == h("a") and tier.parent_of(h("a")) is None
    s = tier.stats()
    assert (s["hits"], s["misses"], s["writes"], s["checksum_failures"]) == (3, 1, 3, 0)
    slot = ALIGN + round_up(math.prod(SHAPE) * dtype.itemsize)
    assert tier.file_bytes == slot and s["slots"] == (1 << 20) // slot and s["slab_files"] == 1
    assert s["bytes_written"] == s["used_bytes"] == tier.used_bytes == 3 * slot == s["bytes_read"]
    assert slabs(tier.directory) == [slab0(tier)] and slab0(tier).stat().st_size == s["slots"] * slot  # preallocated
    assert sorted(headers(slab0(tier), slot)) == [0, slot, 2 * slot]  # the first slots, in order
    assert stat.S_IMODE(slab0(tier).stat().st_mode) == 0o600
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in tier.directory.iterdir()) == [".lock", "slab-0.kvs"]
    tier.check_integrity()
    tier.close()


def test_get_many_keeps_order_and_mixes_hits_and_misses(tier):
    put_all(tier, ("a", None), ("b", "a"), ("c", "b"))
    got = tier.get_many([h("c"), h("x"), h("a"), h("b"), h("a")]).result()
    assert got[1] is None
    assert all(same(got[i], data_of(n)) for i, n in [(0, "c"), (2, "a"), (3, "b"), (4, "a")])
    assert tier.get_many([]).result() == []
    assert tier.stats()["hits"] == 4 and tier.stats()["misses"] == 1


def test_get_of_a_write_in_flight_sees_the_data(tier):
    put = tier.put(h("a"), None, data_of("a"))
    got = tier.get(h("a")).result()
    assert same(got, data_of("a"))  # from the pending write or from disk: whole either way
    got.zero_()  # the caller's copy to keep: it must not reach the slot
    assert put.result() is True and tier.put(h("a"), None, data_of("a")).result() is True
    assert same(tier.get(h("a")).result(), data_of("a"))
    assert tier.stats()["writes"] == 1
    tier.check_integrity()


def test_a_capacity_below_one_slot_stores_nothing(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=SLOT - 1)  # the padded head counts too
    assert tier.put(h("a"), None, block(0)).result() is False
    assert len(tier) == 0 and tier.used_bytes == 0 and tier.stats()["slots"] == 0 and slabs(tier.directory) == []
    tier.check_integrity()
    tier.close()
    exact = tier_at(tmp_path / "exact", capacity=SLOT)
    assert exact.put(h("a"), None, block(0)).result() is True and exact.used_bytes == SLOT
    assert exact.put(h("b"), None, block(1)).result() is True and names_in(exact, "a", "b") == {"b"}
    assert slab0(exact).stat().st_size == SLOT
    exact.check_integrity()
    exact.close()


def test_discard_erases_the_slot_and_the_entry(tier):
    put_all(tier, ("a", None), ("b", "a"))
    b_at = offset_of(tier, h("b"))
    assert tier.discard(h("b")) is True
    assert erased(slab0(tier), b_at)  # at once, not at the next write to the slot
    assert tier.discard(h("b")) is False
    assert names_in(tier, "a", "b") == {"a"} and tier.get(h("b")).result() is None
    assert [head.block_hash for head in headers(slab0(tier)).values()] == [h("a")]
    put_all(tier, ("c", None), ("d", None))
    assert (offset_of(tier, h("c")), offset_of(tier, h("d"))) == (b_at, 2 * SLOT)  # freed, then fresh
    assert tier.discard(h("d")) and tier.discard(h("a"))
    put_all(tier, ("e", None), ("f", None))
    assert (offset_of(tier, h("e")), offset_of(tier, h("f"))) == (0, 2 * SLOT)  # lowest free first
    tier.check_integrity()


def test_discard_of_a_write_in_flight_wins(tier):
    put = tier.put(h("a"), None, data_of("a"))
    assert tier.discard(h("a")) is True  # the write is pending or already done; either way it goes
    tier.flush()
    assert put.result() in (True, False) and h("a") not in tier and len(tier) == 0
    assert all(not path.exists() or headers(path) == {} for path in [slab0(tier)])
    tier.check_integrity()


def test_discarded_blocks_stay_gone_after_a_restart(tmp_path, direct_io):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    put_all(tier, *[(n, None) for n in "abcdef"])
    assert tier.discard(h("b")) and tier.discard(h("e"))
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    assert names_in(again, *"abcdef") == set("acdf")
    assert again.stats()["dropped_at_open"] == 0  # erased slots are free space, not bad ones
    for h_ in again.hashes():  # what the manager's reset does
        again.discard(h_)
    again.close()
    empty = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    assert len(empty) == 0 and headers(slab0(empty)) == {} and empty.stats()["slab_files"] == 1
    empty.check_integrity()
    empty.close()


# -- eviction: LRU by slots, leaves first ------------------------------------------------------------


def test_lru_eviction_and_put_refreshes_recency(tier):
    put_all(tier, ("a", None), ("b", None), ("c", None))
    put_all(tier, ("a", None))  # already stored: only a touch
    assert tier.stats()["writes"] == 3
    put_all(tier, ("d", None))
    assert names_in(tier, "a", "b", "c", "d") == {"a", "c", "d"}
    assert tier.get(h("c")).result() is not None  # a hit is a touch too
    put_all(tier, ("e", None))
    assert names_in(tier, "a", "b", "c", "d", "e") == {"c", "d", "e"}
    assert tier.stats()["evictions"] == 2 and tier.used_bytes <= THREE_BLOCKS
    tier.check_integrity()


def test_get_many_touches_in_the_order_asked(tier):
    put_all(tier, ("a", None), ("b", None), ("c", None))
    assert None not in tier.get_many([h("c"), h("a")]).result()  # recency now: b, c, a
    put_all(tier, ("d", None))
    assert names_in(tier, *"abcd") == {"a", "c", "d"}
    put_all(tier, ("e", None))
    assert names_in(tier, *"acde") == {"a", "d", "e"}
    tier.check_integrity()


def test_chain_is_evicted_leaf_first_even_when_the_leaf_is_newest(tier):
    put_all(tier, ("x", None), ("a", None), ("b", "a"))
    put_all(tier, ("c", "b"))  # x is the LRU leaf; a is older than b but has a child
    assert names_in(tier, "x", "a", "b", "c") == {"a", "b", "c"}
    assert tier.get(h("c")).result() is not None  # c is now the most recent block...
    put_all(tier, ("y", None))
    assert names_in(tier, "a", "b", "c") == {"a", "b"}  # ...and still the only leaf of the chain
    put_all(tier, ("z", None))  # leaves: b (older), y
    assert names_in(tier, "a", "b", "y", "z") == {"a", "y", "z"}
    put_all(tier, ("w", None))
    assert names_in(tier, "a", "y", "z", "w") == {"y", "z", "w"}
    tier.check_integrity()


def test_children_arriving_before_parents_still_go_first(tier):
    """DRAM demotes leaf first, so the NVMe tier usually sees a chain tail first."""
    put_all(tier, ("c", "b"), ("b", "a"), ("a", None))
    put_all(tier, ("x", None))
    assert names_in(tier, "a", "b", "c") == {"a", "b"}
    put_all(tier, ("y", None))
    assert names_in(tier, "a", "b", "x", "y") == {"a", "x", "y"}
    tier.check_integrity()


def test_a_parent_cycle_falls_back_to_plain_lru(tier):
    """Chained SHA-256 cannot make a cycle, but arbitrary bytes can, and eviction must not stall."""
    put_all(tier, ("a", "c"), ("b", "a"), ("c", "b"))
    put_all(tier, ("x", None))
    assert names_in(tier, "a", "b", "c", "x") == {"b", "c", "x"}
    tier.check_integrity()


def test_pinned_blocks_are_never_evicted(tier):
    put_all(tier, ("a", None), ("b", None), ("c", None))
    tier.pinned = frozenset({h("a"), h("b")})
    put_all(tier, ("d", None))  # c is the only unpinned leaf
    assert names_in(tier, *"abcd") == {"a", "b", "d"}
    tier.pinned = frozenset({h("a"), h("b"), h("d")})
    assert tier.put(h("e"), None, data_of("e")).result() is False  # nothing left to evict
    assert names_in(tier, *"abde") == {"a", "b", "d"} and tier.stats()["write_failures"] == 0
    tier.check_integrity()


def test_an_evicted_block_does_not_come_back_after_a_restart(tmp_path, direct_io):
    """Its slot goes to the write that evicted it, whose one pwrite replaces the header."""
    tier = tier_at(tmp_path / "nvme", direct_io=direct_io)
    put_all(tier, ("a", None), ("b", None), ("c", None), ("d", None))
    assert names_in(tier, *"abcd") == {"b", "c", "d"} and offset_of(tier, h("d")) == 0  # a's slot
    tier.close()
    again = tier_at(tmp_path / "nvme", direct_io=direct_io)
    assert names_in(again, *"abcd") == {"b", "c", "d"} and same(again.get(h("d")).result(), data_of("d"))
    assert h("a") not in {head.block_hash for head in headers(slab0(again)).values()}
    again.check_integrity()
    again.close()


# -- bad slots are misses ---------------------------------------------------------------------------


def flip_last_payload_byte(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at + ALIGN + PAYLOAD - 1, bytes([slot_bytes(path, at + ALIGN + PAYLOAD - 1, 1)[0] ^ 0x01]))


def flip_header_byte(tier: NvmeTier, path: Path, at: int) -> None:
    """Byte 60 is in the parent hash of a block with one, else in the layout tag (still ASCII)."""
    patch(path, at + 60, bytes([slot_bytes(path, at + 60, 1)[0] ^ 0x01]))


def zero_header(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at, bytes(ALIGN))


def zero_slot(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at, bytes(SLOT))


def truncate_slab(tier: NvmeTier, path: Path, at: int) -> None:
    os.truncate(path, at + SLOT // 2 + 100)


def other_blocks_slot(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at, slot_bytes(path, offset_of(tier, h("other"))))


def old_header_new_payload(tier: NvmeTier, path: Path, at: int) -> None:
    """A torn overwrite: this block's header, and another block's payload that never got its header."""
    patch(path, at + ALIGN, slot_bytes(path, offset_of(tier, h("other")) + ALIGN, SLOT - ALIGN))


def new_header_old_payload(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at, slot_bytes(path, offset_of(tier, h("other")), ALIGN))


def half_written_header(tier: NvmeTier, path: Path, at: int) -> None:
    """Magic and the first half of another header, the rest still this block's: a torn head."""
    patch(path, at, slot_bytes(path, offset_of(tier, h("other")), 40))


def garbage(tier: NvmeTier, path: Path, at: int) -> None:
    patch(path, at, os.urandom(SLOT))


def nonzero_pad(tier: NvmeTier, path: Path, at: int) -> None:
    """The byte just before the payload: padding, which no checksum covers."""
    patch(path, at + ALIGN - 1, b"\x01")


def as_version_2(tier: NvmeTier, path: Path, at: int) -> None:
    """The header's version set to the one-file-per-block format's, with a valid CRC."""
    raw = slot_bytes(path, at, ALIGN)
    header_len = int.from_bytes(raw[10:14], "little")
    header = bytearray(raw[:header_len])
    header[8:10] = (2).to_bytes(2, "little")
    header[-4:] = zlib.crc32(header[:-4]).to_bytes(4, "little")
    patch(path, at, bytes(header))


def foreign_slot(tier: NvmeTier, **layout) -> bytes:
    """A whole slot of a block of another layout, written by a tier of that layout."""
    other_dir = tier.directory.parent / f"foreign-{os.urandom(4).hex()}"
    args = {"layout_tag": TAG, "dtype": torch.float32, "shape": SHAPE, **layout}
    with NvmeTier(other_dir, 1 << 20, args["shape"], args["dtype"], layout_tag=args["layout_tag"]) as other:
        other.put(h("a"), None, block(0, args["dtype"], args["shape"])).result()
        return slot_bytes(slab0(other), 0, other.file_bytes)


def foreign_layout(**layout):
    def write(tier: NvmeTier, path: Path, at: int) -> None:
        patch(path, at, foreign_slot(tier, **layout))

    return write


BAD_SLOTS = {
    "payload byte": flip_last_payload_byte,
    "header byte": flip_header_byte,
    "zeroed header": zero_header,
    "zeroed slot": zero_slot,
    "truncated slab": truncate_slab,
    "another block's slot": other_blocks_slot,
    "old header, new payload": old_header_new_payload,
    "new header, old payload": new_header_old_payload,
    "half-written header": half_written_header,
    "garbage": garbage,
    "nonzero pad": nonzero_pad,
    "version 2": as_version_2,
    "other tag": foreign_layout(layout_tag="other-model/bs4"),
    "other dtype": foreign_layout(dtype=torch.bfloat16),
    "other shape": foreign_layout(shape=(2, 2, 4, 2, 4)),
}


@pytest.mark.parametrize("damage", BAD_SLOTS.values(), ids=list(BAD_SLOTS))
def test_bad_slot_reads_as_a_miss_and_is_erased(tier, damage):
    # direct: the tier reads its own slots with O_DIRECT after they were rewritten through the page cache
    put_all(tier, ("other", None), ("a", "parent-elsewhere"))
    at = offset_of(tier, h("a"))
    damage(tier, slab0(tier), at)
    assert tier.get(h("a")).result() is None
    s = tier.stats()
    assert (s["checksum_failures"], s["misses"], s["hits"]) == (1, 1, 0)
    assert h("a") not in tier and erased(slab0(tier), at)
    assert tier.get(h("a")).result() is None and tier.stats()["checksum_failures"] == 1  # now a plain miss
    # the tier keeps working, including for the hash that was bad, in the same slot
    assert same(tier.get(h("other")).result(), data_of("other"))
    put_all(tier, ("a", None))
    assert same(tier.get(h("a")).result(), data_of("a")) and tier.parent_of(h("a")) is None
    assert offset_of(tier, h("a")) == at
    tier.check_integrity()


def test_bad_slots_in_get_many_are_misses(tier):
    put_all(tier, ("a", None), ("b", None), ("c", None))
    garbage(tier, slab0(tier), offset_of(tier, h("b")))
    truncate_slab(tier, slab0(tier), offset_of(tier, h("c")))
    got = tier.get_many([h("a"), h("b"), h("c")]).result()
    assert same(got[0], data_of("a")) and got[1:] == [None, None]
    assert tier.stats()["checksum_failures"] == 2 and len(tier) == 1
    tier.check_integrity()


def test_check_integrity_catches_disk_and_index_disagreeing(tier):
    put_all(tier, ("a", None), ("b", None))
    zero_header(tier, slab0(tier), offset_of(tier, h("a")))
    with pytest.raises(AssertionError, match="holds"):
        tier.check_integrity()
    assert tier.get(h("a")).result() is None  # the read repairs the index
    tier.check_integrity()
    patch(slab0(tier), 2 * SLOT, slot_bytes(slab0(tier), offset_of(tier, h("b"))))  # b again, in a free slot
    with pytest.raises(AssertionError, match="free slot"):
        tier.check_integrity()
    zero_header(tier, slab0(tier), 2 * SLOT)
    tier.check_integrity()
    (tier.directory / "slab-7.kvs").write_bytes(b"")
    with pytest.raises(AssertionError, match="past the capacity"):
        tier.check_integrity()
    (tier.directory / "slab-7.kvs").unlink()
    (tier.directory / "ab").mkdir()
    (tier.directory / "ab" / f"{h('a').hex()}.kvb").write_bytes(b"x")
    with pytest.raises(AssertionError, match="one-file-per-block"):
        tier.check_integrity()


# -- a slot being read ---------------------------------------------------------------------------------


@pytest.fixture
def held_read(monkeypatch):
    """The first slot read blocks at its start until `release` is set."""
    started, release = threading.Event(), threading.Event()
    read = SlabFiles.read

    def blocking_read(self, slot, buf):
        if not started.is_set():
            started.set()
            assert release.wait(10)
        return read(self, slot, buf)

    monkeypatch.setattr(SlabFiles, "read", blocking_read)
    return started, release


def test_a_slot_being_read_is_not_evicted_for_a_write(tmp_path, held_read):
    started, release = held_read
    tier = tier_at(tmp_path / "nvme", capacity=SLOT)  # one slot
    put_all(tier, ("a", None))
    got = tier.get(h("a"))
    assert started.wait(10)
    assert tier.put(h("b"), None, data_of("b")).result() is False  # the only victim is being read
    release.set()
    assert same(got.result(), data_of("a"))
    put_all(tier, ("b", None))
    assert names_in(tier, "a", "b") == {"b"}
    tier.check_integrity()
    tier.close()


def test_a_slot_discarded_while_read_is_erased_when_the_read_ends(tmp_path, held_read):
    started, release = held_read
    tier = tier_at(tmp_path / "nvme", capacity=2 * SLOT)
    put_all(tier, ("x", None), ("a", None))
    a_at = offset_of(tier, h("a"))
    got = tier.get(h("a"))
    assert started.wait(10)
    assert tier.discard(h("a")) is True and h("a") not in tier
    put_all(tier, ("b", None))  # no free slot: a's waits for its read, so x goes
    assert names_in(tier, "x", "b") == {"b"} and offset_of(tier, h("b")) != a_at
    tier.check_integrity()  # a's slot is accounted for while it waits
    assert not erased(slab0(tier), a_at)
    release.set()
    assert same(got.result(), data_of("a"))  # the bytes of the block asked for, read before the erase
    tier.close()
    assert erased(slab0(tier), a_at)
    again = tier_at(tmp_path / "nvme", capacity=2 * SLOT)
    assert names_in(again, "a", "b", "x") == {"b"}
    again.check_integrity()
    again.close()


def test_a_write_discarded_mid_flight_leaves_no_block_on_disk(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    write = SlabFiles.write

    def blocking_write(self, slot, data):
        write(self, slot, data)
        started.set()
        assert release.wait(10)

    monkeypatch.setattr(SlabFiles, "write", blocking_write)
    tier = tier_at(tmp_path / "nvme", c_io=False)  # the C IO threads' case: test_nvme_c_io.py
    put = tier.put(h("a"), None, data_of("a"))
    assert started.wait(10)
    assert headers(slab0(tier))[0].block_hash == h("a")  # on disk, not yet in the index
    assert h("a") not in tier and tier.discard(h("a")) is True
    release.set()
    assert put.result() is False
    assert erased(slab0(tier), 0) and len(tier) == 0
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme")
    assert len(again) == 0
    again.close()


# -- restart -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reopen_direct", [True, False], ids=["reopen-direct", "reopen-buffered"])
def test_restart_finds_the_same_blocks(tmp_path, direct_io, reopen_direct):
    """The format does not depend on the mode, so either mode reopens what either wrote."""
    if reopen_direct and not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    tier = tier_at(tmp_path / "nvme", dtype=torch.bfloat16, capacity=1 << 20, direct_io=direct_io)
    chain = [(f"b{i}", f"b{i - 1}" if i else None) for i in range(5)]
    for i, (name, parent) in enumerate(chain):
        tier.put(h(name), h(parent) if parent else None, block(i, torch.bfloat16))
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(h("z"), None, block(0, torch.bfloat16))
    with pytest.raises(RuntimeError, match="closed"):
        tier.discard(h("b0"))
    used = tier.used_bytes

    again = tier_at(tmp_path / "nvme", dtype=torch.bfloat16, capacity=1 << 20, direct_io=reopen_direct)
    assert len(again) == 5 and again.used_bytes == used
    assert all(again.parent_of(h(n)) == (h(p) if p else None) for n, p in chain)
    got = again.get_many([h(n) for n, _ in chain]).result()
    assert all(same(t, block(i, torch.bfloat16)) for i, t in enumerate(got))
    again.check_integrity()
    again.close()


def test_restart_drops_bad_slots_and_old_files_and_leaves_foreign_ones(tmp_path, direct_io):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    names = "abcdefghij"
    put_all(tier, *[(n, None) for n in names])
    at = {n: offset_of(tier, h(n)) for n in names}
    assert [at[n] for n in names] == [i * SLOT for i in range(10)]
    tier.close()
    path = slab0(tier)
    flip_header_byte(tier, path, at["a"])  # dropped
    zero_header(tier, path, at["b"])  # erased: free space, not counted
    patch(path, at["c"], slot_bytes(path, at["d"]))  # d in two slots: one is dropped
    flip_last_payload_byte(tier, path, at["f"])  # header intact: only a read can tell
    as_version_2(tier, path, at["g"])  # dropped
    foreign = foreign_slot(tier, layout_tag="old-layout")
    patch(path, at["h"], foreign)  # foreign: left in place, free to this tier
    patch(path, at["i"], slot_bytes(path, at["e"], 40))  # a half-written header: dropped
    os.truncate(path, at["j"] + ALIGN + 100)  # j's head is there, its payload is not: dropped
    legacy = tmp_path / "nvme" / "ab"
    legacy.mkdir()
    (legacy / f"{h('a').hex()}.kvb").write_bytes(b"an old block file")
    (legacy / ".crashed-writer.tmp").write_bytes(b"half a block")
    (tmp_path / "nvme" / "cd").mkdir()
    (tmp_path / "nvme" / "cd" / "notes.txt").write_bytes(b"not ours")

    again = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    assert names_in(again, *names) == {"d", "e", "f"}
    s = again.stats()
    assert (s["dropped_at_open"], s["foreign_files"], s["evictions"]) == (7, 1, 0)
    assert not legacy.exists() and (tmp_path / "nvme" / "cd" / "notes.txt").exists()
    assert slot_bytes(path, at["h"], len(foreign)) == foreign
    assert all(erased(path, at[n]) for n in "abgij")
    assert path.stat().st_size == s["slots"] * SLOT  # the truncated slab is whole again
    assert again.get(h("f")).result() is None and again.stats()["checksum_failures"] == 1
    assert same(again.get(h("d")).result(), data_of("d")) and same(again.get(h("e")).result(), data_of("e"))
    again.check_integrity()
    put_all(again, *[(n, None) for n in "abcghij"])  # the freed slots, foreign one included, are reused
    assert names_in(again, *names) == set(names) - {"f"}
    again.check_integrity()
    again.close()


@pytest.mark.parametrize("newer", ["copy", "original"])
def test_a_block_in_two_slots_keeps_the_newer_write(tmp_path, newer):
    """A crash between a discard and its erase can leave a block in an old slot and a new one."""
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20)
    put_all(tier, ("a", None), ("b", None), ("c", None))
    tier.close()
    path = slab0(tier)
    rewrite_header(path, 2 * SLOT, block_hash=h("a"), seq=9 if newer == "copy" else 1)  # c's bytes, named a
    if newer == "original":
        rewrite_header(path, 0, seq=9)
    again = tier_at(tmp_path / "nvme", capacity=1 << 20)
    assert names_in(again, "a", "b", "c") == {"a", "b"} and again.stats()["dropped_at_open"] == 1
    assert same(again.get(h("a")).result(), data_of("c" if newer == "copy" else "a"))
    assert erased(path, 0 if newer == "copy" else 2 * SLOT)
    put_all(again, ("d", None))
    assert headers(path)[0 if newer == "copy" else 2 * SLOT].block_hash == h("d")  # sequence numbers go on
    assert BlockHeader.parse(slot_bytes(path, offset_of(again, h("d")))).seq == 10
    again.check_integrity()
    again.close()


BIG = (4, 2, 16, 2, 8)  # a payload of two 4096-byte pages, so half a slot ends inside it
BIG_SLOT = ALIGN + 2 * ALIGN
TORN = {
    "new header, old payload": lambda old, new: new[:ALIGN] + old[ALIGN:],
    "old header, new payload": lambda old, new: old[:ALIGN] + new[ALIGN:],
    "half of the new slot": lambda old, new: new[:BIG_SLOT // 2] + old[BIG_SLOT // 2:],
    "all but the first page": lambda old, new: old[:ALIGN] + new[ALIGN:ALIGN * 2] + old[ALIGN * 2:],
    "part of the new header": lambda old, new: new[:100] + old[100:],
}


@pytest.mark.parametrize("tear", TORN.values(), ids=list(TORN))
def test_a_torn_slot_write_reads_as_a_miss_after_a_restart(tmp_path, tear):
    """A crash while block y overwrites evicted block x's slot leaves some pages of each."""
    def big_tier(path: Path, capacity: int = BIG_SLOT) -> NvmeTier:
        return NvmeTier(path, capacity, BIG, torch.float32, layout_tag=TAG)

    with big_tier(tmp_path / "x") as tier:
        assert tier.file_bytes == BIG_SLOT
        tier.put(h("x"), None, block(1, shape=BIG)).result()
        old = slab0(tier).read_bytes()
    with big_tier(tmp_path / "y") as tier:
        tier.put(h("y"), None, block(2, shape=BIG)).result()
        new = slab0(tier).read_bytes()
    slab0(tier).write_bytes(tear(old, new))
    again = big_tier(tmp_path / "y")
    assert again.get(h("x")).result() is None and again.get(h("y")).result() is None
    s = again.stats()
    assert s["dropped_at_open"] + s["checksum_failures"] == 1 and len(again) == 0
    assert erased(slab0(again), 0)
    assert again.put(h("y"), None, block(2, shape=BIG)).result() is True
    assert same(again.get(h("y")).result(), block(2, shape=BIG))
    again.check_integrity()
    again.close()


def test_restart_over_capacity_keeps_the_newest_writes_and_moves_them_in(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20)
    put_all(tier, *[(n, None) for n in "abcde"])  # slots 0-4, written in that order
    tier.discard(h("c"))
    put_all(tier, ("c", None))  # back in slot 2, now the newest write
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=2 * SLOT)  # slots 0 and 1
    assert names_in(again, *"abcde") == {"e", "c"} and again.stats()["evictions"] == 3
    assert same(again.get(h("c")).result(), data_of("c")) and same(again.get(h("e")).result(), data_of("e"))
    assert slab0(again).stat().st_size == 2 * SLOT and sorted(headers(slab0(again))) == [0, SLOT]
    again.check_integrity()
    again.close()


def test_slabs_are_created_as_slots_fill_and_survive_a_new_geometry(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=5 * SLOT, slab_bytes=2 * SLOT)  # slabs of 2, 2 and 1 slots
    assert slabs(tier.directory) == [] and tier.stats()["slab_files"] == 0
    put_all(tier, *[(n, None) for n in "abc"])
    assert [p.stat().st_size for p in slabs(tier.directory)] == [2 * SLOT, 2 * SLOT]
    assert tier.stats()["slab_files"] == 2
    put_all(tier, *[(n, None) for n in "de"])
    assert [p.stat().st_size for p in slabs(tier.directory)] == [2 * SLOT, 2 * SLOT, SLOT]
    assert [sorted(headers(p)) for p in slabs(tier.directory)] == [[0, SLOT], [0, SLOT], [0]]
    tier.check_integrity()
    tier.close()
    # slabs of 4 slots: slab-1 now starts at slot 4, so d and e move into slots 2 and 3 of slab-0
    again = tier_at(tmp_path / "nvme", capacity=5 * SLOT, slab_bytes=4 * SLOT)
    assert names_in(again, *"abcde") == set("abcde") and again.stats()["dropped_at_open"] == 0
    assert [p.stat().st_size for p in slabs(again.directory)] == [4 * SLOT, SLOT]
    assert all(same(t, data_of(n)) for t, n in zip(again.get_many([h(n) for n in "abcde"]).result(), "abcde"))
    again.check_integrity()
    again.close()
    bigger = tier_at(tmp_path / "nvme", capacity=8 * SLOT, slab_bytes=4 * SLOT)
    put_all(bigger, *[(n, None) for n in "fgh"])
    assert len(bigger) == 8 and [p.stat().st_size for p in slabs(bigger.directory)] == [4 * SLOT, 4 * SLOT]
    bigger.check_integrity()
    bigger.close()


def test_foreign_slots_are_free_space(tmp_path):
    with NvmeTier(tmp_path / "nvme", 4 * SLOT, SHAPE, torch.float32, layout_tag="another-model") as other:
        for n in "wxyz":
            assert other.put(h(n), None, data_of(n)).result() is True
    tier = tier_at(tmp_path / "nvme", capacity=4 * SLOT)
    assert len(tier) == 0 and tier.stats()["foreign_files"] == 4 and tier.stats()["evictions"] == 0
    put_all(tier, ("a", None), ("b", None))
    assert offset_of(tier, h("a")) == 0 and offset_of(tier, h("b")) == SLOT
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=4 * SLOT)
    assert names_in(again, "a", "b", "w") == {"a", "b"} and again.stats()["foreign_files"] == 2
    again.close()


def test_one_tier_per_directory(tmp_path):
    tier = tier_at(tmp_path / "nvme")
    with pytest.raises(RuntimeError, match="already open"):
        tier_at(tmp_path / "nvme")
    tier.close()
    tier_at(tmp_path / "nvme").close()


# -- the slot format and O_DIRECT --------------------------------------------------------------------


@pytest.mark.parametrize("tag, offset", [(TAG, ALIGN), ("t" * 5000, 2 * ALIGN)], ids=["short", "past 4096"])
def test_payload_starts_aligned_after_zero_padding(tmp_path, direct_io, tag, offset):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20, layout_tag=tag, direct_io=direct_io)
    assert tier.file_bytes == offset + round_up(PAYLOAD)
    put_all(tier, ("a", "parent-elsewhere"), ("b", None))
    raw = slot_bytes(slab0(tier), offset_of(tier, h("a")), tier.file_bytes)
    header_len = int.from_bytes(raw[10:14], "little")
    header = BlockHeader.parse(memoryview(raw))
    assert header.payload_offset == offset and header_len < offset
    assert raw[header_len:offset] == bytes(offset - header_len)
    assert raw[offset:offset + PAYLOAD] == bytes(bits(data_of("a")).numpy())
    assert raw[offset + PAYLOAD:] == bytes(tier.file_bytes - offset - PAYLOAD)  # zeros to the slot's end
    assert (header.block_hash, header.parent_hash, header.layout_tag) == (h("a"), h("parent-elsewhere"), tag)
    assert (header.payload_len, header.payload_crc) == (PAYLOAD, zlib.crc32(bits(data_of("a")).numpy()))
    assert header.seq == 0 and BlockHeader.parse(slot_bytes(slab0(tier), tier.file_bytes, offset)).seq == 1
    assert same(tier.get(h("a")).result(), data_of("a"))
    tier.check_integrity()
    tier.close()


def test_auto_mode_uses_direct_io_where_the_file_system_takes_it(tmp_path):
    expected = direct_io_works(tmp_path)  # True on this machine's ext4
    tier = tier_at(tmp_path / "nvme")
    assert tier.direct_io is expected and tier.stats()["direct_io"] is expected
    assert [p.name for p in tier.directory.iterdir()] == [".lock"]  # the probe removed its file
    tier.close()


def test_the_probe_answers_for_its_directory(tmp_path):
    assert supports_direct_io(tmp_path) is direct_io_works(tmp_path)
    assert supports_direct_io(tmp_path / "missing") is False
    assert list(tmp_path.iterdir()) == []


def test_direct_io_true_where_the_file_system_refuses_raises(tmp_path, monkeypatch):
    # this kernel's tmpfs takes O_DIRECT too, so no directory here refuses it: stand in for one
    monkeypatch.setattr(nvme, "supports_direct_io", lambda directory: False)
    with pytest.raises(ValueError, match="direct_io"):
        tier_at(tmp_path / "nvme", direct_io=True)
    auto = tier_at(tmp_path / "nvme")  # the failed open released the directory
    assert auto.direct_io is False and auto.stats()["direct_io"] is False
    put_all(auto, ("a", None))
    assert same(auto.get(h("a")).result(), data_of("a"))
    auto.check_integrity()
    auto.close()


def in_page_cache(path: Path, offset: int, n: int) -> bool:
    """Whether every page of [offset, offset + n) is in the page cache: mincore on a mapping of the
    file, which asks without reading, so the check brings nothing in (a read would start readahead)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
            assert libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
            first, last = offset // mmap.PAGESIZE, (offset + n - 1) // mmap.PAGESIZE
            return all(b & 1 for b in pages.raw[first:last + 1])
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux: posix_fadvise and mincore")
def test_direct_io_keeps_blocks_out_of_the_page_cache(tmp_path, direct_io):
    """The DRAM tier above caches blocks already: direct writes, reads and index rebuilds must not."""
    tier = tier_at(tmp_path / "nvme", direct_io=direct_io)
    put_all(tier, ("x", None), ("a", None))
    assert same(tier.get(h("a")).result(), data_of("a"))
    path, at = slab0(tier), SLOT  # the second slot (found by reading, which would fill the page cache)
    assert in_page_cache(path, at + ALIGN, PAYLOAD) is not direct_io
    tier.close()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # buffered: drop what the writes and reads cached
    os.close(fd)
    again = tier_at(tmp_path / "nvme", direct_io=direct_io)  # reads every head
    assert h("a") in again and same(again.get(h("a")).result(), data_of("a"))
    assert in_page_cache(path, at + ALIGN, PAYLOAD) is not direct_io
    assert in_page_cache(path, 0, ALIGN) is not direct_io
    assert offset_of(again, h("a")) == at
    again.close()


# -- bandwidth accounting ----------------------------------------------------------------------------


def test_busy_clock_counts_overlapping_operations_once():
    now = [1.0]
    clock = BusyClock(lambda: now[0])
    a = clock.begin()
    now[0] = 2.0
    b = clock.begin()
    now[0] = 3.0
    assert clock.end() - a == 2.0
    assert clock.seconds == 2.0  # [1, 3] so far, b still open
    now[0] = 5.0
    assert clock.end() - b == 3.0
    now[0] = 7.0
    clock.begin()
    now[0] = 7.5
    clock.end()
    now[0] = 100.0
    assert clock.seconds == 4.5  # [1, 5] + [7, 7.5]: not the summed 5.5, nor the span 6.5


def test_busy_seconds_are_the_time_any_io_thread_was_busy(tmp_path, direct_io):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 22, num_io_threads=2, direct_io=direct_io)
    s = tier.stats()
    assert (s["read_busy_seconds"], s["write_busy_seconds"]) == (0.0, 0.0)
    names = [f"n{i}" for i in range(40)]
    assert all(f.result() for f in [tier.put(h(n), None, data_of(n)) for n in names])  # 2 threads at once
    for n in names[:5]:  # one at a time with idle gaps, which are not busy time
        threading.Event().wait(0.01)
        assert same(tier.get(h(n)).result(), data_of(n))
    got = tier.get_many([h(n) for n in names]).result()  # 2 threads at once
    assert all(same(t, data_of(n)) for t, n in zip(got, names, strict=True))
    s = tier.stats()
    assert 0 < s["write_busy_seconds"] <= s["write_seconds"]
    assert 0 < s["read_busy_seconds"] <= s["read_seconds"]
    assert s["bytes_written"] == 40 * SLOT and s["bytes_read"] == 45 * SLOT
    keys = {"blocks", "used_bytes", "capacity_bytes", "pending_writes", "direct_io", "hits", "misses", "writes",
            "write_failures", "evictions", "discards", "checksum_failures", "dropped_at_open", "foreign_files",
            "bytes_read", "bytes_written", "read_seconds", "write_seconds", "slots", "slab_files"}
    assert keys <= s.keys()
    tier.check_integrity()
    tier.close()


# -- threads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("c_io", [None, False], ids=["c-io", "python-io"])
def test_threads_never_see_torn_or_foreign_data(tmp_path, direct_io, c_io):
    """Blocks i carry the value i*1000 + version everywhere: a read (get, or get_many of one or two
    blocks) must be one whole version of i."""
    tier = tier_at(tmp_path / "nvme", capacity=12 * SLOT, num_io_threads=3, direct_io=direct_io, c_io=c_io)
    hashes = [h(f"t{i}") for i in range(30)]
    errors: list[str] = []

    def worker(seed: int) -> None:
        try:
            work(seed)
        except Exception as e:  # noqa: BLE001 - a thread's exception would otherwise vanish
            errors.append(repr(e))

    def work(seed: int) -> None:
        rng = random.Random(seed)
        pending = []
        for step in range(500):
            i = rng.randrange(len(hashes))
            op = rng.random()
            if op < 0.45:
                parent = hashes[i - 1] if i and rng.random() < 0.5 else None
                pending.append(tier.put(hashes[i], parent, torch.full(SHAPE, float(i * 1000 + step % 7))))
            elif op < 0.7:
                pending.append(([i], tier.get(hashes[i])))
            elif op < 0.9:
                ids = [i, rng.randrange(len(hashes))]
                pending.append((ids, tier.get_many([hashes[k] for k in ids])))
            else:
                tier.discard(hashes[i])
        for p in pending:
            if isinstance(p, tuple):
                ids, future = p
                got = future.result()
                for i, t in zip(ids, got if isinstance(got, list) else [got]):
                    if t is not None and not (t.eq(t.view(-1)[0]).all() and int(t.view(-1)[0]) // 1000 == i):
                        errors.append(f"block {i} read back torn or foreign data")
            elif p.result() not in (True, False):
                errors.append(f"put resolved to {p.result()!r}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.flush()
    assert errors == []
    s = tier.stats()
    assert s["checksum_failures"] == 0 and s["writes"] > 0 and s["hits"] > 0 and s["evictions"] > 0
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=12 * SLOT, direct_io=direct_io)  # what is on disk is whole too
    assert again.stats()["dropped_at_open"] == 0
    for i, t in enumerate(again.get_many(hashes).result()):
        assert t is None or (t.eq(t.view(-1)[0]).all() and int(t.view(-1)[0]) // 1000 == i)
    again.check_integrity()
    again.close()


# -- a model of the rule -----------------------------------------------------------------------------

NAMES = [h(f"m{i}") for i in range(6)]
ROOT = h("outside")
SMALL = (2, 4)


class TierVersusModel(RuleBasedStateMachine):
    """The tier against a brute-force model: least-recently-used leaf first, LRU if no leaf at all.
    A restart keeps the blocks, with the order of their writes as their recency."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="nvme-model-"))
        self.tier = NvmeTier(self.dir / "tier", 3 * 2 * ALIGN, SMALL, torch.float32)
        self.model: dict[bytes, list] = {}  # hash -> [parent, last_access, data, write number]
        self.tick = 0
        self.version = 0
        self.num_writes = 0

    def touch(self, key: bytes) -> None:
        self.tick += 1
        self.model[key][1] = self.tick

    def victim(self) -> bytes:
        parents = {p for p, _, _, _ in self.model.values()}
        leaves = [k for k in self.model if k not in parents] or list(self.model)
        return min(leaves, key=lambda k: self.model[k][1])

    @rule(i=st.integers(0, 5), parent=st.integers(-1, 5))
    def put(self, i, parent):
        key, parent_hash = NAMES[i], NAMES[parent] if parent >= 0 and parent != i else ROOT
        self.version += 1
        data = torch.full(SMALL, float(self.version))
        assert self.tier.put(key, parent_hash, data).result() is True
        if key in self.model:
            self.touch(key)
            return
        while len(self.model) >= 3:
            del self.model[self.victim()]
        self.num_writes += 1
        self.model[key] = [parent_hash, 0, data, self.num_writes]
        self.touch(key)

    @rule(i=st.integers(0, 5))
    def get(self, i):
        got = self.tier.get(NAMES[i]).result()
        if NAMES[i] in self.model:
            assert same(got, self.model[NAMES[i]][2])
            self.touch(NAMES[i])
        else:
            assert got is None

    @rule(picks=st.lists(st.integers(0, 5), max_size=4))
    def get_many(self, picks):
        got = self.tier.get_many([NAMES[i] for i in picks]).result()
        for i, t in zip(picks, got, strict=True):
            if NAMES[i] in self.model:
                assert same(t, self.model[NAMES[i]][2])
                self.touch(NAMES[i])
            else:
                assert t is None

    @rule(i=st.integers(0, 5))
    def discard(self, i):
        assert self.tier.discard(NAMES[i]) == (self.model.pop(NAMES[i], None) is not None)

    @precondition(lambda self: self.model)
    @rule()
    def restart(self):
        self.tier.close()
        self.tier = NvmeTier(self.dir / "tier", 3 * 2 * ALIGN, SMALL, torch.float32)
        for key in sorted(self.model, key=lambda k: self.model[k][3]):
            self.touch(key)

    @invariant()
    def agrees(self):
        assert {k for k in NAMES if k in self.tier} == set(self.model)
        assert all(self.tier.parent_of(k) == p for k, (p, _, _, _) in self.model.items())
        self.tier.check_integrity()

    def teardown(self):
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTierVersusModel = TierVersusModel.TestCase
TestTierVersusModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.parametrize("fast_crc", [True, False])
def test_a_staged_slot_is_the_same_bytes_with_the_c_crc_or_zlib(monkeypatch, fast_crc):
    """The IO threads stage a block with the C kernels' copy-and-CRC where it is the faster one, and
    with numpy and zlib elsewhere: the same slot bytes either way, so a directory written on one
    machine reads on another, and either way a flipped payload byte fails the check."""
    from kvstrata.tiering import slot_codec
    from kvstrata.worker.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if fast_crc and (kernels is None or not kernels.crc32_fast):
        pytest.skip("no carry-less multiply CRC here")
    block = torch.randn(4, 2, 16, 3, 8, generator=torch.Generator().manual_seed(3))
    # a parent and a sequence number: the C path fills the CRCs in around them
    header = BlockHeader(b"h" * 16, b"p" * 20, "test-layout", "float32", tuple(block.shape), block.numel() * 4, 0,
                         seq=0x0102030405)
    slot_bytes = round_up(header.payload_offset + header.payload_len)

    def staged(use_fast: bool) -> torch.Tensor:
        monkeypatch.setattr(slot_codec, "_fast_crc", lambda: kernels if use_fast else None)
        slot = torch.full((slot_bytes,), 0xAB, dtype=torch.uint8)
        slot_codec.stage(slot, header, block)
        return slot

    slot = staged(fast_crc)
    assert torch.equal(slot, staged(False))
    parsed = BlockHeader.parse(slot.numpy())
    assert parsed.payload_crc == zlib.crc32(block.numpy().tobytes()) and parsed.seq == 0x0102030405
    assert parsed.parent_hash == b"p" * 20
    if fast_crc:
        with pytest.raises(ValueError, match="do not fit a slot"):
            kernels.stage_slot(slot[:-1], header.pack(), 100, block)
    monkeypatch.setattr(slot_codec, "_fast_crc", lambda: kernels if fast_crc else None)
    back = slot_codec.unstage(slot, b"h" * 16, lambda h: True, torch.float32, tuple(block.shape))
    assert torch.equal(back, block)
    # a CRC taken already (by a C IO thread) is used where it covers exactly the payload
    crc, p, n = parsed.payload_crc, header.payload_offset, header.payload_len
    unstage = slot_codec.unstage
    assert torch.equal(unstage(slot, b"h" * 16, lambda h: True, torch.float32, tuple(block.shape), (p, n, crc)), block)
    with pytest.raises(ValueError, match="checksum"):
        unstage(slot, b"h" * 16, lambda h: True, torch.float32, tuple(block.shape), (p, n, crc ^ 1))
    # elsewhere it is ignored and the check takes its own
    assert torch.equal(unstage(slot, b"h" * 16, lambda h: True, torch.float32, tuple(block.shape),
                               (p + 4096, n, crc ^ 1)), block)
    slot[header.payload_offset + 100] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        slot_codec.unstage(slot, b"h" * 16, lambda h: True, torch.float32, tuple(block.shape))


def _thread_slice_ns() -> int | None:
    """The calling thread's scheduler slice, where the kernel shows one (Linux 6.6 on)."""
    try:
        lines = Path(f"/proc/self/task/{threading.get_native_id()}/sched").read_text().splitlines()
    except OSError:
        return None
    found = [ln.split(":")[1] for ln in lines if ln.split(":")[0].strip() == "se.slice"]
    return int(float(found[0])) if found else None


def test_io_threads_ask_for_a_short_scheduler_slice(tmp_path, monkeypatch):
    """Each IO thread asks for a 100 us slice (disk_io.request_short_slice), so that it gets a core
    as soon as its IO ends; 0 asks for none; a bad value names the variable. The caller's own
    thread is left as it was."""
    main_slice = _thread_slice_ns()
    with tier_at(tmp_path / "a") as t:
        assert t.put(b"h" * 8, None, block(1)).result() is True
        io_slice = t._executor.submit(_thread_slice_ns).result()
        if main_slice is None or t.stats()["short_slice_io_threads"] == 0:
            pytest.skip("this kernel shows no slice or takes no slice request")
        assert io_slice == 100_000 and t.io_slice_us == 100
        assert t.stats()["short_slice_io_threads"] >= 1
    assert _thread_slice_ns() == main_slice
    monkeypatch.setenv("KVSTRATA_NVME_IO_SLICE_US", "0")
    with tier_at(tmp_path / "b") as t:
        assert t.put(b"h" * 8, None, block(1)).result() is True
        assert t._executor.submit(_thread_slice_ns).result() == main_slice
        assert t.stats()["short_slice_io_threads"] == 0
    for bad in ("50", "abc", "-1", "200000"):
        monkeypatch.setenv("KVSTRATA_NVME_IO_SLICE_US", bad)
        with pytest.raises(ValueError, match="KVSTRATA_NVME_IO_SLICE_US"):
            tier_at(tmp_path / "c")
