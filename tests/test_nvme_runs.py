"""NvmeTier moves adjacent slots together: a burst of puts is written in runs of adjacent slots, one
pwrite each, and a batch of reads takes each run of adjacent slots in one preadv. A failed run costs
only its own blocks, a bad slot inside a run costs only itself, and the runs never cross a slab.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from kvstrata.tiering import nvme
from kvstrata.tiering.block_file import ALIGN
from kvstrata.tiering.slab import SlabFiles, SlabGeometry
from kvstrata.tiering.slot_io import ReadBuffers
from kvstrata.worker.huge_pages import HUGE_PAGE, huge_pages_available
from tests.test_huge_pages import _smaps_entry, needs_thp
from tests.test_nvme_tier import SLOT, data_of, h, offset_of, patch, same, slab0, slot_bytes, tier_at

NAMES = [f"b{i}" for i in range(8)]


@pytest.fixture
def held_writes(monkeypatch):
    """Every pwrite is recorded as (first slot, slots); the first one waits for `release`."""
    started, release = threading.Event(), threading.Event()
    runs: list[tuple[int, int]] = []
    write = SlabFiles.write

    def recording_write(self, slot, data):
        runs.append((slot, len(data) // self.geometry.slot_bytes))
        if not started.is_set():
            started.set()
            assert release.wait(10)
        return write(self, slot, data)

    monkeypatch.setattr(SlabFiles, "write", recording_write)
    return started, release, runs


def put_burst(tier, held_writes, names=NAMES) -> list:
    """One put, held in its pwrite, then the rest queued behind it: the IO threads take them in runs."""
    started, release, _ = held_writes
    futures = [tier.put(h(names[0]), None, data_of(names[0]))]
    assert started.wait(10)
    futures += [tier.put(h(n), h(p), data_of(n)) for p, n in zip(names, names[1:])]
    release.set()
    return [f.result(timeout=10) for f in futures]


def test_a_burst_of_puts_is_written_in_runs_of_adjacent_slots(tmp_path, held_writes):
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=1, c_io=False)
    assert put_burst(tier, held_writes) == [True] * len(NAMES)
    runs = held_writes[2]
    assert runs[0] == (0, 1) and runs[1] == (1, len(NAMES) - 1)  # the seven queued ones in one pwrite
    assert [offset_of(tier, h(n)) for n in NAMES] == [i * SLOT for i in range(len(NAMES))]
    assert all(same(got, data_of(n)) for n, got in zip(NAMES, tier.get_many([h(n) for n in NAMES]).result()))
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT)
    assert len(again) == len(NAMES) and same(again.get(h("b5")).result(), data_of("b5"))
    again.check_integrity()
    again.close()


def test_runs_stop_at_the_run_size_and_at_the_end_of_a_slab(tmp_path, held_writes, monkeypatch):
    monkeypatch.setattr(nvme, "RUN_BYTES", 3 * SLOT)
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=1, slab_bytes=5 * SLOT, c_io=False)
    assert put_burst(tier, held_writes) == [True] * len(NAMES)
    # slot 0 alone (held), then the queue in takes of 3: slots 1-3, then 4-6 split at the slab's end
    assert held_writes[2] == [(0, 1), (1, 3), (4, 1), (5, 2), (7, 1)]
    assert all(same(got, data_of(n)) for n, got in zip(NAMES, tier.get_many([h(n) for n in NAMES]).result()))
    tier.check_integrity()
    tier.close()


def test_a_failed_run_fails_only_its_own_writes(tmp_path, held_writes, monkeypatch):
    started, release, runs = held_writes
    write = SlabFiles.write  # the recording one

    def failing_long_runs(self, slot, data):
        write(self, slot, data)
        if len(data) > self.geometry.slot_bytes:
            raise OSError(5, "injected")

    monkeypatch.setattr(SlabFiles, "write", failing_long_runs)
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=1, c_io=False)
    assert put_burst(tier, held_writes) == [True] + [False] * (len(NAMES) - 1)
    assert len(tier) == 1 and tier.stats()["write_failures"] == len(NAMES) - 1 and tier.num_pending_writes == 0
    tier.check_integrity()  # the failed slots were erased and freed
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT)
    assert [h(n) in again for n in NAMES] == [True] + [False] * (len(NAMES) - 1)
    again.close()


def test_a_discard_while_queued_or_in_a_run_leaves_the_others(tmp_path, held_writes):
    started, release, runs = held_writes
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=1, c_io=False)
    first = tier.put(h("b0"), None, data_of("b0"))
    assert started.wait(10)
    rest = [tier.put(h(n), None, data_of(n)) for n in NAMES[1:]]
    assert tier.discard(h("b3")) is True
    release.set()
    assert first.result(timeout=10) is True
    assert [f.result(timeout=10) for f in rest] == [n != "b3" for n in NAMES[1:]]
    assert h("b3") not in tier and len(tier) == len(NAMES) - 1
    tier.check_integrity()
    tier.close()


@pytest.fixture
def recorded_reads(monkeypatch):
    runs: list[tuple[int, int]] = []
    read_run = SlabFiles.read_run

    def recording(self, slot, bufs):
        runs.append((slot, len(bufs)))
        return read_run(self, slot, bufs)

    monkeypatch.setattr(SlabFiles, "read_run", recording)
    return runs


def filled(tmp_path, n: int = len(NAMES), **kw):
    """A tier with NAMES[:n] in slots 0, 1, ...; reads on the Python IO threads unless kw says (the
    C IO threads' runs: test_nvme_c_io.py)."""
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, **{"c_io": False, **kw})
    for name in NAMES[:n]:
        assert tier.put(h(name), None, data_of(name)).result() is True  # one by one: slots 0, 1, ...
    return tier


