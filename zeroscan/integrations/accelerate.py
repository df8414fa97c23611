"""zeroscan in a Hugging Face Accelerate training loop: monitor() builds the
Monitor, log() sends its report to the Accelerator's trackers and to Python
logging. The loop itself is unchanged; the Monitor is made after prepare()
and its report read on a step where the gradients synced:

    import zeroscan.integrations.accelerate

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    monitor = zeroscan.integrations.accelerate.monitor(accelerator, model, optimizer)
    completed_steps = 0
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            if completed_steps % 50 == 0:
                zeroscan.integrations.accelerate.log(accelerator, monitor.report(), step=completed_steps)

The Monitor watches the module that prepare() wrapped (accelerator.unwrap_model:
its forward hooks fire when a DDP or FSDP wrapper calls into it, and its
parameters keep their own names) and the torch optimizer inside the
AcceleratedOptimizer. That optimizer's step() runs only on the step that
syncs the gradients, and not at all when a GradScaler finds inf/NaN, so its
step pre-hook, where the Monitor scans, tells the steps apart: the
micro-steps of gradient accumulation leave the gradients to accumulate, and
a skipped step is one whose gradients are reset with no step.
Read monitor.report() where accelerator.sync_gradients: in the middle of an
accumulation, report() closes the backward passes so far as a step that no
optimizer step followed, and counts it as one.

The Monitor is this process's own: in a multi-process run each process
monitors its replica or shard, and log() writes from the main process only.

Steps: log() sends the scalars, and names in its log lines, the `step` it
is given: the loop's own count of optimizer steps (completed_steps above,
from 1, as the Trainer and Lightning count them), so that zeroscan's
values sit at the step of the loop's other logs. Without one it uses the
report's own step, the Monitor's 0-based index of the step it scanned (5
where completed_steps is 6).

Findings: log() sends each finding to Python logging when it first
appears in a report logged for that accelerator, when its severity
changes, and, in a short INFO line, when it clears; a finding that holds
for the whole run is logged once, not at every log() call
(common.LoggedFindings). It remembers this per Accelerator: one Monitor's
reports per Accelerator.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroscan.inputs import received
from zeroscan.integrations import common
from zeroscan.loggers import Sink, report_rows
from zeroscan.monitor import Monitor, Report

# Imported now, so that without Accelerate the import of this module fails
# with an error that names zeroscan's extra.
accelerate = common.require("accelerate", "accelerate", "zeroscan.integrations.accelerate")

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["log", "monitor"]

MONITOR = "zeroscan.integrations.accelerate.monitor"
LOG = "zeroscan.integrations.accelerate.log"

# What log() has sent to Python logging, per Accelerator (a run's), so that each finding
# is logged once; weakly held, so that a finished run's Accelerator is not kept alive.
_LOGGED: weakref.WeakKeyDictionary[Any, common.LoggedFindings] = weakref.WeakKeyDictionary()


def monitor(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    every: int = 1,
    **options: Any,
) -> Monitor:
    """A zeroscan.Monitor of `model` and `optimizer` as accelerator.prepare()
    returned them (or as they were before: both are unwrapped).

    every: scan one optimizer step in `every` (the micro-steps of gradient
        accumulation are not optimizer steps).
    options: history, activations, thresholds, histogram, trace_nonfinite,
        passed on to zeroscan.Monitor.

    With an optimizer the Monitor scans at each optimizer step by itself;
    without one, call monitor.step() once per optimizer step (where
    accelerator.sync_gradients, after clipping, before zero_grad).
    monitor.close() removes its hooks."""
    _check_accelerator(MONITOR, accelerator)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{MONITOR}: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{MONITOR}: optimizer must be a torch.optim.Optimizer (as accelerator.prepare returns it) or None, "
            f"got {type(optimizer).__name__}"
        )
    interval = common.check_interval(MONITOR, "every", every, none_ok=False)
    assert interval is not None  # none_ok=False
    checked = common.monitor_options(MONITOR, options)
    inner = None
    if optimizer is not None:
        inner = common.unwrap_optimizer(optimizer)
        if isinstance(inner, accelerate.optimizer.AcceleratedOptimizer):
            # What it wraps is no torch Optimizer (DeepSpeed's ZeRO optimizer), and the
            # wrapper itself cannot stand in: it never ran Optimizer.__init__ (no hooks),
            # and its step() is called at every micro-step of gradient accumulation.
            held = type(getattr(inner, "optimizer", None)).__name__
            raise TypeError(
                f"{MONITOR}: optimizer holds no torch.optim.Optimizer to hook "
                f"(the {type(inner).__name__}'s .optimizer is {held}); "
                "pass optimizer=None and call monitor.step() once per optimizer step"
            )
    return Monitor(accelerator.unwrap_model(model), inner, interval, **checked)


def log(
    accelerator: Accelerator,
    report: Report | Mapping[str, Any],
    *,
    step: int | None = None,
    per_tensor: bool = False,
    prefix: str = "zeroscan",
    logger: logging.Logger | None = None,
    sinks: Sequence[Sink] = (),
) -> dict[str, float]:
    """Sends one report where an Accelerate run looks, and returns the scalars sent.

    The scalars (zeroscan.loggers.scalars(report, summary=True): finding
    counts and the gradients' zero %, underflow % and non-finite count; with
    per_tensor=True also a norm, zero % and underflow % per gradient) go to
    the accelerator as a sink (accelerator.log), that is to every tracker given as
    Accelerator(log_with=...) once accelerator.init_trackers() has run (with
    none, nothing is sent), at `step`: pass the step the loop's other logs
    use (W&B drops a step lower than one already logged); by default the
    report's step (the Monitor's count of optimizer steps, from 0), so that
    a tracker never files every report under one step. On the main process,
    what changed in the findings since the last log() for this accelerator
    goes to Python logging (`logger`, default the "zeroscan" logger): each
    finding when it first appears or changes severity, at its severity, and
    a line when it clears; the lines name the same `step`. `sinks`: more
    sinks (zeroscan.loggers.Sink: objects with log(scalars, step)) that the
    scalars go to, on the main process, at the same step."""
    _check_accelerator(LOG, accelerator)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"{LOG}: step must be an int or None, got {received(step)}")
    if not isinstance(report, (Report, Mapping)):
        raise TypeError(f"{LOG}: report must be a zeroscan Report or its to_dict() dict, got {type(report).__name__}")
    checked_sinks = common.check_sinks(LOG, sinks)
    rows = report_rows(report)
    if step is None:
        step = rows.get("step")
    # accelerator.log reaches the trackers on the main process only; the findings and the
    # other sinks get the report there too, so that a multi-process run writes each once.
    main = accelerator.is_main_process
    return common.send_report(
        rows, step=step, sinks=[accelerator, *(checked_sinks if main else ())], prefix=prefix,
        per_tensor=per_tensor, findings=_LOGGED.setdefault(accelerator, common.LoggedFindings()) if main else None,
        logger=logger or logging.getLogger("zeroscan"),
    )


def _check_accelerator(user: str, accelerator: object) -> None:
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"{user}: accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
