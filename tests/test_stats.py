"""zeroscan.stats against the float64 reference: dtypes x layouts x sizes x devices."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import zeroscan
from checklist import Checklist
from dispatch_probes import FunctionsSeen, LoggedTensor, OpsSeen
from helpers import (
    ALL_DTYPES,
    DEVICES,
    FLOAT_DTYPES,
    assert_matches_reference,
    fresh_generator,
    make_values,
)

LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "channels_last", "short_rows", "overlapping"]
SIZES = [1, 7, 300, 4099, 70_001]
STRIDED_FROM = {"transposed": 300, "sliced": 300, "short_rows": 300}  # the size from which a layout is strided


def in_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor holding (roughly) `values` in the given memory layout, never copied
    back to contiguous."""
    n = values.numel()
    if layout == "contiguous":
        return values
    if layout == "transposed":
        rows = max(1, int(math.sqrt(n)))
        m = (n // rows) * rows
        return values[:m].reshape(rows, -1).t()
    if layout == "sliced":
        return values.reshape(-1)[::2] if n >= 2 else values
    if layout == "expanded":
        return values[: max(1, n // 8)].reshape(1, -1).expand(8, -1)
    if layout == "channels_last":
        c = 3
        hw = max(1, n // (2 * c))
        side = max(1, int(math.sqrt(hw)))
        m = 2 * c * side * side
        if m == 0 or m > n:
            return values
        return values[:m].reshape(2, c, side, side).contiguous(memory_format=torch.channels_last)
    if layout == "short_rows":
        if n < 5:
            return values
        rows = n // 5
        return values[: rows * 5].reshape(rows, 5)[:, 1:4]
    if layout == "overlapping":
        m = max(1, n // 2)
        return torch.as_strided(values, (max(1, m - 3), 4), (1, 1)) if n >= 8 else values
    raise AssertionError(layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference(dtype: torch.dtype, layout: str, device: str) -> None:
    """Every size, with dense, sparse or no special values, in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for specials, every in [("dense", 50), ("sparse", 20_000), ("none", 1)]:
            for n in SIZES:
                with checks.case(f"{specials} n={n}"):
                    values = make_values(n, dtype, g, specials=specials != "none", every=every)
                    # Built on the device: Tensor.to would make a view contiguous.
                    x = in_layout(values.to(device), layout)
                    if n >= STRIDED_FROM.get(layout, math.inf):
                        assert not x.is_contiguous()  # the layout under test really is strided
                    s = zeroscan.stats(x)
                    assert s.buffer.device == x.device and s.buffer.dtype == torch.int64
                    assert s.numel == x.numel()
                    assert_matches_reference(s, x, same_as_cpu=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_zero_dim_and_empty(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    scalar = make_values(1, dtype, g, specials=False).reshape(()).to(device)
    assert_matches_reference(zeroscan.stats(scalar), scalar)
    for shape in [(0,), (3, 0), (0, 5, 2)]:
        empty = torch.empty(shape, dtype=dtype, device=device)
        s = zeroscan.stats(empty)
        assert_matches_reference(s, empty)
        assert s.numel == 0 and math.isnan(s.mean) and s.norm == 0.0 and s.sum == 0.0
        assert math.isnan(s.min_abs) and math.isnan(s.max_abs) and s.min_abs_nonzero == math.inf


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_large_mean_tiny_spread(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    # Several CPU chunks and several CUDA tiles, each with its own shift.
    x = (1000 + 1e-3 * torch.randn(3_000_017, generator=g, dtype=torch.float64)).to(dtype).to(device)
    assert_matches_reference(zeroscan.stats(x), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_nonfinite_or_all_zero(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    n = int(torch.randint(1, 5000, (), generator=g))
    for fill in [math.nan, math.inf, -math.inf, 0.0, -0.0]:
        x = torch.full((n,), fill, dtype=dtype, device=device)
        x[int(torch.randint(0, n, (), generator=g))] = fill  # same value: still uniform
        assert_matches_reference(zeroscan.stats(x), x)
    mixed = torch.tensor([math.nan, math.inf, -math.inf] * (n // 3 + 1), dtype=dtype, device=device)
    s = zeroscan.stats(mixed)
    assert_matches_reference(s, mixed)
    assert math.isnan(s.mean) and math.isnan(s.std) and s.max_abs == math.inf


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_thresholds_are_exact_at_the_boundaries(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]

    def step(value: float, ulps: int) -> float:
        """The value `ulps` representable steps away from `value` in `dtype`."""
        return float((torch.tensor(value, dtype=dtype).view(bits) + ulps).view(dtype).double())

    largest_subnormal = step(info.tiny, -1)
    above_eps = step(info.eps, +1)
    below_eps = step(info.eps, -1)
    values = [info.tiny, largest_subnormal, info.eps, above_eps, below_eps, 0.0]
    x = torch.tensor(values + [-v for v in values], dtype=torch.float64).to(dtype)
    s = zeroscan.stats(x)
    assert_matches_reference(s, x)
    assert s.zeros == 2
    assert s.subnormal == 2  # +-largest_subnormal; tiny itself is normal
    assert s.near_zero == 8  # everything nonzero up to eps, not above_eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_tol(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    x = make_values(5000, dtype, g).to(device)
    for tol in [0.0, 1e-3, 0.05, 1.0, 1 / 3, 7.0, math.inf]:
        assert_matches_reference(zeroscan.stats(x, tol=tol), x, tol=tol, same_as_cpu=True)
    assert zeroscan.stats(x, tol=0.0).near_zero == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_independent_of_thread_count_and_repeatable(dtype: torch.dtype) -> None:
    g = fresh_generator()
    x = make_values(3_000_017, dtype, g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = zeroscan.stats(x).buffer.clone()
        torch.set_num_threads(max(2, before))
        many = zeroscan.stats(x).buffer.clone()
        again = zeroscan.stats(x).buffer.clone()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many) and torch.equal(many, again)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_never_writes_into_the_input(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    x = make_values(200_000, dtype, g).to(device)
    bits = x.view(torch.uint8).clone() if x.element_size() == 1 else x.clone()
    zeroscan.stats(x)
    zeroscan.stats_many([x, x[::3], x[1:]])  # x[1:]: a data pointer off a 16-byte boundary
    after = x.view(torch.uint8) if x.element_size() == 1 else x
    assert torch.equal(bits.view(torch.uint8), after.view(torch.uint8))


def test_fields_repr_and_dict() -> None:
    g = fresh_generator()
    x = torch.randn(64, 32, generator=g)
    x[0, :5] = 0
    x[1, 0] = math.nan
    s = zeroscan.stats(x)
    d = s.to_dict()
    assert set(zeroscan.FIELDS) <= set(d) and d["dtype"] == "float32" and d["shape"] == [64, 32]
    for field in zeroscan.FIELDS:
        assert getattr(s, field) == d[field] or (math.isnan(d[field]) and math.isnan(getattr(s, field)))
    text = repr(s)
    assert "\n" not in text and "float32[64,32]" in text and "zeros=5" in text and "NaN=1" in text
    assert s.zero_fraction == pytest.approx(5 / 2048)


def test_reading_a_field_copies_once() -> None:
    x = torch.randn(1000)
    x[:7] = 0
    s = zeroscan.stats(x)
    assert s._readout._words is None  # nothing read yet: no copy made
    assert s.zeros == 7
    words = s._readout._words
    assert words is not None and not s._readout._rows  # a count decodes no row
    _ = s.mean, s.std, repr(s)
    assert s._readout._words is words  # one copy serves every later read
    assert s.to_dict()["zeros"] == s.zeros == 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_large_magnitudes_do_not_overflow(dtype: torch.dtype, device: str) -> None:
    g = fresh_generator()
    finite_max = torch.finfo(dtype).max
    with Checklist() as checks:
        for magnitude in [1e4, 1e19, 1e25, 1e36]:
            with checks.case(f"magnitude {magnitude:g}"):
                x = torch.randn(100_003, generator=g, dtype=torch.float64) * min(magnitude, finite_max / 8)
                x = x.to(dtype).to(device)
                s = zeroscan.stats(x)
                assert_matches_reference(s, x)
                assert math.isfinite(s.std) and math.isfinite(s.norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("tol", [None, 0.25])
def test_the_cpu_call_is_the_operator_through_the_dispatcher(
    dtype: torch.dtype, tol: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stats() of a CPU tensor calls the operator from C++ (zeroscan.ops.stats_call),
    # not through torch.ops: the same row, and still the dispatcher's call, which
    # dispatch modes see.
    calls = []
    native = zeroscan.ops.stats_call
    monkeypatch.setattr(zeroscan.ops, "stats_call", lambda *args: calls.append(1) or native(*args))
    g = fresh_generator()
    x = make_values(5000, dtype, g)
    direct = torch.ops.zeroscan.stats.default(x, tol)
    with OpsSeen() as seen:
        s = zeroscan.stats(x, tol=tol)
    assert calls == [1]
    assert seen.ops == ["zeroscan.stats.default"], seen.ops
    assert torch.equal(s._readout.buffer, direct)
    assert_matches_reference(s, x, tol=tol)
    param = torch.nn.Parameter(x.float()) if dtype.is_floating_point else x
    assert zeroscan.stats(param, tol=tol).numel == 5000


def test_torch_function_overrides_still_see_the_operator() -> None:
    # The C++ call skips __torch_function__, so a subclass that defines it and
    # an active TorchFunctionMode go through torch.ops, as before it.
    x = make_values(300, torch.float32, fresh_generator())
    LoggedTensor.calls = []
    s = zeroscan.stats(x.as_subclass(LoggedTensor))
    assert "zeroscan.stats.default" in LoggedTensor.calls, LoggedTensor.calls
    assert_matches_reference(s, x)
    with FunctionsSeen() as mode:
        s = zeroscan.stats(x)
    assert "zeroscan.stats.default" in mode.funcs, mode.funcs
    assert_matches_reference(s, x)


@pytest.mark.parametrize("op", ["stats", "stats_many", "stats_many_hist", "stats_many_mapped", "combine_rows"])
def test_the_operators_pass_autograd_straight_to_the_kernel(op: str) -> None:
    # Their results are integer counts, so the Autograd keys fall through to
    # the backend: torch's boxed autograd fallback turned every argument into
    # an IValue and back on every call, for a warning no int64 result needs.
    table = torch._C._dispatch_dump_table(f"zeroscan::{op}")
    assert "AutogradCPU: fallthrough" in table, table


def test_tensors_that_require_grad_scan_without_a_warning() -> None:
    g = fresh_generator()
    p = torch.nn.Parameter(make_values(3000, torch.float32, g))
    q = torch.nn.Parameter(make_values(2000, torch.bfloat16, g))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = torch.ops.zeroscan.stats.default(p, None)
        single = zeroscan.stats(p)
        batch = zeroscan.stats_many([p, q], histogram=True)
        (q * 2).sum().backward()  # autograd around them is untouched
    assert not rows.requires_grad and rows.grad_fn is None
    assert_matches_reference(single, p.detach())
    for s, x in zip(batch, [p, q]):
        assert_matches_reference(s, x.detach())
    assert q.grad is not None and torch.equal(q.grad, torch.full_like(q, 2))


def test_the_direct_call_answers_for_plain_cpu_tensors_only() -> None:
    # zeroscan._C.stats_call takes a torch.Tensor or Parameter on the CPU and
    # answers None for anything else, which stats() then hands to torch.ops.
    x = make_values(2000, torch.float32, fresh_generator())
    for plain in (x, torch.nn.Parameter(x.clone())):
        row = zeroscan._C.stats_call(plain, 0.5)
        assert row is not None and torch.equal(row, torch.ops.zeroscan.stats.default(plain, 0.5))
    for other in (x.as_subclass(LoggedTensor), torch.empty(3, device="meta"), None, "x"):
        assert zeroscan._C.stats_call(other, None) is None
    with pytest.raises(TypeError, match="stats_call: takes"):
        zeroscan._C.stats_call(x, 1)
