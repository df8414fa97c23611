"""Readout: one native scan's result buffer on its device, and its host
copy, made when a field is first read (zeroscan.stats)."""

from __future__ import annotations

import numpy
import torch

from zeroscan.histogram import Histogram
from zeroscan.result_row import Row, host_array, row_from_words


class Readout:
    """One native call's result buffer and its host copy, made on first read.

    The buffer is copied to the host once: one row (stats) as a list of its
    16 words, many rows (stats_many) as an int64 [N, 16] array whose columns
    are listed for every row when first read (the usual pattern is one field
    of every tensor). A row's floating fields are decoded when one of them is
    first read.
    """

    __slots__ = ("buffer", "fields", "_words", "_host", "_columns", "_rows", "_host_fields")

    def __init__(self, buffer: torch.Tensor, fields: torch.Tensor | None = None) -> None:
        self.buffer = buffer  # int64 [16] or [N, 16], on the scanned device
        self.fields = fields  # int64 [N, B] histogram fields, or None
        self._host_fields: numpy.ndarray | None = None
        self._words: list[int] | None = None  # the one row of a [16] buffer
        self._host: numpy.ndarray | None = None  # a copy of an [N, 16] buffer
        self._columns: dict[int, list[int]] | None = None  # made on first read: a hot loop reads one field
        self._rows: dict[int, Row] | None = None

    def _row_words(self, index: int) -> list[int]:
        if self.buffer.dim() == 1:
            if self._words is None:
                self._words = self.buffer.tolist()  # int64: never requires grad
            return self._words
        return self._array()[index].tolist()

    def _array(self) -> numpy.ndarray:
        if self._host is None:
            self._host = host_array(self.buffer)
        return self._host

    def count(self, index: int, column: int) -> int:
        """One int64 word of row `index`."""
        if self._words is not None:  # a [16] buffer already read
            return self._words[column]
        columns = self._columns  # an [N, 16] buffer's columns listed so far
        values = columns.get(column) if columns is not None else None
        if values is None:
            if self.buffer.dim() == 1:
                return self._row_words(0)[column]
            if columns is None:
                columns = self._columns = {}
            values = columns[column] = self._array()[:, column].tolist()
        return values[index]

    def histogram(self, index: int, dtype: torch.dtype) -> Histogram | None:
        """The histogram of row `index`, or None when scanned without one."""
        if self.fields is None:
            return None
        if self._host_fields is None:
            self._host_fields = host_array(self.fields)
        return Histogram.from_fields(dtype, self._host_fields[index], self.row(index))

    def row(self, index: int) -> Row:
        """Every field of row `index`, decoded once."""
        if self._rows is None:
            self._rows = {}
        row = self._rows.get(index)
        if row is None:
            row = self._rows[index] = row_from_words(self._row_words(index))
        return row
