"""Shared test helpers: devices, dtypes, input makers and the reference check."""

from __future__ import annotations

import math
import os
import random

import torch

import zeroscan

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

FLOAT_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
INT_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES

COUNT_FIELDS = ("numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative", "finite")
EXACT_FLOAT_FIELDS = ("min_abs", "min_abs_nonzero", "max_abs")


def fresh_generator() -> torch.Generator:
    """A generator with a new seed each call (pytest shows the printed seed of
    a failing test; ZEROSCAN_TEST_SEED replays one)."""
    seed = int(os.environ.get("ZEROSCAN_TEST_SEED", random.SystemRandom().randrange(2**63)))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def rtol_for(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-6


def make_values(
    n: int, dtype: torch.dtype, g: torch.Generator, *, specials: bool = True, every: int = 50
) -> torch.Tensor:
    """n random values of `dtype` (CPU), with zeros, subnormals, tiny and
    non-finite values planted (about one of each per `every` values) where the
    dtype can hold them. A large `every` leaves most SIMD blocks free of them,
    so both the fast and the exact path of a kernel are exercised."""
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        hi = min(info.max, 1000)
        lo = max(info.min, -1000)
        return torch.randint(lo, hi + 1, (n,), generator=g).to(dtype)
    scale = float(torch.empty(()).exponential_(generator=g)) * 10 ** float(torch.randint(-2, 3, (), generator=g))
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if specials and n > 0:
        info = torch.finfo(dtype)
        k = max(1, n // every)
        pos = torch.randint(0, n, (6, k), generator=g)
        x[pos[0]] = 0.0
        x[pos[1]] = -0.0
        x[pos[2]] = float(info.tiny) * torch.rand(k, generator=g, dtype=torch.float64)  # subnormal or 0
        x[pos[3]] = float(info.eps) * torch.rand(k, generator=g, dtype=torch.float64)  # near zero
        x[pos[4][: max(1, k // 4)]] = math.nan
        x[pos[5][: max(1, k // 8)]] = math.inf
        x[pos[5][k // 8 : k // 4 + 1]] = -math.inf
    return x.to(dtype)


def close(got: float, want: float, rtol: float, scale: float) -> bool:
    """Relative agreement, with an absolute floor at 1e-12 * scale for values
    that are themselves cancellations (the mean of zero-centred data): a sum
    of n float64 terms is only known to ~sqrt(n) ulps of the data's scale."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return want == got
    return abs(got - want) <= rtol * abs(want) + 1e-12 * scale


def assert_matches_reference(
    s: zeroscan.Stats, x: torch.Tensor, tol: float | None = None, rtol: float | None = None
) -> None:
    want = zeroscan.reference_stats(x.cpu(), tol=tol)
    got = s.to_dict()
    for field in COUNT_FIELDS:
        assert got[field] == want[field], f"{field}: got {got[field]}, want {want[field]}"
    for field in EXACT_FLOAT_FIELDS:
        g, w = got[field], want[field]
        assert (math.isnan(g) and math.isnan(w)) or g == w, f"{field}: got {g!r}, want {w!r}"
    rtol = rtol_for(x.dtype) if rtol is None else rtol
    finite = x.detach().cpu().reshape(-1).to(torch.float64)
    finite = finite[finite.isfinite()]
    scale = float(finite.abs().mean()) if finite.numel() else 0.0
    fields = ("mean", "std", "norm", "sum")
    if finite.numel() and float(finite.abs().max()) < 1e-150:
        # Squares of these float64 values underflow: std and norm lose them
        # in the kernel and in the torch reference alike, differently (README).
        fields = ("mean", "sum")
    for field in fields:
        field_scale = scale * max(1, want["finite"]) if field == "sum" else scale
        assert close(got[field], want[field], rtol, field_scale), (
            f"{field}: got {got[field]!r}, want {want[field]!r} (rtol {rtol})"
        )
