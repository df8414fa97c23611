"""zeroscan.loggers: dashboard scalars, the sinks (TensorBoard, JSON lines,
CSV, a user's own), logging, on hand-built report dicts and on a real Monitor."""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import RecordingSink, fresh_generator, train_monitored
from torch import nn

from zeroscan import loggers
from zeroscan.loggers import CsvLogger, JsonlLogger, TensorBoardSink, log_report, log_tensorboard, scalars


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
               "zero_fraction": [[0.0] * n, [0.1] * n], "subnormal_fraction": [[0.0] * n, [0.0] * n]}
    return {"step": step, "findings": findings, "tensors": tensors, "history": history}


def test_scalars_tags_and_values() -> None:
    """One tag scheme, {prefix}.{kind}/{quantity}/{name}: the per-tensor tags of a
    quantity sit under the model-wide one of the integrations (zeroscan.grad/zero_pct);
    underflow is the subnormal share alone."""
    report = hand_report(fresh_generator())
    got = scalars(report)
    grads = [t for t in report["tensors"] if t["kind"] == "grad"]
    want = {}
    for t in grads:
        want[f"zeroscan.grad/norm/{t['name']}"] = t["norm"]
        want[f"zeroscan.grad/zero_pct/{t['name']}"] = 100 * t["zero_fraction"]
        want[f"zeroscan.grad/underflow_pct/{t['name']}"] = 100 * t["subnormal_fraction"]
    want.update({"zeroscan.findings/error": 1.0, "zeroscan.findings/warning": 1.0, "zeroscan.findings/info": 1.0})
    assert got.keys() == want.keys()
    for tag, value in want.items():
        assert got[tag] == pytest.approx(value, rel=1e-12), tag
    weights = scalars(report, prefix="zs", kinds=("weight",))
    assert len([t for t in weights if t.startswith("zs.weight/norm/")]) == 5


def test_summary_scalars_are_of_the_whole_model() -> None:
    """summary=True adds the integrations' fixed handful: shares over all gradient
    elements (weighted by numel, not averaged per tensor), the non-finite count and
    the gradients scanned, under the same groups as the per-tensor tags."""
    report = hand_report(fresh_generator())
    grads = [t for t in report["tensors"] if t["kind"] == "grad"]
    grads[0]["nan"], grads[2]["inf"] = 3, 2
    numel = sum(t["numel"] for t in grads)
    got = scalars(report, summary=True, per_tensor=False)
    assert got == pytest.approx({
        "zeroscan.findings/error": 1.0, "zeroscan.findings/warning": 1.0, "zeroscan.findings/info": 1.0,
        "zeroscan.grad/scanned": float(len(grads)),
        "zeroscan.grad/zero_pct": 100 * sum(t["zero_fraction"] * t["numel"] for t in grads) / numel,
        "zeroscan.grad/underflow_pct": 100 * sum(t["subnormal_fraction"] * t["numel"] for t in grads) / numel,
        "zeroscan.grad/nonfinite": 5.0,
    }, rel=1e-12)
    both = scalars(report, summary=True)
    assert both == got | scalars(report)
    assert all(tag.startswith(("zeroscan.findings/", "zeroscan.grad/")) for tag in both)
    # With no gradient scanned, no share is made up: only the counts.
    no_grads = {"findings": [], "tensors": [t for t in report["tensors"] if t["kind"] == "weight"]}
    assert scalars(no_grads, summary=True, per_tensor=False) == {
        "zeroscan.findings/error": 0.0, "zeroscan.findings/warning": 0.0, "zeroscan.findings/info": 0.0,
        "zeroscan.grad/scanned": 0.0,
    }


def test_underflow_is_read_from_old_rows_too() -> None:
    """A tensor row names its underflow share subnormal_fraction; a saved report whose
    rows (or history) said underflow_fraction still gives the same scalar."""
    row = {"name": "w", "kind": "grad", "zero_fraction": 0.5, "subnormal_fraction": 0.25, "norm": 1.0}
    old = {k: v for k, v in row.items() if k != "subnormal_fraction"} | {"underflow_fraction": 0.25}
    for t in (row, old):
        assert loggers.underflow_fraction(t) == 0.25
        assert scalars({"tensors": [t]})["zeroscan.grad/underflow_pct/w"] == 25.0
    assert loggers.underflow_fraction({"name": "w"}) is None


