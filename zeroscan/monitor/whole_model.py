"""The findings about the whole model at one step: every gradient exactly
zero, and a model that cuts the graph of its own input.

When every gradient is exactly zero, what the Monitor saw tells where the
zeros came from (the rows `before`: as backward() left the gradients), and
the step's context (context.py) tells what ran: how many in-place writes
each gradient took after backward() (clip_grad_value_ makes two,
clamp_min_ then clamp_max_; clip_grad_norm_, clip_grads_with_norm_,
mul_(0) and zero_() one each), and whether the model runs as a stage of a
torch.distributed.pipelining schedule, whose backward starts at the stage's
outputs with the gradient the next stage sent back (zeros, when the next
stage's input got none). What the Monitor cannot tell apart it lists, and
says it could not tell which.
"""

from __future__ import annotations

from zeroscan.monitor.context import StepContext
from zeroscan.monitor.report import GLOBAL_NAME, Finding
from zeroscan.monitor.series import COUNT_COLUMNS, Series
from zeroscan.verdicts import Cause, Severity

NOT_TOLD = "zeroscan could not tell which"
ONE_WRITE = (
    "clip_grad_norm_ (or clip_grads_with_norm_) with max_norm=0, clip_grad_value_ with clip_value=0 and "
    "foreach=False, or .grad.mul_(0) / .grad.zero_()"
)


def all_zero_finding(series: Series) -> Finding | None:
    """One model-wide finding when every gradient of the step is exactly zero."""
    rec = series.records[-1]
    if rec.rows is None:
        return None
    counts, present = rec.rows.gather(series.grad_rows, COUNT_COLUMNS)  # numel, zeros
    rows = series.grad_rows[present & (counts[:, 0] > 0)]
    counts = counts[present & (counts[:, 0] > 0)]
    if len(rows) < 2 or (counts[:, 1] != counts[:, 0]).any():
        return None
    before, had = rec.rows.gather(rows, COUNT_COLUMNS, before=True)
    context = rec.context if isinstance(rec.context, StepContext) else None
    writes = context.writes if context is not None else None  # every gradient here is zero: all of them
    if (had & (before[:, 1] != before[:, 0])).any():
        why = (
            "they were nonzero when backward() finished and were zeroed before the optimizer step: "
            + _zeroed_by(writes)
        )
    elif not had.any() and writes and 0 not in writes:
        why = (
            "zeroscan did not read them when backward() finished (across ranks it reads them at the step "
            "only), and they were changed in place since: either that change zeroed them ("
            + _zeroed_by(writes) + f"), or backward() itself produced zeros; {NOT_TOLD}"
        )
    else:
        why = _backward_zeros(context)
    return Finding(GLOBAL_NAME, "grad", Severity.WARNING, Cause.EXACT_ZERO, (
        f"every gradient of the model ({len(rows)} tensors) is exactly zero at step {rec.step}: {why}; "
        "nothing trains at this step"
    ))


def _zeroed_by(writes: frozenset[int] | None) -> str:
    """What zeroed gradients that backward() left nonzero, as far as their
    in-place writes since (StepContext.writes) tell."""
    if writes == {2}:
        return (
            "clip_grad_value_ with clip_value=0, which clamps every entry to 0 (each gradient was changed in "
            "place twice between backward() and step(), as clip_grad_value_'s clamp_min_ and clamp_max_ do)"
        )
    if writes == {1}:
        return f"each gradient was changed in place once between backward() and step(): {ONE_WRITE}; {NOT_TOLD}"
    return (
        "an in-place change of the gradients between backward() and step(): clip_grad_norm_ with max_norm=0, "
        f"clip_grad_value_ with clip_value=0, or .grad.mul_(0) / .grad.zero_(); {NOT_TOLD}"
    )


def _backward_zeros(context: StepContext | None) -> str:
    """Why backward() itself gave zeros, where the model's place in a pipeline tells."""
    stage = context.stage if context is not None else None
    if stage is not None and stage.index < stage.count - 1:
        after = stage.index + 1
        return (
            f"backward() itself produced zeros. The model runs as stage {stage.index} of {stage.count} of a "
            "torch.distributed.pipelining schedule, whose backward starts at this stage's outputs with the "
            f"gradient stage {after} sent back, and that gradient was zero: pipelining sends zeros when the "
            f"input of stage {after} got no gradient, because the input of stage {after} was detached (a "
            ".detach(), .data or torch.no_grad() at the pipeline stage boundary); use the input as received there"
        )
    return (
        "backward() itself produced zeros, so what backward started from does not depend on any parameter: "
        "a loss multiplied by 0, a loss scale of 0, a batch whose targets are all masked out, or a zero "
        "gradient given to backward at the model's outputs (as a pipeline stage gets from a next stage whose "
        f"input was detached); {NOT_TOLD}"
    )


def input_cut_finding(context: StepContext | None) -> Finding | None:
    """The model's forward cut the graph of its own input, which requires
    grad: nothing flows back to what made that input (a WARNING for a
    pipeline stage after the first, whose previous stage then gets zeros)."""
    if context is None or context.input_cut is None:
        return None
    how, where = context.input_cut
    at = f"in {where}" if where else "in the model's own forward"
    stage = context.stage
    if stage is not None and stage.index > 0:
        return Finding(GLOBAL_NAME, "grad", Severity.WARNING, Cause.DETACHED, (
            f"the input of this stage was detached ({how} {at}): the model runs as stage {stage.index} of "
            f"{stage.count} of a torch.distributed.pipelining schedule, its input requires grad so that its "
            f"gradient goes back to stage {stage.index - 1}, and the cut leaves it none, so pipelining sends "
            f"stage {stage.index - 1} zeros and it does not train; use the input as received"
        ))
    return Finding(GLOBAL_NAME, "grad", Severity.INFO, Cause.DETACHED, (
        f"the input of the model requires grad, but the model's forward detaches it ({how} {at}): no gradient "
        "flows back to what made the input (a pipeline stage boundary, or .detach()); if it should, use the "
        "input as received"
    ))
