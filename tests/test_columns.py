"""The step log's columns: numpy storage that reads like the lists it replaced."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.results.columns import Column, _Flat, _Runs, column_of


def test_values_and_none_survive_growth() -> None:
    col = Column()
    expected: list[int | None] = []
    for i in range(1000):
        value = None if i % 97 == 5 else i * 3
        col.append(value)
        expected.append(value)
    col.extend(np.arange(10, dtype=np.int64))
    col.extend([None, 7])
    col.repeat(4, 3)
    col.repeat(None, 2)
    expected += [*range(10), None, 7, 4, 4, 4, None, None]
    assert len(col) == len(expected)
    assert col.tolist() == expected and col == expected
    assert col[-1] is None and col[1] == 3 and col[5] is None
    assert col[3:8] == expected[3:8]
    assert None in col and 21 in col and -1 not in col
    assert col.present().tolist() == [v for v in expected if v is not None]
    with pytest.raises(IndexError):
        col[len(expected)]
    col.repeat(9, 5000)
    assert len(col) == len(expected) + 5000 and col[-1] == 9 and col[len(expected) - 1] is None


def test_no_none_reads_as_an_array_view() -> None:
    col = Column(np.float64, [0.5, 1.25])
    col.append(2)
    arr = np.asarray(col)
    assert arr.dtype == np.float64 and arr.tolist() == [0.5, 1.25, 2.0]
    assert not col.has_none and None not in col
    with pytest.raises(ValueError):
        arr[0] = 9.0  # a view of the log is read-only
    assert np.asarray(col, dtype=np.int64).tolist() == [0, 1, 2]


def test_an_integer_column_keeps_fractions_as_floats() -> None:
    col = Column()
    col.append(3.0)
    col.extend([4.0, 5])
    assert col.tolist() == [3, 4, 5] and col.dtype == np.int64
    col.extend(np.array([1.0, 1.5]))
    col.append(7)
    assert col.tolist() == [3, 4, 5, 1, 1.5, 7] and col.dtype == np.float64


def test_column_of_adds_once() -> None:
    columns: dict[str, Column] = {}
    column_of(columns, "a").append(1)
    column_of(columns, "a").append(2)
    assert list(columns) == ["a"] and columns["a"] == [1, 2]


def test_event_columns_stay_runs_and_varying_ones_turn_flat() -> None:
    rng = np.random.default_rng(0)
    steady, varying = Column(), Column(np.float64)
    expected_steady: list[int | None] = []
    for start in range(0, 20_000, 37):  # a value that changes every 37 steps, some None
        value = None if start % 5 == 0 else start // 37 % 4
        if start % 2:
            steady.repeat(value, 37)
        else:
            for _ in range(37):
                steady.append(value)
        expected_steady += [value] * 37
        varying.extend(rng.random(37))
    assert isinstance(steady._store, _Runs) and isinstance(varying._store, _Flat)
    assert steady.tolist() == expected_steady and len(steady) == len(expected_steady)
    for i in (0, 36, 37, 5000, -1):
        assert steady[i] == expected_steady[i]
    assert steady.present().tolist() == [v for v in expected_steady if v is not None]
    arr = np.asarray(varying)
    assert len(arr) == len(steady) and not varying.has_none and arr.max() < 1.0


@pytest.mark.parametrize("runs", [True, False])
def test_head_and_drop_of_runs_and_values(runs: bool) -> None:
    """The first values, and forgetting them (a long replay folds its oldest steps), read as
    slicing the list would, held as runs or as values."""
    rng = np.random.default_rng(3)
    expected: list[int | None] = []
    col = Column()
    for _ in range(300 if runs else 5000):  # values past 4096, changing at every one
        value = None if rng.random() < 0.1 else int(rng.integers(0, 3 if runs else 10**9))
        count = int(rng.integers(1, 40 if runs else 2))
        col.repeat(value, count)
        expected += [value] * count
    col._flush()
    assert isinstance(col._store, _Runs if runs else _Flat)
    for n in (0, 1, 57, len(expected) // 2, len(expected) - 1, len(expected)):
        values, nones = col.head(n)
        flags = [v is None for v in expected[:n]]
        assert values.tolist() == [0 if v is None else v for v in expected[:n]]
        assert (nones.tolist() if nones is not None else [False] * n) == flags
        assert (nones is None) == (not any(flags))
    dropped = 0
    for n in (5, 131, 1):
        col.drop(n)
        dropped += n
        assert col.tolist() == expected[dropped:] and len(col) == len(expected) - dropped
    col.append(8)
    assert col[-1] == 8 and col[0] == expected[dropped]
