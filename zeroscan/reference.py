"""A plain-PyTorch float64 reference for every Stats field.

It is slow and obviously correct: each count and extreme is its own
whole-tensor torch expression in float64, and the moments are computed so
that nothing is lost to rounding, cancellation or overflow: sums of values
are exact (in integers), and squares are taken of values scaled by a power
of two chosen from max |x| and n, so that none of them overflows or
underflows. The test suite compares the native kernels against it, and users
can use it to check zeroscan on their own data.
"""

from __future__ import annotations

import math

import torch

from zeroscan.ops import check_tol, require_readable
from zeroscan.result_row import FIELDS

# _exact_units counts in units of 2^-1126: frexp writes every float64 as a
# whole number below 2^53 of units 2^(e - 53), e >= -1073 (the subnormal
# 2^-1074 is 0.5 * 2^-1073), and e <= 1024.
_UNIT_EXPONENT = 1126
_BUCKETS = 1024 - 53 + _UNIT_EXPONENT + 1


def dtype_tiny_eps(dtype: torch.dtype) -> tuple[float, float]:
    """(smallest normal, eps) of a floating dtype; (0, 0) for integers and bool."""
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return float(info.tiny), float(info.eps)
    return 0.0, 0.0


def _exact_units(values: torch.Tensor) -> int:
    """The sum of finite float64 `values`, exactly, in units of 2^-1126.

    Each value is a whole number m (|m| < 2^53) of units 2^(e - 53), e its
    frexp exponent. The m of one exponent are summed in int64 in two parts,
    m = 2^26 high + low (|high| <= 2^27, 0 <= low < 2^26), which no sum of
    fewer than 2^36 values overflows; the per-exponent sums are then added
    in Python integers. (Pieces of 4M values bound the temporaries.)"""
    sums = torch.zeros((2, _BUCKETS), dtype=torch.int64, device=values.device)  # beside the values: any device
    for piece in values.split(1 << 22):
        mantissa, exponent = torch.frexp(piece)
        m = (mantissa * 2.0**53).to(torch.int64)
        bucket = exponent + (_UNIT_EXPONENT - 53)
        sums[0].index_add_(0, bucket, m >> 26)  # floor(m / 2^26)
        sums[1].index_add_(0, bucket, m & (2**26 - 1))  # m - 2^26 floor(m / 2^26)
    used = sums.ne(0).any(0).nonzero().flatten().tolist()
    his, los = sums[0, used].tolist(), sums[1, used].tolist()
    return sum(((hi << 26) + lo) << b for b, hi, lo in zip(used, his, los))


def _scaled(values: torch.Tensor | float, k: int) -> torch.Tensor | float:
    """values * 2^k, exactly (but for results beyond the float64 range or
    below its normal range), for |k| up to ~2000: by two power-of-two factors
    in turn, neither of which overflows or underflows itself."""
    half = k // 2
    return values * 2.0**half * 2.0 ** (k - half)


def _moments(v: torch.Tensor) -> dict[str, float]:
    """mean, std, norm and sum of the finite float64 values `v` (n >= 1).

    The mean and sum are the exact ones, rounded once. std and norm come from
    the values scaled by 2^k and scaled back: max |x| * 2^k < 2^t, so that n
    of their squares (of deviations up to twice that) sum below 2^1020, and
    above 2^-400 unless max |x| is already between the two (k = 0), so that
    squares of deviations keep their bits. The sum of squared deviations
    from the mean is corrected by the deviations' own exact sum (the
    corrected two-pass algorithm). std and norm are inf when that sum of
    squared deviations exceeds the float64 range, as the README documents
    for zeroscan (and as torch.std's does)."""
    n = v.numel()
    units = _exact_units(v)
    mean = units / (n << _UNIT_EXPONENT)
    try:
        total = units / (1 << _UNIT_EXPONENT)
    except OverflowError:
        total = math.inf if units > 0 else -math.inf
    top = float(v.abs().max())
    if top == 0.0:
        return {"mean": mean, "std": 0.0 if n >= 2 else math.nan, "norm": 0.0, "sum": total}
    t = (1018 - n.bit_length()) // 2
    e = math.frexp(top)[1]  # max |x| < 2^e
    k = 0 if -400 <= e <= t else t - e
    y = _scaled(v, k) if k else v
    # Deviations from the mean, scaled exactly (unless the mean is so far
    # below max |x| that it underflows: the correction below absorbs that).
    z = y - _scaled(mean, k)
    z_sum = _exact_units(z) / (1 << _UNIT_EXPONENT)
    # The squares are non-negative: a float64 torch sum of them is good to a
    # few ulps, whatever their number.
    m2_scaled = max(0.0, float((z * z).sum()) - z_sum * z_sum / n)
    if _scaled(_scaled(m2_scaled, -k), -k) == math.inf:
        return {"mean": mean, "std": math.inf if n >= 2 else math.nan, "norm": math.inf, "sum": total}
    std = _scaled(math.sqrt(m2_scaled / (n - 1)), -k) if n >= 2 else math.nan
    norm = _scaled(math.sqrt(float((y * y).sum())), -k)
    return {"mean": mean, "std": std, "norm": norm, "sum": total}


def require_real(op: str, x: object) -> torch.Tensor:
    """x, when it is a tensor whose values can be read (zeroscan.inputs) and
    that is real; else the error naming `op` and x."""
    x = require_readable(op, "x", x)
    if x.is_complex():
        raise TypeError(f"{op}: x is complex ({str(x.dtype).removeprefix('torch.')}); pass torch.view_as_real(x) or x.abs()")
    return x


def reference_stats(x: torch.Tensor, tol: float | None = None) -> dict[str, float | int]:
    """The Stats fields of `x`, computed in float64 with plain torch ops.
    Anything but a real tensor whose memory can be read (not sparse, nested,
    quantized, meta or freed) is refused as stats() refuses it, in an error
    naming zeroscan.reference_stats."""
    op = "zeroscan.reference_stats"
    x = require_real(op, x)
    checked_tol = check_tol(op, tol)
    tiny, eps = dtype_tiny_eps(x.dtype)
    tol = eps if checked_tol is None else checked_tol
    v = x.detach().reshape(-1).to(torch.float64)
    a = v.abs()
    is_nan = v.isnan()
    finite_values = v[v.isfinite()]
    non_nan = a[~is_nan]
    nonzero = non_nan[non_nan != 0]
    n_finite = finite_values.numel()
    moments = (
        _moments(finite_values)
        if n_finite
        else {"mean": math.nan, "std": math.nan, "norm": 0.0, "sum": 0.0}
    )
    fields = {
        "numel": v.numel(),
        "zeros": int((v == 0).sum()),
        "subnormal": int(((a > 0) & (a < tiny)).sum()),
        "near_zero": int(((a > 0) & (a <= tol)).sum()),
        "nan": int(is_nan.sum()),
        "posinf": int((v == math.inf).sum()),
        "neginf": int((v == -math.inf).sum()),
        "negative": int((v < 0).sum()),
        "finite": n_finite,
        "min_abs": float(non_nan.min()) if non_nan.numel() else math.nan,
        "min_abs_nonzero": float(nonzero.min()) if nonzero.numel() else math.inf,
        "max_abs": float(non_nan.max()) if non_nan.numel() else math.nan,
        **moments,
    }
    return {name: fields[name] for name in FIELDS}  # in the row's order; a field not defined here is a KeyError