def test_scalars_skip_missing_values_and_take_objects() -> None:
    report = hand_report(fresh_generator())
    report["tensors"][0]["norm"] = None

    class Fake:
        def to_dict(self) -> dict[str, Any]:
            return report

    got = scalars(Fake())
    assert "zeroscan.grad/norm/layer0.weight" not in got and "zeroscan.grad/zero_pct/layer0.weight" in got
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
    (event,) = acc.Scalars("zeroscan.grad/norm/layer0.weight")
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


def test_file_loggers_as_sinks(tmp_path: Path) -> None:
    """log(scalars, step): JSON lines {"step", "time", "scalars"}; CSV rows step, tag, value."""
    a, b = two_steps()
    with JsonlLogger(tmp_path / "s.jsonl") as jsonl, CsvLogger(tmp_path / "s.csv") as table:
        for report in (a, b):
            jsonl.log(scalars(report), report["step"])
            table.log(scalars(report), report["step"])
    docs = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(d["step"], d["scalars"]) for d in docs] == [(1, scalars(a)), (2, scalars(b))]
    assert all(set(d) == {"step", "time", "scalars"} for d in docs)
    with open(tmp_path / "s.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(loggers.SCALAR_CSV_COLUMNS)
    want = [(r["step"], tag, value) for r in (a, b) for tag, value in scalars(r).items()]
    assert [(int(r["step"]), r["tag"], float(r["value"])) for r in rows] == want


def test_a_csv_file_holds_rows_of_one_form(tmp_path: Path) -> None:
    """A table of tensors and a table of scalars have other columns: each needs its own file."""
    a, _ = two_steps()
    with CsvLogger(tmp_path / "tensors.csv") as table:
        table.log(a)
        with pytest.raises(ValueError, match=r"tensors.csv'\): the file has the columns step,name,.* cannot take scalars"):
            table.log(scalars(a), 1)
    with CsvLogger(tmp_path / "tensors.csv") as table:  # the form is read back from the file's header
        with pytest.raises(ValueError, match="cannot take scalars"):
            table.log(scalars(a), 1)
    with CsvLogger(tmp_path / "scalars.csv") as table:
        table.log(scalars(a), 1)
        with pytest.raises(ValueError, match="cannot take a report's per-tensor rows"):
            table.log(a)
    assert (tmp_path / "scalars.csv").read_text().count("step,tag,value") == 1


def test_log_report_levels(caplog: pytest.LogCaptureFixture) -> None:
    report = hand_report(fresh_generator(), step=5)
    log = logging.getLogger("zeroscan.test")
    with caplog.at_level(logging.DEBUG, logger="zeroscan.test"):
        assert log_report(report, log) == 3
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == logging.ERROR and "layer1.weight (grad): detached" in levels[0][1]
    assert levels[1][0] == logging.WARNING and levels[2][0] == logging.INFO
    # Gradients and weights counted apart, as zeroscan.grad/scanned counts the gradients.
    assert levels[3] == (logging.DEBUG, "zeroscan step 5: 4 gradients, 5 weights scanned, 3 findings")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="zeroscan.test"):
        log_report(report, log, step=6)  # a framework's step, named in every line
    assert all(r.getMessage().startswith("zeroscan step 6: ") for r in caplog.records)


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
    assert got["zeroscan.grad/norm/b.weight"] == pytest.approx(float(model.b.weight.grad.norm()), rel=1e-5)
    assert "zeroscan.grad/norm/a.weight" not in got  # detached: no gradient
    assert got["zeroscan.findings/error"] == 1  # one cut, one finding for a.weight and a.bias
    with JsonlLogger(tmp_path / "r.jsonl") as log:
        log.log(report)
    doc = json.loads((tmp_path / "r.jsonl").read_text())
    (cut,) = [f for f in doc["findings"] if "a.weight" in f.get("names", [])]
    assert cut["cause"] == "detached" and {m["name"]: m["cause"] for m in cut["members"]} == {
        "a.weight": "detached", "a.bias": "detached"}
    with CsvLogger(tmp_path / "r.csv") as log:
        log.log(report)
    rows = list(csv.DictReader(open(tmp_path / "r.csv", newline="")))
    assert {r["cause"] for r in rows if r["name"] == "a.weight"} == {"detached"}
    with caplog.at_level(logging.WARNING, logger="zeroscan"):
        log_report(report)
    assert any("a.weight (+1 more) (grad): detached" in r.getMessage() for r in caplog.records)


