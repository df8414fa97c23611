"""zeroscan.stats and zeroscan.stats_many: one fused pass, one small result.

Each call runs one native pass over the tensor memory and leaves its results
in one small int64 buffer on the tensor's device ([16] per tensor, see
csrc/stats_record.h). Nothing is read back until a field is: the first field
read copies the whole buffer to the host once, and later reads use that copy.
So calling stats() never waits for the device.

Semantics (also in the README):
  zeros       x == 0, either sign
  subnormal   0 < |x| < torch.finfo(dtype).tiny (0 for integer dtypes)
  near_zero   0 < |x| <= tol, tol defaulting to torch.finfo(dtype).eps
              (0 for integer dtypes); subnormals are near zero too
  nan, posinf, neginf, negative (x < 0; -0.0 and NaN are not negative)
  min_abs, max_abs      over non-NaN values (inf included); nan if none
  min_abs_nonzero       over non-NaN nonzero values; inf if none
  mean, std, norm, sum  over the finite values only: NaN and +-inf are
              counted above and never enter the moments. std uses
              correction=1 like torch.std (nan with fewer than 2 finite
              values); mean is nan with no finite value, sum and norm are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

import numpy
import torch

from zeroscan.ops import check_tensor, check_tol
from zeroscan.record import COUNT_FIELDS, Row, row_from_words

class Readout:
    """One native call's result buffer and its host copy, made on first read.

    The buffer is copied to the host once: one row (stats) as a list of its
    16 words, many rows (stats_many) as an int64 [N, 16] array whose columns
    are listed for every row when first read (the usual pattern is one field
    of every tensor). A row's floating fields are decoded when one of them is
    first read.
    """

    __slots__ = ("buffer", "_words", "_host", "_columns", "_rows")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer  # int64 [16] or [N, 16], on the scanned device
        self._words: list[int] | None = None  # the one row of a [16] buffer
        self._host: numpy.ndarray | None = None  # a copy of an [N, 16] buffer
        self._columns: dict[int, list[int]] = {}
        self._rows: dict[int, Row] = {}

    def _row_words(self, index: int) -> list[int]:
        if self.buffer.dim() == 1:
            if self._words is None:
                self._words = self.buffer.detach().tolist()
            return self._words
        return self._array()[index].tolist()

    def _array(self) -> numpy.ndarray:
        if self._host is None:
            self._host = self.buffer.detach().cpu().numpy()
        return self._host

    def count(self, index: int, column: int) -> int:
        """One int64 word of row `index`."""
        values = self._columns.get(column)
        if values is None:
            if self.buffer.dim() == 1:
                values = [self._row_words(0)[column]]
            else:
                values = self._array()[:, column].tolist()
            self._columns[column] = values
        return values[index]

    def row(self, index: int) -> Row:
        """Every field of row `index`, decoded once."""
        row = self._rows.get(index)
        if row is None:
            row = self._rows[index] = row_from_words(self._row_words(index))
        return row


_COUNT_COLUMN = {name: column for column, name in enumerate(COUNT_FIELDS)}


class Stats:
    """The statistics of one tensor. Every field is read lazily (see module doc)."""

    __slots__ = ("_readout", "_index", "dtype", "shape", "device", "tol")

    def __init__(
        self,
        readout: Readout,
        index: int,
        dtype: torch.dtype,
        shape: torch.Size,
        device: torch.device,
        tol: float | None,
    ) -> None:
        self._readout = readout
        self._index = index
        self.dtype = dtype
        self.shape = shape
        self.device = device
        self.tol = tol

    def _field(self, name: str) -> float | int:
        return self._readout.row(self._index)[name]

    def _count(self, name: str) -> int:
        """A count, read from its int64 word without decoding the row."""
        return self._readout.count(self._index, _COUNT_COLUMN[name])

    @property
    def numel(self) -> int:
        return self._count("numel")

    @property
    def zeros(self) -> int:
        return self._count("zeros")

    @property
    def subnormal(self) -> int:
        return self._count("subnormal")

    @property
    def near_zero(self) -> int:
        return self._count("near_zero")

    @property
    def nan(self) -> int:
        return self._count("nan")

    @property
    def posinf(self) -> int:
        return self._count("posinf")

    @property
    def neginf(self) -> int:
        return self._count("neginf")

    @property
    def negative(self) -> int:
        return self._count("negative")

    @property
    def finite(self) -> int:
        return int(self._field("finite"))

    @property
    def min_abs(self) -> float:
        return float(self._field("min_abs"))

    @property
    def min_abs_nonzero(self) -> float:
        return float(self._field("min_abs_nonzero"))

    @property
    def max_abs(self) -> float:
        return float(self._field("max_abs"))

    @property
    def mean(self) -> float:
        return float(self._field("mean"))

    @property
    def std(self) -> float:
        return float(self._field("std"))

    @property
    def norm(self) -> float:
        return float(self._field("norm"))

    @property
    def sum(self) -> float:
        return float(self._field("sum"))

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def buffer(self) -> torch.Tensor:
        """The raw int64 result row on the scanned device (for graph/compile use)."""
        buffer = self._readout.buffer
        return buffer if buffer.dim() == 1 else buffer[self._index]

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "device": str(self.device),
        }
        out.update(self._readout.row(self._index))
        return out

    def __repr__(self) -> str:
        r = self._readout.row(self._index)
        dtype = str(self.dtype).removeprefix("torch.")
        shape = ",".join(str(s) for s in self.shape)
        n = r["numel"]
        parts = [f"{dtype}[{shape}] n={_count(n)}"]
        if n == 0:
            return f"Stats({parts[0]} empty)"
        parts.append(f"zeros={_count(r['zeros'])} ({_percent(r['zeros'], n)})")
        if r["subnormal"]:
            parts.append(f"subnormal={_count(r['subnormal'])}")
        if r["near_zero"]:
            parts.append(f"near0={_count(r['near_zero'])}")
        nonfinite = r["nan"] + r["posinf"] + r["neginf"]
        if nonfinite:
            parts.append(f"NaN={_count(r['nan'])} +inf={_count(r['posinf'])} -inf={_count(r['neginf'])}!")
        parts.append(f"|x|∈[{_num(r['min_abs'])}, {_num(r['max_abs'])}]")
        parts.append(f"μ={_num(r['mean'])} σ={_num(r['std'])} ‖x‖={_num(r['norm'])}")
        return "Stats(" + " ".join(parts) + ")"


def _count(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 10 * scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _percent(part: int, whole: int) -> str:
    if part == 0:
        return "0%"
    if part == whole:
        return "100%"
    return f"{100.0 * part / whole:.3g}%"


def _num(v: float) -> str:
    if v == 0 or math.isnan(v) or math.isinf(v):
        return str(v).replace("inf", "∞")
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


class StatsBatch(Sequence[Stats]):
    """The Stats of many tensors from one stats_many call; indexes like a list.

    Built by stats_many, its Stats objects are made when first indexed, so a
    long list costs little until it is looked at.
    """

    def __init__(self, items: list[Stats]) -> None:
        self._items: list[Stats | None] = list(items)
        self._make: Callable[[int], Stats] | None = None

    @classmethod
    def lazy(cls, n: int, make: Callable[[int], Stats]) -> StatsBatch:
        """A batch of n whose i-th Stats is make(i), made on first access."""
        batch = cls([])
        batch._items = [None] * n
        batch._make = make
        return batch

    def _get(self, i: int) -> Stats:
        item = self._items[i]
        if item is None:
            assert self._make is not None
            item = self._items[i] = self._make(i)
        return item

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> Stats: ...
    @overload
    def __getitem__(self, index: slice) -> list[Stats]: ...
    def __getitem__(self, index: int | slice) -> Stats | list[Stats]:
        if isinstance(index, slice):
            return [self._get(i) for i in range(len(self))[index]]
        return self._get(range(len(self))[index])

    def __iter__(self) -> Iterator[Stats]:
        return (self._get(i) for i in range(len(self)))

    def to_dicts(self) -> list[dict[str, object]]:
        return [s.to_dict() for s in self]

    def __repr__(self) -> str:
        return f"StatsBatch({len(self)} tensors)"


def stats(x: torch.Tensor, *, tol: float | None = None) -> Stats:
    """Scans `x` once and returns its Stats (see the module doc for each field).

    `tol` sets the near-zero threshold; by default torch.finfo(x.dtype).eps.
    Never a collective: a DTensor (FSDP2, tensor parallel) is refused with an
    error that names zeroscan.distributed.stats, the collective call that
    every rank of its mesh makes to get the statistics of the full tensor.
    """
    x = check_tensor("zeroscan.stats", "x", x)
    tol = check_tol("zeroscan.stats", tol)
    buffer = torch.ops.zeroscan.stats.default(x, tol)
    return Stats(Readout(buffer), 0, x.dtype, x.shape, x.device, tol)


def stats_many(tensors: Iterable[torch.Tensor], *, tol: float | None = None) -> StatsBatch:
    """Scans every tensor with one native call per device; one Stats each.

    Tensors may mix dtypes, shapes and devices. Their results share one buffer
    per device, so reading any one field copies each device's buffer once.
    Never a collective: DTensors are refused, as by stats().
    """
    op = "zeroscan.stats_many"
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{op}: tensors must be a list of tensors, got a single tensor; use zeroscan.stats(x)")
    tol = check_tol(op, tol)
    xs = tensors if isinstance(tensors, list) else list(tensors)
    if not xs:
        return StatsBatch([])
    # The common case first: plain tensors on one device, one native call that
    # checks every tensor itself. Anything else it refuses -- None, mixed
    # devices, sparse or DTensor inputs -- takes the careful path below, which
    # names the offending argument or splits the work by device.
    try:
        buffer = torch.ops.zeroscan.stats_many.default(xs, tol)
    except (RuntimeError, TypeError, NotImplementedError):
        buffer = None
    if buffer is not None and not buffer.is_meta:  # meta inputs reach the fake kernel
        readout = Readout(buffer)
        device = buffer.device
        metas = [(x.dtype, x.shape) for x in xs]
        return StatsBatch.lazy(len(xs), lambda row: Stats(readout, row, *metas[row], device, tol))
    xs = [check_tensor(op, "tensors", x, i) for i, x in enumerate(xs)]
    items: list[Stats | None] = [None] * len(xs)
    for indices in device_groups(xs):
        readout = Readout(torch.ops.zeroscan.stats_many.default([xs[i] for i in indices], tol))
        for row, i in enumerate(indices):
            items[i] = Stats(readout, row, xs[i].dtype, xs[i].shape, xs[i].device, tol)
    return StatsBatch(items)  # type: ignore[arg-type]


def device_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of `tensors` grouped by device, devices in order of first
    appearance and indices ascending within a group (scan_buffers' row order)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(tensors):
        by_device.setdefault(x.device, []).append(i)
    return list(by_device.values())


def scan_buffers(tensors: Iterable[torch.Tensor], *, tol: float | None = None) -> list[torch.Tensor]:
    """Scans every tensor and returns only the raw result buffers: one int64
    [N_g, 16] tensor per device group (see `device_groups` for the order).

    This is stats_many without the Python result objects: it calls only the
    native op, never reads a value back and never synchronises, so it traces
    into one torch.compile(fullgraph=True) graph and can be captured in a CUDA
    graph. Turn a buffer into fields later with `decode`, or merge it across
    ranks with zeroscan.distributed.
    """
    op = "zeroscan.scan_buffers"
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{op}: tensors must be a list of tensors, got a single tensor")
    tol = check_tol(op, tol)
    xs = [check_tensor(op, "tensors", t, i) for i, t in enumerate(tensors)]
    return [torch.ops.zeroscan.stats_many.default([xs[i] for i in g], tol) for g in device_groups(xs)]
