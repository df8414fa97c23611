"""zeroscan.loggers: dashboard scalars, TensorBoard, JSON lines, CSV, logging
and the Lightning callback, on hand-built report dicts and on a real Monitor."""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_generator, train_monitored
from torch import nn

from zeroscan import loggers
from zeroscan.loggers import CsvLogger, JsonlLogger, log_report, log_tensorboard, scalars


def hand_report(g: torch.Generator, n: int = 5, step: int = 7) -> dict[str, Any]:
    """A Report.to_dict()-shaped dict with random values, one missing gradient and a NaN mean."""
    names = [f"layer{i}.weight" for i in range(n)]
    tensors = []
    for i, name in enumerate(names):
        for kind in ("grad", "weight"):
            if kind == "grad" and i == 1:
                continue  # no gradient for layer 1
            vals = torch.rand(6, generator=g, dtype=torch.float64).tolist()
            tensors.append({
                "name": name, "kind": kind, "numel": int(torch.randint(1, 1000, (), generator=g)),
                "zero_fraction": vals[0], "subnormal_fraction": vals[1] * 1e-3, "near_zero_fraction": vals[2] * 1e-2,
                "nan": 0, "inf": 0, "norm": vals[3] * 10 ** (-i), "mean": math.nan if i == 2 else vals[4],
                "std": vals[5], "min_abs": 0.0, "max_abs": 1.0,
            })
    findings = [
        {"name": names[1], "kind": "grad", "severity": "error", "cause": "detached", "message": "cut by .detach()"},
        {"name": names[2], "kind": "weight", "severity": "warning", "cause": "not_updated", "message": "same"},
        {"name": names[2], "kind": "grad", "severity": "info", "cause": "mostly_zero", "message": "zeros"},
    ]
    history = {"steps": [step - 1, step], "names": names, "grad_norm": [[1.0] * n, [2.0] * n],
               "zero_fraction": [[0.0] * n, [0.1] * n], "underflow_fraction": [[0.0] * n, [0.0] * n]}
    return {"step": step, "findings": findings, "tensors": tensors, "history": history}


def test_scalars_tags_and_values() -> None:
    report = hand_report(fresh_generator())
    got = scalars(report)
    grads = [t for t in report["tensors"] if t["kind"] == "grad"]
    want = {}
    for t in grads:
        want[f"zeroscan.grad_norm/{t['name']}"] = t["norm"]
        want[f"zeroscan.grad_zero_pct/{t['name']}"] = 100 * t["zero_fraction"]
        want[f"zeroscan.grad_underflow_pct/{t['name']}"] = 100 * t["subnormal_fraction"]
    want.update({"zeroscan.findings/error": 1.0, "zeroscan.findings/warning": 1.0, "zeroscan.findings/info": 1.0})
    assert got.keys() == want.keys()
    for tag, value in want.items():
        assert got[tag] == pytest.approx(value, rel=1e-12), tag
    weights = scalars(report, prefix="zs", kinds=("weight",))
    assert len([t for t in weights if t.startswith("zs.weight_norm/")]) == 5


def test_scalars_skip_missing_values_and_take_objects() -> None:
    report = hand_report(fresh_generator())
    report["tensors"][0]["norm"] = None

    class Fake:
        def to_dict(self) -> dict[str, Any]:
            return report

    got = scalars(Fake())
    assert "zeroscan.grad_norm/layer0.weight" not in got and "zeroscan.grad_zero_pct/layer0.weight" in got
    with pytest.raises(TypeError, match="report must be a zeroscan Report or its to_dict"):
        scalars(42)


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int | None]] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        self.calls.append((tag, scalar_value, global_step))


def test_log_tensorboard_with_any_writer() -> None:
    report = hand_report(fresh_generator(), step=12)
    w = FakeWriter()
    n = log_tensorboard(w, report)
    assert n == len(w.calls) == len(scalars(report))
    assert {step for _, _, step in w.calls} == {12}
    assert dict((t, v) for t, v, _ in w.calls) == scalars(report)
    w2 = FakeWriter()
    log_tensorboard(w2, report, step=99, prefix="x")
    assert {s for *_, s in w2.calls} == {99} and all(t.startswith("x.") for t, *_ in w2.calls)
    with pytest.raises(TypeError, match="writer must have add_scalar"):
        log_tensorboard(object(), report)  # type: ignore[arg-type]


def test_log_tensorboard_real_summary_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    report = hand_report(fresh_generator(), step=3)
    with SummaryWriter(str(tmp_path)) as writer:
        log_tensorboard(writer, report)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set(scalars(report))
    (event,) = acc.Scalars("zeroscan.grad_norm/layer0.weight")
    assert event.step == 3 and event.value == pytest.approx(report["tensors"][0]["norm"], rel=1e-6)


def two_steps() -> tuple[dict[str, Any], dict[str, Any]]:
    """Reports of steps 1 and 2, with fresh random values."""
    g = fresh_generator()
    return hand_report(g, step=1), hand_report(g, step=2)


