"""Counts in words agree in number (zeroscan.words), and so do diagnose's
reasons: "1 of the N values is", "2 of the N values are", "1 NaN", "2 NaNs"."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fresh_generator

import zeroscan
from zeroscan.words import count_noun, is_are, listed


@pytest.mark.parametrize(
    ("n", "singular", "plural", "want"),
    [(0, "NaN", None, "0 NaNs"), (1, "NaN", None, "1 NaN"), (2, "NaN", None, "2 NaNs"),
     (1, "info", "info", "1 info"), (3, "info", "info", "3 info"), (2, "+inf", "+inf", "2 +inf"),
     (1, "tensor", None, "1 tensor"), (122, "tensor", None, "122 tensors")],
)
def test_count_noun(n: int, singular: str, plural: str | None, want: str) -> None:
    assert count_noun(n, singular, plural) == want


@pytest.mark.parametrize(("n", "want"), [(0, "are"), (1, "is"), (2, "are"), (10**9, "are")])
def test_is_are(n: int, want: str) -> None:
    assert is_are(n) == want


@pytest.mark.parametrize("bad", [1.0, "1", True, None])
def test_counts_must_be_ints(bad: object) -> None:
    with pytest.raises(TypeError, match=f"count_noun: n must be an int, got {type(bad).__name__}"):
        count_noun(bad, "NaN")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"is_are: n must be an int, got {type(bad).__name__}"):
        is_are(bad)  # type: ignore[arg-type]


def with_planted(n: int, k: int, value: float, g: torch.Generator) -> torch.Tensor:
    """n random normal values (|x| >= 0.5) with `value` at k random places."""
    x = torch.randn(n, generator=g).abs() + 0.5
    x[torch.randperm(n, generator=g)[:k]] = value
    return x


@pytest.mark.parametrize(
    ("k", "want"),
    [(1, "1 of the {n} values is not finite (1 NaN); everything computed from it is poisoned"),
     (2, "2 of the {n} values are not finite (2 NaNs); everything computed from them is poisoned")],
)
def test_nonfinite_reasons_agree(k: int, want: str) -> None:
    g = fresh_generator()
    n = int(torch.randint(20_000, 40_000, (), generator=g))  # so k of n is below 0.01 %: a count, not a share
    assert zeroscan.diagnose(with_planted(n, k, math.nan, g)).reason == want.format(n=n)


@pytest.mark.parametrize(
    ("x", "want"),
    [(torch.tensor([math.nan]), "the only value is not finite (1 NaN); everything computed from it is poisoned"),
     (torch.tensor([math.inf, -math.inf, math.inf]),
      "all of the 3 values are not finite (2 +inf, 1 -inf); everything computed from them is poisoned"),
     (torch.zeros(1), "the only value is exactly zero"),
     (torch.zeros(3), "all 3 values are exactly zero"),
     (torch.tensor([1.5]), "1 finite value, 0 exactly zero, |x| up to 1.5")],
)
def test_reasons_for_few_values_agree(x: torch.Tensor, want: str) -> None:
    assert zeroscan.diagnose(x).reason == want


@pytest.mark.parametrize("k", [1, 2])
def test_partial_underflow_reason_agrees(k: int) -> None:
    g = fresh_generator()
    n = int(torch.randint(20_000, 40_000, (), generator=g))
    d = zeroscan.diagnose(with_planted(n, k, 1e-40, g), partial_underflow=1e-5)
    verb, them = ("is", "it has") if k == 1 else ("are", "they have")
    assert d.reason.startswith(f"{k} of the {n} nonzero values {verb} subnormal in float32")
    assert f"so {them} lost precision" in d.reason


def test_a_share_that_rounds_to_100_percent_is_a_count() -> None:
    g = fresh_generator()
    n = int(torch.randint(100_000, 200_000, (), generator=g))
    x = torch.zeros(n)
    x[int(torch.randint(0, n, (), generator=g))] = 1.0
    assert zeroscan.diagnose(x).reason == f"{n - 1} of the {n} values are exactly zero (threshold 0.9)"


@pytest.mark.parametrize("n, shown, want", [
    (1, 3, "n0"),
    (3, 3, "n0, n1, n2"),
    (4, 3, "n0, n1, n2 and 1 more"),
    (12, 10, "n0, n1, n2, n3, n4, n5, n6, n7, n8, n9 and 2 more"),
])
def test_listed_names_the_first_and_counts_the_rest(n: int, shown: int, want: str) -> None:
    assert listed([f"n{k}" for k in range(n)], shown) == want
