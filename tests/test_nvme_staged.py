"""Blocks staged for their NVMe write as they leave DRAM (tiering/slot_stage.py): the slot on disk is
byte for byte what the IO thread's own staging writes, the IO thread stages nothing more, and every
write buffer comes back to the pool however the put ends."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.tiering import slot_io
from kvstrata.tiering.block_file import ALIGN
from kvstrata.tiering.slab import SlabFiles
from kvstrata.tiering.slot_stage import StagedCopies
from tests.test_nvme_tier import PAYLOAD, SHAPE, SLOT, data_of, h, offset_of, same, slab0, slot_bytes, tier_at


@pytest.fixture
def staging_enabled(tmp_path):
    tier = tier_at(tmp_path / "probe")
    enabled = tier._staged.enabled
    tier.close()
    if not enabled:
        pytest.skip("no C CRC on this host: staged copies are plain clones")


def test_a_staged_put_writes_the_slot_a_plain_put_writes(tmp_path, staging_enabled, monkeypatch):
    plain, staged = tier_at(tmp_path / "plain"), tier_at(tmp_path / "staged")
    data = data_of("b")
    assert plain.put(h("b"), h("a"), data).result()
    copy = staged.staged_copy(data)
    assert same(copy, data) and copy.data_ptr() != data.data_ptr() and staged.num_staged == 1

    def no_staging(*a):
        raise AssertionError("a staged block was staged again")

    monkeypatch.setattr(slot_io, "stage", no_staging)
    assert staged.put(h("b"), h("a"), copy).result() and staged.num_staged == 0
    slot = offset_of(staged, h("b"))
    assert slot_bytes(slab0(staged), slot) == slot_bytes(slab0(plain), offset_of(plain, h("b")))
    assert same(staged.get(h("b")).result(), data)
    staged.check_integrity()
    for t in (plain, staged):
        t.close()
    again = tier_at(tmp_path / "staged")
    assert same(again.get(h("b")).result(), data)
    again.close()


def test_every_write_buffer_comes_back(tmp_path, staging_enabled):
    tier = tier_at(tmp_path / "nvme")
    pool = tier._staged.buffers
    assert tier.put(h("a"), None, tier.staged_copy(data_of("a"))).result()
    assert len(pool) == 1  # written, and back
    assert tier.put(h("a"), None, tier.staged_copy(data_of("a"))).result()  # already stored: only a refresh
    assert len(pool) == 1 and tier.num_staged == 0
    tier.release_staged(tier.staged_copy(data_of("c")))  # not put after all
    assert len(pool) == 1 and tier.num_staged == 0
    tier.release_staged(data_of("c"))  # any other tensor: nothing to give back
    tier.release_staged(None)
    assert len(pool) == 1
    copies = [tier.staged_copy(data_of(n)) for n in "xyz"]
    assert len({c.data_ptr() for c in copies}) == 3 and tier.num_staged == 3
    assert all(f.result() for f in [tier.put(h(n), None, c) for n, c in zip("xyz", copies)])
    assert len(pool) == 3 and tier.num_staged == 0
    tier.check_integrity()
    tier.close()


def test_a_discarded_staged_write_gives_its_buffer_back(tmp_path, staging_enabled):
    tier = tier_at(tmp_path / "nvme", num_io_threads=1)
    copies = [tier.staged_copy(data_of(n)) for n in "abc"]  # three buffers (a write done early frees one for reuse)
    futures = [tier.put(h(n), None, c) for n, c in zip("abc", copies)]
    tier.discard(h("c"))  # queued behind the others, or in flight: either way not stored
    tier.flush()
    assert [f.result() for f in futures][:2] == [True, True] and h("c") not in tier
    assert tier.num_staged == 0 and len(tier._staged.buffers) == 3
    tier.check_integrity()
    tier.close()


def test_staged_copies_are_plain_clones_where_heads_differ_in_length():
    """A layout whose head can be longer than one page has no one payload offset: no staging."""
    copies = StagedCopies(3 * ALIGN, 2 * ALIGN, torch.float32, SHAPE, PAYLOAD, limit=4)
    data = data_of("a")
    copy = copies.copy(data)
    assert not copies.enabled and same(copy, data) and copy.data_ptr() != data.data_ptr()
    assert copies.claim(copy) is None and len(copies) == 0


def test_a_run_of_staged_blocks_goes_out_in_one_pwritev_without_staging_again(tmp_path, staging_enabled, monkeypatch):
    """The first write is held, so the three queued behind it form one run of adjacent slots: all
    staged as they left DRAM, they go from their own buffers, with no copy into the IO thread's."""
    started, release, runs = threading.Event(), threading.Event(), []
    write_run = SlabFiles.write_run

    def held(self, slot, bufs):
        runs.append((slot, len(bufs)))
        if not started.is_set():
            started.set()
            assert release.wait(10)
        return write_run(self, slot, bufs)

    def no_staging(*a):
        raise AssertionError("a staged block was staged again")

    monkeypatch.setattr(SlabFiles, "write_run", held)
    monkeypatch.setattr(slot_io, "stage", no_staging)
    tier = tier_at(tmp_path / "nvme", capacity=8 * SLOT, num_io_threads=1, c_io=False)
    copies = [tier.staged_copy(data_of(n)) for n in "abcd"]
    futures = [tier.put(h("a"), None, copies[0])]
    assert started.wait(10)
    futures += [tier.put(h(n), None, c) for n, c in zip("bcd", copies[1:])]
    release.set()
    assert [f.result(timeout=10) for f in futures] == [True] * 4
    assert runs == [(0, 1), (1, 3)] and tier.num_staged == 0
    assert all(same(tier.get(h(n)).result(), data_of(n)) for n in "abcd")
    tier.check_integrity()
    tier.close()


def test_a_staged_copy_is_its_own_payload_view_and_its_crc_is_kept(tmp_path, staging_enabled):
    """put takes a staged copy as the payload view it already is; any other tensor gets the view of
    the buffer; the CRC stashed in the buffer reads back as zlib's of the payload."""
    import zlib

    from kvstrata.tiering.slot_codec import stashed_crc

    tier = tier_at(tmp_path / "nvme")
    staged = tier._staged
    copy = tier.staged_copy(data_of("a"))
    buf = staged.claim(copy)
    assert staged.payload(buf, copy) is copy
    other = staged.payload(buf, data_of("a"))  # the caller's own tensor: not in the buffer
    assert other is not copy and other.data_ptr() == copy.data_ptr() and same(other, data_of("a"))
    assert staged.payload(buf).data_ptr() == copy.data_ptr()
    assert stashed_crc(buf) == zlib.crc32(copy.contiguous().view(-1).view(torch.uint8).numpy())
    staged.give([buf])
    tier.close()
