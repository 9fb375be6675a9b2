"""The NVMe tier's choice of read run size from its loads' own rates (tiering/run_sizes.py)."""

import pytest

from kvstrata.tiering import run_sizes
from kvstrata.tiering.run_sizes import EXPLORE_EVERY, MIN_SAMPLES, WINDOW, RunSizeChooser

MB = 1 << 20


def feed(chooser: RunSizeChooser, rates: dict[int, float], picks: int) -> list[int]:
    """`picks` bursts of 8 MB, each size reading at rates[size] bytes a second; the sizes picked."""
    got = []
    for _ in range(picks):
        size = chooser.pick()
        got.append(size)
        chooser.record(size, 8 * MB, 8 * MB / rates[size])
    return got


def test_each_size_is_tried_in_turn_before_the_faster_one_is_taken():
    chooser = RunSizeChooser([5, 1])
    assert chooser.candidates == [1, 5]
    assert chooser.best() == 1  # nothing timed yet: the smallest
    first = feed(chooser, {1: 1e9, 5: 3e9}, 2 * MIN_SAMPLES)
    assert sorted(first) == [1] * MIN_SAMPLES + [5] * MIN_SAMPLES
    assert chooser.best() == 5
    after = feed(chooser, {1: 1e9, 5: 3e9}, 4 * EXPLORE_EVERY)
    assert after.count(1) == 4  # one burst in EXPLORE_EVERY keeps the slower size measured
    assert all((i + 1) % EXPLORE_EVERY == 0 for i, size in enumerate(after) if size == 1)
    stats = chooser.stats()
    assert stats["read_run_slots"] == 5
    rates = {r["slots"]: r for r in stats["read_run_rates"]}
    assert rates[5]["gb_per_s"] == pytest.approx(3.0, rel=1e-3) and rates[1]["gb_per_s"] == pytest.approx(1.0, rel=1e-3)
    assert rates[5]["bursts"] == WINDOW and rates[1]["bursts"] == MIN_SAMPLES + 4


def test_a_disk_that_changes_is_followed():
    chooser = RunSizeChooser([1, 5])
    feed(chooser, {1: 1e9, 5: 3e9}, 2 * MIN_SAMPLES + 2 * EXPLORE_EVERY)
    assert chooser.best() == 5
    feed(chooser, {1: 1e9, 5: 0.2e9}, 2 * WINDOW)  # the large runs slow down: their window fills with it
    assert chooser.best() == 1
    assert chooser.pick() in (1, 5)


def test_the_first_picks_alternate_even_before_their_records_arrive():
    chooser = RunSizeChooser([1, 4])
    picks = [chooser.pick() for _ in range(2 * MIN_SAMPLES)]  # bursts still in flight: nothing recorded
    assert sorted(picks) == [1] * MIN_SAMPLES + [4] * MIN_SAMPLES
    assert picks[:2] in ([1, 4], [4, 1])


def test_one_size_is_always_that_size_and_empty_bursts_do_not_count():
    chooser = RunSizeChooser([3])
    assert {chooser.pick() for _ in range(3 * EXPLORE_EVERY)} == {3}
    chooser.record(3, 0, 0.5)  # every block missed: nothing read
    chooser.record(3, MB, 0.0)
    assert chooser.stats()["read_run_rates"] == [{"slots": 3, "gb_per_s": 0.0, "bursts": 0}]
    with pytest.raises(ValueError, match="run sizes"):
        chooser.record(2, MB, 0.1)
    for bad in ([], [0, 1]):
        with pytest.raises(ValueError, match="run sizes"):
            RunSizeChooser(bad)


def test_equal_rates_keep_the_smaller_size(monkeypatch):
    monkeypatch.setattr(run_sizes, "MIN_SAMPLES", 1)
    chooser = RunSizeChooser([1, 2])
    feed(chooser, {1: 2e9, 2: 2e9}, 2)
    assert chooser.best() == 1
