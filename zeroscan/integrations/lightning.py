"""zeroscan in Lightning's Trainer: a Callback that runs a zeroscan.Monitor
over the LightningModule and sends its reports to the Trainer's loggers.

    from zeroscan.integrations.lightning import ZeroscanCallback
    trainer = lightning.Trainer(callbacks=[ZeroscanCallback()])

When training starts, the callback puts a Monitor on the LightningModule.
It steps the Monitor once per optimizer step, after backward and before the
update (after gradient accumulation; Lightning's usual path runs backward
inside the torch optimizer's step(), so this is before gradient clipping,
and under a GradScaler after unscaling and clipping). A step that a
GradScaler skips is recorded as skipped, not as an update. With several
optimizers (manual optimization) it steps the Monitor once per training
batch, at the batch's first optimizer step, and makes no optimizer checks
(not_in_optimizer, lr 0).

Reports follow the Trainer's own logging: at each `log_every_n_steps`-th
optimizer step (trainer.global_step), or every `report_every` steps when
given, the callback

- logs zeroscan.loggers.scalars(report, summary=True) (per-tensor ones
  only with per_tensor=True) through each of the Trainer's loggers
  (Logger.log_metrics at trainer.global_step, each as a LoggerSink), and,
  on the global-zero process, to the callback's own `sinks`;
- on the global-zero process, sends to Python logging (the "zeroscan"
  logger, at the finding's severity: warnings and errors show by default)
  each finding when it first appears and when its severity changes, and a
  short INFO line when it clears: a finding that holds for the whole run
  is logged once, not at every report (common.LoggedFindings).

When training ends it does the same for the steps since the last report,
if any, then removes the Monitor's hooks. Its latest Report stays as `callback.report`.

Steps: the scalars and the log lines name trainer.global_step, the number
of optimizer steps taken, as ModelCheckpoint counts them (the report after
the fifth step is at step 5), not the report's own step, the Monitor's
0-based index of the step it scanned (4 there). With several optimizers,
global_step counts each optimizer's steps. What training_step logs with
self.log, Lightning files under the batches that stepped before it (4
there), so in metrics.csv such a row sits one step before zeroscan's.

Limits: the Monitor's cause analysis (why a gradient is None) and its check
for skipped steps watch the LightningModule's own forward, so training_step
should call the model through `self(...)`, Lightning's idiom. Where it calls
a submodule directly (`self.model(...)`), every gradient and weight is
still scanned, but a detached parameter is reported as "no_backward" (a
warning) rather than "detached" (an error), and a step that a GradScaler
skips goes unrecorded. An optimizer that runs its closure several times per
step (LBFGS) has several backward passes per step, and the Monitor takes
the extra ones for skipped steps. The Monitor is this process's own: in a multi-process run each process
monitors its replica or shard.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from zeroscan.integrations import common
from zeroscan.monitor import Monitor

USER = "zeroscan.integrations.lightning.ZeroscanCallback"

# Imported now, so that without Lightning the import of this module fails with
# an error that names zeroscan's extra. The older standalone pytorch_lightning
# package has the same Callback and Trainer API, so it serves where it is the
# one installed.
try:
    pl = common.require("lightning.pytorch", "lightning", "zeroscan.integrations.lightning")
except ImportError as missing:
    try:
        pl = importlib.import_module("pytorch_lightning")
    except ImportError:
        raise missing from missing.__cause__

__all__ = ["ZeroscanCallback"]


class ZeroscanCallback(common.ReportingCallback, pl.Callback):  # type: ignore[misc,name-defined]
    """A Lightning Callback that runs a zeroscan.Monitor over the LightningModule.

    Its arguments (every, report_every, per_tensor, prefix, logger, sinks,
    and the Monitor's options) are those of common.ReportingCallback;
    report_every None follows the Trainer's log_every_n_steps, and `sinks`
    get each report's scalars besides the Trainer's loggers.

    After fit(), `monitor` is the (closed) Monitor of the run and `report`
    its latest Report (None before the first).
    """

    USER = USER

    # Set for each fit() in on_fit_start; these values stand before the first.
    _hooks: Sequence[RemovableHandle] = ()  # the callback's step hooks on the optimizers
    _several = False  # several optimizers: one Monitor step per batch
    _batch_scanned = False  # the Monitor has stepped in this batch
    _inside: set[int]  # optimizers (by id) whose step() runs its closure
    _closure_ran: set[int]  # optimizers whose closure ran before their step()
    _checked_at = 0  # trainer.global_step when on_train_batch_end last looked

    # ---- the Trainer's events --------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._stop()  # a second fit() with the same callback
        optimizers = [common.unwrap_optimizer(o) for o in trainer.optimizers]
        # The Monitor's optimizer checks (not_in_optimizer, lr 0) compare the model with one
        # optimizer's parameters: with several, each would flag the others' parameters. The
        # stand-in Lightning uses when configure_optimizers returns None holds none.
        holding = [o for o in optimizers if any(group["params"] for group in o.param_groups)]
        self._several = len(optimizers) > 1
        # auto=False: the callback steps the Monitor (_scan_point says when), since Lightning
        # runs backward inside the torch optimizer's step() on most paths, after the step
        # pre-hook where an auto Monitor would scan.
        self.monitor = Monitor(
            pl_module, holding[0] if len(holding) == 1 else None, self.every, auto=False, **self.options
        )
        hooks: list[RemovableHandle] = []
        self._hooks = hooks  # filled one by one: a registration that raises leaves the others removable
        for o in optimizers:
            hooks.append(o.register_step_pre_hook(self._optimizer_step_starts))
            hooks.append(o.register_step_post_hook(self._optimizer_step_ends))
        self._inside = set()
        self._closure_ran = set()
        self._start_run(trainer.global_step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Here rather than in on_fit_start: a resumed fit() restores global_step in between.
        self._checked_at = self._reported_at = trainer.global_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_scanned = False

    # ---- when the Monitor steps -----------------------------------------------------------
    # The Monitor scans once per optimizer step, after backward and before the update.
    # Lightning runs an optimizer step in one of two orders:
    #   - optimizer.step(closure): the torch step starts (its pre-hook runs), then the
    #     closure runs training_step, backward and on_before_optimizer_step, then the
    #     update. This is Lightning's usual path (32-bit, bf16, manual optimization).
    #   - closure first, then optimizer.step() (a GradScaler: MixedPrecision "16-mixed"):
    #     backward, unscaling, on_before_optimizer_step and clipping run before the torch
    #     step, and the step (with its pre-hook) runs only where the scaler takes it.
    # So the Monitor steps at whichever of on_before_optimizer_step and the step pre-hook
    # comes second: after backward, before the update, and never for a step the scaler
    # skips, which the Monitor then records as skipped. The order is seen as it happens,
    # per optimizer, rather than guessed from the precision plugin.

    def _optimizer_step_starts(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._closure_ran:
            self._closure_ran.discard(id(optimizer))
            self._scan_point()
        else:
            self._inside.add(id(optimizer))  # the closure, with backward, runs inside this step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        key = id(common.unwrap_optimizer(optimizer))
        if key in self._inside:
            self._inside.discard(key)
            self._scan_point()
        else:
            self._closure_ran.add(key)  # the step follows, unless a GradScaler skips it

    def _optimizer_step_ends(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        if key in self._inside:
            # A step that never reached on_before_optimizer_step: the torch optimizer was
            # stepped directly (manual optimization with use_pl_optimizer=False). Scanned
            # late, after the update, rather than not at all: the Monitor would take a step
            # it never sees for a skipped one.
            self._scan_point()
        # Nothing of a finished step waits any longer (LBFGS runs its closure several times).
        self._inside.discard(key)
        self._closure_ran.discard(key)

    def _scan_point(self) -> None:
        if self.monitor is None or self.monitor.closed:
            return
        # With several optimizers, one Monitor step per batch, at the batch's first optimizer
        # step: a step per optimizer would see each optimizer's parameters left unchanged
        # across the other optimizers' steps and report them as not updated.
        if self._several and self._batch_scanned:
            return
        self._batch_scanned = True
        self.monitor.step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or self.monitor.closed:
            return
        # Batches that only accumulate gradients leave global_step where it was: no new step.
        # A batch may also pass several steps (manual optimization, several optimizers), so
        # a report is due when global_step has passed a multiple of the interval since the
        # last look, not only when it lands on one.
        step, before = trainer.global_step, self._checked_at
        self._checked_at = step
        interval = self.report_every if self.report_every is not None else trainer.log_every_n_steps
        if interval and step // interval > before // interval:
            self._report(trainer, pl_module, final=False)

    # on_train_end, not on_fit_end: the strategy's teardown runs in between and moves the
    # model and the optimizer state to the CPU; the final report should see them as
    # training left them.
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is None or self.monitor.closed:
            return
        if self._unreported() or trainer.global_step != self._reported_at:
            self._report(trainer, pl_module, final=True)
        elif trainer.is_global_zero:  # nothing new since the last report, made just now
            self.logger.info(
                "zeroscan: training ended at step %d; the last report, of that step, has %d findings",
                trainer.global_step, len(self.report.findings),
            )
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A failed fit() ends without on_train_end: the model and the optimizers must not
        # keep the hooks.
        self._stop()

    def _stop(self) -> None:
        """Removes every hook: the Monitor's and the callback's own on the optimizers."""
        for h in self._hooks:
            h.remove()
        self._hooks = ()
        if self.monitor is not None:
            self.monitor.close()

    # ---- reporting ------------------------------------------------------------------------

    def _report(self, trainer: Any, pl_module: Any, *, final: bool) -> None:
        """One report: its scalars to every logger of the Trainer (and the
        callback's sinks), what changed in its findings to Python logging,
        both at trainer.global_step."""
        # Logger.log_metrics directly, not LightningModule.log: self.log is not allowed in
        # on_train_end and would apply its own cadence (log_every_n_steps) on top of ours.
        self.take_report(
            trainer.global_step, main_process=trainer.is_global_zero, final=final,
            sinks=[LoggerSink(lg) for lg in pl_module.loggers],
        )


class LoggerSink:
    """A Lightning Logger (CSVLogger, TensorBoardLogger, WandbLogger, ...) as
    a zeroscan.loggers.Sink: log(scalars, step) is its log_metrics."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.logger.log_metrics(dict(scalars), step=step)
