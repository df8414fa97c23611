"""zeroscan.integrations.lightning: ZeroscanCallback in a real lightning.Trainer
on CPU, training the harness's tiny GPT-2 (tests/frameworks.py) for a few
steps, healthy or with one planted problem; what it logs is read back from a
CSVLogger's metrics.csv and from Python logging."""

from __future__ import annotations

import csv
import importlib
import logging
import re
import sys
from pathlib import Path
from typing import Any

import frameworks
import pytest
import torch
from helpers import RecordingSink
from torch.utils.data import DataLoader

from zeroscan import Cause, Severity, loggers

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

lightning = frameworks.require("lightning")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402  (needs the require above)
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from zeroscan.integrations.lightning import ZeroscanCallback  # noqa: E402

BATCH = 2
SUMMARY = ("findings/error", "findings/warning", "findings/info", "grad/zero_pct", "grad/underflow_pct",
           "grad/nonfinite", "grad/scanned")


class TinyGPT2(lightning.LightningModule):
    """The harness's GPT-2 as a LightningModule. training_step calls self(...),
    Lightning's idiom, so that the Monitor sees the module's forward pass."""

    def __init__(self, problem: str = "healthy") -> None:
        super().__init__()
        self.problem = problem
        self.model = frameworks.plant(frameworks.tiny_gpt2(), problem)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return frameworks.optimizer(self.model, self.problem)


class TwoOptimizers(TinyGPT2):
    """Manual optimization: the transformer blocks in one AdamW, the rest in another."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        blocks = list(self.model.transformer.h.parameters())
        in_blocks = {id(p) for p in blocks}
        rest = [p for p in self.model.parameters() if id(p) not in in_blocks]
        return [torch.optim.AdamW(blocks, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]


def fit(
    tmp_path: Path, module: lightning.LightningModule, callback: ZeroscanCallback, *, steps: int, **options: Any
) -> lightning.Trainer:
    """Trains `module` for `steps` optimizer steps on CPU, logging to a CSVLogger under tmp_path."""
    accumulate = int(options.get("accumulate_grad_batches", 1))
    data = DataLoader(frameworks.token_rows(BATCH * accumulate * steps), batch_size=BATCH)
    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback], **options,
    )
    trainer.fit(module, data)
    return trainer


def zeroscan_rows(trainer: lightning.Trainer, prefix: str = "zeroscan") -> list[dict[str, str]]:
    """The rows of the CSVLogger's metrics.csv that hold zeroscan's scalars."""
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get(f"{prefix}.findings/error")]


def zeroscan_records(caplog: pytest.LogCaptureFixture, level: int | None = None) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "zeroscan" and (level is None or r.levelno == level)]


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[tuple[int, int, str]]:
    """(step named, level, message) of each "zeroscan step N: ..." line that holds `text`."""
    out = []
    for r in zeroscan_records(caplog):
        match = re.match(r"zeroscan step (\d+): ", r.getMessage())
        if match and text in r.getMessage():
            out.append((int(match[1]), r.levelno, r.getMessage()))
    return out


def summary_steps(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The step each report's one-line summary ("zeroscan step 4: ..., 2 findings") names."""
    return [step for step, _, message in lines(caplog, "") if re.search(r", \d+ findings$", message)]


def test_healthy_run_logs_clean_scalars_at_every_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    callback = ZeroscanCallback()
    steps = 5
    trainer = fit(tmp_path, TinyGPT2(), callback, steps=steps)
    rows = zeroscan_rows(trainer)
    assert [int(row["step"]) for row in rows] == list(range(1, steps + 1))
    for row in rows:
        for key in SUMMARY:
            assert row[f"zeroscan.{key}"] != "", (row["step"], key)
        assert float(row["zeroscan.findings/error"]) == 0 and float(row["zeroscan.findings/warning"]) == 0, row
        assert float(row["zeroscan.grad/scanned"]) > 0 and float(row["zeroscan.grad/nonfinite"]) == 0, row
    # One DEBUG summary line per report, an INFO one at the end, and nothing at WARNING or above.
    summaries = [r.levelno for r in zeroscan_records(caplog) if r.getMessage().endswith(" 0 findings")]
    assert summaries == [logging.DEBUG] * steps + [logging.INFO]
    assert not [r.getMessage() for r in zeroscan_records(caplog) if r.levelno >= logging.WARNING]
    assert callback.report is not None and callback.report.findings == []
    assert callback.monitor is not None and callback.monitor.closed
    assert callback.monitor.steps_seen == trainer.global_step == steps


