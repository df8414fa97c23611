"""The result row: the Python side of csrc/stats_record.h, declared once.

Every scan leaves one int64 row of NUM_FIELDS words per tensor. `Column` is
the one table of its columns: each one's name, position and merge kind.
The first columns are exact counts (SUM); the next hold float64 values bit
for bit: the extremes (MIN, MAX) and the moments (MOMENT: mean and m2); the
last are zero from the scan and free for callers to mark rows with (the
Monitor does, across ranks). Everything else that needs the columns derives
them from this table: the count and float fields, the slices below, the
fields of a Stats (`FIELDS`), the merges across ranks. This module also
reads rows: one row into the public fields of a Stats, many rows at once,
and the empty row that merges as the identity.
"""

from __future__ import annotations

import enum
import math
import struct

import numpy
import torch


class Merge(enum.Enum):
    """How one column of two partial rows of a tensor (two chunks, two
    shards) merges into the column of the whole: what csrc/stats_record.h's
    `combine` does to it, and what the Python merges across ranks
    (zeroscan/distributed/allreduce.py) do to it by kind."""

    SUM = "sum"  # an exact count: added; 0 merges as nothing
    MIN = "min"  # a float64 least value: the smaller; +inf merges as nothing
    MAX = "max"  # a float64 greatest value: the larger; -inf merges as nothing
    MOMENT = "moment"  # mean and m2 of the finite values, merged together (Chan et al.)
    SPARE = "spare"  # zero from the scan; free for callers' marks


class Column(enum.IntEnum):
    """The result row, column by column: the one table of it in Python
    (csrc/stats_record.h's `Field` in C++). Each column is `NAME = position,
    merge`; its field is its name in lower case. The columns are grouped by
    merge, counts first, then the extremes, the moments and the spares: the
    slices below read them so."""

    merge: Merge

    def __new__(cls, position: int, merge: Merge) -> Column:
        column = int.__new__(cls, position)
        column._value_ = position
        column.merge = merge
        return column

    NUMEL = 0, Merge.SUM
    ZEROS = 1, Merge.SUM
    SUBNORMAL = 2, Merge.SUM
    NEAR_ZERO = 3, Merge.SUM
    NAN = 4, Merge.SUM
    POSINF = 5, Merge.SUM
    NEGINF = 6, Merge.SUM
    NEGATIVE = 7, Merge.SUM
    MIN_ABS = 8, Merge.MIN  # float64 bits, over non-NaN values; +inf when there are none
    MIN_ABS_NONZERO = 9, Merge.MIN  # float64 bits; +inf when none
    MAX_ABS = 10, Merge.MAX  # float64 bits; -inf when there are none
    MEAN = 11, Merge.MOMENT  # float64 bits, over finite values
    M2 = 12, Merge.MOMENT  # float64 bits: sum of squared deviations from MEAN
    SPARE_0 = 13, Merge.SPARE
    SPARE_1 = 14, Merge.SPARE
    SPARE_2 = 15, Merge.SPARE


def columns_of(*merges: Merge) -> tuple[Column, ...]:
    """The columns that merge as one of `merges`, in row order."""
    return tuple(c for c in Column if c.merge in merges)


def field_names(columns: tuple[Column, ...]) -> tuple[str, ...]:
    return tuple(c.name.lower() for c in columns)


COUNT_COLUMNS = columns_of(Merge.SUM)
EXTREME_COLUMNS = columns_of(Merge.MIN, Merge.MAX)  # min |x|, min nonzero |x|, max |x|
MOMENT_COLUMNS = columns_of(Merge.MOMENT)  # mean, m2
assert list(Column) == [*COUNT_COLUMNS, *EXTREME_COLUMNS, *MOMENT_COLUMNS, *columns_of(Merge.SPARE)], (
    "Column must list the counts, then the extremes, the moments and the spares"
)

NUM_FIELDS = len(Column)
NUM_COUNTS = len(COUNT_COLUMNS)
NUM_SCANNED = NUM_COUNTS + len(EXTREME_COLUMNS) + len(MOMENT_COLUMNS)  # the columns a scan writes
COUNT_FIELDS = field_names(COUNT_COLUMNS)
EXTREME_FIELDS = field_names(EXTREME_COLUMNS)
FLOAT_FIELDS = EXTREME_FIELDS + field_names(MOMENT_COLUMNS)
COUNTS = slice(0, NUM_COUNTS)
EXACT = slice(0, NUM_COUNTS + len(EXTREME_COLUMNS))  # counts and extremes: merged bit for bit
FLOATS = slice(NUM_COUNTS, NUM_SCANNED)
MOMENTS = slice(EXACT.stop, NUM_SCANNED)  # mean, m2
SCANNED = slice(0, NUM_SCANNED)
NONFINITE = slice(Column.NAN, Column.NEGINF + 1)  # nan, +inf, -inf

# The fields of a decoded row, in the order Stats.to_dict lists them: the
# counts, the finite values, the extremes, then what the moments give.
FIELDS = (*COUNT_FIELDS, "finite", *EXTREME_FIELDS, "mean", "std", "norm", "sum")

Row = dict[str, float | int]

_pack_int64 = struct.Struct("<q").pack
_unpack_float64 = struct.Struct("<d").unpack


def as_float64(word: int) -> float:
    """The float64 stored bit for bit in an int64 result word."""
    return _unpack_float64(_pack_int64(word))[0]


def finish_row(counts: list[int], floats: list[float]) -> Row:
    """The public fields of one row from its counts and floats (COUNT_FIELDS, FLOAT_FIELDS)."""
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
    zeros, but each MIN column +inf and each MAX column -inf. Made on
    `device` from the column numbers, with no copy from the host (the
    Monitor's merge makes one at every step)."""
    column = torch.arange(NUM_FIELDS, dtype=torch.int64, device=device)
    row = torch.zeros_like(column)
    for c in EXTREME_COLUMNS:
        row = torch.where(column == c, POS_INF_BITS if c.merge is Merge.MIN else NEG_INF_BITS, row)
    return row.expand(n, NUM_FIELDS).clone()


def finite_count(rows: torch.Tensor) -> torch.Tensor:
    """float64 [...]: the finite values of each row of int64 [..., 16] rows."""
    nonfinite = rows[..., NONFINITE].sum(-1)
    return (rows[..., Column.NUMEL] - nonfinite).to(torch.float64)


def moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, m2), float64 [...] each, of int64 [..., 16] rows."""
    floats = rows[..., FLOATS].view(torch.float64)
    return floats[..., Column.MEAN - Column.MIN_ABS], floats[..., Column.M2 - Column.MIN_ABS]
