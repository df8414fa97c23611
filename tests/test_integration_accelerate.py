"""zeroscan.integrations.accelerate in a real Accelerate loop on CPU: the
tiny GPT-2 of frameworks.py, healthy or with one planted problem, trained a
few steps with accelerator.backward, clip_grad_norm_ and accumulate; the
reports go through log() to a recording tracker and to Python logging."""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import frameworks
from helpers import RecordingSink

accelerate = frameworks.require("accelerate")

import zeroscan.integrations.accelerate as za  # noqa: E402  (after the require above)
from accelerate.tracking import GeneralTracker  # noqa: E402
from zeroscan import Cause, Severity  # noqa: E402
from zeroscan.loggers import JsonlLogger, Sink  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

WATCHED = "transformer.wte.weight"  # trains under every planted problem (tied to the LM head)


class Recorder(GeneralTracker):  # type: ignore[misc]
    """A tracker that keeps what accelerator.log sends it."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def tracker(self) -> list[tuple[int | None, dict[str, Any]]]:
        return self.rows

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.rows.append((step, dict(values)))


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerator keeps its state (mixed precision, accumulation steps)
    process-wide; each test starts its own."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    yield
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


@dataclass
class Run:
    accelerator: Any
    monitor: Any
    optimizer: Any
    reports: list[Any] = field(default_factory=list)
    logged: list[dict[str, float]] = field(default_factory=list)
    synced: list[bool] = field(default_factory=list)  # per batch
    changed: list[bool] = field(default_factory=list)  # per batch: WATCHED changed in the step
    skipped: list[bool] = field(default_factory=list)  # per synced batch: optimizer.step_was_skipped


def train(
    problem: str = "healthy",
    *,
    batches: int = 6,
    log_every: int = 2,
    scaler: torch.amp.GradScaler | None = None,
    nan_at: int | None = None,
    monitor_options: dict[str, Any] | None = None,
    sinks: tuple[Sink, ...] = (),
    **accelerator_options: Any,
) -> Run:
    """Trains the tiny GPT-2 with `problem` planted for `batches` batches of 4,
    logging a report every `log_every` optimizer steps and after the last.
    nan_at: a NaN made in one module's forward at that optimizer step
    (frameworks.plant_nan_at); monitor_options: passed on to monitor();
    sinks: passed on to log()."""
    accelerator = accelerate.Accelerator(cpu=True, **accelerator_options)
    if scaler is not None:
        # Accelerate makes no GradScaler on CPU; one set before prepare() is used as
        # on a GPU under fp16: backward() scales the loss and the AcceleratedOptimizer
        # steps through scaler.step, which skips the step when it finds inf/NaN.
        accelerator.scaler = scaler
    accelerator.init_trackers("test")
    model = frameworks.plant(frameworks.tiny_gpt2(), problem)
    if nan_at is not None:
        frameworks.plant_nan_at(model, nan_at)
    optimizer = frameworks.optimizer(model, problem)
    data = torch.utils.data.DataLoader(frameworks.token_rows(4 * batches), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    monitor = za.monitor(accelerator, model, optimizer, **(monitor_options or {}))
    run = Run(accelerator, monitor, optimizer)
    watched = accelerator.unwrap_model(model).get_parameter(WATCHED)
    steps = 0
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if scaler is not None:
                    # What clip_grad_norm_ does itself under fp16 on a GPU (unscale_gradients),
                    # and leaves out here, where mixed_precision is "no".
                    scaler.unscale_(optimizer.optimizer)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            before = watched.detach().clone()
            optimizer.step()
            optimizer.zero_grad()
            run.changed.append(not torch.equal(before, watched.detach()))
        run.synced.append(accelerator.sync_gradients)
        if accelerator.sync_gradients:
            run.skipped.append(optimizer.step_was_skipped)
            steps += 1
            if steps % log_every == 0 or len(run.synced) == batches:
                run.reports.append(monitor.report())
                run.logged.append(za.log(accelerator, run.reports[-1], step=steps, sinks=sinks))
    monitor.close()
    return run


def tracked(run: Run) -> list[dict[str, Any]]:
    """What the recording tracker received, one dict per report."""
    (tracker,) = run.accelerator.trackers
    assert isinstance(tracker, Recorder)
    return [values for _, values in tracker.rows]


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("zeroscan") and r.levelno >= logging.WARNING]


def test_healthy_run_logs_zero_findings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zeroscan")
    tracker = Recorder()
    run = train(log_with=[tracker])
    assert len(tracker.rows) == len(run.reports) == 3
    assert [step for step, _ in tracker.rows] == [2, 4, 6]
    for values, returned in zip(tracked(run), run.logged):
        assert values == returned
        assert values["zeroscan.findings/error"] == 0
        assert values["zeroscan.findings/warning"] == 0
        assert math.isfinite(values["zeroscan.grad/zero_pct"])
        assert values["zeroscan.grad/scanned"] > 0
    assert not warnings_logged(caplog)
    assert run.reports[-1].findings == []
    assert run.monitor.steps_seen == 6


def test_log_lines_name_the_step_the_tracker_gets(caplog: pytest.LogCaptureFixture) -> None:
    """log(step=completed_steps) files the scalars at the loop's step; its log lines name
    that step too, not the Monitor's 0-based report.step (one less)."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    tracker = Recorder()
    run = train("frozen", batches=6, log_every=2, log_with=[tracker])
    summaries = [step for step, _, m in frameworks.lines(caplog, "") if re.search(r", \d+ findings$", m)]
    assert [step for step, _ in tracker.rows] == summaries == [2, 4, 6]
    assert [r.step for r in run.reports] == [1, 3, 5]  # the Monitor's own count is left as it is
    assert {step for step, _, _ in frameworks.lines(caplog, ": frozen: ")} == {2}


