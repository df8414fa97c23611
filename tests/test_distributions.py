"""zeroscan.stats on the data users have: every value distribution of
zeroscan.testing, every dtype, against the float64 reference.

The sizes put every distribution through each part of the CPU scan: elements
handled one at a time (fewer than one 64-byte vector), whole vectors with a
ragged tail, whole blocks of vectors between counter widenings (8K elements
for 1-byte types), and several chunks (over 64K elements). The strided layout
goes through the gather buffer instead of reading in place.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import zeroscan
from checklist import Checklist
from helpers import ALL_DTYPES, DEVICES, assert_matches_reference, fresh_generator
from zeroscan.testing import distributions_for, make_distribution

SIZES = [5, 64, 1_000, 20_000, 200_003]
CASES = [(dtype, name) for dtype in ALL_DTYPES for name in distributions_for(dtype)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "name"), CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_distribution_matches_reference(dtype: torch.dtype, name: str, device: str) -> None:
    """Every size, contiguous and strided, in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for layout in ["contiguous", "strided"]:
            for n in SIZES:
                with checks.case(f"{layout} n={n}"):
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


# Scales within each dtype's range, far apart: float32 and bfloat16 square
# their runs in float32 scaled by a power of two picked from the run before,
# so a jump beyond 2^40 has to be caught and squared again.
JUMPS = {
    torch.float32: [1e-30, 1e20, 1.0, 1e-40, 1e30, 1e-3],
    torch.bfloat16: [1e-30, 1e20, 1.0, 1e-39, 1e30, 1e-3],
    torch.float16: [1e-6, 1e4, 1.0, 1e-7, 1e-2],
    torch.float8_e4m3fn: [0.01, 200.0, 1.0, 0.002],
}


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", list(JUMPS))
def test_magnitude_jumps_between_runs(dtype: torch.dtype, layout: str) -> None:
    """Blocks of 300 values (longer than a run, not aligned to one), each at
    one of the dtype's extreme scales in turn: every moment still matches."""
    g = fresh_generator()
    scales = torch.tensor(JUMPS[dtype], dtype=torch.float64)
    n = 60_000
    block = torch.arange(n) // 300 % len(scales)
    values = (torch.randn(n, generator=g, dtype=torch.float64) * scales[block]).to(dtype)
    x = torch.stack([values, values], 1).reshape(-1)[::2] if layout == "strided" else values
    assert_matches_reference(zeroscan.stats(x), x)


# An offset and a spread each dtype resolves, the offset far above the spread.
OFFSETS = {
    torch.float32: (1000.0, 1e-3),
    torch.bfloat16: (100.0, 2.0),
    torch.float16: (100.0, 0.1),
    torch.float8_e4m3fn: (100.0, 10.0),
    torch.float64: (1000.0, 1e-6),
}


@pytest.mark.parametrize("prefix", [0.0, math.nan])
@pytest.mark.parametrize("dtype", list(OFFSETS))
def test_first_values_unlike_the_rest(dtype: torch.dtype, prefix: float) -> None:
    """Zeros (a padding row) or NaN (a poisoned row) before offset data: a
    chunk's shift comes from its first finite values, here far from its mean
    or none at all, so the shifted sums would cancel; the variance must
    still be right to 1e-6."""
    g = fresh_generator()
    offset, spread = OFFSETS[dtype]
    x = (offset + spread * torch.randn(200_003, generator=g, dtype=torch.float64)).to(dtype)
    x[:100] = prefix
    assert_matches_reference(zeroscan.stats(x), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_largest_values_cancelling(dtype: torch.dtype) -> None:
    """Values between half the dtype's largest and the largest, in blocks of
    1000 of one sign (so that partial sums grow as large as they can), among
    ordinary and tiny ones whose low bits a rounded partial sum would lose;
    then the same values negated, in another order. The sum is exactly 0 and
    the mean is held to 1e-12 of mean |x|, so any rounding in summing the
    values beyond float64's own shows."""
    g = fresh_generator()
    n = 100_001
    largest = float(torch.finfo(dtype).max)
    magnitudes = largest * (0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64))
    signs = 1.0 - 2.0 * (torch.arange(n) // 1000 % 2).to(torch.float64)
    values = magnitudes * signs
    values[::7] = torch.randn(len(values[::7]), generator=g, dtype=torch.float64)
    values[3::7] = float(torch.finfo(dtype).eps) * torch.randn(len(values[3::7]), generator=g, dtype=torch.float64)
    x = torch.cat([values, -values.roll(17)]).to(dtype)  # rounding is symmetric in sign
    assert_matches_reference(zeroscan.stats(x), x)


@pytest.mark.parametrize("name", ["all_subnormal", "subnormal_0.1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_subnormals_under_flush_denormal(dtype: torch.dtype, name: str) -> None:
    """torch.set_flush_denormal(True) makes the CPU read subnormal inputs as
    zero; the scan of an underflowed gradient must still find its true
    min |x|, mean and std. The result row is decoded, and the reference
    taken, with the mode off: Python's own float arithmetic would flush too
    (a float64 `sum` is mean * n in Python, and such data's mean is
    subnormal)."""
    g = fresh_generator()
    x = make_distribution(name, 200_003, dtype, g)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        got = zeroscan.stats(x)  # scanned now, decoded at the first read
    finally:
        torch.set_flush_denormal(False)
    assert_matches_reference(got, x)


FLUSH_FIRST = """
import json, sys, torch, zeroscan
from zeroscan.testing import make_distribution
torch.set_flush_denormal(True)  # before the thread pool exists: its threads inherit the mode
x = make_distribution("all_subnormal", 1 << 22, torch.float32, torch.Generator().manual_seed(int(sys.argv[1])))
s = zeroscan.stats(x)
torch.set_flush_denormal(False)
print(json.dumps(s.to_dict()))
"""


def test_subnormals_when_every_thread_flushes() -> None:
    """Threads made after torch.set_flush_denormal(True) start in that mode;
    a 4M-element scan, split over them, must still see every subnormal."""
    seed = int(torch.randint(0, 2**31, (1,), generator=fresh_generator()))
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-denormal mode")
    result = subprocess.run([sys.executable, "-c", FLUSH_FIRST, str(seed)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout)
    x = make_distribution("all_subnormal", 1 << 22, torch.float32, torch.Generator().manual_seed(seed))
    assert_matches_reference(got, x)