def test_get_many_reads_each_run_of_adjacent_slots_at_once(tmp_path, recorded_reads):
    tier = filled(tmp_path, num_io_threads=2)
    asked = ["b6", "b1", "zz", "b0", "b2", "b7", "b5"]  # shuffled, a miss, b3 and b4 left out
    got = tier.get_many([h(n) for n in asked]).result()
    assert got[2] is None and all(same(g, data_of(n)) for n, g in zip(asked, got) if n != "zz")
    # sorted slots 0 1 2 5 6 7, a share of three per IO thread: runs 0-2 and 5-7
    assert sorted(recorded_reads) == [(0, 3), (5, 3)]
    tier.check_integrity()
    tier.close()


def test_a_bad_slot_inside_a_run_is_the_only_miss(tmp_path, recorded_reads):
    tier = filled(tmp_path, num_io_threads=1)
    in_payload = offset_of(tier, h("b4")) + ALIGN + 10  # the payload starts one page into the slot
    patch(slab0(tier), in_payload, bytes([slot_bytes(slab0(tier), in_payload, 1)[0] ^ 0xFF]))
    got = tier.get_many([h(n) for n in NAMES]).result()
    assert recorded_reads == [(0, len(NAMES))]
    assert [g is not None for g in got] == [n != "b4" for n in NAMES]
    assert all(same(g, data_of(n)) for n, g in zip(NAMES, got) if n != "b4")
    assert h("b4") not in tier and tier.stats()["checksum_failures"] == 1
    tier.check_integrity()
    tier.close()


def test_a_run_whose_read_fails_is_read_slot_by_slot(tmp_path, monkeypatch):
    tier = filled(tmp_path, num_io_threads=1)
    singles = []
    read = SlabFiles.read

    def failing_run(self, slot, bufs):
        raise OSError(5, "injected")

    def counting_read(self, slot, buf):
        singles.append(slot)
        if slot == 3:
            raise OSError(5, "injected")
        return read(self, slot, buf)

    monkeypatch.setattr(SlabFiles, "read_run", failing_run)
    monkeypatch.setattr(SlabFiles, "read", counting_read)
    got = tier.get_many([h(n) for n in NAMES]).result()
    assert singles == list(range(len(NAMES)))
    assert [g is not None for g in got] == [n != "b3" for n in NAMES]
    assert h("b3") not in tier and len(tier) == len(NAMES) - 1
    tier.check_integrity()
    tier.close()


def test_run_length_keeps_runs_adjacent_within_a_slab():
    geometry = SlabGeometry(slot_bytes=SLOT, num_slots=20, slots_per_slab=4)
    files = SlabFiles(None, geometry, 0)
    slots = [0, 1, 2, 3, 4, 5, 7, 8, 9]
    lengths, i = [], 0
    while i < len(slots):
        lengths.append(files.run_length(slots, i, limit=3))
        i += lengths[-1]
    assert lengths == [3, 1, 2, 1, 2]  # 0-2 (limit), 3 (slab end), 4-5, 7 (slab end), 8-9


