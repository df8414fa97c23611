"""fp8/fp4 headroom: what a cast to e4m3, e5m2 or e2m1 would do to a tensor.

`headroom(hist, target)` reads a log2-magnitude Histogram (zeroscan.histogram)
and counts, for the "satfinite" cast of x*s to the target (round to nearest,
ties to even, finite values beyond the largest clamped to it), the nonzero
finite values that flush to zero, land as subnormals of the target, or
saturate. The scale s comes from `scaling`:

  "amax"       s = fmt_max / amax (per-tensor amax scaling; not a power of two)
  "amax_pow2"  s = 2^floor(log2(fmt_max / amax)), the scale rounded down
  "none"       s = scale (default 1); any positive finite float

x*s is the float64 product, rounded once onto the target (torch's own cast
of a float64 tensor to float8 rounds through float32 first, which differs
only within 2^-24 of a tie). With v = |x*s| the rounding classes are, for a
format with smallest subnormal m, smallest normal n, largest value M and
ulp u at M:

  flush to zero   v <= m/2              (m/2 itself ties to even: 0)
  subnormal       m/2 < v < n - m/2     (n - m/2 ties to even: n)
  saturated       v > M + u/2, and v == M + u/2 where M's last mantissa bit
                  is odd (e5m2, e2m1); e4m3's 448 is even, so 464 rounds to it

Exact and bounded. Each count is a Bound (low, high). A source binade
[2^e, 2^(e+1)) maps to [2^e s, 2^(e+1) s) for any s (2^e s is exact, and the
float64 product of a float64 x <= 2^(e+1) (1 - 2^-53) stays below the
midpoint under 2^(e+1) s, so it never rounds up to it). Where that image lies
inside one class the binade's whole count goes there (exact). Where it holds
a class boundary the histogram cannot say how its values split: the binade
adds its count to `high` of every class it touches and nothing to `low`.
With a power-of-two s the images are whole target binades, so only three can
be undecided: [m/2, m), [n/2, n) and the top binade [2^emax, 2^(emax+1)).
With any other s an image is undecided wherever it holds a boundary, at most
one binade per boundary. The source's subnormal bin maps to (0, tiny*s) and
is bounded likewise unless it lies wholly below m/2. When `amax` is given, the top binade's image ends at
amax*s, and the one value at amax counts towards `low` of its class: so
"amax" and "amax_pow2" scaling never saturate, exactly. Zeros are reported as
`zeros` (never as flushed); NaN and Inf as `nonfinite` (passed through). A
tensor with no nonzero finite value (all zero like a fresh LoRA B, empty,
all NaN/Inf) has amax 0: no scale changes any count, so the amax scalings
report s = 1 and the three counts are 0.

MX block scaling (`mx_headroom`) cannot come from one per-tensor histogram:
it makes its own exact float64 torch pass over the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from zeroscan.histogram import Histogram
from zeroscan.inputs import require_readable
from zeroscan.stats import scan_one

ZERO, SUBNORMAL, NORMAL, SATURATED = range(4)  # rounding classes, in order of |x*s|


@dataclass(frozen=True)
class Format:
    """A sign + exponent + mantissa float format with no infinities reached
    (the satfinite cast clamps at `max_finite`)."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    dtype: torch.dtype | None  # torch's dtype; None where torch has no cast (e2m1)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias - self.man_bits)

    @property
    def max_exponent(self) -> int:
        """emax: the exponent of the largest normal binade (e4m3 8, e5m2 15, e2m1 2)."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def ulp_at_max(self) -> float:
        return math.ldexp(1.0, self.max_exponent - self.man_bits)

    @property
    def boundaries(self) -> tuple[tuple[float, bool], ...]:
        """Where |x*s| changes rounding class, each with whether the boundary
        value itself rounds into the upper class (the tie goes to the even
        neighbour)."""
        max_is_odd = round(self.max_finite / self.ulp_at_max) % 2 == 1
        return (
            (self.min_subnormal / 2, False),  # ties to 0
            (self.min_normal - self.min_subnormal / 2, True),  # ties to min normal
            (self.max_finite + self.ulp_at_max / 2, max_is_odd),
        )


FORMATS: dict[str, Format] = {
    "e4m3": Format("e4m3", 4, 3, 7, 448.0, torch.float8_e4m3fn),
    "e5m2": Format("e5m2", 5, 2, 15, 57344.0, torch.float8_e5m2),
    "e2m1": Format("e2m1", 2, 1, 1, 6.0, None),  # OCP MX fp4: 0, 0.5, 1, 1.5, 2, 3, 4, 6
}
_ALIASES: dict[object, str] = {
    "e4m3fn": "e4m3",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "fp4": "e2m1",
    "float4_e2m1fn": "e2m1",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}
if hasattr(torch, "float4_e2m1fn_x2"):
    _ALIASES[torch.float4_e2m1fn_x2] = "e2m1"


def format_of(target: str | torch.dtype, op: str = "zeroscan.headroom") -> Format:
    try:
        name = target if isinstance(target, str) and target in FORMATS else _ALIASES.get(target)
    except TypeError:  # unhashable
        name = None
    if name is None:
        raise ValueError(
            f"{op}: target must be one of 'e4m3', 'e5m2', 'e2m1' (or torch.float8_e4m3fn, "
            f"torch.float8_e5m2), got target={target!r}"
        )
    return FORMATS[name]


def _class_at(fmt: Format, v: float) -> int:
    """The rounding class of |x*s| == v."""
    return sum(v >= b if up else v > b for b, up in fmt.boundaries)


def _class_below(fmt: Format, v: float) -> int:
    """The rounding class of values just below v (an open upper end)."""
    return sum(v > b for b, _ in fmt.boundaries)


def _classes(fmt: Format, v: torch.Tensor) -> torch.Tensor:
    """_class_at of every element of the float64 tensor v (int64)."""
    c = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for b, up in fmt.boundaries:
        c += (v >= b) if up else (v > b)
    return c


class Bound(NamedTuple):
    """A count known to lie in [low, high]."""

    low: int
    high: int

    @property
    def exact(self) -> bool:
        return self.low == self.high


_COUNTS = ("to_zero", "to_subnormal", "saturated")
_VERBS = {"to_zero": "flush to zero", "to_subnormal": "subnormal", "saturated": "saturate"}


@dataclass(frozen=True)
class Headroom:
    """What the satfinite cast of x*s to `target` does to a tensor's values.

    to_zero, to_subnormal and saturated count nonzero finite values; each is a
    Bound, exact (low == high) except where a source binade straddles a
    rounding boundary (module doc): with a power-of-two scale only the source
    binades mapping onto [m/2, m), [n/2, n) and [2^emax, 2^(emax+1)) of the
    target, and the source subnormals when tiny*s > m/2. mx_headroom's counts
    are always exact. zeros (already zero), nonfinite (NaN, +-Inf, passed
    through) and total are exact. `scale` is nan and `block` set for MX, and
    1 under the amax scalings when x holds no nonzero finite value.
    """

    target: str
    scaling: str
    scale: float
    total: int
    zeros: int
    nonfinite: int
    to_zero: Bound
    to_subnormal: Bound
    saturated: Bound
    block: int | None = None

    @property
    def exact(self) -> bool:
        return all(getattr(self, name).exact for name in _COUNTS)

    def fraction(self, name: str) -> tuple[float, float]:
        """The bounds of count `name` ("to_zero", ...) as fractions of total."""
        low, high = getattr(self, name)
        return (low / self.total, high / self.total) if self.total else (0.0, 0.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "target": self.target,
            "scaling": self.scaling,
            "scale": self.scale,
            "block": self.block,
            "total": self.total,
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
            "exact": self.exact,
        }
        for name in _COUNTS:
            out[name] = list(getattr(self, name))
            out[f"{name}_fraction"] = list(self.fraction(name))
        return out

    def __str__(self) -> str:
        how = f"mx block {self.block}" if self.block is not None else f"{self.scaling} scale {self.scale:.2g}"
        parts = [_describe(getattr(self, name), self.total, _VERBS[name]) for name in _COUNTS]
        if self.nonfinite:
            parts.append(f"{self.nonfinite} nonfinite")
        return f"{self.target} {how}: " + ", ".join(parts)


def _percent(count: int, total: int) -> str:
    p = 100 * count / total
    return f"{p:.0f}" if p >= 10 else f"{p:.2g}"


def _describe(bound: Bound, total: int, verb: str) -> str:
    if bound.high == 0:
        return f"0 {verb}"
    if bound.exact:
        return f"{_percent(bound.low, total)}% {verb} (exact)"
    return f"{_percent(bound.low, total)}–{_percent(bound.high, total)}% {verb}"


def _ldexp(m: float, e: int) -> float:
    try:
        return math.ldexp(m, e)
    except OverflowError:
        return math.inf


def _check_positive_finite(op: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{op}: {name} must be a positive finite number, got {name}={value!r}")
    return float(value)


def _resolve_scale(
    op: str, fmt: Format, scaling: str | None, amax: float | None, scale: float | None
) -> tuple[str, float]:
    """(scaling name, s), or the error naming the public call `op`."""
    if scaling is None:
        scaling = "none" if scale is not None else "amax"
    if scaling not in ("amax", "amax_pow2", "none"):
        raise ValueError(f"{op}: scaling must be 'amax', 'amax_pow2' or 'none', got scaling={scaling!r}")
    if scaling == "none":
        return scaling, 1.0 if scale is None else _check_positive_finite(op, "scale", scale)
    if scale is not None:
        raise ValueError(f"{op}: scale= goes with scaling='none', got scale={scale!r} with scaling={scaling!r}")
    if amax is None:
        raise ValueError(f"{op}: scaling={scaling!r} needs amax= (zeroscan.stats(x).max_abs), got amax=None")
    if amax == 0.0:
        # No nonzero finite value to scale (headroom() checks that against the
        # histogram): whatever s is, every count is 0, so s = 1 rather than M/0.
        return scaling, 1.0
    amax = _check_positive_finite(op, "amax", amax)
    if scaling == "amax":
        s = fmt.max_finite / amax
    else:
        # floor(log2(M / amax)) from the exponents and mantissas, exactly:
        # M = mm 2^em, amax = ma 2^ea with mantissas in [0.5, 1).
        mm, em = math.frexp(fmt.max_finite)
        ma, ea = math.frexp(amax)
        s = _ldexp(1.0, em - ea - (mm < ma))
    if not 0 < s < math.inf:
        raise ValueError(f"{op}: amax={amax!r} gives scale {fmt.max_finite}/amax outside float64")
    return scaling, s


def _top_binade(hist: Histogram) -> tuple[int, float, float] | None:
    """(bin index, low, high) of the largest nonzero finite bin of |x|: a
    normal binade (index >= 0) or the subnormal bin (index -1)."""
    nonzero = hist.counts.nonzero()[0]
    if len(nonzero):
        i = int(nonzero[-1])
        return i, math.ldexp(1.0, hist.min_exponent + i), _ldexp(1.0, hist.min_exponent + i + 1)
    if hist.subnormal:
        return -1, 0.0, math.ldexp(1.0, hist.min_exponent)
    return None


def _check_amax(op: str, hist: Histogram, amax: float) -> None:
    top = _top_binade(hist)
    if top is None and amax != 0:
        raise ValueError(f"{op}: amax={amax!r}, but the histogram holds no nonzero finite value")
    if top is not None and not (top[1] <= amax < top[2] and amax > 0):
        span = f"[{top[1]!r}, {top[2]!r})"
        raise ValueError(f"{op}: amax={amax!r} is not in the histogram's largest nonzero bin {span}")


def headroom(
    hist: Histogram,
    target: str | torch.dtype,
    *,
    scaling: str | None = None,
    amax: float | None = None,
    scale: float | None = None,
) -> Headroom:
    """Counts what the satfinite cast of x*s to `target` does, from x's
    Histogram alone (exact or bounded, module doc).

    `scaling`: "amax" (default, s = fmt_max / amax), "amax_pow2" (s rounded
    down to a power of two) or "none" (s = `scale`, default 1; the default
    where scale= is given). `amax` is x's exact largest finite |x|
    (zeroscan.stats(x).max_abs where x holds no Inf); the amax scalings need
    it, and given with any scaling it narrows the top binade's bounds. amax
    0 says the histogram holds no nonzero finite value: the amax scalings
    then report s = 1 and count nothing.
    """
    return headroom_from("zeroscan.headroom", hist, target, scaling=scaling, amax=amax, scale=scale)


def headroom_from(
    op: str,
    hist: object,
    target: str | torch.dtype,
    *,
    scaling: str | None = None,
    amax: float | None = None,
    scale: float | None = None,
) -> Headroom:
    """headroom() as the public call `op` makes it: every refusal names `op`."""
    if not isinstance(hist, Histogram):
        raise TypeError(f"{op}: hist must be a zeroscan Histogram, got {type(hist).__name__}")
    fmt = format_of(target, op)
    if amax is not None:
        if isinstance(amax, bool) or not isinstance(amax, (int, float)) or not 0 <= amax < math.inf:
            raise ValueError(f"{op}: amax must be a finite number >= 0, got amax={amax!r}")
        amax = float(amax)
    scaling, s = _resolve_scale(op, fmt, scaling, amax, scale)
    if amax is not None:
        _check_amax(op, hist, amax)
    low, high = _bounds(fmt, hist, s, amax)
    return Headroom(
        target=fmt.name,
        scaling=scaling,
        scale=s,
        total=hist.numel,
        zeros=hist.zeros,
        nonfinite=hist.nan + hist.posinf + hist.neginf,
        to_zero=Bound(low[ZERO], high[ZERO]),
        to_subnormal=Bound(low[SUBNORMAL], high[SUBNORMAL]),
        saturated=Bound(low[SATURATED], high[SATURATED]),
    )


def _bounds(fmt: Format, hist: Histogram, s: float, amax: float | None) -> tuple[list[int], list[int]]:
    """Per rounding class, the least and most values that can be in it."""
    top = _top_binade(hist)
    # Per nonzero bin: (count, image [lo, hi) of its |x| times s, bin index).
    images: list[tuple[int, float, float, int]] = []
    if hist.subnormal:
        images.append((hist.subnormal, 0.0, math.ldexp(1.0, hist.min_exponent) * s, -1))
    for i in hist.counts.nonzero()[0]:
        e = hist.min_exponent + int(i)
        images.append((int(hist.counts[i]), _ldexp(s, e), _ldexp(s, e + 1), int(i)))
    low, high = [0] * 4, [0] * 4
    for count, lo, hi, index in images:
        first = _class_at(fmt, lo)
        # The top bin ends at amax * s, included: the product the value at amax itself gets.
        at_amax = amax is not None and top is not None and index == top[0]
        last = _class_at(fmt, amax * s) if at_amax else _class_below(fmt, hi)
        if first == last:
            low[first] += count
            high[first] += count
            continue
        known = int(at_amax)  # the value at amax itself sits at hi, in class `last`
        for c in range(first, last):
            high[c] += count - known
        high[last] += count
        low[last] += known
    return low, high


def headroom_of(
    x: torch.Tensor, target: str | torch.dtype, *, scaling: str | None = None, scale: float | None = None
) -> Headroom:
    """headroom() of one tensor: its histogram, and amax from zeroscan.stats.

    amax is the largest finite |x|: where x holds +-Inf (stats' max_abs is
    then inf) it is found by one extra torch pass over x; it is 0 where x
    holds no nonzero finite value (all zero, empty, all NaN/Inf), which
    every scaling counts (module doc)."""
    op = "zeroscan.headroom_of"
    x = require_readable(op, "x", x)  # x first, as it is the first argument
    format_of(target, op)  # a bad target is reported before x is scanned
    scanned = scan_one(op, x, histogram=True)  # amax and the histogram from one pass
    amax = scanned.max_abs
    if amax == math.inf:
        v = x.detach()
        amax = float(torch.where(v.isfinite(), v.abs(), 0).max().to(torch.float64))
    # nan: x holds no non-NaN value (empty or all NaN), so no finite one either.
    finite_amax = amax if math.isfinite(amax) else 0.0
    histogram = scanned.histogram
    assert histogram is not None
    return headroom_from(op, histogram, target, scaling=scaling, amax=finite_amax, scale=scale)


_MX_SCALE_EXPONENTS = (-127, 127)  # the range of the E8M0 shared scale
_MX_CHUNK = 1 << 20  # elements converted to float64 at a time


def mx_headroom(x: torch.Tensor, target: str | torch.dtype, block: int = 32) -> Headroom:
    """Exact counts for OCP MX block scaling of x to `target`.

    Blocks are `block` consecutive elements along the last dimension; a last
    dimension that is not a multiple of `block` ends each row with a shorter
    block (zero padding, which changes no block's amax and is not counted).
    A block's shared scale is X = 2^(floor(log2(amax)) - emax) with amax its
    largest finite |x| and emax the target's (e4m3 8, e5m2 15, e2m1 2), the
    exponent clamped to E8M0's [-127, 127]; a block with amax 0 gets X = 1.
    x/X is cast with round to nearest even and saturation.

    Per-block scales cannot come from one histogram, so this is a separate
    pass over x in float64 torch (in chunks, on x's device); every count is
    exact (low == high). NaN and Inf count as nonfinite and the block's scale
    comes from its finite values. This differs from the OCP MX conversion
    (and torchao), which gives such a block a NaN scale so that all its
    elements decode to NaN: here the finite values of the block are still
    counted as their scale would treat them, since the NaN/Inf themselves are
    what `nonfinite` already reports.
    """
    op = "zeroscan.mx_headroom"
    x = require_readable(op, "x", x)
    if x.is_complex():
        raise TypeError(f"{op}: x must be real, got dtype {x.dtype}")
    fmt = format_of(target, op)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"{op}: block must be a positive int, got block={block!r}")
    x = x.detach()
    last = x.shape[-1] if x.dim() and x.numel() else 1
    rows = x.reshape(-1, last)
    pad = -last % block
    classes = torch.zeros(4, dtype=torch.int64, device=x.device)
    zeros = nonfinite = 0
    step = max(1, _MX_CHUNK // max(1, last + pad))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].to(torch.float64)
        blocks = torch.nn.functional.pad(chunk, (0, pad)).reshape(-1, block)
        finite = blocks.isfinite()
        mag = torch.where(finite, blocks.abs(), 0.0)
        amax = mag.amax(dim=1, keepdim=True)
        _, e = torch.frexp(amax)  # amax = m 2^e with 0.5 <= m < 1: floor(log2 amax) = e - 1
        shared = torch.where(amax > 0, e.to(torch.int64) - 1 - fmt.max_exponent, 0).clamp(*_MX_SCALE_EXPONENTS)
        scaled = mag * torch.pow(2.0, (-shared).to(torch.float64))  # a power of two: exact
        live = finite & (mag > 0)
        classes += torch.bincount(_classes(fmt, scaled)[live], minlength=4)
        zeros += int((finite & (mag == 0)).sum()) - pad * chunk.shape[0]
        nonfinite += int((~finite).sum())
    low = classes.tolist()
    return Headroom(
        target=fmt.name,
        scaling="mx",
        scale=math.nan,
        total=x.numel(),
        zeros=zeros,
        nonfinite=nonfinite,
        to_zero=Bound(low[ZERO], low[ZERO]),
        to_subnormal=Bound(low[SUBNORMAL], low[SUBNORMAL]),
        saturated=Bound(low[SATURATED], low[SATURATED]),
        block=block,
    )
