"""Property-based: any list of values (NaN, inf, subnormals included) in any
float dtype agrees with the reference, and so does any tol."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zeroscan
from helpers import FLOAT_DTYPES, assert_matches_reference


def squares_representable(v: float) -> bool:
    """float64 moments, like torch.std's, lose values whose square underflows
    (|x| < ~1e-154) or overflows (|x| > ~1e154); those are left out."""
    return v == 0 or math.isnan(v) or math.isinf(v) or 1e-150 < abs(v) < 1e150


values = st.lists(
    st.one_of(
        # Beyond ~1e150 the float64 second moment overflows (as torch.std's does).
        st.floats(min_value=-1e150, max_value=1e150),
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.floats(min_value=-1e-37, max_value=1e-37),  # float32 subnormals
        st.floats(min_value=-1e-4, max_value=1e-4),
        st.sampled_from([0.0, -0.0, 1000.0, -1000.0]),
    ).filter(squares_representable),
    max_size=3000,
)


@settings(max_examples=150, deadline=None)
@given(data=values, dtype=st.sampled_from(FLOAT_DTYPES), step=st.integers(1, 3))
def test_any_values(data: list[float], dtype: torch.dtype, step: int) -> None:
    x = torch.tensor(data, dtype=torch.float64).to(dtype)[::step]
    assert_matches_reference(zeroscan.stats(x), x, rtol=1e-6 if dtype != torch.float64 else 1e-9)


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.floats(-10, 10).filter(squares_representable), min_size=1, max_size=500),
    tol=st.one_of(st.floats(0, 20), st.just(0.0), st.just(math.inf)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_any_tol(data: list[float], tol: float, dtype: torch.dtype) -> None:
    x = torch.tensor(data, dtype=torch.float64).to(dtype)
    assert_matches_reference(zeroscan.stats(x, tol=tol), x, tol=tol)


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=2000), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_any_integers(data: list[int], dtype: torch.dtype) -> None:
    x = torch.tensor(data, dtype=dtype)
    assert_matches_reference(zeroscan.stats(x), x, rtol=1e-9)
