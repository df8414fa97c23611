"""Monitor(histogram=True): the exact log2-magnitude histogram of every
gradient and weight, counted in the Monitor's own scans and reported for
the latest step. Each reported histogram is checked against
zeroscan.histogram.reference_histogram of a copy of the tensor taken just
before optimizer.step(), where the Monitor scans."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroscan.monitor.scanner as monitor_scans
from helpers import fresh_generator
from zeroscan import Monitor
from zeroscan.histogram import Histogram, reference_histogram

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

BINS = ("zeros", "subnormal", "posinf", "neginf", "nan")


def assert_same_histogram(got: Histogram, want: Histogram, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.min_exponent == want.min_exponent, f"{what}: min_exponent {got.min_exponent}, want {want.min_exponent}"
    differ = numpy.flatnonzero(got.counts != want.counts) if got.counts.shape == want.counts.shape else None
    assert differ is not None and differ.size == 0, (
        f"{what}: binade counts differ: got {got.to_dict()['binades']}, want {want.to_dict()['binades']}"
    )
    for name in BINS:
        got_n, want_n = getattr(got, name), getattr(want, name)
        assert got_n == want_n, f"{what}: {name} {got_n}, want {want_n}"


class Mixed(nn.Module):
    """float32 layers, a bfloat16 gate and a float64 scale: each scan holds
    tensors of three dtypes, whose fields differ in width and meaning."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.gate = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        self.fc2 = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * self.gate.float()
        return (self.fc2(h).double() * self.scale).float()


def randomized(model: nn.Module, g: torch.Generator) -> nn.Module:
    """The model with random weights, each parameter at its own scale (so
    that the tensors' histograms spread over different binades)."""
    with torch.no_grad():
        for p in model.parameters():
            scale = 10.0 ** float(torch.empty(()).uniform_(-3.0, 1.0, generator=g))
            wide = torch.complex128 if p.is_complex() else torch.float64
            p.copy_((torch.randn(p.shape, generator=g, dtype=wide) * scale).to(p.dtype))
    return model


def backward(model: nn.Module, g: torch.Generator, batch: int = 6) -> None:
    scale = 10.0 ** float(torch.randint(-2, 3, (), generator=g))
    model(torch.randn(batch, 4, generator=g) * scale).square().mean().backward()


def scanned_now(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every gradient and weight as they are now (what a scan at
    this point sees), by Report.histograms key."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"{name}:grad"] = p.grad.detach().clone()
        out[f"{name}:weight"] = p.detach().clone()
    return out


def assert_histograms_of(histograms: dict[str, Histogram], tensors: dict[str, torch.Tensor]) -> None:
    assert list(histograms) == list(tensors)  # the same tensors, in parameter order, grad before weight
    for key, t in tensors.items():
        assert_same_histogram(histograms[key], reference_histogram(t), key)


def test_each_step_reports_the_histograms_of_its_tensors() -> None:
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, histogram=True, history=3) as mon:
        for step in range(4):
            opt.zero_grad()
            backward(model, g)
            scanned = scanned_now(model)  # the Monitor scans in optimizer.step()'s pre-hook
            opt.step()
            report = mon.report()
            assert report.step == step
            assert_histograms_of(report.histograms, scanned)
    dtypes = {h.dtype for h in report.histograms.values()}
    assert dtypes == {torch.float32, torch.bfloat16, torch.float64}
    rows = {f"{t['name']}:{t['kind']}": t for t in report.tensors}
    for key, hist in report.histograms.items():
        assert hist.numel == rows[key]["numel"] and hist.zeros == round(rows[key]["zero_fraction"] * hist.numel)