def test_a_finding_that_holds_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A frozen block is in every report, logged at every step here, and in the log once."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    run = train("frozen", batches=5, log_every=1, log_with=[Recorder()])
    assert len(run.reports) == 5 and all(values["zeroscan.findings/info"] >= 1 for values in tracked(run))
    frozen = frameworks.lines(caplog, ": frozen")
    first = frozen[0][0] if frozen else None
    assert frozen and {(step, level) for step, level, _ in frozen} == {(first, logging.INFO)}, frozen
    # Another Accelerator is another run: its findings are logged afresh.
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    caplog.clear()
    train("frozen", batches=1, log_every=1)
    assert len(frameworks.lines(caplog, ": frozen: ")) == len(frozen)


@pytest.mark.parametrize("problem", sorted(frameworks.PROBLEMS))
def test_planted_problem_reaches_tracker_and_logging(problem: str, caplog: pytest.LogCaptureFixture) -> None:
    cause, severity = frameworks.PROBLEMS[problem]
    level = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.ERROR: logging.ERROR}[severity]
    caplog.set_level(logging.INFO, logger="zeroscan")
    run = train(problem, batches=4, log_with=[Recorder()])
    report = run.reports[-1]
    names = frameworks.finding_names(report.to_dict()["findings"], problem)
    assert names, f"no {cause.value} finding: {report}"
    assert tracked(run)[-1][f"zeroscan.findings/{severity.name.lower()}"] >= 1
    records = [r for r in caplog.records if r.name == "zeroscan" and r.levelno == level]
    assert any(name in r.getMessage() and cause.value in r.getMessage() for r in records for name in names)