@pytest.mark.parametrize("problem", sorted(frameworks.PROBLEMS))
def test_planted_problem_reaches_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture, problem: str) -> None:
    caplog.set_level(logging.INFO, logger="zeroscan")
    cause, severity = frameworks.PROBLEMS[problem]
    callback = ZeroscanCallback()
    steps = 4
    trainer = fit(tmp_path, TinyGPT2(problem), callback, steps=steps)
    last = zeroscan_rows(trainer)[-1]
    assert int(last["step"]) == steps
    assert float(last[f"zeroscan.findings/{severity.name.lower()}"]) >= 1, last
    assert callback.report is not None
    names = frameworks.finding_names(callback.report.to_dict()["findings"], problem)
    # The parameters the planted problem is about: the planted block's, or under
    # "detached" those upstream of the cut, all of the transformer.
    under = "model.transformer." if problem == "detached" else f"model.{frameworks.PLANTED}."
    expected = {name for name in names if name.startswith(under)}
    assert expected, (cause, sorted(names))
    logged = " ".join(r.getMessage() for r in zeroscan_records(caplog, loggers.LOG_LEVELS[severity.name.lower()]))
    # One line per root cause: each finding that names an expected parameter is logged.
    for f in callback.report.to_dict()["findings"]:
        if expected & {str(m["name"]) for m in f.get("members") or [f]} and f["cause"] == cause.value:
            assert re.search(rf" {re.escape(f['name'])} \(\w+\): {cause.value}:", logged), f["name"]


def test_trace_nonfinite_names_where_a_planted_nan_was_born(tmp_path: Path) -> None:
    """ZeroscanCallback(trace_nonfinite=True) passes the option on: a NaN made in
    one activation's forward at the third optimizer step (the Monitor's step 2,
    global_step 3) is named there, by its name in the LightningModule."""
    module = TinyGPT2()
    name = frameworks.plant_nan_at(module.model, 2, prefix="model.")
    callback = ZeroscanCallback(trace_nonfinite=True)
    trainer = fit(tmp_path, module, callback, steps=4)
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.global_step == 4
    rows = zeroscan_rows(trainer)
    nonfinite = [(int(row["step"]), float(row["zeroscan.grad/nonfinite"]) > 0) for row in rows]
    assert nonfinite == [(1, False), (2, False), (3, True), (4, True)], nonfinite
    assert callback.report is not None
    frameworks.assert_nan_born_at(callback.report, name, 2)


