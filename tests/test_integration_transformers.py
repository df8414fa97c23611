"""zeroscan.integrations.transformers.ZeroscanCallback on a real transformers
Trainer: a tiny GPT-2 from a config, a few steps on CPU (tests/frameworks.py)."""

from __future__ import annotations

import importlib
import logging
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import frameworks
from helpers import RecordingSink, example, fresh_seed
from zeroscan import Cause, Severity

pytestmark = pytest.mark.integration

transformers = frameworks.require("transformers")
frameworks.require("accelerate")  # the Trainer's own dependency
from zeroscan.integrations.transformers import ZeroscanCallback  # noqa: E402

SUMMARY = ("findings/error", "findings/warning", "findings/info", "grad/scanned", "grad/zero_pct")


class GradientWatch(transformers.TrainerCallback):  # type: ignore[misc]
    """Records, per optimizer step, what the Trainer did, for the tests to
    compare with what zeroscan logged: the exact-zero count and size of all
    gradients just before the step, whether the GradScaler skipped it, and
    whether one weight changed."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.zeros: list[tuple[int, int]] = []
        self.skipped: list[bool] = []
        self.changed: list[bool] = []
        self._before: torch.Tensor | None = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.zeros.append((sum(int((g == 0).sum()) for g in grads), sum(g.numel() for g in grads)))
        self._before = self.weight.detach().clone()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.skipped.append(bool(getattr(kwargs["optimizer"], "step_was_skipped", False)))
        assert self._before is not None
        self.changed.append(not torch.equal(self._before, self.weight))


def run(
    tmp_path: Path,
    problem: str = "healthy",
    callback: ZeroscanCallback | None = None,
    scaler: torch.amp.GradScaler | None = None,
    nan_at: int | None = None,
    **args: Any,
) -> tuple[Any, ZeroscanCallback, GradientWatch]:
    """Trains the tiny GPT-2 with `problem` planted (and with nan_at, a NaN
    made in one module's forward at that optimizer step: frameworks.plant_nan_at);
    returns the Trainer, the zeroscan callback and the GradientWatch."""
    model = frameworks.plant(frameworks.tiny_gpt2(), problem)
    if nan_at is not None:
        frameworks.plant_nan_at(model, nan_at)
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4, logging_steps=2,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
    )
    settings.update(args)
    callback = callback or ZeroscanCallback()
    watch = GradientWatch(model.get_parameter("transformer.h.0.mlp.c_fc.weight"))
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=frameworks.token_rows(64),
        eval_dataset=frameworks.token_rows(8, seed=2) if settings.get("eval_strategy") else None,
        callbacks=[callback, watch],
        optimizers=(frameworks.optimizer(model, problem), None),
    )
    if scaler is not None:
        # What Accelerate sets up for fp16 on a GPU (it gives a CPU none): the GradScaler
        # scales the loss, clip_grad_norm_ unscales, AcceleratedOptimizer steps through it.
        trainer.accelerator.scaler = scaler
        trainer.accelerator.native_amp = True
    trainer.train()
    return trainer, callback, watch


def zeroscan_rows(trainer: Any, prefix: str = "zeroscan") -> list[dict[str, Any]]:
    return [row for row in trainer.state.log_history if f"{prefix}.findings/error" in row]


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zeroscan" and r.levelno >= logging.WARNING]


def summary_steps(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The step each report's one-line summary ("zeroscan step 4: ..., 2 findings") names."""
    return [step for step, _, message in frameworks.lines(caplog, "") if re.search(r", \d+ findings$", message)]


def test_healthy_run_adds_zeroscan_to_each_training_row(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer, callback, watch = run(tmp_path)
    rows = zeroscan_rows(trainer)
    assert [r["step"] for r in rows] == [2, 4, 6]
    for row in rows:  # the Trainer's own row of the step
        assert "loss" in row and "learning_rate" in row, row
        assert all(f"zeroscan.{key}" in row for key in SUMMARY), row
        assert row["zeroscan.findings/error"] == row["zeroscan.findings/warning"] == 0, row
        assert row["zeroscan.grad/scanned"] == len(frameworks.trained_params(trainer.model, "healthy"))
    # The logged zero share is that of all gradients at the step, counted independently.
    zeros, numel = watch.zeros[5]
    assert rows[-1]["zeroscan.grad/zero_pct"] == pytest.approx(100.0 * zeros / numel, rel=1e-12, abs=1e-12)
    assert zeros > 0  # GPT-2's unused token rows: a share that a wrong sum would miss
    assert warnings_logged(caplog) == []
    assert callback.report is not None and callback.report.findings == []
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.state.global_step == 6
    assert callback.monitor.closed  # hooks removed at the end of training


def test_scalars_join_the_trainers_own_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Merged, not a row of their own: log_history has the rows it has without
    zeroscan, each training row with zeroscan's scalars in it, and the console
    (the Trainer's printer) prints no extra dict."""
    trainer, _, _ = run(tmp_path, logging_steps=2, max_steps=6)
    history = trainer.state.log_history
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rows = zeroscan_rows(trainer)
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert all("loss" in row for row in rows), history
    assert not [row for row in history if "zeroscan.findings/error" in row and "loss" not in row], history
    # Three training rows and the end-of-training row, as without zeroscan; each printed once.
    assert [row["step"] for row in history] == [2, 4, 6, 6] and "train_loss" in history[-1]
    assert len(printed) == len(history), printed
    assert all("zeroscan.findings/error" in line for line in printed if "'loss'" in line), printed


def test_everything_logged_names_the_trainers_global_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A report at global_step 2 is logged in log_history's row of step 2, and its log
    lines name step 2 too, not the Monitor's 0-based report.step (1)."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    trainer, callback, _ = run(tmp_path, "frozen", logging_steps=2, max_steps=6)
    rows = zeroscan_rows(trainer)
    assert [r["step"] for r in rows] == summary_steps(caplog) == [2, 4, 6]
    assert {step for step, _, _ in frameworks.lines(caplog, ": frozen: ")} == {2}
    assert callback.report is not None and callback.report.step == 5  # the Monitor's own count is left as it is


def test_a_finding_that_holds_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A frozen block is in every report (one per step here), and in the log once; the
    summary line says what each report scanned, with the count grad/scanned logs."""
    caplog.set_level(logging.DEBUG, logger="zeroscan")
    trainer, _, _ = run(tmp_path, "frozen", logging_steps=1, max_steps=5)
    rows = zeroscan_rows(trainer)
    reports = summary_steps(caplog)
    assert len(reports) == len(rows) == 5 and all(r["zeroscan.findings/info"] >= 1 for r in rows)
    frozen = frameworks.lines(caplog, ": frozen")
    assert [(step, level) for step, level, _ in frozen] == [(reports[0], logging.INFO)] * len(frozen), frozen
    assert reports == [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    logged = " ".join(m for _, _, m in frozen)
    assert all(f"{frameworks.PLANTED}.{name}" in logged for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight"))
    counted = [
        re.search(r": (\d+) gradients, (\d+) weights scanned, ", m) for _, _, m in frameworks.lines(caplog, " scanned, ")
    ]
    for match, row in zip(counted, rows, strict=True):
        assert match is not None and int(match[1]) == row["zeroscan.grad/scanned"], (match, row)


def test_scalars_reach_tensorboard_through_report_to(tmp_path: Path) -> None:
    frameworks.require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _, _ = run(tmp_path, report_to="tensorboard")
    (events,) = (tmp_path / "out").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    tag = "train/zeroscan.grad/zero_pct"  # the Trainer's TensorBoardCallback adds "train/"
    assert tag in accumulator.Tags()["scalars"], accumulator.Tags()["scalars"]
    logged = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    expected = [(r["step"], r["zeroscan.grad/zero_pct"]) for r in zeroscan_rows(trainer)]
    assert [s for s, _ in logged] == [s for s, _ in expected] == [2, 4, 6]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    # At the steps of the Trainer's own scalars of the same rows.
    assert [e.step for e in accumulator.Scalars("train/loss")] == [2, 4, 6]


@pytest.mark.parametrize("problem", sorted(frameworks.PROBLEMS))
def test_a_planted_problem_reaches_the_trainer_log_and_python_logging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, problem: str
) -> None:
    caplog.set_level(logging.INFO, logger="zeroscan")
    cause, severity = frameworks.PROBLEMS[problem]
    trainer, callback, _ = run(tmp_path, problem)
    assert callback.report is not None
    names = frameworks.finding_names(callback.report.to_dict()["findings"], problem)
    assert names, str(callback.report)
    assert any(n.startswith(frameworks.PLANTED) for n in names), names
    if problem in ("frozen", "not_in_optimizer"):  # NaN and a detached head reach beyond the block
        assert all(n.startswith(frameworks.PLANTED) for n in names), names
    last = zeroscan_rows(trainer)[-1]
    assert last["zeroscan.findings/" + severity.name.lower()] >= 1  # one per root cause, not one per name
    logged = [r.getMessage() for r in caplog.records if r.name == "zeroscan" and r.levelno == int(severity_level(severity))]
    assert any(cause.value in m and any(n in m for n in names) for m in logged), logged


def severity_level(severity: Severity) -> int:
    return {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.ERROR: logging.ERROR}[severity]


@pytest.mark.parametrize(
    "settings",
    [
        {"gradient_accumulation_steps": 2},
        {"activation_checkpointing": True},  # transformers < 5: gradient_checkpointing
        {"bf16": True},
        {"eval_strategy": "steps", "eval_steps": 2},
    ],
    ids=["accumulation", "checkpointing", "bf16", "evaluation"],
)
def test_healthy_variants_report_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture, settings: dict) -> None:
    trainer, callback, watch = run(tmp_path, **settings)
    assert trainer.model.is_activation_checkpointing == ("activation_checkpointing" in settings)
    assert warnings_logged(caplog) == []
    assert callback.report is not None and callback.report.findings == [], str(callback.report)
    # One Monitor step per optimizer step (not per micro-batch), each a real update.
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.state.global_step == 6
    assert watch.changed == [True] * 6
    assert [r["zeroscan.findings/error"] for r in zeroscan_rows(trainer)] == [0, 0, 0]


def test_steps_the_grad_scaler_skips_are_told_apart(tmp_path: Path) -> None:
    # fp16 overflows at a loss scale of 2^22 for this model: the first steps are skipped
    # while the scaler halves its scale, then training goes on.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
    trainer, callback, watch = run(tmp_path, scaler=scaler, fp16=True, max_steps=8)
    skipped = sum(watch.skipped)
    assert 0 < skipped < 8, watch.skipped
    assert [not c for c in watch.changed] == watch.skipped  # a skipped step leaves the weights
    assert callback.report is not None
    (finding,) = [f for f in callback.report.findings if f.cause == Cause.SKIPPED_STEPS]
    assert f"skipped at {skipped} of 8 monitored steps" in finding.message, finding.message
    assert finding.severity == Severity.INFO  # the run ends stepping: a scaler calibrating
    assert all(f.cause == Cause.SKIPPED_STEPS for f in callback.report.findings), str(callback.report)


def test_trace_nonfinite_names_where_a_planted_nan_was_born(tmp_path: Path) -> None:
    """ZeroscanCallback(trace_nonfinite=True) passes the option on: a NaN made in
    one activation's forward at the third optimizer step (the Monitor's step 2,
    the Trainer's global_step 3) is named there, in the Trainer's model's names."""
    callback = ZeroscanCallback(trace_nonfinite=True)
    trainer, callback, _ = run(tmp_path, callback=callback, nan_at=2, max_steps=4, logging_steps=1)
    assert callback.monitor is not None and callback.monitor.steps_seen == trainer.state.global_step == 4
    rows = zeroscan_rows(trainer)
    # The rows at global_step 1 and 2 report finite gradients; the NaN ones from 3 on.
    errors = [(r["step"], r["zeroscan.findings/error"] > 0) for r in rows]
    assert errors == [(1, False), (2, False), (3, True), (4, True)], errors
    assert callback.report is not None
    frameworks.assert_nan_born_at(callback.report, frameworks.NAN_MODULE, 2)


def test_report_every_spaces_the_reports(tmp_path: Path) -> None:
    trainer, _, _ = run(tmp_path, callback=ZeroscanCallback(report_every=3), logging_steps=1, max_steps=7)
    # Rows after the first training row at least 3 steps past the last report, and a
    # last one for the step the run ended on.
    assert [r["step"] for r in zeroscan_rows(trainer)] == [3, 6, 7]


def test_per_tensor_scalars_and_prefix(tmp_path: Path) -> None:
    mine = RecordingSink()
    trainer, _, _ = run(tmp_path, callback=ZeroscanCallback(per_tensor=True, prefix="zs", sinks=[mine]))
    # A user's sink gets what each row of the Trainer gets, at its step.
    rows = zeroscan_rows(trainer, prefix="zs")
    assert [(row["step"], {k: v for k, v in row.items() if k.startswith("zs.")}) for row in rows] == mine.calls
    assert [step for step, _ in mine.calls] == [2, 4, 6]
    row = rows[-1]
    assert "zs.grad/norm/transformer.h.0.mlp.c_fc.weight" in row
    assert math.isfinite(row["zs.grad/norm/transformer.h.0.mlp.c_fc.weight"])
    assert not any(k.startswith("zeroscan.") for k in row)
    # One tag scheme: the model-wide zero % and each gradient's sit under one group.
    zero_pct = [k for k in row if "zero_pct" in k]
    assert "zs.grad/zero_pct" in zero_pct and len(zero_pct) == 1 + len(frameworks.trained_params(trainer.model, "healthy"))
    assert all(k.startswith("zs.grad/zero_pct") for k in zero_pct), zero_pct


def test_without_training_rows_the_report_comes_at_the_end(tmp_path: Path) -> None:
    trainer, callback, _ = run(tmp_path, logging_strategy="no")
    assert [r["step"] for r in zeroscan_rows(trainer)] == [6]
    assert callback.monitor is not None and callback.monitor.steps_seen == 6


def test_a_second_train_call_gets_a_fresh_monitor(tmp_path: Path) -> None:
    trainer, callback, _ = run(tmp_path, max_steps=2)
    first = callback.monitor
    trainer.args.max_steps = 4
    trainer.train()
    assert callback.monitor is not first and first is not None and first.closed
    assert callback.monitor is not None and callback.monitor.steps_seen == 4
    assert callback.report is not None and callback.report.findings == []


def test_without_a_trainer_findings_still_reach_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    model = frameworks.plant(frameworks.tiny_gpt2(), "not_in_optimizer")
    opt = frameworks.optimizer(model, "not_in_optimizer")
    callback = ZeroscanCallback()
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    args = None  # the callback never reads the TrainingArguments
    callback.on_train_begin(args, state, control, model=model, optimizer=opt)
    assert any("no Trainer holding this callback" in m for m in warnings_logged(caplog))
    ids = torch.randint(0, frameworks.VOCAB, (2, frameworks.LENGTH))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    callback.on_train_end(args, state, control)
    assert any("not_in_optimizer" in m for m in warnings_logged(caplog))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every": 0}, "every must be an int >= 1, got 0"),
        ({"report_every": True}, "report_every must be an int >= 1 or None, got True"),
        ({"prefix": 3}, "prefix must be a str, got int"),
        ({"logger": "zeroscan"}, "logger must be a logging.Logger or None, got str"),
        ({"histogram": True, "warmup": 3}, "unexpected keyword argument(s) warmup"),
        ({"sinks": [print]}, "sinks[0] must have log(scalars, step)"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError)) as err:
        ZeroscanCallback(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "zeroscan.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'torch-zeroscan\[transformers\]'"):
        importlib.import_module("zeroscan.integrations.transformers")


def test_import_zeroscan_imports_no_framework() -> None:
    code = (
        "import sys, zeroscan, zeroscan.integrations; "
        "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_the_trainer_example() -> None:
    report, history = example("hf_trainer").run(seed=fresh_seed(), steps=4)
    mlp = frameworks.PLANTED
    assert len(report.findings) == 1  # one optimizer built too early: one finding for the MLP's four parameters
    assert {(f.name, f.cause, f.severity) for f in report.detailed} == {
        (f"{mlp}.{name}", Cause.NOT_IN_OPTIMIZER, Severity.WARNING)
        for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
    }, str(report)
    rows = [row for row in history if "zeroscan.findings/warning" in row]
    assert [(r["step"], r["zeroscan.findings/warning"]) for r in rows] == [(4, 1.0)]


def test_trl_sft_trainer_keeps_its_own_metrics(tmp_path: Path) -> None:
    # TRL is not among the pinned test dependencies (it brings datasets and pyarrow):
    # this runs where it is installed, and is skipped elsewhere, CI included.
    trl = pytest.importorskip("trl", reason="TRL is not in tests/pins.txt; checked where it is installed")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({str(i): i for i in range(frameworks.VOCAB)}, unk_token="0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1", unk_token="0")
    data = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in frameworks.token_rows(64)]})
    model = frameworks.plant(frameworks.tiny_gpt2(), "not_in_optimizer")
    callback = ZeroscanCallback()
    trainer = trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(
            output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        ),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[callback],
        optimizers=(frameworks.optimizer(model, "not_in_optimizer"), None),
    )
    trainer.train()
    rows = zeroscan_rows(trainer)
    assert [(r["step"], r["zeroscan.findings/warning"]) for r in rows] == [(2, 4.0), (4, 4.0)]
    # SFTTrainer.log adds its averaged metrics to the Trainer's rows; zeroscan's scalars join
    # those rows and leave SFTTrainer's metrics in them.
    trained = [r for r in trainer.state.log_history if "loss" in r]
    assert trained == rows and all("mean_token_accuracy" in r for r in trained)


def test_an_optimizer_that_cannot_be_hooked_steps_from_the_callback(caplog: pytest.LogCaptureFixture) -> None:
    # What DeepSpeed hands the Trainer: a wrapper around no torch Optimizer. The Monitor
    # cannot hook it, so the callback steps it at on_pre_optimizer_step instead.
    class Opaque:
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            self.inner = torch.optim.SGD(params, lr=0.1)

        def step(self) -> None:
            self.inner.step()

    model = frameworks.tiny_gpt2()
    opt = Opaque(list(model.parameters()))
    callback = ZeroscanCallback()
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback.on_train_begin(None, state, control, model=model, optimizer=opt)
    for _ in range(3):
        ids = torch.randint(0, frameworks.VOCAB, (2, frameworks.LENGTH))
        model(input_ids=ids, labels=ids).loss.backward()
        callback.on_pre_optimizer_step(None, state, control)
        opt.step()
        model.zero_grad()
    callback.on_train_end(None, state, control)
    assert callback.monitor is not None and callback.monitor.steps_seen == 3
    assert callback.report is not None and callback.report.findings == [], str(callback.report)
