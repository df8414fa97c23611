"""The result row: the Python side of csrc/stats_record.h, declared once.

Every scan leaves one int64 row of NUM_FIELDS words per tensor. The first
eight are exact counts; the next five hold float64 values bit for bit
(`Column` mirrors the `Field` enum of csrc/stats_record.h); the last three
are zero from the scan and free for callers to mark rows with (the Monitor
does, across ranks). This module reads rows: one row into the public fields
of a Stats (`FIELDS`), many rows at once, and the empty row that merges as
the identity.
"""

from __future__ import annotations

import enum
import math
import struct

import numpy
import torch


class Column(enum.IntEnum):
    """Columns of a result row (csrc/stats_record.h, `Field`)."""

    NUMEL = 0
    ZEROS = 1
    SUBNORMAL = 2
    NEAR_ZERO = 3
    NAN = 4
    POSINF = 5
    NEGINF = 6
    NEGATIVE = 7
    MIN_ABS = 8  # float64 bits, over non-NaN values; +inf when there are none
    MIN_ABS_NONZERO = 9  # float64 bits; +inf when none
    MAX_ABS = 10  # float64 bits; -inf when there are none
    MEAN = 11  # float64 bits, over finite values
    M2 = 12  # float64 bits: sum of squared deviations from MEAN
    SPARE_0 = 13  # zero from the scan; free for callers' marks
    SPARE_1 = 14
    SPARE_2 = 15


NUM_FIELDS = len(Column)
NUM_COUNTS = 8
COUNT_FIELDS = tuple(c.name.lower() for c in Column if c < NUM_COUNTS)
FLOAT_FIELDS = ("min_abs", "min_abs_nonzero", "max_abs", "mean", "m2")
COUNTS = slice(0, NUM_COUNTS)
FLOATS = slice(Column.MIN_ABS, Column.M2 + 1)
NONFINITE = slice(Column.NAN, Column.NEGINF + 1)  # nan, +inf, -inf

# The fields of a decoded row, in the order Stats.to_dict lists them.
FIELDS = (
    *COUNT_FIELDS,
    "finite",
    "min_abs",
    "min_abs_nonzero",
    "max_abs",
    "mean",
    "std",
    "norm",
    "sum",
)

Row = dict[str, float | int]

_pack_int64 = struct.Struct("<q").pack
_unpack_float64 = struct.Struct("<d").unpack


def as_float64(word: int) -> float:
    """The float64 stored bit for bit in an int64 result word."""
    return _unpack_float64(_pack_int64(word))[0]


def finish_row(counts: list[int], floats: list[float]) -> Row:
    """The public fields of one row from its eight counts and five floats."""
    row: Row = dict(zip(COUNT_FIELDS, counts))
    raw = dict(zip(FLOAT_FIELDS, floats))
    finite = row["numel"] - row["nan"] - row["posinf"] - row["neginf"]
    non_nan = row["numel"] - row["nan"]
    mean, m2 = raw["mean"], raw["m2"]
    row["finite"] = finite
    row["min_abs"] = raw["min_abs"] if non_nan else math.nan
    row["min_abs_nonzero"] = raw["min_abs_nonzero"]
    row["max_abs"] = raw["max_abs"] if non_nan else math.nan
    row["mean"] = mean if finite else math.nan
    row["std"] = math.sqrt(m2 / (finite - 1)) if finite >= 2 else math.nan
    row["norm"] = _norm(finite, mean, m2)
    row["sum"] = mean * finite if finite else 0.0
    return row


def row_from_words(words: list[int]) -> Row:
    """The public fields of one row given as its NUM_FIELDS int64 words."""
    return finish_row(words[COUNTS], [as_float64(w) for w in words[FLOATS]])


def host_array(buffer: torch.Tensor) -> numpy.ndarray:
    """An int64 result buffer copied to the host as a numpy array.

    Inside torch.func.grad or jvp the buffer is a functorch wrapper, which
    has no storage for numpy to read; its values are then read through
    tolist(), which every wrapper answers."""
    host = buffer.detach().cpu()
    try:
        return host.numpy()
    except RuntimeError:
        return numpy.array(host.tolist(), dtype=numpy.int64).reshape(tuple(host.shape))


def decode(buffer: torch.Tensor) -> list[Row]:
    """int64 [N, 16] (or [16]) result rows -> one dict of fields per row."""
    host = host_array(buffer).reshape(-1, NUM_FIELDS)
    counts = host[:, COUNTS].tolist()
    floats = host[:, FLOATS].view(numpy.float64).tolist()
    return [finish_row(c, f) for c, f in zip(counts, floats)]


def _norm(finite: int, mean: float, m2: float) -> float:
    """sqrt(sum x^2) = sqrt(m2 + n mean^2), as the hypotenuse of sqrt(m2) and
    sqrt(n) |mean| scaled by the larger, so that n mean^2 never overflows:
    float64 data near the top of its range has a finite norm whenever its m2
    is finite and its norm within range (max |x| can be inf, from an infinity
    that the moments leave out, so it cannot scale them). Plain operations,
    not math.hypot, so that numpy gives the same bits (monitor/table.py)."""
    if finite == 0:
        return 0.0
    a, b = math.sqrt(m2), math.sqrt(finite) * abs(mean)
    s = max(a, b)
    if s == 0.0 or s == math.inf:
        return s
    ra, rb = a / s, b / s
    return s * math.sqrt(ra * ra + rb * rb)


POS_INF_BITS = 0x7FF0000000000000  # float64 +inf as an int64 word
NEG_INF_BITS = -0x10000000000000  # float64 -inf (0xFFF0000000000000) as an int64 word


def empty_rows(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [n, 16] rows of the empty partial (the identity of the merge):
    zeros, but min |x| and min nonzero |x| +inf and max |x| -inf. Made on
    `device` from the column numbers, with no copy from the host (the
    Monitor's merge makes one at every step)."""
    column = torch.arange(NUM_FIELDS, dtype=torch.int64, device=device)
    lowest = (column == Column.MIN_ABS) | (column == Column.MIN_ABS_NONZERO)
    row = torch.where(lowest, POS_INF_BITS, torch.where(column == Column.MAX_ABS, NEG_INF_BITS, 0))
    return row.expand(n, NUM_FIELDS).clone()


def finite_count(rows: torch.Tensor) -> torch.Tensor:
    """float64 [...]: the finite values of each row of int64 [..., 16] rows."""
    nonfinite = rows[..., NONFINITE].sum(-1)
    return (rows[..., Column.NUMEL] - nonfinite).to(torch.float64)


def moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, m2), float64 [...] each, of int64 [..., 16] rows."""
    floats = rows[..., FLOATS].view(torch.float64)
    return floats[..., Column.MEAN - Column.MIN_ABS], floats[..., Column.M2 - Column.MIN_ABS]
