"""torch.ops.zeroscan.mark_nonfinite against torch's isinf / isnan.

The op ORs into flags[slots[i]] 1 when xs[i] holds an infinity and 2 when it
holds a NaN, and touches nothing else: not the other slots, not the bits
already set, not the tensors it reads. Each check compares the flags with the
torch reference of the same tensor, over dtypes x layouts x where the special
values sit (first, last or anywhere among the positions the view reaches,
and in the first and last of the CPU's pieces), every bit pattern of the
16- and 8-bit floats, the value distributions of zeroscan.testing, and the
errors, which name the op and the argument.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from checklist import Checklist
from helpers import ALL_DTYPES, DEVICES, FLOAT_DTYPES, INT_DTYPES, fresh_generator, make_values
from zeroscan.testing import distributions_for, make_distribution, special_bits

MARK = torch.ops.zeroscan.mark_nonfinite.default
ALL_THREADS = torch.get_num_threads()  # read at import, before the one_thread fixture
INF, NAN = 1, 2  # the bits: kHoldsInf and kHoldsNan of csrc/nonfinite.h
PIECE = 1 << 14  # kPiece of csrc/cpu/nonfinite_cpu.cpp; its parallel grain is 4 pieces
LARGE = 200_003  # > 2 grains: every strided layout of it still spans several pieces and threads
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer views
NO_INF = (torch.float8_e4m3fn,)


# Torch's own work here (making values, the reference) runs on one thread, far
# faster on a shared 2-core machine (conftest.py); the op runs on all of them,
# so that a large tensor is split between threads (`mark`).
pytestmark = pytest.mark.usefixtures("one_thread")


def mark(xs: list[torch.Tensor], flags: torch.Tensor, slots: list[int], threads: int = ALL_THREADS) -> None:
    """MARK on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = MARK(xs, flags, slots)
    finally:
        torch.set_num_threads(before)
    assert result is None


def reference(x: torch.Tensor) -> int:
    """The flag bits of x by torch: float64 kept as it is (a float32 copy would
    turn its large finite values into infinities), the rest widened to float32."""
    x = x.detach().cpu()
    if not x.dtype.is_floating_point:
        return 0
    wide = x if x.dtype == torch.float64 else x.float()
    return (INF if bool(torch.isinf(wide).any()) else 0) | (NAN if bool(torch.isnan(wide).any()) else 0)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """x's stored bits, as a same-width integer tensor (a view)."""
    return x.view(BITS[x.element_size()]) if x.dtype.is_floating_point else x


def pattern(dtype: torch.dtype, value: float) -> int:
    """The bit pattern of `value` in `dtype`; for an infinity in float8_e4m3fn,
    which has none (torch saturates it to 448), the NaN of the same sign."""
    if math.isinf(value) and dtype in NO_INF:
        value = math.copysign(math.nan, value)
    return int(torch.tensor([value]).to(dtype).view(BITS[dtype.itemsize])[0])


def kinds_of_value(dtype: torch.dtype, value: float) -> int:
    if math.isnan(value) or dtype in NO_INF:
        return NAN
    return INF if math.isinf(value) else 0


def nan_patterns(dtype: torch.dtype, k: int, g: torch.Generator) -> torch.Tensor:
    """k NaN bit patterns of `dtype` with random signs and payloads (the one
    magnitude float8_e4m3fn has, with either sign)."""
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    if dtype in NO_INF:
        payload = torch.full((k,), (1 << mantissa_bits) - 1, dtype=torch.int64)
    else:
        payload = torch.randint(1, 1 << mantissa_bits, (k,), generator=g, dtype=torch.int64)
    magnitude = payload | top_exponent(dtype)
    negative = torch.randint(0, 2, (k,), generator=g, dtype=torch.bool)
    width = BITS[dtype.itemsize]
    # Setting the sign (top) bit of m >= 0 makes it m + min as a signed integer.
    return torch.where(negative, magnitude + torch.iinfo(width).min, magnitude).to(width)