def test_a_user_sink_gets_what_the_built_in_loggers_write(tmp_path: Path) -> None:
    """Any object with log(scalars, step) is a sink: from a Monitor report it is
    handed exactly what TensorBoard (through log_tensorboard, the front door, and
    TensorBoardSink), the JSON lines and the CSV file write."""
    report, _ = monitored_report(fresh_generator())
    values = scalars(report)
    assert values["zeroscan.findings/error"] == 1  # a report with something to say
    mine, board, front = RecordingSink(), FakeWriter(), FakeWriter()
    with JsonlLogger(tmp_path / "s.jsonl") as jsonl, CsvLogger(tmp_path / "s.csv") as table:
        for sink in (mine, TensorBoardSink(board), jsonl, table):
            sink.log(values, report.step)
    log_tensorboard(front, report, histograms=False)
    ((step, got),) = mine.calls
    assert step == report.step == 2 and got == values
    written = [(tag, value, step) for tag, value in got.items()]
    assert board.calls == front.calls == written
    doc = json.loads((tmp_path / "s.jsonl").read_text())
    assert (doc["step"], doc["scalars"]) == (step, got)
    with open(tmp_path / "s.csv", newline="") as f:
        assert [(r["tag"], float(r["value"]), int(r["step"])) for r in csv.DictReader(f)] == written
    with pytest.raises(TypeError, match="TensorBoardSink: writer must have add_scalar .* got object"):
        TensorBoardSink(object())  # type: ignore[arg-type]


def test_history_names_underflow_as_the_rows_do(tmp_path: Path) -> None:
    """One quantity, one name: the history's per-step underflow share is
    "subnormal_fraction", as in the tensor rows, and its last step equals them."""
    report, _ = monitored_report(fresh_generator())
    with JsonlLogger(tmp_path / "h.jsonl", history=True) as log:
        log.log(report)
    history = json.loads((tmp_path / "h.jsonl").read_text())["history"]
    assert "underflow_fraction" not in history and "underflow_fraction" not in report.history
    rows = {t["name"]: t for t in report.tensors if t["kind"] == "grad"}
    last = dict(zip(history["names"], history["subnormal_fraction"][-1]))
    assert last and last == {name: rows[name]["subnormal_fraction"] for name in last}
    assert len(history["subnormal_fraction"]) == len(history["steps"]) == 3


# --- TensorBoard histograms (Monitor(histogram=True)) -----------------------------------


class FakeHistogramWriter(FakeWriter):
    """add_scalar and add_histogram_raw, with the parameters of torch's SummaryWriter."""

    def __init__(self) -> None:
        super().__init__()
        self.histograms: dict[str, dict[str, Any]] = {}

    def add_histogram_raw(
        self, tag: str, min: float, max: float, num: int, sum: float, sum_squares: float,
        bucket_limits: list[float], bucket_counts: list[int], global_step: int | None = None,
        walltime: float | None = None,
    ) -> None:
        assert tag not in self.histograms, f"{tag} written twice"
        self.histograms[tag] = {
            "min": min, "max": max, "num": num, "sum": sum, "sum_squares": sum_squares,
            "bucket_limits": list(bucket_limits), "bucket_counts": list(bucket_counts), "global_step": global_step,
        }


def test_fake_writer_has_the_signature_of_summary_writer() -> None:
    """add_histogram_raw's parameters as torch declares them (read from its source:
    importing torch.utils.tensorboard needs the tensorboard package)."""
    import ast
    import inspect

    source = Path(torch.__file__).parent / "utils" / "tensorboard" / "writer.py"
    tree = ast.parse(source.read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "add_histogram_raw"]
    declared = [a.arg for a in fn.args.args]
    assert declared == list(inspect.signature(FakeHistogramWriter.add_histogram_raw).parameters)


