"""The NVMe tier's writes on C threads (tiering/io_pool.py, worker/csrc/io_pool.c).

The pool alone: real pwritev / preadv with their errors, callbacks on the reaper, close. The tier
with c_io: a burst goes out as runs of adjacent slots straight from the write buffers, a failed run
fails only its own writes, a write discarded in flight leaves nothing on disk, blocks not staged
are staged at the put; get_many reads runs in one preadv each, a failed run slot by slot, a bad
slot alone is a miss; and nothing is left behind: threads, write buffers, pending writes, slots
marked as being read.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
import zlib

import pytest
import torch

from kvstrata.tiering import nvme
from kvstrata.tiering.io_pool import IoPool
from kvstrata.worker.cpu_kernels import load_cpu_kernels
from kvstrata.tiering.block_file import ALIGN
from kvstrata.tiering.slab import SlabFiles
from tests.test_nvme_runs import NAMES, filled, no_slot_being_read
from tests.test_nvme_tier import _thread_slice_ns
from tests.test_nvme_tier import SLOT, data_of, erased, h, headers, offset_of, patch, same, slab0, slot_bytes, tier_at

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None or not KERNELS.crc32_fast,
                                   reason="the C IO threads need the C kernels with their fast CRC-32")
pytestmark = needs_kernels


def io_threads() -> list[str]:
    """The tier's Python threads: the IO pool's reaper and, on the Python path, the executors'."""
    return [t.name for t in threading.enumerate() if t.name.startswith(("kvstrata-io", "kvstrata-nvme"))]


