"""Host buffers on transparent huge pages: the packed weights and the CPU KV pool."""

from __future__ import annotations

import gc

import pytest
import torch

from kvstrata.worker.huge_pages import HUGE_PAGE, empty_on_huge_pages, huge_pages_available

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this host gives no transparent huge pages")


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    fields: dict[str, str] | None = None
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            fields = {} if start <= address < end else None
        elif fields is not None and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
            if head == "VmFlags:":
                return fields
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_buffer_holds_values_after_the_call(dtype):
    numel = (3 * HUGE_PAGE + 4096) // torch.empty((), dtype=dtype).element_size()
    t = empty_on_huge_pages(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
    t.copy_(torch.arange(numel).to(dtype))
    gc.collect()  # the mapping must outlive the function's locals
    assert torch.equal(t, torch.arange(numel).to(dtype))
    view = t[HUGE_PAGE // 8 :]
    del t
    gc.collect()
    assert torch.equal(view[:5], torch.arange(HUGE_PAGE // 8, HUGE_PAGE // 8 + 5).to(dtype))


@needs_thp
def test_large_buffers_are_aligned_and_advised():
    t = empty_on_huge_pages(HUGE_PAGE, torch.float32)  # 8 MB
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.0)
    assert _smaps_entry(t.data_ptr())["THPeligible"] == "1"


def test_small_buffers_are_plain_tensors():
    t = empty_on_huge_pages(1000, torch.float32)
    assert t.shape == (1000,)
    with pytest.raises(ValueError, match="numel"):
        empty_on_huge_pages(-1, torch.float32)


@needs_thp
def test_engine_weights_and_pool_sit_on_huge_pages(llm):
    model = llm.engine.runner.model
    layer = model.layers[0]
    packed = layer.qkv[0] if isinstance(layer.qkv, tuple) else layer.qkv
    if not hasattr(packed, "n"):
        pytest.skip("this model's projections are not packed (no C kernels)")
    assert _smaps_entry(packed.data.data_ptr())["THPeligible"] == "1"
    pool = llm.engine.runner.kv_cache
    assert pool.data_ptr() % HUGE_PAGE == 0
    assert _smaps_entry(pool.data_ptr())["THPeligible"] == "1"


def test_io_buffers_are_aligned_for_o_direct_on_huge_pages_or_not(monkeypatch):
    from kvstrata.tiering import disk_io
    from kvstrata.tiering.block_file import ALIGN

    for n in (1, ALIGN, 741376, 3 * HUGE_PAGE + 5):
        buf = disk_io.io_buffer(n)
        assert buf.shape == (n,) and buf.dtype == torch.uint8 and buf.data_ptr() % ALIGN == 0
        buf.fill_(7)  # every byte is ours
        if huge_pages_available():
            assert buf.data_ptr() % HUGE_PAGE == 0
            assert _smaps_entry(buf.data_ptr())["THPeligible"] == "1"
    monkeypatch.setattr(disk_io, "huge_pages_available", lambda: False)
    buf = disk_io.io_buffer(741376)
    assert buf.shape == (741376,) and buf.data_ptr() % ALIGN == 0


@needs_thp
def test_bandwidth_probes_read_huge_pages_as_the_engine_does():
    """A probe on 4 KB pages times page walks the engine does not pay, and its bound is no bound."""
    from kvstrata.cluster.bench.roofline import PeakProbe, probe_buffer

    buf = probe_buffer(8 * HUGE_PAGE, 3.0)
    assert buf.dtype == torch.float32 and buf.numel() == 2 * HUGE_PAGE
    assert bool((buf == 3.0).all())
    assert buf.data_ptr() % HUGE_PAGE == 0 and _smaps_entry(buf.data_ptr())["THPeligible"] == "1"
    probe = PeakProbe("float32", read_bytes=4 * HUGE_PAGE, matmul_size=64)
    assert _smaps_entry(probe._buf.data_ptr())["THPeligible"] == "1"
    assert probe.measure().read_bytes_per_s > 0
