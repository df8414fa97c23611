"""zeroscan in transformers' Trainer (and in TRL's trainers, which subclass it).

    from zeroscan.integrations.transformers import ZeroscanCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ZeroscanCallback()])

When training starts, the callback puts a zeroscan.Monitor on the Trainer's
model. The Monitor hooks the torch optimizer inside the Trainer's Accelerate
wrapper, so it scans every `every`-th optimizer step just before the update:
after gradient accumulation, after clipping and fp16 unscaling, right after
the Trainer's on_pre_optimizer_step. A step that the fp16 GradScaler skips
never reaches that optimizer; the Monitor records it as skipped and does not
count it as an update.

Reports follow the Trainer's own logging (TrainingArguments.logging_steps).
At each training log row, or, with `report_every`, at the first such row at
least that many steps past the last report, the callback does two things:

- it adds zeroscan.loggers.scalars(report, summary=True) (per-tensor ones
  only with per_tensor=True) to that row, through a RowSink: to the `logs`
  dict that on_log hands every callback, and to the row's copy in
  log_history, so they reach every `report_to` integration (TensorBoard,
  W&B, MLflow, ...) and the console printer in the Trainer's own row, and
  log_history has no row of zeroscan's alone (unless the row log_history
  ends with is not the copy of that `logs`, as in a Trainer that logs
  otherwise: then the scalars get a row of their own rather than join
  another); on the main process they also go to the callback's `sinks`;
- it sends to Python logging (the "zeroscan" logger, at the finding's
  severity) each finding when it first appears and when its severity
  changes, and a short INFO line when it clears: a finding that holds for
  the whole run is logged once, not at every report (common.LoggedFindings).

Trainer.log appends a copy of the row to log_history and only then calls
on_log, with the callbacks in their list's order: the report_to
integrations first, the callbacks given to the Trainer after them. So keys
added to `logs` would miss log_history and the integrations. The callback
therefore adds its scalars to the row's log_history copy too, and at the
start of training moves itself to the front of the Trainer's callback list,
so that its on_log runs before any other's.

At the end of training it reports the steps since the last report, if any,
in the Trainer's end-of-training row (train_loss, train_runtime, ...), then
removes the Monitor's hooks. Its latest Report stays as `callback.report`.
Where no such row reaches on_log (a loop that drives the callbacks itself),
on_train_end makes that report, for Python logging only.

Steps: the scalars and the log lines name the Trainer's state.global_step,
the number of optimizer steps taken, as the row's "step" in log_history
does (the report after the tenth step is at step 10), not the report's own
step, the Monitor's 0-based index of the step it scanned (9 there).

A callback is not given its Trainer, so on_train_begin finds it on the call
stack: the Trainer whose callback handler holds this callback. Where none is
found (a loop that drives the callbacks itself), the callback stays where it
is in the list, so callbacks before it get no scalars in on_log, and one
warning says so. With logging_strategy="no" there are no training rows, so
the only report comes at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from zeroscan.integrations import common
from zeroscan.monitor import Monitor

transformers = common.require("transformers", "transformers", "zeroscan.integrations.transformers")

USER = "zeroscan.integrations.transformers.ZeroscanCallback"
STACK_DEPTH = 16  # frames searched for the Trainer, above on_train_begin


class ZeroscanCallback(common.ReportingCallback, transformers.TrainerCallback):  # type: ignore[misc,name-defined]
    """A TrainerCallback that runs a zeroscan.Monitor over the Trainer's model.

    Its arguments (every, report_every, per_tensor, prefix, logger, sinks,
    and the Monitor's options) are those of common.ReportingCallback;
    report_every None makes a report at every training log row of the
    Trainer (logging_steps), and `sinks` get each report's scalars besides
    the Trainer's row.
    """

    USER = USER

    _trainer: Any = None  # the Trainer running this callback, found in on_train_begin
    _auto = True  # the Monitor scans from the torch optimizer's step pre-hook

    # ---- the Trainer's events --------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:  # a second train() on the same callback
            self.monitor.close()
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{USER}: the Trainer passed no model to on_train_begin, got {type(model).__name__}")
        inner = None if optimizer is None else common.unwrap_optimizer(optimizer)
        self._auto = isinstance(inner, torch.optim.Optimizer)
        # An optimizer that is no torch Optimizer (DeepSpeed's) cannot be hooked: then the
        # Monitor steps from on_pre_optimizer_step and has no optimizer checks.
        self.monitor = Monitor(model, inner if self._auto else None, self.every, auto=self._auto, **self.options)
        self._start_run(state.global_step)
        self._trainer = self._find_trainer()
        if self._trainer is None:
            self.logger.warning(
                "%s: no Trainer holding this callback was found on the call stack; its scalars reach "
                "only the rows whose on_log it runs in, and not the callbacks before it", USER,
            )
        else:
            # First in the list, so that the report_to integrations' on_log sees the scalars
            # this one's adds. A new list: the handler is iterating the old one right now.
            handler = self._trainer.callback_handler
            handler.callbacks = [self] + [cb for cb in handler.callbacks if cb is not self]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and not self._auto and not self.monitor.closed:
            self.monitor.step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # The Trainer's training rows ("loss"; evaluation rows have "eval_loss"), and its
        # end-of-training row ("train_loss"), which takes the steps since the last report.
        if self.monitor is None or self.monitor.closed or not logs:
            return
        if "loss" in logs:
            key, final = "loss", False
            if self.report_every is not None and state.global_step - self._reported_at < self.report_every:
                return
        elif "train_loss" in logs:
            key, final = "train_loss", True
            if not self._unreported():
                return
        else:
            return
        self.take_report(
            state.global_step, main_process=state.is_world_process_zero, final=final,
            sinks=[RowSink(logs, key, state.log_history)],
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None or self.monitor.closed:
            return
        if self._unreported():
            # No end-of-training row reached on_log (a loop that drives the callbacks itself):
            # the report's findings go to Python logging, and its scalars have no row to join
            # (they reach the callback's own sinks only).
            self.take_report(state.global_step, main_process=state.is_world_process_zero, final=True, sinks=[])
        elif state.is_world_process_zero and self.report is not None:  # nothing new since the last report
            self.logger.info(
                "zeroscan: training ended at step %d; the last report, of that step, has %d findings",
                state.global_step, len(self.report.findings),
            )
        self.monitor.close()

    # ---- finding the Trainer --------------------------------------------------------------

    def _find_trainer(self) -> Any:
        """The Trainer running this callback: on the call stack above
        on_train_begin (Trainer._inner_training_loop), holding this callback."""
        frame = sys._getframe(1)
        for _ in range(STACK_DEPTH):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if isinstance(owner, transformers.Trainer) and any(
                cb is self for cb in owner.callback_handler.callbacks
            ):
                return owner
            frame = frame.f_back
        return None


class RowSink:
    """The Trainer's log row being logged as a zeroscan.loggers.Sink: log(scalars, step)
    adds the scalars to the `logs` dict that on_log hands every callback, and to
    the row's copy in log_history."""

    def __init__(self, logs: dict[str, Any], key: str, history: list[dict[str, Any]]) -> None:
        self.logs, self.key, self.history = logs, key, history

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.logs.update(scalars)
        # Trainer.log appended {**logs, "step": global_step} to log_history before on_log:
        # that row, its last, gets the same keys. Where the last row is not the copy of
        # these logs (a Trainer that logs otherwise), the scalars get a row of their own.
        row = self.history[-1] if self.history else None
        if row is not None and row.get("step") == step and row.get(self.key) is self.logs[self.key]:
            row.update(scalars)
        else:
            self.history.append({**scalars, "step": step})