def c_threads() -> int:
    """The IO pool's C threads, by the name each gives itself, as the kernel lists the process's
    threads (not all of them: a test session's other threads come and go)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("kvstrata-io")


class Done:
    """Callbacks that record their status, and wait for a count of them."""

    def __init__(self):
        self.errs: list[int] = []
        self._cv = threading.Condition()

    def __call__(self, err: int) -> None:
        with self._cv:
            self.errs.append(err)
            self._cv.notify_all()

    def wait(self, n: int) -> list[int]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.errs) >= n, timeout=10)
            return list(self.errs)


# -- the pool alone ----------------------------------------------------------------------------------


def test_the_pool_writes_and_reads_vectors_at_offsets(tmp_path):
    pool = IoPool(KERNELS._lib, 3)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        src = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8)
        dst = torch.zeros(3 * 4096, dtype=torch.uint8)
        done = Done()
        # two buffers into one write at 8192; then read back in one buffer
        pool.submit(fd, True, 8192, [(src.data_ptr(), 4096), (src.data_ptr() + 4096, 2 * 4096)], done)
        assert done.wait(1) == [0]
        pool.submit(fd, False, 8192, [(dst.data_ptr(), 3 * 4096)], done)
        assert done.wait(2) == [0, 0]
        assert torch.equal(src, dst)
        assert os.path.getsize(tmp_path / "f") == 8192 + 3 * 4096
    finally:
        pool.close()
        os.close(fd)


def test_the_pool_clocks_each_kinds_time_in_syscalls_once_however_many_overlap(tmp_path):
    pool = IoPool(KERNELS._lib, 3)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        buf = torch.ones(8 << 20, dtype=torch.uint8)
        done = Done()
        t0 = time.monotonic()
        for k in range(6):  # three threads: up to three writes in their syscalls at once
            pool.submit(fd, True, k * buf.numel(), [(buf.data_ptr(), buf.numel())], done)
        assert done.wait(6) == [0] * 6
        wall = time.monotonic() - t0
        writes = pool.busy_seconds(True)
        assert 0.0 < writes <= min(wall, pool.io_seconds + 1e-9)  # a union, never the sum of the six
        assert pool.busy_seconds(False) == 0.0  # each kind has its own clock
        time.sleep(0.05)
        assert pool.busy_seconds(True) == writes  # idle: no spell left open
        pool.submit(fd, False, 0, [(buf.data_ptr(), buf.numel())], done)
        assert done.wait(7)[-1] == 0
        reads = pool.busy_seconds(False)
        assert reads > 0.0 and pool.busy_seconds(True) == writes
    finally:
        pool.close()
        os.close(fd)
    assert (pool.busy_seconds(False), pool.busy_seconds(True)) == (reads, writes)  # kept past the close


def test_the_reaper_asks_for_the_short_slice_too(tmp_path):
    """Callbacks run on the reaper, which like the C threads asks for the pool's slice as it starts
    (so that a finished IO is reaped while forward passes hold the cores); 0 asks for none."""
    main_slice = _thread_slice_ns()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    src = torch.zeros(4096, dtype=torch.uint8)
    try:
        for slice_us in (100, 0):
            pool = IoPool(KERNELS._lib, 1, slice_us)
            seen = []
            done = Done()
            pool.submit(fd, True, 0, [(src.data_ptr(), 4096)], lambda err: (seen.append(_thread_slice_ns()), done(err)))
            assert done.wait(1) == [0]
            granted = pool.short_slice_threads == 1 and pool.reaper_short_slice
            pool.close()
            if slice_us and not granted:
                pytest.skip("this kernel takes no slice request")
            if main_slice is None:
                pytest.skip("this kernel shows no slice")
            assert seen == [slice_us * 1000 if slice_us else main_slice]
            assert pool.reaper_short_slice == bool(slice_us)
    finally:
        os.close(fd)


def test_a_read_checksums_each_buffers_span_on_its_io_thread(tmp_path):
    """Each buffer's CRC-32 (zlib's) of bytes [100, 100 + 3000), taken after the read; a buffer too
    short for the span, and every buffer of a failed read, keeps what was there."""
    pool = IoPool(KERNELS._lib, 2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    src = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8)
    os.write(fd, src.numpy().tobytes())
    dst = torch.zeros(3 * 4096, dtype=torch.uint8)
    try:
        done = Done()
        crcs = (ctypes.c_uint32 * 3)(7, 7, 7)
        buffers = [(dst.data_ptr(), 4096), (dst.data_ptr() + 4096, 2048), (dst.data_ptr() + 6144, 6144)]
        pool.submit(fd, False, 0, buffers, done, crcs, (100, 3000))
        assert done.wait(1) == [0]
        assert torch.equal(src, dst)
        assert list(crcs) == [zlib.crc32(src[100:3100].numpy()), 7, zlib.crc32(src[6244:9244].numpy())]
        failed = (ctypes.c_uint32 * 1)(7)
        pool.submit(fd, False, 4096, [(dst.data_ptr(), 3 * 4096)], done, failed, (0, 10))  # short: EIO
        assert done.wait(2)[1] == errno.EIO and list(failed) == [7]
        with pytest.raises(ValueError, match="crcs"):
            pool.submit(fd, True, 0, buffers, done, crcs, (0, 10))  # a write has nothing to check
        with pytest.raises(ValueError, match="crcs"):
            pool.submit(fd, False, 0, buffers[:2], done, crcs, (0, 10))
        assert len(done.errs) == 2
    finally:
        pool.close()
        os.close(fd)


def test_c_reads_are_checked_against_the_io_threads_crcs_and_still_catch_a_bad_payload(tmp_path, monkeypatch):
    """get_many on the C path hands the check each slot's CRC from its IO thread (the check takes
    none of its own), and a flipped payload byte is still a miss, dropped and counted."""
    tier = filled(tmp_path, c_io=True)
    in_payload = offset_of(tier, h("b2")) + ALIGN + 10
    patch(slab0(tier), in_payload, bytes([slot_bytes(slab0(tier), in_payload, 1)[0] ^ 0xFF]))
    from kvstrata.tiering import slot_codec

    own = []
    monkeypatch.setattr(slot_codec, "_fast_crc", lambda: own.append(1))  # the check's own CRC: never wanted
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert own == []
    assert [g is not None for g in got] == [n != "b2" for n in NAMES]
    assert all(same(g, data_of(n)) for n, g in zip(NAMES, got) if g is not None)
    assert h("b2") not in tier and tier.stats()["checksum_failures"] == 1
    assert no_slot_being_read(tier)
    tier.check_integrity()
    tier.close()


def test_io_errors_reach_the_callback_as_errnos(tmp_path):
    pool = IoPool(KERNELS._lib, 2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"x" * 100)
    buf = torch.zeros(4096, dtype=torch.uint8)
    try:
        done = Done()
        pool.submit(fd, False, 0, [(buf.data_ptr(), 4096)], done)  # only 100 bytes there: short
        assert done.wait(1) == [errno.EIO]
        bad_fd = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o600)
        os.close(bad_fd)
        pool.submit(bad_fd, True, 0, [(buf.data_ptr(), 10)], done)
        assert done.wait(2)[1] == errno.EBADF
        with pytest.raises(OSError, match="queue"):
            pool.submit(fd, True, 0, [], done)  # no buffers: EINVAL, never queued
        assert len(done.errs) == 2
    finally:
        pool.close()
        os.close(fd)


def test_a_failing_callback_does_not_stop_the_others(tmp_path, caplog):
    pool = IoPool(KERNELS._lib, 1)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    buf = torch.zeros(4096, dtype=torch.uint8)
    done = Done()

    def buggy(err: int) -> None:
        raise RuntimeError("injected")

    try:
        pool.submit(fd, True, 0, [(buf.data_ptr(), 4096)], buggy)
        pool.submit(fd, True, 4096, [(buf.data_ptr(), 4096)], done)
        assert done.wait(1) == [0]
    finally:
        pool.close()
        os.close(fd)
    assert "an IO completion callback failed" in caplog.text


def test_close_finishes_what_was_queued_then_refuses_and_leaves_no_thread(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [torch.full((65536,), i, dtype=torch.uint8) for i in range(16)]  # (torch may start its threads)
    before, before_c = io_threads(), c_threads()
    pool = IoPool(KERNELS._lib, 2, name="kvstrata-io-test")
    assert c_threads() == before_c + 2 and len(io_threads()) == len(before) + 1  # two C threads, the reaper
    done = Done()
    for i, b in enumerate(bufs):
        pool.submit(fd, True, i * 65536, [(b.data_ptr(), 65536)], done)
    pool.close()  # returns once every callback has run
    assert done.errs == [0] * 16
    with pytest.raises(OSError, match="closed"):
        pool.submit(fd, True, 0, [(bufs[0].data_ptr(), 10)], done)
    pool.close()  # again: nothing
    os.close(fd)
    assert io_threads() == before and c_threads() == before_c
    with open(tmp_path / "f", "rb") as f:
        assert all(f.read(65536) == bytes([i]) * 65536 for i in range(16))


def test_close_from_a_callback_returns_and_the_pool_still_ends(tmp_path):
    pool = IoPool(KERNELS._lib, 1, name="kvstrata-io-test")
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    buf = torch.zeros(4096, dtype=torch.uint8)
    closed = threading.Event()

    def close_here(err: int) -> None:
        pool.close()
        closed.set()

    pool.submit(fd, True, 0, [(buf.data_ptr(), 4096)], close_here)
    assert closed.wait(10)
    deadline = time.monotonic() + 10
    while "kvstrata-io-test-reaper" in io_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "kvstrata-io-test-reaper" not in io_threads()
    os.close(fd)


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="num_threads"):
        IoPool(KERNELS._lib, 0)
    with pytest.raises(ValueError, match="num_threads"):
        IoPool(KERNELS._lib, 65)


# -- the tier ----------------------------------------------------------------------------------------


@pytest.fixture
def submitted(monkeypatch):
    """Every IO the tiers queue on their pools, as (offset in its slab, buffers)."""
    ios: list[tuple[int, int]] = []
    submit = IoPool.submit

    def recording(self, fd, write, offset, buffers, done, *crc):
        ios.append((offset, len(buffers)))
        return submit(self, fd, write, offset, buffers, done, *crc)

    monkeypatch.setattr(IoPool, "submit", recording)
    return ios


def test_c_io_is_the_default_where_the_kernels_stage_and_can_be_turned_off(tmp_path, monkeypatch):
    tier = tier_at(tmp_path / "a")
    assert tier.stats()["c_io"] is True
    tier.close()
    monkeypatch.setenv("KVSTRATA_NVME_C_IO", "0")
    tier = tier_at(tmp_path / "b")
    stats = tier.stats()
    assert stats["c_io"] is False
    # the Python IO threads read runs of up to RUN_BYTES: no size to choose, no rates
    assert stats["read_run_slots"] == max(1, nvme.RUN_BYTES // stats["slot_bytes"]) and stats["read_run_rates"] == []
    tier.close()
    monkeypatch.setenv("KVSTRATA_NVME_C_IO", "yes")
    with pytest.raises(ValueError, match="KVSTRATA_NVME_C_IO"):
        tier_at(tmp_path / "c")


def test_c_io_true_without_staging_is_refused(tmp_path, monkeypatch):
    from kvstrata.worker import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda: None)  # as where no compiler is
    with pytest.raises(ValueError, match="c_io"):
        tier_at(tmp_path / "nvme", c_io=True)
    tier = tier_at(tmp_path / "nvme")  # the default falls back to the Python IO threads
    assert tier.stats()["c_io"] is False
    tier.close()


@pytest.mark.parametrize("n, run", [(0, 1), (3, 1), (8, 2), (20, 5), (21, 3), (45, 4), (100, 5), (101, 5)])
def test_bursts_are_cut_into_runs_that_keep_every_thread_busy_to_the_end(tmp_path, monkeypatch, n, run):
    """4 threads, runs of at most 5: up to 20 blocks, one run a thread; past that, runs of even length
    in as few rounds as runs of 5 need (21 blocks: 7 runs of 3 in two rounds, not 5 + 5 + 5 + 5 + 1)."""
    monkeypatch.setattr(nvme, "RUN_BYTES", 5 * SLOT)
    tier = tier_at(tmp_path / "nvme", num_io_threads=4, c_io=True)
    assert tier._run_limit(n) == run
    tier.close()


def test_a_burst_goes_out_in_runs_of_adjacent_slots_from_its_write_buffers(tmp_path, monkeypatch, submitted):
    monkeypatch.setattr(nvme, "RUN_BYTES", 3 * SLOT)
    names = [f"b{i}" for i in range(8)]
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=2, c_io=True)
    copies = [tier.staged_copy(data_of(n)) for n in names]
    futures = tier.put_many([(h(n), None, c) for n, c in zip(names, copies)])
    assert [f.result(timeout=10) for f in futures] == [True] * 8
    # free slots go lowest first; 8 blocks on 2 threads need two rounds of runs of at most 3, so
    # runs of 2: two a thread (runs of 3 would leave one thread a third run alone)
    assert sorted(submitted) == [(0, 2), (2 * SLOT, 2), (4 * SLOT, 2), (6 * SLOT, 2)]
    # a burst too small to give each thread a full run is cut into one run per thread
    more = [f"c{i}" for i in range(4)]
    futures = tier.put_many([(h(n), None, data_of(n)) for n in more])
    assert [f.result(timeout=10) for f in futures] == [True] * 4
    assert sorted(submitted)[4:] == [(8 * SLOT, 2), (10 * SLOT, 2)]
    assert [offset_of(tier, h(n)) for n in names] == [i * SLOT for i in range(8)]
    assert all(same(got, data_of(n)) for n, got in zip(names, tier.get_many([h(n) for n in names]).result()))
    assert tier.num_staged == 0 and tier.num_pending_writes == 0  # every write buffer back in the pool
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT)  # the same format: a restart finds them
    assert all(same(got, data_of(n)) for n, got in zip(names, again.get_many([h(n) for n in names]).result()))
    again.close()


def test_loads_go_out_in_runs_of_their_own_size_not_the_writes(tmp_path, monkeypatch, submitted):
    """Writes run up to RUN_BYTES of adjacent slots, reads up to a size of READ_RUN_SIZES (smaller
    reads ran faster on one host's disk, smaller writes slower): 12 adjacent blocks on 2 threads."""
    monkeypatch.setattr(nvme, "RUN_BYTES", 6 * SLOT)
    monkeypatch.setattr(nvme, "READ_RUN_SIZES", (2 * SLOT,))
    names = [f"b{i}" for i in range(12)]
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=2, c_io=True)
    futures = tier.put_many([(h(n), None, tier.staged_copy(data_of(n))) for n in names])
    assert [f.result(timeout=10) for f in futures] == [True] * 12
    assert sorted(submitted) == [(0, 6), (6 * SLOT, 6)]  # one write a thread
    del submitted[:]
    got = tier.get_many([h(n) for n in names]).result(timeout=10)
    assert all(same(g, data_of(n)) for n, g in zip(names, got))
    assert sorted(submitted) == [(2 * k * SLOT, 2) for k in range(6)]  # reads of two slots each
    tier.check_integrity()
    tier.close()
    monkeypatch.setenv("KVSTRATA_NVME_READ_RUN_KB", str(3 * SLOT // 1024))  # an operator's own size
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=2, c_io=True)
    del submitted[:]
    assert all(same(g, data_of(n)) for n, g in zip(names, again.get_many([h(n) for n in names]).result(timeout=10)))
    assert sorted(submitted) == [(3 * k * SLOT, 3) for k in range(4)]
    again.close()
    for bad in ("0", "2", "65537", "1m", ""):
        monkeypatch.setenv("KVSTRATA_NVME_READ_RUN_KB", bad)
        with pytest.raises(ValueError, match="KVSTRATA_NVME_READ_RUN_KB"):
            tier_at(tmp_path / "refused", c_io=True)


def test_loads_take_turns_between_run_sizes_and_time_the_bursts_they_cut_differently(tmp_path, monkeypatch,
                                                                                        submitted):
    """Without KVSTRATA_NVME_READ_RUN_KB, bursts try each of READ_RUN_SIZES in turn (run_sizes.py), and
    only a burst that the sizes would cut into different runs is timed."""
    monkeypatch.delenv("KVSTRATA_NVME_READ_RUN_KB", raising=False)
    monkeypatch.setattr(nvme, "READ_RUN_SIZES", (SLOT, 3 * SLOT))
    names = [f"b{i}" for i in range(12)]
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=2, c_io=True)
    assert [f.result(timeout=10) for f in tier.put_many([(h(n), None, data_of(n)) for n in names])] == [True] * 12
    stats = tier.stats()
    assert stats["read_run_slots"] == 1
    assert [r["bursts"] for r in stats["read_run_rates"]] == [0, 0]
    runs = []
    for _ in range(2):
        del submitted[:]
        got = tier.get_many([h(n) for n in names]).result(timeout=10)
        assert all(same(g, data_of(n)) for n, g in zip(names, got))
        runs.append(sorted(n for _, n in submitted))
    assert runs == [[1] * 12, [3] * 4]  # one slot a read, then three
    assert [(r["slots"], r["bursts"]) for r in tier.stats()["read_run_rates"]] == [(1, 1), (3, 1)]
    assert all(r["gb_per_s"] > 0 for r in tier.stats()["read_run_rates"])
    del submitted[:]
    tier.get_many([h("b0"), h("b5")]).result(timeout=10)  # one slot a run whichever the size: not timed
    assert [r["bursts"] for r in tier.stats()["read_run_rates"]] == [1, 1] and len(submitted) == 2
    tier.check_integrity()
    tier.close()
    monkeypatch.setenv("KVSTRATA_NVME_READ_RUN_KB", str(2 * SLOT // 1024))  # an operator's size: no choice
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT, num_io_threads=2, c_io=True)
    del submitted[:]
    assert all(same(g, data_of(n)) for n, g in zip(names, again.get_many([h(n) for n in names]).result(timeout=10)))
    assert sorted(n for _, n in submitted) == [2] * 6
    assert [(r["slots"], r["bursts"]) for r in again.stats()["read_run_rates"]] == [(2, 1)]  # its rate, for stats
    again.close()


def test_blocks_not_staged_are_staged_at_the_put(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, c_io=True)
    data = data_of("a")
    strided = torch.stack([data_of("b"), data_of("b")], dim=-1)[..., 0]  # not contiguous
    assert not strided.is_contiguous()
    fa, fb = tier.put_many([(h("a"), None, data), (h("b"), None, strided)])
    data.zero_()  # the caller's tensor is free once put returns: the tier copied it
    assert fa.result(timeout=10) and fb.result(timeout=10)
    assert same(tier.get(h("a")).result(), data_of("a")) and same(tier.get(h("b")).result(), data_of("b"))
    assert tier.num_staged == 0
    tier.check_integrity()
    tier.close()


def test_a_failed_run_fails_only_its_own_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "RUN_BYTES", 2 * SLOT)
    submit = IoPool.submit

    def failing_second_run(self, fd, write, offset, buffers, done):
        if offset == 2 * SLOT:  # a real IO error from the C thread: a closed descriptor
            bad = os.open(os.devnull, os.O_RDONLY)
            os.close(bad)
            fd = bad
        return submit(self, fd, write, offset, buffers, done)

    monkeypatch.setattr(IoPool, "submit", failing_second_run)
    names = [f"b{i}" for i in range(6)]
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, c_io=True)
    futures = tier.put_many([(h(n), None, data_of(n)) for n in names])
    assert [f.result(timeout=10) for f in futures] == [True, True, False, False, True, True]
    assert tier.stats()["write_failures"] == 2
    tier.flush()
    assert {n for n in names if h(n) in tier} == {"b0", "b1", "b4", "b5"}
    assert tier.num_staged == 0
    tier.check_integrity()
    tier.close()