def test_to_dict_and_json_lines_carry_the_histograms() -> None:
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, histogram=True) as mon:
        opt.zero_grad()
        backward(model, g)
        opt.step()
        report = mon.report()
    tensors = report.to_dict()["tensors"]
    assert len(tensors) == len(report.histograms) == 12
    for t in tensors:
        hist = report.histograms[f"{t['name']}:{t['kind']}"]
        assert t["histogram"] == hist.to_dict() and getattr(torch, t["dtype"]) == hist.dtype
    lines = [json.loads(line) for line in report.to_json_lines().splitlines()]
    shown = {f"{d['name']}:{d['kind']}": d["histogram"] for d in lines if d["type"] == "tensor"}
    assert shown == {key: h.to_dict() for key, h in report.histograms.items()}
    assert all(t.keys() >= {"name", "kind", "numel"} and "histogram" not in t for t in report.tensors)


def test_planted_nan_and_inf_land_in_their_bins() -> None:
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    names = [n for n, _ in model.named_parameters()]
    target = names[int(torch.randint(0, len(names), (), generator=g))]
    with Monitor(model, opt, histogram=True) as mon:
        opt.zero_grad()
        backward(model, g)
        opt.step()
        opt.zero_grad()
        backward(model, g)  # the Monitor scans these gradients, finite, when backward ends ...
        grad = dict(model.named_parameters())[target].grad
        assert grad is not None
        flat = grad.view(-1)
        assert flat.numel() >= 2
        flat[0] = math.nan  # ... and again at the step, with a NaN and an inf: the step's scan counts
        flat[-1] = -math.inf
        scanned = scanned_now(model)
        opt.step()
        report = mon.report()
    assert_histograms_of(report.histograms, scanned)
    hist = report.histograms[f"{target}:grad"]
    assert (hist.nan, hist.neginf, hist.posinf) == (1, 1, 0)
    assert hist.numel == flat.numel() and int(hist.counts.sum()) + hist.zeros + hist.subnormal == flat.numel() - 2
    assert all(h.nan == 0 for key, h in report.histograms.items() if key != f"{target}:grad")


def test_off_by_default_and_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_histograms(tensors: list[torch.Tensor]) -> Any:
        raise AssertionError("a Monitor without histogram=True counted histograms")

    monkeypatch.setattr(monitor_scans, "native_many_hist", no_histograms)
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt) as mon:
        for _ in range(2):
            opt.zero_grad()
            backward(model, g)
            opt.step()
        assert all(f is None for r in mon._log.records for f in r.fields)
        report = mon.report()
    assert mon.histogram is False and report.histograms == {}
    assert len(report.tensors) == 12
    assert all("histogram" not in t and "dtype" not in t for t in report.to_dict()["tensors"])
    assert "histogram" not in report.to_json_lines()


def test_one_call_per_scan_no_readback_and_fields_of_the_latest_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = monitor_scans.native_many_hist

    def counting(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(len(tensors))
        return real(tensors)

    witness: list[int] = []
    real_plain = monitor_scans.native_many

    def witness_only(tensors: list[torch.Tensor]) -> Any:
        # The one scan without histograms: the witness of the first values of a few
        # gradients when backward ends (monitor/deferred.py), whose rows no report shows.
        assert all(t.numel() <= 64 for t in tensors), "histogram=True scanned without counting histograms"
        witness.append(len(tensors))
        return real_plain(tensors)

    def no_decode(*args: Any) -> Any:
        raise AssertionError("the Monitor read results back during training")

    monitor_py = sys.modules["zeroscan.monitor.step_reads"]
    real_decode = monitor_py.decode_records
    monkeypatch.setattr(monitor_scans, "native_many_hist", counting)
    monkeypatch.setattr(monitor_scans, "native_many", witness_only)
    monkeypatch.setattr(monitor_py, "decode_records", no_decode)
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, opt, histogram=True, history=5)
    for _ in range(7):
        opt.zero_grad()
        backward(model, g)
        scanned = scanned_now(model)
        opt.step()
    # Per step: 6 gradients + 6 weights at the step. When backward ends: the 6 gradients
    # at the first step (the Monitor does not know yet whether the loop lets them go, see
    # monitor/deferred.py), then the witness only (here the whole of these small gradients).
    assert calls == [6, 12] + [12] * 6
    assert witness == [6] * 6
    records = list(mon._log.records)
    assert [r.step for r in records] == [2, 3, 4, 5, 6]
    for r in records[:-1]:  # a later step was taken: their fields are freed
        assert r.fields == [None] and r.rows is None
    last = records[-1]
    assert [tuple(block.fields.shape) for block in last.fields] == [(12, 2048)]  # float64's width
    assert last.rows is None
    monkeypatch.setattr(monitor_py, "decode_records", real_decode)
    report = mon.report()
    mon.close()
    assert report.step == 6
    assert_histograms_of(report.histograms, scanned)
    assert last.fields == [None] and last.rows is not None  # the host copy replaces the device one