def test_recycled_blocks_lend_their_buffers_to_later_reads(tmp_path):
    tier = filled(tmp_path, num_io_threads=1)
    first = tier.get_many([h(n) for n in NAMES[:4]]).result()
    buffers = {tier._read_buffers.buffer_of(b).data_ptr() for b in first}
    assert len(buffers) == 4
    tier.recycle(first + [None])
    tier.recycle(first)  # twice: each buffer still waits once
    assert len(tier._read_buffers) == 4
    second = tier.get_many([h(n) for n in NAMES[4:]]).result()
    assert {tier._read_buffers.buffer_of(b).data_ptr() for b in second} == buffers  # read into the same memory
    assert all(same(b, data_of(n)) for n, b in zip(NAMES[4:], second))
    assert len(tier._read_buffers) == 0
    tier.check_integrity()
    tier.close()


def test_only_read_buffers_are_recycled_and_the_pool_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "READ_BUFFER_BYTES", 2 * SLOT)  # room for max(8, 2) buffers
    tier = filled(tmp_path, num_io_threads=1)
    tier.recycle([data_of("b0"), data_of("b0").clone()])  # not a read's block: ignored
    assert len(tier._read_buffers) == 0
    blocks = tier.get_many([h(n) for n in NAMES]).result() + tier.get_many([h(n) for n in NAMES]).result()
    tier.recycle(blocks)
    assert len(tier._read_buffers) == 8  # the bound, not all 16
    tier.close()


@pytest.mark.parametrize("thp", [True, False])
def test_read_buffers_come_from_a_huge_page_arena_then_fresh_and_stay_bounded(monkeypatch, thp):
    from kvstrata.tiering import disk_io

    if not thp:  # a host without huge pages: the arena is one plain aligned buffer, used the same way
        monkeypatch.setattr(disk_io, "huge_pages_available", lambda: False)
    buffers = ReadBuffers(slot_bytes=2 * ALIGN, limit=2)
    taken = [buffers.take() for _ in range(3)]
    assert all(b.numel() == 2 * ALIGN and b.data_ptr() % ALIGN == 0 for b in taken)
    arena, fresh = taken[:2], taken[2]
    assert fresh.data_ptr() not in {b.data_ptr() for b in arena}
    assert arena[1].data_ptr() == arena[0].data_ptr() + 2 * ALIGN  # slices of one arena
    if thp and huge_pages_available():
        assert _smaps_entry(arena[0].data_ptr())["THPeligible"] == "1"
    for b in taken:  # a block is a view of its buffer, past the head
        assert buffers.buffer_of(b[ALIGN:].view(torch.float32)).data_ptr() == b.data_ptr()
    assert buffers.buffer_of(torch.zeros(2 * ALIGN, dtype=torch.uint8)) is None
    assert len(buffers) == 0
    buffers.give(taken + [arena[0]])  # one twice: it waits once; the fresh one is past the bound
    assert len(buffers) == 2
    again = [buffers.take() for _ in range(3)]
    assert {b.data_ptr() for b in again[:2]} == {b.data_ptr() for b in arena}
    assert again[2].data_ptr() not in {b.data_ptr() for b in arena}


@needs_thp
def test_reads_land_in_buffers_on_huge_pages(tmp_path):
    tier = filled(tmp_path, num_io_threads=1)
    blocks = tier.get_many([h(n) for n in NAMES]).result()
    assert all(same(b, data_of(n)) for n, b in zip(NAMES, blocks))
    assert all(_smaps_entry(b.data_ptr())["THPeligible"] == "1" for b in blocks)
    tier.recycle(blocks)
    tier.close()


def test_a_bad_slots_buffer_goes_straight_back(tmp_path):
    tier = filled(tmp_path, num_io_threads=1)
    in_payload = offset_of(tier, h("b2")) + ALIGN + 10
    patch(slab0(tier), in_payload, bytes([slot_bytes(slab0(tier), in_payload, 1)[0] ^ 0xFF]))
    got = tier.get_many([h("b2")]).result()
    assert got == [None] and len(tier._read_buffers) == 1
    tier.close()