def histogram_report(g: torch.Generator, *, plant: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """A Monitor(histogram=True) report after two steps, and copies of the
    tensors it scanned at the last one; `plant` puts a NaN, a +inf and a -inf
    into the last step's gradient of 2.weight."""
    from zeroscan import Monitor

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, opt, histogram=True) as mon:
        for step in range(2):
            opt.zero_grad()
            scale = 10.0 ** float(torch.randint(-3, 3, (), generator=g))
            model(torch.randn(8, 4, generator=g) * scale).square().mean().backward()
            if plant and step == 1:
                grad = model[2].weight.grad
                grad[0, 0], grad[1, 1], grad[2, 2] = math.nan, math.inf, -math.inf
            scanned = {}
            for name, p in model.named_parameters():
                scanned[f"grad:{name}"] = p.grad.detach().clone()
                scanned[f"weight:{name}"] = p.detach().clone()
            opt.step()
        report = mon.report()
    return report, scanned


def assert_buckets_are_the_exact_counts(call: dict[str, Any], t: torch.Tensor) -> None:
    """Each bucket holds exactly the values of t whose |x| lies in it: 0 for
    the limit 0, (0, tiny) for the dtype's tiny, [previous, limit) above."""
    from zeroscan.histogram import reference_histogram

    a = t.detach().double().abs().flatten()
    a = a[torch.isfinite(a)]
    limits, counts = call["bucket_limits"], call["bucket_counts"]
    tiny = torch.finfo(t.dtype).tiny
    assert len(limits) == len(counts) and limits[:2] == [0.0, tiny]
    assert all(lo < hi for lo, hi in zip(limits, limits[1:]))
    assert all(math.log2(limit) == int(math.log2(limit)) for limit in limits[1:])  # powers of two
    want = [int((a == 0).sum()), int(((a > 0) & (a < tiny)).sum())]
    want += [int(((a >= lo) & (a < hi)).sum()) for lo, hi in zip(limits[1:], limits[2:])]
    assert counts == want
    assert sum(counts) == call["num"] == a.numel() == t.numel() - int((~torch.isfinite(t)).sum())
    ref = reference_histogram(t)
    by_limit = dict(zip(limits, counts))
    assert by_limit[0.0] == ref.zeros and by_limit[tiny] == ref.subnormal
    for e, n in zip(ref.exponents.tolist(), ref.counts.tolist()):
        assert by_limit.get(2.0 ** (e + 1), 0) == n, f"binade 2^{e}"
    finite = t.detach().double().flatten()
    finite = finite[torch.isfinite(finite)]
    assert call["min"] == float(t.detach().double().abs()[~torch.isnan(t)].min())
    # The scan's moments of float32 data agree with float64 torch to ~1e-6 (helpers.rtol_for).
    assert call["sum"] == pytest.approx(float(finite.sum()), rel=1e-6, abs=1e-9 * float(finite.abs().sum()))
    assert call["sum_squares"] == pytest.approx(float(finite.square().sum()), rel=1e-6)


def test_tensorboard_histograms_are_the_exact_counts() -> None:
    report, scanned = histogram_report(fresh_generator(), plant=False)
    w = FakeHistogramWriter()
    n = log_tensorboard(w, report, kinds=("grad", "weight"))
    assert set(w.histograms) == {f"zeroscan.{key.replace(':', '/magnitude/', 1)}" for key in scanned}
    for key, t in scanned.items():
        kind, name = key.split(":", 1)
        call = w.histograms[f"zeroscan.{kind}/magnitude/{name}"]
        assert call["global_step"] == report.step == 1
        assert_buckets_are_the_exact_counts(call, t)
        assert call["max"] == float(t.double().abs().max())
    scalar_calls = {tag: value for tag, value, _ in w.calls}
    assert n == len(w.calls) + len(w.histograms) == len(scalars(report, kinds=("grad", "weight"))) + 3 * len(scanned)
    for key in scanned:
        kind, name = key.split(":", 1)
        assert scalar_calls[f"zeroscan.{kind}/nan/{name}"] == 0.0 and scalar_calls[f"zeroscan.{kind}/inf/{name}"] == 0.0
    grads_only = FakeHistogramWriter()
    log_tensorboard(grads_only, report)
    assert set(grads_only.histograms) == {tag for tag in w.histograms if tag.startswith("zeroscan.grad/")}


