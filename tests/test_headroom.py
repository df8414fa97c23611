"""fp8/fp4 headroom (zeroscan.headroom) against explicit casts of the scaled tensor.

The references here never use the module's class boundaries: fp8 counts come
from torch's float8 casts, e2m1 counts from a float64 round-to-nearest-even
quantizer onto the e2m1 grid (checked against torch's fp8 casts first).
"""

from __future__ import annotations

import math

import pytest
import torch

import zeroscan
from zeroscan.headroom import FORMATS, Bound, Headroom, headroom, headroom_of, mx_headroom
from zeroscan.histogram import reference_histogram

from helpers import fresh_generator

TARGETS = ("e4m3", "e5m2", "e2m1")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Written out here rather than read from the module: (mantissa bits, min normal exponent, max).
GRID = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0), "e2m1": (1, 0, 6.0)}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
SOURCES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def min_normal(target: str) -> float:
    return math.ldexp(1.0, GRID[target][1])


def min_sub(target: str) -> float:
    return math.ldexp(1.0, GRID[target][1] - GRID[target][0])


def fmt_max(target: str) -> float:
    return GRID[target][2]


# ---------------------------------------------------------------- references


def round_grid(v: torch.Tensor, target: str) -> torch.Tensor:
    """|v| (float64, >= 0) rounded to nearest even onto the target's grid,
    extended above its max (no saturation): the step is the ulp of v's
    binade, never below the subnormal spacing."""
    man_bits, min_exp, _ = GRID[target]
    _, e = torch.frexp(v)  # v = m 2^e, 0.5 <= m < 1
    step = torch.pow(2.0, (torch.clamp(e.to(torch.int64) - 1, min=min_exp) - man_bits).to(torch.float64))
    return torch.round(v / step) * step  # torch.round: half to even