def test_a_run_that_cannot_be_queued_fails_its_writes(tmp_path, monkeypatch):
    def refused(self, fd, write, offset, buffers, done):
        raise OSError(errno.ENOMEM, "could not queue an IO")

    monkeypatch.setattr(IoPool, "submit", refused)
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, c_io=True)
    assert tier.put(h("a"), None, data_of("a")).result(timeout=10) is False
    assert len(tier) == 0 and tier.num_pending_writes == 0 and tier.num_staged == 0
    tier.check_integrity()
    tier.close()


def test_a_write_discarded_in_flight_leaves_no_block_on_disk(tmp_path, monkeypatch):
    held: list = []
    submit = IoPool.submit

    def holding(self, fd, write, offset, buffers, done):
        def finish(err: int) -> None:
            held.append(lambda: done(err))  # the IO is done; its completion waits for the test

        return submit(self, fd, write, offset, buffers, finish)

    monkeypatch.setattr(IoPool, "submit", holding)
    tier = tier_at(tmp_path / "nvme", c_io=True)
    put = tier.put(h("a"), None, data_of("a"))
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.005)
    assert held and headers(slab0(tier))[0].block_hash == h("a")  # on disk, not yet in the index
    assert h("a") not in tier and tier.discard(h("a")) is True
    held.pop()()
    assert put.result(timeout=10) is False
    assert erased(slab0(tier), 0) and len(tier) == 0 and tier.num_staged == 0
    tier.check_integrity()
    tier.close()
    again = tier_at(tmp_path / "nvme")
    assert len(again) == 0
    again.close()


