"""Moments at the edges: shifts picked from values unlike the rest, and
float64 data near the top of its range.

The CPU takes a chunk's shift from its first 64 values and squares floats of
up to 32 bits in float32; planted outliers make that sample unrepresentative,
and the result must still be within the README's bound (1e-6 relative, 1e-10
for float64). float64 values near 1.8e308 overflow sums of values and of
squares; the mean must stay finite and accurate, std and norm may only
overflow to inf (when the sum of squared deviations leaves the float64 range,
as documented), never turn 0 or NaN.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroscan
from checklist import Checklist
from helpers import DEVICES, assert_matches_reference, fresh_generator
from zeroscan.distributed import combine_rows
from zeroscan.result_row import row_from_words

CHUNK = 1 << 16  # the CPU's chunk, whose first 64 values pick its shift
N = 3 * CHUNK + 5  # several chunks and a ragged end
FLOAT64_MAX = torch.finfo(torch.float64).max

# (offset, spread, outlier) each dtype resolves: the outliers far off the
# offset, the spread far below it, so shifted sums about an outlier cancel.
OFFSETS = {
    torch.float32: (1.0, 1e-3, 1e4),
    torch.float16: (1.0, 1e-3, 1e4),
    torch.bfloat16: (1.0, 1e-2, 1e4),
    torch.float8_e4m3fn: (8.0, 0.5, 400.0),
    torch.float8_e5m2: (8.0, 1.0, 4e4),
    torch.float64: (1.0, 1e-6, 1e8),
}

# Where the outliers go: [start, stop) position ranges, per N.
OUTLIER_LAYOUTS = {
    # The issue's cat([full(64, 1e4), 1 + 1e-3 * randn(...)]).
    "first_64": [(0, 64)],
    "every_chunk_start": [(c, c + 64) for c in range(0, N, CHUNK)],
    "across_a_chunk_boundary": [(CHUNK - 40, CHUNK + 200)],
    "a_third_of_a_chunk": [(CHUNK, CHUNK + CHUNK // 3)],
    "mid_chunk_blocks": [(CHUNK + 1000, CHUNK + 1064), (2 * CHUNK + 5000, 2 * CHUNK + 9096)],
    "short_first_block": [(0, 3)],
}


def planted(dtype: torch.dtype, layout: str, g: torch.Generator, *, near: float | None = None) -> torch.Tensor:
    """offset + spread * randn with the layout's blocks of outliers (or of
    values `near` spreads off the offset), in float64."""
    offset, spread, outlier = OFFSETS[dtype]
    x = offset + spread * torch.randn(N, generator=g, dtype=torch.float64)
    off = outlier - offset if near is None else near * spread
    for start, stop in OUTLIER_LAYOUTS[layout]:
        stop = min(stop, N)
        x[start:stop] = offset + off * (1 + 1e-2 * torch.randn(stop - start, generator=g, dtype=torch.float64))
    return x


def on(values: torch.Tensor, dtype: torch.dtype, device: str, strided: bool) -> torch.Tensor:
    """values in dtype on device, contiguous or as every other element of a
    twice-as-long tensor (so the CPU gathers them)."""
    x = values.to(dtype).to(device)
    if strided:
        x = torch.stack([x, torch.zeros_like(x)], 1).reshape(-1)[::2]
        assert not x.is_contiguous()
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", list(OFFSETS), ids=str)
def test_planted_outliers(dtype: torch.dtype, strided: bool, device: str) -> None:
    """Each of OUTLIER_LAYOUTS in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for layout in OUTLIER_LAYOUTS:
            with checks.case(layout):
                x = on(planted(dtype, layout, g), dtype, device, strided)
                assert_matches_reference(zeroscan.stats(x), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_shift_a_few_spreads_off(dtype: torch.dtype, device: str) -> None:
    """First values `near` spreads off the offset: around the sqrt(3) spreads
    from which a chunk is summed again about its own mean, and below it,
    where the first sums stand."""
    g = fresh_generator()
    with Checklist() as checks:
        for near in [1.0, 1.5, 1.7, 1.8, 3.0]:
            with checks.case(f"near={near}"):
                x = on(planted(dtype, "every_chunk_start", g, near=near), dtype, device, False)
                assert_matches_reference(zeroscan.stats(x), x)


@pytest.mark.slow  # a fresh process per cap
@pytest.mark.parametrize("cap", ["scalar", "avx2"])
def test_planted_outliers_under_capability(cap: str) -> None:
    """The same on the CPU paths of lesser CPUs (the cap is read once per
    process, so a fresh one runs them)."""
    env = {**os.environ, "ZEROSCAN_CPU_CAPABILITY": cap}
    tests = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "(planted_outliers or few_spreads) and not cuda and not capability"],
        env=env, cwd=tests.parent, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


# ---- float64 near the top of its range -----------------------------------