def round_to_odd_f32(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounding to odd. torch casts float64 to float8 through
    float32 (double rounding, see test_torch_float8_cast_semantics); rounding
    to odd first makes that one correct rounding of the float64 value."""
    f = v.to(torch.float32)
    f = torch.where(f.double().abs() > v.abs(), torch.nextafter(f, torch.zeros_like(f)), f)  # towards zero
    odd = (f.view(torch.int32) | 1).view(torch.float32)
    return torch.where(f.double() != v, odd, f)


def satfinite_cast(v: torch.Tensor, target: str) -> torch.Tensor:
    """|v| (float64, >= 0) through the saturating cast, back as float64."""
    top = fmt_max(target)
    if target in FP8:  # clamped: e5m2 overflows to inf
        return round_to_odd_f32(v.clamp(max=top)).to(FP8[target]).to(torch.float64)
    return round_grid(v, target).clamp(max=top)


def saturates(v: torch.Tensor, target: str) -> torch.Tensor:
    """Whether |v| rounds (unbounded) above max. For fp8 by torch's cast of
    v/2: halving keeps v's rounding grid near max, and clamps nothing that
    would not saturate anyway."""
    top = fmt_max(target)
    if target in FP8:
        return 2 * satfinite_cast(v / 2, target) > top
    return round_grid(v, target) > top


def reference_counts(x: torch.Tensor, s: float, target: str) -> dict[str, int]:
    """The counts of the satfinite cast of x*s (float64 product) to target."""
    v = x.detach().reshape(-1).to(torch.float64)
    return classify(v, (v * s).abs(), target)


def classify(v: torch.Tensor, scaled: torch.Tensor, target: str) -> dict[str, int]:
    finite = v.isfinite()
    live = finite & (v != 0)
    m = scaled[live]
    q = satfinite_cast(m, target)
    return {
        "total": v.numel(),
        "zeros": int((v == 0).sum()),
        "nonfinite": int((~finite).sum()),
        "to_zero": int((q == 0).sum()),
        "to_subnormal": int(((q > 0) & (q < min_normal(target))).sum()),
        "saturated": int(saturates(m, target).sum()),
    }


def mx_reference(x: torch.Tensor, target: str, block: int) -> dict[str, int]:
    """OCP MX: per block of the last dimension (zero padded), X = 2^(floor(log2
    amax) - emax) clamped to E8M0's exponents, amax over finite values."""
    last = x.shape[-1] if x.dim() else 1
    v = x.detach().to(torch.float64).reshape(-1, last)
    pad, rows = -last % block, v.shape[0]
    v = torch.cat([v, torch.zeros(v.shape[0], pad, dtype=torch.float64)], dim=1).reshape(-1, block)
    mag = torch.where(v.isfinite(), v.abs(), 0.0)
    amax = mag.max(dim=1).values
    e = torch.floor(torch.log2(amax.clamp(min=1e-300)))
    e = e - (torch.exp2(e) > amax).double() + (torch.exp2(e + 1) <= amax).double()  # log2 rounding
    shared = torch.where(amax > 0, e - EMAX[target], 0.0).clamp(-127, 127)
    scaled = mag / torch.exp2(shared)[:, None]
    counts = classify(v.reshape(-1), scaled.reshape(-1), target)
    counts["total"] = x.numel()
    counts["zeros"] -= pad * rows  # the padding
    return counts


def assert_within(h: Headroom, want: dict[str, int]) -> None:
    for name in ("total", "zeros", "nonfinite"):
        assert getattr(h, name) == want[name], f"{name}: got {getattr(h, name)}, want {want[name]}"
    for name in ("to_zero", "to_subnormal", "saturated"):
        low, high = getattr(h, name)
        assert low <= want[name] <= high, f"{name}: reference {want[name]} outside [{low}, {high}]"


def assert_exact(h: Headroom, want: dict[str, int]) -> None:
    assert_within(h, want)
    for name in ("to_zero", "to_subnormal", "saturated"):
        assert getattr(h, name) == Bound(want[name], want[name]), f"{name}: {getattr(h, name)} is not exact"


def finite_amax(x: torch.Tensor) -> float:
    v = x.detach().to(torch.float64)
    return float(torch.where(v.isfinite(), v.abs(), 0.0).max())


# ---------------------------------------------------------------- data


def make_data(kind: str, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "tiny":
        x *= 1e-6
    elif kind == "heavy":
        x = x.sign() * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 6)
    elif kind == "half_zeros":
        x[torch.rand(n, generator=g) < 0.5] = 0.0
    elif kind == "power5":
        x = x**5
    k = max(1, n // 100)
    pos = torch.randint(0, n, (4, k), generator=g)
    x[pos[0]] = float(torch.finfo(dtype).tiny) * torch.rand(k, generator=g, dtype=torch.float64)  # source subnormals
    x[pos[1, : k // 2 + 1]] = math.nan
    x[pos[2, : k // 3 + 1]] = math.inf
    x[pos[3, : k // 3 + 1]] = -math.inf
    return x.to(dtype)


# ---------------------------------------------------------------- the casts themselves


def test_torch_float8_cast_semantics() -> None:
    """What torch 2.13's CPU casts do, which the references above rely on."""
    e4m3 = torch.tensor([464.0, 464.5, 1e9, math.inf, 2.0**-10, 3 * 2.0**-11], dtype=torch.float64)
    assert e4m3.to(torch.float8_e4m3fn).double().tolist() == [448.0, 448.0, 448.0, 448.0, 0.0, 2.0**-9]
    e5m2 = torch.tensor([61439.0, 61440.0, 2.0**-17, 2.0**-17 * 1.5], dtype=torch.float64)
    assert e5m2.to(torch.float8_e5m2).double().tolist() == [57344.0, math.inf, 0.0, 2.0**-16]
    # float64 goes through float32 first: 2^-10 (1 + 2^-40) becomes the tie 2^-10, then 0.
    assert torch.tensor([2.0**-10 * (1 + 2.0**-40)], dtype=torch.float64).to(torch.float8_e4m3fn).item() == 0.0
    assert satfinite_cast(torch.tensor([2.0**-10 * (1 + 2.0**-40)], dtype=torch.float64), "e4m3").item() == 2.0**-9


@pytest.mark.parametrize("target", ["e4m3", "e5m2"])
def test_round_grid_matches_torch_float8(target: str) -> None:
    """The float64 quantizer that stands for e2m1 agrees with torch's float8 casts."""
    g = fresh_generator()
    lo, hi = math.log2(min_sub(target)) - 3, math.log2(fmt_max(target))
    v = torch.exp2(lo + (hi - lo) * torch.rand(20000, generator=g, dtype=torch.float64)).to(torch.float32).double()
    ties = torch.tensor([min_sub(target) * k / 2 for k in range(1, 40)], dtype=torch.float64)
    v = torch.cat([v, ties])
    assert torch.equal(round_grid(v, target), v.to(FP8[target]).double())


def test_formats_table() -> None:
    for name, dtype in FP8.items():
        fmt, info = FORMATS[name], torch.finfo(dtype)
        smallest = torch.tensor([1], dtype=torch.uint8).view(dtype).double().item()
        assert (fmt.max_finite, fmt.min_normal, fmt.min_subnormal) == (info.max, info.smallest_normal, smallest)
        assert fmt.max_exponent == EMAX[name]
    e2m1 = FORMATS["e2m1"]
    grid = sorted(
        m * e2m1.min_subnormal if e == 0 else (1 + m / 2**e2m1.man_bits) * 2.0 ** (e - e2m1.bias)
        for e in range(2**e2m1.exp_bits)
        for m in range(2**e2m1.man_bits)
    )
    assert grid == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert (e2m1.max_finite, e2m1.min_normal, e2m1.max_exponent) == (6.0, 1.0, 2)


# Planted at the rounding boundaries: (|x|, the class of its satfinite cast).
PLANTED = {
    "e4m3": [
        (2.0**-10, "to_zero"),  # min_sub / 2 ties to even: 0
        (2.0**-10 * (1 + 2.0**-20), "to_subnormal"),
        (2.0**-9, "to_subnormal"),
        (2.0**-6 - 2.0**-10, "normal"),  # ties to min normal
        (2.0**-6 - 2.0**-10 - 2.0**-30, "to_subnormal"),
        (2.0**-6, "normal"),
        (448.0, "normal"),
        (464.0, "normal"),  # max + half ulp ties to even: 448 (1.110b)
        (464.0 + 2.0**-10, "saturated"),
        (2.0**9 * (1 - 2.0**-20), "saturated"),
    ],
    "e5m2": [
        (2.0**-17, "to_zero"),
        (2.0**-17 * (1 + 2.0**-20), "to_subnormal"),
        (2.0**-14 - 2.0**-17, "normal"),
        (2.0**-14 - 2.0**-17 - 2.0**-38, "to_subnormal"),
        (57344.0, "normal"),
        (61440.0 - 2.0**-8, "normal"),
        (61440.0, "saturated"),  # max + half ulp ties to even: 65536 (1.11b is odd)
    ],
    "e2m1": [
        (0.25, "to_zero"),
        (0.25 + 2.0**-20, "to_subnormal"),
        (0.5, "to_subnormal"),
        (0.75 - 2.0**-20, "to_subnormal"),
        (0.75, "normal"),
        (5.0, "normal"),
        (6.0, "normal"),
        (7.0 - 2.0**-20, "normal"),
        (7.0, "saturated"),  # ties to even: 8
        (7.5, "saturated"),
    ],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("target", TARGETS)
def test_planted_boundary_values(target: str, dtype: torch.dtype) -> None:
    """Each boundary value rounds as written (reference), and headroom of the
    one value with its amax places it exactly, scaled by 2^k."""
    k = int(torch.randint(-20, 21, (), generator=fresh_generator()))
    for value, want in PLANTED[target]:
        x = torch.tensor([value * 2.0**-k, -math.inf], dtype=torch.float64).to(dtype)
        assert x[0].item() == value * 2.0**-k, "planted values are float32 numbers"
        ref = reference_counts(x, 2.0**k, target)
        expected = {name: int(name == want) for name in ("to_zero", "to_subnormal", "saturated")}
        assert {name: ref[name] for name in expected} == expected, f"reference: {value!r} is not {want}"
        h = headroom(reference_histogram(x), target, scale=2.0**k, amax=value * 2.0**-k)
        assert_exact(h, ref)
        assert h.nonfinite == 1


# ---------------------------------------------------------------- headroom from the histogram


def scale_for(scaling: str, target: str, amax: float, g: torch.Generator) -> dict[str, object]:
    if scaling == "pow2":  # an explicit power of two around the amax one, often saturating
        k = math.floor(math.log2(fmt_max(target) / amax)) + int(torch.randint(-3, 4, (), generator=g))
        return {"scaling": "none", "scale": 2.0**k}
    return {"scaling": scaling}


@pytest.mark.parametrize("kind", ["randn", "tiny", "heavy", "half_zeros", "power5"])
@pytest.mark.parametrize("scaling", ["amax", "amax_pow2", "pow2"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", SOURCES)
def test_bounds_hold_reference(dtype: torch.dtype, target: str, scaling: str, kind: str) -> None:
    g = fresh_generator()
    x = make_data(kind, 3000, dtype, g)
    amax = finite_amax(x)
    h = headroom(reference_histogram(x), target, amax=amax, **scale_for(scaling, target, amax, g))
    ref = reference_counts(x, h.scale, target)
    assert_within(h, ref)
    if scaling != "pow2":
        assert h.saturated == Bound(0, 0)  # the amax lands at or below max
    if scaling == "amax":
        assert h.scale == fmt_max(target) / amax
        assert_straddlers_bound_spread(h, x, target)
        return
    # A power-of-two scale leaves only the target binades [m/2, m), [n/2, n)
    # and [2^emax, 2^(emax+1)), and the source subnormals, undecided.
    assert math.frexp(h.scale)[0] == 0.5
    v = x.double()
    live = v.isfinite() & (v != 0)
    m = (v[live] * h.scale).abs()

    def within(lo: float, hi: float) -> int:
        return int(((m >= lo) & (m < hi)).sum())

    tiny = float(torch.finfo(dtype).tiny)

    def source_subnormals_above(threshold: float) -> int:  # their bin's image (0, tiny s) reaches past threshold
        return int((v[live].abs() < tiny).sum()) if tiny * h.scale > threshold else 0

    src_sub = source_subnormals_above(min_sub(target) / 2)
    below_sub = within(min_sub(target) / 2, min_sub(target))
    below_normal = within(min_normal(target) / 2, min_normal(target))
    top = within(2.0 ** EMAX[target], 2.0 ** (EMAX[target] + 1))
    spread = {name: getattr(h, name).high - getattr(h, name).low for name in ("to_zero", "to_subnormal", "saturated")}
    assert spread["to_zero"] <= below_sub + src_sub
    assert spread["to_subnormal"] <= below_sub + below_normal + src_sub
    assert spread["saturated"] <= top + source_subnormals_above(fmt_max(target))


def assert_straddlers_bound_spread(h: Headroom, x: torch.Tensor, target: str) -> None:
    """Any scale: no count is looser than the values whose source binade's
    image [2^e s, 2^(e+1) s] (source subnormals: [0, tiny s]) holds a
    rounding boundary."""
    v = x.detach().reshape(-1).double()
    a = v[v.isfinite() & (v != 0)].abs()
    tiny = float(torch.finfo(x.dtype).tiny)
    _, e = torch.frexp(a)
    lo = torch.where(a < tiny, 0.0, torch.exp2(e.double() - 1) * h.scale)
    hi = torch.where(a < tiny, tiny * h.scale, torch.exp2(e.double()) * h.scale)
    top = fmt_max(target) + 2.0 ** (EMAX[target] - GRID[target][0] - 1)
    straddles = torch.zeros_like(a, dtype=torch.bool)
    for b in (min_sub(target) / 2, min_normal(target) - min_sub(target) / 2, top):
        straddles |= (lo <= b) & (b <= hi)
    for name in ("to_zero", "to_subnormal", "saturated"):
        low, high = getattr(h, name)
        n = int(straddles.sum())
        assert high - low <= n, f"{name}: [{low}, {high}] looser than its {n} straddling values"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", SOURCES)
def test_exact_away_from_boundary_binades(dtype: torch.dtype, target: str) -> None:
    """Power-of-two scale, no value in a boundary binade: every count exact."""
    g = fresh_generator()
    sub_e, normal_e, top_e = math.log2(min_sub(target)), math.log2(min_normal(target)), EMAX[target]
    boundary = {sub_e - 1, normal_e - 1, top_e}
    info = torch.finfo(dtype)
    src_lo, src_hi = math.frexp(info.tiny)[1] - 1, math.frexp(info.max)[1] - 2

    def binades_for(k: int) -> list[int]:  # target binades away from the boundaries that x * 2^-k can hold
        return [t for t in range(int(sub_e) - 4, top_e + 4) if t not in boundary and src_lo <= t - k <= src_hi]

    def lossy_classes(k: int) -> int:  # of flush, subnormal, saturate: float16 cannot span all three for e5m2
        ts = binades_for(k)
        return any(t < sub_e - 1 for t in ts) + any(sub_e <= t < normal_e - 1 for t in ts) + any(t > top_e for t in ts)

    centre = int((sub_e + top_e) // 2 - (src_lo + src_hi) // 2)
    ks = [k for k in range(centre - 8, centre + 9) if lossy_classes(k) >= 2]
    k = ks[int(torch.randint(0, len(ks), (), generator=g))]
    binades = binades_for(k)
    n = 4000
    exps = torch.tensor(binades, dtype=torch.float64)[torch.randint(0, len(binades), (n,), generator=g)]
    mantissa = 1 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)  # cannot round up into the next binade
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * mantissa * torch.exp2(exps - k)
    x[:40] = 0.0
    x[40:45] = math.nan
    x[45:50] = math.inf
    x = x.to(dtype)
    ref = reference_counts(x, 2.0**k, target)
    classes = sum(ref[name] > 0 for name in ("to_zero", "to_subnormal", "saturated"))
    assert classes >= 2, f"too few classes in the data: {ref}"
    assert_exact(headroom(reference_histogram(x), target, scale=2.0**k), ref)
    assert_exact(headroom(reference_histogram(x), target, scale=2.0**k, amax=finite_amax(x)), ref)


@pytest.mark.parametrize("target", TARGETS)
def test_top_binade_is_bounded_not_guessed(target: str) -> None:
    """A top binade holding both saturating and clamped-down values: the
    bound is its whole count, and moves with neither."""
    g = fresh_generator()
    top, ulp_half = fmt_max(target), 2.0 ** (EMAX[target] - GRID[target][0] - 1)
    below = top + ulp_half * torch.rand(50, generator=g, dtype=torch.float64) * 0.99  # rounds to max
    above = top + ulp_half * (1.01 + 0.98 * torch.rand(30, generator=g, dtype=torch.float64))  # saturates, < 2^(emax+1)
    x = torch.cat([below, above, torch.ones(20, dtype=torch.float64)])
    h = headroom(reference_histogram(x), target, scale=1.0)
    ref = reference_counts(x, 1.0, target)
    assert ref["saturated"] == 30
    assert h.saturated == Bound(0, 80)
    h = headroom(reference_histogram(x), target, scale=1.0, amax=finite_amax(x))
    assert h.saturated == Bound(1, 80)  # the amax itself saturates


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("boundary", ["below_normal", "saturation"])
def test_image_ending_at_a_boundary_is_decided(target: str, boundary: str) -> None:
    """A non-power-of-two s with 2 s exactly at a rounding boundary: x in [1, 2)
    never reaches it (the float64 product of the largest x below 2 rounds
    down), so the binade is decided wholly on the lower side."""
    top = fmt_max(target) + 2.0 ** (EMAX[target] - GRID[target][0] - 1)
    edge = {"below_normal": min_normal(target) - min_sub(target) / 2, "saturation": top}[boundary]
    s = edge / 2
    assert math.frexp(s)[0] != 0.5
    g = fresh_generator()
    largest = torch.tensor([2 - 2.0**-52, 1.0], dtype=torch.float64)
    x = torch.cat([1 + torch.rand(500, generator=g, dtype=torch.float64), largest])
    assert float((x.max() * s)) < edge
    h = headroom(reference_histogram(x), target, scale=s)
    want = reference_counts(x, s, target)
    assert_exact(h, want)
    if boundary == "below_normal":  # [edge/2, edge): every value a subnormal
        assert want["to_subnormal"] == len(x)
    else:
        assert want["saturated"] == 0


def test_integer_source() -> None:
    g = fresh_generator()
    x = torch.randint(-5000, 5000, (500,), generator=g, dtype=torch.int32)
    for target in TARGETS:
        h = headroom(reference_histogram(x), target, scaling="amax_pow2", amax=finite_amax(x))
        assert_within(h, reference_counts(x, h.scale, target))


def test_headroom_of_uses_stats_and_finite_amax() -> None:
    g = fresh_generator()
    x = make_data("heavy", 2000, torch.float32, g)
    x[0] = math.inf
    amax = finite_amax(x)
    for target in TARGETS:
        for scaling in ("amax", "amax_pow2"):
            h = headroom_of(x, target, scaling=scaling)
            assert h == headroom(reference_histogram(x), target, scaling=scaling, amax=amax)
            assert_within(h, reference_counts(x, h.scale, target))
    y = torch.where(x.isfinite(), x, 1.0)  # no Inf: stats' max_abs is the amax
    assert headroom_of(y, "e4m3").scale == 448.0 / zeroscan.stats(y).max_abs
    assert headroom_of(y, "e4m3", scale=4.0) == headroom(reference_histogram(y), "e4m3", scale=4.0, amax=amax)


# headroom_of's ways of choosing the scale: keyword arguments and the scaling they report.
HEADROOM_OF_SCALINGS = {
    "default": ({}, "amax"),
    "amax": ({"scaling": "amax"}, "amax"),
    "amax_pow2": ({"scaling": "amax_pow2"}, "amax_pow2"),
    "none": ({"scaling": "none"}, "none"),
    "scale": ({"scale": 4.0}, "none"),
}


def nothing_to_scale(kind: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A tensor without a nonzero finite value (so its amax is 0): all zero of
    either sign (a fresh LoRA B), empty, all NaN, all +-Inf, or zeros and NaN/Inf."""
    n = int(torch.randint(1, 200, (), generator=g))
    if kind == "empty":
        return torch.empty(0, n, dtype=dtype)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    special = {"all_zeros": 0.0, "all_nan": math.nan, "all_inf": math.inf, "zeros_inf": math.inf,
               "zeros_nan": math.nan}[kind]
    x = sign * 0.0
    picked = torch.rand(n, generator=g) < 0.3 if kind.startswith("zeros_") else torch.ones(n, dtype=torch.bool)
    picked[0] = True
    x[picked] = sign[picked] * special
    return x.to(dtype)


@pytest.mark.parametrize("kind", ["all_zeros", "empty", "all_nan", "zeros_inf", "zeros_nan", "all_inf"])
@pytest.mark.parametrize("scaling", list(HEADROOM_OF_SCALINGS))
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", SOURCES)
def test_headroom_of_with_nothing_to_scale(dtype: torch.dtype, target: str, scaling: str, kind: str) -> None:
    """No nonzero finite value: every scaling counts the zeros and the NaN/Inf
    as the float64 reference does, and nothing flushed or saturated."""
    x = nothing_to_scale(kind, dtype, fresh_generator())
    kwargs, reported = HEADROOM_OF_SCALINGS[scaling]
    h = headroom_of(x, target, **kwargs)  # type: ignore[arg-type]
    assert (h.scaling, h.scale) == (reported, kwargs.get("scale", 1.0))
    assert_exact(h, reference_counts(x, h.scale, target))
    assert h.fraction("to_zero") == (0.0, 0.0)


@pytest.mark.parametrize("kind", ["randn", "half_zeros"])
@pytest.mark.parametrize("scaling", list(HEADROOM_OF_SCALINGS))
@pytest.mark.parametrize("target", TARGETS)
def test_headroom_of_ordinary_tensors(target: str, scaling: str, kind: str) -> None:
    """A tensor with nonzero finite values: headroom_of is headroom() with its finite amax."""
    x = make_data(kind, 1000, torch.float32, fresh_generator())
    kwargs, reported = HEADROOM_OF_SCALINGS[scaling]
    h = headroom_of(x, target, **kwargs)  # type: ignore[arg-type]
    assert h == headroom(reference_histogram(x), target, amax=finite_amax(x), **kwargs)  # type: ignore[arg-type]
    assert h.scaling == reported
    assert_within(h, reference_counts(x, h.scale, target))


def test_result_forms() -> None:
    x = torch.tensor([0.0, 2.0**-20, 1.0, 2.0**-8, math.nan] + [1.5] * 95, dtype=torch.float32)
    h = headroom(reference_histogram(x), "e4m3", scale=1.0)
    assert (h.total, h.zeros, h.nonfinite, h.to_zero, h.to_subnormal, h.saturated) == (
        100, 1, 1, Bound(1, 1), Bound(1, 1), Bound(0, 0)
    )
    assert h.exact and h.fraction("to_zero") == (0.01, 0.01)
    assert str(h) == "e4m3 none scale 1: 1% flush to zero (exact), 1% subnormal (exact), 0 saturate, 1 nonfinite"
    d = h.to_dict()
    assert d["to_zero"] == [1, 1] and d["to_subnormal_fraction"] == [0.01, 0.01] and d["exact"] is True
    b = headroom(reference_histogram(torch.tensor([2.0**-10, 1.0])), "e4m3", scale=1.0)
    assert b.to_zero == Bound(0, 1) and not b.exact and "0–50% flush to zero" in str(b)
    assert str(mx_headroom(x, "e2m1")).startswith("e2m1 mx block 32: ")


# ---------------------------------------------------------------- MX


@pytest.mark.parametrize("block", [32, 7])
@pytest.mark.parametrize("kind", ["randn", "heavy", "tiny", "half_zeros"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mx_matches_reference(dtype: torch.dtype, target: str, kind: str, block: int) -> None:
    g = fresh_generator()
    x = make_data(kind, 30 * 100, dtype, g).reshape(30, 100)  # 100 = 3 * 32 + 4: padded
    h = mx_headroom(x, target, block=block)
    assert h.block == block and h.scaling == "mx" and math.isnan(h.scale)
    assert_exact(h, mx_reference(x, target, block))


def test_mx_by_hand() -> None:
    x = torch.tensor(
        [
            [1.0, 2.0**-18, 2.0**-17, 1.9375],  # X = 2^-8: 256, 2^-10 -> 0, 2^-9 sub, 496 saturates
            [0.0, 0.0, -0.0, 0.0],  # amax 0: X = 1
            [math.nan, math.inf, 3.0, 2.0**-20],  # X from 3.0 = 2^-7: 384, 2^-13 -> 0
        ]
    )
    h = mx_headroom(x.reshape(-1), "e4m3", block=4)
    assert (h.total, h.zeros, h.nonfinite) == (12, 4, 2)
    assert (h.to_zero, h.to_subnormal, h.saturated) == (Bound(2, 2), Bound(1, 1), Bound(1, 1))
    # E8M0 holds 2^-127 at least: a block of 2^-140 scales to 2^-13 and flushes.
    assert mx_headroom(torch.full((32,), 2.0**-140), "e4m3").to_zero == Bound(32, 32)
    # A last dimension of 5 with block 4: rows [a b c d][e 0 0 0].
    y = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0**-30]] * 3)
    assert mx_headroom(y, "e4m3", block=4).to_zero == Bound(0, 0)
    assert mx_headroom(y.reshape(-1), "e4m3", block=4).to_zero == Bound(3, 3)
    for empty in (torch.empty(0, 8), torch.empty(4, 0), torch.empty(0)):
        h = mx_headroom(empty, "e4m3")
        assert (h.total, h.zeros, h.nonfinite, h.to_zero, h.saturated) == (0, 0, 0, Bound(0, 0), Bound(0, 0))
    assert mx_headroom(torch.tensor(2.0**-20), "e4m3").to_zero == Bound(0, 0)  # 0-dim: one block of one


# ---------------------------------------------------------------- errors


def one_line(excinfo: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    text = str(excinfo.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


def test_errors() -> None:
    hist = reference_histogram(torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError) as e:
        headroom(hist, "e3m4", amax=3.0)
    one_line(e, "target='e3m4'", "'e4m3'", "'e5m2'", "'e2m1'")
    with pytest.raises(ValueError) as e:
        headroom(hist, torch.float16, amax=3.0)
    one_line(e, "target=torch.float16")
    with pytest.raises(ValueError) as e:
        headroom(hist, "e4m3")
    one_line(e, "amax=None", "'amax'")
    with pytest.raises(ValueError) as e:
        headroom(hist, "e4m3", scaling="amax_pow2")
    one_line(e, "amax=None")
    for bad in (0.0, math.inf, math.nan):
        with pytest.raises(ValueError) as e:
            headroom(hist, "e4m3", amax=bad)
        one_line(e, f"amax={bad!r}")
    with pytest.raises(ValueError) as e:
        headroom(hist, "e4m3", amax=5.0)
    one_line(e, "amax=5.0", "[2.0, 4.0)")
    with pytest.raises(ValueError) as e:
        headroom(hist, "e4m3", scaling="max")
    one_line(e, "scaling='max'")
    for bad in (0.0, -2.0, math.inf):
        with pytest.raises(ValueError) as e:
            headroom(hist, "e4m3", scale=bad)
        one_line(e, f"scale={bad!r}")
    with pytest.raises(ValueError) as e:
        headroom(hist, "e4m3", scaling="amax", amax=3.0, scale=2.0)
    one_line(e, "scale=2.0", "scaling='amax'")
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError) as e:
            mx_headroom(torch.ones(64), "e4m3", block=bad)  # type: ignore[arg-type]
        one_line(e, f"block={bad!r}")
    with pytest.raises(ValueError) as e:
        mx_headroom(torch.ones(64), "fp8")
    one_line(e, "mx_headroom", "target='fp8'")