def test_close_waits_for_the_writes_and_stops_the_io_threads(tmp_path):
    before, before_c = io_threads(), c_threads()
    tier = tier_at(tmp_path / "nvme", capacity=16 * SLOT, c_io=True)
    assert len(io_threads()) == len(before) + 1 and c_threads() == before_c + 4  # the reaper, 4 C threads
    futures = tier.put_many([(h(f"b{i}"), None, data_of(f"b{i}")) for i in range(10)])
    tier.close()
    assert all(f.done() and f.result() for f in futures)
    assert io_threads() == before and c_threads() == before_c  # the C threads and the executors' too
    again = tier_at(tmp_path / "nvme", capacity=16 * SLOT)
    assert len(again) == 10
    again.close()


# -- reads -------------------------------------------------------------------------------------------


def test_get_many_reads_each_run_of_adjacent_slots_in_one_preadv(tmp_path, submitted):
    tier = filled(tmp_path, num_io_threads=2, c_io=True)
    submitted.clear()
    asked = ["b6", "b1", "zz", "b0", "b2", "b7", "b5"]  # shuffled, a miss, b3 and b4 left out
    got = tier.get_many([h(n) for n in asked]).result(timeout=10)
    assert got[2] is None and all(same(g, data_of(n)) for n, g in zip(asked, got) if n != "zz")
    # sorted slots 0 1 2 5 6 7, a run of at most three per thread: 0-2 and 5-7
    assert sorted(submitted) == [(0, 3), (5 * SLOT, 3)]
    assert no_slot_being_read(tier)
    tier.check_integrity()
    tier.close()


