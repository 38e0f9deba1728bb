"""Tiling spaces as numpy columns, and arithmetic that runs on an int or a column alike.

A space of tens of thousands of tilings is built and filtered in numpy (`TilingColumns`: one
int64 column per tiling field, rows in the order the space lists them); a `Tiling` object is
made only for a row that is read (`space[i]`), e.g. the few dozen a branch and bound prices.

The kernels' fit rules and clipped sizes are written once with `lesser` / `pick`, so the same
function answers for one tiling (ints: what `check_tiling` and the program use) and for a
whole space (columns: what the space filter uses): one fact in one place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .api import Tiling


def lesser(*xs: Any) -> Any:
    """min of ints, or the elementwise minimum when one of them is a numpy column."""
    for x in xs:
        if isinstance(x, np.ndarray):
            return functools.reduce(np.minimum, xs)
    return min(xs)


def greater(*xs: Any) -> Any:
    """max of ints, or the elementwise maximum when one of them is a numpy column."""
    for x in xs:
        if isinstance(x, np.ndarray):
            return functools.reduce(np.maximum, xs)
    return max(xs)


def pick(cond: Any, if_true: Any, if_false: Any) -> Any:
    """`if_true if cond else if_false`, elementwise when `cond` is a numpy column."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, if_true, if_false)
    return if_true if cond else if_false


def first_of_each(*keys: np.ndarray) -> np.ndarray:
    """Ascending indices of the first row of each distinct tuple of `keys` (non-negative int
    columns of one length): a space's deduplication, keeping the first as a loop with a `seen`
    set keeps it."""
    n = len(keys[0]) if keys else 0
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    code = np.zeros(n, dtype=np.int64)
    span = 1
    for k in keys:
        top = int(k.max()) + 1 if len(k) else 1
        span *= top
        if span >= 2**62:  # too wide to pack into one int64: compare the rows themselves
            _, first = np.unique(np.stack(keys, axis=1), axis=0, return_index=True)
            return np.sort(first)
        code = code * top + k
    _, first = np.unique(code, return_index=True)
    return np.sort(first)


class TilingColumns(Sequence[Tiling]):
    """A tiling space as one int64 column per field of `kind` (see the module docstring).

    A `Sequence[Tiling]`: `space[i]` makes the i-th tiling, iterating makes them all (what an
    exhaustive search needs anyway); `in` and `index` compare columns, not objects; a field
    name reads its column (`space.tile_h`)."""

    def __init__(self, kind: type[Tiling], columns: Mapping[str, Any]) -> None:
        fields = dataclasses.fields(kind)
        n = max((len(np.atleast_1d(columns[f.name])) for f in fields if f.name in columns),
                default=0)  # fmt: skip
        cols: dict[str, np.ndarray] = {}
        for f in fields:
            if f.name in columns:
                c = np.asarray(columns[f.name], dtype=np.int64)
                cols[f.name] = c if c.shape == (n,) else np.broadcast_to(c, (n,))
            elif f.default is not dataclasses.MISSING:
                cols[f.name] = np.full(n, int(f.default), dtype=np.int64)
            else:
                raise TypeError(f"{kind.__name__}: no column for field '{f.name}'")
        self.kind = kind
        self.columns = cols
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str) -> np.ndarray:
        # A field's column read as the field (`space.tile_h`), so a rule written for one
        # tiling (`t.tile_h`) runs on the whole space.
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    @overload
    def __getitem__(self, i: int) -> Tiling: ...
    @overload
    def __getitem__(self, i: slice) -> TilingColumns: ...
    def __getitem__(self, i: int | slice) -> Tiling | TilingColumns:
        if isinstance(i, slice):
            return self.take(np.arange(self._n)[i])
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self.kind(**{name: int(c[i]) for name, c in self.columns.items()})

    def __iter__(self) -> Iterator[Tiling]:
        names = list(self.columns)
        for row in zip(*(c.tolist() for c in self.columns.values()), strict=True):
            yield self.kind(**dict(zip(names, row, strict=True)))

    def _matches(self, t: object) -> np.ndarray:
        if type(t) is not self.kind:
            return np.zeros(self._n, dtype=bool)
        hit = np.ones(self._n, dtype=bool)
        for name, c in self.columns.items():
            hit &= c == getattr(t, name)
        return hit

    def __contains__(self, t: object) -> bool:
        return bool(self._matches(t).any())

    def index(self, t: Any, start: int = 0, stop: int | None = None) -> int:
        """Position of the first row equal to `t` (`ValueError` if none)."""
        hit = np.flatnonzero(self._matches(t)[start:stop])
        if not len(hit):
            raise ValueError(f"{t!r} is not in the space")
        return int(hit[0]) + start

    def take(self, rows: np.ndarray) -> TilingColumns:
        """The given rows, in that order."""
        return TilingColumns(self.kind, {n: c[rows] for n, c in self.columns.items()})

    def extended(self, tilings: Sequence[Tiling]) -> TilingColumns:
        """This space with `tilings` (of `kind`) appended."""
        if not tilings:
            return self
        more = {n: [getattr(t, n) for t in tilings] for n in self.columns}
        return TilingColumns(
            self.kind,
            {
                n: np.concatenate([c, np.asarray(more[n], dtype=np.int64)])
                for n, c in self.columns.items()
            },
        )

    @staticmethod
    def concat(kind: type[Tiling], parts: Sequence[TilingColumns]) -> TilingColumns:
        """The rows of `parts` one after another."""
        names = [f.name for f in dataclasses.fields(kind)]
        return TilingColumns(
            kind,
            {
                n: np.concatenate([p.columns[n] for p in parts])
                if parts
                else np.zeros(0, dtype=np.int64)
                for n in names
            },
        )
