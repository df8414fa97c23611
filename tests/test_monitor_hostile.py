"""zeroscan.Monitor on what a real model may hold, and report() at scale.

A parameter of a dtype the native scan does not read (uint16/32/64, the
float8 fnuz variants, quantized dtypes) is left out with one INFO finding,
and the rest of the model is still scanned. report() reads the kept steps
column-wise with numpy (zeroscan/monitor/table.py, series.py); its report
must equal the one a plain loop over decoded rows gives.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import zeroscan.monitor.compose as compose_module
import zeroscan.monitor.rules as rules_module
import zeroscan.monitor.steps as steps_module
from helpers import fresh_generator
from steps import step_past_freed_memory
from zeroscan import Cause, Monitor, Report, Severity, Thresholds
from zeroscan.monitor import GLOBAL_NAME, Slot
from zeroscan.monitor.series import tensor_dict
from zeroscan.monitor.step_record import Param, StepRecord
from zeroscan.ops import scannable_form

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

ODD_DTYPES = [
    getattr(torch, name)
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "quint8", "qint8", "qint32")
    if hasattr(torch, name)
]


def odd_tensor(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """n values of `dtype`, a dtype the native scan does not read."""
    if dtype in (torch.quint8, torch.qint8, torch.qint32):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated, and still met in checkpoints
            return torch.quantize_per_tensor(torch.rand(n), 0.1, 0, dtype)
    return torch.arange(n).to(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nan_report(odd: dict[str, torch.Tensor], g: torch.Generator, *, auto: bool = True) -> tuple[Report, nn.Module]:
    """Three steps of a small MLP holding the frozen parameters `odd` (on
    its first layer) whose second layer's bias gradient gets a NaN after
    backward: the NaN is seen only by the Monitor's scan at the step."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for name, t in odd.items():
        model[0].register_parameter(name, nn.Parameter(t, requires_grad=False))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with Monitor(model, opt if auto else None, auto=auto) as monitor:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 4, generator=g)).square().mean().backward()
            model[2].bias.grad[0] = math.nan
            if not auto:
                monitor.step()
            opt.step()
    return monitor.report(), model


def assert_rest_scanned(report: Report, model: nn.Module, odd: dict[str, torch.Tensor]) -> None:
    """The NaN is an ERROR, every tensor but the odd ones is scanned, and no
    finding claims a missing step or gradient."""
    errors = {(f.name, f.kind, f.cause) for f in report.detailed if f.severity == Severity.ERROR}
    assert ("2.bias", "grad", Cause.NONFINITE) in errors, str(report)
    scanned = {(t["name"], t["kind"]) for t in report.tensors}
    want = {(n, k) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] not in odd for k in ("grad", "weight")}
    assert scanned == want, str(report)
    assert {f.cause for f in report.findings if f.severity >= Severity.WARNING} == {Cause.NONFINITE}, str(report)
    grads = sum(1 for _, k in want if k == "grad")
    assert f" {grads} gradients, {len(want) - grads} weights scanned" in str(report).splitlines()[0]


@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=dtype_name)
def test_scannable_form_refuses_a_dtype_the_scan_does_not_read(dtype: torch.dtype) -> None:
    ready, why = scannable_form(odd_tensor(dtype))
    assert ready is None and dtype_name(dtype) in why, why


@pytest.mark.parametrize("auto", [True, False], ids=["optimizer_hook", "manual_step"])
@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=dtype_name)
def test_one_frozen_parameter_of_an_odd_dtype_is_left_out_alone(dtype: torch.dtype, auto: bool) -> None:
    odd = {"odd": odd_tensor(dtype)}
    report, model = nan_report(odd, fresh_generator(), auto=auto)
    assert_rest_scanned(report, model, odd)
    skipped = [f for f in report.findings if f.cause == Cause.NOT_SCANNED]
    assert [(f.name, f.kind, f.severity) for f in skipped] == [("0.odd", "weight", Severity.INFO)], str(report)
    assert skipped[0].message.startswith("0.odd ") and dtype_name(dtype) in skipped[0].message