def test_a_bad_slot_inside_a_c_run_is_the_only_miss(tmp_path, submitted):
    tier = filled(tmp_path, num_io_threads=1, c_io=True)
    submitted.clear()
    in_payload = offset_of(tier, h("b4")) + ALIGN + 10
    patch(slab0(tier), in_payload, bytes([slot_bytes(slab0(tier), in_payload, 1)[0] ^ 0xFF]))
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert submitted == [(0, len(NAMES))]
    assert [g is not None for g in got] == [n != "b4" for n in NAMES]
    assert h("b4") not in tier and tier.stats()["checksum_failures"] == 1
    tier.check_integrity()
    tier.close()


def test_a_c_run_whose_read_fails_is_read_slot_by_slot(tmp_path, monkeypatch):
    tier = filled(tmp_path, num_io_threads=1, c_io=True)
    submit, read, singles = IoPool.submit, SlabFiles.read, []

    def failing_reads(self, fd, write, offset, buffers, done, *crc):
        if not write:
            fd = os.open(os.devnull, os.O_RDONLY)
            os.close(fd)  # a real EBADF from the C thread
        return submit(self, fd, write, offset, buffers, done, *crc)

    def counting_read(self, slot, buf):
        singles.append(slot)
        if slot == 3:
            raise OSError(errno.EIO, "injected")
        return read(self, slot, buf)

    monkeypatch.setattr(IoPool, "submit", failing_reads)
    monkeypatch.setattr(SlabFiles, "read", counting_read)
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert singles == list(range(len(NAMES)))
    assert [g is not None for g in got] == [n != "b3" for n in NAMES]
    assert h("b3") not in tier and len(tier) == len(NAMES) - 1 and no_slot_being_read(tier)
    tier.check_integrity()
    tier.close()


