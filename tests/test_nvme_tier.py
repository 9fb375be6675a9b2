"""NvmeTier: round trips, leaf-first LRU by bytes, bad files as misses, restart, threads.

Every scenario ends with `check_integrity()`. Bad files are made by hand on disk (flipped bytes,
truncation, renames, foreign layouts, garbage, stale temp files), and a stateful test drives the
tier against a brute-force model of the eviction rule, restarts included.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.tiering.nvme import NvmeTier

SHAPE = (2, 2, 4, 2, 8)  # [layers, k/v, block_size, kv_heads, head_dim]
TAG = "test-model/bs4"
PAYLOAD = math.prod(SHAPE) * 4  # float32
THREE_BLOCKS = 3 * (PAYLOAD + 200)  # headers are < 200 bytes here, so 3 blocks fit and 4 do not


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


@pytest.fixture
def tier(tmp_path):
    t = tier_at(tmp_path / "nvme")
    yield t
    t.close()


# -- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"capacity_bytes": -5}, "capacity_bytes"),
    ({"block_shape": ()}, "block_shape"),
    ({"block_shape": (4, 0)}, "block_shape"),
    ({"num_io_threads": 0}, "num_io_threads"),
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
def test_round_trip_is_bit_exact(tmp_path, dtype):
    tier = tier_at(tmp_path / "nvme", dtype=dtype, capacity=1 << 20)
    data = block(1, dtype)
    data.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")], dtype=dtype)
    assert tier.put(h("a"), None, data).result() is True
    assert tier.put(h("b"), h("a"), block(2, dtype)).result() is True
    tier.flush()
    assert same(tier.get(h("a")).result(), data)
    assert same(tier.get(h("b")).result(), block(2, dtype))
    assert tier.get(h("missing")).result() is None
    assert h("a") in tier and h("missing") not in tier and len(tier) == 2
    assert tier.parent_of(h("b")) == h("a") and tier.parent_of(h("a")) is None
    s = tier.stats()
    assert (s["hits"], s["misses"], s["writes"], s["checksum_failures"]) == (2, 1, 2, 0)
    on_disk = sum(p.stat().st_size for p in files(tier.directory))
    assert s["bytes_written"] == s["used_bytes"] == tier.used_bytes == on_disk
    assert s["bytes_read"] == s["bytes_written"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in files(tier.directory)] == [0o600, 0o600]
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
    tier = tier_at(tmp_path / "nvme", capacity=PAYLOAD)  # the header does not fit on top
    assert tier.put(h("a"), None, block(0)).result() is False
    assert len(tier) == 0 and tier.used_bytes == 0 and files(tier.directory) == []
    tier.check_integrity()
    tier.close()


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
    "other tag": foreign_layout(layout_tag="other-model/bs4"),
    "other dtype": foreign_layout(dtype=torch.bfloat16),
    "other shape": foreign_layout(shape=(2, 2, 4, 2, 4)),
}


@pytest.mark.parametrize("damage", BAD_FILES.values(), ids=list(BAD_FILES))
def test_bad_file_reads_as_a_miss_and_is_dropped(tier, damage):
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


def test_restart_finds_the_same_blocks(tmp_path):
    tier = tier_at(tmp_path / "nvme", dtype=torch.bfloat16, capacity=1 << 20)
    chain = [(f"b{i}", f"b{i - 1}" if i else None) for i in range(5)]
    for i, (name, parent) in enumerate(chain):
        tier.put(h(name), h(parent) if parent else None, block(i, torch.bfloat16))
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tier.put(h("z"), None, block(0, torch.bfloat16))
    used = tier.used_bytes

    again = tier_at(tmp_path / "nvme", dtype=torch.bfloat16, capacity=1 << 20)
    assert len(again) == 5 and again.used_bytes == used
    assert all(again.parent_of(h(n)) == (h(p) if p else None) for n, p in chain)
    got = again.get_many([h(n) for n, _ in chain]).result()
    assert all(same(t, block(i, torch.bfloat16)) for i, t in enumerate(got))
    again.check_integrity()
    again.close()


def test_restart_drops_bad_and_temp_files_and_leaves_foreign_ones(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=1 << 20)
    put_all(tier, *[(n, None) for n in "abcdef"])
    tier.close()
    flip_header_byte(tier, path_of(tier, h("a")))
    truncate(tier, path_of(tier, h("b")))
    shutil.copyfile(path_of(tier, h("d")), path_of(tier, h("c")))
    temp = path_of(tier, h("e")).parent / ".crashed-writer.tmp"
    temp.write_bytes(b"half a block")
    flip_last_byte(tier, path_of(tier, h("f")))  # header intact: only a read can tell
    (tmp_path / "nvme" / "00").mkdir(exist_ok=True)
    foreign_layout(layout_tag="old-layout")(tier, tmp_path / "nvme" / "00" / "ab.kvb")

    again = tier_at(tmp_path / "nvme", capacity=1 << 20)
    assert names_in(again, *"abcdef") == {"d", "e", "f"}
    s = again.stats()
    assert (s["dropped_at_open"], s["foreign_files"]) == (4, 1)
    assert not temp.exists() and (tmp_path / "nvme" / "00" / "ab.kvb").exists()
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
    again = tier_at(tmp_path / "nvme", capacity=2 * (PAYLOAD + 200))
    assert names_in(again, *"abcd") == {"d", "b"} and again.stats()["evictions"] == 2
    again.check_integrity()
    again.close()


def test_one_tier_per_directory(tmp_path):
    tier = tier_at(tmp_path / "nvme")
    with pytest.raises(RuntimeError, match="already open"):
        tier_at(tmp_path / "nvme")
    tier.close()
    tier_at(tmp_path / "nvme").close()


# -- threads -----------------------------------------------------------------------------------------


def test_threads_never_see_torn_or_foreign_data(tmp_path):
    """Blocks i carry the value i*1000 + version everywhere: a read must be one whole version of i."""
    tier = tier_at(tmp_path / "nvme", capacity=12 * (PAYLOAD + 200), num_io_threads=3)
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
