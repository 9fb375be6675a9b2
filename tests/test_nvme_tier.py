"""NvmeTier: round trips, leaf-first LRU by bytes, bad files as misses, restart, threads, the
aligned file format, O_DIRECT and busy-time accounting.

Every scenario ends with `check_integrity()`. The core scenarios run with O_DIRECT and through the
page cache. Bad files are made by hand on disk (flipped bytes, truncation, renames, foreign
layouts, garbage, version-1 files, stale temp files), and a stateful test drives the tier against
a brute-force model of the eviction rule, restarts included.
"""

from __future__ import annotations

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

SHAPE = (2, 2, 4, 2, 8)  # [layers, k/v, block_size, kv_heads, head_dim]
TAG = "test-model/bs4"
PAYLOAD = math.prod(SHAPE) * 4  # float32
# with or without a parent, the header pads to the same offset, so every file here has one size
FILE = BlockHeader(b"h" * 32, b"p" * 32, TAG, "float32", SHAPE, PAYLOAD, 0).payload_offset + PAYLOAD
THREE_BLOCKS = 3 * FILE  # 3 blocks fit and 4 do not


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


def path_of(tier: NvmeTier, block_hash: bytes) -> Path:
    return tier.directory / block_hash.hex()[:2] / f"{block_hash.hex()}.kvb"


def files(directory: Path, pattern: str = "*.kvb") -> list[Path]:
    return sorted(directory.glob(f"*/{pattern}"))


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
    t = tier_at(tmp_path / "nvme", direct_io=direct_io)
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
    on_disk = sum(p.stat().st_size for p in files(tier.directory))
    assert s["bytes_written"] == s["used_bytes"] == tier.used_bytes == on_disk
    assert on_disk == 3 * (ALIGN + math.prod(SHAPE) * dtype.itemsize)
    assert s["bytes_read"] == s["bytes_written"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in files(tier.directory)] == [0o600] * 3
    assert {stat.S_IMODE(p.stat().st_mode) for p in tier.directory.glob("??")} == {0o700}
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    assert files(tier.directory, ".*.tmp") == []
    tier.check_integrity()
    tier.close()


def test_file_names_come_from_the_hash(tier):
    put_all(tier, ("a", None))
    assert files(tier.directory) == [path_of(tier, h("a"))]


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
    got.zero_()  # the caller's copy to keep: it must not reach the file
    assert put.result() is True and tier.put(h("a"), None, data_of("a")).result() is True
    assert same(tier.get(h("a")).result(), data_of("a"))
    assert tier.stats()["writes"] == 1
    tier.check_integrity()


def test_block_bigger_than_the_capacity_is_not_stored(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=FILE - 1)  # the padded header counts too
    assert tier.put(h("a"), None, block(0)).result() is False
    assert len(tier) == 0 and tier.used_bytes == 0 and files(tier.directory) == []
    tier.check_integrity()
    tier.close()
    exact = tier_at(tmp_path / "exact", capacity=FILE)
    assert exact.put(h("a"), None, block(0)).result() is True and exact.used_bytes == FILE
    exact.check_integrity()
    exact.close()


def test_discard_removes_file_and_entry(tier):
    put_all(tier, ("a", None), ("b", "a"))
    assert tier.discard(h("b")) is True
    assert tier.discard(h("b")) is False
    assert names_in(tier, "a", "b") == {"a"} and files(tier.directory) == [path_of(tier, h("a"))]
    assert tier.get(h("b")).result() is None
    tier.check_integrity()


def test_discard_of_a_write_in_flight_wins(tier):
    put = tier.put(h("a"), None, data_of("a"))
    assert tier.discard(h("a")) is True  # the write is pending or already done; either way it goes
    tier.flush()
    assert put.result() in (True, False) and h("a") not in tier and len(tier) == 0
    assert files(tier.directory) == [] and files(tier.directory, ".*.tmp") == []
    tier.check_integrity()


# -- eviction: LRU by bytes, leaves first ------------------------------------------------------------


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


# -- bad files are misses ---------------------------------------------------------------------------


