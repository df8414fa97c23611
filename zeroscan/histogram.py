"""Log2-magnitude histograms: where a tensor's values sit in its dtype's range.

`stats(x, histogram=True)` counts, in the same pass as the statistics, how
many values fall in each binade 2^e <= |x| < 2^(e+1) of x's dtype, with the
exact zeros, subnormals, infinities and NaN in bins of their own. Counts are
exact int64.

The native scan counts each element under the exponent field of |x| (for
integers, the bit length of |x|): int64 [B] per tensor, B = `field_bins`.
`Histogram.from_fields` turns those fields and the tensor's result row into
the bins above; `reference_histogram` computes the same in float64 torch,
for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy
import torch

from zeroscan.inputs import require_readable


@dataclass(frozen=True)
class BinLayout:
    """How the native fields of one dtype map to binades.

    A floating dtype with `exp_bits` exponent bits keeps field 0 for zeros and
    subnormals and fields 1.. for the normal binades, exponent field - bias.
    Its all-ones field holds infinities and NaN (float8_e4m3fn, which has no
    infinities, keeps a normal binade there beside its NaN). An integer dtype
    keeps field k for bit length k: zero in field 0, 2^(k-1) <= |x| < 2^k in
    field k.
    """

    fields: int  # native bins, int64 [fields] per tensor
    min_exponent: int  # binary exponent of the smallest normal binade
    max_exponent: int  # ... of the largest finite one
    first_field: int  # the field of min_exponent


def _float_layout(exp_bits: int, top_is_normal: bool = False) -> BinLayout:
    bias = (1 << (exp_bits - 1)) - 1
    fields = 1 << exp_bits
    top = fields - 1 if top_is_normal else fields - 2
    return BinLayout(fields, 1 - bias, top - bias, 1)


def _int_layout(bits: int) -> BinLayout:
    return BinLayout(bits + 1, 0, bits - 1, 1)


LAYOUTS: dict[torch.dtype, BinLayout] = {
    torch.float32: _float_layout(8),
    torch.float64: _float_layout(11),
    torch.float16: _float_layout(5),
    torch.bfloat16: _float_layout(8),
    torch.float8_e4m3fn: _float_layout(4, top_is_normal=True),
    torch.float8_e5m2: _float_layout(5),
    torch.bool: _int_layout(1),
    torch.uint8: _int_layout(8),
    torch.int8: _int_layout(8),  # |-128| = 2^7 has bit length 8
    torch.int16: _int_layout(16),
    torch.int32: _int_layout(32),
    torch.int64: _int_layout(64),
}


def layout_of(dtype: torch.dtype) -> BinLayout:
    layout = LAYOUTS.get(dtype)
    if layout is None:
        raise TypeError(f"zeroscan.histogram: no histogram for dtype {dtype}")
    return layout


def field_bins(dtype: torch.dtype) -> int:
    """Native histogram fields of one tensor of `dtype` (csrc/histogram.h)."""
    return layout_of(dtype).fields


@dataclass(frozen=True)
class Histogram:
    """Exact counts of one tensor's values by binade of |x|.

    `counts[i]` counts the finite, normal values with 2^e <= |x| < 2^(e+1),
    e = min_exponent + i, for every binade of the dtype (integers: e from 0
    to bits - 1). Zeros, subnormals, infinities and NaN have their own bins.
    Every element is in exactly one bin: `numel` is their sum.
    """

    dtype: torch.dtype
    min_exponent: int
    counts: numpy.ndarray  # int64 [max_exponent - min_exponent + 1]
    zeros: int
    subnormal: int
    posinf: int
    neginf: int
    nan: int

    @property
    def max_exponent(self) -> int:
        return self.min_exponent + len(self.counts) - 1

    @property
    def exponents(self) -> numpy.ndarray:
        """int64 [len(counts)]: the binary exponent of each bin of `counts`."""
        return numpy.arange(self.min_exponent, self.max_exponent + 1, dtype=numpy.int64)

    @property
    def numel(self) -> int:
        return int(self.counts.sum()) + self.zeros + self.subnormal + self.posinf + self.neginf + self.nan

    def count(self, exponent: int) -> int:
        """Values with 2^exponent <= |x| < 2^(exponent + 1) (normal binades)."""
        i = exponent - self.min_exponent
        return int(self.counts[i]) if 0 <= i < len(self.counts) else 0

    @classmethod
    def from_fields(cls, dtype: torch.dtype, fields: numpy.ndarray, row: Mapping[str, Any]) -> Histogram:
        """The histogram of one tensor from its native fields (int64 [>= B],
        extra fields zero) and its decoded result row (zeros, subnormal, nan,
        posinf, neginf)."""
        layout = layout_of(dtype)
        fields = numpy.asarray(fields, dtype=numpy.int64)
        n_bins = layout.max_exponent - layout.min_exponent + 1
        counts = fields[layout.first_field : layout.first_field + n_bins].copy()
        nan, posinf, neginf = int(row["nan"]), int(row["posinf"]), int(row["neginf"])
        if dtype == torch.float8_e4m3fn:
            counts[-1] -= nan  # its NaN shares the top field with 256 <= |x| <= 448
        return cls(dtype, layout.min_exponent, counts, int(row["zeros"]), int(row["subnormal"]), posinf, neginf, nan)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: nonzero binades only, as {"exponent": count}."""
        nonzero = numpy.nonzero(self.counts)[0]
        return {
            "min_exponent": self.min_exponent,
            "max_exponent": self.max_exponent,
            "binades": {str(int(self.min_exponent + i)): int(self.counts[i]) for i in nonzero},
            "zeros": self.zeros,
            "subnormal": self.subnormal,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "nan": self.nan,
        }

    @classmethod
    def from_dict(cls, dtype: torch.dtype, doc: Mapping[str, Any]) -> Histogram:
        """The histogram that `to_dict()` wrote (as saved JSON), of dtype `dtype`."""
        low = int(doc["min_exponent"])
        counts = numpy.zeros(int(doc["max_exponent"]) - low + 1, dtype=numpy.int64)
        for exponent, count in doc["binades"].items():
            counts[int(exponent) - low] = int(count)
        return cls(
            dtype, low, counts, int(doc["zeros"]), int(doc["subnormal"]), int(doc["posinf"]), int(doc["neginf"]), int(doc["nan"])
        )

    def __repr__(self) -> str:
        # The dataclass repr printed every bin of `counts` as a numpy array
        # (254 for float32, mostly zeros); like to_dict, show the occupied
        # binades only, by exponent.
        occupied = numpy.nonzero(self.counts)[0]
        binades = ", ".join(f"{int(self.min_exponent + i)}: {int(self.counts[i])}" for i in occupied)
        return (
            f"Histogram(dtype={str(self.dtype).removeprefix('torch.')}, numel={self.numel}, binades={{{binades}}}, "
            f"zeros={self.zeros}, subnormal={self.subnormal}, posinf={self.posinf}, neginf={self.neginf}, nan={self.nan})"
        )

    def __add__(self, other: Histogram) -> Histogram:
        if other.dtype != self.dtype:
            raise TypeError(f"Histogram: cannot add a {other.dtype} histogram to a {self.dtype} one")
        return Histogram(
            self.dtype,
            self.min_exponent,
            self.counts + other.counts,
            self.zeros + other.zeros,
            self.subnormal + other.subnormal,
            self.posinf + other.posinf,
            self.neginf + other.neginf,
            self.nan + other.nan,
        )


