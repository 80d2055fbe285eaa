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
# Values appended one at a time wait in a list, and arrays in a queue, until this many are
# waiting: then they join the array in one copy (a list append is several times cheaper
# than setting one element of an array).
_FLUSH = 4096


class Column:
    """Growable values of one dtype (``int64`` unless told: fractions make it ``float64``),
    some possibly None. An array
    passed to :meth:`extend` is queued as it is: it must not change afterwards."""

    __slots__ = ("_data", "_missing", "_pending", "_queue", "_queued", "_size")

    def __init__(self, dtype: type = np.int64, values: Iterable[Any] = ()) -> None:
        self._data = np.empty(_FIRST_CAPACITY, dtype=dtype)
        self._size = 0
        # Where a None was stored (the array holds 0 there); None while there is none.
        self._missing: np.ndarray | None = None
        self._pending: list[Any] = []
        # Arrays waiting, in order, each with its None flags (or None: no None in it).
        self._queue: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._queued = 0
        self.extend(values)

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    def append(self, value: Any) -> None:
        pending = self._pending
        pending.append(value)
        if len(pending) >= _FLUSH:
            self._flush()

    def extend(self, values: Iterable[Any]) -> None:
        if type(values) is np.ndarray:
            if self._pending:
                self._queue_pending()
            self._queue.append((values, None))
            self._queued += len(values)
        else:
            self._pending.extend(values.tolist() if isinstance(values, Column) else values)
        if self._queued + len(self._pending) >= _FLUSH:
            self._flush()

    def _queue_pending(self) -> None:
        """Move the values appended one at a time to the queue, as one array."""
        pending, self._pending = self._pending, []
        arr = np.asarray(pending) if None not in pending else None
        flags = None
        if arr is None or arr.dtype == object:
            flags = np.fromiter((v is None for v in pending), bool, len(pending))
            arr = np.asarray([0 if v is None else v for v in pending])
        self._queue.append((arr, flags))
        self._queued += len(arr)

    def _flush(self) -> None:
        if self._pending:
            self._queue_pending()
        queue = self._queue
        if not queue:
            return
        if len(queue) == 1:
            values, missing = queue[0]
        else:
            values = np.concatenate([v for v, _ in queue])
            missing = None
            if any(f is not None for _, f in queue):
                missing = np.concatenate([np.zeros(len(v), bool) if f is None else f
                                          for v, f in queue])
        self._store(values, missing)
        self._queue = []
        self._queued = 0

    def _store(self, values: np.ndarray, missing: np.ndarray | None) -> None:
        """Append ``values`` (``missing``: which of them stand for None) to the array. An
        integer column given a fraction becomes a float one rather than cut it."""
        if (values.dtype.kind == "f" and self._data.dtype.kind in "iu"
                and not np.all(np.mod(values, 1) == 0)):
            self._data = self._data.astype(np.float64)
        n = len(values)
        start = end = self._size
        end += n
        if end > len(self._data):
            capacity = max(end, len(self._data) * 3 // 2)
            data = np.empty(capacity, dtype=self._data.dtype)
            data[:start] = self._data[:start]
            self._data = data
            if self._missing is not None:
                self._missing = np.concatenate(
                    [self._missing[:start], np.zeros(capacity - start, dtype=bool)])
        self._data[start:end] = values
        self._size = end
        if missing is not None and missing.any():
            if self._missing is None:
                self._missing = np.zeros(len(self._data), dtype=bool)
            self._missing[start:end] = missing

    def repeat(self, value: Any, count: int) -> None:
        """Append ``value`` ``count`` times."""
        if count < 64 or value is None:
            self.extend([value] * count)
            return
        self.extend(np.full(count, value, dtype=self._data.dtype))

    def view(self) -> np.ndarray:
        """The values as an array (no copy; where None was appended it holds 0)."""
        self._flush()
        return self._data[: self._size]

    def present(self) -> np.ndarray:
        """The values that are not None, in order."""
        self._flush()
        if self._missing is None:
            return self.view()
        return self.view()[~self._missing[: self._size]]

    @property
    def has_none(self) -> bool:
        self._flush()
        return self._missing is not None and bool(self._missing[: self._size].any())

    def tolist(self) -> list[Any]:
        out = self.view().tolist()  # flushes
        if self._missing is not None:
            for i in np.flatnonzero(self._missing[: self._size]).tolist():
                out[i] = None
        return out

    def __len__(self) -> int:
        return self._size + self._queued + len(self._pending)

    def __getitem__(self, key: int | slice) -> Any:
        self._flush()
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
