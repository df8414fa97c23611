"""zeroscan.diagnose / diagnose_stats / diagnose_many: each verdict on fresh
random inputs, over dtype x device x layout, checked against the float64
reference and hand-built truth."""

from __future__ import annotations

import pytest
import torch

import zeroscan
from zeroscan.diagnosis import Diagnosis, Severity, Verdict, diagnose, diagnose_many, diagnose_stats
from helpers import DEVICES, fresh_generator

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "transposed", "strided"]


def laid_out(values: torch.Tensor, layout: str, device: str) -> torch.Tensor:
    """The same multiset of values in the given memory layout."""
    n = values.numel()
    if layout == "contiguous":
        return values.to(device)
    if layout == "transposed":
        rows = 4 if n % 4 == 0 else 1
        return values.reshape(n // rows, rows).to(device).t()
    # every other element of a twice-as-long buffer
    full = torch.empty(2 * n, dtype=values.dtype)
    full[0::2] = values
    full[1::2] = float("nan") if values.dtype.is_floating_point else 0
    return full.to(device)[0::2]


def shuffled(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return x[torch.randperm(x.numel(), generator=g)]


def normal(n: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal values well inside the dtype's normal range, none zero."""
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    x = torch.where(x.abs() < 0.05 * scale, torch.full_like(x, 0.5 * scale), x)
    return x.to(dtype)


def subnormal(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    x = tiny * (0.1 + 0.8 * torch.rand(n, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    out = (x * sign).to(dtype)
    assert bool((out != 0).all()) and bool((out.abs() < tiny).all())
    return out


def check_evidence(d: Diagnosis, x: torch.Tensor) -> None:
    ref = zeroscan.reference_stats(x)
    for field in ("numel", "zeros", "subnormal", "nan", "posinf", "neginf"):
        assert getattr(d.stats, field) == ref[field], field


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_verdict(device: str, dtype: torch.dtype, layout: str) -> None:
    g = fresh_generator()
    n = 4 * int(torch.randint(50, 200, (), generator=g))

    cases: list[tuple[Verdict, torch.Tensor]] = []
    healthy = normal(n, dtype, g)
    cases.append((Verdict.HEALTHY, healthy))

    bad = healthy.clone()
    special = ["nan", "inf", "-inf"][int(torch.randint(0, 3, (), generator=g))]
    bad[int(torch.randint(0, n, (), generator=g))] = float(special)
    cases.append((Verdict.NONFINITE, bad))

    zeros = torch.zeros(n, dtype=dtype)
    zeros[torch.rand(n, generator=g) < 0.5] = -0.0
    cases.append((Verdict.EXACT_ZERO, zeros))

    k = int(torch.randint(1, n // 2, (), generator=g))
    cases.append((Verdict.UNDERFLOW, shuffled(torch.cat([subnormal(k, dtype, g), torch.zeros(n - k, dtype=dtype)]), g)))
    cases.append((Verdict.UNDERFLOW, subnormal(n, dtype, g)))

    k = int(0.95 * n)
    cases.append((Verdict.MOSTLY_ZERO, shuffled(torch.cat([torch.zeros(k, dtype=dtype), normal(n - k, dtype, g)]), g)))

    k = max(1, n // 20)
    cases.append((Verdict.PARTIAL_UNDERFLOW, shuffled(torch.cat([subnormal(k, dtype, g), normal(n - k, dtype, g)]), g)))

    value = float(normal(1, dtype, g)[0])
    cases.append((Verdict.CONSTANT, torch.full((n,), value, dtype=dtype)))
    cases.append((Verdict.EMPTY, torch.empty(0, dtype=dtype)))

    for expected, values in cases:
        x = laid_out(values, layout, device) if values.numel() else values.to(device)
        before = x.clone()
        d = diagnose(x)
        assert d.verdict is expected, (expected, str(d))
        assert d.severity == expected.severity
        assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())
        check_evidence(d, x)
        same = diagnose_stats(zeroscan.stats(x))
        assert same.verdict is expected and same.reason == d.reason


@pytest.mark.parametrize("device", DEVICES)
def test_tol_decides_underflow(device: str) -> None:
    g = fresh_generator()
    n = int(torch.randint(100, 1000, (), generator=g))
    x = (torch.rand(n, generator=g) * 1e-3 + 1e-6).to(device)  # normal float32 values in (1e-6, 1e-3]
    assert diagnose(x).verdict is Verdict.HEALTHY
    d = diagnose(x, tol=2e-3)
    assert d.verdict is Verdict.UNDERFLOW
    assert "tol=0.002" in d.reason
    assert diagnose(x, tol=float(x.max()) / 2).verdict is Verdict.HEALTHY


def test_mostly_zero_threshold_is_an_argument() -> None:
    g = fresh_generator()
    n = 1000
    k = 850
    x = shuffled(torch.cat([torch.zeros(k), normal(n - k, torch.float32, g)]), g)
    assert diagnose(x).verdict is Verdict.HEALTHY  # 85 % < default 0.9
    d = diagnose(x, mostly_zero=0.8)
    assert d.verdict is Verdict.MOSTLY_ZERO
    assert "85%" in d.reason
    assert diagnose(x, partial_underflow=0.5).verdict is Verdict.HEALTHY


def test_constant_needs_same_sign_and_two_values() -> None:
    assert diagnose(torch.tensor([-2.5, -2.5, -2.5])).verdict is Verdict.CONSTANT
    assert diagnose(torch.tensor([2.5, -2.5])).verdict is Verdict.HEALTHY
    assert diagnose(torch.tensor([2.5])).verdict is Verdict.HEALTHY


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_tensors(dtype: torch.dtype) -> None:
    g = fresh_generator()
    n = int(torch.randint(10, 500, (), generator=g))
    assert diagnose(torch.zeros(n, dtype=dtype)).verdict is Verdict.EXACT_ZERO
    if dtype == torch.bool:
        x = torch.rand(n, generator=g) < 0.5
        x[0], x[1] = True, False
    else:
        x = torch.randint(1, 100, (n,), generator=g).to(dtype)
        x[0], x[1] = 1, 2
    d = diagnose(x)
    assert d.verdict is Verdict.HEALTHY
    check_evidence(d, x)


def test_diagnose_many_uses_one_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    g = fresh_generator()
    xs = [normal(64, torch.float32, g), torch.zeros(10), subnormal(5, torch.float32, g), normal(3, torch.float16, g)]
    calls = []
    real = zeroscan.diagnosis.scan_many

    def counting(op, tensors, *, tol=None):  # type: ignore[no-untyped-def]
        calls.append(len(list(tensors)))
        return real(op, tensors, tol=tol)

    monkeypatch.setattr(zeroscan.diagnosis, "scan_many", counting)
    ds = diagnose_many(xs)
    assert calls == [4]
    assert [d.verdict for d in ds] == [diagnose(x).verdict for x in xs]
    assert [d.verdict for d in ds] == [Verdict.HEALTHY, Verdict.EXACT_ZERO, Verdict.UNDERFLOW, Verdict.HEALTHY]


def test_severity_and_output_forms() -> None:
    assert [s.value for s in Severity] == [0, 1, 2, 3]
    assert Severity.ERROR > Severity.WARNING > Severity.INFO > Severity.OK
    for v in Verdict:
        assert v.value == v.name.lower()
        assert isinstance(v.severity, Severity)
    assert Verdict.HEALTHY.severity == Severity.OK
    assert Verdict.NONFINITE.severity == Severity.ERROR
    d = diagnose(torch.tensor([1.0, float("nan"), 0.0]))
    out = d.to_dict()
    assert out["verdict"] == "nonfinite" and out["severity"] == "error"
    assert out["stats"]["nan"] == 1 and out["stats"]["numel"] == 3
    assert isinstance(out["reason"], str) and "NaN" in out["reason"]
    text = str(d)
    assert text.startswith("NONFINITE (error)") and "NaN" in text
    with pytest.raises(Exception):
        d.verdict = Verdict.HEALTHY  # type: ignore[misc]  (frozen)


def test_misuse_errors_name_the_argument() -> None:
    x = torch.randn(4)
    with pytest.raises(ValueError, match="mostly_zero"):
        diagnose(x, mostly_zero=0.0)
    with pytest.raises(ValueError, match="mostly_zero"):
        diagnose(x, mostly_zero=1.5)
    with pytest.raises(TypeError, match="partial_underflow"):
        diagnose(x, partial_underflow="a lot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tol"):
        diagnose(x, tol=-1.0)
    with pytest.raises(TypeError, match="None"):
        diagnose(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Stats"):
        diagnose_stats(x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single tensor"):
        diagnose_many(x)  # type: ignore[arg-type]
