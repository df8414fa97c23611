"""A monitored step's decoded rows, kept as the int64 words the scan wrote.

report() reads every kept step of every parameter: a dict of fields per row
cost 10k parameters x 64 steps some 20 s and 2 GB. A `RowTable` keeps the
step's host rows as they came back (numpy views, no copy on the CPU) and,
per Slot row (see step_record.Slot.row), where its latest row is: a dict of
fields is made only for a row read alone, and whole columns are read with
numpy (`gather`, `fields`), by the same formulas as zeroscan.result_row's
finish_row, so that every value is bit for bit the one a Row would hold.
With Monitor(histogram=True) each group also has its histogram fields
(`FieldBlock`), found by the same Slot row lookup as its rows, so that a
histogram always goes with the row it was scanned beside.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from zeroscan.histogram import Histogram
from zeroscan.result_row import COUNTS, FLOATS, NONFINITE, NUM_FIELDS, Column, Row, finish_row

ScannedRow = tuple[Row, tuple[int, ...]]  # a decoded row and its raw int64 words
ABSENT = -1


class FieldBlock(NamedTuple):
    """The histogram fields of one scan group (zeroscan.histogram): int64
    [K, B], a tensor on the scanned device until decoded and a numpy array
    after, and the dtype each of its K tensors was scanned as (the fields
    mean nothing without it)."""

    fields: Any
    dtypes: tuple[torch.dtype, ...]


def row_of_words(words: np.ndarray) -> Row:
    """The Row (zeroscan.result_row's fields) of one int64 [16] row."""
    return finish_row(words[COUNTS].tolist(), words[FLOATS].view(np.float64).tolist())


class RowTable:
    """The rows of one step, by Slot row. Built from the step's groups
    (slot rows int64 [K], words int64 [K, 16]), oldest first: a slot in
    several groups takes the last group's row, and the row it replaced is
    kept as the slot's row `before` (what the step's optimizer-time scan
    replaced of the scan when backward ended). `blocks`, when given, holds
    each group's histogram fields (None for a group scanned without)."""

    __slots__ = ("_words", "_blocks", "_group", "_pos", "_before_group", "_before_pos", "_nonfinite")

    def __init__(
        self, groups: list[tuple[np.ndarray, np.ndarray]], blocks: list[FieldBlock | None] | None = None
    ) -> None:
        size = max((int(rows.max()) + 1 for rows, _ in groups if rows.size), default=0)
        size += size % 2  # a grad and a weight row per parameter
        self._words = [words for _, words in groups]
        self._blocks: list[FieldBlock | None] = list(blocks) if blocks is not None else [None] * len(groups)
        self._group = np.full(size, ABSENT, dtype=np.int8)
        self._pos = np.zeros(size, dtype=np.int32)
        self._before_group = np.full(size, ABSENT, dtype=np.int8)
        self._before_pos = np.zeros(size, dtype=np.int32)
        self._nonfinite: np.ndarray | None = None
        for g, (rows, _) in enumerate(groups):
            had = rows[self._group[rows] != ABSENT]
            self._before_group[had] = self._group[had]
            self._before_pos[had] = self._pos[had]
            self._group[rows] = g
            self._pos[rows] = np.arange(rows.size, dtype=np.int32)

    @classmethod
    def dense(cls, words: np.ndarray, present: np.ndarray) -> RowTable:
        """Rows int64 [n, 16], one per Slot row, of which those `present` (bool [n]) count."""
        rows = np.flatnonzero(present)
        return cls([(rows, words[rows])])

    def words(self, row: int, *, before: bool = False) -> np.ndarray | None:
        """The int64 [16] words of Slot row `row` (or of the row it replaced), None if absent."""
        group, pos = (self._before_group, self._before_pos) if before else (self._group, self._pos)
        if not 0 <= row < group.size or group[row] == ABSENT:
            return None
        return self._words[group[row]][pos[row]]

    def row(self, row: int, *, before: bool = False) -> Row | None:
        words = self.words(row, before=before)
        return None if words is None else row_of_words(words)

    @property
    def has_histograms(self) -> bool:
        return any(b is not None for b in self._blocks)

    def histogram(self, row: int) -> Histogram | None:
        """The histogram of Slot row `row` at this step, from the same scan as
        its row; None if absent or scanned without one."""
        if not 0 <= row < self._group.size or self._group[row] == ABSENT:
            return None
        block = self._blocks[self._group[row]]
        if block is None:
            return None
        pos = self._pos[row]
        words = self._words[self._group[row]][pos]
        return Histogram.from_fields(block.dtypes[pos], block.fields[pos], row_of_words(words))

    def drop_histograms(self) -> None:
        """Frees the histogram fields (a later step's are the ones reported)."""
        self._blocks = [None] * len(self._words)

    def __getitem__(self, slot: tuple[int, str]) -> ScannedRow:
        """(Row, raw words) of a step_record.Slot; KeyError if it was not scanned."""
        words = self.words(2 * slot[0] + (slot[1] == "weight"))
        if words is None:
            raise KeyError(slot)
        return row_of_words(words), tuple(words.tolist())

    def gather(
        self, rows: np.ndarray, columns: slice | list[int] = slice(None), *, before: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The words (int64 [len(rows), c], 0 where absent) of the Slot rows
        `rows` (or of the rows they replaced) in `columns`, and which rows are
        present (bool [len(rows)])."""
        where, at = (self._before_group, self._before_pos) if before else (self._group, self._pos)
        inside = rows < where.size
        group = np.full(rows.size, ABSENT, dtype=np.int8)
        group[inside] = where[rows[inside]]
        pos = np.zeros(rows.size, dtype=np.int32)
        pos[inside] = at[rows[inside]]
        width = len(range(NUM_FIELDS)[columns]) if isinstance(columns, slice) else len(columns)
        out = np.zeros((rows.size, width), dtype=np.int64)
        for g, words in enumerate(self._words):
            at = group == g
            if at.any():
                out[at] = words[pos[at]][:, columns]
        return out, group != ABSENT

    def nonfinite_grads(self, params: int) -> np.ndarray:
        """bool [params]: the parameters whose gradient holds NaN or inf."""
        if self._nonfinite is None or self._nonfinite.size != params:
            self._nonfinite = self._nonfinite_rows(2 * np.arange(params))
        return self._nonfinite

    def nonfinite_weights(self, params: int) -> np.ndarray:
        """bool [params]: the parameters whose weight holds NaN or inf."""
        return self._nonfinite_rows(2 * np.arange(params) + 1)

    def _nonfinite_rows(self, rows: np.ndarray) -> np.ndarray:
        counts, _ = self.gather(rows, list(range(NUM_FIELDS))[NONFINITE])
        return counts.sum(axis=1) > 0

    def witnessed(self, rows: np.ndarray, words: np.ndarray) -> None:
        """Rows read of the first values of some gradients when backward ended
        (monitor/deferred.py), int64 [K, 16] at Slot rows `rows` (-1: a
        parameter gone): kept as those slots' rows `before` where they have no
        other, and never as their rows."""
        into = (rows >= 0) & (rows < self._before_group.size)
        into[into] &= self._before_group[rows[into]] == ABSENT
        if not into.any():
            return
        self._words.append(words)
        self._blocks.append(None)
        self._before_group[rows[into]] = len(self._words) - 1
        self._before_pos[rows[into]] = np.flatnonzero(into).astype(np.int32)

    def clear(self, row: int) -> None:
        """Slot row `row` is not the step's: its row becomes the row `before`."""
        if 0 <= row < self._group.size and self._group[row] != ABSENT:
            self._before_group[row] = self._group[row]
            self._before_pos[row] = self._pos[row]
            self._group[row] = ABSENT
            self._nonfinite = None

    def renumbered(self, new_row: np.ndarray, size: int) -> RowTable:
        """The table with Slot row r moved to new_row[r] (-1: dropped), `size` rows in all."""
        target = np.full(self._group.size, -1, dtype=np.int64)
        known = min(target.size, new_row.size)
        target[:known] = new_row[:known]
        keep = target >= 0
        table = RowTable([])
        table._words = self._words
        table._blocks = self._blocks
        for name in ("_group", "_pos", "_before_group", "_before_pos"):
            old = getattr(self, name)
            new = np.full(size, ABSENT, dtype=old.dtype) if "group" in name else np.zeros(size, dtype=old.dtype)
            new[target[keep]] = old[keep]
            setattr(table, name, new)
        return table


def fields(words: np.ndarray) -> dict[str, np.ndarray]:
    """The fields of finish_row (zeroscan.result_row) for every row of int64
    [K, 16] words at once, as numpy arrays: the same operations in the same
    order on float64, so every value equals the Row's bit for bit."""
    counts = {c.name.lower(): words[:, c] for c in Column if c < Column.MIN_ABS}
    raw = words[:, FLOATS].view(np.float64)
    min_abs, max_abs, mean, m2 = (raw[:, c - Column.MIN_ABS] for c in (
        Column.MIN_ABS, Column.MAX_ABS, Column.MEAN, Column.M2))
    finite = counts["numel"] - counts["nan"] - counts["posinf"] - counts["neginf"]
    non_nan = counts["numel"] - counts["nan"]
    n = finite.astype(np.float64)
    with np.errstate(all="ignore"):
        a, b = np.sqrt(m2), np.sqrt(n) * np.abs(mean)
        s = np.maximum(a, b)
        ra, rb = a / s, b / s
        hypot = np.where((s == 0.0) | (s == np.inf), s, s * np.sqrt(ra * ra + rb * rb))
        norm = np.where(finite == 0, 0.0, hypot)
        std = np.where(finite >= 2, np.sqrt(m2 / (n - 1.0)), np.nan)
    return {
        **counts,
        "finite": finite,
        "min_abs": np.where(non_nan > 0, min_abs, np.nan),
        "max_abs": np.where(non_nan > 0, max_abs, np.nan),
        "mean": np.where(finite > 0, mean, np.nan),
        "std": std,
        "norm": norm,
    }


def fraction(part: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """part / numel as float64 (Python's int / int for ints below 2**53), 0.0 where numel is 0."""
    with np.errstate(all="ignore"):
        return np.where(numel > 0, part / np.maximum(numel, 1), 0.0)
