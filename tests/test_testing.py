"""zeroscan.testing: each distribution has the property it is named after,
checked with the float64 reference (not the kernels under test)."""

from __future__ import annotations

import pytest
import torch

import zeroscan
from zeroscan.testing import DISTRIBUTIONS, FRACTION, distributions_for, make_distribution

from helpers import ALL_DTYPES, FLOAT_DTYPES, fresh_generator

N = 50_000
EXACT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # randn has no zeros or subnormals there


def test_names_and_order() -> None:
    assert DISTRIBUTIONS[0] == "randn" and len(set(DISTRIBUTIONS)) == len(DISTRIBUTIONS) == 9
    for dtype in FLOAT_DTYPES:
        assert distributions_for(dtype) == DISTRIBUTIONS
    assert distributions_for(torch.int8) == ("randn", "zeros_50", "zeros_99", "all_zeros", "large_mean")
    assert distributions_for(torch.bool) == ("randn", "zeros_50", "zeros_99", "all_zeros")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_each_distribution_has_its_property(dtype: torch.dtype) -> None:
    g = fresh_generator()
    for name in distributions_for(dtype):
        x = make_distribution(name, N, dtype, g)
        assert x.dtype == dtype and x.shape == (N,) and x.is_contiguous() and x.device.type == "cpu", name
        r = zeroscan.reference_stats(x)
        zero_fraction = r["zeros"] / N
        nonfinite = r["nan"] + r["posinf"] + r["neginf"]
        if name not in ("nonfinite_0.01", "nonfinite_1"):
            assert nonfinite == 0, name
        if name == "randn":
            assert zero_fraction < 0.01, name
            if dtype in EXACT_DTYPES or not dtype.is_floating_point:
                assert r["zeros"] == 0 and r["subnormal"] == 0
        elif name == "zeros_50":
            assert 0.47 < zero_fraction < 0.53
        elif name == "zeros_99":
            assert 0.985 < zero_fraction < 0.995
        elif name == "all_zeros":
            assert r["zeros"] == N
        elif name == "all_subnormal":
            assert r["subnormal"] == N and r["zeros"] == 0
            assert 0.45 * N < r["negative"] < 0.55 * N  # both signs
        elif name == "subnormal_0.1":
            k = round(FRACTION[name] * N)
            assert r["subnormal"] >= k
            if dtype in EXACT_DTYPES:
                assert r["subnormal"] == k
        elif name in ("nonfinite_0.01", "nonfinite_1"):
            k = round(FRACTION[name] * N)
            assert r["nan"] > 0
            if dtype == torch.float8_e4m3fn:
                assert r["posinf"] == r["neginf"] == 0 and r["nan"] == k
            else:
                assert r["posinf"] > 0 and r["neginf"] > 0 and nonfinite == k
        elif name == "large_mean":
            assert r["std"] > 0 and abs(r["mean"]) > 5 * r["std"]
            if dtype in (torch.float32, torch.float64):
                assert abs(r["mean"] - 1000) < 1e-3 and abs(r["std"] - 1e-3) < 1e-4
        else:
            raise AssertionError(f"untested distribution {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=str)
def test_small_tensors_still_hold_their_specials(dtype: torch.dtype) -> None:
    g = fresh_generator()
    r = zeroscan.reference_stats(make_distribution("nonfinite_0.01", 1024, dtype, g))
    assert r["nan"] > 0 and (dtype == torch.float8_e4m3fn or (r["posinf"] > 0 and r["neginf"] > 0))
    assert zeroscan.reference_stats(make_distribution("subnormal_0.1", 1024, dtype, g))["subnormal"] >= 1
    for name in distributions_for(dtype):
        assert make_distribution(name, 0, dtype, g).shape == (0,)


def test_same_seed_same_tensor() -> None:
    for name in DISTRIBUTIONS:
        a = make_distribution(name, 4096, torch.bfloat16, torch.Generator().manual_seed(7))
        b = make_distribution(name, 4096, torch.bfloat16, torch.Generator().manual_seed(7))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_errors_name_the_argument_and_value() -> None:
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"name .*'gaussian'"):
        make_distribution("gaussian", 10, torch.float32, g)
    with pytest.raises(ValueError, match=r"name 'all_subnormal' does not exist for dtype torch.int8"):
        make_distribution("all_subnormal", 10, torch.int8, g)
    with pytest.raises(ValueError, match=r"name 'large_mean' does not exist for dtype torch.bool"):
        make_distribution("large_mean", 10, torch.bool, g)
    with pytest.raises(ValueError, match=r"n must .*-1"):
        make_distribution("randn", -1, torch.float32, g)
    with pytest.raises(ValueError, match=r"dtype .*torch.complex64"):
        distributions_for(torch.complex64)


def test_randn_replaces_the_zero_torch_randn_draws() -> None:
    # torch.randn drew an exact 0.0 among these 50,000 float32 values (its
    # Box-Muller radius was 0); the distribution promises none.
    g = torch.Generator().manual_seed(8928464073463674640)
    raw = torch.randn(N, generator=g)
    assert int((raw == 0).sum()) == 1
    g = torch.Generator().manual_seed(8928464073463674640)
    x = make_distribution("randn", N, torch.float32, g)
    assert int((x == 0).sum()) == 0
    assert torch.equal(x[raw != 0], raw[raw != 0])
