"""How a bf16 model's greedy calls choose their way (worker/head_choice.py): every way sampled first,
then the least median time a row, with a look at the others every explore_every-th call."""

from __future__ import annotations

import pytest

from kvstrata.worker.head_choice import HeadChoice


def _call(choice: HeadChoice, rows: int, seconds_a_row: dict[str, float]) -> str:
    way = choice.pick(rows)
    choice.record(rows, way, seconds_a_row[way] * rows)
    return way


def test_calls_are_grouped_by_their_rows_bit_length():
    assert [HeadChoice.group(r) for r in (1, 2, 3, 4, 7, 8, 31, 32, 63, 64)] == [1, 2, 2, 3, 3, 4, 5, 6, 6, 7]
    with pytest.raises(ValueError, match="rows"):
        HeadChoice.group(0)


def test_every_way_is_sampled_then_the_fastest_taken_with_looks_at_the_others_backing_off():
    choice = HeadChoice(("a", "b", "c"), samples=2, explore_every=8)
    speed = {"a": 3.0, "b": 1.0, "c": 2.0}
    ways = [_call(choice, 16, speed) for _ in range(80)]
    assert ways[:6] == ["a", "a", "b", "b", "c", "c"]
    looks = {i + 1: w for i, w in enumerate(ways[6:], start=6) if w != "b"}
    # b chosen at call 7: a looked at 8 calls on, c 16; each look that finds the way slower doubles its gap
    assert looks == {15: "a", 23: "c", 31: "a", 39: "c", 63: "a", 71: "c"}
    assert choice.taken == {"a": 5, "b": 70, "c": 5}
    assert choice.best(16) == "b" and choice.best(31) == "b"
    many = HeadChoice(("a", "b"), samples=1, explore_every=2)
    calls = [_call(many, 4, {"a": 1.0, "b": 2.0}) for _ in range(300)]
    gaps = [j - i for i, j in zip(*[[k for k, w in enumerate(calls) if w == "b"][n:] for n in (1, 2)])]
    assert gaps[:5] == [4, 8, 16, 32, 32]  # up to explore_every * MAX_BACKOFF calls apart


def test_groups_choose_apart_and_time_a_row():
    choice = HeadChoice(("copy", "own"), samples=1, explore_every=100)
    # 2 and 3 rows share a group: 3 rows at 2.5 s (0.83 a row) beat 2 rows at 2 s (1.0 a row)
    assert choice.pick(2) == "copy"
    choice.record(2, "copy", 2.0)
    assert choice.pick(3) == "own"
    choice.record(3, "own", 2.5)
    assert choice.pick(2) == "own"
    assert choice.best(1) == "copy"  # no time yet in the group of one row: the first way
    assert choice.pick(1) == "copy"  # and it samples every way there afresh
    choice.record(1, "copy", 5.0)
    assert choice.pick(1) == "own"


def test_the_choice_follows_a_change_in_the_rows():
    choice = HeadChoice(("int8", "own"), samples=3, explore_every=4)
    speed = {"int8": 1.0, "own": 2.0}
    for _ in range(12):
        _call(choice, 32, speed)
    assert choice.best(32) == "int8"
    speed = {"int8": 4.0, "own": 2.0}  # rows its bound leaves many tokens of
    ways = [_call(choice, 32, speed) for _ in range(12)]
    assert ways[-4:] != ["int8"] * 4 and choice.best(32) == "own"
    speed = {"int8": 1.0, "own": 2.0}  # and back: the looks at int8 find it faster again
    ways = [_call(choice, 32, speed) for _ in range(24)]
    assert choice.best(32) == "int8" and ways[-4:] == ["int8", "int8", "int8", "own"]  # the 48th call: a look


def test_bad_settings_and_ways_are_refused():
    for ways in ((), ("a", "a")):
        with pytest.raises(ValueError, match="distinct ways"):
            HeadChoice(ways)
    with pytest.raises(ValueError, match="samples"):
        HeadChoice(("a",), samples=0)
    with pytest.raises(ValueError, match="explore_every"):
        HeadChoice(("a",), explore_every=1)
    with pytest.raises(ValueError, match="no way 'z'"):
        HeadChoice(("a", "b")).record(4, "z", 1.0)
    assert HeadChoice(("a",), explore_every=2).pick(5) == "a"  # one way: no other to look at