def test_accumulation_counts_optimizer_steps_not_batches(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zeroscan")
    run = train(batches=8, gradient_accumulation_steps=2, log_with=[Recorder()])
    assert run.synced == [False, True] * 4
    assert run.monitor.steps_seen == 4
    assert run.changed == run.synced  # the weights change on the synced batches only
    assert run.reports[-1].findings == []
    assert not warnings_logged(caplog)


def test_bf16_mixed_precision_healthy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zeroscan")
    run = train(batches=4, mixed_precision="bf16", log_with=[Recorder()])
    assert run.reports[-1].findings == []
    assert all(values["zeroscan.findings/warning"] == 0 for values in tracked(run))
    assert not warnings_logged(caplog)


def test_gradscaler_skipped_steps_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    # 2**127 overflows the first gradients; the scaler skips those steps,
    # halving its scale each time, until the gradients fit.
    caplog.set_level(logging.INFO, logger="zeroscan")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    run = train(batches=6, log_every=6, scaler=scaler, log_with=[Recorder()])
    skips = sum(run.skipped)
    assert run.skipped[:skips] == [True] * skips and skips >= 1 and not run.skipped[-1]
    assert run.changed == [not s for s in run.skipped]  # a skipped step leaves the weights as they were
    assert scaler.get_scale() == 2.0 ** (127 - skips)
    (finding,) = [f for f in run.reports[-1].findings if f.cause == Cause.SKIPPED_STEPS]
    # A few skips, then steps taken: a GradScaler calibrating its scale (INFO).
    assert finding.severity == Severity.INFO
    assert f"skipped at {skips} of 6 monitored steps" in finding.message
    assert tracked(run)[-1]["zeroscan.findings/info"] >= 1
    assert any(Cause.SKIPPED_STEPS.value in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert run.monitor.steps_seen == 6


def test_trace_nonfinite_names_where_a_planted_nan_was_born() -> None:
    """monitor(..., trace_nonfinite=True) passes the option on: a NaN made in one
    activation's forward at the loop's third optimizer step (the Monitor's step 2)
    is named there, in the unwrapped model's names; the reports before it have no origin."""
    run = train(batches=4, log_every=1, nan_at=2, monitor_options={"trace_nonfinite": True}, log_with=[Recorder()])
    assert run.monitor.steps_seen == 4 and [r.step for r in run.reports] == [0, 1, 2, 3]
    assert [r.nonfinite_origin is None for r in run.reports] == [True, True, False, False]
    assert [values["zeroscan.grad/nonfinite"] > 0 for values in tracked(run)] == [False, False, True, True]
    for report in run.reports[2:]:
        frameworks.assert_nan_born_at(report, frameworks.NAN_MODULE, 2)


def test_tensorboard_tracker_gets_the_scalars(tmp_path: Path) -> None:
    frameworks.require("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    run = train(batches=2, log_every=1, log_with="tensorboard", project_dir=str(tmp_path))
    run.accelerator.end_training()
    (events,) = tmp_path.rglob("events.out.tfevents.*")
    acc = event_accumulator.EventAccumulator(str(events.parent))
    acc.Reload()
    errors = acc.Scalars("zeroscan.findings/error")
    assert [(e.step, e.value) for e in errors] == [(1, 0.0), (2, 0.0)]
    assert "zeroscan.grad/zero_pct" in acc.Tags()["scalars"]


def test_a_user_sink_gets_what_the_tracker_gets(tmp_path: Path) -> None:
    """log(sinks=...): any object with log(scalars, step) is handed what the
    Accelerator's trackers get, at the same steps; so is a built-in JsonlLogger."""
    tracker, mine = Recorder(), RecordingSink()
    with JsonlLogger(tmp_path / "z.jsonl") as jsonl:
        run = train("frozen", batches=4, log_every=2, log_with=[tracker], sinks=(mine, jsonl))
    assert [(2, run.logged[0]), (4, run.logged[1])] == tracker.rows == mine.calls
    assert mine.calls[-1][1]["zeroscan.findings/info"] >= 1  # the frozen block
    lines = [json.loads(line) for line in (tmp_path / "z.jsonl").read_text().splitlines()]
    assert [(doc["step"], doc["scalars"]) for doc in lines] == mine.calls


def test_log_per_tensor_and_default_step() -> None:
    tracker = Recorder()
    run = train(batches=2, log_every=99, log_with=[tracker])
    values = za.log(run.accelerator, run.reports[-1], per_tensor=True)
    assert tracker.rows[-1] == (run.reports[-1].step, values)
    assert f"zeroscan.grad/norm/{WATCHED}" in values and f"zeroscan.grad/underflow_pct/{WATCHED}" in values
    assert "zeroscan.findings/error" in values


def test_log_without_trackers_still_logs_findings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zeroscan")
    run = train("frozen", batches=2)
    assert run.accelerator.trackers == []
    assert run.logged[-1]["zeroscan.findings/info"] >= 1
    assert any(r.levelno == logging.INFO and Cause.FROZEN.value in r.getMessage() for r in caplog.records)


def test_argument_errors_name_the_argument() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = frameworks.tiny_gpt2()
    optimizer = frameworks.optimizer(model, "healthy")
    # As DeepSpeed's wrapper: an AcceleratedOptimizer around an optimizer that is no torch Optimizer.
    no_torch_optimizer = accelerate.optimizer.AcceleratedOptimizer.__new__(accelerate.optimizer.AcceleratedOptimizer)
    no_torch_optimizer.optimizer = object()
    cases: list[tuple[Any, str]] = [
        (lambda: za.monitor(object(), model, optimizer), "accelerator must be an accelerate.Accelerator, got object"),
        (lambda: za.monitor(accelerator, "model", optimizer), "model must be a torch.nn.Module, got str"),
        (lambda: za.monitor(accelerator, model, [optimizer]), "optimizer must be a torch.optim.Optimizer"),
        (lambda: za.monitor(accelerator, model, optimizer, every=0), "every must be an int >= 1, got 0"),
        (lambda: za.monitor(accelerator, model, optimizer, every=True), "every must be an int >= 1, got True"),
        (lambda: za.monitor(accelerator, model, optimizer, histroy=8), "unexpected keyword argument(s) histroy"),
        (lambda: za.monitor(accelerator, model, no_torch_optimizer), "pass optimizer=None and call monitor.step()"),
        (lambda: za.log(None, {"findings": []}), "accelerator must be an accelerate.Accelerator, got NoneType"),
        (lambda: za.log(accelerator, [], step=1), "report must be a zeroscan Report or its to_dict() dict, got list"),
        (lambda: za.log(accelerator, {"step": 0}, step="1"), "step must be an int or None, got '1'"),
        (lambda: za.log(accelerator, {"step": 0}, sinks=[print]), "sinks[0] must have log(scalars, step)"),
        (lambda: za.log(accelerator, {"step": 0}, sinks=None), "sinks must be a list or tuple of sinks"),
    ]
    for call, message in cases:
        with pytest.raises((TypeError, ValueError)) as err:
            call()
        text = str(err.value)
        assert message in text and "\n" not in text, text
        assert text.startswith("zeroscan.integrations.accelerate."), text


def test_monitor_options_reach_the_monitor() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = frameworks.tiny_gpt2()
    optimizer = frameworks.optimizer(model, "healthy")
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = za.monitor(accelerator, model, optimizer, every=3, history=5, histogram=True)
    try:
        assert monitor.every == 3 and monitor.histogram
        assert monitor.optimizer is optimizer.optimizer  # the torch optimizer, not Accelerate's wrapper
        assert monitor.model is accelerator.unwrap_model(model)
    finally:
        monitor.close()


def test_missing_accelerate_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "zeroscan.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=r"zeroscan\[accelerate\]"):
        importlib.import_module("zeroscan.integrations.accelerate")