def test_every_odd_parameter_is_named_in_one_finding() -> None:
    odd = {f"odd{k}": odd_tensor(d) for k, d in enumerate(ODD_DTYPES)}
    report, model = nan_report(odd, fresh_generator())
    assert_rest_scanned(report, model, odd)
    skipped = [f for f in report.findings if f.cause == Cause.NOT_SCANNED]
    assert [(f.name, f.kind, f.severity) for f in skipped] == [(GLOBAL_NAME, "param", Severity.INFO)], str(report)
    message = skipped[0].message
    assert message.startswith(f"{len(odd)} tensors are left out of this report"), message
    shown = list(odd.items())[:6]  # words.listed shows six, then "and N more"
    for name, t in shown:
        assert f"0.{name} ({dtype_name(t.dtype)})" in message
    if len(odd) > 6:
        assert f"and {len(odd) - 6} more" in message


# ---- memory freed under the Monitor (FSDP frees unsharded parameters with resize_(0)) ----


def free_gradient(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.untyped_storage().resize_(0)


@pytest.mark.parametrize("histogram", [False, True])
@pytest.mark.parametrize("what", ["weight", "grad", "weight and grad"])
def test_freed_memory_is_left_out_with_a_note(what: str, histogram: bool) -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    freed = model[0].weight
    monitor = Monitor(model, opt, histogram=histogram)
    step_past_freed_memory(opt)
    for step in range(3):
        opt.zero_grad()
        if step:  # the memory comes back for forward, as FSDP's all-gather gives it back
            freed.untyped_storage().resize_(freed.numel() * freed.element_size())
            with torch.no_grad():
                freed.normal_(generator=g)
        if "grad" in what:  # freed before the Monitor's scan at the end of backward
            handle = freed.register_post_accumulate_grad_hook(free_gradient)
        model(torch.randn(16, 4, generator=g)).square().mean().backward()
        if "grad" in what:
            handle.remove()
        if "weight" in what:
            freed.untyped_storage().resize_(0)
        norms = {name: float(p.detach().double().norm()) for name, p in model.named_parameters() if p is not freed}
        opt.step()
    report = monitor.report()
    notes = [f for f in report.findings if f.cause == Cause.NOT_SCANNED]
    left_out = {"weight": [("0.weight", "weight")], "grad": [("0.weight", "grad")],
                "weight and grad": [(GLOBAL_NAME, "param")]}[what]
    assert [(f.name, f.kind, f.severity) for f in notes] == [(n, k, Severity.INFO) for n, k in left_out], str(report)
    assert "has no data to scan" in notes[0].message and "0.weight" in notes[0].message
    scanned = {(t["name"], t["kind"]): t for t in report.tensors}
    gone = {("0.weight", k) for k in ("weight", "grad") if k in what}
    assert set(scanned) == {(n, k) for n, _ in model.named_parameters() for k in ("grad", "weight")} - gone, str(report)
    for name, norm in norms.items():  # the rest is scanned, and right
        assert scanned[(name, "weight")]["norm"] == pytest.approx(norm, rel=1e-6)
    assert not [f for f in report.findings if f.severity >= Severity.WARNING], str(report)


def test_a_gradient_freed_after_backward_keeps_its_row_from_backward() -> None:
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    step_past_freed_memory(opt)
    model(torch.randn(16, 4, generator=g)).square().mean().backward()
    want = float(model[0].weight.grad.double().norm())
    model[0].weight.grad.untyped_storage().resize_(0)  # freed between backward and the step
    opt.step()
    report = monitor.report()
    (row,) = [t for t in report.tensors if (t["name"], t["kind"]) == ("0.weight", "grad")]
    assert row["norm"] == pytest.approx(want, rel=1e-6)
    assert not [f for f in report.findings if f.severity >= Severity.WARNING], str(report)


def test_a_gradient_freed_before_its_read_at_the_step_is_left_out_with_a_note() -> None:
    """Once the Monitor reads gradients at optimizer.step() only (from the
    second step on here: monitor/deferred.py), a gradient freed between
    backward and the step has nothing left to read there: it is left out
    with the INFO note, where the first step keeps its row from backward."""
    g = fresh_generator()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, opt)
    step_past_freed_memory(opt)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(16, 4, generator=g)).square().mean().backward()
        if step == 1:
            model[0].weight.grad.untyped_storage().resize_(0)  # freed between backward and the step
        opt.step()
    report = monitor.report()
    (note,) = [f for f in report.findings if f.cause == Cause.NOT_SCANNED]
    assert (note.name, note.kind, note.severity) == ("0.weight", "grad", Severity.INFO)
    assert "has no data to scan" in note.message
    assert ("0.weight", "grad") not in {(t["name"], t["kind"]) for t in report.tensors}
    assert not [f for f in report.findings if f.severity >= Severity.WARNING], str(report)


