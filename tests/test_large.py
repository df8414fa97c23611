"""Big inputs: more than 2**31 elements (int64 indexing) and the N >= 1e8 hard case."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import zeroscan
from helpers import assert_same_stats, fresh_generator, rtol_for

pytestmark = pytest.mark.slow


def exact_moments(parts: list[tuple[torch.Tensor, int]]) -> tuple[int, Fraction, Fraction]:
    """(count, sum, sum of squares) of the finite values, exactly, for values
    given as (tensor, times it repeats)."""
    count, total, squares = 0, Fraction(0), Fraction(0)
    for values, times in parts:
        v = values.to(torch.float64)
        v = v[v.isfinite()]
        count += times * v.numel()
        total += times * sum(Fraction(t) for t in v.tolist())
        squares += times * sum(Fraction(t) ** 2 for t in v.tolist())
    return count, total, squares


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_more_than_2_pow_31_elements(dtype: torch.dtype) -> None:
    g = fresh_generator()
    period = 1 << 16
    pattern = torch.randint(-100, 101, (period,), generator=g, dtype=torch.int16).to(torch.int8)
    pattern[pattern == -2] = 0  # bits 0xFE: float8_e4m3fn's -448, kept for the tail's last element
    tail = torch.randint(-100, 100, (4099,), generator=g, dtype=torch.int16).to(torch.int8)
    tail[-1] = 127 if dtype == torch.int8 else 0x7E  # the largest |x| (127 or 448), last position
    reps = (1 << 31) // period + 1
    n = reps * period + tail.numel()
    assert n > 2**31

    storage = torch.empty(n, dtype=torch.int8)
    storage[: reps * period].view(reps, period).copy_(pattern.expand(reps, period))
    storage[reps * period :] = tail
    x = storage.view(dtype)
    pattern, tail = pattern.view(dtype), tail.view(dtype)

    s = zeroscan.stats(x)
    ref_pattern = zeroscan.reference_stats(pattern)
    ref_tail = zeroscan.reference_stats(tail)
    for field in ("zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative", "finite"):
        assert getattr(s, field) == reps * ref_pattern[field] + ref_tail[field], field
    assert s.numel == n
    assert s.max_abs == ref_tail["max_abs"] > ref_pattern["max_abs"]  # read from the last element
    assert s.min_abs == min(ref_pattern["min_abs"], ref_tail["min_abs"])

    count, total, squares = exact_moments([(pattern, reps), (tail, 1)])
    mean = total / count
    var = (squares - total * mean) / (count - 1)
    rtol = 1e-10 if dtype == torch.int8 else 1e-6
    assert math.isclose(s.mean, float(mean), rel_tol=rtol)
    assert math.isclose(s.std, math.sqrt(var), rel_tol=rtol)
    assert math.isclose(s.norm, math.sqrt(squares), rel_tol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_mean_tiny_spread_at_1e8(dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = torch.randn(100_000_000, generator=g, dtype=dtype).mul_(1e-3).add_(1000)
    s = zeroscan.stats(x)
    # One float64 reference of 1e8 values (most of this test's time), held to
    # twice: as assert_matches_reference holds every scan (the moments' floor
    # at the mean |x|, here about 1000), and strictly relative, no absolute
    # floor (scale 0): this is the case shifted sums exist for.
    reference = zeroscan.reference_stats(x)
    assert_same_stats(s, reference, rtol_for(dtype), scale=float(x.abs().mean(dtype=torch.float64)), what="vs reference:")
    assert_same_stats(
        s, reference, rtol_for(dtype), scale=0.0, moments=("mean", "std", "norm"), what="strictly relative:"
    )