class CallsSubmodule(TinyGPT2):
    """training_step calls the GPT-2 directly, bypassing the LightningModule's forward."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def test_training_step_that_bypasses_forward(tmp_path: Path) -> None:
    """The limit the module doc states: without the module's forward the Monitor cannot
    tell a detached parameter from one that backward never reached, but it still
    scans every step and flags those parameters."""
    callback = ZeroscanCallback()
    trainer = fit(tmp_path, CallsSubmodule("detached"), callback, steps=3)
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.global_step == 3
    assert callback.report is not None
    flagged = {f.name for f in callback.report.detailed if f.severity >= Severity.WARNING}
    assert "model.transformer.h.0.attn.c_attn.weight" in flagged, sorted(flagged)


class FailsAtSecondBatch(TinyGPT2):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("planted failure")
        return super().training_step(batch, batch_idx)


def test_failed_fit_removes_the_hooks(tmp_path: Path) -> None:
    callback = ZeroscanCallback()
    with pytest.raises(RuntimeError, match="planted failure"):
        fit(tmp_path, FailsAtSecondBatch(), callback, steps=3)
    assert callback.monitor is not None and callback.monitor.closed and callback.monitor.steps_seen == 1


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    callback = ZeroscanCallback()
    steps = 3
    trainer = fit(tmp_path, TinyGPT2(), callback, steps=steps, accumulate_grad_batches=2)
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.global_step == steps
    assert [int(row["step"]) for row in zeroscan_rows(trainer)] == [1, 2, 3]
    assert callback.report is not None and callback.report.findings == []


def test_report_every_and_final_report(tmp_path: Path) -> None:
    mine = RecordingSink()
    callback = ZeroscanCallback(report_every=2, per_tensor=True, prefix="zs", sinks=[mine])
    trainer = fit(tmp_path, TinyGPT2(), callback, steps=5)
    rows = zeroscan_rows(trainer, prefix="zs")
    # Steps 2 and 4, and the final report at the last step (5).
    assert [int(row["step"]) for row in rows] == [2, 4, 5]
    assert all(row["zs.grad/norm/model.transformer.h.1.mlp.c_fc.weight"] for row in rows)
    # A user's sink gets what the Trainer's CSVLogger writes, at its steps.
    written = [(int(row["step"]), {k: float(v) for k, v in row.items() if k.startswith("zs.") and v}) for row in rows]
    assert written == mine.calls


class StepLog(lightning.Callback):
    """trainer.global_step after each batch (after the zeroscan callback's report)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.steps.append(trainer.global_step)


def test_everything_logged_names_the_trainers_global_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """metrics.csv files zeroscan's scalars at trainer.global_step (5 after the fifth
    step); the log lines of the same report name that step too, not the Monitor's
    0-based report.step (4)."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    steps = StepLog()
    callback = ZeroscanCallback()
    data = DataLoader(frameworks.token_rows(BATCH * 5), batch_size=BATCH)
    trainer = lightning.Trainer(
        max_steps=5, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, steps],
    )
    trainer.fit(TinyGPT2("frozen"), data)
    assert steps.steps == [1, 2, 3, 4, 5]
    assert [int(row["step"]) for row in zeroscan_rows(trainer)] == steps.steps
    assert summary_steps(caplog) == steps.steps  # one summary line per report, naming its row's step
    assert {step for step, _, _ in lines(caplog, ": frozen: ")} == {1}
    assert callback.report is not None and callback.report.step == 4  # the Monitor's own count is left as it is


def test_the_summary_line_counts_what_grad_scanned_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One count, one name: the log line says how many gradients were scanned, the number
    zeroscan.grad/scanned logs, and the weights apart (not one sum of "tensors")."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    callback = ZeroscanCallback()
    trainer = fit(tmp_path, TinyGPT2("frozen"), callback, steps=2)
    counts = [re.search(r": (\d+) gradients, (\d+) weights scanned, ", m) for _, _, m in lines(caplog, " scanned, ")]
    rows = zeroscan_rows(trainer)
    assert len(counts) == len(rows) == 2
    for match, row in zip(counts, rows):
        assert match is not None
        assert int(match[1]) == float(row["zeroscan.grad/scanned"]) == 24  # the frozen block's 4 have none
        assert int(match[2]) == 28


def test_a_finding_is_logged_when_it_appears_and_when_it_clears(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Reports at every step: the frozen block is logged once, not at each report; unfrozen
    at the fourth batch (its parameters are in no optimizer), its "frozen" finding clears in
    one line and the new "not_in_optimizer" one is logged once."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    callback = ZeroscanCallback()
    fit(tmp_path, UnfrozenAtFourthBatch(), callback, steps=6)
    reports = summary_steps(caplog)
    assert len(reports) == 6
    frozen = lines(caplog, ": frozen")
    assert [(step, level) for step, level, _ in frozen] == [(reports[0], logging.INFO), (reports[3], logging.INFO)], frozen
    assert frozen[1][2].endswith(": frozen cleared (was info)")
    assert all(name in frozen[1][2] for name in block_names())
    moved = lines(caplog, ": not_in_optimizer: ")
    assert [(step, level) for step, level, _ in moved] == [(reports[3], logging.WARNING)], moved


def test_a_finding_is_logged_again_when_its_severity_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A block whose output is multiplied by 0 gets exactly-zero gradients: INFO at first
    (designs that start from zero train from the next step), a WARNING once it lasts
    (Thresholds.zero_window, 3 steps). Reported at every step, the finding is logged when
    it appears and when it becomes a warning, and not at the reports after."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    callback = ZeroscanCallback()
    fit(tmp_path, ZeroedBlock(), callback, steps=6)
    reports = summary_steps(caplog)
    assert len(reports) == 6
    zero = lines(caplog, ": exact_zero: ")
    assert zero[0][:2] == (reports[0], logging.INFO), zero
    assert max(step for step, _, _ in zero) <= reports[2], zero  # settled by the window's end: nothing after
    assert any(level == logging.WARNING and m.endswith("(was info)") for _, level, m in zero), zero
    assert callback.report is not None
    assert {f.severity for f in callback.report.findings if f.cause == Cause.EXACT_ZERO} == {Severity.WARNING}


def block_names() -> list[str]:
    """The planted block's parameters, as the LightningModule names them."""
    return [f"model.{frameworks.PLANTED}.{name}" for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")]


class UnfrozenAtFourthBatch(TinyGPT2):
    """The planted block frozen (left out of the optimizer), then unfrozen at the fourth batch."""

    def __init__(self) -> None:
        super().__init__("frozen")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            self.model.get_submodule(frameworks.PLANTED).requires_grad_(True)
        return super().training_step(batch, batch_idx)


class ZeroedBlock(TinyGPT2):
    """The planted block's output multiplied by 0: its gradients are exactly zero."""

    def __init__(self) -> None:
        super().__init__()
        self.model.get_submodule(frameworks.PLANTED).register_forward_hook(lambda module, args, out: out * 0.0)


def test_bf16_mixed_healthy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zeroscan")
    callback = ZeroscanCallback()
    trainer = fit(tmp_path, TinyGPT2(), callback, steps=4, precision="bf16-mixed")
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.global_step == 4
    assert callback.report is not None and callback.report.findings == []
    assert not zeroscan_records(caplog)


class WeightLog(lightning.Callback):
    """lm_head's weight before training and after each batch."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.weights.append(pl_module.model.lm_head.weight.detach().clone())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.weights.append(pl_module.model.lm_head.weight.detach().clone())


def test_grad_scaler_skips_are_told_apart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning refuses precision="16-mixed" on CPU, but runs its MixedPrecision plugin
    there with a CPU GradScaler. A loss scale of 2**20 overflows float16's gradients, so
    the first steps are skipped while the scaler halves its scale."""
    caplog.set_level(logging.INFO, logger="zeroscan")
    init = 20
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**init, growth_interval=1000)
    weights = WeightLog()
    callback = ZeroscanCallback()
    steps = 6
    trainer = lightning.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, log_every_n_steps=1,
        plugins=[MixedPrecision("16-mixed", device="cpu", scaler=scaler)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, weights],
    )
    trainer.fit(TinyGPT2(), DataLoader(frameworks.token_rows(BATCH * steps), batch_size=BATCH))
    unchanged = [torch.equal(a, b) for a, b in zip(weights.weights, weights.weights[1:])]
    skipped = sum(unchanged)
    assert len(unchanged) == steps and 0 < skipped < steps
    assert unchanged == [True] * skipped + [False] * (steps - skipped)  # skips come first, then it trains
    assert scaler.get_scale() == 2.0 ** (init - skipped)  # the scaler halved its scale once per skip
    assert callback.report is not None and callback.monitor is not None
    assert callback.monitor.steps_seen == steps
    (finding,) = [f for f in callback.report.findings if f.cause == Cause.SKIPPED_STEPS]
    # The Monitor counts exactly the steps whose weights stayed as they were.
    match = re.search(r"skipped at (\d+) of (\d+) monitored steps", finding.message)
    assert match is not None and (int(match[1]), int(match[2])) == (skipped, steps), finding.message
    assert [f for f in callback.report.findings if f.cause != Cause.SKIPPED_STEPS] == []
    assert any("skipped_steps" in r.getMessage() for r in zeroscan_records(caplog))