# ---- report() read column-wise equals a plain loop over rows -------------------


class NaiveSeries:
    """What series.Series answers, by a plain loop over each record's decoded rows."""

    def __init__(self, records: list[StepRecord], params: int) -> None:
        self.records = records
        self.params = params
        self.grad_rows = 2 * np.arange(params)

    def _grads(self, i: int) -> list[dict[str, Any] | None]:
        return [r.row(Slot.grad(i)) for r in self.records]

    def zero_streak(self, i: int) -> int:
        streak = 0
        for g in reversed(self._grads(i)):
            if g is None or g["zeros"] != g["numel"]:
                break
            streak += 1
        return streak

    def zero_counts(self, i: int) -> list[int]:
        return [g["zeros"] for g in self._grads(i) if g is not None]

    def had_grad(self, i: int) -> int:
        return sum(g is not None for g in self._grads(i)[:-1])

    def _weight(self, r: StepRecord, i: int) -> tuple[int, ...] | None:
        return r.rows[Slot.weight(i)][1] if r.row(Slot.weight(i)) is not None else None  # type: ignore[index]

    def unchanged_for(self, i: int) -> int:
        last = self._weight(self.records[-1], i) if self.records else None
        count = 0
        for r in reversed(self.records):
            if last is None or self._weight(r, i) != last:
                break
            count += 1
        return count

    def weight_same_last(self, i: int) -> bool:
        if len(self.records) < 2:
            return False
        w0, w1 = self._weight(self.records[-2], i), self._weight(self.records[-1], i)
        return w0 is not None and w0 == w1

    def grad_norms(self) -> np.ndarray:
        return np.array([[math.nan if g is None else g["norm"] for g in self._grads(i)] for i in range(self.params)]).T

    def zero_fractions(self) -> tuple[np.ndarray, np.ndarray]:
        grads = [self._grads(i) for i in range(self.params)]
        fractions = [[g["zeros"] / g["numel"] if g is not None and g["numel"] else 0.0 for g in gs] for gs in grads]
        valid = [[g is not None and g["numel"] > 0 for g in gs] for gs in grads]
        return np.array(fractions).T, np.array(valid).T


def naive_nonfinite_grads(params: list[Param], r: StepRecord) -> list[str]:
    return [p.name for p in params if (g := r.row(Slot.grad(p.index))) is not None and g["nan"] + g["posinf"] + g["neginf"]]


def naive_tensor_rows(params: list[Param], rec: StepRecord) -> list[dict[str, Any]]:
    out = [
        tensor_dict(p.name, slot.kind, row)
        for p in params
        for slot in (Slot.grad(p.index), Slot.weight(p.index))
        if (row := rec.row(slot)) is not None
    ]
    return out + [tensor_dict(a.name, "activation", a.output) for a in rec.acts or []]