def flip_last_byte(tier: NvmeTier, path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(raw)


def flip_header_byte(tier: NvmeTier, path: Path) -> None:
    """Byte 60 is in the parent hash of a block with one, else in the layout tag (still ASCII)."""
    raw = bytearray(path.read_bytes())
    raw[60] ^= 0x01
    path.write_bytes(raw)


def pad(tier: NvmeTier, path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4)


def truncate(tier: NvmeTier, path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def other_blocks_file(tier: NvmeTier, path: Path) -> None:
    shutil.copyfile(path_of(tier, h("other")), path)


def garbage(tier: NvmeTier, path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def empty(tier: NvmeTier, path: Path) -> None:
    path.write_bytes(b"")


def nonzero_pad(tier: NvmeTier, path: Path) -> None:
    """The byte just before the payload: padding, which no checksum covers."""
    raw = bytearray(path.read_bytes())
    raw[ALIGN - 1] = 0x01
    path.write_bytes(raw)


def as_version_1(tier: NvmeTier, path: Path) -> None:
    """Rewrite a file in the old format: a version-1 header, valid CRC, the payload right after it."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[10:14], "little")
    header = bytearray(raw[:header_len])
    header[8:10] = (1).to_bytes(2, "little")
    header[-4:] = zlib.crc32(header[:-4]).to_bytes(4, "little")
    path.write_bytes(bytes(header) + raw[round_up(header_len):])


def foreign_layout(**layout):
    def write(tier: NvmeTier, path: Path) -> None:
        other_dir = tier.directory.parent / "foreign"
        args = {"layout_tag": TAG, "dtype": torch.float32, "shape": SHAPE, **layout}
        with NvmeTier(other_dir, 1 << 20, args["shape"], args["dtype"], layout_tag=args["layout_tag"]) as other:
            other.put(h("a"), None, block(0, args["dtype"], args["shape"])).result()
            shutil.copyfile(path_of(other, h("a")), path)

    return write


BAD_FILES = {
    "payload byte": flip_last_byte,
    "header byte": flip_header_byte,
    "truncated": truncate,
    "padded": pad,
    "another block's file": other_blocks_file,
    "garbage": garbage,
    "empty": empty,
    "nonzero pad": nonzero_pad,
    "version 1": as_version_1,
    "other tag": foreign_layout(layout_tag="other-model/bs4"),
    "other dtype": foreign_layout(dtype=torch.bfloat16),
    "other shape": foreign_layout(shape=(2, 2, 4, 2, 4)),
}


@pytest.mark.parametrize("damage", BAD_FILES.values(), ids=list(BAD_FILES))
def test_bad_file_reads_as_a_miss_and_is_dropped(tier, damage):
    # direct: the tier reads its own files with O_DIRECT after they were rewritten through the page cache
    put_all(tier, ("a", "parent-elsewhere"), ("other", None))
    damage(tier, path_of(tier, h("a")))
    assert tier.get(h("a")).result() is None
    s = tier.stats()
    assert (s["checksum_failures"], s["misses"], s["hits"]) == (1, 1, 0)
    assert h("a") not in tier and not path_of(tier, h("a")).is_file()
    assert tier.get(h("a")).result() is None and tier.stats()["checksum_failures"] == 1  # now a plain miss
    # the tier keeps working, including for the hash that was bad
    assert same(tier.get(h("other")).result(), data_of("other"))
    put_all(tier, ("a", None))
    assert same(tier.get(h("a")).result(), data_of("a")) and tier.parent_of(h("a")) is None
    tier.check_integrity()


def test_bad_files_in_get_many_are_misses(tier):
    put_all(tier, ("a", None), ("b", None), ("c", None))
    garbage(tier, path_of(tier, h("b")))
    truncate(tier, path_of(tier, h("c")))
    got = tier.get_many([h("a"), h("b"), h("c")]).result()
    assert same(got[0], data_of("a")) and got[1:] == [None, None]
    assert tier.stats()["checksum_failures"] == 2 and len(tier) == 1
    tier.check_integrity()


def test_check_integrity_catches_disk_and_index_disagreeing(tier):
    put_all(tier, ("a", None), ("b", None))
    path_of(tier, h("a")).unlink()
    with pytest.raises(AssertionError, match="no file"):
        tier.check_integrity()
    assert tier.get(h("a")).result() is None  # the read repairs the index
    tier.check_integrity()
    stray = path_of(tier, h("b")).parent / ".leftover.tmp"
    stray.write_bytes(b"x")
    with pytest.raises(AssertionError, match="temp files"):
        tier.check_integrity()


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
    used = tier.used_bytes

    again = tier_at(tmp_path / "nvme", dtype=torch.bfloat16, capacity=1 << 20, direct_io=reopen_direct)
    assert len(again) == 5 and again.used_bytes == used
    assert all(again.parent_of(h(n)) == (h(p) if p else None) for n, p in chain)
    got = again.get_many([h(n) for n, _ in chain]).result()
    assert all(same(t, block(i, torch.bfloat16)) for i, t in enumerate(got))
    again.check_integrity()
    again.close()


def test_restart_drops_bad_and_temp_files_and_leaves_foreign_ones(tmp_path, direct_io):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    put_all(tier, *[(n, None) for n in "abcdefg"])
    tier.close()
    flip_header_byte(tier, path_of(tier, h("a")))
    truncate(tier, path_of(tier, h("b")))
    shutil.copyfile(path_of(tier, h("d")), path_of(tier, h("c")))
    temp = path_of(tier, h("e")).parent / ".crashed-writer.tmp"
    temp.write_bytes(b"half a block")
    flip_last_byte(tier, path_of(tier, h("f")))  # header intact: only a read can tell
    as_version_1(tier, path_of(tier, h("g")))
    (tmp_path / "nvme" / "00").mkdir(exist_ok=True)
    foreign_layout(layout_tag="old-layout")(tier, tmp_path / "nvme" / "00" / "ab.kvb")

    again = tier_at(tmp_path / "nvme", capacity=1 << 20, direct_io=direct_io)
    assert names_in(again, *"abcdefg") == {"d", "e", "f"}
    s = again.stats()
    assert (s["dropped_at_open"], s["foreign_files"]) == (5, 1)
    assert not temp.exists() and (tmp_path / "nvme" / "00" / "ab.kvb").exists()
    assert not path_of(again, h("g")).exists()
    assert again.get(h("f")).result() is None and again.stats()["checksum_failures"] == 1
    assert same(again.get(h("d")).result(), data_of("d"))
    again.check_integrity()
    again.close()


def test_restart_over_capacity_evicts_by_file_age(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20)
    put_all(tier, ("a", None), ("b", None), ("c", None), ("d", None))
    tier.close()
    for age, name in enumerate("cadb"):  # oldest first
        os.utime(path_of(tier, h(name)), ns=(10**18 + age * 10**9,) * 2)
    again = tier_at(tmp_path / "nvme", capacity=2 * FILE)
    assert names_in(again, *"abcd") == {"d", "b"} and again.stats()["evictions"] == 2
    again.check_integrity()
    again.close()


def test_one_tier_per_directory(tmp_path):
    tier = tier_at(tmp_path / "nvme")
    with pytest.raises(RuntimeError, match="already open"):
        tier_at(tmp_path / "nvme")
    tier.close()
    tier_at(tmp_path / "nvme").close()


# -- the file format and O_DIRECT --------------------------------------------------------------------


@pytest.mark.parametrize("tag, offset", [(TAG, ALIGN), ("t" * 5000, 2 * ALIGN)], ids=["short", "past 4096"])
def test_payload_starts_aligned_after_zero_padding(tmp_path, direct_io, tag, offset):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20, layout_tag=tag, direct_io=direct_io)
    put_all(tier, ("a", "parent-elsewhere"))
    path = path_of(tier, h("a"))
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[10:14], "little")
    header = BlockHeader.parse(memoryview(raw))
    assert header.payload_offset == offset and header_len < offset
    assert raw[header_len:offset] == bytes(offset - header_len)
    assert len(raw) == offset + PAYLOAD and raw[offset:] == bytes(bits(data_of("a")).numpy())
    with open(path, "rb") as f:
        assert BlockHeader.read(f) == header and f.tell() == offset
    assert (header.block_hash, header.parent_hash, header.layout_tag) == (h("a"), h("parent-elsewhere"), tag)
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
    """A RWF_NOWAIT read succeeds only from the page cache (a miss starts readahead from `offset` on)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(n)], offset, os.RWF_NOWAIT) == n
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2 with RWF_NOWAIT")
def test_direct_io_keeps_blocks_out_of_the_page_cache(tmp_path, direct_io):
    """The DRAM tier above caches blocks already: direct writes, reads and index rebuilds must not."""
    tier = tier_at(tmp_path / "nvme", direct_io=direct_io)
    put_all(tier, ("a", None))
    assert same(tier.get(h("a")).result(), data_of("a"))
    path = path_of(tier, h("a"))
    assert in_page_cache(path, ALIGN, PAYLOAD) is not direct_io
    tier.close()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop what the check's readahead brought in
    os.close(fd)
    again = tier_at(tmp_path / "nvme", direct_io=direct_io)  # reads every head
    assert h("a") in again and same(again.get(h("a")).result(), data_of("a"))
    assert in_page_cache(path, ALIGN, PAYLOAD) is not direct_io
    assert in_page_cache(path, 0, ALIGN) is not direct_io  # second: readahead only goes forward
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
    assert s["bytes_written"] == 40 * FILE and s["bytes_read"] == 45 * FILE
    old_keys = {"blocks", "used_bytes", "capacity_bytes", "pending_writes", "hits", "misses", "writes",
                "write_failures", "evictions", "discards", "checksum_failures", "dropped_at_open",
                "foreign_files", "bytes_read", "bytes_written", "read_seconds", "write_seconds"}
    assert old_keys <= s.keys()
    tier.check_integrity()
    tier.close()


# -- threads -----------------------------------------------------------------------------------------


def test_threads_never_see_torn_or_foreign_data(tmp_path, direct_io):
    """Blocks i carry the value i*1000 + version everywhere: a read must be one whole version of i."""
    tier = tier_at(tmp_path / "nvme", capacity=12 * FILE, num_io_threads=3, direct_io=direct_io)
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
            elif op < 0.9:
                pending.append((i, tier.get(hashes[i])))
            else:
                tier.discard(hashes[i])
        for p in pending:
            if isinstance(p, tuple):
                i, future = p
                t = future.result()
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


# -- a model of the rule -----------------------------------------------------------------------------

NAMES = [h(f"m{i}") for i in range(6)]
ROOT = h("outside")  # every block has a 32-byte parent, so every file has the same size
SMALL = (2, 4)


class TierVersusModel(RuleBasedStateMachine):
    """The tier against a brute-force model: least-recently-used leaf first, LRU if no leaf at all."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="nvme-model-"))
        probe = NvmeTier(self.dir / "probe", 1 << 20, SMALL, torch.float32)
        probe.put(NAMES[0], ROOT, torch.zeros(SMALL)).result()
        self.file_bytes = probe.used_bytes
        probe.close()
        self.tier = NvmeTier(self.dir / "tier", 3 * self.file_bytes, SMALL, torch.float32)
        self.model: dict[bytes, list] = {}  # hash -> [parent, last_access, data]
        self.tick = 0
        self.version = 0

    def touch(self, key: bytes) -> None:
        self.tick += 1
        self.model[key][1] = self.tick

    def victim(self) -> bytes:
        parents = {p for p, _, _ in self.model.values()}
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
        self.model[key] = [parent_hash, 0, data]
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
        """Reopen; file mtimes carry the model's recency across, as they would in real time."""
        self.tier.close()
        for key, (_, last_access, _) in self.model.items():
            os.utime(path_of(self.tier, key), ns=(10**18 + last_access * 10**6,) * 2)
        self.tier = NvmeTier(self.dir / "tier", 3 * self.file_bytes, SMALL, torch.float32)

    @invariant()
    def agrees(self):
        assert {k for k in NAMES if k in self.tier} == set(self.model)
        assert all(self.tier.parent_of(k) == p for k, (p, _, _) in self.model.items())
        self.tier.check_integrity()

    def teardown(self):
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTierVersusModel = TierVersusModel.TestCase
TestTierVersusModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