def no_slot_being_read(tier) -> bool:
    return not any(tier._slots.is_being_read(s) for s in range(tier.geometry.num_slots))


def test_a_threads_runs_are_checked_on_checker_threads_while_it_reads_on(tmp_path, monkeypatch):
    """One IO thread, one slot per run: it reads the eight runs one after another, and each but the
    last is checked on a checker thread meanwhile; bad slots there are misses, dropped and counted."""
    monkeypatch.setattr(nvme, "RUN_BYTES", SLOT)
    tier = filled(tmp_path, num_io_threads=1)
    for name in ("b2", "b7"):  # one run checked on a checker thread, and the last, checked in place
        in_payload = offset_of(tier, h(name)) + ALIGN + 10
        patch(slab0(tier), in_payload, bytes([slot_bytes(slab0(tier), in_payload, 1)[0] ^ 0xFF]))
    checked_on = []
    check_run = nvme.SlotIO.check_run

    def recording(self, bufs, read_ok, hashes, crcs=None):
        checked_on.append(threading.current_thread().name.split("_")[0])
        return check_run(self, bufs, read_ok, hashes, crcs)

    monkeypatch.setattr(nvme.SlotIO, "check_run", recording)
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert sorted(checked_on) == ["kvstrata-nvme"] + ["kvstrata-nvme-check"] * (len(NAMES) - 1)
    assert [g is not None for g in got] == [n not in ("b2", "b7") for n in NAMES]
    assert all(same(g, data_of(n)) for n, g in zip(NAMES, got) if g is not None)
    assert h("b2") not in tier and h("b7") not in tier and tier.stats()["checksum_failures"] == 2
    assert no_slot_being_read(tier)
    tier.check_integrity()
    tier.close()


@pytest.mark.parametrize("fails", ["check", "read"])
def test_a_bug_in_a_runs_check_or_read_reaches_the_caller_and_every_slot_is_let_go(tmp_path, monkeypatch, fails):
    """A check that raises on a checker thread, or a read that raises halfway through a thread's
    runs: the caller's future carries the error, no slot stays marked as being read (so all can be
    evicted and reused), and the tier goes on reading."""
    monkeypatch.setattr(nvme, "RUN_BYTES", SLOT)
    tier = filled(tmp_path, num_io_threads=1)
    calls = []
    name = "check_run" if fails == "check" else "read_raw"
    real = getattr(nvme.SlotIO, name)

    def third_fails(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(self, *args)

    monkeypatch.setattr(nvme.SlotIO, name, third_fails)
    with pytest.raises(RuntimeError, match="injected"):
        tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert no_slot_being_read(tier)
    monkeypatch.setattr(nvme.SlotIO, name, real)
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert all(same(g, data_of(n)) for n, g in zip(NAMES, got))
    tier.check_integrity()
    tier.close()


def resident(t: torch.Tensor) -> int:
    """Bytes of t's memory that are in RAM (mincore over its pages; not the whole mapping's Rss in
    smaps, which counts a neighbour the kernel merged into the same mapping)."""
    page = 4096
    start = t.data_ptr() - t.data_ptr() % page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page


@needs_thp
def test_prefault_faults_in_the_buffers_the_first_takes_hand_out_and_never_touches_one_in_use():
    slot = 256 << 10
    cold = ReadBuffers(slot_bytes=slot, limit=32)  # an 8 MB arena: four huge pages
    cold.take()
    assert resident(cold._arena) == 0  # a take alone faults nothing in; the read does
    warm = ReadBuffers(slot_bytes=slot, limit=32)
    warm.prefault(16)
    first = warm.take()
    assert 16 * slot <= resident(warm._arena) <= 16 * slot + HUGE_PAGE
    first.fill_(7)  # as a read would; prefault again must leave it alone
    warm.prefault(32)
    assert bool((first == 7).all()) and resident(warm._arena) <= 16 * slot + HUGE_PAGE


@needs_thp
def test_a_tier_opens_with_its_first_read_buffers_faulted_in(tmp_path):
    tier = tier_at(tmp_path)
    slots = min(tier.geometry.num_slots, nvme.PREFAULT_READ_BYTES // tier.geometry.slot_bytes)
    tier._read_buffers.take()
    assert resident(tier._read_buffers._arena) >= slots * tier.geometry.slot_bytes
    tier.close()