def naive_history(params: list[Param], shown: list[StepRecord]) -> dict[str, Any]:
    kept = [p for p in params if any(r.row(Slot.grad(p.index)) is not None for r in shown)]
    rows = [[r.row(Slot.grad(p.index)) for p in kept] for r in shown]

    def per(f: Any) -> list[list[float]]:
        return [[math.nan if g is None else f(g) for g in row] for row in rows]

    return {
        "steps": [r.step for r in shown],
        "names": [p.name for p in kept],
        "grad_norm": per(lambda g: g["norm"]),
        "zero_fraction": per(lambda g: g["zeros"] / g["numel"] if g["numel"] else 0.0),
        "subnormal_fraction": per(lambda g: g["subnormal"] / g["numel"] if g["numel"] else 0.0),
    }


class Varied(nn.Module):
    """A model whose steps give many kinds of findings: a dead ReLU layer, a
    parameter the loss ignores (zero gradient), an empty one, a gradient
    that decays (norm drift), one whose zeros grow, one in an lr-0 group."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.dead = nn.Linear(6, 5)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)
        self.relu = nn.ReLU()
        self.out = nn.Linear(5, 1)
        self.ignored = nn.Parameter(torch.ones(3))
        self.empty = nn.Parameter(torch.empty(0))
        self.decaying = nn.Parameter(torch.ones(4))
        self.masked = nn.Parameter(torch.ones(8))
        self.fixed = nn.Parameter(torch.ones(2))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = self.out(self.relu(self.dead(h))).sum() + h.square().mean()
        mask = torch.arange(8) >= min(self.step, 7)
        y = y + 0.0 * self.ignored.sum() + self.empty.sum() + (self.masked * mask).sum()
        return y + 0.5**self.step * self.decaying.square().sum() + self.fixed.sum()


def plain_report(monitor: Monitor) -> dict[str, Any]:
    """monitor.report(), with every column-wise read replaced by a plain loop over rows."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rules_module, "Series", NaiveSeries)
        patch.setattr(steps_module, "nonfinite_grads", naive_nonfinite_grads)
        patch.setattr(compose_module, "tensor_rows", naive_tensor_rows)
        patch.setattr(compose_module, "history", naive_history)
        return monitor.report().to_dict()


@pytest.mark.parametrize("history", [64, 5])
def test_report_read_columnwise_equals_a_plain_loop(history: int) -> None:
    g = fresh_generator()
    model = Varied()
    fixed = [model.fixed]
    rest = [p for p in model.parameters() if p is not model.fixed]
    opt = torch.optim.SGD([{"params": rest}, {"params": fixed, "lr": 0.0}], lr=1e-2)
    thresholds = Thresholds(drift_window=4, drift_factor=4.0, frozen_window=3, zero_window=2)
    monitor = Monitor(model, opt, history=history, activations=True, thresholds=thresholds)
    reports: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for k in range(12):
        model.step = k
        opt.zero_grad()
        x = torch.randn(8, 4, generator=g)
        if k in (3, 4):
            x[0, 0] = math.inf  # inf gradients; then, as GradScaler does, no step
        model(x).backward()
        if k in (3, 4):
            opt.zero_grad()
            continue
        if k >= 9:
            model.out.bias.grad[0] = math.nan
        if k == 7:
            model.masked.grad = None  # zero_grad() between backward and step, for one parameter
        opt.step()
        if k in (2, 6, 7, 11):
            reports.append((monitor.report().to_dict(), plain_report(monitor)))
    monitor.close()
    causes = {f["cause"] for columnwise, _ in reports for f in columnwise["findings"]}
    assert {"nonfinite", "exact_zero", "dead_units", "skipped_steps", "norm_drift", "conditional"} <= causes, causes
    assert {"not_updated", "frozen_in_time"} & causes, causes
    assert "zero_fraction_rising" in causes or history < 6, causes  # 6 steps kept: 4 taken, the window
    assert reports[-1][0]["history"]["steps"] == list(range(12))[-history:]
    for columnwise, plain in reports:
        assert repr(columnwise) == repr(plain)  # repr tells floats apart bit for bit, and numpy scalars from floats