def reference_histogram(x: torch.Tensor) -> Histogram:
    """The Histogram of `x` computed in float64 torch, independently of the
    native scan (for tests): frexp gives each finite value's exponent, and
    Python integers the bit length of each integer. A tensor that stats()
    would refuse, or of a dtype with no histogram, is refused naming
    zeroscan.reference_histogram."""
    op = "zeroscan.reference_histogram"
    x = require_readable(op, "x", x)
    layout = LAYOUTS.get(x.dtype)
    if layout is None:
        listed = ", ".join(str(d).removeprefix("torch.") for d in LAYOUTS)
        raise TypeError(f"{op}: x has dtype {str(x.dtype).removeprefix('torch.')}, which has no histogram (these have: {listed})")
    n_bins = layout.max_exponent - layout.min_exponent + 1
    if not x.dtype.is_floating_point:
        lengths = torch.tensor([abs(int(v)).bit_length() for v in x.detach().flatten().tolist()], dtype=torch.int64)
        fields = torch.bincount(lengths, minlength=layout.fields).numpy()
        return Histogram(x.dtype, layout.min_exponent, fields[1:].astype(numpy.int64), int(fields[0]), 0, 0, 0, 0)
    v = x.detach().flatten().to("cpu", torch.float64)
    a = v.abs()
    tiny = torch.finfo(x.dtype).tiny
    normal = a[torch.isfinite(a) & (a >= tiny)]
    _, exp = torch.frexp(normal)  # normal = m * 2^exp, 0.5 <= m < 1
    counts = torch.bincount(exp.to(torch.int64) - 1 - layout.min_exponent, minlength=n_bins)
    return Histogram(
        x.dtype,
        layout.min_exponent,
        counts.numpy().astype(numpy.int64),
        zeros=int((v == 0).sum()),
        subnormal=int(((a > 0) & (a < tiny)).sum()),
        posinf=int((v == float("inf")).sum()),
        neginf=int((v == float("-inf")).sum()),
        nan=int(torch.isnan(v).sum()),
    )