def test_steps_not_taken_keep_their_fields_and_the_report_shows_the_step_taken() -> None:
    g = fresh_generator()
    model = randomized(Mixed(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, histogram=True, history=6) as mon:
        for _ in range(2):
            opt.zero_grad()
            backward(model, g)
            taken = scanned_now(model)
            opt.step()
        for _ in range(2):  # backward passes that no optimizer step follows
            opt.zero_grad()
            backward(model, g)
        kept = [any(f is not None for f in r.fields) for r in mon._log.records]
        assert [r.stepped for r in mon._log.records] == [True, True, False]
        assert kept == [False, True, True]
        report = mon.report()
    assert report.step == 1
    assert_histograms_of(report.histograms, taken)


def test_without_any_step_the_latest_backward_pass_is_shown() -> None:
    g = fresh_generator()
    model = randomized(Mixed(), g)
    with Monitor(model, histogram=True) as mon:
        for _ in range(2):
            model.zero_grad()
            backward(model, g)
        grads = {k: t for k, t in scanned_now(model).items() if k.endswith(":grad")}
        report = mon.report()
    assert_histograms_of(report.histograms, grads)  # a backward pass scans the gradients alone


def test_histograms_follow_their_parameters_when_the_model_changes() -> None:
    g = fresh_generator()
    model = randomized(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, histogram=True) as mon:
        for _ in range(2):
            opt.zero_grad()
            backward(model, g)
            scanned = scanned_now(model)
            opt.step()
        model[0].bias = None  # the parameters after it are renumbered, their records with them
        report = mon.report()
    assert_histograms_of(report.histograms, {k: t for k, t in scanned.items() if not k.startswith("0.bias:")})


def test_a_tensor_scanned_in_another_form_keeps_that_forms_dtype() -> None:
    g = fresh_generator()

    class WithComplex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.phase = nn.Parameter(torch.ones(3, dtype=torch.complex64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.fc(x) * self.phase).real

    model = randomized(WithComplex(), g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Monitor(model, opt, histogram=True) as mon:
        opt.zero_grad()
        backward(model, g)
        scanned = scanned_now(model)
        opt.step()
        report = mon.report()
    # The scan reads a complex tensor as its real view: float32 pairs.
    assert_histograms_of(report.histograms, {
        k: torch.view_as_real(t) if t.is_complex() else t for k, t in scanned.items()
    })


def test_histogram_argument_is_checked() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="histogram must be a bool, got str"):
        Monitor(model, histogram="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="histogram must be a bool, got int"):
        Monitor(model, histogram=1)  # type: ignore[arg-type]


@pytest.fixture
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


def test_histogram_with_a_process_group_is_not_supported(one_rank_group: dist.ProcessGroup) -> None:
    with pytest.raises(NotImplementedError, match="histogram=True is not supported with a process_group"):
        Monitor(nn.Linear(2, 1), histogram=True, process_group=one_rank_group)
    Monitor(nn.Linear(2, 1), process_group=one_rank_group).close()  # histogram=False: as before