def test_several_optimizers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zeroscan")
    callback = ZeroscanCallback()
    batches = 3
    trainer = fit(tmp_path, TwoOptimizers(), callback, steps=2 * batches)
    assert callback.monitor is not None and callback.monitor.optimizer is None  # no optimizer checks
    # Lightning counts each optimizer's step in global_step; the Monitor one step per batch.
    assert trainer.global_step == 2 * batches and callback.monitor.steps_seen == batches
    assert zeroscan_rows(trainer), "no scalars logged"
    assert callback.report is not None and callback.report.findings == []
    assert not zeroscan_records(caplog)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": 0}, ValueError, "every must be an int >= 1, got 0"),
        ({"every": True}, ValueError, "every must be an int >= 1, got True"),
        ({"report_every": 0}, ValueError, "report_every must be an int >= 1 or None, got 0"),
        ({"report_every": 2.5}, ValueError, "report_every must be an int >= 1 or None, got 2.5"),
        ({"prefix": 3}, TypeError, "prefix must be a str, got int"),
        ({"histgram": True}, TypeError, "unexpected keyword argument(s) histgram"),
        ({"sinks": [print]}, TypeError, "sinks[0] must have log(scalars, step)"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        ZeroscanCallback(**kwargs)
    text = str(caught.value)
    assert message in text and "ZeroscanCallback" in text and "\n" not in text


def test_missing_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "zeroscan.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'torch-zeroscan\[lightning\]'"):
        importlib.import_module("zeroscan.integrations.lightning")
