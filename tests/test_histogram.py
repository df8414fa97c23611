"""stats(x, histogram=True): the log2-magnitude histogram counted in the scan.

Every histogram is compared bin for bin with `reference_histogram`, which
takes each value's exponent with float64 torch.frexp (integers: Python's
bit_length), on fresh random data of every distribution zeroscan
benchmarks, every dtype, and the layouts the scan walks differently.
The rows of a scan with the histogram are those of a scan without it.
"""

from __future__ import annotations

import pytest
import torch

import zeroscan
from zeroscan.histogram import Histogram, field_bins, layout_of, reference_histogram
from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES
from zeroscan.testing import distributions_for, make_distribution

from checklist import Checklist
from helpers import DEVICES, fresh_generator, make_values

ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
# Sizes: below one vector, a few vectors with a tail, past the first
# elements that place the CPU's counting window, and several chunks of the
# parallel scan (64K elements each).
SIZES = (1, 63, 1000, 70_001, 300_000)


def assert_same_histogram(got: Histogram | None, x: torch.Tensor) -> None:
    want = reference_histogram(x)
    assert got is not None
    assert got.dtype == want.dtype and got.min_exponent == want.min_exponent
    assert got.to_dict() == want.to_dict()
    assert got.counts.tolist() == want.counts.tolist()
    assert got.numel == x.numel()


def reference_fields(x: torch.Tensor) -> list[int]:
    """The native fields of x (csrc/histogram.h) from the reference: field 0
    zeros and subnormals, then the binades, then Inf and NaN in the
    all-ones field of IEEE formats (float8_e4m3fn's shares its top binade)."""
    h = reference_histogram(x)
    fields = [h.zeros + h.subnormal, *h.counts.tolist()]
    if x.dtype.is_floating_point:
        if x.dtype == torch.float8_e4m3fn:
            fields[-1] += h.nan
        else:
            fields.append(h.nan + h.posinf + h.neginf)
    assert len(fields) == field_bins(x.dtype)
    return fields


def assert_same_fields(x: torch.Tensor) -> None:
    _, fields = torch.ops.zeroscan.stats_many_hist.default([x], None)
    assert fields[0].tolist() == reference_fields(x.cpu())


def layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x as the layouts the scan walks differently: contiguous, a strided
    view (gathered), a transposed 2-D view, and an expanded (stride-0) one."""
    n = x.numel()
    out = {"contiguous": x, "strided": x[::3]}
    if n >= 4:
        rows = n // 4
        out["transposed"] = x[: rows * 4].view(rows, 4).t()
    out["expanded"] = x[: max(1, n // 7)].unsqueeze(1).expand(-1, 7)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference_on_mixed_values(device: str, dtype: torch.dtype) -> None:
    """Every size and layout in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for n in SIZES:
            x = make_values(n, dtype, g, every=40).to(device)
            for name, view in layouts(x).items():
                with checks.case(f"n={n} {name}"):
                    s = zeroscan.stats(view, histogram=True)
                    assert_same_histogram(s.histogram, view.cpu())
                    assert_same_fields(view)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_reference_on_every_distribution(device: str, dtype: torch.dtype) -> None:
    """Both sizes in one case (checklist.py)."""
    g = fresh_generator()
    with Checklist() as checks:
        for n in [20_003, 200_003]:  # several vector blocks; several 64K-element chunks
            for name in distributions_for(dtype):
                with checks.case(f"{name} n={n}"):
                    x = make_distribution(name, n, dtype, g).to(device)
                    assert_same_histogram(zeroscan.stats(x, histogram=True).histogram, x.cpu())
                    assert_same_fields(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_wide_and_shifting_magnitudes(device: str, dtype: torch.dtype) -> None:
    """Values over the dtype's whole range, and data whose magnitudes jump
    from one part of the tensor to the next (the CPU's counting window is
    placed from the values before each span; what falls outside it is
    counted by windows above and below it, then one at a time)."""
    g = fresh_generator()
    info = torch.finfo(dtype)
    n = 150_000
    lo, hi = torch.log2(torch.tensor(float(info.smallest_normal))), torch.log2(torch.tensor(float(info.max)))
    exps = lo + (hi - lo - 1) * torch.rand(n, generator=g, dtype=torch.float64)
    wide = torch.exp2(exps) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    tiny = torch.randn(n, generator=g, dtype=torch.float64) * float(info.smallest_normal) * 4
    big = torch.randn(n, generator=g, dtype=torch.float64) * float(info.max) / 8
    for x in (wide, torch.cat([tiny, big, tiny]), torch.cat([big[:300], tiny])):
        x = x.to(dtype).to(device)
        assert_same_histogram(zeroscan.stats(x, histogram=True).histogram, x.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_those_of_a_scan_without_it(device: str) -> None:
    g = fresh_generator()
    xs = [make_values(n, dt, g).to(device) for n, dt in ((70_001, torch.float32), (999, torch.bfloat16), (5, torch.int8))]
    xs.append(xs[0][::2])
    with_hist = zeroscan.stats_many(xs, histogram=True)
    plain = zeroscan.stats_many(xs)
    for a, b, x in zip(with_hist, plain, xs):
        assert torch.equal(a.buffer, b.buffer)
        assert b.histogram is None
        assert_same_histogram(a.histogram, x.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_stats_many_mixes_dtypes(device: str) -> None:
    g = fresh_generator()
    xs = [make_values(2000, dt, g).to(device) for dt in ALL_DTYPES]
    rows, fields = torch.ops.zeroscan.stats_many_hist.default(xs, None)
    assert rows.shape == (len(xs), zeroscan.NUM_FIELDS)
    assert fields.shape == (len(xs), max(field_bins(dt) for dt in ALL_DTYPES)) and fields.dtype == torch.int64
    # A tensor's fields past its dtype's own are zero, and its fields sum to its numel.
    for i, x in enumerate(xs):
        assert int(fields[i, field_bins(x.dtype) :].abs().sum()) == 0
        assert int(fields[i].sum()) == x.numel()
    for s, x in zip(zeroscan.stats_many(xs, histogram=True), xs):
        assert_same_histogram(s.histogram, x.cpu())


def test_empty_inputs() -> None:
    s = zeroscan.stats(torch.empty(0), histogram=True)
    assert s.histogram is not None and s.histogram.numel == 0
    assert len(zeroscan.stats_many([], histogram=True)) == 0
    batch = zeroscan.stats_many([torch.empty(0, dtype=torch.float16), torch.ones(2)], histogram=True)
    assert batch[0].histogram is not None and batch[0].histogram.numel == 0
    assert_same_histogram(batch[1].histogram, torch.ones(2))


def test_scanning_never_writes_the_input() -> None:
    x = make_values(100_000, torch.bfloat16, fresh_generator())
    before = x.clone()
    zeroscan.stats(x, histogram=True)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))


def test_histogram_flag_is_checked() -> None:
    with pytest.raises(TypeError, match=r"zeroscan.stats: histogram must be True or False, got int 1"):
        zeroscan.stats(torch.ones(3), histogram=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"zeroscan.stats_many: histogram must be True or False, got str 'yes'"):
        zeroscan.stats_many([torch.ones(3)], histogram="yes")  # type: ignore[arg-type]


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"stats_many_hist: xs\[1\] is complex"):
        torch.ops.zeroscan.stats_many_hist.default([torch.ones(2), torch.ones(2, dtype=torch.complex64)], None)


def test_layout_bins_cover_each_dtype() -> None:
    """The Python layout and the native field count agree for every dtype."""
    for dtype in ALL_DTYPES:
        x = torch.zeros(1, dtype=dtype)
        _, fields = torch.ops.zeroscan.stats_many_hist.default([x], None)
        assert fields.shape[1] == layout_of(dtype).fields


def test_fake_kernel_and_compile() -> None:
    xs = [torch.randn(100), torch.randn(7, dtype=torch.float64)]
    torch.library.opcheck(torch.ops.zeroscan.stats_many_hist.default, (xs, None))

    def scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.zeroscan.stats_many_hist.default([a * 2, b], None)

    compiled = torch.compile(scan, fullgraph=True, backend="eager")
    rows, fields = compiled(*xs)
    want_rows, want_fields = scan(*xs)
    assert torch.equal(rows, want_rows) and torch.equal(fields, want_fields)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dict_form_round_trips(dtype: torch.dtype) -> None:
    """Histogram.from_dict reads back what to_dict wrote (saved JSON)."""
    x = make_values(5000, dtype, fresh_generator(), every=30)
    h = zeroscan.stats(x, histogram=True).histogram
    assert h is not None
    back = Histogram.from_dict(dtype, h.to_dict())
    assert back.to_dict() == h.to_dict() and back.counts.tolist() == h.counts.tolist()
    assert (back.min_exponent, back.max_exponent, back.numel) == (h.min_exponent, h.max_exponent, x.numel())