def test_jsonl_logger(tmp_path: Path) -> None:
    a, b = two_steps()
    path = tmp_path / "zs.jsonl"
    with JsonlLogger(path) as log:
        log.log(a)
        log.log(b)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    docs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}")) for line in lines]
    assert [d["step"] for d in docs] == [1, 2] and all("history" not in d and "time" in d for d in docs)
    assert docs[0]["findings"] == a["findings"]
    mean_nan = [t for t in docs[0]["tensors"] if t["name"] == "layer2.weight"]
    assert mean_nan and all(t["mean"] is None for t in mean_nan)
    with JsonlLogger(path, history=True) as log:  # appends
        log.log(a)
    assert len(path.read_text().splitlines()) == 3 and "history" in json.loads(path.read_text().splitlines()[-1])
    with JsonlLogger(path, mode="w") as log:
        log.log(b)
    assert len(path.read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="is closed"):
        log.log(a)
    with pytest.raises(ValueError, match="mode must be"):
        JsonlLogger(path, mode="r")


def test_csv_logger(tmp_path: Path) -> None:
    a, b = two_steps()
    path = tmp_path / "zs.csv"
    with CsvLogger(path) as log:
        log.log(a)
    with CsvLogger(path) as log:  # a second run appends without a second header
        log.log(b)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(loggers.CSV_COLUMNS)
    assert len(rows) == len(a["tensors"]) + len(b["tensors"])
    assert [r["step"] for r in rows] == ["1"] * len(a["tensors"]) + ["2"] * len(b["tensors"])
    first = rows[0]
    t = a["tensors"][0]
    assert first["name"] == t["name"] and float(first["norm"]) == pytest.approx(t["norm"], rel=1e-12)
    by = {(r["step"], r["name"], r["kind"]): r for r in rows}
    assert by[("1", "layer1.weight", "weight")]["severity"] == "error"  # its gradient is missing
    assert by[("1", "layer2.weight", "grad")]["cause"] == "not_updated"  # the worst of two
    assert by[("1", "layer0.weight", "grad")]["severity"] == ""


def test_log_report_levels(caplog: pytest.LogCaptureFixture) -> None:
    report = hand_report(fresh_generator(), step=5)
    log = logging.getLogger("zeroscan.test")
    with caplog.at_level(logging.DEBUG, logger="zeroscan.test"):
        assert log_report(report, log) == 3
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == logging.ERROR and "layer1.weight (grad): detached" in levels[0][1]
    assert levels[1][0] == logging.WARNING and levels[2][0] == logging.INFO
    assert levels[3] == (logging.DEBUG, f"zeroscan step 5: {len(report['tensors'])} tensors, 3 findings")


# --- with a real Monitor -----------------------------------------------------------------


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).detach())


def monitored_report(g: torch.Generator, steps: int = 3) -> Any:
    model = Detached()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_monitored(model, opt, g, steps=steps), model


def test_loggers_on_a_real_monitor_report(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    g = fresh_generator()
    report, model = monitored_report(g)
    got = scalars(report)
    assert got["zeroscan.grad_norm/b.weight"] == pytest.approx(float(model.b.weight.grad.norm()), rel=1e-5)
    assert "zeroscan.grad_norm/a.weight" not in got  # detached: no gradient
    assert got["zeroscan.findings/error"] >= 2
    with JsonlLogger(tmp_path / "r.jsonl") as log:
        log.log(report)
    doc = json.loads((tmp_path / "r.jsonl").read_text())
    assert {f["cause"] for f in doc["findings"] if f["name"] == "a.weight"} == {"detached"}
    with CsvLogger(tmp_path / "r.csv") as log:
        log.log(report)
    rows = list(csv.DictReader(open(tmp_path / "r.csv", newline="")))
    assert {r["cause"] for r in rows if r["name"] == "a.weight"} == {"detached"}
    with caplog.at_level(logging.WARNING, logger="zeroscan"):
        log_report(report)
    assert any("a.weight (grad): detached" in r.getMessage() for r in caplog.records)


# --- Lightning ---------------------------------------------------------------------------


@pytest.fixture
def fake_lightning(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in for lightning.pytorch with just its Callback base class."""

    class Callback:
        pass

    package = types.ModuleType("lightning")
    module = types.ModuleType("lightning.pytorch")
    module.Callback = Callback  # type: ignore[attr-defined]
    package.pytorch = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning", package)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", module)
    return Callback


def test_lightning_callback(fake_lightning: type) -> None:
    g = fresh_generator()
    model = Detached()
    logged: list[dict[str, float]] = []
    model.log_dict = logged.append  # type: ignore[attr-defined]
    params = [model.a.weight, model.a.bias, model.b.weight]  # b.bias left out of the optimizer
    opt = torch.optim.SGD(params, lr=0.1)
    trainer = types.SimpleNamespace(optimizers=[opt])
    cb = loggers.lightning_callback(log_every=2)
    assert isinstance(cb, fake_lightning)
    cb.on_fit_start(trainer, model)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        cb.on_before_optimizer_step(trainer, model, opt)
        opt.step()
    cb.on_fit_end(trainer, model)
    assert len(logged) == 2 and "zeroscan.grad_norm/b.weight" in logged[0]
    causes = {(f.name, f.cause) for f in cb.report.findings}
    assert ("a.weight", "detached") in causes and ("b.bias", "not_in_optimizer") in causes
    assert cb.monitor.closed


def test_lightning_callback_needs_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(ImportError, match="pip install lightning"):
        loggers.lightning_callback()
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        loggers.lightning_callback(log_every=0)