def huge_values(case: str, n: int, g: torch.Generator) -> torch.Tensor:
    """n float64 values of one family near the top of the range."""
    normal = torch.randn(n, generator=g, dtype=torch.float64)
    if case == "near_max_runs":
        # +-(0.5..1) * max in runs of one sign, among ordinary and tiny
        # values; then the same values negated, rolled: the sum is 0.
        half = n // 2
        signs = 1.0 - 2.0 * (torch.arange(half) // 1000 % 2).to(torch.float64)
        values = FLOAT64_MAX * (0.5 + 0.5 * torch.rand(half, generator=g, dtype=torch.float64)) * signs
        values[::7] = normal[: len(values[::7])]
        values[3::7] = 1e-300 * normal[: len(values[3::7])]
        return torch.cat([values, -values.roll(17)])
    if case == "max_minus_max_one":  # the issue's [max, -max, 1] * (n / 3)
        return torch.tensor([FLOAT64_MAX, -FLOAT64_MAX, 1.0], dtype=torch.float64).repeat(n // 3)
    if case == "constant_huge":
        sign = 1.0 if float(normal[0]) > 0 else -1.0
        return torch.full((n,), sign * 1.5e308, dtype=torch.float64)
    if case == "huge_and_ordinary":
        huge = FLOAT64_MAX * (0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64))
        return torch.where(torch.rand(n, generator=g) < 0.5, huge * normal.sign(), normal)
    # One value among ordinary ones, first in its CPU chunk and CUDA tile,
    # so that it is in the values that pick the CPU shift and is a CUDA
    # thread's shift.
    at = CHUNK if n > 2 * CHUNK else 0
    if case == "one_near_max":
        normal[at] = -0.9 * FLOAT64_MAX
        return normal
    if case == "one_squares_to_near_max":
        # Its square alone nearly fills the range: m2 is finite, but the
        # squares about it, a CUDA thread's shift, overflow. (The CPU keeps
        # a shift of 0 here: the mean of its first values is within one
        # standard deviation of 0.)
        normal[at] = 1.2e154
        return normal
    if case == "first_64_far_off":
        # The CPU's shift, the mean of a chunk's first 64 values, lies far
        # from its mean; so does a CUDA thread's first value: sums of squares
        # about them overflow while m2 (~1.4e308) does not.
        normal[at : at + 64] = 1.5e153
        return normal
    if case == "halves_of_opposite_sign":
        # Partials (chunks, tiles, threads) whose means are +-1.5e308: their
        # difference overflows when they are combined.
        x = torch.full((n,), 1.5e308, dtype=torch.float64)
        x[n // 3 :] = -1.5e308
        return x
    if case == "spread_near_sqrt_max":
        return 1e150 * normal
    raise AssertionError(case)


HUGE_CASES = [
    "near_max_runs",
    "max_minus_max_one",
    "constant_huge",
    "huge_and_ordinary",
    "one_near_max",
    "one_squares_to_near_max",
    "first_64_far_off",
    "halves_of_opposite_sign",
    "spread_near_sqrt_max",
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", HUGE_CASES)
def test_float64_near_the_top_of_its_range(case: str, device: str) -> None:
    """Both sizes, contiguous and strided, in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for n in [300, N]:
            for strided in [False, True]:
                with checks.case(f"n={n} {'strided' if strided else 'contiguous'}"):
                    x = on(huge_values(case, n, g), torch.float64, device, strided)
                    s = zeroscan.stats(x)
                    reference = zeroscan.reference_stats(x.cpu())
                    # Counts and min/max |x| exactly; the mean within 1e-10 of itself or
                    # 1e-12 of mean |x|; std, norm and sum likewise, inf exactly when the
                    # reference's is (std and norm: when sum((x - mean)^2) overflows).
                    assert_matches_reference(s, x)
                    assert math.isfinite(s.mean)
                    constant = reference["std"] == 0.0
                    assert s.std > 0.0 or constant, f"std {s.std} of non-constant data"
                    assert not math.isnan(s.std) and not math.isnan(s.norm) and s.norm > 0.0
                    assert math.isinf(s.std) == math.isinf(reference["std"])


def test_the_issues_float64_examples() -> None:
    two = torch.tensor([1.5e308, 1.5e308], dtype=torch.float64)
    s = zeroscan.stats(two)
    assert s.mean == 1.5e308 and s.std == 0.0 and s.sum == math.inf  # the sum, 3e308, overflows
    three = torch.tensor([FLOAT64_MAX, -FLOAT64_MAX, 1.0] * 100, dtype=torch.float64)
    reference = zeroscan.reference_stats(three)
    assert reference["mean"] == 1 / 3 and reference["sum"] == 100.0  # exact
    s = zeroscan.stats(three)
    # Sums of values +-1.8e308 round in units of ~1e292: the mean is finite
    # and within 1e-15 of max |x| of the truth (the ones are below the
    # rounding), and std overflows, as sum((x - mean)^2) does.
    assert math.isfinite(s.mean) and abs(s.mean - 1 / 3) <= 1e-15 * FLOAT64_MAX
    assert s.std == math.inf and reference["std"] == math.inf


def test_norm_beside_an_infinity() -> None:
    """max |x| counts infinities, which the moments leave out: it cannot
    scale the norm of huge finite values (whose squares, 1e400, overflow)."""
    x = torch.tensor([1e200, 1e200, math.inf, 1e200, -math.inf], dtype=torch.float64)
    s = zeroscan.stats(x)
    assert s.max_abs == math.inf and s.std == 0.0
    assert s.norm == pytest.approx(math.sqrt(3) * 1e200, rel=1e-15)
    assert_matches_reference(s, x)


def test_merging_rows_whose_means_are_far_apart() -> None:
    """The distributed merge combines rows as the scans combine partials:
    here two whose means, +-1.5e308, differ by more than the float64 range."""
    parts = [torch.full((5,), 1.5e308, dtype=torch.float64), torch.full((3,), -1.5e308, dtype=torch.float64)]
    rows = torch.stack([zeroscan.stats(p).buffer for p in parts]).unsqueeze(1)  # [W=2, N=1, 16]
    merged = row_from_words(combine_rows(rows)[0].tolist())
    reference = zeroscan.reference_stats(torch.cat(parts))
    assert merged["numel"] == 8 and merged["negative"] == 3
    assert merged["mean"] == pytest.approx(reference["mean"], rel=1e-15)
    assert merged["std"] == math.inf == reference["std"]
