"""The value distributions that zeroscan's tests and benchmarks measure.

Any scan whose cost could depend on the values must be measured on the data
users actually have, and on its worst case: dense random data flatters a
kernel that treats zeros, subnormals or NaN differently. Each distribution
here is one of those, named after what it stands for:

    randn            dense normal values (integers: nonzero values in -100..100
                     clipped to the dtype; bool: True). In float8_e4m3fn about
                     1 % of a standard normal is subnormal and 0.1 % rounds to 0;
                     float32, float64 and bfloat16 have no zero (torch.randn
                     draws an exact 0 about once in 15M float32 values, when
                     its Box-Muller radius is 0: such a value becomes 1)
    zeros_50         50 % exact zeros: a ReLU network's gradient
    zeros_99         99 % exact zeros: an embedding's gradient
    all_zeros        every value 0
    all_subnormal    every value subnormal and nonzero: an underflowed gradient
    subnormal_0.1    0.1 % subnormal values among randn
    nonfinite_0.01   0.01 % NaN, +Inf and -Inf among randn (NaN only for
                     float8_e4m3fn, which has no Inf)
    nonfinite_1      1 % of them: a NaN-poisoned tensor, a special value in
                     every few hundred
    large_mean       a large mean with a small spread: 1000 + 1e-3 * randn where
                     the dtype resolves it, else a spread of one unit in the
                     last place at the mean (bfloat16 1000 +- 4, float16
                     1000 +- 0.5, float8_e5m2 1000 +- 128; float8_e4m3fn,
                     whose largest value is 448, 128 +- 16; integers 1000 or
                     half their largest value, +- 1)

Integer and bool tensors have no subnormal or non-finite values, and bool none
with a spread, so `distributions_for` leaves those out. The positions of zeros
and special values are random; the rarer specials sit one in each of k equal
stretches of the tensor, so there are exactly k of them (at least one of each
kind, also in a small tensor). Everything is made with vectorised torch ops
from the given generator: 64M float32 values take about a second.
"""

from __future__ import annotations

import math

import torch

from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES

DISTRIBUTIONS: tuple[str, ...] = (
    "randn",
    "zeros_50",
    "zeros_99",
    "all_zeros",
    "all_subnormal",
    "subnormal_0.1",
    "nonfinite_0.01",
    "nonfinite_1",
    "large_mean",
)

# The fraction of values each sparse or masked distribution sets.
FRACTION: dict[str, float] = {
    "zeros_50": 0.5,
    "zeros_99": 0.99,
    "subnormal_0.1": 0.001,
    "nonfinite_0.01": 0.0001,
    "nonfinite_1": 0.01,
}

_FLOAT_ONLY = ("all_subnormal", "subnormal_0.1", "nonfinite_0.01", "nonfinite_1")
_NO_INF = (torch.float8_e4m3fn,)  # its top exponent holds finite values and NaN only
_RANDN_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # torch.randn makes these directly
_NO_ZERO_DTYPES = (torch.float64, torch.float32, torch.bfloat16)  # where no normal value rounds to 0
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer view
_MASK_RESOLUTION = 1 << 15  # masks compare int16 draws: 5x faster than torch.rand at 64M


