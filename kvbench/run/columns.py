"""A per-step column of a run's step log, held in a numpy array.

A long simulated replay logs tens of millions of steps; as Python lists of ints and floats
its columns took about 650 bytes a step, here 8 bytes a value. A value an engine cannot give
(None) is kept in a mask beside the array. Columns read like the lists they replace (length,
indexing, slicing into lists, iteration, ``None in column``, equality with a list), and
``numpy.asarray(column)`` is a view of the values, without copying.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_FIRST_CAPACITY = 64


class Column:
    """Growable values of one dtype (``int64`` unless told), some possibly None."""

    __slots__ = ("_data", "_missing", "_size")

    def __init__(self, dtype: type = np.int64, values: Iterable[Any] = ()) -> None:
        self._data = np.empty(_FIRST_CAPACITY, dtype=dtype)
        self._size = 0
        # Where a None was appended (the array holds 0 there); None while there is none.
        self._missing: np.ndarray | None = None
        self.extend(values)

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    def _reserve(self, extra: int) -> None:
        need = self._size + extra
        if need <= len(self._data):
            return
        capacity = max(need, len(self._data) * 3 // 2)
        data = np.empty(capacity, dtype=self._data.dtype)
        data[: self._size] = self._data[: self._size]
        self._data = data
        if self._missing is not None:
            missing = np.zeros(capacity, dtype=bool)
            missing[: self._size] = self._missing[: self._size]
            self._missing = missing

    def _mark_missing(self, start: int, flags: np.ndarray) -> None:
        if self._missing is None:
            self._missing = np.zeros(len(self._data), dtype=bool)
        self._missing[start : start + len(flags)] = flags

    def _check(self, values: np.ndarray) -> np.ndarray:
        """``values`` as this column's dtype; a fraction in an integer column is refused
        rather than cut."""
        integer = self._data.dtype.kind in "iu"
        if integer and values.dtype.kind == "f" and not np.all(np.mod(values, 1) == 0):
            raise TypeError(f"an integer column cannot hold fractional values {values[:4]}")
        return values

    def append(self, value: Any) -> None:
        self._reserve(1)
        i = self._size
        if value is None:
            self._size += 1
            self._data[i] = 0
            self._mark_missing(i, np.ones(1, dtype=bool))
            return
        if isinstance(value, float) and self._data.dtype.kind in "iu" and not value.is_integer():
            raise TypeError(f"an integer column cannot hold the fractional value {value}")
        self._data[i] = value
        self._size += 1

    def extend(self, values: Iterable[Any]) -> None:
        if isinstance(values, Column):
            values = values.tolist() if values._missing is not None else values.view()
        if isinstance(values, np.ndarray):
            arr = self._check(values)
            flags = None
        else:
            items = values if isinstance(values, list) else list(values)
            if not items:
                return
            try:
                arr = self._check(np.asarray(items))
                flags = None
            except (TypeError, ValueError):
                arr = None
            if arr is None or arr.dtype == object:
                flags = np.fromiter((v is None for v in items), bool, len(items))
                arr = self._check(np.asarray([0 if v is None else v for v in items]))
        n = len(arr)
        if not n:
            return
        self._reserve(n)
        start = self._size
        self._data[start : start + n] = arr
        self._size += n
        if flags is not None and flags.any():
            self._mark_missing(start, flags)

    def repeat(self, value: Any, count: int) -> None:
        """Append ``value`` ``count`` times."""
        if count <= 0:
            return
        if value is None:
            self.extend([None] * count)
            return
        self._reserve(count)
        self._data[self._size : self._size + count] = value
        self._size += count

    def view(self) -> np.ndarray:
        """The values as an array (no copy; where None was appended it holds 0)."""
        return self._data[: self._size]

    def present(self) -> np.ndarray:
        """The values that are not None, in order."""
        if self._missing is None:
            return self.view()
        return self.view()[~self._missing[: self._size]]

    @property
    def has_none(self) -> bool:
        return self._missing is not None and bool(self._missing[: self._size].any())

    def tolist(self) -> list[Any]:
        out = self.view().tolist()
        if self._missing is not None:
            for i in np.flatnonzero(self._missing[: self._size]).tolist():
                out[i] = None
        return out

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            if self._missing is None:
                return self.view()[key].tolist()
            return self.tolist()[key]
        n = self._size
        i = key + n if key < 0 else key
        if not 0 <= i < n:
            raise IndexError(f"step {key} of a column of {n}")
        if self._missing is not None and self._missing[i]:
            return None
        return self._data[i].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def __contains__(self, value: object) -> bool:
        if value is None:
            return self.has_none
        return value in self.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column | list | tuple):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self.has_none:
            return np.asarray(self.tolist(), dtype=dtype)
        out = self.view()
        if dtype is not None and out.dtype != dtype:
            return out.astype(dtype)
        if copy:
            return out.copy()
        out.flags.writeable = False  # a view of the log: reading it must not change it
        return out

    def __repr__(self) -> str:
        return f"Column({self.tolist()!r})"


def column_of(columns: dict[str, Column], name: str) -> Column:
    """``columns[name]``, an empty integer column added first if it is not there."""
    col = columns.get(name)
    if col is None:
        col = columns[name] = Column()
    return col