def test_tensorboard_histograms_leave_nan_and_inf_to_scalars() -> None:
    report, scanned = histogram_report(fresh_generator(), plant=True)
    w = FakeHistogramWriter()
    log_tensorboard(w, report, kinds=("grad",))
    t = scanned["grad:2.weight"]
    call = w.histograms["zeroscan.grad/magnitude/2.weight"]
    assert_buckets_are_the_exact_counts(call, t)
    assert call["num"] == t.numel() - 3
    top = max(k for k, c in enumerate(call["bucket_counts"]) if c)
    assert call["max"] == call["bucket_limits"][top]  # the inf hides the largest finite |x|: the bucket's limit
    assert call["max"] > float(t[torch.isfinite(t)].abs().max())
    scalar_calls = {tag: value for tag, value, _ in w.calls}
    assert scalar_calls["zeroscan.grad/nan/2.weight"] == 1.0 and scalar_calls["zeroscan.grad/inf/2.weight"] == 2.0
    assert scalar_calls["zeroscan.grad/nan/0.weight"] == 0.0
    # A report replayed from its JSON (inf and NaN became null) draws the same histograms.
    from zeroscan.report_data import json_safe

    replay = FakeHistogramWriter()
    log_tensorboard(replay, json.loads(json.dumps(json_safe(report.to_dict()))), kinds=("grad",))
    assert replay.histograms == w.histograms and replay.calls == w.calls


def test_tensorboard_histograms_need_add_histogram_raw() -> None:
    report, _ = histogram_report(fresh_generator(), plant=False)
    w = FakeWriter()
    with pytest.raises(TypeError, match="writer must have add_histogram_raw .* got FakeWriter; pass histograms=False"):
        log_tensorboard(w, report)
    assert w.calls == []  # nothing written by the call that failed
    n = log_tensorboard(w, report, histograms=False)
    assert n == len(w.calls) and dict((t, v) for t, v, _ in w.calls) == scalars(report)
    with pytest.raises(TypeError, match="log_tensorboard_histograms: writer must have add_histogram_raw"):
        loggers.log_tensorboard_histograms(w, report)


def test_magnitude_histogram_at_the_edges_of_the_range() -> None:
    """float64's top binade ends at inf; a tensor of zeros and NaN has no binade;
    one of NaN alone has nothing to draw."""
    hist = {"min_exponent": -1022, "max_exponent": 1023, "binades": {"1023": 2, "-1022": 1, "0": 3},
            "zeros": 1, "subnormal": 4, "posinf": 0, "neginf": 0, "nan": 0}
    t = {"name": "w", "kind": "grad", "numel": 11, "nan": 0, "inf": 0, "mean": 1.0, "norm": 2.0,
         "min_abs": 0.0, "max_abs": 1.7e308, "histogram": hist}
    raw = loggers.magnitude_histogram(t)
    assert raw is not None
    assert raw.bucket_limits[:3] == [0.0, 2.0**-1022, 2.0**-1021] and raw.bucket_limits[-1] == math.inf
    assert len(raw.bucket_limits) == 2 + 2046 and sum(raw.bucket_counts) == raw.num == 11
    by_limit = dict(zip(raw.bucket_limits, raw.bucket_counts))
    edges = (0.0, 2.0**-1022, 2.0**-1021, 2.0, math.inf)
    assert [by_limit[limit] for limit in edges] == [1, 4, 1, 3, 2]
    assert (raw.min, raw.max, raw.sum, raw.sum_squares) == (0.0, 1.7e308, 11.0, 4.0)
    zeros = dict(hist, binades={}, zeros=5, subnormal=0, nan=2)
    raw = loggers.magnitude_histogram(dict(t, histogram=zeros, numel=7, min_abs=0.0, max_abs=0.0))
    assert raw is not None and raw.bucket_limits == [0.0, 2.0**-1022] and raw.bucket_counts == [5, 0]
    assert loggers.magnitude_histogram(dict(t, histogram=dict(zeros, zeros=0))) is None
    assert loggers.magnitude_histogram({k: v for k, v in t.items() if k != "histogram"}) is None


def test_tensorboard_histograms_real_summary_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    report, scanned = histogram_report(fresh_generator(), plant=True)
    with SummaryWriter(str(tmp_path)) as writer:
        log_tensorboard(writer, report)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    (event,) = acc.Histograms("zeroscan.grad/magnitude/2.weight")
    assert event.step == report.step and event.histogram_value.num == scanned["grad:2.weight"].numel() - 3
    (nan,) = acc.Scalars("zeroscan.grad/nan/2.weight")
    assert nan.value == 1.0