def distributions_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The distributions that exist for `dtype`, in DISTRIBUTIONS order."""
    if dtype in FLOAT_DTYPES:
        return DISTRIBUTIONS
    if dtype in INT_DTYPES:
        names = tuple(d for d in DISTRIBUTIONS if d not in _FLOAT_ONLY)
        return names if dtype != torch.bool else tuple(d for d in names if d != "large_mean")
    supported = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES + INT_DTYPES)
    raise ValueError(f"distributions_for: dtype must be one of {supported}, got {dtype}")


def make_distribution(name: str, n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """n values of `dtype` drawn from distribution `name`: a contiguous 1-D CPU tensor."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"make_distribution: name must be one of {', '.join(DISTRIBUTIONS)}, got {name!r}")
    if name not in distributions_for(dtype):
        raise ValueError(
            f"make_distribution: name {name!r} does not exist for dtype {dtype} "
            f"(it has {', '.join(distributions_for(dtype))})"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_distribution: n must be a non-negative int, got {n!r}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise TypeError(f"make_distribution: generator must be a CPU torch.Generator, got {generator!r}")
    if name == "all_zeros":
        return torch.zeros(n, dtype=dtype)
    if name == "all_subnormal":
        return subnormal_bits(n, dtype, generator).view(dtype)
    x = large_mean(n, dtype, generator) if name == "large_mean" else dense(n, dtype, generator)
    bits = x.view(_BITS_DTYPE[x.element_size()]) if dtype.is_floating_point else x
    if name in ("zeros_50", "zeros_99"):
        threshold = round(FRACTION[name] * _MASK_RESOLUTION)
        mask = torch.randint(0, _MASK_RESOLUTION, (n,), generator=generator, dtype=torch.int16) < threshold
        bits.masked_fill_(mask, 0)  # +0.0 for floats
    elif name == "subnormal_0.1":
        where = spread_positions(n, FRACTION[name], 1, generator)
        bits[where] = subnormal_bits(where.numel(), dtype, generator)
    elif name in ("nonfinite_0.01", "nonfinite_1"):
        specials = special_bits(dtype)
        where = spread_positions(n, FRACTION[name], specials.numel(), generator)
        bits[where] = specials.repeat(math.ceil(where.numel() / specials.numel()))[: where.numel()]
    return x


def dense(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """randn for floats; nonzero integers in -100..100 (clipped to the dtype); True for bool."""
    if dtype == torch.bool:
        return torch.ones(n, dtype=torch.bool)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -100), min(info.max, 100), (n,), generator=g, dtype=dtype)
        return x.add_((x >= 0).to(dtype))  # [lo, hi) -> [lo, -1] and [1, hi]
    work = dtype if dtype in _RANDN_DTYPES else torch.float16
    x = torch.randn(n, generator=g, dtype=work).to(dtype)
    if dtype in _NO_ZERO_DTYPES:
        x.masked_fill_(x == 0, 1.0)
    return x


def large_mean(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """mean + spread * randn with mean >> spread, both chosen to fit the dtype."""
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        mean = min(1000, (info.max + 1) // 2)
        return torch.randint(mean - 1, mean + 2, (n,), generator=g, dtype=dtype)
    info = torch.finfo(dtype)
    mean = 1000.0 if info.max >= 16_000 else 2.0 ** (math.floor(math.log2(info.max)) - 1)
    ulp = 2.0 ** math.floor(math.log2(mean)) * info.eps
    spread = max(1e-6 * mean, ulp)
    work = dtype if dtype in _RANDN_DTYPES else torch.float16
    return torch.randn(n, generator=g, dtype=work).mul_(spread).add_(mean).to(dtype)


def subnormal_bits(k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """The bit patterns (as a same-width signed integer tensor) of k subnormal
    values of floating `dtype`: uniform over the nonzero subnormals, random sign."""
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    count = (1 << mantissa_bits) - 1  # nonzero mantissas under a zero exponent
    int_dtype = _BITS_DTYPE[info.bits // 8]
    u = torch.randint(0, 2 * count, (k,), generator=g, dtype=int_dtype)  # one draw: sign and mantissa
    negative = u >= count
    positive_bits = torch.where(negative, u - (count - 1), u + 1)  # 1 .. count either way
    return torch.where(negative, positive_bits + torch.iinfo(int_dtype).min, positive_bits)  # set the sign bit


def special_bits(dtype: torch.dtype) -> torch.Tensor:
    """The bit patterns of NaN, +Inf and -Inf in `dtype` (NaN only where it has no Inf)."""
    values = [math.nan] if dtype in _NO_INF else [math.nan, math.inf, -math.inf]
    return torch.tensor(values, dtype=torch.float32).to(dtype).view(_BITS_DTYPE[dtype.itemsize])


def spread_positions(n: int, fraction: float, at_least: int, g: torch.Generator) -> torch.Tensor:
    """k = max(at_least, round(fraction * n)) distinct random positions in [0, n)
    (at most n): one at a random place in each of k equal stretches."""
    k = min(n, max(at_least, round(fraction * n)))
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    stretch = n // k
    return torch.arange(k, dtype=torch.int64) * stretch + torch.randint(0, stretch, (k,), generator=g)
