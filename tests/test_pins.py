"""The prompt-cache pin table (tiering/pins.py): TTLs, tenants and quotas, on a clock the test moves."""

from __future__ import annotations

import pytest

from kvstrata.tiering.pins import PinTable


def _table(max_blocks: int = 8, quota: int | None = None) -> tuple[PinTable, list[float]]:
    now = [100.0]
    return PinTable(max_blocks, quota, block_bytes=1000, clock=lambda: now[0]), now


def test_pins_expire_at_their_ttl_and_a_longer_pin_extends_them():
    pins, now = _table()
    pins.add([b"a", b"b"], 10.0, "t1")
    pins.add([b"b"], 30.0, "t2")  # b again, for longer: extended, still t1's
    pins.add([b"a"], 1.0, "t1")  # a again, for shorter: the longer TTL stays
    assert (len(pins), pins.count("t1"), pins.count("t2")) == (2, 2, 0)
    now[0] = 109.9
    assert not pins.expire() and b"a" in pins
    now[0] = 110.0
    assert pins.expire()  # a's 10 s are up; b's first heap entry is stale and ignored
    assert b"a" not in pins and b"b" in pins and pins.snapshot() == frozenset({b"b"})
    now[0] = 130.0
    assert pins.expire() and len(pins) == 0 and not pins.expire()


def test_quotas_refuse_a_pin_whole_and_name_cache_control():
    pins, now = _table(max_blocks=5, quota=3)
    pins.add([b"a", b"b"], 60.0, "t1")
    with pytest.raises(ValueError, match=r"cache_control: tenant 't1' would pin 4000 bytes .* quota of 3000"):
        pins.add([b"c", b"d"], 60.0, "t1")
    assert pins.count("t1") == 2  # nothing of the refused pin was kept
    pins.add([b"a", b"b", b"c"], 60.0, "t1")  # two of them held already: within the quota
    pins.add([b"x", b"y"], 60.0, "")
    with pytest.raises(ValueError, match=r"cache_control: the server's pinned KV is full \(5000 bytes\)"):
        pins.add([b"z"], 60.0, "t3")
    now[0] += 61.0  # expired pins make room before the next one is counted
    pins.add([b"z"], 60.0, "t3")
    assert pins.count() == 1
    pins.clear()
    assert len(pins) == 0 and pins.snapshot() == frozenset()


def test_the_quota_never_exceeds_the_table():
    assert PinTable(4, 100, 1).quota_blocks == 4
    assert PinTable(0, None, 1).max_blocks == 1  # a tier of one block still takes a pin