def top_exponent(dtype: torch.dtype) -> int:
    """The bits of dtype's exponent field all set: +inf's pattern (for
    float8_e4m3fn, the smallest magnitude pattern above its finite ones' exponent)."""
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    return ((1 << (info.bits - 1)) - 1) ^ ((1 << mantissa_bits) - 1)


# ---- layouts: views of one contiguous base, never copied ---------------------

LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last", "overlapping"]


def in_layout(base: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of the 1-D tensor `base` in `layout` (base itself for "contiguous")."""
    n = base.numel()
    if layout == "contiguous":
        return base
    if layout == "transposed":
        rows = max(1, math.isqrt(n))
        return base[: rows * (n // rows)].reshape(rows, -1).t()
    if layout == "sliced":
        return base[1::3]
    if layout == "expanded":  # stride-0 outer and inner dimensions: each position read six times
        half = max(1, n // 2)
        return base[:half].reshape(1, half, 1).expand(2, half, 3)
    if layout == "channels_last":
        if n < 6:
            return base
        side = math.isqrt(n // 6)
        view = base[: 6 * side * side].reshape(2, side, side, 3).permute(0, 3, 1, 2)
        assert side == 1 or view.is_contiguous(memory_format=torch.channels_last)
        return view
    if layout == "overlapping":  # rows that share elements
        return torch.as_strided(base, (max(1, n - 3), 4), (1, 1)) if n >= 4 else base
    raise AssertionError(layout)


def offsets_reached(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The offsets into `base` (a contiguous 1-D tensor at storage offset 0)
    that the elements of its view x read, in x's element order."""
    index = torch.arange(base.numel())
    return index.as_strided(x.shape, x.stride(), x.storage_offset()).reshape(-1)


# ---- where the special values sit ---------------------------------------------

# (kind, where) pairs planted in order, a later one overwriting an earlier one
# at the same offset: "first" and "last" are the lowest and highest offset the
# view reaches (its first and last piece), "random" any element of it.
CASES = {
    "finite": [],
    "nan_first": [(math.nan, "first")],
    "nan_last": [(math.nan, "last")],
    "nan_random": [(math.nan, "random")],
    "posinf_first": [(math.inf, "first")],
    "posinf_random": [(math.inf, "random")],
    "neginf_last": [(-math.inf, "last")],
    "neginf_random": [(-math.inf, "random")],
    "nan_first_inf_last": [(math.nan, "first"), (-math.inf, "last")],
    "inf_first_nan_last": [(math.inf, "first"), (math.nan, "last")],
    "many_nan": [],  # about 1 % of the positions, random payloads and signs
}


def planted(base: torch.Tensor, x: torch.Tensor, case: str, g: torch.Generator) -> int:
    """Writes the special values of `case` into `base` where its view x reads
    them; the flag bits x must get (base's other values are finite)."""
    offsets = offsets_reached(base, x)
    if offsets.numel() == 0:
        return 0
    bits = bits_of(base)
    at: dict[int, int] = {}  # offset -> the kinds of what was last written there
    for value, where in CASES[case]:
        if where == "first":
            offset = int(offsets.min())
        elif where == "last":
            offset = int(offsets.max())
        else:
            offset = int(offsets[int(torch.randint(0, offsets.numel(), (), generator=g))])
        bits[offset] = pattern(base.dtype, value)
        at[offset] = kinds_of_value(base.dtype, value)
    if case == "many_nan":
        k = max(1, offsets.numel() // 100)
        chosen = offsets[torch.randint(0, offsets.numel(), (k,), generator=g)]
        bits[chosen] = nan_patterns(base.dtype, k, g)
        at.update({int(o): NAN for o in chosen})
    kinds = 0
    for k in at.values():
        kinds |= k
    return kinds


# Every case on a small tensor; on a large one (several pieces and threads in
# every layout), those that put a value in the last piece, or the two kinds in
# the first and the last.
SIZED_CASES = [(37, case) for case in CASES] + [
    (LARGE, case) for case in ["finite", "nan_last", "neginf_last", "inf_first_nan_last"]
]


def run_one(x: torch.Tensor, slot: int = 2, size: int = 4, threads: int = ALL_THREADS) -> torch.Tensor:
    """The flags of one call on x alone, into zeroed flags of `size` slots."""
    flags = torch.zeros(size, dtype=torch.int32, device=x.device)
    mark([x], flags, [slot], threads)
    return flags.cpu()


def expected_flags(kinds: int, slot: int = 2, size: int = 4) -> list[int]:
    return [kinds if i == slot else 0 for i in range(size)]


# ---- against the reference ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_reference(dtype: torch.dtype, layout: str, device: str) -> None:
    """Every (size, case) of SIZED_CASES in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for n, case in SIZED_CASES:
            with checks.case(f"n={n} {case}"):
                base = make_distribution("randn", n, dtype, g)
                want = planted(base, in_layout(base, layout), case, g)
                base = base.to(device)
                x = in_layout(base, layout)  # built on the device: Tensor.to would make a view contiguous
                assert x.is_contiguous() == (layout == "contiguous")  # the layout under test is what it says
                before = bits_of(base).clone()
                flags = run_one(x)
                assert reference(x) == want  # the planting reached x (and only what was planted is non-finite)
                assert flags.tolist() == expected_flags(want), f"got {flags.tolist()}, want kinds {want} in slot 2"
                assert torch.equal(bits_of(base), before)  # x is read, never written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_zero_dim_and_empty(dtype: torch.dtype, device: str) -> None:
    """Each of CASES planted in a 0-d view, in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for case in CASES:
            with checks.case(case):
                base = make_distribution("randn", 5, dtype, g)
                at = int(torch.randint(0, 5, (), generator=g))
                want = planted(base, base[at], case, g)  # a 0-d view at a storage offset
                base = base.to(device)
                scalar = base[at]
                assert scalar.dim() == 0 and scalar.storage_offset() == at
                assert reference(scalar) == want
                assert run_one(scalar).tolist() == expected_flags(want)
                for empty in [base[3:3], base[:0].reshape(0, 4), base.reshape(5, 1)[:, :0].t()]:
                    assert empty.numel() == 0
                    assert run_one(empty).tolist() == [0, 0, 0, 0]
                # A non-finite value right beside an empty view is not in it.
                bits_of(base).fill_(pattern(dtype, math.nan))
                assert reference(base) == NAN
                assert run_one(base[2:2]).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_distributions(dtype: torch.dtype, device: str) -> None:
    """Every distribution of zeroscan.testing that exists for dtype (zeros,
    subnormals, a large mean, a few or many specials), contiguous and sliced,
    of each size (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for n in [1, 300, 70_001]:
            for name in distributions_for(dtype):
                with checks.case(f"{name} n={n}"):
                    values = make_distribution(name, n, dtype, g).to(device)
                    for x in [values, values[::2]]:
                        want = reference(x)
                        if name.startswith("nonfinite") and x is values and n >= 3:
                            # Every kind present (three specials at least, spread evenly).
                            assert want == (NAN if dtype in NO_INF else INF | NAN), (name, want)
                        elif not name.startswith("nonfinite"):
                            assert want == 0, (name, want)
                        got = run_one(x).tolist()
                        assert got == expected_flags(want), f"{name} n={x.numel()}: got {got}, want kinds {want}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_piece_and_thread_edges(dtype: torch.dtype, device: str) -> None:
    """A single NaN or infinity at each edge of the CPU's pieces and of the
    two threads' halves, and two kinds in far apart pieces (the scan may stop
    early only once it has found both), on one thread and on all of them."""
    g = fresh_generator()
    n = 8 * PIECE + 5
    values = make_distribution("randn", n, dtype, g).to(device)
    bits = bits_of(values)
    edges = [0, PIECE - 1, PIECE, 4 * PIECE - 1, 4 * PIECE, n // 2 - 1, n // 2, n // 2 + 1, n - PIECE, n - 1]
    nan, neg_inf = pattern(dtype, math.nan), pattern(dtype, -math.inf)
    assert reference(values) == 0
    both = NAN if dtype in NO_INF else INF | NAN
    for threads in sorted({1, ALL_THREADS}):
        for at in edges:
            for value, kinds in [(nan, NAN), (neg_inf, kinds_of_value(dtype, -math.inf))]:
                old = bits[at].clone()
                bits[at] = value
                got = run_one(values, threads=threads).tolist()
                assert got == expected_flags(kinds), f"{threads} threads, position {at}: {got}"
                bits[at] = old
        for first, last in [(0, n - 1), (PIECE, n // 2 + 1), (n // 2 - 1, n - PIECE)]:
            old = bits[[first, last]].clone()
            bits[first], bits[last] = nan, neg_inf
            got = run_one(values, threads=threads).tolist()
            assert got == expected_flags(both), f"{threads} threads, NaN at {first}, -inf at {last}: {got}"
            bits[first], bits[last] = neg_inf, nan
            assert reference(values) == both  # the patterns are what they say
            got = run_one(values, threads=threads).tolist()
            assert got == expected_flags(both), f"{threads} threads, -inf at {first}, NaN at {last}: {got}"
            bits[[first, last]] = old


# ---- every bit pattern ----------------------------------------------------------


def assert_each_pattern(values: torch.Tensor, g: torch.Generator) -> None:
    """Each element of `values` as its own tensor, in one call, with its own
    slot of flags pre-filled at random: each slot gets exactly its element's
    reference bits ORed in."""
    n = values.numel()
    wide = values.cpu().double() if values.dtype == torch.float64 else values.cpu().float()
    want = torch.isinf(wide).int() * INF | torch.isnan(wide).int() * NAN
    before = torch.randint(-(2**31), 2**31, (n + 1,), generator=g, dtype=torch.int64).to(torch.int32)
    flags = before.to(values.device)
    order = torch.randperm(n, generator=g)  # slot of element i: order[i]
    mark(list(values.split(1)), flags, order.tolist())
    got = flags.cpu()
    expected = before.clone()
    expected[order] |= want
    assert got[n] == before[n]  # the slot no tensor names
    wrong = (got != expected).nonzero().reshape(-1)
    if wrong.numel():
        i = int((order == wrong[0]).nonzero()[0])  # the element whose slot is wrong
        bits = int(bits_of(values.cpu())[i]) & ((1 << (8 * values.element_size())) - 1)
        raise AssertionError(
            f"{wrong.numel()} wrong slots; first: {values.dtype} bits {bits:#x} ({float(wide[i])}) "
            f"set {int(got[wrong[0]] & 3)} over {int(before[wrong[0]] & 3)}, want {int(want[i])}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_bit_pattern(dtype: torch.dtype, device: str) -> None:
    width = BITS[dtype.itemsize]
    info = torch.iinfo(width)
    patterns = torch.arange(info.min, info.max + 1, dtype=torch.int64).to(width)
    values = patterns.view(dtype).to(device)
    assert values.numel() == 1 << (8 * dtype.itemsize)
    kinds = reference(values)
    assert kinds == (NAN if dtype in NO_INF else INF | NAN)
    assert_each_pattern(values, fresh_generator())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_wide_bit_patterns(dtype: torch.dtype, device: str) -> None:
    """float32 and float64, too many patterns for all: the 64 either side of
    +inf (the largest finite values and the first NaNs), of the largest
    pattern (a NaN), of zero and of the smallest normal value, each with
    both signs; 2048 with the exponent all ones (infinities and NaNs) and
    their negatives; and 2048 random patterns."""
    g = fresh_generator()
    width = BITS[dtype.itemsize]
    bits = 8 * dtype.itemsize
    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
    inf = top_exponent(dtype)
    largest = (1 << (bits - 1)) - 1  # the largest positive pattern: a NaN
    near = [p for b in [inf, largest, 0, 1 << mantissa_bits] for p in range(b - 64, b + 64) if 0 <= p <= largest]
    top = torch.randint(0, 1 << mantissa_bits, (2048,), generator=g, dtype=torch.int64) | inf
    positive = torch.cat([torch.tensor(near, dtype=torch.int64), top])
    anywhere = torch.randint(0, 256, (2048 * dtype.itemsize,), generator=g, dtype=torch.uint8).view(width)
    low = torch.iinfo(width).min
    signed = torch.cat([positive, positive + low, anywhere.to(torch.int64)]).to(width)
    values = signed.view(dtype).to(device)
    assert reference(values) == INF | NAN
    assert_each_pattern(values, g)


# ---- what the op leaves alone, and what it accumulates ------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bits_accumulate_and_other_slots_stay(device: str) -> None:
    """Flags pre-filled at random: the op only ORs bits 1 and 2 into the
    slots it is given, never clears one, and writes no tensor it reads."""
    g = fresh_generator()
    size = 9
    before = torch.randint(-(2**31), 2**31, (size,), generator=g, dtype=torch.int64).to(torch.int32)
    before[[1, 4, 6]] &= ~3  # three slots start with neither bit, so the op must set them
    flags = before.to(device)
    finite = torch.randn(1000, generator=g).to(device)
    nan = finite.clone()
    nan[int(torch.randint(0, 1000, (), generator=g))] = math.nan
    inf = finite.clone()
    inf[-1] = -math.inf
    inputs = [bits_of(t).clone() for t in (finite, nan, inf)]

    mark([finite, nan, inf], flags, [1, 4, 6])
    expected = before.clone()
    expected[4] |= NAN
    expected[6] |= INF
    assert flags.cpu().tolist() == expected.tolist()
    assert all(torch.equal(a, bits_of(b)) for a, b in zip(inputs, (finite, nan, inf), strict=True))

    # A finite tensor clears nothing; a second kind joins the first.
    mark([finite, finite, finite], flags, [4, 6, 1])
    assert flags.cpu().tolist() == expected.tolist()
    mark([inf, nan], flags, [4, 6])
    expected[4] |= INF
    expected[6] |= NAN
    assert flags.cpu().tolist() == expected.tolist()
    assert int(expected[4]) & 3 == 3 and int(expected[6]) & 3 == 3
    # Slots named by nobody, and the high bits everywhere, are as they were.
    high = ~torch.tensor(3, dtype=torch.int32)
    assert torch.equal(flags.cpu() & high, before & high)
    others = [i for i in range(size) if i not in (1, 4, 6)]
    assert torch.equal(flags.cpu()[others], before[others])
    # An empty list of tensors changes nothing.
    mark([], flags, [])
    assert flags.cpu().tolist() == expected.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_one_call(device: str) -> None:
    """Tensors of every dtype and layout in one call, first each with its own
    slot, then several to a slot (their kinds ORed)."""
    g = fresh_generator()
    xs: list[torch.Tensor] = []
    bases: list[torch.Tensor] = []
    cases = iter(list(CASES) * 2)
    for i, dtype in enumerate(ALL_DTYPES * 3):
        n = int(torch.randint(1, 3000, (), generator=g))
        layout = LAYOUTS[i % len(LAYOUTS)]
        if dtype.is_floating_point:
            base = make_distribution("randn", n, dtype, g)
            planted(base, in_layout(base, layout), next(cases), g)
        else:
            base = make_values(n, dtype, g)
        bases.append(base.to(device))
        xs.append(in_layout(bases[-1], layout))
    want = [reference(x) for x in xs]
    assert any(k == 0 for k in want) and any(k & NAN for k in want) and any(k & INF for k in want)
    before = [bits_of(b).clone() for b in bases]

    distinct = torch.randperm(len(xs) + 3, generator=g)[: len(xs)].tolist()
    flags = torch.zeros(len(xs) + 3, dtype=torch.int32, device=device)
    mark(xs, flags, distinct)
    expected = [0] * (len(xs) + 3)
    for slot, kinds in zip(distinct, want, strict=True):
        expected[slot] = kinds
    assert flags.cpu().tolist() == expected

    shared = torch.randint(0, 4, (len(xs),), generator=g).tolist()
    flags = torch.zeros(5, dtype=torch.int32, device=device)
    mark(xs, flags, shared)
    expected = [0] * 5
    for slot, kinds in zip(shared, want, strict=True):
        expected[slot] |= kinds
    assert flags.cpu().tolist() == expected
    # The same tensor twice, to one slot and to two.
    nan_x = next(x for x, k in zip(xs, want, strict=True) if k & NAN)
    inf_x = next(x for x, k in zip(xs, want, strict=True) if k & INF)
    flags = torch.zeros(3, dtype=torch.int32, device=device)
    mark([nan_x, nan_x, inf_x, inf_x], flags, [0, 0, 0, 2])
    assert flags.cpu().tolist() == [reference(nan_x) | reference(inf_x), 0, reference(inf_x)]
    assert all(torch.equal(bits_of(b), a) for a, b in zip(before, bases, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integers_never_set_bits(dtype: torch.dtype, device: str) -> None:
    """Integer and bool tensors, whatever their bits (those of a float NaN or
    infinity of the same width included), in every layout."""
    g = fresh_generator()
    n = 5 * PIECE + 3
    if dtype == torch.bool:
        values = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        info = torch.iinfo(dtype)
        values = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)
        floats = [d for d in FLOAT_DTYPES if d.itemsize == dtype.itemsize]
        lookalikes = torch.cat([special_bits(d).to(torch.int64) for d in floats])
        values[: lookalikes.numel()] = lookalikes.to(dtype)
        values[-2:] = torch.tensor([info.min, info.max]).to(dtype)
    values = values.to(device)
    before = values.clone()
    flags = torch.zeros(len(LAYOUTS) + 1, dtype=torch.int32, device=device)
    xs = [in_layout(values, layout) for layout in LAYOUTS] + [values[7]]
    mark(xs, flags, list(range(len(xs))))
    assert flags.cpu().tolist() == [0] * len(xs)
    assert torch.equal(values, before)
    # ... while a float tensor of the same call still sets its slot.
    flags.fill_(0)
    mark([*xs, torch.tensor([math.nan], device=device)], flags, [0] * len(xs) + [3])
    assert flags.cpu().tolist() == [NAN if i == 3 else 0 for i in range(len(xs))]


# ---- errors -----------------------------------------------------------------


def refused(match: str, xs: list[torch.Tensor], flags: torch.Tensor, slots: list[int]) -> None:
    """The call raises a RuntimeError matching `match` and leaves flags as they were."""
    before = flags.clone()
    with pytest.raises(RuntimeError, match=match):
        MARK(xs, flags, slots)
    assert torch.equal(flags, before)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_flags(device: str) -> None:
    x = torch.tensor([math.nan, math.inf], device=device)
    prefix = r"^zeroscan\.mark_nonfinite: flags must be a contiguous int32 \[F\] tensor, got "
    refused(prefix + r"Byte of shape \[3\]", [x], torch.zeros(3, dtype=torch.uint8, device=device), [0])
    refused(prefix + r"Float of shape \[3\]", [x], torch.zeros(3, device=device), [0])
    refused(prefix + r"Long of shape \[3\]", [x], torch.zeros(3, dtype=torch.int64, device=device), [0])
    refused(prefix + r"Int of shape \[2, 3\]", [x], torch.zeros(2, 3, dtype=torch.int32, device=device), [0])
    refused(prefix + r"Int of shape \[\]", [x], torch.zeros((), dtype=torch.int32, device=device), [0])
    strided = torch.zeros(3, 2, dtype=torch.int32, device=device)[:, 0]
    assert not strided.is_contiguous()
    refused(prefix + r"Int of shape \[3\]", [x], strided, [0])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_slots(device: str) -> None:
    x = torch.tensor([math.nan], device=device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    count = r"^zeroscan\.mark_nonfinite: slots must give one flag per tensor; got "
    refused(count + r"2 tensors and 1 slots", [x, x], flags, [0])
    refused(count + r"1 tensors and 2 slots", [x], flags, [0, 1])
    refused(count + r"0 tensors and 1 slots", [], flags, [0])
    range_ = r"^zeroscan\.mark_nonfinite: slots\[1\] is {}, outside flags of 4 entries"
    refused(range_.format(-1), [x, x], flags, [0, -1])
    refused(range_.format(4), [x, x], flags, [0, 4])
    refused(range_.format(2**40), [x, x], flags, [3, 2**40])
    empty_flags = torch.zeros(0, dtype=torch.int32, device=device)
    refused(r"^zeroscan\.mark_nonfinite: slots\[0\] is 0, outside flags of 0 entries", [x], empty_flags, [0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_refused(dtype: torch.dtype, device: str) -> None:
    """Refused by name before anything is flagged, also the NaN tensor before it."""
    nan = torch.tensor([math.nan], device=device)
    z = torch.tensor([complex(math.nan, 0.0)], dtype=dtype, device=device)
    flags = torch.zeros(2, dtype=torch.int32, device=device)
    name = "ComplexFloat" if dtype == torch.complex64 else "ComplexDouble"
    refused(rf"^zeroscan\.mark_nonfinite: xs\[1\] is complex \({name}\); scan x\.abs\(\)", [nan, z], flags, [0, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_refused(device: str) -> None:
    """A sparse tensor is refused before any kernel runs: the dispatcher finds
    no sparse kernel, so the message names the op and the sparse backend, not
    the argument (check_input's "must be a dense (strided) tensor" is not
    reached from Python)."""
    nan = torch.tensor([math.nan], device=device)
    sparse = torch.tensor([0.0, math.nan, 0.0], device=device).to_sparse()
    flags = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match=r"'zeroscan::mark_nonfinite' with arguments from the 'Sparse"):
        MARK([nan, sparse], flags, [0, 1])
    assert flags.cpu().tolist() == [0, 0]


# "cuda" in the name: the GPU job (benchmarks/gpu_check.sh) selects -k cuda.
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to put a tensor on another device")
def test_other_device_refused_with_cuda() -> None:
    nan = torch.tensor([math.nan])
    on_cuda = nan.cuda()
    cuda_flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    cpu_flags = torch.zeros(2, dtype=torch.int32)
    refused(r"^zeroscan\.mark_nonfinite: xs\[1\] is on cpu but flags is on cuda:0", [on_cuda, nan], cuda_flags, [0, 1])
    refused(r"^zeroscan\.mark_nonfinite: xs\[0\] is on cuda:0 but flags is on cpu", [on_cuda], cpu_flags, [0])
    assert cuda_flags.cpu().tolist() == [0, 0]


def test_meta_beside_cpu_refused() -> None:
    nan = torch.tensor([math.nan])
    meta = torch.empty(3, device="meta")
    flags = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"^zeroscan\.mark_nonfinite: xs\[1\] is on meta but flags is on cpu"):
        MARK([nan, meta], flags, [0, 1])
    assert flags.tolist() == [0, 0]


# ---- opcheck ------------------------------------------------------------------

# opcheck's schema test compares inputs with arithmetic that torch does not
# implement for float8 on the CPU (as in test_compile.py); the rest runs for them.
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    g = fresh_generator()
    xs = {dtype: make_values(301, dtype, g).to(device) for dtype in ALL_DTYPES}
    x = xs[torch.float32]
    samples = [
        ([xs[torch.float64], xs[torch.bfloat16], xs[torch.int32], xs[torch.bool]], [0, 1, 2, 3]),
        ([x.reshape(7, 43).t(), x[::3], x[:40].reshape(40, 1).expand(40, 9), x[0].reshape(()), x[:0]], [4, 0, 1, 2, 3]),
        ([xs[torch.float16], xs[torch.float16], xs[torch.float32]], [1, 1, 1]),  # one slot for three
        ([xs[torch.float8_e4m3fn], xs[torch.float8_e5m2]], [0, 1]),
        ([], []),
    ]
    for sample, slots in samples:
        flags = torch.randint(0, 4, (len(sample) + 2,), generator=g, dtype=torch.int32).to(device)
        args = (sample, flags, slots)
        if any(t.dtype in FP8 for t in sample):
            torch.library.opcheck(MARK, args, test_utils=NO_SCHEMA_TEST)
        else:
            torch.library.opcheck(MARK, args)
        # opcheck ran the op on copies: flags still match what one call gives.
        before = flags.clone()
        mark(*args)
        want = before.cpu()
        for t, slot in zip(sample, slots, strict=True):
            want[slot] |= reference(t)
        assert flags.cpu().tolist() == want.tolist()


# ---- the CPU's plain path ---------------------------------------------------------

SCALAR_CHECK = textwrap.dedent(
    """
    import math, torch, zeroscan
    MARK = torch.ops.zeroscan.mark_nonfinite.default
    n = 200_003
    def ref(x):
        w = x if x.dtype == torch.float64 else x.float()
        return int(bool(torch.isinf(w).any())) | 2 * int(bool(torch.isnan(w).any()))
    def mark(xs, flags, slots):
        torch.set_num_threads(threads)  # the op on every thread, torch's own work on one
        MARK(xs, flags, slots)
        torch.set_num_threads(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bad = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                  torch.float8_e4m3fn, torch.float8_e5m2, torch.int32):
        for first, last in [(None, None), (math.nan, None), (None, -math.inf), (math.inf, math.nan)]:
            base = torch.randn(n, generator=g).to(dtype)
            if first is not None and dtype.is_floating_point:
                base[1] = first
            if last is not None and dtype.is_floating_point:
                base[-1] = last
            for x in (base, base[1::3], base[: 447 * 447].reshape(447, 447).t(), base[1]):
                flags = torch.zeros(3, dtype=torch.int32)
                mark([x], flags, [1])
                if flags.tolist() != [0, ref(x), 0]:
                    bad.append((dtype, first, last, tuple(x.shape), flags.tolist(), ref(x)))
    if ref(torch.tensor([math.nan, -math.inf])) != 3:
        bad.append("the reference")
    halves = torch.arange(-32768, 32768).to(torch.int16).view(torch.float16)
    flags = torch.zeros(halves.numel(), dtype=torch.int32)
    mark(list(halves.split(1)), flags, list(range(halves.numel())))
    f = halves.float()
    if not torch.equal(flags, torch.isinf(f).int() | 2 * torch.isnan(f).int()):
        bad.append("float16 patterns")
    print("OK" if not bad else bad)
    """
)


@pytest.mark.slow  # a fresh process: importing torch alone takes seconds
def test_plain_path_under_scalar_capability() -> None:
    """ZEROSCAN_CPU_CAPABILITY=scalar keeps the CPU off its AVX2 loop (read
    once per process): the plain loop against the reference."""
    env = {**os.environ, "ZEROSCAN_CPU_CAPABILITY": "scalar"}
    result = subprocess.run(
        [sys.executable, "-c", SCALAR_CHECK],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "OK", result.stdout[-3000:]


@pytest.mark.slow
def test_more_than_2_pow_31_elements() -> None:
    """int64 positions: a NaN past element 2^31 (2 GiB of float8) is found, and a
    finite tensor of that size is not flagged."""
    n = 2**31 + 5
    x = torch.zeros(n, dtype=torch.float8_e5m2)
    flags = torch.zeros(2, dtype=torch.int32)
    MARK([x], flags, [0])
    x[n - 2] = float("nan")
    MARK([x], flags, [1])
    assert flags.tolist() == [0, 2]
    del x
