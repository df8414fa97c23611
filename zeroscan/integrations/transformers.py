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
Right after each training log row, or, with `report_every`, after the first
such row at least that many steps past the last report, the callback does
two things:

- it sends each finding to Python logging (the "zeroscan" logger, at the
  finding's severity);
- it logs summary_scalars(report) through the Trainer's own log(), as a row
  of log_history at the same step that reaches every `report_to` integration
  (TensorBoard, W&B, MLflow, ...) and the console printer. That row is
  logged when the next step begins (or the epoch or training ends), so that
  it follows the Trainer's own row instead of being nested inside it.

At the end of training it does the same for the steps since the last
report, if any, then removes the Monitor's hooks. Its latest Report stays as `callback.report`.

A callback is not given its Trainer, so on_train_begin finds it on the call
stack: the Trainer whose callback handler holds this callback. Where none is
found (a loop that drives the callbacks itself), the scalars are not logged,
and one warning says so. With logging_strategy="no" there are no training
rows, so the only report comes at the end.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from zeroscan.integrations import common
from zeroscan.loggers import log_report
from zeroscan.monitor import Monitor, Report

transformers = common.require("transformers", "transformers", "zeroscan.integrations.transformers")

USER = "zeroscan.integrations.transformers.ZeroscanCallback"
STACK_DEPTH = 16  # frames searched for the Trainer, above on_train_begin


class ZeroscanCallback(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
    """A TrainerCallback that runs a zeroscan.Monitor over the Trainer's model.

    every: scan one optimizer step in `every` (Monitor's `every`).
    report_every: optimizer steps between reports. None (the default):
        a report at every training log row of the Trainer (logging_steps).
    per_tensor: also log zeroscan.loggers.scalars(report): a norm, zero %
        and underflow % per gradient (three scalars per parameter).
    prefix: the first part of every logged key ("zeroscan.findings/error").
    logger: where findings go (default logging.getLogger("zeroscan")).
    options: history, activations, thresholds, histogram, passed on
        to zeroscan.Monitor.
    """

    def __init__(
        self,
        *,
        every: int = 1,
        report_every: int | None = None,
        per_tensor: bool = False,
        prefix: str = "zeroscan",
        logger: logging.Logger | None = None,
        **options: Any,
    ) -> None:
        self.every, self.report_every, self.per_tensor, self.prefix, self.logger, self.options = (
            common.callback_settings(
                USER, every=every, report_every=report_every, per_tensor=per_tensor, prefix=prefix,
                logger=logger, options=options,
            )
        )
        self.monitor: Monitor | None = None
        self.report: Report | None = None
        self._trainer: Any = None
        self._auto = True  # the Monitor scans from the torch optimizer's step pre-hook
        self._reported_at = 0  # the Trainer's global_step at the last report
        self._steps_reported = 0  # the Monitor's steps_seen at the last report
        self._logging = False  # inside our own Trainer.log call
        self._pending: dict[str, float] | None = None  # scalars of a report, not yet logged

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
        self.report = None
        self._reported_at = state.global_step
        self._steps_reported = 0
        self._trainer = self._find_trainer()
        if self._trainer is None:
            self.logger.warning(
                "%s: no Trainer holding this callback was found on the call stack; "
                "findings go to Python logging only, and no scalars reach the Trainer's log", USER,
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and not self._auto and not self.monitor.closed:
            self.monitor.step()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # Only the Trainer's training rows ("loss"; evaluation rows have "eval_loss", the
        # end-of-training summary "train_loss"), and never the row this callback logs.
        if self._logging or self.monitor is None or self.monitor.closed or not logs or "loss" not in logs:
            return
        if self.report_every is not None and state.global_step - self._reported_at < self.report_every:
            return
        self._report(state, final=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None or self.monitor.closed:
            return
        if self.report is None or self.monitor.steps_seen > self._steps_reported:
            self._report(state, final=True)
        elif state.is_world_process_zero:  # nothing new since the last report, logged just now
            self.logger.info(
                "zeroscan: training ended at step %d; the report of that step (above) has %d findings",
                state.global_step, len(self.report.findings),
            )
        self._flush()
        self.monitor.close()

    # ---- reporting ------------------------------------------------------------------------

    def _report(self, state: Any, *, final: bool) -> None:
        """One report: its findings to Python logging now, its scalars to
        Trainer.log at the next _flush."""
        assert self.monitor is not None
        self.report = self.monitor.report()
        self._reported_at = state.global_step
        self._steps_reported = self.monitor.steps_seen
        rows = common.report_rows(self.report)
        self._pending = common.logged_scalars(rows, prefix=self.prefix, per_tensor=self.per_tensor)
        if state.is_world_process_zero:
            log_report(rows, self.logger, summary_level=logging.INFO if final else logging.DEBUG)

    def _flush(self) -> None:
        """Logs the scalars of the latest report through Trainer.log, once."""
        values, self._pending = self._pending, None
        if values is None or self._trainer is None:
            return
        self._logging = True
        try:
            self._trainer.log(values)
        finally:
            self._logging = False

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
