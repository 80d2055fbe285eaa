"""A per-step column of a run's step log, held in numpy arrays.

A long simulated replay logs tens of millions of steps. As Python lists of ints and floats
its step log took some 650 bytes a step; here a column that changes at most steps holds
8 bytes a value, and one that changes only at events (queue sizes, capacity, counters that
move at arrivals and finishes, most device-memory components) holds its runs of equal
values: 17 bytes a run. A value an engine cannot give (None) is flagged beside it.

Columns read like the lists they replace (length, indexing, slicing into lists, iteration,
``None in column``, equality with a list), and ``numpy.asarray(column)`` gives the values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_FIRST_CAPACITY = 64
# Values appended one at a time wait in a list, and arrays in a queue, until this many are
# waiting: then they join the storage in one go (a list append is several times cheaper
# than setting one element of an array).
_FLUSH = 4096


def _grown(arr: np.ndarray, used: int, need: int) -> np.ndarray:
    """``arr`` (its first ``used`` entries kept) with room for ``need`` entries."""
    if need <= len(arr):
        return arr
    out = np.zeros(max(need, len(arr) * 3 // 2), dtype=arr.dtype)
    out[:used] = arr[:used]
    return out


class _Flat:
    """Every value in one array, and where a None was stored (the array holds 0 there)."""

    __slots__ = ("data", "missing", "size")

    def __init__(self, data: np.ndarray, missing: np.ndarray | None, size: int) -> None:
        self.data, self.missing, self.size = data, missing, size

    def add(self, values: np.ndarray, missing: np.ndarray | None) -> None:
        start, end = self.size, self.size + len(values)
        self.data = _grown(self.data, start, end)
        self.data[start:end] = values
        if self.missing is None and missing is not None and missing.any():
            self.missing = np.zeros(len(self.data), dtype=bool)
        if self.missing is not None:
            self.missing = _grown(self.missing, start, len(self.data))
            self.missing[start:end] = False if missing is None else missing
        self.size = end

    def values(self, n: int | None = None) -> np.ndarray:
        return self.data[: self.size if n is None else min(n, self.size)]

    def nones(self) -> np.ndarray | None:
        return None if self.missing is None else self.missing[: self.size]

    def item(self, i: int) -> Any:
        if self.missing is not None and self.missing[i]:
            return None
        return self.data[i].item()

    def as_float(self) -> _Flat:
        return _Flat(self.data.astype(np.float64), self.missing, self.size)

    def dropped(self, n: int) -> _Flat:
        missing = None if self.missing is None else self.missing[n: self.size].copy()
        return _Flat(self.data[n: self.size].copy(), missing, self.size - n)


class _Runs:
    """Runs of equal values: each run's value, whether it stands for None, and its end (one
    past its last index)."""

    __slots__ = ("count", "end", "none", "size", "value")

    def __init__(self, dtype: type) -> None:
        self.value = np.zeros(_FIRST_CAPACITY, dtype=dtype)
        self.none = np.zeros(_FIRST_CAPACITY, dtype=bool)
        self.end = np.zeros(_FIRST_CAPACITY, dtype=np.int64)
        self.count = self.size = 0

    def add(self, values: np.ndarray, missing: np.ndarray | None) -> None:
        n = len(values)
        if not n:
            return
        flags = np.zeros(n, dtype=bool) if missing is None else missing
        new = np.ones(n, dtype=bool)
        new[1:] = (values[1:] != values[:-1]) | (flags[1:] != flags[:-1])
        starts = np.flatnonzero(new)
        value, none = values[starts], flags[starts]
        end = np.append(starts[1:], n) + self.size
        c = self.count
        if c and self.value[c - 1] == value[0] and self.none[c - 1] == none[0]:
            # The first new run goes on from the last stored one.
            self.end[c - 1] = end[0]
            value, none, end = value[1:], none[1:], end[1:]
        k = c + len(value)
        self.value = _grown(self.value, c, k)
        self.none = _grown(self.none, c, k)
        self.end = _grown(self.end, c, k)
        self.value[c:k], self.none[c:k], self.end[c:k] = value, none, end
        self.count, self.size = k, self.size + n

    def _lengths(self) -> np.ndarray:
        return np.diff(self.end[: self.count], prepend=0)

    def values(self, n: int | None = None) -> np.ndarray:
        """The values, or the first ``n``."""
        if n is None or n >= self.size:
            return np.repeat(self.value[: self.count], self._lengths())
        r = int(self.end[: self.count].searchsorted(n, side="right")) + 1
        lengths = np.diff(np.minimum(self.end[:r], n), prepend=0)
        return np.repeat(self.value[:r], lengths)

    def nones(self) -> np.ndarray | None:
        none = self.none[: self.count]
        return np.repeat(none, self._lengths()) if none.any() else None

    def item(self, i: int) -> Any:
        r = int(np.searchsorted(self.end[: self.count], i, side="right"))
        return None if self.none[r] else self.value[r].item()

    def as_float(self) -> _Runs:
        out = _Runs(np.float64)
        out.value, out.none, out.end = self.value.astype(np.float64), self.none, self.end
        out.count, out.size = self.count, self.size
        return out

    def flat(self) -> _Flat:
        return _Flat(self.values(), self.nones(), self.size)

    def dropped(self, n: int) -> _Runs:
        out = _Runs(self.value.dtype.type)
        r = int(np.searchsorted(self.end[: self.count], n, side="right"))
        out.value = self.value[r: self.count].copy()
        out.none = self.none[r: self.count].copy()
        out.end = self.end[r: self.count] - n
        out.count, out.size = self.count - r, self.size - n
        return out


class Column:
    """Growable values of one dtype (``int64`` unless told: fractions make it ``float64``),
    some possibly None, held as runs of equal values until runs would take more room than
    the values. An array passed to :meth:`extend` is queued as it is: it must not change
    afterwards."""

    __slots__ = ("_pending", "_queue", "_queued", "_store")

    def __init__(self, dtype: type = np.int64, values: Iterable[Any] = ()) -> None:
        self._store: _Runs | _Flat = _Runs(dtype)
        self._pending: list[Any] = []
        # Arrays waiting, in order, each with its None flags (or None: no None in it).
        self._queue: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._queued = 0
        self.extend(values)

    @property
    def dtype(self) -> np.dtype:
        store = self._store
        return store.value.dtype if isinstance(store, _Runs) else store.data.dtype

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

    def repeat(self, value: Any, count: int) -> None:
        """Append ``value`` ``count`` times."""
        if count < 64 or value is None:
            self.extend([value] * count)
        else:
            self.extend(np.full(count, value, dtype=self.dtype))

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
        self._queue, self._queued = [], 0
        store = self._store
        if (values.dtype.kind == "f" and self.dtype.kind in "iu"
                and not np.all(np.mod(values, 1) == 0)):
            store = store.as_float()
        store.add(values, missing)
        # A run takes about the room of two values: past that, keep the values.
        if isinstance(store, _Runs) and store.size >= _FLUSH and 2 * store.count > store.size:
            store = store.flat()
        self._store = store

    def view(self) -> np.ndarray:
        """The values as an array (where None was appended it holds 0); a view of a column
        held as values, a new array of one held as runs."""
        self._flush()
        return self._store.values()

    def present(self) -> np.ndarray:
        """The values that are not None, in order."""
        values = self.view()
        nones = self._store.nones()
        return values if nones is None else values[~nones]

    def head(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The first ``n`` values (0 where None was appended) and where None was among
        them, or None where it was nowhere."""
        self._flush()
        values, nones = self._store.values(n), self._store.nones()
        if nones is not None:
            nones = nones[:n]
        return values, nones if nones is not None and nones.any() else None

    def drop(self, n: int) -> None:
        """Forget the first ``n`` values (a long replay folds its oldest steps)."""
        self._flush()
        self._store = self._store.dropped(n)

    @property
    def has_none(self) -> bool:
        self._flush()
        nones = self._store.nones()
        return nones is not None and bool(nones.any())

    def tolist(self) -> list[Any]:
        out = self.view().tolist()
        nones = self._store.nones()
        if nones is not None:
            for i in np.flatnonzero(nones).tolist():
                out[i] = None
        return out

    def __len__(self) -> int:
        return self._store.size + self._queued + len(self._pending)

    def __getitem__(self, key: int | slice) -> Any:
        self._flush()
        if isinstance(key, slice):
            return self.tolist()[key]
        n = self._store.size
        i = key + n if key < 0 else key
        if not 0 <= i < n:
            raise IndexError(f"step {key} of a column of {n}")
        return self._store.item(i)

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
        out.flags.writeable = False  # the log's own values: reading must not change them
        return out

    def __repr__(self) -> str:
        return f"Column({self.tolist()!r})"


def column_of(columns: dict[str, Column], name: str) -> Column:
    """``columns[name]``, an empty integer column added first if it is not there."""
    col = columns.get(name)
    if col is None:
        col = columns[name] = Column()
    return col