def test_a_bug_in_a_c_runs_check_reaches_the_caller_and_every_slot_is_let_go(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "READ_RUN_SIZES", (SLOT,))  # one block a read
    tier = filled(tmp_path, num_io_threads=1, c_io=True)
    calls, real = [], nvme.SlotIO.check_run

    def third_fails(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(self, *args)

    monkeypatch.setattr(nvme.SlotIO, "check_run", third_fails)
    with pytest.raises(RuntimeError, match="injected"):
        tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert no_slot_being_read(tier)
    monkeypatch.setattr(nvme.SlotIO, "check_run", real)
    got = tier.get_many([h(n) for n in NAMES]).result(timeout=10)
    assert all(same(g, data_of(n)) for n, g in zip(NAMES, got))
    tier.check_integrity()
    tier.close()


# -- scripts/nvme_io_paths.py ------------------------------------------------------------------------


def load_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "nvme_io_paths.py"
    spec = importlib.util.spec_from_file_location("nvme_io_paths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_io_paths_script_compares_both_paths_at_a_tiny_size(tmp_path, capsys):
    from tests.test_nvme_tier import direct_io_works

    if not direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT, so the probe has no reference")
    script = load_script()
    assert script.main([str(tmp_path / "disk"), "--rounds", "1", "--mb", "4"]) == 0
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"Python", "C"}
    for cells in rows.values():
        medians = [float(cell.split()[0]) for cell in cells]
        assert len(medians) == 3 and all(m > 0 for m in medians)
    assert nvme.NvmeTier.__name__ == "NvmeTier"  # the script put the real class back
    assert not (tmp_path / "disk" / "tier-probe").exists()


def test_the_io_paths_script_refuses_bad_arguments(tmp_path):
    script = load_script()
    for bad in (["--rounds", "0"], ["--mb", "-1"]):
        with pytest.raises(SystemExit):
            script.main([str(tmp_path), *bad])


def test_stats_count_the_c_threads_time_in_their_syscalls(tmp_path):
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, c_io=True)
    assert tier.stats()["c_io_syscall_seconds"] == 0.0
    assert all(f.result(timeout=10) for f in tier.put_many([(h(n), None, data_of(n)) for n in "abcd"]))
    after_writes = tier.stats()["c_io_syscall_seconds"]
    assert after_writes > 0.0
    assert all(b is not None for b in tier.get_many([h(n) for n in "abcd"]).result(timeout=10))
    assert tier.stats()["c_io_syscall_seconds"] > after_writes
    stats = tier.stats()
    # the disk's share of each busy clock: never more than the clock, never more than the summed syscalls
    for kind in ("write", "read"):
        assert 0.0 < stats[f"{kind}_io_seconds"] <= stats[f"{kind}_busy_seconds"]
    assert stats["write_io_seconds"] + stats["read_io_seconds"] <= stats["c_io_syscall_seconds"] + 1e-9
    tier.close()
    plain = tier_at(tmp_path / "py", capacity=8 * SLOT, c_io=False)
    assert plain.stats()["write_io_seconds"] is None and plain.stats()["read_io_seconds"] is None
    plain.close()
