"""zeroscan.stats on the data users have: every value distribution of
zeroscan.testing, every dtype, against the float64 reference.

The sizes put every distribution through each part of the CPU scan: elements
handled one at a time (fewer than one 64-byte vector), whole vectors with a
ragged tail, whole blocks of vectors between counter widenings (8K elements
for 1-byte types), and several chunks (over 64K elements). The strided layout
goes through the gather buffer instead of reading in place.
"""

from __future__ import annotations

import math

import pytest
import torch

import zeroscan
from helpers import ALL_DTYPES, DEVICES, assert_matches_reference, fresh_generator
from zeroscan.testing import distributions_for, make_distribution

SIZES = [5, 64, 1_000, 20_000, 200_003]
CASES = [(dtype, name) for dtype in ALL_DTYPES for name in distributions_for(dtype)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("dtype", "name"), CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_distribution_matches_reference(dtype: torch.dtype, name: str, n: int, layout: str, device: str) -> None:
    g = fresh_generator()
    values = make_distribution(name, 2 * n if layout == "strided" else n, dtype, g).to(device)
    x = values[::2] if layout == "strided" else values
    assert_matches_reference(zeroscan.stats(x), x)


def specials_of(dtype: torch.dtype) -> list[float]:
    """A zero, and where the dtype has them a subnormal, NaN and -inf."""
    if not dtype.is_floating_point:
        return [0.0]
    values = [-0.0, float(torch.finfo(dtype).tiny) / 2, math.nan]
    if dtype != torch.float8_e4m3fn:  # no infinities
        values.append(-math.inf)
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8])
def test_one_special_at_every_lane(dtype: torch.dtype) -> None:
    """One special value at each lane position of a 64-byte vector among
    ordinary values: whichever lane it lands in, it is counted, and it moves
    min |x| / max |x| exactly as the reference says."""
    g = fresh_generator()
    base = make_distribution("randn", 4096, dtype, g)
    for value in specials_of(dtype):
        for lane in range(64 // base.element_size()):
            x = base.clone()
            x[1024 + lane] = value
            assert_matches_reference(zeroscan.stats(x), x)
